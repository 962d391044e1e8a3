//! The reference for `pingpong --transport verbs`: perftest's `ib_send_lat` and `ib_write_bw`
//! on the same RDMA device and GID index, server and client on this host (the Soft-RoCE VM of
//! scripts/verbs-vm.sh), and ferrocomm's own streaming bandwidth, the like-for-like counterpart
//! of `ib_write_bw`.
//!
//! `ib_send_lat` is perftest's ping-pong of sends with busy polling; its median `t_typical` and
//! mean `t_avg` one-way times are compared with ferrocomm's median and mean at the same size.
//! `ib_write_bw` streams RDMA writes (up to 128 outstanding, the receiving process idle), so a
//! ping-pong (one message in flight, both sides working on every message) is not its
//! counterpart: [`stream_bw`] measures ferrocomm the `osu_bw` way, a window of [`WINDOW`] sends
//! outstanding, the receiver's receives posted ahead, one acknowledgement per window. Both
//! figures are reported.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use crate::{Result, process, ranks};

/// Iterations of `ib_send_lat` and of `ib_write_bw`.
const LAT_ITERS: u32 = 2000;
const BW_ITERS: u32 = 200;
/// How long one perftest pair may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the client keeps trying to reach a server that is still starting.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) const INSTALL_HINT: &str =
    "ib_send_lat / ib_write_bw not in PATH: install them with `apt-get install perftest` (or pass --no-peer)";

/// The perftest executables and the device to use.
pub(crate) struct Perftest {
    send_lat: PathBuf,
    write_bw: PathBuf,
    pub device: String,
    pub gid_index: u32,
}

/// The first RDMA device of this host, from sysfs.
pub(crate) fn first_device() -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    names.sort();
    names.into_iter().next()
}

/// The GID index ferrocomm's verbs transport picks by default (first RoCE v2 entry with an IPv4
/// address, else first RoCE v2, else 0), read from sysfs so both sides use the same one.
pub(crate) fn default_gid_index(device: &str) -> u32 {
    let port = format!("/sys/class/infiniband/{device}/ports/1");
    let read =
        |what: &str, i: u32| std::fs::read_to_string(format!("{port}/{what}/{i}")).ok().map(|s| s.trim().to_string());
    let entries: Vec<(u32, String, String)> = (0..16)
        .filter_map(|i| Some((i, read("gids", i)?, read("gid_attrs/types", i)?)))
        .filter(|(_, gid, _)| gid.chars().any(|c| c != '0' && c != ':'))
        .collect();
    let v2 = |t: &str| t.contains("v2");
    entries
        .iter()
        .find(|(_, g, t)| v2(t) && g.starts_with("0000:0000:0000:0000:0000:ffff"))
        .or_else(|| entries.iter().find(|(_, _, t)| v2(t)))
        .map(|e| e.0)
        .unwrap_or(0)
}

impl Perftest {
    pub(crate) fn find(device: &str, gid_index: u32) -> Result<Perftest> {
        let send_lat = process::find_in_path("ib_send_lat").ok_or(INSTALL_HINT)?;
        let write_bw = process::find_in_path("ib_write_bw").ok_or(INSTALL_HINT)?;
        Ok(Perftest { send_lat, write_bw, device: device.to_string(), gid_index })
    }

    fn args(&self, bytes: usize, iters: u32) -> Vec<String> {
        [
            "-d",
            &self.device,
            "-x",
            &self.gid_index.to_string(),
            "-s",
            &bytes.to_string(),
            "-n",
            &iters.to_string(),
            "-F",
        ]
        .map(String::from)
        .to_vec()
    }

    /// The commands, for the record.
    pub(crate) fn describe(&self) -> String {
        format!(
            "ib_send_lat {0} & ib_send_lat {0} 127.0.0.1; ib_write_bw {1} & ib_write_bw {1} 127.0.0.1",
            self.args(8, LAT_ITERS).join(" "),
            self.args(1 << 20, BW_ITERS).join(" ")
        )
    }

