//! The one-sided suite, written once and run in-process (tests/rma.rs) and as separate processes
//! under the launcher (tests/rma_multiprocess.rs), over shared memory (segments mapped by the
//! peers) and over TCP (requests served by the target's progress).
#![allow(dead_code)]

use std::time::Duration;

use ferrocomm::{
    Access, ArrayView, Deadline, Error, Geometry, RemoteSegment, RmaError, Segment, SegmentId, Side, World,
};
use futures::StreamExt;

const T: Duration = Duration::from_secs(60);

pub(crate) fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed).to_le_bytes()[1]).collect()
}

/// Every rank's segment id, by rank.
pub(crate) async fn exchange(w: &World, id: SegmentId) -> Vec<SegmentId> {
    let all = w.allgather(&[id.to_u64()]).timeout(T).await.unwrap();
    all.into_iter().map(SegmentId::from_u64).collect()
}

/// Whether the route to `r` is the one the test expects (mapped over shared memory, requests
/// over TCP).
pub(crate) fn check_route(w: &World, r: &RemoteSegment) {
    if r.owner() == w.rank() {
        assert!(r.is_mapped(), "a rank's own segment is always mapped");
        return;
    }
    let route = w.transport_for(r.owner());
    assert_eq!(r.is_mapped(), route == "shm", "route to rank {} over {route}", r.owner());
    // Over verbs the device carries out puts, gets and atomics on windows (not on queues).
    if r.record_len().is_none() {
        assert_eq!(r.is_device(), route == "verbs", "route to rank {} over {route}", r.owner());
    }
}

// Arrays of the geometry test: a 12 x 10 x 4 grid of u64 in each segment, and local tiles.
const DIMS: [usize; 3] = [12, 10, 4];
const ELEM: usize = 8;
const GRID: usize = DIMS[0] * DIMS[1] * DIMS[2] * ELEM;
const LARGE: usize = (3 << 20) + 5;

/// Reference: box `extent` from array `from` (dims, origin) into array `to`, byte by byte.
fn reference_box(src: &[u8], from: ArrayView, dst: &mut [u8], to: ArrayView, extent: [usize; 3]) {
    for z in 0..extent[2] {
        for y in 0..extent[1] {
            for x in 0..extent[0] {
                let at = |v: &ArrayView| {
                    (((v.origin[2] + z) * v.dims[1] + (v.origin[1] + y)) * v.dims[0] + (v.origin[0] + x)) * ELEM
                };
                let (s, d) = (at(&from), at(&to));
                dst[d..d + ELEM].copy_from_slice(&src[s..s + ELEM]);
            }
        }
    }
}

