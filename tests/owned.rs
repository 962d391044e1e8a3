//! The owned collectives (`allreduce_owned`, `broadcast_owned`, `reduce_owned`,
//! `reduce_scatter_owned`, `scan_owned`): results on every path (the default table, the
//! shared-memory board, single copy, TCP) with each call `tokio::spawn`ed; a spawned all-reduce
//! that provably overlaps a computation; calls ordered as made, not as first polled; owned calls
//! dropped unpolled; and, at compile time, that every public future of the facade is `Send` (and
//! the owned ones `'static`).

mod coll;

use std::time::Duration;

use ferrocomm::{
    Comm, Error, InvalidArgument, ProgressMode, ReduceOp, Settings, Source, TagMatch, TransportChoice, testing,
};

const T: Duration = Duration::from_secs(60);

fn shm() -> Settings {
    Settings::builder().progress(ProgressMode::Adaptive(Duration::from_micros(20))).build()
}

fn busy() -> Settings {
    Settings::builder().progress(ProgressMode::BusyPoll).build()
}

fn tcp() -> Settings {
    shm().into_builder().transports(TransportChoice::Tcp).build()
}

/// Wrapping element-wise sum of `input(r, count)` over `ranks`.
fn sum(count: usize, ranks: std::ops::Range<u32>) -> Vec<u64> {
    let mut acc = vec![0u64; count];
    for r in ranks {
        acc.iter_mut().zip(coll::input(r, count)).for_each(|(a, x)| *a = a.wrapping_add(x));
    }
    acc
}

/// Spawns `f` on the runtime and waits for it: proof that its future is `Send + 'static`.
async fn spawned<R: Send + 'static>(f: impl Future<Output = R> + Send + 'static) -> R {
    tokio::time::timeout(T, tokio::spawn(f)).await.expect("within the deadline").expect("the task ran")
}