    /// Runs a server and a client of `exe`; returns the client's output.
    pub(crate) fn pair(&self, exe: &PathBuf, args: &[String], cpus: [usize; 2]) -> Result<String> {
        let pin = |cpu: usize| -> Command {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string()]).arg(exe).args(args);
            c
        };
        let mut server = pin(cpus[1]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        let start = Instant::now();
        let out = loop {
            std::thread::sleep(Duration::from_millis(300));
            let out = pin(cpus[0]).arg("127.0.0.1").stdin(Stdio::null()).output()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() {
                break text;
            }
            if start.elapsed() > CONNECT_TIMEOUT {
                let _ = server.kill();
                let _ = server.wait();
                return Err(format!("{} failed: {text}{}", exe.display(), String::from_utf8_lossy(&out.stderr)).into());
            }
        };
        process::wait_until(&mut server, Instant::now() + RUN_TIMEOUT)?;
        Ok(out)
    }

    /// `ib_send_lat` at `bytes`: the mean and the typical (median) one-way time, seconds.
    pub(crate) fn send_lat(&self, bytes: usize, cpus: [usize; 2]) -> Result<(f64, f64)> {
        let out = self.pair(&self.send_lat, &self.args(bytes, LAT_ITERS), cpus)?;
        Ok((column(&out, bytes, "t_avg")? * 1e-6, column(&out, bytes, "t_typical")? * 1e-6))
    }

    /// `ib_write_bw` at `bytes`: the average bandwidth, MB/s (10^6 bytes per second).
    pub(crate) fn write_bw(&self, bytes: usize, cpus: [usize; 2]) -> Result<f64> {
        let out = self.pair(&self.write_bw, &self.args(bytes, BW_ITERS), cpus)?;
        let unit = if out.contains("BW average[MiB/sec]") { 1.048576 } else { 1.0 };
        Ok(column(&out, bytes, "BW average")? * unit)
    }
}

/// Hidden subcommands: the streaming job, and one of its ranks.
pub(crate) const STREAM_JOB: &str = "verbs-stream-job";
pub(crate) const STREAM_RANK: &str = "verbs-stream-rank";
/// Sends outstanding per window (`osu_bw`'s default).
pub(crate) const WINDOW: usize = 32;
/// Timed windows after one warm-up window: 192 messages, about `ib_write_bw -n 200`.
const STREAM_WINDOWS: usize = 6;
const TAG_DATA: u64 = 1;
const TAG_ACK: u64 = 2;
const STREAM_TIMEOUT: Duration = Duration::from_secs(300);

/// ferrocomm's streaming bandwidth, MB/s: rank 0 keeps [`WINDOW`] sends of `bytes` outstanding,
/// rank 1 answers each window with one empty message (the `osu_bw` method). `env` holds the
/// device settings; run as a job of two ranks pinned to `cpus`.
pub(crate) fn stream_bw(progress: &str, cpus: [usize; 2], bytes: usize, env: &[(String, String)]) -> Result<f64> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    let spec = StreamSpec { progress: progress.to_string(), cpus, bytes };
    cmd.arg(STREAM_JOB).args(spec.to_args()).envs(env.iter().map(|(k, v)| (k, v))).stderr(Stdio::inherit());
    let (status, lines) = process::run_lines(cmd, STREAM_TIMEOUT)?;
    let mut mbps = None;
    for line in lines {
        match line.strip_prefix("[0] ").and_then(|l| serde_json::from_str::<Value>(l).ok()) {
            Some(v) if mbps.is_none() => mbps = v["stream_MBps"].as_f64(),
            _ => eprintln!("  {line}"),
        }
    }
    if !status.success() {
        return Err(format!("the streaming job failed ({status})").into());
    }
    mbps.ok_or_else(|| "the streaming job printed no result".into())
}

/// The arguments of the streaming job and its ranks.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct StreamSpec {
    /// `FERROCOMM_PROGRESS` of the ranks.
    pub progress: String,
    /// CPU of rank 0 and of rank 1.
    #[arg(value_parser = crate::cli::cpu_pair)]
    pub cpus: [usize; 2],
    /// Message size.
    pub bytes: usize,
}

