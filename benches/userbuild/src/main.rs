//! Shared-memory ping-pong at 8 B and 64 KiB between two ranks, as an application would write it:
//! `ferrocomm::init_with` under its own launcher, busy-poll progress, `send_from` a borrowed slice
//! and `recv_into` one reused buffer. The same source is built twice, to see whether an
//! application's build matches ferrocomm's own: as the crate beside this file (outside the
//! workspace, Cargo's default release profile) and as ferrocomm-bench's `userbuild-pingpong`
//! (the workspace's release profile: fat LTO, one codegen unit, aborting panics, and the bench's
//! inline threshold).
//!
//! Usage: `ferrocomm-userbuild [LABEL]`, with `USERBUILD_CPUS=A,B` (default `0,1`) the CPUs the
//! two ranks are pinned to. Rank 0 prints one line: the label, then each size's median one-way
//! latency over the timed batches and, for 64 KiB, its throughput.

use std::time::Instant;

use bytes::BytesMut;
use ferrocomm::{ProgressMode, Settings, World};

/// The sizes measured: the latency point and the bandwidth point of the goals.
const SIZES: [usize; 2] = [8, 64 << 10];
/// Timed batches per size, after one untimed warm-up batch.
const BATCHES: usize = 21;
/// Round trips per batch: about 10-50 ms of work per batch at each size.
const TRIPS: [u32; 2] = [20_000, 2_000];
const TAG: u64 = 7;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> Result<()> {
    // Outside a job: become the launcher of two copies of this program (same arguments).
    ferrorun::launch_self(2)?;
    let rank: usize = std::env::var("FERROCOMM_RANK")?.parse()?;
    let cpus = std::env::var("USERBUILD_CPUS").unwrap_or_else(|_| "0,1".into());
    let cpu: usize = cpus.split(',').nth(rank).ok_or("USERBUILD_CPUS needs two CPUs")?.trim().parse()?;
    // Pinned first of all, so that every thread started from here on (ferrocomm's progress
    // thread included) inherits the CPU.
    pin(cpu)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(std::env::args().nth(1).unwrap_or_else(|| "user build".into())))
}

async fn run(label: String) -> Result<()> {
    let settings = Settings::from_env()?.into_builder().progress(ProgressMode::BusyPoll).build();
    let world = ferrocomm::init_with(settings).await?;
    if world.size() != 2 {
        return Err("the ping-pong runs with exactly 2 ranks".into());
    }
    let payload: Vec<u8> = (0..SIZES[1]).map(|i| (i % 251) as u8).collect();
    let mut buf = BytesMut::zeroed(SIZES[1]);
    let mut line = label;
    world.barrier().await?;
    for (&size, &trips) in SIZES.iter().zip(&TRIPS) {
        let mut one_way = Vec::with_capacity(BATCHES);
        for batch in 0..=BATCHES {
            let start = Instant::now();
            for _ in 0..trips {
                buf = round_trip(&world, &payload[..size], buf).await?;
            }
            if batch > 0 {
                one_way.push(start.elapsed().as_secs_f64() / f64::from(trips) / 2.0);
            }
        }
        if buf[..size] != payload[..size] {
            return Err(format!("a wrong message of {size} bytes").into());
        }
        one_way.sort_by(f64::total_cmp);
        let median = one_way[one_way.len() / 2];
        line += &format!("; {size} B {:.3} us", median * 1e6);
        if size > 8 {
            line += &format!(" ({:.2} GB/s)", size as f64 / median / 1e9);
        }
    }
    if world.rank() == 0 {
        println!("{line}");
    }
    world.finalize().await?;
    Ok(())
}

/// One round trip: rank 0 sends `data` and receives it back into `buf`; rank 1 receives, then
/// sends it back. Returns the buffer for the next one.
async fn round_trip(world: &World, data: &[u8], mut buf: BytesMut) -> Result<BytesMut> {
    let peer = 1 - world.rank();
    buf.resize(data.len(), 0);
    if world.rank() == 0 {
        world.send_from(peer, TAG, data).await?;
        Ok(world.recv_into(peer, TAG, buf).await?.0)
    } else {
        let (buf, _) = world.recv_into(peer, TAG, buf).await?;
        world.send_from(peer, TAG, &buf).await?;
        Ok(buf)
    }
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) -> Result<()> {
    // SAFETY: `cpu_set_t` is plain data, for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(format!("CPU {cpu} is out of range").into());
    }
    // SAFETY: CPU_SET writes inside `set` for any `cpu` below CPU_SETSIZE, checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 names the calling thread.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(format!("cannot pin to CPU {cpu}: {}", std::io::Error::last_os_error()).into());
    }
    Ok(())
}
