//! Reliable multicast between processes over real networks, with loss injected by iptables:
//!
//! * **bridge**: 9 ranks (root + 8 receivers), each in its own network namespace (`ip netns add`),
//!   joined by veth pairs to a Linux bridge in a hub namespace (10.77.0.0/24);
//! * **loopback**: the same 9 ranks in one namespace, on its loopback interface.
//!
//! Each receiver's namespace drops incoming UDP at random (`iptables -A INPUT -p udp -m statistic
//! --mode random --probability P -j DROP`) at P = 0, 5% and 20%; point-to-point (TCP) is untouched.
//! Ranks 0 and 5 each multicast 300 messages of 0 to 20 kB (up to 15 datagrams each): every
//! other rank must get every message exactly once and in order.
//!
//! Needs root (namespaces, iptables): without it the tests say so loudly and pass. iptables must be
//! installed (scripts/test.sh installs it). The namespaces are named after the test's process id
//! and removed afterwards, even on failure.
//!
//! The ranks are this test binary, re-run inside the namespaces with `--exact mcast_rank_process`
//! and the job in `FERROCOMM_*` variables; without `FERROCOMM_MCAST_SCENARIO` that test does nothing.

#[path = "common/netns.rs"]
mod netns;
use netns::{is_root, sh};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::multicast::Channel;
use ferrocomm::{Deadline, Error};

const SCENARIO: &str = "FERROCOMM_MCAST_SCENARIO";
const RANKS: u32 = 9;
const MESSAGES: usize = 300;
const ROOTS: [u32; 2] = [0, 5];

fn payload(root: u32, i: usize) -> Bytes {
    let len = (i * 7919 + root as usize * 131) % 20_000;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(2_654_435_761) ^ root) as u8).collect::<Vec<u8>>().into()
}

/// Network namespaces that are deleted when dropped.
struct Netns {
    names: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in self.names.iter().rev() {
            let _ = sh(&["ip", "netns", "del", n]);
        }
    }
}