impl StreamSpec {
    fn to_args(&self) -> Vec<String> {
        vec![self.progress.clone(), format!("{},{}", self.cpus[0], self.cpus[1]), self.bytes.to_string()]
    }
}

/// The streaming job: two verbs ranks of this binary.
pub(crate) fn stream_job_main(spec: StreamSpec) -> Result<()> {
    let env =
        vec![("FERROCOMM_TRANSPORTS".into(), "verbs".into()), ("FERROCOMM_PROGRESS".into(), spec.progress.clone())];
    ranks::launch(2, STREAM_RANK, spec.to_args(), env)
}

/// One rank of the streaming job; rank 0 prints `{"stream_MBps": ...}`.
pub(crate) fn stream_rank_main(spec: StreamSpec) -> Result<()> {
    let StreamSpec { cpus, bytes, .. } = spec;
    let rt = ranks::pinned_pair_runtime(&cpus)?;
    rt.block_on(async {
        let world = ranks::init_pair().await?;
        world.barrier().await?;
        if world.rank() == 0 {
            let data = Bytes::from((0..bytes).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
            let mut start = Instant::now();
            for w in 0..=STREAM_WINDOWS {
                if w == 1 {
                    start = Instant::now();
                }
                let sends: Vec<_> = (0..WINDOW).map(|_| world.send(1, TAG_DATA, data.clone())).collect();
                for s in sends {
                    s.await?;
                }
                world.recv(1, TAG_ACK).await?;
            }
            let secs = start.elapsed().as_secs_f64();
            println!("{}", json!({"stream_MBps": (STREAM_WINDOWS * WINDOW * bytes) as f64 / secs / 1e6}));
        } else {
            let mut bufs: Vec<BytesMut> = (0..WINDOW).map(|_| BytesMut::zeroed(bytes)).collect();
            let post = |bufs: &mut Vec<BytesMut>| -> Vec<_> {
                bufs.drain(..).map(|b| world.recv_into(0, TAG_DATA, b)).collect()
            };
            // The next window's receives are posted before the acknowledgement that starts it.
            let mut posted = post(&mut bufs);
            for w in 0..=STREAM_WINDOWS {
                for r in posted.drain(..) {
                    let (b, _) = r.await?;
                    if b.len() != bytes {
                        return Err(format!("received {} bytes, expected {bytes}", b.len()).into());
                    }
                    bufs.push(b);
                }
                if w < STREAM_WINDOWS {
                    posted = post(&mut bufs);
                }
                world.send(0, TAG_ACK, Bytes::new()).await?;
            }
        }
        world.finalize().await?;
        Ok(())
    })
}

/// The value in column `name` of perftest's result row for `bytes`.
pub(crate) fn column(out: &str, bytes: usize, name: &str) -> Result<f64> {
    let header = out.lines().find(|l| l.contains("#bytes") && l.contains(name)).ok_or("no result header")?;
    // A column name ends with a `#name` or `...[unit]` word ("BW peak[MB/sec]" is one column).
    let mut cells = Vec::new();
    let mut cell = String::new();
    for w in header.split_whitespace() {
        cell = if cell.is_empty() { w.to_string() } else { format!("{cell} {w}") };
        if w.starts_with('#') || w.ends_with(']') {
            cells.push(std::mem::take(&mut cell));
        }
    }
    let i = cells.iter().position(|c| c.starts_with(name)).ok_or("no such column")?;
    let row = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first().and_then(|b| b.parse::<usize>().ok()) == Some(bytes))
        .ok_or_else(|| format!("no result row for {bytes} bytes in:\n{out}"))?;
    row.get(i).and_then(|v| v.parse().ok()).ok_or_else(|| format!("column {name} missing in:\n{out}").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perftest_rows() {
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 8       1000          8.78           28277.30      9.23     \t       320.93      \t1881.70\t\t11772.25 \t\t28277.30\n";
        assert_eq!(column(lat, 8, "t_typical").unwrap(), 9.23);
        let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 1048576    200              34.47              29.56  \t\t   0.000030\n";
        assert_eq!(column(bw, 1 << 20, "BW average").unwrap(), 29.56);
        assert!(column(bw, 8, "BW average").is_err());
    }
}
