//! Calls of a communicator whose members share one host: on the board (small calls) and by
//! single copy (large calls read the other ranks' memory).

use super::*;

/// Broadcast by single copy: each receiver copies the root's buffer straight into its own; the root
/// returns once every receiver has (the fan-in), so its buffer is not needed after that. Meanwhile
/// the root, which would only wait, writes half of the copies that receivers offer to split.
pub(super) async fn bcast_single_copy(mut call: board::Lending, root: Rank, me: Rank, buf: &mut [u8]) -> Result<()> {
    let got = call.next().await?;
    if me != root {
        let lent = Lent::decode(root, &got, buf.len())?;
        call.read_split(root, &lent, buf)?;
        return call.next().await.map(drop);
    }
    let readers = call.ranks() - 1;
    call.next_helping(Some(&*buf), readers).await.map(drop)
}

/// A scatter by single copy: the root lends its whole data (`own`: its block of it); each other
/// rank copies its block (`dst.len()` bytes at its rank's offset) straight out of it, then tells
/// the root (the fan-in), which returns once every rank has, so its data is not needed after
/// that. Meanwhile the root copies its own block.
pub(super) async fn scatter_single_copy(
    mut call: board::Lending,
    root: Rank,
    me: Rank,
    own: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    let n = call.ranks();
    let got = call.next().await?;
    if me != root {
        let lent = Lent::decode(root, &got, dst.len() * n)?;
        call.read(root, &lent, me as usize * dst.len(), dst)?;
        return call.next().await.map(drop);
    }
    dst.copy_from_slice(own);
    call.next().await.map(drop)
}

/// What a gather-style single-copy call lends of the caller's input.
#[derive(Clone, Copy)]
pub(super) enum Lend {
    /// A copy, which the call keeps: for futures that do not borrow the input.
    Copy,
    /// The input where it is: only for a future that borrows it until its end
    /// ([`lending_in_place`]); one copy of the data less.
    InPlace,
}

/// The future of a call that lent `data` in place ([`Lend::InPlace`]): it holds the borrow of
/// `data` for as long as the call may be read, so the caller cannot change it meanwhile; dropped
/// early, the call withdraws the memory before the borrow ends.
pub(super) async fn lending_in_place<T: Element>(
    data: &[T],
    call: impl Future<Output = Result<()>> + Send,
) -> Result<()> {
    let _lent = data;
    call.await
}

/// A gather-style call by single copy (reduce, all-gather, all-to-all; see [`Comm::lend`]):
/// learns what every rank lent (`len` bytes each), makes this rank's `copies`, then waits until
/// nobody reads this rank's copy any more and gives it back to `pool`.
pub(super) async fn gather_single_copy<R>(
    mut call: board::Lending,
    n: Rank,
    len: usize,
    pool: &Pool,
    copies: impl FnOnce(&board::Lending, &[Lent]) -> Result<R>,
) -> Result<R> {
    let lent = lent_by_all(&call.next().await?, n as usize, len)?;
    let r = copies(&call, &lent)?;
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(r)
}

