//! ferrocomm in one file: `cargo run --release --example quickstart`.
//!
//! Started by hand, it launches itself as 4 local ranks (the same launcher as `ferrorun -n 4`).
//! Each rank then passes a token around a ring, rank 0 takes a storm of messages from everyone with
//! a wildcard receive, and rank 1 sends rank 0 a 64 MiB buffer by rendezvous straight into a
//! posted buffer. Then the ranks await collectives: an all-reduce of a 1 Mi-element vector, a
//! broadcast, an all-gather and an all-to-all, each checked. Rank 0 prints a short report.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ferrocomm::{Deadline, Operation, ReduceOp, Source, TagMatch};

const RANKS: u32 = 4;
const STORM: u32 = 1000;
const LARGE: usize = 64 << 20;

fn main() {
    // Outside a job: become the launcher of RANKS copies of ourselves.
    ferrorun::launch_self(RANKS).expect("launch");
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    if let Err(e) = rt.block_on(rank_main()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn rank_main() -> Result<(), Box<dyn std::error::Error>> {
    let world = ferrocomm::init().await?;
    let (rank, size) = (world.rank(), world.size());
    let limit = Duration::from_secs(60);

    // 1. A token travels around the ring, each rank adding its number.
    let t0 = Instant::now();
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    if rank == 0 {
        world.send(next, 1, Bytes::from(0u64.to_le_bytes().to_vec())).timeout(limit).await?;
    }
    let token = world.recv(prev, 1u64).timeout(limit).await?;
    let sum = u64::from_le_bytes(token.data[..8].try_into().unwrap()) + rank as u64;
    if rank != 0 {
        world.send(next, 1, Bytes::from(sum.to_le_bytes().to_vec())).timeout(limit).await?;
    }
    let ring = t0.elapsed();

    // 2. Wildcard storm: everyone fires STORM messages at rank 0, which takes them as they come.
    world.barrier().await?;
    let t1 = Instant::now();
    let mut per_source = vec![0u32; size as usize];
    if rank == 0 {
        for _ in 0..STORM * (size - 1) {
            let m = world.recv(Source::Any, TagMatch::Any).timeout(limit).await?;
            assert_eq!(m.tag, per_source[m.source as usize] as u64, "messages from one rank stay in order");
            per_source[m.source as usize] += 1;
        }
    } else {
        let sends: Vec<_> = (0..STORM).map(|i| world.send(0, i as u64, vec![rank as u8; 64])).collect();
        for s in futures::future::join_all(sends).await {
            s?;
        }
    }
    let storm = t1.elapsed();

    // 3. A large rendezvous transfer into a posted buffer. Both buffers are written before the
    // clock starts (their pages then exist), and the content is checked after it stops: the time
    // is the transfer's alone.
    let payload = Bytes::from(vec![0xa5u8; if rank == 1 { LARGE } else { 0 }]);
    let mut into = BytesMut::new();
    if rank == 0 {
        into.resize(LARGE, 0x5a);
    }
    world.barrier().await?;
    let t2 = Instant::now();
    let mut received = None;
    if rank == 1 {
        world.send(0, 9, payload).timeout(limit).await?;
    } else if rank == 0 {
        received = Some(world.recv_into(1, 9u64, into).timeout(limit).await?);
    }
    let large = t2.elapsed();
    let large_ok = received.is_none_or(|(buf, status)| status.len == LARGE && buf.iter().all(|&b| b == 0xa5));
    world.barrier().await?;

    // 4. Collectives, awaited like any future.
    let t3 = Instant::now();
    let mut v: Vec<f64> = (0..1 << 20).map(|i| (i % 7) as f64 + rank as f64).collect();
    world.allreduce(&mut v, ReduceOp::Sum).timeout(limit).await?;
    let ranks_sum: f64 = (0..size).map(f64::from).sum();
    let mut coll_ok = v.iter().enumerate().all(|(i, &x)| x == (i % 7) as f64 * size as f64 + ranks_sum);
    let mut cfg = if rank == 2 { [7u32, 11, 13] } else { [0; 3] };
    world.broadcast(2, &mut cfg).timeout(limit).await?;
    coll_ok &= cfg == [7, 11, 13];
    let gathered = world.allgather(&[rank * 10]).timeout(limit).await?;
    coll_ok &= gathered == (0..size).map(|r| r * 10).collect::<Vec<_>>();
    let sent: Vec<u32> = (0..size).map(|d| rank * 100 + d).collect();
    let got = world.alltoall(&sent).timeout(limit).await?;
    coll_ok &= got == (0..size).map(|s| s * 100 + rank).collect::<Vec<_>>();
    let colls = t3.elapsed();
    let alg = world.collective_algorithm(Operation::Allreduce, 8 << 20);

    if rank == 0 {
        let expect: u64 = (0..size as u64).sum();
        println!("ferrocomm quickstart: {size} ranks over {}", world.transport_name());
        println!("  ring       token sum {sum} (expected {expect}) in {ring:.2?}");
        println!(
            "  storm      {} messages from {} ranks by wildcard receive in {storm:.2?} ({:.0} msg/s), per-source order kept: {:?}",
            STORM * (size - 1),
            size - 1,
            (STORM * (size - 1)) as f64 / storm.as_secs_f64(),
            &per_source[1..]
        );
        println!(
            "  rendezvous {} MiB rank 1 -> rank 0 in {large:.2?} ({:.0} MB/s), content {}",
            LARGE >> 20,
            LARGE as f64 / large.as_secs_f64() / 1e6,
            if large_ok { "verified" } else { "WRONG" }
        );
        println!(
            "  collectives all-reduce of 8 MiB ({alg}), broadcast, all-gather, all-to-all in {colls:.2?}, results {}",
            if coll_ok { "verified" } else { "WRONG" }
        );
        assert!(sum == expect && large_ok);
    }
    if !coll_ok {
        return Err(format!("rank {rank}: a collective result is wrong").into());
    }
    Ok(world.finalize().await?)
}
