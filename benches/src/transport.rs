//! `shm-transport`: the shared-memory transport alone, without the protocol engine and the async
//! API, between two pinned processes.
//!
//! Why: the gap between this and `pingpong --transport shm` is what the layers above the
//! transport cost (matching, the operation slab, the futures), and the gap between this and the
//! cache-line reference ([`crate::reference`]) is what the ring protocol costs.
//!
//! Three processes, all this binary: the benchmark starts two ranks (`shm-transport-rank`), each
//! pinned to its CPU; they exchange their shared-memory descriptors through the benchmark (one hex
//! line on standard output each, relayed to the other's standard input), connect, and run:
//!
//! * latency: rank 0 sends an 8-byte eager frame, rank 1 answers with one; after a warm-up,
//!   [`BATCHES`] timed batches of [`PINGS`] round trips; one-way = batch time / (2 x pings),
//!   median over batches;
//! * the same through the protocol engine driven by hand (no reactor, no operation slab, no
//!   futures): each side posts a `recv_into`-style receive, sends with
//!   [`Engine::send_now_via`] straight to the transport (as the driver does) and polls the
//!   transport into the engine until its receive completes. Between this and the transport alone
//!   is what the engine costs (matching, credits, completions); between this and `pingpong` what
//!   the async API adds;
//! * bandwidth: [`BW_BYTES`] in messages of `--message` bytes (default 4 MiB), each sent as
//!   512 KiB `Data` frames and acknowledged by an 8-byte frame, by single copy
//!   (`process_vm_readv`) or streamed through the 256 KiB ring, per `--cma`.
//!
//! Rank 0 prints one JSON line with the results.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ferrocomm::p2p::engine::{Completion, Config, Engine, RecvBuf};
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm::transports::shm::{ShmConfig, ShmEndpoint, ShmTransport, SingleCopy};
use ferrocomm::transports::{Header, Kind, Limits, Rank, Sink, Transport, TransportError, WireError};
use serde_json::{Value, json};

use crate::{Result, affinity, cli, process, sweep};

/// Hidden subcommand: one rank of the transport benchmark.
pub(crate) const RANK_COMMAND: &str = "shm-transport-rank";

/// Round trips per timed latency batch.
const PINGS: usize = 20_000;
/// Timed latency batches (the median is reported).
const BATCHES: usize = 11;
/// Bytes moved per bandwidth measurement.
const BW_BYTES: usize = 256 << 20;
/// `Data` frame size (the engine's default rendezvous chunk).
const CHUNK: usize = 512 << 10;
/// The longest a rank waits for anything.
const STALL: Duration = Duration::from_secs(60);

/// The shared-memory transport alone (no engine, no futures).
///
/// 8-byte frame ping-pong latency and bandwidth of large messages in 512 KiB Data frames,
/// between two processes pinned to two CPUs; and the 8-byte ping-pong through the protocol
/// engine driven by hand (no reactor, no futures).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// CPUs of the two ranks
    #[arg(long, value_name = "A,B", default_value = "0,1", value_parser = cli::cpu_pair)]
    pub cpus: [usize; 2],
    /// Single copy by process_vm_readv (auto, from 16 KiB frames) or streamed (off) [default:
    /// both, one after the other]
    #[arg(long, value_parser = ["auto", "off"])]
    pub cma: Option<String>,
    /// Bandwidth message size (rounded to whole 512 KiB frames)
    #[arg(long, value_name = "BYTES", default_value = "4M", value_parser = cli::bytes)]
    pub message: usize,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// The arguments of one rank (`shm-transport-rank RANK CPU JOB CMA MESSAGE`).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct RankSpec {
    rank: Rank,
    cpu: usize,
    job: String,
    cma: String,
    message: usize,
}

/// What one run measured.
#[derive(Clone, Debug)]
pub(crate) struct TransportResult {
    pub cma: String,
    pub one_way_us: f64,
    pub batches_us: Vec<f64>,
    /// The same ping-pong through the engine driven by hand (median over batches).
    pub engine_one_way_us: f64,
    pub engine_batches_us: Vec<f64>,
    pub message: usize,
    pub gbps: f64,
}

