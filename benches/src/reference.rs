//! The machine's limits, measured by the benchmark itself, as reference lines for the
//! shared-memory results:
//!
//! * a cross-core cache-line ping-pong: two threads pinned to the two CPUs bounce one atomic
//!   counter (each waits for the other's value, then stores the next); one-way = time / (2 x
//!   round trips). No message can cross between the cores faster than this.
//! * single-thread `memcpy` bandwidth at 4 MiB (source and destination in the cache hierarchy as
//!   a benchmark's reused buffers are): what one copy of a large message costs at best.
//!
//! And one line that is not the machine's but ferrocomm's own floor: the API alone, a rank sending
//! 8 bytes to itself and receiving them (`send` then `recv_into`, awaited, busy-poll mode): the
//! operation slab, the lock, the engine's matching and the futures, without any transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde_json::{Value, json};

use crate::{Result, affinity, sweep};

/// Round trips per cache-line ping-pong measurement.
const BOUNCES: u64 = 1_000_000;
/// Copies per memcpy measurement.
const COPIES: usize = 200;
/// Repetitions of each measurement (the median is reported).
const REPEAT: usize = 5;
/// The memcpy size.
pub const MEMCPY_BYTES: usize = 4 << 20;
/// Send/receive pairs per measurement of the API alone.
const SELF_PAIRS: u32 = 200_000;

/// One atomic alone on its cache lines (128 bytes: adjacent-line prefetchers pull pairs).
#[repr(align(128))]
struct Padded(AtomicU64);

/// The reference measurements.
#[derive(Clone, Debug)]
pub struct Reference {
    /// Cache-line ping-pong, one way, microseconds (median over repetitions).
    pub cacheline_us: f64,
    pub cacheline_runs_us: Vec<f64>,
    /// memcpy of [`MEMCPY_BYTES`], GB/s (median over repetitions).
    pub memcpy_gbps: f64,
    pub memcpy_runs_gbps: Vec<f64>,
    /// One 8-byte send to itself plus its `recv_into`, nanoseconds (median over repetitions).
    pub api_pair_ns: f64,
    pub api_pair_runs_ns: Vec<f64>,
}

impl Reference {
    pub fn to_json(&self) -> Value {
        json!({
            "cacheline_pingpong_one_way_us": self.cacheline_us,
            "cacheline_runs_us": self.cacheline_runs_us,
            "memcpy_bytes": MEMCPY_BYTES,
            "memcpy_GBps": self.memcpy_gbps,
            "memcpy_runs_GBps": self.memcpy_runs_gbps,
            "api_self_send_recv_pair_ns": self.api_pair_ns,
            "api_self_runs_ns": self.api_pair_runs_ns,
        })
    }
}

/// Measures both reference lines on `cpus`.
pub fn measure(cpus: [usize; 2]) -> Result<Reference> {
    let mut cacheline_runs_us = Vec::new();
    let mut memcpy_runs_gbps = Vec::new();
    for _ in 0..REPEAT {
        cacheline_runs_us.push(cacheline_one_way(cpus)? * 1e6);
        memcpy_runs_gbps.push(memcpy_gbps(cpus[0])?);
    }
    let api_pair_runs_ns = api_alone(cpus[0])?;
    Ok(Reference {
        cacheline_us: sweep::median(&cacheline_runs_us).unwrap_or(f64::NAN),
        cacheline_runs_us,
        memcpy_gbps: sweep::median(&memcpy_runs_gbps).unwrap_or(f64::NAN),
        memcpy_runs_gbps,
        api_pair_ns: sweep::median(&api_pair_runs_ns).unwrap_or(f64::NAN),
        api_pair_runs_ns,
    })
}

/// Two threads on `cpus` bounce one counter [`BOUNCES`] times; seconds one way.
fn cacheline_one_way(cpus: [usize; 2]) -> Result<f64> {
    let word = Arc::new(Padded(AtomicU64::new(0)));
    let peer = {
        let word = word.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            affinity::pin_current_thread(cpus[1])?;
            for i in 0..BOUNCES {
                while word.0.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                word.0.store(2 * i + 2, Ordering::Release);
            }
            Ok(())
        })
    };
    let timed = std::thread::spawn(move || -> std::io::Result<f64> {
        affinity::pin_current_thread(cpus[0])?;
        let start = Instant::now();
        for i in 0..BOUNCES {
            word.0.store(2 * i + 1, Ordering::Release);
            while word.0.load(Ordering::Acquire) != 2 * i + 2 {
                std::hint::spin_loop();
            }
        }
        Ok(start.elapsed().as_secs_f64() / (2 * BOUNCES) as f64)
    });
    let t = timed.join().map_err(|_| "the ping-pong thread panicked")??;
    peer.join().map_err(|_| "the ping-pong thread panicked")??;
    Ok(t)
}

/// [`COPIES`] copies of [`MEMCPY_BYTES`] on `cpu`, after one warm-up copy; GB/s.
fn memcpy_gbps(cpu: usize) -> Result<f64> {
    let t = std::thread::spawn(move || -> std::io::Result<f64> {
        affinity::pin_current_thread(cpu)?;
        let src = vec![1u8; MEMCPY_BYTES];
        let mut dst = vec![0u8; MEMCPY_BYTES];
        dst.copy_from_slice(&src);
        let start = Instant::now();
        for _ in 0..COPIES {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        Ok((COPIES * MEMCPY_BYTES) as f64 / start.elapsed().as_secs_f64() / 1e9)
    });
    Ok(t.join().map_err(|_| "the memcpy thread panicked")??)
}

/// A one-rank job in this process, on `cpu` (its progress thread too): [`REPEAT`] timed batches
/// of [`SELF_PAIRS`] 8-byte sends to itself, each followed by a `recv_into`; nanoseconds per pair.
fn api_alone(cpu: usize) -> Result<Vec<f64>> {
    let t = std::thread::spawn(move || -> std::result::Result<Vec<f64>, String> {
        affinity::pin_current_thread(cpu).map_err(|e| e.to_string())?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(async {
            let settings = ferrocomm::Settings { progress: ferrocomm::ProgressMode::BusyPoll, ..Default::default() };
            let world = ferrocomm::testing::cluster(1, settings).await.map_err(|e| e.to_string())?.remove(0);
            let data = bytes::Bytes::from(vec![7u8; 8]).slice(..);
            let mut buf = Some(bytes::BytesMut::zeroed(8));
            let mut runs = Vec::new();
            for batch in 0..=REPEAT {
                let start = Instant::now();
                for _ in 0..SELF_PAIRS {
                    world.send(0, 1, data.clone()).await.map_err(|e| e.to_string())?;
                    let mut b = buf.take().ok_or("lost the buffer")?;
                    b.resize(8, 0);
                    let (b, _) = world.recv_into(0u32, 1u64, b).await.map_err(|e| e.to_string())?;
                    buf = Some(b);
                }
                // Batch 0 warms up.
                if batch > 0 {
                    runs.push(start.elapsed().as_nanos() as f64 / SELF_PAIRS as f64);
                }
            }
            world.finalize().await.map_err(|e| e.to_string())?;
            Ok(runs)
        })
    });
    Ok(t.join().map_err(|_| "the API thread panicked")??)
}
