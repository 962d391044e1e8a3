//! Multi-rail striping (docs/routes.md), over real TCP connections:
//!
//! * **loopback**: ranks in this process with rails on 127.0.0.2 and 127.0.0.3 besides the
//!   bootstrap connection on 127.0.0.1: the whole point-to-point suite over the bonded
//!   transport (both TCP backends), and large messages that every rail carries a share of.
//! * **two veth pairs**: two network namespaces (hosts) joined by two veth pairs (10.88.1.0/24
//!   and 10.88.2.0/24), each rank in its own namespace, both rails rate-limited by `tc tbf` so
//!   that a transfer lasts long enough; while rank 0 sends a 48 MiB message, the test takes the
//!   second rail's link down (`ip link set ... down`): the message arrives whole, the second rail
//!   is dropped, and the bootstrap rail carried the rest; then the same with the bootstrap rail's
//!   (rail 0's) link down: the second rail takes over its parts and every control frame (the
//!   message's, the barrier's and the goodbyes after it), and the job ends cleanly.
//!
//! The namespace test needs root (namespaces, tc): without it, it says so loudly and passes. Its
//! ranks are this test binary, re-run inside the namespaces with `--exact rails_rank_process`.

mod common;

#[path = "common/netns.rs"]
mod netns;
use netns::{is_root, sh};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::{RailList, RailSettings, Settings, TcpBackend, TransportChoice, testing};

