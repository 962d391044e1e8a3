//! Scale curves: one collective at a given rank count and size, simulated, beside its model.

use std::time::Instant;

use bytes::Bytes;
use ferrocomm_collectives::{Algorithm, ReduceOp, ops};
use ferrocomm_transports::sim::{NetConfig, SimNet, Time};

use crate::cluster::{Node, run};
use crate::coll::run_calls;
use crate::mcast::{McastRank, config};
use crate::model::{AlphaBeta, Op};

/// One point of a curve.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The operation.
    pub op: Op,
    /// Ranks taking part.
    pub ranks: u32,
    /// Message (or vector) bytes.
    pub bytes: usize,
    /// Simulated time of the operation, nanoseconds.
    pub sim_ns: Time,
    /// Multicast: from the root's first send until every receiver acknowledged (the root's window
    /// is empty again); delayed ACKs make this longer than the delivery.
    pub acked_ns: Option<Time>,
    /// The alpha-beta model's time, nanoseconds.
    pub model_ns: f64,
    /// Frames the network carried.
    pub frames: u64,
    /// Datagrams the network carried.
    pub datagrams: u64,
}

/// The vector or message of `bytes` bytes (whole u64 elements; at least one).
fn payload(bytes: usize) -> Bytes {
    let n = bytes.div_ceil(8).max(1);
    Bytes::from((0..n as u64).flat_map(|i| (i * 0x9e37_79b9).to_le_bytes()).collect::<Vec<u8>>())
}

/// Simulates `op` on `p` ranks with `bytes` bytes on a network of `cfg` (uniform: its `link`).
pub fn measure(op: Op, p: u32, bytes: usize, cfg: &NetConfig) -> Result<Point, String> {
    let net = SimNet::new(p, cfg.clone());
    let limit: Time = 3_600_000_000_000;
    let data = payload(bytes);
    let bytes = data.len();
    let mut acked_ns = None;
    let sim_ns = match op {
        Op::McastBcast => {
            let origin = Instant::now();
            let mcfg = config(p, cfg.max_datagram);
            let mut ranks: Vec<McastRank> = (0..p)
                .map(|r| {
                    let outbox = if r == 0 { vec![data.clone()] } else { Vec::new() };
                    McastRank::new(
                        Node::with_defaults(&net, r),
                        &net,
                        origin,
                        mcfg.clone(),
                        outbox,
                        usize::from(r != 0),
                    )
                })
                .collect();
            run(&net, &mut ranks, limit, |_, _| {}).map_err(|e| e.to_string())?;
            if let Some(e) = ranks.iter().flat_map(|r| r.errors.first()).next() {
                return Err(e.clone());
            }
            let start = ranks[0].first_send_at.ok_or("the root never sent")?;
            let end = ranks.iter().filter_map(|r| r.read_all_at).max().unwrap_or(start);
            acked_ns = ranks[0].acked_at.map(|t| t - start);
            end - start
        }
        _ => {
            let calls = |r: u32| {
                let m = match op {
                    Op::Barrier(a) => ops::barrier(r, p, a),
                    Op::Bcast(a) => ops::bcast(r, p, 0, a, (r == 0).then(|| data.clone()), 8),
                    Op::Allreduce(a) => ops::allreduce(r, p, a, data.clone(), ReduceOp::<u64>::Sum.erase()),
                    Op::McastBcast => unreachable!(),
                };
                vec![m.expect("a valid call")]
            };
            let (report, ranks) = run_calls(&net, calls, limit).map_err(|e| e.to_string())?;
            if let Some(e) = ranks.iter().flat_map(|r| r.error.as_ref()).next() {
                return Err(e.clone());
            }
            report.time
        }
    };
    let stats = net.stats();
    let model_ns = op.predict(AlphaBeta::of(&cfg.link), p, if matches!(op, Op::Barrier(_)) { 0 } else { bytes });
    Ok(Point { op, ranks: p, bytes, sim_ns, acked_ns, model_ns, frames: stats.frames, datagrams: stats.datagrams })
}

/// The operations of the curves: the latency-bound and bandwidth-bound algorithm of each.
pub fn curve_ops() -> Vec<Op> {
    vec![
        Op::Barrier(Algorithm::Dissemination),
        Op::Bcast(Algorithm::Binomial),
        Op::Bcast(Algorithm::ScatterAllgather),
        Op::McastBcast,
        Op::Allreduce(Algorithm::RecursiveDoubling),
        Op::Allreduce(Algorithm::Rabenseifner),
    ]
}