/// Strided and 3-D puts and gets into the next rank's segment, against a reference copy; then a
/// large contiguous put and get (several messages on the emulated path); a batch through an event.
pub(crate) async fn geometries(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let seg = w.publish(GRID + LARGE, Access::GET | Access::PUT).unwrap();
    let ids = exchange(w, seg.id()).await;
    let dst = w.attach(ids[next as usize]).timeout(T).await.unwrap();
    check_route(w, &dst);
    assert_eq!(dst.len(), GRID + LARGE);

    // A 5 x 3 x 2 box from a local 7 x 6 x 3 tile (at 1, 2, 1) into the grid at (6, 4, 1).
    let tile = ArrayView { dims: [7, 6, 3], origin: [1, 2, 1] };
    let at = ArrayView { dims: DIMS, origin: [6, 4, 1] };
    let extent = [5, 3, 2];
    let local = pattern(7 * 6 * 3 * ELEM, r);
    let g = Geometry::sub_array(ELEM, extent, tile, at).unwrap();
    w.put_with(&dst, &g, &local).timeout(T).await.unwrap();
    // Strided: 9 runs of 6 bytes, local stride 10, remote stride 40, into the grid's last plane.
    let strided_src = pattern(100, 1000 + r);
    let plane = GRID - DIMS[0] * DIMS[1] * ELEM;
    let sg = Geometry::strided(6, 9, Side::at(3, 10), Side::at(plane + 7, 40));
    w.put_with(&dst, &sg, &strided_src).timeout(T).await.unwrap();
    w.barrier().timeout(T).await.unwrap();

    // What the previous rank wrote into ours, against the reference.
    let mut want = vec![0u8; GRID];
    reference_box(&pattern(7 * 6 * 3 * ELEM, prev), tile, &mut want, at, extent);
    let s = pattern(100, 1000 + prev);
    for k in 0..9 {
        want[plane + 7 + 40 * k..plane + 13 + 40 * k].copy_from_slice(&s[3 + 10 * k..9 + 10 * k]);
    }
    let mut got = vec![0u8; GRID];
    seg.read(0, &mut got).unwrap();
    assert_eq!(got, want, "rank {r}: the grid that rank {prev} wrote");

    // Get a 4 x 4 x 3 box of the next rank's grid (at 4, 3, 0) into a local 6 x 5 x 3 array at
    // (2, 1, 0): it holds what this rank put there, where the boxes overlap.
    let mut theirs = vec![0u8; GRID];
    reference_box(&local, tile, &mut theirs, at, extent);
    for k in 0..9 {
        theirs[plane + 7 + 40 * k..plane + 13 + 40 * k].copy_from_slice(&strided_src[3 + 10 * k..9 + 10 * k]);
    }
    let from = ArrayView { dims: DIMS, origin: [4, 3, 0] };
    let into = ArrayView { dims: [6, 5, 3], origin: [2, 1, 0] };
    let gg = Geometry::sub_array(ELEM, [4, 4, 3], into, from).unwrap();
    let mut out = vec![0xEEu8; 6 * 5 * 3 * ELEM];
    w.get_with(&dst, &gg, &mut out).timeout(T).await.unwrap();
    let mut expect = vec![0xEEu8; out.len()];
    reference_box(&theirs, from, &mut expect, into, [4, 4, 3]);
    assert_eq!(out, expect, "rank {r}: a 3-D get (bytes outside the box untouched)");

    // Large contiguous put and get, and a get with a strided geometry over it.
    let big = pattern(LARGE, 77 + r);
    w.put(&dst, GRID, &big).timeout(T).await.unwrap();
    let mut back = vec![0u8; LARGE];
    w.get(&dst, GRID, &mut back).timeout(T).await.unwrap();
    assert!(back == big, "rank {r}: large put then get");
    let mut sparse = vec![0u8; 4000];
    let sg = Geometry::strided(3, 1000, Side::at(0, 4), Side::at(GRID + 11, 2999));
    w.get_with(&dst, &sg, &mut sparse).timeout(T).await.unwrap();
    for k in 0..1000 {
        assert_eq!(&sparse[4 * k..4 * k + 3], &big[11 + 2999 * k..14 + 2999 * k], "run {k}");
        assert_eq!(sparse[4 * k + 3], 0, "gap {k} untouched");
    }

    // A batch of 64 puts completes through one event.
    let ev = w.event();
    let mut last = None;
    for i in 0..64usize {
        let v = [i as u8; 16];
        last = Some(w.put(&dst, GRID + i * 16, &v).on(&ev));
    }
    ev.wait(last.unwrap()).timeout(T).await.unwrap();
    assert_eq!(ev.completed(), 64);
    let mut back = vec![0u8; 64 * 16];
    w.get(&dst, GRID, &mut back).timeout(T).await.unwrap();
    for i in 0..64 {
        assert_eq!(&back[i * 16..i * 16 + 16], &[i as u8; 16]);
    }
    w.barrier().timeout(T).await.unwrap();
    seg.unpublish().timeout(T).await.unwrap();
}