fn loopback_rails(backend: TcpBackend) -> Settings {
    Settings::builder()
        .transports(TransportChoice::Tcp)
        .tcp_backend(backend)
        .rails(RailSettings {
            list: RailList::List(vec!["127.0.0.2".parse().unwrap(), "127.0.0.3".parse().unwrap()]),
            ..RailSettings::default()
        })
        .build()
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(u32::from(seed)) as u8 ^ (i >> 13) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_suite_over_loopback_rails() {
    for backend in [TcpBackend::Uring, TcpBackend::Portable] {
        for n in [2, 4] {
            testing::run(n, loopback_rails(backend), |w| async move {
                common::suite(&w).await;
                w.finalize().await.unwrap();
            })
            .await
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_are_striped_over_every_rail() {
    let stats = testing::run(2, loopback_rails(TcpBackend::Auto), |w| async move {
        let c = w.comm();
        let sizes = [1000, 200_000, 300_000, 8 * 1024 * 1024 + 3, 32 * 1024 * 1024];
        let peer = 1 - w.rank();
        for (i, &len) in sizes.iter().enumerate() {
            let tag = i as u64;
            if w.rank() == 0 {
                c.send(peer, tag, pattern(len, i as u8)).await.unwrap();
                let back = c.recv(peer, tag).await.unwrap();
                assert!(back.data == pattern(len, i as u8 ^ 0xff), "echo of {len} bytes differs");
            } else {
                let m = c.recv(peer, tag).await.unwrap();
                assert!(m.data == pattern(len, i as u8), "{len} bytes differ");
                c.send(peer, tag, pattern(len, i as u8 ^ 0xff)).await.unwrap();
            }
        }
        c.barrier().await.unwrap();
        let s = w.rail_stats(peer);
        w.finalize().await.unwrap();
        s
    })
    .await
    .unwrap();
    for (rank, s) in stats.iter().enumerate() {
        assert_eq!(s.len(), 3, "rank {rank}: {s:?}");
        for (rail, r) in s.iter().enumerate() {
            let r = r.unwrap_or_else(|| panic!("rank {rank}: rail {rail} does not reach the peer"));
            assert!(r.up, "rank {rank}: rail {rail} dropped: {s:?}");
            // Every rail carries parts of the large messages. How much follows each rail's
            // measured bandwidth, which on loopback with shared CPUs is noise; that shares track
            // bandwidth, and that a rail measured low once regains its share by re-probing, is
            // asserted on the striping core with modelled rails (ferrocomm-transports,
            // rails::stripe::tests), where time is not the machine's.
            assert!(r.carried > 0, "rank {rank}: rail {rail} carried nothing: {s:?}");
        }
    }
}

// ---- two namespaces, two veth pairs ----

const ROLE: &str = "FERROCOMM_RAILS_ROLE";
const BIG: usize = 48 << 20;

/// Two namespaces joined by two veth pairs; deleted when dropped.
struct TwoHosts {
    a: String,
    b: String,
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.a]);
        let _ = sh(&["ip", "netns", "del", &self.b]);
    }
}

impl TwoHosts {
    fn new(prefix: &str) -> Result<TwoHosts, String> {
        let (a, b) = (format!("{prefix}a"), format!("{prefix}b"));
        for n in [&a, &b] {
            let _ = sh(&["ip", "netns", "del", n]);
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        let hosts = TwoHosts { a, b };
        for rail in 1..=2 {
            let (ea, eb) = (format!("r{rail}a"), format!("r{rail}b"));
            sh(&["ip", "-n", &hosts.a, "link", "add", &ea, "type", "veth", "peer", "name", &eb, "netns", &hosts.b])?;
            sh(&["ip", "-n", &hosts.a, "addr", "add", &format!("10.88.{rail}.1/24"), "dev", &ea])?;
            sh(&["ip", "-n", &hosts.b, "addr", "add", &format!("10.88.{rail}.2/24"), "dev", &eb])?;
            sh(&["ip", "-n", &hosts.a, "link", "set", &ea, "up"])?;
            sh(&["ip", "-n", &hosts.b, "link", "set", &eb, "up"])?;
        }
        Ok(hosts)
    }

    /// Rate-limits both directions of rail `rail` to `rate` (a `tc` rate, e.g. `400mbit`).
    fn limit(&self, rail: u32, rate: &str) -> Result<(), String> {
        for (ns, dev) in [(&self.a, format!("r{rail}a")), (&self.b, format!("r{rail}b"))] {
            sh(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", &dev, "root", "tbf", "rate", rate, "burst",
                "256kb", "latency", "50ms",
            ])?;
        }
        Ok(())
    }
}

fn prerequisites(test: &str) -> bool {
    if !is_root() {
        eprintln!("\n!!!!!!!! SKIPPED {test}: network namespaces and tc need root; run the suite as root !!!!!!!!\n");
        return false;
    }
    for (tool, flag) in [("ip", "-V"), ("tc", "-V")] {
        let found = Command::new(tool).arg(flag).output().is_ok_and(|o| o.status.success());
        assert!(found, "{tool} is missing: scripts/test.sh installs it (apt-get install iproute2)");
    }
    true
}

/// Runs the two ranks of the link-cut test across `hosts`; `veth` (1: rail 0, the bootstrap
/// connection; 2: rail 1) goes down 300 ms into the 48 MiB message. The job's store is on the
/// other pair, so that only the rails see the cut. Returns rank 0's `RAIL-STATS` line.
fn cut_mid_message(hosts: &TwoHosts, veth: u32, port: u16) -> String {
    // 48 MiB over 2 x 200 Mbit/s: about a second, so the cut lands mid-message.
    hosts.limit(1, "200mbit").unwrap();
    hosts.limit(2, "200mbit").unwrap();
    let exe = std::env::current_exe().unwrap();
    let token: String = (0..32).map(|i| format!("{:02x}", (std::process::id() as u8).wrapping_add(i * 7))).collect();
    let store = 3 - veth;
    let mut children = Vec::new();
    for (rank, ns, host) in [(0, &hosts.a, 1), (1, &hosts.b, 2)] {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(&exe).args([
            "--exact",
            "rails_rank_process",
            "--nocapture",
            "--test-threads=1",
        ]);
        c.env(ROLE, "cut")
            .env("FERROCOMM_RANK", rank.to_string())
            .env("FERROCOMM_SIZE", "2")
            .env("FERROCOMM_COORD", format!("10.88.{store}.1:{port}"))
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_HOST_STORE", if rank == 0 { "1" } else { "0" })
            .env("FERROCOMM_BIND", format!("10.88.1.{host}"))
            .env("FERROCOMM_RAILS", format!("10.88.1.{host},10.88.2.{host}"))
            .env("FERROCOMM_RAIL_STALL_MS", "500")
            .env("FERROCOMM_TRANSPORTS", "tcp")
            .env_remove("FERROCOMM_LAUNCHER");
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        children.push(c.spawn().unwrap());
    }
    // Rank 0 says when the big message starts; the link goes down a moment later.
    let out0 = children[0].stdout.take().unwrap();
    let ns_a = hosts.a.clone();
    let dev = format!("r{veth}a");
    let reader = std::thread::spawn(move || {
        let (mut text, mut cut) = (String::new(), false);
        for line in BufReader::new(out0).lines().map_while(Result::ok) {
            if line.contains("BIG-START") && !cut {
                std::thread::sleep(Duration::from_millis(300));
                sh(&["ip", "-n", &ns_a, "link", "set", &dev, "down"]).unwrap();
                cut = true;
            }
            text.push_str(&line);
            text.push('\n');
        }
        (text, cut)
    });
    let start = Instant::now();
    let mut outputs = Vec::new();
    for mut child in children {
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        outputs.push((out.status, text));
    }
    for (rank, (status, text)) in outputs.iter().enumerate() {
        assert!(status.success(), "rank {rank} failed ({status:?}):\n{text}\nother rank:\n{}", outputs[1 - rank].1);
    }
    let outputs: Vec<String> = outputs.into_iter().map(|(_, t)| t).collect();
    let (text0, cut) = reader.join().unwrap();
    let text0 = text0 + &outputs[0];
    assert!(cut, "the link was never cut:\n{text0}");
    assert!(outputs[1].contains("RAILS-OK"), "rank 1:\n{}", outputs[1]);
    let stats = text0.lines().find(|l| l.starts_with("RAIL-STATS")).unwrap_or_else(|| panic!("no stats:\n{text0}"));
    println!("{stats}");
    stats.to_string()
}

/// The value of `key` (`up0=`, `carried1=`...) in a `RAIL-STATS` line.
fn stat(stats: &str, key: &str) -> String {
    stats.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in {stats}")).into()
}

#[test]
fn two_veth_rails_survive_a_link_cut_mid_message() {
    if !prerequisites("two_veth_rails_survive_a_link_cut_mid_message") {
        return;
    }
    let prefix = format!("fcr{}", std::process::id() % 100_000);
    let hosts = TwoHosts::new(&prefix).unwrap();
    let stats = cut_mid_message(&hosts, 2, 29611);
    // Rail 0 carried and is up; rail 1 (the second veth pair) carried part and is down.
    assert_eq!(stat(&stats, "up0="), "true", "{stats}");
    assert_eq!(stat(&stats, "up1="), "false", "{stats}");
    let carried1: u64 = stat(&stats, "carried1=").parse().unwrap();
    assert!(carried1 > 0 && carried1 < BIG as u64, "{stats}");
}

#[test]
fn two_veth_rails_survive_cutting_rail_zero_mid_message() {
    if !prerequisites("two_veth_rails_survive_cutting_rail_zero_mid_message") {
        return;
    }
    let prefix = format!("fcz{}", std::process::id() % 100_000);
    let hosts = TwoHosts::new(&prefix).unwrap();
    let stats = cut_mid_message(&hosts, 1, 29612);
    // Rail 0 (the bootstrap connection, first veth pair) carried part and is down; rail 1 took
    // over its share and the control frames: the message, the barrier after it and the goodbye.
    assert_eq!(stat(&stats, "up0="), "false", "{stats}");
    assert_eq!(stat(&stats, "up1="), "true", "{stats}");
    assert_eq!(stat(&stats, "control1="), "true", "{stats}");
    let carried0: u64 = stat(&stats, "carried0=").parse().unwrap();
    assert!(carried0 > 0 && carried0 < BIG as u64, "{stats}");
}

// ---- three namespaces: A and C joined only through B ----

/// Hosts A (10.90.1.1), B (10.90.1.2 and 10.90.2.2) and C (10.90.2.3): A and C each have a veth
/// pair to B and a route to the other's network through B, which does not forward.
struct ThreeHosts {
    names: [String; 3],
}

impl Drop for ThreeHosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = sh(&["ip", "netns", "del", n]);
        }
    }
}