/// Every owned form, each call spawned, against a sequential reference.
async fn owned_forms(c: &Comm, counts: &[usize], label: &str) {
    let (r, n) = (c.rank(), c.size());
    for &count in counts {
        let ctx = format!("{label} n={n} count={count} rank {r}");
        let got = spawned(c.allreduce_owned(coll::input(r, count), ReduceOp::Sum)).await.unwrap();
        assert_eq!(got, sum(count, 0..n), "allreduce_owned {ctx}");
        for root in [0, n - 1] {
            let buf = if r == root { coll::input(root, count) } else { vec![0; count] };
            let got = spawned(c.broadcast_owned(root, buf)).await.unwrap();
            assert_eq!(got, coll::input(root, count), "broadcast_owned root {root} {ctx}");
        }
        let root = n / 2;
        let got = spawned(c.reduce_owned(root, coll::input(r, count), ReduceOp::Sum)).await.unwrap();
        assert_eq!(got, (r == root).then(|| sum(count, 0..n)), "reduce_owned {ctx}");
        let parts: Vec<usize> = (0..n as usize).map(|i| count / n as usize + i % 2).collect();
        let total: usize = parts.iter().sum();
        let got = spawned(c.reduce_scatter_owned(coll::input(r, total), &parts, ReduceOp::Sum)).await.unwrap();
        let start: usize = parts[..r as usize].iter().sum();
        assert_eq!(got, sum(total, 0..n)[start..start + parts[r as usize]], "reduce_scatter_owned {ctx}");
        let got = spawned(c.scan_owned(coll::input(r, count.min(5_000)), ReduceOp::Sum)).await.unwrap();
        assert_eq!(got, sum(count.min(5_000), 0..r + 1), "scan_owned {ctx}");
    }
    // Wrong arguments are typed errors, as in place.
    let bad = spawned(c.reduce_scatter_owned(vec![1u64; 3], &[1], ReduceOp::Sum)).await;
    let want = if n == 1 {
        InvalidArgument::CountSum { sum: 1, len: 3 }
    } else {
        InvalidArgument::CountMismatch { expected: n as usize, got: 1 }
    };
    assert!(
        matches!(&bad, Err(e) if matches!(e.error, Error::Invalid(got) if got == want) && e.buffer == [1; 3]),
        "{bad:?}"
    );
    c.barrier().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_forms_on_every_path() {
    for n in [1, 2, 3, 4] {
        testing::run(n, shm(), |w| async move {
            owned_forms(&w, &coll::TABLE_COUNTS, "table").await;
            owned_forms(&coll::on_board(&w), &coll::BOARD_COUNTS, "board").await;
            owned_forms(&coll::single_copy(&w), &coll::SINGLE_COPY_COUNTS, "single copy").await;
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
    testing::run(3, tcp(), |w| async move {
        owned_forms(&w, &coll::TABLE_COUNTS, "tcp").await;
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// A deterministic computation to overlap with: the sum of `i * i` over `0..k`, wrapping.
fn compute(k: u64) -> u64 {
    (0..k).fold(0u64, |a, i| a.wrapping_add(std::hint::black_box(i.wrapping_mul(i))))
}

/// Ranks 1.. spawn an all-reduce, then compute while it is in flight: it cannot have completed
/// when their computation ends, because rank 0 joins the all-reduce only after every other rank
/// has told it that its computation ended. Both results are right. No clock is read.
async fn spawned_allreduce_overlaps_computation(c: Comm) {
    let (r, n) = (c.rank(), c.size());
    const COUNT: usize = 50_000;
    if r == 0 {
        for _ in 1..n {
            let m = c.recv(Source::Any, TagMatch::Exact(7)).await.unwrap();
            assert_eq!(m.data[..], compute(1 << 20).to_le_bytes(), "rank {}'s computation", m.source);
        }
    }
    let pending = tokio::spawn(c.allreduce_owned(coll::input(r, COUNT), ReduceOp::Sum));
    if r > 0 {
        let done = compute(1 << 20);
        assert!(!pending.is_finished(), "rank {r}: the all-reduce completed without rank 0");
        c.send(0, 7, done.to_le_bytes().to_vec()).await.unwrap();
    }
    let got = tokio::time::timeout(T, pending).await.unwrap().unwrap().unwrap();
    assert_eq!(got, sum(COUNT, 0..n), "rank {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_allreduce_overlaps_a_computation() {
    for (settings, label) in [(shm(), "shm"), (busy(), "board"), (tcp(), "tcp")] {
        eprintln!("{label}");
        testing::run(3, settings, |w| async move {
            spawned_allreduce_overlaps_computation(w.comm().clone()).await;
            spawned_allreduce_overlaps_computation(coll::single_copy(&w)).await;
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
}

/// Buckets all-reduced as a training loop does: each spawned as soon as it is ready, one
/// in-place call made between them, and the results awaited in an order that differs between
/// ranks. The calls pair up across ranks in the order they were made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_calls_keep_the_order_they_were_made_in() {
    for settings in [shm(), busy()] {
        testing::run(4, settings, |w| async move {
            let (r, n) = (w.rank(), w.size());
            let sizes = [10usize, 3_000, 20_000, 100];
            let mut pending: Vec<_> = sizes
                .iter()
                .enumerate()
                .map(|(b, &len)| tokio::spawn(w.allreduce_owned(coll::input(r * 10 + b as u32, len), ReduceOp::Sum)))
                .collect();
            let mut inplace = coll::input(r, 777);
            let call = w.allreduce(&mut inplace, ReduceOp::Sum);
            let last = tokio::spawn(w.scan_owned(coll::input(r, 5), ReduceOp::Sum));
            if r % 2 == 1 {
                pending.reverse();
            }
            call.await.unwrap();
            assert_eq!(inplace, sum(777, 0..n));
            for p in pending {
                let got = p.await.unwrap().unwrap();
                let b = sizes.iter().position(|&s| s == got.len()).unwrap();
                let mut want = vec![0u64; got.len()];
                for q in 0..n {
                    let x = coll::input(q * 10 + b as u32, got.len());
                    want.iter_mut().zip(x).for_each(|(a, x)| *a = a.wrapping_add(x));
                }
                assert_eq!(got, want, "bucket {b} rank {r}");
            }
            assert_eq!(last.await.unwrap().unwrap(), sum(5, 0..r + 1));
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
}

/// Owned calls dropped before their first poll (on every rank) free their buffers and leave the
/// communicator usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_owned_calls_leave_the_communicator_usable() {
    for settings in [shm(), busy()] {
        testing::run(3, settings, |w| async move {
            let (r, n) = (w.rank(), w.size());
            for count in [1usize, 9_000] {
                drop(w.allreduce_owned(coll::input(r, count), ReduceOp::Sum));
                drop(w.broadcast_owned(0, coll::input(r, count)));
                drop(w.reduce_owned(0, coll::input(r, count), ReduceOp::Sum));
                let got = spawned(w.allreduce_owned(coll::input(r, count), ReduceOp::Sum)).await.unwrap();
                assert_eq!(got, sum(count, 0..n), "count {count} rank {r}");
            }
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
}

/// A failed owned call gives the caller's buffer back with the error, element for element: each
/// form with arguments that cannot work, and an all-reduce whose peer left before joining it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_owned_calls_return_the_buffer() {
    for (settings, label) in [(shm(), "shm"), (tcp(), "tcp")] {
        testing::run(2, settings, move |w| async move {
            let (r, n) = (w.rank(), w.size());
            let ints = coll::input(r, 1000);
            let floats: Vec<f64> = (0..1000).map(|i| f64::from(i) + 0.5).collect();
            let ctx = format!("{label} rank {r}");
            let unsupported =
                |e: &Error, want| matches!(e, Error::Invalid(InvalidArgument::UnsupportedOp { op, element: "f64" }) if *op == want);

            let e = spawned(w.allreduce_owned(floats.clone(), ReduceOp::BitAnd)).await.unwrap_err();
            assert!(unsupported(&e.error, "BitAnd"), "{e:?} {ctx}");
            assert_eq!(e.buffer, floats, "allreduce_owned {ctx}");
            let e = spawned(w.broadcast_owned(n + 3, ints.clone())).await.unwrap_err();
            assert!(matches!(e.error, Error::UnknownRank { rank, size } if rank == n + 3 && size == n), "{e:?} {ctx}");
            assert_eq!(e.buffer, ints, "broadcast_owned {ctx}");
            let e = spawned(w.reduce_owned(n, ints.clone(), ReduceOp::Sum)).await.unwrap_err();
            assert!(matches!(e.error, Error::UnknownRank { .. }), "{e:?} {ctx}");
            assert_eq!(e.buffer, ints, "reduce_owned {ctx}");
            let e = spawned(w.reduce_scatter_owned(ints.clone(), &[500, 400], ReduceOp::Sum)).await.unwrap_err();
            let want = InvalidArgument::CountSum { sum: 900, len: 1000 };
            assert!(matches!(e.error, Error::Invalid(got) if got == want), "{e:?} {ctx}");
            assert_eq!(e.buffer, ints, "reduce_scatter_owned {ctx}");
            let e = spawned(w.scan_owned(floats.clone(), ReduceOp::BitXor)).await.unwrap_err();
            assert!(unsupported(&e.error, "BitXor"), "{e:?} {ctx}");
            assert_eq!(e.buffer, floats, "scan_owned {ctx}");
            // `?` makes it an `Error`.
            let plain: Error = e.into();
            assert!(unsupported(&plain, "BitXor"), "{plain:?}");

            // The communicator is still usable; then rank 1 leaves, and rank 0's all-reduce, which
            // rank 1 never joins, fails naming it, with rank 0's buffer.
            w.barrier().await.unwrap();
            if r == 1 {
                w.finalize().await.unwrap();
                return;
            }
            let e = spawned(w.allreduce_owned(ints.clone(), ReduceOp::Sum)).await.unwrap_err();
            assert!(matches!(e.error, Error::PeerLost { rank: 1, .. }), "{e:?} {ctx}");
            assert_eq!(e.buffer, ints, "allreduce_owned after a departure {ctx}");
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
}

/// Compile-time checks: every public future of the facade is `Send`, and the owned collectives'
/// are `'static` too. Nothing here runs; it only has to compile.
#[allow(dead_code, unused_must_use, clippy::let_underscore_future)]
mod send {
    use std::time::Duration;

    use bytes::Bytes;
    use ferrocomm::multicast::{self, Channel, TokenBarrier};
    use ferrocomm::{Comm, Deadline, ReduceOp, RemoteSegment, Segment, World};

    fn assert_send<T: Send>(_: &T) {}
    fn assert_spawnable<T: Send + 'static>(_: &T) {}

    fn bootstrap() {
        assert_send(&ferrocomm::init());
        assert_send(&ferrocomm::init_with(ferrocomm::Settings::default()));
        assert_send(&ferrocomm::testing::cluster(2, Default::default()));
        assert_send(&ferrocomm::testing::run(2, Default::default(), |w| async move { drop(w) }));
        let token = [0u8; 32];
        assert_send(&ferrocomm::bootstrap::join(0, 1, "127.0.0.1:1", token, None, Default::default()));
        assert_send(&ferrocomm::bootstrap::kv::KvServer::start("127.0.0.1:0".parse().unwrap(), token));
        assert_send(&ferrocomm::bootstrap::kv::KvClient::connect("127.0.0.1:1", &token, Duration::from_secs(1)));
    }

    fn store(mut kv: ferrocomm::bootstrap::kv::KvClient) {
        assert_send(&kv.put("k", b"v"));
        assert_send(&kv.get("k", Duration::from_secs(1)));
    }

    fn world(w: World) {
        assert_send(&w.clone().finalize());
    }

    fn point_to_point(c: &Comm) {
        assert_spawnable(&c.send(0, 1, Bytes::new()));
        assert_spawnable(&c.send_from(0, 1, b"x"));
        assert_spawnable(&c.recv(0, 1u64));
        assert_spawnable(&c.recv_into(0, 1u64, bytes::BytesMut::new()));
        assert_spawnable(&c.probe(0, 1u64));
        assert_send(&c.sendrecv(0, 1, Bytes::new(), 0, 1u64));
        assert_send(&c.split(Some(0), 0));
        assert_send(&c.recv(0, 1u64).timeout(Duration::from_secs(1)));
    }

    fn collectives(c: &Comm, buf: &mut [f32], data: &[f32]) {
        assert_spawnable(&c.barrier());
        assert_send(&c.broadcast(0, &mut *buf));
        assert_spawnable(&c.broadcast_bytes(0, None));
        assert_send(&c.reduce(0, data, ReduceOp::Sum));
        assert_send(&c.reduce_into(0, data, Some(&mut *buf), ReduceOp::Sum));
        assert_spawnable(&c.gather(0, data));
        assert_send(&c.gather_into(0, data, Some(&mut *buf)));
        assert_spawnable(&c.gatherv(0, data));
        assert_spawnable(&c.gather_bytes(0, Bytes::new()));
        assert_spawnable(&c.scatter(0, Some(data)));
        assert_send(&c.scatter_into(0, Some(data), &mut *buf));
        assert_spawnable(&c.scatterv::<f32>(0, None));
        assert_spawnable(&c.scatter_bytes(0, None));
        assert_send(&c.allreduce(&mut *buf, ReduceOp::Sum));
        assert_spawnable(&c.allgather(data));
        assert_send(&c.allgather_into(data, &mut *buf));
        assert_spawnable(&c.allgatherv(data));
        assert_spawnable(&c.allgather_bytes(Bytes::new()));
        assert_spawnable(&c.alltoall(data));
        assert_send(&c.alltoall_into(data, &mut *buf));
        assert_spawnable(&c.alltoallv::<f32>(&[]));
        assert_spawnable(&c.alltoall_bytes(Vec::new()));
        assert_spawnable(&c.reduce_scatter(data, &[1], ReduceOp::Sum));
        assert_spawnable(&c.reduce_scatter_block(data, ReduceOp::Sum));
        assert_send(&c.scan(&mut *buf, ReduceOp::Sum));
        assert_spawnable(&c.exscan(data, ReduceOp::Sum));
        // The owned forms: spawnable.
        assert_spawnable(&c.allreduce_owned(vec![0f32], ReduceOp::Sum));
        assert_spawnable(&c.broadcast_owned(0, vec![0f32]));
        assert_spawnable(&c.reduce_owned(0, vec![0f32], ReduceOp::Sum));
        assert_spawnable(&c.reduce_scatter_owned(vec![0f32], &[1], ReduceOp::Sum));
        assert_spawnable(&c.scan_owned(vec![0f32], ReduceOp::Sum));
    }

    fn one_sided(c: &World, seg: Segment, queue: ferrocomm::RemoteQueue, remote: &RemoteSegment, buf: &mut [u8]) {
        assert_send(&c.attach(seg.id()));
        assert_spawnable(&c.put(remote, 0, b"x"));
        assert_spawnable(&c.put_notify(remote, 0, b"x"));
        assert_spawnable(&c.notify(remote));
        assert_send(&c.get(remote, 0, buf));
        assert_spawnable(&c.fetch_add(remote, 0, 1));
        assert_spawnable(&c.compare_and_swap(remote, 0, 0, 1));
        assert_spawnable(&c.swap(remote, 0, 1));
        assert_spawnable(&c.add(remote, 0, 1));
        assert_spawnable(&c.fence(remote));
        assert_spawnable(&c.enqueue(remote, b"x"));
        let ev = c.event();
        assert_spawnable(&ev.wait_all());
        assert_spawnable(&seg.wait_notifications(1));
        assert_spawnable(&queue.dequeue());
        assert_send(&queue.stream());
        assert_send(&queue.unpublish());
        assert_send(&seg.unpublish());
    }

    fn multicast(c: &Comm, chan: &Channel, barrier: &TokenBarrier) {
        assert_send(&Channel::new(c));
        assert_send(&chan.send(Bytes::new()));
        assert_send(&chan.recv(0));
        assert_send(&chan.recv_any());
        assert_send(&chan.flush());
        assert_send(&chan.wait_group(Duration::from_secs(1)));
        assert_send(&multicast::broadcast(chan, 0, None));
        assert_send(&chan.stream(0));
        assert_send(&TokenBarrier::new(c));
        assert_send(&barrier.wait());
    }
}