/// Every rank hammers one word of rank 0 with fetch-add (awaited one by one, and in a batch on an
/// event) while rank 0's application only looks at its own memory: the sum is exact and the
/// fetched values are all distinct.
pub(crate) async fn fetch_add_sums(w: &World) {
    const EACH: u64 = 300;
    let (r, n) = (w.rank(), w.size());
    let seg = (r == 0).then(|| w.publish(64, Access::ATOMIC | Access::GET).unwrap());
    let id = w.allgather(&[seg.as_ref().map_or(0, |s| s.id().to_u64())]).timeout(T).await.unwrap()[0];
    let target = w.attach(SegmentId::from_u64(id)).timeout(T).await.unwrap();
    check_route(w, &target);
    let want = EACH * u64::from(n) * u64::from(n + 1) / 2;
    let mut seen = Vec::new();
    for _ in 0..EACH / 2 {
        seen.push(w.fetch_add(&target, 8, u64::from(r + 1)).timeout(T).await.unwrap());
    }
    let ev = w.event();
    for _ in EACH / 2..EACH {
        w.add(&target, 8, u64::from(r + 1)).on(&ev);
    }
    ev.wait_all().timeout(T).await.unwrap();
    if let Some(seg) = &seg {
        // No ferrocomm call: the requests are served by the progress task alone.
        let word = seg.word(8).unwrap();
        let t0 = std::time::Instant::now();
        while word.load(std::sync::atomic::Ordering::Acquire) != want {
            assert!(t0.elapsed() < T, "sum stuck at {}", word.load(std::sync::atomic::Ordering::Acquire));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let all = w.allgatherv(&seen).timeout(T).await.unwrap();
    let mut flat: Vec<u64> = all.into_iter().flatten().collect();
    let len = flat.len();
    flat.sort_unstable();
    flat.dedup();
    assert_eq!(flat.len(), len, "every fetch saw a different value");
    w.barrier().timeout(T).await.unwrap();
    let mut v = [0u8; 8];
    let get = w.get(&target, 8, &mut v);
    // On a mapping the call itself copies the data.
    assert!(get.is_complete() || !target.is_mapped(), "a get on a mapping is complete in its call");
    get.timeout(T).await.unwrap();
    assert_eq!(u64::from_le_bytes(v), want);
    w.barrier().timeout(T).await.unwrap();
}

/// A spin lock made of compare-and-swap guards a counter that is read with get and written with
/// put (no atomic): the count is exact only if the lock excludes.
pub(crate) async fn cas_lock(w: &World) {
    const EACH: u64 = 40;
    let (r, n) = (w.rank(), w.size());
    let host = n - 1;
    let seg = (r == host).then(|| w.publish(64, Access::WINDOW).unwrap());
    let id = w.allgather(&[seg.as_ref().map_or(0, |s| s.id().to_u64())]).timeout(T).await.unwrap()[host as usize];
    let s = w.attach(SegmentId::from_u64(id)).timeout(T).await.unwrap();
    let me = u64::from(r) + 1;
    for _ in 0..EACH {
        while w.compare_and_swap(&s, 0, 0, me).timeout(T).await.unwrap() != 0 {
            tokio::task::yield_now().await;
        }
        let mut c = [0u8; 8];
        w.get(&s, 16, &mut c).timeout(T).await.unwrap();
        let v = u64::from_le_bytes(c) + 1;
        w.put(&s, 16, &v.to_le_bytes()).timeout(T).await.unwrap();
        // The put is complete before the lock is released (issue order on one segment).
        assert_eq!(w.swap(&s, 0, 0).timeout(T).await.unwrap(), me, "the lock was ours");
    }
    w.barrier().timeout(T).await.unwrap();
    let mut c = [0u8; 8];
    w.get(&s, 16, &mut c).timeout(T).await.unwrap();
    assert_eq!(u64::from_le_bytes(c), EACH * u64::from(n));
    w.barrier().timeout(T).await.unwrap();
}

fn rma_err<T: std::fmt::Debug>(r: Result<T, Error>) -> RmaError {
    match r {
        Err(Error::Rma(e)) => e,
        other => panic!("expected a one-sided error, got {other:?}"),
    }
}

/// Out of bounds, not permitted, misaligned, unknown: refused with their typed errors, and the
/// memory is unchanged.
pub(crate) async fn violations(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let owner = 0;
    let content = pattern(256, 5);
    let segs = (r == owner).then(|| {
        (w.publish_from(&content, Access::GET).unwrap(), w.publish_from(&content, Access::GET | Access::PUT).unwrap())
    });
    let ids = w
        .allgather(&segs.as_ref().map_or([0, 0], |(a, b)| [a.id().to_u64(), b.id().to_u64()]))
        .timeout(T)
        .await
        .unwrap();
    let ro = w.attach(SegmentId::from_u64(ids[0])).timeout(T).await.unwrap();
    let rw = w.attach(SegmentId::from_u64(ids[1])).timeout(T).await.unwrap();
    assert_eq!((ro.access(), rw.access()), (Access::GET, Access::GET | Access::PUT));
    let e = rma_err(w.put(&ro, 0, &[1; 8]).await);
    assert_eq!(e, RmaError::NotPermitted { needed: Access::PUT, granted: Access::GET });
    let e = rma_err(w.put(&rw, 250, &[1; 8]).await);
    assert_eq!(e, RmaError::OutOfBounds { offset: 250, len: 8, segment_len: 256 });
    let e = rma_err(w.put(&rw, usize::MAX - 2, &[1; 8]).await);
    assert!(matches!(e, RmaError::OutOfBounds { .. }), "{e:?}");
    let strided = Geometry::strided(8, 10, Side::at(0, 8), Side::at(0, 30));
    let e = rma_err(w.put_with(&rw, &strided, &[1; 80]).await);
    assert_eq!(e, RmaError::OutOfBounds { offset: 0, len: 278, segment_len: 256 }, "the whole geometry's reach");
    let e = rma_err(w.put_with(&rw, &strided, &[1; 79]).await);
    assert!(matches!(e, RmaError::Geometry(_)), "local buffer too short: {e:?}");
    let e = rma_err(w.fetch_add(&rw, 8, 1).await);
    assert_eq!(e, RmaError::NotPermitted { needed: Access::ATOMIC, granted: Access::GET | Access::PUT });
    let mut buf = [0u8; 16];
    let e = rma_err(w.get(&rw, 250, &mut buf).await);
    assert!(matches!(e, RmaError::OutOfBounds { .. }), "{e:?}");
    let e = rma_err(w.enqueue(&rw, &[0; 8]).await);
    assert!(matches!(e, RmaError::NotPermitted { needed: Access::QUEUE, .. }), "{e:?}");
    let atomics = w.publish(64, Access::ATOMIC).unwrap();
    let mine = w.attach(atomics.id()).timeout(T).await.unwrap();
    let e = rma_err(w.fetch_add(&mine, 4, 1).await);
    assert_eq!(e, RmaError::Misaligned { offset: 4 });
    let e = rma_err(w.swap(&mine, 64, 1).await);
    assert!(matches!(e, RmaError::OutOfBounds { .. }), "{e:?}");
    let unknown = SegmentId::from_u64(u64::from((r + 1) % n) << 32 | 999_999);
    let e = rma_err(w.attach(unknown).timeout(T).await);
    assert_eq!(e, RmaError::UnknownSegment { id: unknown });
    let beyond = w.attach(SegmentId::from_u64(u64::from(n) << 32 | 1)).await;
    assert!(matches!(beyond, Err(Error::UnknownRank { .. })), "{beyond:?}");
    w.barrier().timeout(T).await.unwrap();
    if let Some((a, b)) = &segs {
        let mut got = vec![0u8; 256];
        a.read(0, &mut got).unwrap();
        assert_eq!(got, content, "read-only segment unchanged");
        b.read(0, &mut got).unwrap();
        assert_eq!(got, content, "segment unchanged by refused operations");
    }
    w.barrier().timeout(T).await.unwrap();
}

/// Many producers enqueue into one small remote queue (flow control: it fills up) and put data
/// with notify; the owner takes every record, in each producer's order, as a stream, and learns
/// of the data by its notification counter.
pub(crate) async fn queues_and_notify(w: &World) {
    const EACH: u64 = 200;
    let (r, n) = (w.rank(), w.size());
    let q = (r == 0).then(|| w.publish_queue(16, 8).unwrap());
    let win = (r == 0).then(|| w.publish(64 * n as usize, Access::PUT | Access::GET).unwrap());
    let ids = w
        .allgather(&[q.as_ref().map_or(0, |q| q.id().to_u64()), win.as_ref().map_or(0, |s| s.id().to_u64())])
        .timeout(T)
        .await
        .unwrap();
    let rq = w.attach(SegmentId::from_u64(ids[0])).timeout(T).await.unwrap();
    let rwin = w.attach(SegmentId::from_u64(ids[1])).timeout(T).await.unwrap();
    check_route(w, &rq);
    assert_eq!(rq.record_len(), Some(16));
    let bad = rma_err(w.enqueue(&rq, &[0; 15]).await);
    assert_eq!(bad, RmaError::RecordSize { len: 15, record: 16 });
    if r != 0 {
        for i in 0..EACH {
            let mut rec = [0u8; 16];
            rec[..8].copy_from_slice(&u64::from(r).to_le_bytes());
            rec[8..].copy_from_slice(&i.to_le_bytes());
            w.enqueue(&rq, &rec).timeout(T).await.unwrap();
        }
        let data = pattern(64, 300 + r);
        w.put_notify(&rwin, 64 * r as usize, &data).timeout(T).await.unwrap();
    } else {
        let q = q.as_ref().unwrap();
        let mut next = vec![0u64; n as usize];
        let mut stream = std::pin::pin!(q.stream());
        for _ in 0..EACH * u64::from(n - 1) {
            let rec = tokio::time::timeout(T, stream.next()).await.unwrap().unwrap().unwrap();
            let p = u64::from_le_bytes(rec[..8].try_into().unwrap()) as usize;
            let i = u64::from_le_bytes(rec[8..].try_into().unwrap());
            assert_eq!(i, next[p], "producer {p}'s records in order");
            next[p] += 1;
        }
        assert!(q.is_empty());
        let win = win.as_ref().unwrap();
        let got = win.wait_notifications(u64::from(n - 1)).timeout(T).await.unwrap();
        assert_eq!(got, u64::from(n - 1));
        for p in 1..n {
            let mut d = vec![0u8; 64];
            win.read(64 * p as usize, &mut d).unwrap();
            assert_eq!(d, pattern(64, 300 + p), "rank {p}'s data landed before its notification");
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// Rank 0 unpublishes while every other rank has operations in flight on the segment: each of
/// them either completed (and its effect is in the memory it saw) or failed with `Unpublished`;
/// everything later fails with `Unpublished`, attaching included.
pub(crate) async fn unpublish_in_flight(w: &World) {
    let r = w.rank();
    let seg = (r == 0).then(|| w.publish(1 << 16, Access::WINDOW).unwrap());
    let id =
        SegmentId::from_u64(w.allgather(&[seg.as_ref().map_or(0, |s| s.id().to_u64())]).timeout(T).await.unwrap()[0]);
    let s = w.attach(id).timeout(T).await.unwrap();
    w.barrier().timeout(T).await.unwrap();
    if let Some(seg) = seg {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let before = seg.word(0).unwrap().load(std::sync::atomic::Ordering::SeqCst);
        seg.unpublish().timeout(T).await.unwrap();
        println!("unpublished after {before} fetch-adds");
    } else {
        let ev = w.event();
        let mut done = 0u64;
        let mut refused = 0u64;
        // Keep issuing until refused: puts on an event, awaited fetch-adds.
        loop {
            // Operations on a mapping complete inside their calls: give rank 0 (perhaps a task of
            // this process) its turn.
            tokio::task::yield_now().await;
            let data = [r as u8; 512];
            w.put(&s, 1024 + 512 * (r as usize % 64), &data).on(&ev);
            match w.fetch_add(&s, 0, 1).timeout(T).await {
                Ok(_) => done += 1,
                Err(Error::Rma(RmaError::Unpublished { id: i })) => {
                    assert_eq!(i, id);
                    refused += 1;
                    break;
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
        // The event's puts: done, or refused as unpublished.
        ev.wait_all().timeout(T).await.ok();
        if let Some(e) = ev.error() {
            assert!(matches!(e, Error::Rma(RmaError::Unpublished { .. })), "{e:?}");
        }
        assert_eq!(refused, 1);
        let e = rma_err(w.put(&s, 0, &[1]).timeout(T).await);
        assert_eq!(e, RmaError::Unpublished { id });
        let mut b = [0u8; 8];
        let e = rma_err(w.get(&s, 0, &mut b).timeout(T).await);
        assert_eq!(e, RmaError::Unpublished { id });
        println!("rank {r}: {done} fetch-adds before the unpublish");
    }
    w.barrier().timeout(T).await.unwrap();
    // A fresh attach is refused too (ranks that never attached, or whose cache dropped it).
    if r != 0 {
        let again = w.attach(id).timeout(T).await;
        match again {
            Err(Error::Rma(RmaError::Unpublished { id: i })) => assert_eq!(i, id),
            // A mapping attached before keeps answering from the cache; its operations fail.
            Ok(s) => assert_eq!(rma_err(w.fetch_add(&s, 0, 1).await), RmaError::Unpublished { id }),
            other => panic!("{other:?}"),
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// Fences: puts handed to an event, then a fence, then the data is there.
pub(crate) async fn fences(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let seg: Segment = w.publish(4096, Access::GET | Access::PUT).unwrap();
    let ids = exchange(w, seg.id()).await;
    let next = w.attach(ids[((r + 1) % n) as usize]).timeout(T).await.unwrap();
    let ev = w.event();
    for i in 0..32usize {
        w.put(&next, i * 64, &[(r as u8).wrapping_add(i as u8); 64]).on(&ev);
    }
    w.fence(&next).timeout(T).await.unwrap();
    assert_eq!(ev.completed(), 32, "the fence waited for every earlier put");
    let mut b = vec![0u8; 32 * 64];
    w.get(&next, 0, &mut b).timeout(T).await.unwrap();
    for i in 0..32usize {
        assert!(b[i * 64..(i + 1) * 64].iter().all(|&x| x == (r as u8).wrapping_add(i as u8)));
    }
    w.barrier().timeout(T).await.unwrap();
}

/// The first one-sided traffic of the job: the last rank publishes a segment and then makes no
/// ferrocomm call at all (it sleeps and reads its memory) while every other rank writes its slot
/// and counts itself in with a fetch-add: its progress task alone serves them.
pub(crate) async fn idle_target(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let owner = n - 1;
    let seg = (r == owner).then(|| w.publish(8 + 64 * n as usize, Access::PUT | Access::ATOMIC).unwrap());
    let id = w.allgather(&[seg.as_ref().map_or(0, |s| s.id().to_u64())]).timeout(T).await.unwrap()[owner as usize];
    if let Some(seg) = &seg {
        let word = seg.word(0).unwrap();
        let t0 = std::time::Instant::now();
        while word.load(std::sync::atomic::Ordering::Acquire) != u64::from(n - 1) {
            assert!(t0.elapsed() < T, "the idle target was not served");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for p in 0..n - 1 {
            let mut b = vec![0u8; 64];
            seg.read(8 + 64 * p as usize, &mut b).unwrap();
            assert_eq!(b, pattern(64, 50 + p), "slot of rank {p}");
        }
    } else {
        let s = w.attach(SegmentId::from_u64(id)).timeout(T).await.unwrap();
        check_route(w, &s);
        w.put(&s, 8 + 64 * r as usize, &pattern(64, 50 + r)).timeout(T).await.unwrap();
        w.fetch_add(&s, 0, 1).timeout(T).await.unwrap();
    }
    w.barrier().timeout(T).await.unwrap();
}

/// The whole suite, in order.
pub(crate) async fn suite(w: &World) {
    idle_target(w).await;
    geometries(w).await;
    fetch_add_sums(w).await;
    cas_lock(w).await;
    violations(w).await;
    queues_and_notify(w).await;
    fences(w).await;
    unpublish_in_flight(w).await;
}