impl ThreeHosts {
    fn new(prefix: &str) -> Result<ThreeHosts, String> {
        let names = [format!("{prefix}A"), format!("{prefix}B"), format!("{prefix}C")];
        for n in &names {
            let _ = sh(&["ip", "netns", "del", n]);
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        let hosts = ThreeHosts { names };
        let [a, b, c] = &hosts.names;
        sh(&["ip", "-n", a, "link", "add", "ab", "type", "veth", "peer", "name", "ba", "netns", b])?;
        sh(&["ip", "-n", c, "link", "add", "cb", "type", "veth", "peer", "name", "bc", "netns", b])?;
        for (ns, dev, addr) in
            [(a, "ab", "10.90.1.1/24"), (b, "ba", "10.90.1.2/24"), (b, "bc", "10.90.2.2/24"), (c, "cb", "10.90.2.3/24")]
        {
            sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev])?;
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        }
        sh(&["ip", "-n", a, "route", "add", "10.90.2.0/24", "via", "10.90.1.2"])?;
        sh(&["ip", "-n", c, "route", "add", "10.90.1.0/24", "via", "10.90.2.2"])?;
        sh(&["ip", "netns", "exec", b, "sysctl", "-qw", "net.ipv4.ip_forward=0"])?;
        Ok(hosts)
    }

    /// Adds a direct veth pair A - C (10.90.3.0/24) limited to `rate`; B reaches A's end of it
    /// through A.
    fn direct_link(&self, rate: &str) -> Result<(), String> {
        let [a, b, c] = &self.names;
        sh(&["ip", "-n", a, "link", "add", "ac", "type", "veth", "peer", "name", "ca", "netns", c])?;
        for (ns, dev, addr) in [(a, "ac", "10.90.3.1/24"), (c, "ca", "10.90.3.3/24")] {
            sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev])?;
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            sh(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                "64kb", "latency", "50ms",
            ])?;
        }
        sh(&["ip", "-n", b, "route", "add", "10.90.3.1/32", "via", "10.90.1.1"])
    }

    fn tx_bytes(&self, host: usize, dev: &str) -> u64 {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.names[host], "cat", &format!("/sys/class/net/{dev}/statistics/tx_bytes")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// Runs ranks 0 (on B, 0.0.0.0), 1 (on A, `bind1`), 2 (on C) in role `role`; returns their
    /// outputs.
    fn run(&self, role: &str, bind1: &str, port: u16, env: &[(&str, String)]) -> Vec<String> {
        let exe = std::env::current_exe().unwrap();
        let token: String = (0..32).map(|i| format!("{:02x}", (port as u8).wrapping_add(i * 5))).collect();
        let mut children = Vec::new();
        for (rank, host, bind) in [(0, 1, "0.0.0.0"), (1, 0, bind1), (2, 2, "10.90.2.3")] {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.names[host]]).arg(&exe);
            c.args(["--exact", "rails_rank_process", "--nocapture", "--test-threads=1"]);
            c.env(ROLE, role)
                .env("FERROCOMM_RANK", rank.to_string())
                .env("FERROCOMM_SIZE", "3")
                .env("FERROCOMM_COORD", format!("10.90.1.2:{port}"))
                .env("FERROCOMM_TOKEN", &token)
                .env("FERROCOMM_HOST_STORE", if rank == 0 { "1" } else { "0" })
                .env("FERROCOMM_BIND", bind)
                .env("FERROCOMM_PROXY", "on")
                .env("FERROCOMM_DIRECT_TIMEOUT_MS", "1000")
                .env("FERROCOMM_TRANSPORTS", "tcp")
                .env_remove("FERROCOMM_LAUNCHER");
            for (k, v) in env {
                c.env(k, v);
            }
            c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            children.push(c.spawn().unwrap());
        }
        let start = Instant::now();
        let mut outputs = Vec::new();
        let mut failed = false;
        for mut child in children {
            while child.try_wait().unwrap().is_none() {
                if start.elapsed() > Duration::from_secs(180) {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            failed |= !out.status.success();
            outputs.push((out.status, text));
        }
        // Every rank's output on a failure: the first to fail may only report another's loss.
        if failed {
            let all: Vec<String> = outputs
                .iter()
                .enumerate()
                .map(|(rank, (status, text))| format!("rank {rank} ({status:?}):\n{text}"))
                .collect();
            panic!("{role}: a rank failed\n{}", all.join("\n"));
        }
        outputs.into_iter().map(|(_, text)| text).collect()
    }
}

