//! Collectives over real transports with all ranks in this process: every operation and every
//! algorithm for 1..=9 and 16 ranks over shared memory, a TCP run, skewed entry, concurrent
//! collectives on one and several communicators, split, cancellation and deadlines.

mod coll;

use std::time::{Duration, Instant};

use ferrocomm::{Algorithm, Deadline, Error, Operation, ProgressMode, ReduceOp, Settings, TransportChoice, testing};

fn shm() -> Settings {
    Settings::builder().progress(ProgressMode::Adaptive(Duration::from_micros(20))).build()
}

fn tcp() -> Settings {
    shm().into_builder().transports(TransportChoice::Tcp).build()
}

async fn suite(n: u32, settings: Settings, pinned: bool) {
    testing::run(n, settings, move |w| async move {
        coll::operations(&w, &coll::TABLE_COUNTS, "table").await;
        if pinned {
            coll::every_algorithm(&w).await;
        }
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_every_rank_count_shm() {
    for n in (1..=9).chain([16]) {
        let t = Instant::now();
        suite(n, shm(), true).await;
        eprintln!("{n} ranks: {:?}", t.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_over_tcp() {
    for n in [2, 3, 5] {
        suite(n, tcp(), false).await;
    }
}

/// Busy-polling ranks on one host take the shared-memory board for small barriers, broadcasts
/// and all-reduces by default, with right results on every rank count (calls split into pieces
/// included); larger calls keep the table's algorithms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_board_by_default_when_busy() {
    let busy = Settings::builder().progress(ProgressMode::BusyPoll).build();
    for n in (1..=9).chain([16]) {
        testing::run(n, busy.clone(), move |w| async move {
            let board = if n > 1 { Algorithm::SharedMemory } else { Algorithm::RecursiveDoubling };
            assert_eq!(w.collective_algorithm(Operation::Allreduce, 8), board);
            assert_eq!(
                w.collective_algorithm(Operation::Barrier, 0),
                if n > 1 { board } else { Algorithm::Dissemination }
            );
            let above = w.collective_table().shared_limit(Operation::Allreduce, n) + 1;
            assert_ne!(w.collective_algorithm(Operation::Allreduce, above), Algorithm::SharedMemory);
            coll::operations(&w, &coll::BOARD_COUNTS, "board").await;
            // Scatters either side of the board's and single copy's thresholds: single copy
            // takes over right above the board.
            let scatter = |bytes| w.collective_algorithm(Operation::Scatter, bytes);
            if (2..=8).contains(&n) {
                assert_eq!(scatter(8 << 10), Algorithm::SharedMemory);
                assert_eq!(scatter((8 << 10) + 8), Algorithm::SingleCopy);
                assert_eq!(scatter(64 << 10), Algorithm::SingleCopy);
            }
            coll::rooted_into_thresholds(&w, "default").await;
            // An all-gather of 72 KB per rank: two pieces on the board.
            let c = coll::on_board(&w);
            let all: Vec<u64> = (0..n).flat_map(|r| coll::input(r, 9_000)).collect();
            assert_eq!(c.allgather(&coll::input(w.rank(), 9_000)).await.unwrap(), all);
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
    // Adaptive ranks keep the message-based algorithms unless pinned.
    testing::run(2, shm(), |w| async move {
        assert_eq!(w.collective_algorithm(Operation::Allreduce, 8), Algorithm::RecursiveDoubling);
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// Busy-polling ranks on one host copy large broadcasts and all-reduces straight from each other's
/// memory by default (single copy), with right results; a rank that drops such a call with its
/// memory lent makes the others' call fail with a typed error (never keeping data read from
/// memory that may have changed), later calls awaited while a single-copy call is held unpolled
/// complete, and the communicator's next calls work for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_copy_by_default_for_large_calls_when_busy() {
    let busy = Settings::builder().progress(ProgressMode::BusyPoll).build();
    for n in [1, 2, 3, 5] {
        testing::run(n, busy.clone(), move |w| async move {
            let large = w.collective_table().single_copy_from(Operation::Allreduce, n);
            let want = if n > 1 { Algorithm::SingleCopy } else { Algorithm::RecursiveDoubling };
            assert_eq!(w.collective_algorithm(Operation::Allreduce, large), want);
            assert_ne!(w.collective_algorithm(Operation::Allreduce, large - 8), Algorithm::SingleCopy);
            coll::operations(&w, &[40_000, 131_075], "default").await;
            coll::scans(&w, &[40_000], "default").await;
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
    testing::run(3, shm(), |w| async move {
        let c = coll::single_copy(&w);
        let r = c.rank();
        let ten = Duration::from_secs(10);
        assert_eq!(c.collective_algorithm(Operation::Allreduce, 8), Algorithm::SingleCopy);
        // Rank 0 lends its buffer (the call is made) and drops the call before its first poll.
        let mut v = vec![r as u64 + 1; 50_000];
        if r == 0 {
            drop(c.allreduce(&mut v, ReduceOp::Sum));
        } else {
            let e = c.allreduce(&mut v, ReduceOp::Sum).timeout(ten).await;
            assert!(matches!(e, Err(Error::Collective(ferrocomm::CollError::Withdrawn { .. }))), "{e:?}");
        }
        // The same with an all-gather into a buffer, which lends the caller's slice where it is.
        let mine = vec![r as u64 + 1; 40_000];
        let mut out = vec![0u64; 3 * 40_000];
        if r == 0 {
            drop(c.allgather_into(&mine, &mut out));
        } else {
            let e = c.allgather_into(&mine, &mut out).timeout(ten).await;
            assert!(matches!(e, Err(Error::Collective(ferrocomm::CollError::Withdrawn { .. }))), "{e:?}");
        }
        // And a reduce, whose root reads every rank's data where it is: rank 2 drops its call.
        if r == 2 {
            drop(c.reduce(0, &mine, ReduceOp::Sum));
        } else {
            let e = c.reduce(0, &mine, ReduceOp::Sum).timeout(ten).await;
            let withdrawn = matches!(e, Err(Error::Collective(ferrocomm::CollError::Withdrawn { .. })));
            // The root reads rank 2's data and fails; rank 1 only waits for the root to be done.
            assert!(if r == 0 { withdrawn } else { e.is_ok() || withdrawn }, "{e:?}");
        }
        // A scan down the chain of ranks (320 KB): rank 1 drops its call with its buffer lent.
        // Rank 2 waits for rank 1's prefix and fails; rank 0 reads nothing and ends with the
        // barrier that rank 1's abandoned call still takes part in.
        let mut v = coll::input(r, 40_000);
        if r == 1 {
            drop(c.scan(&mut v, ReduceOp::Sum));
        } else {
            let e = c.scan(&mut v, ReduceOp::Sum).timeout(ten).await;
            let withdrawn = matches!(e, Err(Error::Collective(ferrocomm::CollError::Withdrawn { .. })));
            assert!(if r == 2 { withdrawn } else { e.is_ok() || withdrawn }, "{e:?}");
        }
        // Held unpolled while later calls on the board are awaited: they pass it (up to the
        // board's slots); polled, the held call completes.
        let pins = "allreduce=single-copy,barrier=shared-memory";
        let cb = c.with_collective_table(ferrocomm::Table::default().with_overrides(pins).unwrap());
        let mut v = vec![r as u64 + 1; 50_000];
        let held = cb.allreduce(&mut v, ReduceOp::Sum);
        cb.barrier().timeout(ten).await.unwrap();
        cb.barrier().timeout(ten).await.unwrap();
        held.timeout(ten).await.unwrap();
        assert_eq!(v, vec![6; 50_000]);
        // The next calls work: a broadcast by single copy, a barrier, an all-reduce.
        let mut b = if r == 1 { coll::input(1, 70_000) } else { vec![0; 70_000] };
        c.broadcast(1, &mut b).timeout(ten).await.unwrap();
        assert_eq!(b, coll::input(1, 70_000));
        c.barrier().timeout(ten).await.unwrap();
        let mut v = vec![r as u64 + 1; 50_000];
        c.allreduce(&mut v, ReduceOp::Sum).timeout(ten).await.unwrap();
        assert_eq!(v, vec![6; 50_000]);
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// Single-copy calls dropped by rank 1 before their first poll ([`coll::lending_calls_dropped`]):
/// the others fail promptly with a typed error where they read its memory, and the
/// communicator's next calls work for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lending_calls_dropped_before_their_first_poll() {
    for n in [2, 5] {
        testing::run(n, shm(), |w| async move {
            coll::lending_calls_dropped(&w).await;
            w.finalize().await.unwrap();
        })
        .await
        .unwrap();
    }
}

/// The shared-memory board (pinned; adaptive ranks): calls held unpolled, dropped before or after
/// their first poll, more in flight than the board has slots, and a rank that joins late. A call
/// on the board is carried out by its rank even when its future is gone (defined behaviour: the
/// others get their result as long as that rank keeps using the communicator).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn board_calls_held_dropped_and_late() {
    testing::run(4, shm(), |w| async move {
        let c = coll::on_board(&w);
        let r = c.rank();
        let ten = Duration::from_secs(10);
        assert_eq!(c.collective_algorithm(Operation::Allreduce, 8), Algorithm::SharedMemory);
        // Held: the first all-reduce is polled only after the barrier behind it completed.
        let mut a = vec![r as u64; 4];
        let held = c.allreduce(&mut a, ReduceOp::Sum);
        c.barrier().timeout(ten).await.unwrap();
        held.timeout(ten).await.unwrap();
        assert_eq!(a, vec![6; 4]);
        // Rank 0 drops one all-reduce after its first poll and another before any: the others
        // still get both results.
        for polled in [true, false] {
            let mut v = vec![r as u64 + 1; 10];
            if r == 0 {
                let call = c.allreduce(&mut v, ReduceOp::Sum);
                if polled {
                    // Complete if the others were quicker; dropped unfinished otherwise.
                    let _ = futures::FutureExt::now_or_never(call);
                }
            } else {
                c.allreduce(&mut v, ReduceOp::Sum).timeout(ten).await.unwrap();
                assert_eq!(v, vec![10; 10], "polled {polled}");
            }
        }
        // The last rank to arrive (rank 3, 300 ms late) completes its call when making it: its
        // buffer holds the result before the future is polled, and dropping the future changes
        // nothing (documented on the board's future). The same for a broadcast's late receiver.
        let mut v = vec![r as u64 + 1; 3];
        let mut b = [if r == 0 { 42u32 } else { 0 }; 5];
        if r == 3 {
            let late = Duration::from_millis(300);
            tokio::time::sleep(late).await;
            drop(c.allreduce(&mut v, ReduceOp::Sum));
            tokio::time::sleep(late).await;
            drop(c.broadcast(0, &mut b));
        } else {
            c.allreduce(&mut v, ReduceOp::Sum).timeout(ten).await.unwrap();
            c.broadcast(0, &mut b).timeout(ten).await.unwrap();
        }
        assert_eq!((v, b), (vec![10; 3], [42; 5]), "rank {r}");
        // More calls in flight than slots, awaited newest first.
        let mut bufs: Vec<Vec<u64>> = (0..20).map(|k| vec![k + r as u64; 2]).collect();
        let calls: Vec<_> = bufs.iter_mut().map(|b| c.allreduce(b, ReduceOp::Sum)).collect();
        for call in calls.into_iter().rev() {
            call.timeout(ten).await.unwrap();
        }
        assert!(bufs.iter().enumerate().all(|(k, b)| *b == vec![4 * k as u64 + 6; 2]), "{bufs:?}");
        // Rank 3 joins a barrier 500 ms late: the others time out with a typed error, rank 3 then
        // finds their parts on the board, and the next calls work for everyone.
        if r != 3 {
            let e = c.barrier().timeout(Duration::from_millis(200)).await;
            assert!(matches!(e, Err(Error::Timeout)), "{e:?}");
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.barrier().timeout(ten).await.unwrap();
        }
        c.barrier().timeout(ten).await.unwrap();
        let mut v = [r as f64];
        c.allreduce(&mut v, ReduceOp::Max).timeout(ten).await.unwrap();
        assert_eq!(v, [3.0]);
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// One rank enters 200 ms late; everyone still gets the right result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_entry() {
    testing::run(5, shm(), |w| async move {
        if w.rank() == 3 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut v = coll::input(w.rank(), 1000);
        w.allreduce(&mut v, ReduceOp::Sum).await.unwrap();
        let want: Vec<u64> =
            (0..1000).map(|i| (0..5).map(|r| coll::input(r, 1000)[i]).fold(0u64, |a, x| a.wrapping_add(x))).collect();
        assert_eq!(v, want);
        w.barrier().await.unwrap();
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// Several collectives outstanding at once on one communicator, on a duplicate and on split
/// halves: all complete with their own results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_collectives_and_split() {
    testing::run(6, shm(), |w| async move {
        let (r, n) = (w.rank(), w.size());
        let dup = w.dup().unwrap();
        let half = w.split(Some(r % 2), n - r).await.unwrap().unwrap();
        assert_eq!(half.size(), 3);
        // Keys are descending ranks, so the order is reversed within each colour.
        assert_eq!(half.rank(), 2 - r / 2);
        assert!(w.split(None, 0).await.unwrap().is_none());

        let (mut a, mut b, mut c) = (vec![r as u64; 10], vec![1u64; 50_000], vec![r as u64; 3]);
        let gathered = w.allgather(&[r]);
        let (ra, rb, rc, rg) = futures::join!(
            w.allreduce(&mut a, ReduceOp::Sum),
            dup.allreduce(&mut b, ReduceOp::Sum),
            half.allreduce(&mut c, ReduceOp::Max),
            gathered,
        );
        ra.unwrap();
        rb.unwrap();
        rc.unwrap();
        assert_eq!(a, vec![15; 10]);
        assert_eq!(b, vec![6; 50_000]);
        assert_eq!(c, vec![if r % 2 == 0 { 4 } else { 5 }; 3]);
        assert_eq!(rg.unwrap(), (0..n).collect::<Vec<_>>());
        // Point-to-point on the split communicator speaks its ranks.
        let (right, left) = ((half.rank() + 1) % 3, (half.rank() + 2) % 3);
        let m = half.sendrecv(right, 9, vec![half.rank() as u8], left, 9u64).await.unwrap();
        assert_eq!((m.source, m.data[0] as u32), (left, left));
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// Rank 0 drops an all-reduce after starting it. The others time out on that call (defined
/// behaviour: a collective needs everyone), then the next collective works for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_collective_leaves_the_communicator_usable() {
    testing::run(4, shm(), |w| async move {
        let r = w.rank();
        let mut v = vec![1u64; 100];
        if r == 0 {
            // Started alone (its first messages go out), then dropped.
            let once = futures::FutureExt::now_or_never(w.allreduce(&mut v, ReduceOp::Sum));
            assert!(once.is_none(), "cannot complete without the others");
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let late = w.allreduce(&mut v, ReduceOp::Sum).timeout(Duration::from_millis(300)).await;
            // Ranks that needed nothing more from rank 0 finish; the others time out.
            assert!(matches!(late, Ok(()) | Err(Error::Timeout)), "{late:?}");
        }
        let mut v = vec![r as u64; 100];
        w.allreduce(&mut v, ReduceOp::Sum).timeout(Duration::from_secs(10)).await.unwrap();
        assert_eq!(v, vec![6; 100]);
        w.barrier().await.unwrap();
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// A rank that never joins: the others' deadline fires with a typed error, no hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_when_a_rank_never_joins() {
    testing::run(3, shm(), |w| async move {
        if w.rank() != 2 {
            let t = Instant::now();
            let e = w.barrier().timeout(Duration::from_millis(200)).await;
            assert!(matches!(e, Err(Error::Timeout)), "{e:?}");
            assert!(t.elapsed() < Duration::from_secs(60), "the 200 ms deadline did not end the barrier");
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// Broadcast and barrier pinned to reliable multicast through the selection table: results are
/// right (over UDP multicast on loopback when the group confirms, point-to-point otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multicast_broadcast_and_barrier_from_the_table() {
    testing::run(4, shm(), |w| async move {
        let table = ferrocomm::Table::default().with_overrides("bcast=multicast,barrier=multicast").unwrap();
        let c = w.with_collective_table(table);
        assert_eq!(c.collective_algorithm(ferrocomm::Operation::Bcast, 8), ferrocomm::Algorithm::Multicast);
        for (root, count) in [(0, 1), (2, 1000), (3, 40_000)] {
            let mut buf = if c.rank() == root { coll::input(root, count) } else { vec![0; count] };
            c.broadcast(root, &mut buf).timeout(Duration::from_secs(30)).await.unwrap();
            assert_eq!(buf, coll::input(root, count));
            c.barrier().timeout(Duration::from_secs(30)).await.unwrap();
        }
        drop(c);
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

/// A root that finalizes right after a multicast broadcast does not leave before the others have
/// it: once they hear its goodbye they drop its datagrams still on the way, and nobody would be
/// left to retransmit a lost one. So its finalize returns only after the late ranks consumed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_waits_until_multicast_broadcast_is_consumed() {
    let out = testing::run(3, shm(), |w| async move {
        let table = ferrocomm::Table::default().with_overrides("bcast=multicast").unwrap();
        let c = w.with_collective_table(table);
        let me = c.rank();
        if me != 0 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let started = Instant::now();
        let mut buf = if me == 0 { coll::input(0, 1000) } else { vec![0; 1000] };
        c.broadcast(0, &mut buf).timeout(Duration::from_secs(30)).await.unwrap();
        assert_eq!(buf, coll::input(0, 1000));
        drop(c);
        w.finalize().await.unwrap();
        (me, started, Instant::now())
    })
    .await
    .unwrap();
    let root_left = out.iter().find(|o| o.0 == 0).unwrap().2;
    for &(r, started, _) in out.iter().filter(|o| o.0 != 0) {
        assert!(root_left > started, "rank 0 left before rank {r} started receiving");
    }
}
