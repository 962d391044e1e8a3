//! The machine's limits, measured by the benchmark itself, as reference lines for the
//! shared-memory results:
//!
//! * a cross-core cache-line ping-pong: two threads pinned to the two CPUs bounce one atomic
//!   counter (each waits for the other's value, then stores the next); one-way = time / (2 x
//!   round trips). No message can cross between the cores faster than this.
//! * single-thread `memcpy` bandwidth at 4 MiB (source and destination in the cache hierarchy as
//!   a benchmark's reused buffers are): what one copy of a large message costs at best.
//!
//! * waking a thread asleep on an eventfd on the other, idle CPU: one thread sleeps for the
//!   idle-peer gap, then writes the eventfd and spins until the sleeper, woken from its blocking
//!   `read`, stores a flag. No peer that has gone to sleep can answer faster than this, so it is
//!   the floor of the idle-peer latency in adaptive mode (which sleeps on such a doorbell).
//!
//! * a cross-core copy ping-pong (`copy_pingpong`, taken before every slice of the ping-pong
//!   sweep, not a reference line): [`COPY_PROBE_BYTES`] copied into a shared buffer on one CPU
//!   and out of it on the other, and back; two copies per one-way trip, no sockets. On a virtual
//!   machine its speed follows where the host runs the two CPUs (a shared cache or not) and can
//!   change severalfold within seconds; large-message ping-pong times (a copy on each side, for
//!   ferrocomm and the peers alike) change with it, so it tells slices taken in a slow moment.
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
pub(crate) const MEMCPY_BYTES: usize = 4 << 20;
/// Wake-ups measured, and the sleep before each (the idle-peer measurement's default gap).
const WAKEUPS: usize = 300;
const WAKEUP_GAP: std::time::Duration = std::time::Duration::from_millis(1);
/// Message size of the cross-core copy probe.
pub(crate) const COPY_PROBE_BYTES: usize = 1 << 20;
/// Round trips per cross-core copy probe.
const COPY_PROBE_TRIPS: u64 = 50;
/// Send/receive pairs per measurement of the API alone.
const SELF_PAIRS: u32 = 200_000;

/// One atomic alone on its cache lines (128 bytes: adjacent-line prefetchers pull pairs).
#[repr(align(128))]
struct Padded(AtomicU64);

/// The reference measurements.
#[derive(Clone, Debug)]
pub(crate) struct Reference {
    /// Cache-line ping-pong, one way, microseconds (median over repetitions).
    pub cacheline_us: f64,
    pub cacheline_runs_us: Vec<f64>,
    /// memcpy of [`MEMCPY_BYTES`], GB/s (median over repetitions).
    pub memcpy_gbps: f64,
    pub memcpy_runs_gbps: Vec<f64>,
    /// One 8-byte send to itself plus its `recv_into`, nanoseconds (median over repetitions).
    pub api_pair_ns: f64,
    pub api_pair_runs_ns: Vec<f64>,
    /// Waking an eventfd sleeper on an idle CPU, microseconds (median over wake-ups).
    pub wakeup_us: f64,
}

impl Reference {
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "cacheline_pingpong_one_way_us": self.cacheline_us,
            "cacheline_runs_us": self.cacheline_runs_us,
            "memcpy_bytes": MEMCPY_BYTES,
            "memcpy_GBps": self.memcpy_gbps,
            "memcpy_runs_GBps": self.memcpy_runs_gbps,
            "api_self_send_recv_pair_ns": self.api_pair_ns,
            "api_self_runs_ns": self.api_pair_runs_ns,
            "eventfd_wakeup_idle_cpu_us": self.wakeup_us,
        })
    }
}