#[test]
fn a_slow_direct_link_loses_large_messages_to_the_proxy_path() {
    if !prerequisites("a_slow_direct_link_loses_large_messages_to_the_proxy_path") {
        return;
    }
    let prefix = format!("fcs{}", std::process::id() % 100_000);
    let hosts = ThreeHosts::new(&prefix).unwrap();
    hosts.direct_link("20mbit").unwrap();
    // The calibration: fast hops through B, a slow direct link (as a measurement would say).
    let costs = std::env::temp_dir().join(format!("{prefix}-costs.txt"));
    std::fs::write(&costs, "# from to latency_us MBps\n0 1 60 1000\n0 2 60 1000\n1 2 60 2.5\n").unwrap();
    let before = (hosts.tx_bytes(0, "ac"), hosts.tx_bytes(0, "ab"));
    let out = hosts.run("split", "10.90.3.1", 29613, &[("FERROCOMM_ROUTE_COSTS", costs.display().to_string())]);
    let _ = std::fs::remove_file(&costs);
    for (rank, text) in out.iter().enumerate() {
        assert!(text.contains("SPLIT-OK"), "rank {rank}:\n{text}");
    }
    assert!(out[1].contains("routes Direct Via(0)"), "{}", out[1]);
    // The 8 MiB crossed A - B, not the direct link (which carried the small messages and the
    // rendezvous handshakes).
    let (ac, ab) = (hosts.tx_bytes(0, "ac") - before.0, hosts.tx_bytes(0, "ab") - before.1);
    println!("A sent {ac} bytes on the direct link, {ab} toward the proxy");
    assert!(ab > 8 << 20, "{ab} bytes toward the proxy");
    assert!(ac < 2 << 20, "{ac} bytes on the slow direct link");
}