impl Netns {
    fn add(&mut self, name: String) -> Result<String, String> {
        let _ = sh(&["ip", "netns", "del", &name]);
        sh(&["ip", "netns", "add", &name])?;
        self.names.push(name.clone());
        sh(&["ip", "-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// One namespace per rank on a bridge; returns (namespace, address) per rank.
    fn bridge(prefix: &str, n: u32) -> Result<(Netns, Vec<(String, String)>), String> {
        let mut ns = Netns { names: Vec::new() };
        let hub = ns.add(format!("{prefix}h"))?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        let mut ranks = Vec::new();
        for r in 0..n {
            let name = ns.add(format!("{prefix}r{r}"))?;
            let port = format!("v{r}");
            sh(&["ip", "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &name])?;
            sh(&["ip", "-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            let addr = format!("10.77.0.{}", r + 1);
            sh(&["ip", "-n", &name, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            sh(&["ip", "-n", &name, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &name, "route", "add", "224.0.0.0/4", "dev", "eth0"])?;
            ranks.push((name, addr));
        }
        Ok((ns, ranks))
    }

    /// Every rank in one namespace, on its loopback interface.
    fn loopback(prefix: &str, n: u32) -> Result<(Netns, Vec<(String, String)>), String> {
        let mut ns = Netns { names: Vec::new() };
        let name = ns.add(format!("{prefix}lo"))?;
        sh(&["ip", "-n", &name, "link", "set", "lo", "multicast", "on"])?;
        sh(&["ip", "-n", &name, "route", "add", "224.0.0.0/4", "dev", "lo"])?;
        Ok((ns, (0..n).map(|_| (name.clone(), "127.0.0.1".to_string())).collect()))
    }
}

/// Runs the scenario on `ranks` (namespace, address), rank 0's namespace hosting the store, with
/// `loss` dropped on every receiver's namespace. Returns each rank's output.
fn run(ranks: &[(String, String)], loss: f64, extra_env: &[(&str, &str)]) -> Vec<String> {
    let mut lossy: Vec<&String> = ranks.iter().skip(1).map(|(n, _)| n).collect();
    lossy.dedup();
    for ns in &lossy {
        let _ = sh(&["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"]);
        if loss > 0.0 {
            let p = format!("{loss}");
            sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "iptables",
                "-A",
                "INPUT",
                "-p",
                "udp",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ])
            .unwrap();
        }
    }
    let exe = std::env::current_exe().unwrap();
    let token: String =
        (0..32).map(|i| format!("{:02x}", (std::process::id() as u8).wrapping_mul(31).wrapping_add(i))).collect();
    let coord = format!("{}:29517", ranks[0].1);
    let mut children = Vec::new();
    for (r, (ns, addr)) in ranks.iter().enumerate() {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(&exe).args([
            "--exact",
            "mcast_rank_process",
            "--nocapture",
            "--test-threads=1",
        ]);
        c.env(SCENARIO, "stream")
            .env("FERROCOMM_RANK", r.to_string())
            .env("FERROCOMM_SIZE", ranks.len().to_string())
            .env("FERROCOMM_COORD", &coord)
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_HOST_STORE", if r == 0 { "1" } else { "0" })
            .env("FERROCOMM_BIND", addr)
            .env("FERROCOMM_TRANSPORTS", "tcp")
            .env("FERROCOMM_PROGRESS", "blocking")
            .env_remove("FERROCOMM_LAUNCHER");
        for (k, v) in extra_env {
            c.env(k, v);
        }
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        children.push(c.spawn().unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut outputs = Vec::new();
    for (r, mut child) in children.into_iter().enumerate() {
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "rank {r} failed ({:?}) at loss {loss}:\n{text}", out.status);
        outputs.push(text);
    }
    outputs
}

fn field(text: &str, key: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(&format!("{key}="))))
        .next_back()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in:\n{text}"))
}

fn check(outputs: &[String], what: &str, loss: f64) {
    for (r, text) in outputs.iter().enumerate() {
        assert!(text.contains("MCAST-OK"), "{what}, loss {loss}, rank {r}:\n{text}");
        assert_eq!(field(text, "confirmed"), 1, "{what}: rank {r}'s group was not confirmed:\n{text}");
    }
    let sum = |k: &str| outputs.iter().map(|t| field(t, k)).sum::<u64>();
    println!(
        "{what}, loss {:>4.0}%: {} ranks, {} messages from each of {:?} exactly once in order at every rank; \
         datagrams {}, NACKs {}, retransmissions {} (false {}), ACKs at roots {} / co-roots {}, window stalls {}",
        loss * 100.0,
        outputs.len(),
        MESSAGES,
        ROOTS,
        sum("datagrams"),
        sum("nacks"),
        sum("retx"),
        sum("false_retx"),
        sum("acks_root"),
        sum("acks_coroot"),
        sum("stalls"),
    );
    if loss > 0.0 {
        assert!(sum("retx") > 0, "{what}: loss {loss} needed retransmissions");
    }
}

fn prerequisites(test: &str) -> bool {
    if !is_root() {
        eprintln!(
            "\n!!!!!!!! SKIPPED {test}: network namespaces and iptables need root; run the suite as root !!!!!!!!\n"
        );
        return false;
    }
    for (tool, flag) in [("ip", "-V"), ("iptables", "--version")] {
        let found = Command::new(tool).arg(flag).output().is_ok_and(|o| o.status.success());
        assert!(found, "{tool} is missing: scripts/test.sh installs it (apt-get install iptables iproute2)");
    }
    true
}

#[test]
fn bridge_of_namespaces_with_iptables_loss() {
    if !prerequisites("bridge_of_namespaces_with_iptables_loss") {
        return;
    }
    let prefix = format!("fcm{}", std::process::id() % 100_000);
    let (_ns, ranks) = Netns::bridge(&prefix, RANKS).unwrap();
    for loss in [0.0, 0.05, 0.2] {
        let out = run(&ranks, loss, &[]);
        check(&out, "bridge", loss);
    }
}

#[test]
fn loopback_namespace_with_iptables_loss() {
    if !prerequisites("loopback_namespace_with_iptables_loss") {
        return;
    }
    let prefix = format!("fcl{}", std::process::id() % 100_000);
    let (_ns, ranks) = Netns::loopback(&prefix, RANKS).unwrap();
    for loss in [0.0, 0.05, 0.2] {
        let out = run(&ranks, loss, &[("FERROCOMM_MCAST_DATAGRAM", "8000")]);
        check(&out, "loopback", loss);
    }
}

/// Broadcast by the communicator's own selection: the ranks of the bridge, each namespace posing
/// as a host of its own (`FERROCOMM_HOST_ID`), choose reliable multicast for broadcasts of 0 B to
/// the table's 128 KiB (more ranks than the table's crossover, several hosts; 1400-byte datagrams,
/// so the larger ones take several) and point-to-point above it; every rank gets every broadcast
/// intact, at 0% and 20% loss; at 0% each rank's namespace took in at least half as many UDP
/// datagrams as the broadcasts from other roots need (so they came by multicast, not TCP).
#[test]
fn broadcast_selected_as_multicast_across_namespace_hosts() {
    if !prerequisites("broadcast_selected_as_multicast_across_namespace_hosts") {
        return;
    }
    let prefix = format!("fcs{}", std::process::id() % 100_000);
    let (_ns, ranks) = Netns::bridge(&prefix, RANKS).unwrap();
    for loss in [0.0, 0.2] {
        let out = run(&ranks, loss, &[(SCENARIO, "selected"), ("FERROCOMM_MCAST_DATAGRAM", "1400")]);
        for (r, text) in out.iter().enumerate() {
            assert!(text.contains("SELECTED-OK"), "loss {loss}, rank {r}:\n{text}");
            if loss == 0.0 {
                // Messages sent before a root's group test confirms go over TCP (the channel is
                // made by the first broadcast), so not every datagram is counted; over TCP alone
                // the namespace would see only the group tests' pings.
                let (got, need) = (field(text, "udp_in"), field(text, "datagrams_needed"));
                assert!(got >= need / 2, "rank {r} took in {got} UDP datagrams, the broadcasts need {need}:\n{text}");
            }
        }
        println!("broadcast selected as multicast, loss {:.0}%: {} ranks, every broadcast intact", loss * 100.0, RANKS);
    }
}

/// UDP datagrams this network namespace took in (`InDatagrams` of /proc/net/snmp).
fn udp_in() -> u64 {
    let snmp = std::fs::read_to_string("/proc/net/snmp").unwrap();
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next().unwrap(), udp.next().unwrap());
    let i = names.split_whitespace().position(|n| n == "InDatagrams").unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// The "selected" scenario: broadcasts through `Comm::broadcast`, whose selection must be
/// reliable multicast.
async fn selected(w: &ferrocomm::World) {
    let t = Duration::from_secs(90);
    let me = w.rank();
    let datagram = w.settings().multicast.datagram - ferrocomm::transports::auth::TAG_LEN;
    let payload_per = datagram - ferrocomm_multicast::wire::HEADER;
    let before = udp_in();
    let mut needed = 0u64;
    let max = ferrocomm::Table::default().multicast_bcast_max;
    for (root, len) in [(0u32, 8usize), (5, 1000), (0, max), (5, max + 1), (0, 1 << 20), (3, 0)] {
        let multicast = len <= max;
        assert_eq!(
            w.collective_algorithm(ferrocomm::Operation::Bcast, len) == ferrocomm::Algorithm::Multicast,
            multicast,
            "rank {me}: broadcast of {len} B"
        );
        let want: Vec<u8> = payload(root, len % 9973).iter().copied().cycle().take(len).collect();
        let mut buf = if me == root { want.clone() } else { vec![0u8; len] };
        w.broadcast(root, &mut buf).timeout(t).await.unwrap();
        assert!(buf == want, "rank {me}: broadcast of {len} B from {root} altered");
        // Counted up to 8 KiB only: a root's first messages go over TCP until its group test
        // confirms, and a large broadcast right after a small one may be among them.
        if me != root && multicast && len <= 8192 {
            needed += len.div_ceil(payload_per).max(1) as u64;
        }
    }
    w.barrier().timeout(t).await.unwrap();
    println!("SELECTED-OK rank={me} udp_in={} datagrams_needed={needed}", udp_in() - before);
}

/// One rank of the scenario, when run inside a namespace by the tests above.
#[test]
fn mcast_rank_process() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    if scenario == "selected" {
        let rank = std::env::var("FERROCOMM_RANK").unwrap();
        // SAFETY: no other thread of this process runs yet (the runtime is made below).
        unsafe { std::env::set_var("FERROCOMM_HOST_ID", format!("selected-host-{rank}")) };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let w = ferrocomm::init().await.unwrap();
            selected(&w).await;
            w.finalize().await.unwrap();
        });
        return;
    }
    assert_eq!(scenario, "stream");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let t = Duration::from_secs(90);
        let w = ferrocomm::init().await.unwrap();
        let me = w.rank();
        let chan = Channel::new(w.comm()).await.unwrap();
        let confirmed = chan.wait_group(Duration::from_secs(20)).await;
        w.barrier().timeout(t).await.unwrap();
        let sending = async {
            if ROOTS.contains(&me) {
                for i in 0..MESSAGES {
                    chan.send(payload(me, i)).timeout(t).await.unwrap();
                }
            }
        };
        let receiving = async {
            for root in ROOTS.into_iter().filter(|&r| r != me) {
                for i in 0..MESSAGES {
                    let m = chan.recv(root).timeout(t).await.unwrap();
                    assert!(m == payload(root, i), "rank {me}: message {i} of root {root} altered or out of order");
                }
            }
        };
        futures::join!(sending, receiving);
        chan.flush().timeout(t).await.unwrap();
        w.barrier().timeout(t).await.unwrap();
        // Exactly once: nothing more is left in any stream.
        for root in ROOTS.into_iter().filter(|&r| r != me) {
            let extra = chan.recv(root).timeout(Duration::from_millis(100)).await;
            assert!(matches!(extra, Err(Error::Timeout)), "rank {me}: extra message from {root}: {extra:?}");
        }
        let s = chan.stats();
        println!(
            "MCAST-OK rank={me} confirmed={} datagrams={} nacks={} retx={} false_retx={} acks_root={} acks_coroot={} stalls={}",
            u8::from(confirmed),
            s.datagrams_sent,
            s.nacks_sent,
            s.retransmissions,
            s.false_retransmissions,
            s.acks_at_root,
            s.acks_at_coroot,
            s.window_stalls
        );
        w.barrier().timeout(t).await.unwrap();
        drop(chan);
        w.finalize().await.unwrap();
    });
}