/// `count` broadcasts of `bytes` bytes each from rank 0, back to back, on `p` ranks: by a binomial
/// tree (the calls one after another on every rank, as a program that issues them in a loop) or
/// by multicast (all in the root's window at once). The time is until the last rank has read the
/// last message. Throughput, where [`measure`] gives the latency of one.
pub fn broadcast_stream(p: u32, bytes: usize, count: usize, multicast: bool, cfg: &NetConfig) -> Result<Time, String> {
    let net = SimNet::new(p, cfg.clone());
    let limit: Time = 3_600_000_000_000;
    let data = payload(bytes);
    if multicast {
        let origin = Instant::now();
        let mcfg = config(p, cfg.max_datagram);
        let mut ranks: Vec<McastRank> = (0..p)
            .map(|r| {
                let outbox = if r == 0 { vec![data.clone(); count] } else { Vec::new() };
                let expect = if r == 0 { 0 } else { count };
                McastRank::new(Node::with_defaults(&net, r), &net, origin, mcfg.clone(), outbox, expect)
            })
            .collect();
        run(&net, &mut ranks, limit, |_, _| {}).map_err(|e| e.to_string())?;
        if let Some(e) = ranks.iter().flat_map(|r| r.errors.first()).next() {
            return Err(e.clone());
        }
        let start = ranks[0].first_send_at.ok_or("the root never sent")?;
        Ok(ranks.iter().filter_map(|r| r.read_all_at).max().unwrap_or(start) - start)
    } else {
        let calls = |r: u32| {
            (0..count)
                .map(|_| ops::bcast(r, p, 0, Algorithm::Binomial, (r == 0).then(|| data.clone()), 8).expect("valid"))
                .collect()
        };
        let (report, ranks) = run_calls(&net, calls, limit).map_err(|e| e.to_string())?;
        if let Some(e) = ranks.iter().flat_map(|r| r.error.as_ref()).next() {
            return Err(e.clone());
        }
        Ok(report.time)
    }
}

/// What [`multicast_stream`] measured.
#[derive(Clone, Debug)]
pub struct StreamRun {
    /// From the root's first send until the last rank read the last message, nanoseconds.
    pub time: Time,
    /// Each rank's protocol counters (rank 0 is the root).
    pub stats: Vec<ferrocomm_multicast::Stats>,
}

/// The messages `lens` from rank 0 to `p - 1` receivers through one multicast channel of
/// protocol settings `mcfg` (its `me` and `size` are set here), with `drop` of the datagrams
/// received by the odd ranks dropped (as `FERROCOMM_MCAST_TEST_DROP` on half the receivers):
/// the simulated form of `ferrocomm-bench multicast --stream`.
pub fn multicast_stream(
    p: u32,
    lens: &[usize],
    drop: f64,
    mcfg: &ferrocomm_multicast::Config,
    cfg: &NetConfig,
) -> Result<StreamRun, String> {
    let net = SimNet::new(p, cfg.clone());
    let origin = Instant::now();
    let data = payload(lens.iter().copied().max().unwrap_or(0));
    let mcfg = ferrocomm_multicast::Config { size: p, ..mcfg.clone() };
    let mut ranks: Vec<McastRank> = (0..p)
        .map(|r| {
            let outbox =
                if r == 0 { lens.iter().map(|&n| data.slice(..n.min(data.len()))).collect() } else { Vec::new() };
            let expect = if r == 0 { 0 } else { lens.len() };
            let rank = McastRank::new(Node::with_defaults(&net, r), &net, origin, mcfg.clone(), outbox, expect);
            let share = if r % 2 == 1 { drop } else { 0.0 };
            rank.with_drop(share, cfg.seed ^ (u64::from(r) << 32) ^ 0x6d63)
        })
        .collect();
    run(&net, &mut ranks, 3_600_000_000_000, |_, _| {}).map_err(|e| e.to_string())?;
    if let Some(e) = ranks.iter().flat_map(|r| r.errors.first()).next() {
        return Err(e.clone());
    }
    for (r, rank) in ranks.iter().enumerate().skip(1) {
        if rank.got.len() != lens.len() || rank.got.iter().zip(lens).any(|((_, m), &n)| m.len() != n) {
            return Err(format!("rank {r} did not read the stream intact"));
        }
    }
    let start = ranks[0].first_send_at.ok_or("the root never sent")?;
    let time = ranks.iter().filter_map(|r| r.read_all_at).max().unwrap_or(start) - start;
    Ok(StreamRun { time, stats: ranks.iter().map(|r| r.core().stats().clone()).collect() })
}