#[test]
fn the_start_up_probe_sends_large_messages_around_a_slow_direct_link() {
    if !prerequisites("the_start_up_probe_sends_large_messages_around_a_slow_direct_link") {
        return;
    }
    let prefix = format!("fcq{}", std::process::id() % 100_000);
    let hosts = ThreeHosts::new(&prefix).unwrap();
    hosts.direct_link("20mbit").unwrap();
    // No calibration file: the probe measures the hops (256 KiB bursts; the slow link's takes
    // about 0.1 s).
    let before = (hosts.tx_bytes(0, "ac"), hosts.tx_bytes(0, "ab"));
    let out = hosts.run("split", "10.90.3.1", 29614, &[("FERROCOMM_ROUTE_PROBE_BYTES", (256 << 10).to_string())]);
    for (rank, text) in out.iter().enumerate() {
        assert!(text.contains("SPLIT-OK"), "rank {rank}:\n{text}");
    }
    assert!(out[1].contains("routes Direct Via(0)"), "{}", out[1]);
    let (ac, ab) = (hosts.tx_bytes(0, "ac") - before.0, hosts.tx_bytes(0, "ab") - before.1);
    println!("A sent {ac} bytes on the direct link, {ab} toward the proxy");
    assert!(ab > 16 << 20, "{ab} bytes toward the proxy");
    // The probe's burst, the small messages and the handshakes.
    assert!(ac < 2 << 20, "{ac} bytes on the slow direct link");
}

#[test]
fn a_peer_without_a_direct_path_is_reached_through_a_proxy() {
    if !prerequisites("a_peer_without_a_direct_path_is_reached_through_a_proxy") {
        return;
    }
    let prefix = format!("fcp{}", std::process::id() % 100_000);
    let hosts = ThreeHosts::new(&prefix).unwrap();
    let out = hosts.run("proxy", "10.90.1.1", 29612, &[]);
    for (rank, text) in out.iter().enumerate() {
        assert!(text.contains("PROXY-OK"), "rank {rank}:\n{text}");
        if rank > 0 {
            assert!(text.contains(&format!("peer {} via tcp-proxy", 3 - rank)), "rank {rank}:\n{text}");
        }
    }
}