impl TransportResult {
    pub(crate) fn to_json(&self) -> Value {
        json!({"cma": self.cma, "one_way_8B_us": self.one_way_us, "batches_us": self.batches_us,
               "engine_one_way_8B_us": self.engine_one_way_us, "engine_batches_us": self.engine_batches_us,
               "message_bytes": self.message, "bandwidth_GBps": self.gbps})
    }
}

/// `ferrocomm-bench shm-transport`.
pub(crate) fn main(o: Options) -> Result<()> {
    let cpus = o.cpus;
    let modes: Vec<String> = match o.cma {
        Some(m) => vec![m],
        None => vec!["auto".into(), "off".into()],
    };
    let message = o.message.max(CHUNK) / CHUNK * CHUNK;
    let mut results = Vec::new();
    for cma in &modes {
        let r = run(cpus, cma, message)?;
        println!(
            "shm transport alone (cma={cma}): 8 B one-way {:.3} us (median of {BATCHES} batches of {PINGS}), \
             through the engine by hand {:.3} us; {} KiB messages {:.2} GB/s",
            r.one_way_us,
            r.engine_one_way_us,
            message >> 10,
            r.gbps
        );
        results.push(r);
    }
    if let Some(path) = o.json {
        let doc = json!({"bench": "shm-transport", "cpus": cpus,
                         "runs": results.iter().map(TransportResult::to_json).collect::<Vec<_>>()});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Runs the two ranks once and returns rank 0's measurements.
pub(crate) fn run(cpus: [usize; 2], cma: &str, message: usize) -> Result<TransportResult> {
    let exe = std::env::current_exe()?;
    let job = format!("bench{}", std::process::id());
    let spawn = |rank: usize| {
        Command::new(&exe)
            .args([RANK_COMMAND, &rank.to_string(), &cpus[rank].to_string(), &job, cma, &message.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
    };
    let mut ranks = [spawn(0)?, spawn(1)?];
    let mut outs: Vec<_> = ranks.iter_mut().map(|c| BufReader::new(c.stdout.take().expect("piped")).lines()).collect();
    let mut descs = Vec::new();
    for out in outs.iter_mut() {
        descs.push(out.next().ok_or("a rank exited before publishing its descriptor")??);
    }
    for (rank, child) in ranks.iter_mut().enumerate() {
        let mut stdin = child.stdin.take().expect("piped");
        writeln!(stdin, "{}", descs[1 - rank])?;
    }
    let line = outs[0].next().ok_or("rank 0 printed no result")??;
    for c in ranks.iter_mut() {
        let status = process::wait_until(c, Instant::now() + STALL)?;
        if !status.success() {
            return Err(format!("a transport benchmark rank failed ({status})").into());
        }
    }
    let v: Value = serde_json::from_str(&line).map_err(|e| format!("rank 0's result ({e}): {line}"))?;
    let batches = |key: &str| -> Result<Vec<f64>> {
        Ok(v[key].as_array().ok_or("no batches")?.iter().filter_map(Value::as_f64).collect())
    };
    let (batches_us, engine_batches_us) = (batches("batches_us")?, batches("engine_batches_us")?);
    Ok(TransportResult {
        cma: cma.to_string(),
        one_way_us: sweep::median(&batches_us).ok_or("no batches")?,
        batches_us,
        engine_one_way_us: sweep::median(&engine_batches_us).ok_or("no engine batches")?,
        engine_batches_us,
        message,
        gbps: v["GBps"].as_f64().ok_or("no bandwidth")?,
    })
}

/// Counts frames; `Data` payloads land in one buffer at their offset.
pub(crate) struct CountSink {
    pub frames: usize,
    pub data: Vec<u8>,
    pub lost: Option<TransportError>,
}

// SAFETY: `data` is allocated once and never resized while the transport may write into it.
unsafe impl Sink for CountSink {
    fn data_dest(&mut self, _peer: Rank, h: &Header) -> std::result::Result<Option<&mut [u8]>, WireError> {
        Ok(self.data.get_mut(h.aux as usize..h.aux as usize + h.len as usize))
    }
    fn frame(&mut self, _peer: Rank, h: Header, _payload: Bytes) {
        if h.kind != Kind::Credit {
            self.frames += 1;
        }
    }
    fn frame_ref(&mut self, _peer: Rank, h: Header, _payload: &[u8]) {
        // As the engine does for a posted receive: no allocation per frame.
        if h.kind != Kind::Credit {
            self.frames += 1;
        }
    }
    fn peer_lost(&mut self, _peer: Rank, err: TransportError) {
        self.lost = Some(err);
    }
}

/// Notices a spin that has waited longer than [`STALL`]. The clock is read only every 4096 polls:
/// it costs about as much as a ring round trip.
#[derive(Default)]
struct Watchdog {
    polls: u32,
    start: Option<Instant>,
}

impl Watchdog {
    fn stalled(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        self.polls.is_multiple_of(4096) && self.start.get_or_insert_with(Instant::now).elapsed() > STALL
    }
}

/// One side of the ping-pong through the engine driven by hand: what the driver and the async API
/// do for `recv_into` and `send_from`, without the reactor, the operation slab and the futures.
struct ByHand {
    engine: Engine,
    peer: Rank,
    /// The receive buffer, reused (as `pingpong --recv-into` does).
    buf: Option<BytesMut>,
    data: [u8; 8],
}

impl ByHand {
    const TAG: u64 = 7;

    fn new(me: Rank) -> ByHand {
        let cfg = Config { eager_limit: 64 << 10, max_credit: 32, credit_sync: 16, chunk: CHUNK, max_message: 1 << 20 };
        ByHand { engine: Engine::new(me, 2, cfg), peer: 1 - me, buf: Some(BytesMut::zeroed(8)), data: [7; 8] }
    }

    /// An eager send of the 8 bytes, straight to the transport when it can go at once.
    fn send<T: Transport>(&mut self, t: &mut T) -> Result<()> {
        let sent = self.engine.send_now_via(self.peer, 0, Self::TAG, &self.data[..], |p, h, d| t.send_copy(p, h, d));
        match sent {
            Ok(r) => r.map_err(|e| format!("the engine's send failed: {e}"))?,
            Err(d) => self.engine.post_send(0, self.peer, 0, Self::TAG, Bytes::copy_from_slice(d)),
        }
        self.flush(t);
        Ok(())
    }

    /// Posts the receive, then polls the transport into the engine until it completes.
    fn recv<T: Transport>(&mut self, t: &mut T) -> Result<()> {
        const KEY: usize = 1;
        let buf = self.buf.take().ok_or("the receive buffer was lost")?;
        self.engine.post_recv(KEY, 0, Source::Rank(self.peer), TagMatch::Exact(Self::TAG), RecvBuf::User(buf));
        let mut watchdog = Watchdog::default();
        loop {
            t.progress(&mut self.engine);
            self.flush(t);
            while let Some((key, c)) = self.engine.poll_event() {
                match (key, c) {
                    (KEY, Completion::Recv(Ok((p, s)))) if s.len == 8 => {
                        self.buf = Some(p.into_bytes_mut());
                        return Ok(());
                    }
                    (KEY, other) => return Err(format!("the receive completed as {other:?}").into()),
                    (_, Completion::Send(Ok(()))) => {}
                    (_, other) => return Err(format!("unexpected completion {other:?}").into()),
                }
            }
            if watchdog.stalled() {
                return Err("stalled in the engine ping-pong".into());
            }
        }
    }

    /// Hands the engine's queued frames (credit updates, sends behind them) to the transport.
    fn flush<T: Transport>(&mut self, t: &mut T) {
        while let Some((p, h, b)) = self.engine.poll_transmit() {
            t.send(p, h, b);
        }
    }
}

/// One side of a two-rank transport benchmark (any transport).
pub(crate) struct Node<T> {
    pub t: T,
    pub s: CountSink,
    pub me: Rank,
}

impl<T: Transport> Node<T> {
    /// Busy-polls until `frames` frames have arrived.
    pub(crate) fn spin_until(&mut self, frames: usize) -> Result<()> {
        let mut watchdog = Watchdog::default();
        while self.s.frames < frames {
            self.t.progress(&mut self.s);
            if let Some(e) = &self.s.lost {
                return Err(format!("rank {}: peer lost: {e}", self.me).into());
            }
            if watchdog.stalled() {
                return Err(format!("rank {}: stalled", self.me).into());
            }
        }
        Ok(())
    }

    /// Sends an 8-byte eager frame to the other rank.
    pub(crate) fn eager(&mut self, tag: u64) {
        let h = Header { src: self.me, tag, len: 8, ..Header::new(Kind::Eager) };
        self.t.send(1 - self.me, h, Bytes::from_static(&[7; 8]));
    }

    /// Says goodbye (a `Credit` frame) and waits until our output is out and the peer's goodbye in.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.t.send(1 - self.me, Header { src: self.me, ..Header::new(Kind::Credit) }, Bytes::new());
        let start = Instant::now();
        while self.t.has_pending_output() && start.elapsed() < STALL {
            self.t.progress(&mut self.s);
        }
        // Give the peer time to read our goodbye before our side of the rings goes away.
        std::thread::sleep(Duration::from_millis(50));
        Ok(())
    }
}

/// One-way latency of each of [`BATCHES`] timed batches of [`PINGS`] round trips, after a batch
/// of warm-up (microseconds).
fn timed_batches(mut round_trip: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut batches_us = Vec::with_capacity(BATCHES);
    for b in 0..=BATCHES {
        let start = Instant::now();
        for _ in 0..PINGS {
            round_trip()?;
        }
        if b > 0 {
            batches_us.push(start.elapsed().as_secs_f64() * 1e6 / (2 * PINGS) as f64);
        }
    }
    Ok(batches_us)
}

/// `shm-transport-rank RANK CPU JOB CMA MESSAGE`.
pub(crate) fn rank_main(spec: RankSpec) -> Result<()> {
    let RankSpec { rank: me, cpu, job, cma, message } = spec;
    let (job, cma) = (job.as_str(), cma.as_str());
    affinity::pin_current_thread(cpu)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let cfg = ShmConfig {
        cma_threshold: 16 << 10,
        single_copy: if cma == "off" { SingleCopy::Off } else { SingleCopy::Auto },
        ..ShmConfig::default()
    };
    let (ep, desc) = ShmEndpoint::create(job, me, &[0, 1], cfg)?;
    println!("{}", hex(&desc));
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let theirs = unhex(line.trim()).ok_or("a malformed descriptor line")?;
    let limits = Limits { world_size: 2, eager_limit: 64 << 10, chunk: CHUNK, max_message: 1 << 30 };
    let t = {
        let _g = rt.enter();
        ep.connect(vec![(1 - me, theirs)], limits)?
    };
    let mut node: Node<ShmTransport> = Node { t, s: CountSink { frames: 0, data: vec![0; message], lost: None }, me };
    let pings = PINGS * (BATCHES + 1);
    if me == 0 {
        let mut i = 0;
        let batches_us = timed_batches(|| {
            node.eager(i as u64);
            i += 1;
            node.spin_until(i)
        })?;
        let mut by_hand = ByHand::new(me);
        let engine_batches_us = timed_batches(|| {
            by_hand.send(&mut node.t)?;
            by_hand.recv(&mut node.t)
        })?;
        let payload = Bytes::from(vec![5u8; message]);
        let base = node.s.frames;
        let start = Instant::now();
        for m in 0..BW_BYTES / message {
            for c in 0..message / CHUNK {
                let h = Header {
                    src: 0,
                    seq: c as u64,
                    aux: (c * CHUNK) as u64,
                    len: CHUNK as u32,
                    ..Header::new(Kind::Data)
                };
                node.t.send(1, h, payload.slice(c * CHUNK..(c + 1) * CHUNK));
            }
            node.spin_until(base + m + 1)?;
        }
        let gbps = (BW_BYTES / message * message) as f64 / start.elapsed().as_secs_f64() / 1e9;
        println!("{}", json!({"batches_us": batches_us, "engine_batches_us": engine_batches_us, "GBps": gbps}));
        std::io::stdout().flush()?;
    } else {
        for i in 0..pings {
            node.spin_until(i + 1)?;
            node.eager(i as u64);
        }
        let mut by_hand = ByHand::new(me);
        for _ in 0..pings {
            by_hand.recv(&mut node.t)?;
            by_hand.send(&mut node.t)?;
        }
        let per = message / CHUNK;
        for m in 0..BW_BYTES / message {
            node.spin_until(pings + (m + 1) * per)?;
            node.eager(m as u64);
        }
    }
    node.finish()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("0g"), None);
    }
}