/// Measures both reference lines on `cpus`.
pub(crate) fn measure(cpus: [usize; 2]) -> Result<Reference> {
    let mut cacheline_runs_us = Vec::new();
    let mut memcpy_runs_gbps = Vec::new();
    for _ in 0..REPEAT {
        cacheline_runs_us.push(cacheline_one_way(cpus)? * 1e6);
        memcpy_runs_gbps.push(memcpy_gbps(cpus[0])?);
    }
    let api_pair_runs_ns = api_alone(cpus[0])?;
    let wakeups = eventfd_wakeups(cpus, WAKEUP_GAP, WAKEUPS)?;
    Ok(Reference {
        wakeup_us: sweep::median(&wakeups).unwrap_or(f64::NAN) * 1e6,
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

/// Cross-core copy ping-pong of [`COPY_PROBE_BYTES`] on `cpus`, [`COPY_PROBE_TRIPS`] round trips:
/// each way, the sender copies its message into a shared buffer and the receiver copies it out
/// (two copies of cache-cold data for the receiving core, as a TCP ping-pong over loopback makes);
/// microseconds one way.
pub(crate) fn copy_pingpong(cpus: [usize; 2]) -> Result<f64> {
    use std::sync::Mutex;
    let shared = Arc::new((Mutex::new(vec![1u8; COPY_PROBE_BYTES]), Padded(AtomicU64::new(0))));
    let peer = {
        let shared = shared.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            affinity::pin_current_thread(cpus[1])?;
            let (own, mut got) = (vec![2u8; COPY_PROBE_BYTES], vec![0u8; COPY_PROBE_BYTES]);
            for i in 0..COPY_PROBE_TRIPS {
                while shared.1.0.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                let mut buf = shared.0.lock().unwrap_or_else(|e| e.into_inner());
                got.copy_from_slice(&buf);
                buf.copy_from_slice(&own);
                drop(buf);
                shared.1.0.store(2 * i + 2, Ordering::Release);
            }
            std::hint::black_box(&got);
            Ok(())
        })
    };
    let timed = std::thread::spawn(move || -> std::io::Result<f64> {
        affinity::pin_current_thread(cpus[0])?;
        let (own, mut got) = (vec![3u8; COPY_PROBE_BYTES], vec![0u8; COPY_PROBE_BYTES]);
        let start = Instant::now();
        for i in 0..COPY_PROBE_TRIPS {
            shared.0.lock().unwrap_or_else(|e| e.into_inner()).copy_from_slice(&own);
            shared.1.0.store(2 * i + 1, Ordering::Release);
            while shared.1.0.load(Ordering::Acquire) != 2 * i + 2 {
                std::hint::spin_loop();
            }
            got.copy_from_slice(&shared.0.lock().unwrap_or_else(|e| e.into_inner()));
        }
        std::hint::black_box(&got);
        Ok(start.elapsed().as_secs_f64() * 1e6 / (2 * COPY_PROBE_TRIPS) as f64)
    });
    let t = timed.join().map_err(|_| "the copy ping-pong thread panicked")??;
    peer.join().map_err(|_| "the copy ping-pong thread panicked")??;
    Ok(t)
}

/// `count` times: the thread on `cpus[0]` sleeps `gap`, writes an eventfd and spins until the
/// thread on `cpus[1]`, blocked in `read` on it, has stored a flag; seconds per wake-up.
fn eventfd_wakeups(cpus: [usize; 2], gap: std::time::Duration, count: usize) -> Result<Vec<f64>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: eventfd returns a new descriptor or -1, checked below.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
    let flag = Arc::new(Padded(AtomicU64::new(0)));
    let sleeper = {
        let (efd, flag) = (efd.clone(), flag.clone());
        std::thread::spawn(move || -> std::io::Result<()> {
            affinity::pin_current_thread(cpus[1])?;
            for i in 0..count as u64 {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into `v` from a descriptor we keep open.
                if unsafe { libc::read(efd.as_raw_fd(), (&raw mut v).cast(), 8) } != 8 {
                    return Err(std::io::Error::last_os_error());
                }
                flag.0.store(i + 1, Ordering::Release);
            }
            Ok(())
        })
    };
    let timed = std::thread::spawn(move || -> std::io::Result<Vec<f64>> {
        affinity::pin_current_thread(cpus[0])?;
        let mut samples = Vec::with_capacity(count);
        for i in 0..count as u64 {
            std::thread::sleep(gap);
            let start = Instant::now();
            let one = 1u64;
            // SAFETY: writes 8 bytes from `one` to a descriptor we keep open.
            if unsafe { libc::write(efd.as_raw_fd(), (&raw const one).cast(), 8) } != 8 {
                return Err(std::io::Error::last_os_error());
            }
            while flag.0.load(Ordering::Acquire) != i + 1 {
                std::hint::spin_loop();
            }
            samples.push(start.elapsed().as_secs_f64());
        }
        Ok(samples)
    });
    let samples = timed.join().map_err(|_| "the wake-up thread panicked")??;
    sleeper.join().map_err(|_| "the sleeping thread panicked")??;
    Ok(samples)
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
            let settings = ferrocomm::Settings::builder().progress(ferrocomm::ProgressMode::BusyPoll).build();
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