/// One rank of a namespace test.
#[test]
fn rails_rank_process() {
    let Ok(role) = std::env::var(ROLE) else { return };
    // Warnings (a peer disconnected for breaking a protocol, and why) on stderr, as under ferrorun.
    ferrocomm::observe::log::install();
    if role == "proxy" {
        return proxy_rank();
    }
    if role == "split" {
        return split_rank();
    }
    assert_eq!(role, "cut");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let w = ferrocomm::init().await.unwrap();
        let c = w.comm();
        let peer = 1 - w.rank();
        // Made before the barrier: in a debug build that takes seconds.
        let data = pattern(BIG, 3);
        c.barrier().await.unwrap();
        if w.rank() == 0 {
            println!("BIG-START");
            c.send(peer, 7, data).await.unwrap();
        } else {
            let m = c.recv(peer, 7).await.unwrap();
            assert!(m.data == data, "the message arrived altered");
            println!("RAILS-OK {} bytes", m.data.len());
        }
        c.barrier().await.unwrap();
        let s = w.rail_stats(peer);
        let mut line = String::from("RAIL-STATS");
        for (i, r) in s.iter().enumerate() {
            if let Some(r) = r {
                line += &format!(
                    " up{i}={} carried{i}={} bw{i}={:.0} control{i}={}",
                    r.up, r.carried, r.bandwidth, r.control
                );
            }
        }
        println!("{line}");
        w.finalize().await.unwrap();
    });
}

/// A rank of the proxy test: the point-to-point suite over all three, then large messages each
/// way between the two ends, which only the proxy connects.
fn proxy_rank() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let w = ferrocomm::init().await.unwrap();
        let me = w.rank();
        for p in (0..3).filter(|&p| p != me) {
            println!("peer {p} via {}", w.transport_for(p));
        }
        common::suite(&w).await;
        let c = w.comm();
        if me > 0 {
            let peer = 3 - me;
            for (i, len) in [10, 70_000, 1 << 20, (8 << 20) + 5].into_iter().enumerate() {
                let (mine, theirs) = (pattern(len, me as u8 + i as u8), pattern(len, peer as u8 + i as u8));
                let (sent, got) = futures::join!(c.send(peer, i as u64, mine), c.recv(peer, i as u64));
                sent.unwrap();
                assert!(got.unwrap().data == theirs, "{len} bytes from rank {peer} differ");
            }
        }
        let mut v = [u64::from(me) + 1];
        c.allreduce(&mut v, ferrocomm::ReduceOp::Sum).await.unwrap();
        assert_eq!(v, [6]);
        c.barrier().await.unwrap();
        println!("PROXY-OK rank {me}");
        w.finalize().await.unwrap();
    });
}

/// A rank of the slow-direct-link test: rank 1 sends rank 2 small messages (direct) and 8 MiB
/// (through rank 0), interleaved, and the order and content hold.
fn split_rank() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let w = ferrocomm::init().await.unwrap();
        let c = w.comm();
        let me = w.rank();
        let sizes = [100, 8 << 20, 1000, 8 << 20, 5];
        c.barrier().await.unwrap();
        if me == 1 {
            println!("routes {:?} {:?}", w.route_for(2, 1000), w.route_for(2, 8 << 20));
            for (i, &len) in sizes.iter().enumerate() {
                c.send(2, 0, pattern(len, i as u8)).await.unwrap();
            }
        } else if me == 2 {
            for (i, &len) in sizes.iter().enumerate() {
                let m = c.recv(1, 0).await.unwrap();
                assert!(m.data == pattern(len, i as u8), "message {i} ({len} bytes) differs or is out of order");
            }
        }
        c.barrier().await.unwrap();
        println!("SPLIT-OK rank {me}");
        w.finalize().await.unwrap();
    });
}