/// A gather by single copy: every rank lends its part (`own`: a copy the call keeps, or the
/// caller's data in place) and the root its `dst` too ([`Comm::lend_for_gather`]); the root
/// copies each part into its place in `dst` (`len` bytes a rank), then a barrier ends the
/// lending. The other ranks, which would only wait, help: on 2 ranks the other writes half of
/// the root's copy ([`board::Lending::read_split`]); on more, the root opens a push to every
/// rank, and those that claim it write their whole part into `dst` while the root copies the
/// others ([`board::Lending::read_pushed`]): the copies spread over the CPUs.
#[allow(clippy::too_many_arguments)] // the call, who is who, what is lent and where it goes
pub(super) async fn gather_direct(
    mut call: board::Lending,
    root: Rank,
    me: Rank,
    n: Rank,
    len: usize,
    own: Option<&[u8]>,
    dst: Option<&mut [u8]>,
    pool: &Pool,
) -> Result<()> {
    let all = call.next().await?;
    if n > 2 {
        let (data, dsts) = lent_for_gather(&all, n as usize, len, root as usize)?;
        if let Some(dst) = dst.filter(|_| me == root) {
            let own = own.unwrap_or(call.kept());
            call.read_pushed(&data, dst, len, own)?;
            call.next().await?;
        } else {
            call.next_pushing(&dsts[root as usize], me as usize * len, own).await?;
        }
    } else {
        let lent = lent_by_all(&all, n as usize, len)?;
        if let Some(dst) = dst.filter(|_| me == root) {
            for (k, (d, l)) in dst.chunks_exact_mut(len.max(1)).zip(&lent).enumerate() {
                match k as Rank {
                    k if k == me => d.copy_from_slice(own.unwrap_or(call.kept())),
                    k => call.read_split(k, l, d)?,
                }
            }
            call.next().await?;
        } else if n == 2 {
            call.next_helping(own, 1).await?;
        } else {
            call.next().await?;
        }
    }
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// What every rank lent for a gather by single copy of `len` bytes a rank on more than two ranks
/// ([`Comm::lend_for_gather`]): its data, and the root's `dst` for every rank's part.
fn lent_for_gather(all: &[u8], n: usize, len: usize, root: usize) -> Result<(Vec<Lent>, Vec<Lent>)> {
    lent_with_results(all, n, len, |k| (k == root).then_some(n * len))
}

/// From this many bytes a reduce by single copy on more than 2 ranks shares the combining out
/// ([`reduce_single_copy`]; 2 ranks take [`reduce_pair`]); below, the root combines every rank's
/// data alone while the others wait. On 2 ranks (loaded, no
/// LTO; `ferrocomm-bench collectives --ranks 2 --runs 5 --mpi openmpi --ops reduce --max 4M`, three
/// runs each way) sharing took 1.27-1.33x Open MPI's time at 2 MiB and 1.08-1.27x at 4 MiB against
/// 1.47-1.68x and 1.40x for the root alone, but 1.46-1.63x at 128 KiB against 1.29-1.38x (its
/// extra step and second copy cost more than the halved combining saves), and about the same at
/// 512 KiB.
pub(super) const REDUCE_SPLIT_MIN: usize = 1 << 20;

/// A reduce by single copy, its combining shared out as in an all-reduce: every rank lends its
/// data in place and a result buffer of its own (the call keeps it; see [`Comm::lend_for_reduce`]),
/// combines part `me` of every rank's data in rank order (the root straight into its part of
/// `dst`, the others into that buffer), then, after a barrier, the root copies every other part
/// from the rank that combined it; after another, nobody reads anything lent any more (from
/// [`REDUCE_SPLIT_MIN`] bytes).
#[allow(clippy::too_many_arguments)] // the call, who is who, what is combined and where it goes
pub(super) async fn reduce_single_copy(
    mut call: board::Lending,
    root: Rank,
    me: Rank,
    n: Rank,
    own: &[u8],
    dst: Option<&mut [u8]>,
    op: ferrocomm_collectives::Reducer,
    pool: &Pool,
) -> Result<()> {
    use ferrocomm_collectives::shared::part;
    let (elem, len, n, me, root) = (op.element_size(), own.len(), n as usize, me as usize, root as usize);
    let all = call.next().await?;
    let (data, results) = lent_for_reduce(&all, n, len, elem, root)?;
    let mine = part(len, elem, n, me);
    if me == root {
        let dst = dst.ok_or(Error::Internal { what: "a reduce's root without its result buffer" })?;
        combine(&call, &data, me, &op, mine.start, Some(&own[mine.clone()]), &mut dst[mine], pool)?;
        call.next().await?;
        for (k, result) in results.iter().enumerate().filter(|&(k, _)| k != me) {
            call.read(k as Rank, result, 0, &mut dst[part(len, elem, n, k)])?;
        }
    } else {
        let mut result = call.take_kept().ok_or(Error::Internal { what: "a reduce's result buffer" })?;
        let combined =
            combine(&call, &data, me, &op, mine.start, Some(&own[mine.clone()]), &mut result[..mine.len()], pool);
        call.keep(result);
        combined?;
        call.next().await?;
    }
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// A reduce by single copy on 2 ranks: every rank lends its data in place, the root also its
/// `dst` ([`Comm::lend_for_reduce_pair`]). The root opens a push to the other rank and combines
/// the first [`ROOT_SHARE`] of the vector (the other rank's piece read straight into `dst`, its
/// own applied); the other rank, which would only wait, claims the push and combines the rest
/// (the root's data read, its own applied, in rank order) and writes it into the root's `dst`;
/// unless the root took the push back first and combines that part too. A barrier then ends the
/// lending.
#[allow(clippy::too_many_arguments)] // the call, who is who, what is combined and where it goes
pub(super) async fn reduce_pair(
    mut call: board::Lending,
    root: Rank,
    me: Rank,
    own: &[u8],
    dst: Option<&mut [u8]>,
    op: ferrocomm_collectives::Reducer,
    pool: &Pool,
) -> Result<()> {
    let (elem, len, me_k, root_k) = (op.element_size(), own.len(), me as usize, root as usize);
    let all = call.next().await?;
    let (data, dsts) = lent_with_results(&all, 2, len, |k| (k == root_k).then_some(len))?;
    let (share, of) = ROOT_SHARE;
    let split = len / elem * share / of * elem;
    if me == root {
        let dst = dst.ok_or(Error::Internal { what: "a reduce's root without its result buffer" })?;
        let other = 1 - me;
        let opened = call.open_push(other);
        let first = combine(&call, &data, me_k, &op, 0, Some(&own[..split]), &mut dst[..split], pool);
        // Settled whatever happened: the other rank may be writing into `dst`.
        let pushed = if opened { call.settle_push(other, data[other as usize].pid)? } else { false };
        first?;
        if !pushed {
            combine(&call, &data, me_k, &op, split, Some(&own[split..]), &mut dst[split..], pool)?;
        }
        call.next().await?;
    } else {
        let piece = (REDUCE_PIECE / elem * elem).max(elem);
        let mut x = pool.take(piece.min(len - split).max(1));
        let (theirs, into) = (&data[root_k], &dsts[root_k]);
        call.next_serving_push(|c| {
            (split..len).step_by(piece).all(|start| {
                let p = start..(start + piece).min(len);
                let x = &mut x[..p.len()];
                c.read(root, theirs, p.start, x).is_ok() && {
                    // The root's data on the left if it comes first in rank order.
                    op.apply(x, &own[p.clone()], me < root);
                    c.write(into, p.start, x).is_ok()
                }
            })
        })
        .await?;
        pool.give(x);
    }
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// The root's share of a reduce by single copy on 2 ranks ([`reduce_pair`]), as a fraction: its
/// part costs two passes over the data (the copy from the other rank, the combining), the other
/// rank's three (the copy from the root, the combining, the copy into the root's result), so the
/// root takes 3/5 and both finish together. Halves left the root waiting: in `perf record` of
/// `collectives-job --ranks 2 -o reduce -s 2097152` (loaded, no LTO) the other rank's copies,
/// combining and page pinning took 22.9% of the samples against the root's 15.6%, the root
/// spinning for the other's push meanwhile; with 3/5, 20.5% against 22.7%.
const ROOT_SHARE: (usize, usize) = (3, 5);

/// Bytes of the result buffer that rank `k` lends for a reduce by single copy (part `k` of `len`
/// bytes): never below [`Pool::MIN`], so that it comes from the pool, not the allocator.
pub(super) fn reduce_result_len(len: usize, elem: usize, n: usize, k: usize) -> usize {
    ferrocomm_collectives::shared::part(len, elem, n, k).len().max(Pool::MIN)
}

/// What every rank lent for a reduce by single copy of `len` bytes ([`Comm::lend_for_reduce`]):
/// its data, and its result buffer (the root's is not read: it combines into its own `dst`).
fn lent_for_reduce(all: &[u8], n: usize, len: usize, elem: usize, root: usize) -> Result<(Vec<Lent>, Vec<Lent>)> {
    lent_with_results(all, n, len, |k| (k != root).then(|| reduce_result_len(len, elem, n, k)))
}

/// What every rank lent as two pieces of memory each: its data of `len` bytes, and a result
/// buffer of `result_len(k)` bytes (`None`: not read, an empty one stands in).
fn lent_with_results(
    all: &[u8],
    n: usize,
    len: usize,
    result_len: impl Fn(usize) -> Option<usize>,
) -> Result<(Vec<Lent>, Vec<Lent>)> {
    let each = 2 * Lent::BYTES;
    if all.len() != n * each {
        return Err(Error::Collective(CollError::Malformed { from: 0, why: "lent memory of every rank" }));
    }
    let (mut data, mut results) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (k, b) in all.chunks(each).enumerate() {
        let (d, r) = b.split_at(Lent::BYTES);
        data.push(Lent::decode(k as Rank, d, len)?);
        results.push(match result_len(k) {
            Some(bytes) => Lent::decode(k as Rank, r, bytes)?,
            None => Lent { pid: 0, addr: 0, len: 0 },
        });
    }
    Ok((data, results))
}

/// A reduce-scatter by single copy: every rank lends its vector, `data` where it is (in place, see
/// [`lending_in_place`]) or, if `None`, a copy the call keeps; this rank combines bytes `mine` of
/// every rank's, in rank order, into `dst`; a barrier then ends the lending.
#[allow(clippy::too_many_arguments)] // the call, what is combined, who is who, and where it goes
pub(super) async fn reduce_scatter_direct(
    mut call: board::Lending,
    data: Option<&[u8]>,
    mine: std::ops::Range<usize>,
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    dst: &mut [u8],
    pool: &Pool,
) -> Result<()> {
    let len = data.map_or(call.kept().len(), <[u8]>::len);
    let lent = lent_by_all(&call.next().await?, n as usize, len)?;
    let own = data.unwrap_or(call.kept()).get(mine.clone());
    let own = own.ok_or(Error::Internal { what: "a reduce-scatter segment out of range" })?;
    combine(&call, &lent, me as usize, &op, mine.start, Some(own), dst, pool)?;
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// A scan by single copy: every rank lends its data (`buf` in place, or a copy the call keeps);
/// this rank combines, in rank order, the data of the ranks before it and, if `inclusive`, its own
/// into a pooled scratch buffer; once nobody reads what it lent any more (a barrier), the result
/// goes into `buf` (an exclusive scan's rank 0 has none: its `buf` is empty).
pub(super) async fn scan_direct(
    mut call: board::Lending,
    buf: &mut [u8],
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    inclusive: bool,
    pool: &Pool,
) -> Result<()> {
    let (me, n) = (me as usize, n as usize);
    let len = if inclusive { buf.len() } else { call.kept().len() };
    let lent = lent_by_all(&call.next().await?, n, len)?;
    // The last rank this one combines, if any, and the ranks up to it.
    let upto = if inclusive { Some(me) } else { me.checked_sub(1) };
    let mut scratch = None;
    if let Some(last) = upto {
        let mut x = pool.take(len);
        if inclusive {
            combine(&call, &lent[..=last], last, &op, 0, Some(&*buf), &mut x, pool)?;
        } else {
            call.read(last as Rank, &lent[last], 0, &mut x)?;
            combine(&call, &lent[..=last], last, &op, 0, None, &mut x, pool)?;
        }
        scratch = Some(x);
    }
    call.next().await?;
    if let Some(x) = scratch {
        buf.copy_from_slice(&x);
        pool.give(x);
    }
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// Up to this many ranks a scan by single copy goes down a chain ([`scan_chain`]): each rank
/// reads one vector, the prefix of the rank before it, where [`scan_direct`]'s last rank reads
/// n - 1 and [`scan_split`]'s every rank two parts of each other rank's; where ranks share CPUs,
/// the total reads are what count. Pieces keep the chain's ranks busy at once.
pub(super) const SCAN_CHAIN_RANKS: Rank = 4;

/// A piece of [`scan_chain`]: a rank starts on it as soon as the rank before it has it done.
const CHAIN_PIECE: usize = 64 << 10;

/// A scan by single copy down a chain, piece by piece: every rank lends its prefix-to-be (an
/// inclusive scan's `buf` in place; an exclusive scan's kept copy of its data); rank `me` waits
/// until rank `me - 1` has published a piece of its prefix done, reads it, and combines it with
/// its own data in place (the prefix on the left, so any associative operator keeps rank order),
/// then publishes that piece of its own prefix. An exclusive scan's result (`buf`; rank 0 has
/// none) is the piece read from the rank before. A barrier then ends the lending.
pub(super) async fn scan_chain(
    mut call: board::Lending,
    buf: &mut [u8],
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    inclusive: bool,
    pool: &Pool,
) -> Result<()> {
    let len = if inclusive { buf.len() } else { call.kept().len() };
    let lent = lent_by_all(&call.next().await?, n as usize, len)?;
    let elem = op.element_size();
    // Pieces of whole elements, no more of them than the board counts.
    let at_least = len.div_ceil(ferrocomm_collectives::shared::MAX_PIECES as usize);
    let piece = (CHAIN_PIECE.max(at_least) / elem * elem).max(elem);
    let pieces = len.div_ceil(piece);
    if me == 0 {
        // Its prefix is its data.
        call.progress(pieces as u64);
    } else {
        let before = me - 1;
        let mut x = if inclusive { pool.take(piece.min(len)) } else { BytesMut::new() };
        for (k, start) in (0..len).step_by(piece).enumerate() {
            let p = start..(start + piece).min(len);
            call.wait_progress(before, &lent[before as usize], k as u64 + 1).await?;
            if inclusive {
                let x = &mut x[..p.len()];
                call.read(before, &lent[before as usize], p.start, x)?;
                op.apply(&mut buf[p], x, true);
            } else {
                call.read(before, &lent[before as usize], p.start, &mut buf[p.clone()])?;
                op.apply(&mut call.kept_mut()[p.clone()], &buf[p], true);
            }
            call.progress(k as u64 + 1);
        }
        pool.give(x);
    }
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// From this many bytes a scan by single copy on more than [`SCAN_CHAIN_RANKS`] ranks shares the
/// combining out ([`scan_split`]); below, each rank combines the data of the ranks before it
/// itself ([`scan_direct`]). Loaded, no LTO
/// (`ferrocomm-bench collectives --ranks 2,4 --runs 5 --no-mpi --ops scan --max 4M`, two runs each
/// way, us): on 4 ranks sharing took 1171/1651 at 512 KiB against 2499/2372, 7317/7474 at 2 MiB
/// against 10734/14484, 14566/16608 at 4 MiB against 26920/28086; on 2 ranks 1862/2476 at 2 MiB
/// against 3225/2885 and 5638/5454 at 4 MiB against 8491/8405; at 128 KiB neither won on either
/// rank count (its extra step and second copy cost about what the shared combining saves).
pub(super) const SCAN_SPLIT_MIN: usize = 256 << 10;

/// A scan by single copy, its combining shared out by parts: every rank lends its data (`buf` in
/// place for an inclusive scan, a copy the call keeps for an exclusive one) and a result buffer
/// (kept by the call; see [`Comm::lend_for_scan`]). Rank `me` computes the running prefix over
/// ranks 0, 1, ... of part `me` of the vector, each rank's part read once and combined in rank
/// order, and leaves each rank's prefix of that part in its result buffer (its own straight in
/// `buf`); after a barrier, each rank copies its other parts from the ranks that computed them;
/// after another, nobody reads anything lent any more. Each rank combines about one vector's
/// length where the last rank of [`scan_direct`] combines n - 1 vectors while the others wait.
/// `buf`: the result (and for an inclusive scan the data); an exclusive scan's rank 0 has none.
#[allow(clippy::too_many_arguments)] // the call, what is combined, who is who
pub(super) async fn scan_split(
    mut call: board::Lending,
    buf: &mut [u8],
    len: usize,
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    inclusive: bool,
    pool: &Pool,
) -> Result<()> {
    use ferrocomm_collectives::shared::part;
    let (elem, n, me) = (op.element_size(), n as usize, me as usize);
    let (data, results) = lent_for_scan(&call.next().await?, n, len, elem)?;
    let mut kept = call.take_kept().ok_or(Error::Internal { what: "a scan's result buffer" })?;
    let computed = if inclusive {
        prefixes(&call, &data, me, &op, None, buf, &mut kept[..])
    } else {
        let (own, results) = kept.split_at_mut(len);
        prefixes(&call, &data, me, &op, Some(own), buf, results)
    };
    call.keep(kept);
    computed?;
    call.next().await?;
    if me > 0 {
        for (k, result) in results.iter().enumerate().filter(|&(k, _)| k != me) {
            let theirs = part(len, elem, n, k);
            let at = me * theirs.len();
            call.read(k as Rank, result, at, &mut buf[theirs])?;
        }
    }
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(())
}

/// Rank `me`'s share of [`scan_split`]: the running prefix `x0 ⊕ ... ⊕ xk` over ranks k = 0, 1,
/// ... of part `me` of the ranks' `data`, piece by piece (a piece of each rank stays in cache).
/// The prefix that rank `o` gets (an inclusive scan's `o = k`, an exclusive one's `o = k + 1`)
/// goes to slot `o` of `results` (a part's length each) or, for this rank, into `out` where the
/// part lies. Each rank's piece is read straight into the place of its prefix and the previous
/// prefix applied on the left, so rank order holds for any associative operator. This rank's own
/// data: `own` (an exclusive scan's kept copy), or for an inclusive scan in `out` already.
#[allow(clippy::too_many_arguments)] // the call, what it reads, how it combines, where it goes
fn prefixes(
    call: &board::Lending,
    data: &[Lent],
    me: usize,
    op: &ferrocomm_collectives::Reducer,
    own: Option<&[u8]>,
    out: &mut [u8],
    results: &mut [u8],
) -> Result<()> {
    let (n, elem) = (data.len(), op.element_size());
    let len = data.first().map_or(0, |l| l.len as usize);
    let mine = ferrocomm_collectives::shared::part(len, elem, n, me);
    let (part_len, excl) = (mine.len(), usize::from(own.is_some()));
    let piece = (REDUCE_PIECE / elem * elem).max(1);
    for start in (0..part_len).step_by(piece) {
        let end = (start + piece).min(part_len);
        let (here, slot) = (mine.start + start..mine.start + end, |o: usize| o * part_len + start..o * part_len + end);
        for (k, theirs) in data.iter().enumerate().take(n - excl) {
            let o = k + excl;
            // The previous prefix (rank o - 1's) and where this one goes.
            let (prev, dst): (Option<&[u8]>, &mut [u8]) = if o == me {
                ((k > 0).then(|| &results[slot(o - 1)]), &mut out[here.clone()])
            } else if k > 0 && o - 1 == me {
                (Some(&out[here.clone()]), &mut results[slot(o)])
            } else {
                let (before, from) = results.split_at_mut(o * part_len);
                ((k > 0).then(|| &before[slot(o - 1)]), &mut from[start..end])
            };
            match (k == me, own) {
                (true, Some(own)) => dst.copy_from_slice(&own[here.clone()]),
                // An inclusive scan's own data, in `out` where its prefix goes.
                (true, None) => {}
                (false, _) => call.read(k as Rank, theirs, here.start, dst)?,
            }
            if let Some(prev) = prev {
                op.apply(dst, prev, true);
            }
        }
    }
    Ok(())
}

/// Bytes of the result buffer that rank `k` lends for a scan by single copy ([`scan_split`]): a
/// slot of part `k`'s length for each rank, never below [`Pool::MIN`].
pub(super) fn scan_result_len(len: usize, elem: usize, n: usize, k: usize) -> usize {
    (n * ferrocomm_collectives::shared::part(len, elem, n, k).len()).max(Pool::MIN)
}

/// What every rank lent for a scan by single copy of `len` bytes ([`Comm::lend_for_scan`]): its
/// data, and its result buffer.
fn lent_for_scan(all: &[u8], n: usize, len: usize, elem: usize) -> Result<(Vec<Lent>, Vec<Lent>)> {
    lent_with_results(all, n, len, |k| Some(scan_result_len(len, elem, n, k)))
}

/// Bytes of a reduction's piece: a piece of each rank's part and the partial result stay in cache
/// (L2 is 1 MiB a core here), and each `process_vm_readv` moves a piece (a call has a fixed cost:
/// the kernel pins the remote pages). 256 KiB pieces beat 64 KiB ones by 10-15% on a 1 MiB
/// all-reduce (`ferrocomm-bench collectives --ranks 4,2 --ops allreduce --max 1M --no-mpi
/// --iters-large 40`). The scratch is reused across calls: a fresh allocation above the
/// allocator's mmap threshold would fault its pages in on every call.
pub(super) const REDUCE_PIECE: usize = 256 << 10;

/// What every rank lent for a call of `len` bytes each (the first step's all-gather).
pub(super) fn lent_by_all(all: &[u8], n: usize, len: usize) -> Result<Vec<Lent>> {
    if all.len() != n * Lent::BYTES {
        return Err(Error::Collective(CollError::Malformed { from: 0, why: "lent memory of every rank" }));
    }
    let each = all.chunks(Lent::BYTES).enumerate().map(|(r, b)| Lent::decode(r as Rank, b, len));
    Ok(each.collect::<std::result::Result<_, _>>()?)
}

/// Combines bytes `at..at + dst.len()` of every rank's lent memory in rank order into `dst`, in
/// place, piece by piece (a piece of each rank and the partial result stay in cache). This rank's
/// bytes come from `own`, or are in `dst` already (`None`); from them the result grows outwards:
/// the ranks before this one are applied on the left, nearest first, then the ranks after it on
/// the right, so `x0 ⊕ (x1 ⊕ ... ⊕ xme) ⊕ ... ⊕ xn-1` keeps rank order for any associative operator.
/// With `own`, the nearest other rank's piece is read straight into `dst` and `own` applied to it
/// (one pass over the piece less than copying `own` in first), unless that puts `own` on the left
/// of a non-commutative operator (which would copy instead). The other pieces are read into a
/// scratch buffer from `pool` (kept between calls: a fresh one faults its pages in on every call).
#[allow(clippy::too_many_arguments)] // the call, what it reads, how it combines, where it goes
pub(super) fn combine(
    call: &board::Lending,
    lent: &[Lent],
    me: usize,
    op: &ferrocomm_collectives::Reducer,
    at: usize,
    own: Option<&[u8]>,
    dst: &mut [u8],
    pool: &Pool,
) -> Result<()> {
    let piece = (REDUCE_PIECE / op.element_size() * op.element_size()).max(1);
    // The rank read straight into `dst`, with `own` applied to it: the nearest one before this
    // rank (`own` on the right), or the first after it where the operator commutes.
    let first = own.and_then(|_| match me.checked_sub(1) {
        Some(before) => Some(before),
        None => (lent.len() > 1 && op.is_commutative()).then_some(1),
    });
    // Pieces of the other ranks go through `x` (none with two ranks and `own`).
    let through_x = lent.len().saturating_sub(1 + usize::from(first.is_some()));
    let mut x = if through_x > 0 { pool.take(piece.min(dst.len())) } else { BytesMut::new() };
    for start in (0..dst.len()).step_by(piece) {
        let p = start..(start + piece).min(dst.len());
        let (k, result) = (p.len(), &mut dst[p.clone()]);
        match (own, first) {
            (Some(own), Some(r)) => {
                call.read(r as Rank, &lent[r], at + start, result)?;
                op.apply(result, &own[p], r > me);
            }
            (Some(own), None) => result.copy_from_slice(&own[p]),
            (None, _) => {}
        }
        let before = lent[..me].iter().enumerate().rev().map(|(r, l)| (r, l, true));
        let after = lent.iter().enumerate().skip(me + 1).map(|(r, l)| (r, l, false));
        for (r, theirs, on_the_left) in before.chain(after).filter(|&(r, _, _)| Some(r) != first) {
            call.read(r as Rank, theirs, at + start, &mut x[..k])?;
            op.apply(result, &x[..k], on_the_left);
        }
    }
    pool.give(x);
    Ok(())
}

/// All-reduce by single copy, in place, as a reduce-scatter and an all-gather straight between the
/// ranks' buffers: rank `me` combines part `me` of every rank's buffer in rank order and leaves it
/// in its own; after a barrier, it copies every other part from the rank that computed it; after
/// another, nobody reads its buffer any more. Each part is computed once, so every rank gets the
/// same bits, and rank order keeps non-commutative operators right.
pub(super) async fn allreduce_single_copy(
    mut call: board::Lending,
    buf: &mut [u8],
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    pool: &Pool,
) -> Result<()> {
    use ferrocomm_collectives::shared::part;
    let (elem, len, n, me) = (op.element_size(), buf.len(), n as usize, me as usize);
    let lent = lent_by_all(&call.next().await?, n, len)?;
    let mine = part(len, elem, n, me);
    combine(&call, &lent, me, &op, mine.start, None, &mut buf[mine], pool)?;
    call.next().await?;
    for r in (0..n).filter(|&r| r != me) {
        let theirs = part(len, elem, n, r);
        call.read(r as Rank, &lent[r], theirs.start, &mut buf[theirs])?;
    }
    call.next().await?;
    Ok(())
}

impl Comm {
    /// Enqueues a call on this communicator's shared-memory board (opened on first use); see
    /// [`board::HostBoard::call`].
    pub(super) fn board_call(&self, kind: BoardOp, len: usize, input: &[u8], elem: usize) -> Result<board::Made> {
        self.board()?.call(kind, len, input, elem)
    }

    /// [`Comm::board_call`] as a future of its pieces, complete or not (for the calls whose
    /// result is more than a copy into the caller's buffer).
    pub(super) fn board_future(
        &self,
        kind: BoardOp,
        len: usize,
        input: &[u8],
        elem: usize,
    ) -> Result<board::BoardCall> {
        self.board_call(kind, len, input, elem).map(board::Made::into_future)
    }

    /// Starts a single-copy call on this communicator's board; see [`board::HostBoard::lend`].
    pub(super) fn lending(&self, kind: BoardOp, lent: Option<Lent>, held: &[BoardOp]) -> Result<board::Lending> {
        self.board()?.lend(kind, lent, held)
    }

    /// Starts a gather-style single-copy call that lends `data` as `lend` says: every rank learns
    /// what the others lent, does its copies, then waits in a barrier until nobody reads what it
    /// lent any more.
    pub(super) fn lend<T: Element>(&self, data: &[T], lend: Lend) -> Result<board::Lending> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if let Lend::InPlace = lend {
            return self.lending(BoardOp::Allgather, Some(Lent::of(bytes)), &[BoardOp::Barrier]);
        }
        let mut copy = self.coll().pool.take(bytes.len());
        copy.copy_from_slice(bytes);
        let mut call = self.lending(BoardOp::Allgather, Some(Lent::of(&copy)), &[BoardOp::Barrier])?;
        call.keep(copy);
        Ok(call)
    }

    /// [`Comm::lend`] of a buffer the call takes over (kept until nobody reads it, then given
    /// back to the pool): for a caller that copied its input into a pooled buffer already.
    pub(super) fn lend_owned(&self, buf: BytesMut) -> Result<board::Lending> {
        let mut call = self.lending(BoardOp::Allgather, Some(Lent::of(&buf)), &[BoardOp::Barrier])?;
        call.keep(buf);
        Ok(call)
    }

    /// Starts a gather by single copy to `root` ([`gather_direct`]): this rank lends `data` as
    /// `lend` says and, on more than two ranks, the root also its `dst` (every rank's part, which
    /// the others may push into; only for a future that borrows it until its end), the others
    /// nothing more.
    pub(super) fn lend_for_gather<T: Element>(
        &self,
        data: &[T],
        lend: Lend,
        dst: Option<&[u8]>,
    ) -> Result<board::Lending> {
        if self.size() <= 2 {
            return self.lend(data, lend);
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let copy = matches!(lend, Lend::Copy).then(|| {
            let mut copy = self.coll().pool.take(bytes.len());
            copy.copy_from_slice(bytes);
            copy
        });
        let lent = [Lent::of(copy.as_deref().unwrap_or(bytes)), Lent::of(dst.unwrap_or_default())];
        let mut call = self.board()?.lend_each(BoardOp::Allgather, 2, &lent, &[BoardOp::Barrier])?;
        if let Some(b) = copy {
            call.keep(b);
        }
        Ok(call)
    }

    /// Starts a reduce by single copy on 2 ranks ([`reduce_pair`]) to `root`: this rank lends
    /// `data` in place and the root also its `dst` (both only for a future that borrows them
    /// until its end), the other rank nothing more.
    pub(super) fn lend_for_reduce_pair<T: Element>(&self, data: &[T], dst: Option<&[u8]>) -> Result<board::Lending> {
        let lent = [Lent::of(bytemuck::cast_slice(data)), Lent::of(dst.unwrap_or_default())];
        self.board()?.lend_each(BoardOp::Allgather, 2, &lent, &[BoardOp::Barrier])
    }

    /// Starts a reduce by single copy ([`reduce_single_copy`]) to `root`: this rank lends `data`
    /// in place (only for a future that borrows it until its end) and, if it is not the root, a
    /// pooled buffer for the part it combines, which the call keeps.
    pub(super) fn lend_for_reduce<T: Element>(&self, data: &[T], root: Rank) -> Result<board::Lending> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let (me, n) = (self.rank(), self.size() as usize);
        let result =
            (me != root).then(|| self.coll().pool.take(reduce_result_len(bytes.len(), size_of::<T>(), n, me as usize)));
        // The root's result buffer is its caller's: nobody reads it, but every rank lends two.
        let lent = [Lent::of(bytes), Lent::of(result.as_deref().unwrap_or_default())];
        let held = [BoardOp::Barrier, BoardOp::Barrier];
        let mut call = self.board()?.lend_each(BoardOp::Allgather, 2, &lent, &held)?;
        if let Some(b) = result {
            call.keep(b);
        }
        Ok(call)
    }

    /// Starts a scan by single copy with its combining shared out ([`scan_split`]): this rank
    /// lends its data (inclusive: `data` in place, only for a future that borrows it until its
    /// end; exclusive: a pooled copy) and a pooled result buffer, which the call keeps (the copy
    /// and the result buffer in one).
    pub(super) fn lend_for_scan<T: Element>(&self, data: &[T], inclusive: bool) -> Result<board::Lending> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let (me, n, len) = (self.rank() as usize, self.size() as usize, bytes.len());
        let results = scan_result_len(len, size_of::<T>(), n, me);
        let copy = if inclusive { 0 } else { len };
        let mut kept = self.coll().pool.take(copy + results);
        kept[..copy].copy_from_slice(&bytes[..copy]);
        let (own, results) = kept.split_at(copy);
        let lent = [Lent::of(if inclusive { bytes } else { own }), Lent::of(results)];
        let held = [BoardOp::Barrier, BoardOp::Barrier];
        let mut call = self.board()?.lend_each(BoardOp::Allgather, 2, &lent, &held)?;
        call.keep(kept);
        Ok(call)
    }

    /// This communicator's shared-memory board, opened on first use.
    pub(super) fn board(&self) -> Result<&Arc<board::HostBoard>> {
        let seg = self.coll().board.get_or_init(|| {
            let job = self.inner().shm_job.as_deref().ok_or_else(|| Error::from(InvalidArgument::NoSharedMemory))?;
            board::HostBoard::open(self, job).map(Arc::new)
        });
        seg.as_ref().map_err(Clone::clone)
    }
}
