//! The barrier and the rooted collectives: broadcast, reduce, gather, scatter.

use super::*;

/// One step of a hierarchical broadcast: the sub-communicator's call slot, this rank's place in
/// it, its size and the step's root.
type HierStep = (super::run::Slot, Rank, Rank, Rank);

impl Comm {
    /// Waits until every rank of the communicator has entered the barrier (dissemination:
    /// ceil(log2 n) rounds; node-leader when the communicator spans several hosts).
    pub fn barrier(&self) -> impl Future<Output = Result<()>> + Send + use<> {
        let alg = self.choose(Operation::Barrier, 0, true);
        let obs = self.observe(Operation::Barrier, alg, 0);
        if alg == Algorithm::SharedMemory {
            return obs.wrap(Collective::board(self.board_call(BoardOp::Barrier, 0, &[], 1), None));
        }
        let multicast = (alg == Algorithm::Multicast).then(|| self.clone());
        let plan = if alg == Algorithm::Multicast {
            // Takes its sequence number like any call, but runs on the multicast channel.
            self.slot();
            None
        } else if alg == Algorithm::Hierarchical {
            let h = self.hierarchy().expect("chosen");
            let (n, l) = (&h.node, h.leaders.as_ref());
            let (nr, nn) = (n.rank(), n.size());
            let up = (n.slot(), ops::gather(nr, nn, 0, Algorithm::Binomial, Bytes::new()));
            let mid = l.map(|l| (l.slot(), ops::barrier(l.rank(), l.size(), Algorithm::Dissemination)));
            let down = (n.slot(), ops::bcast(nr, nn, 0, Algorithm::Binomial, (nr == 0).then(Bytes::new), 1));
            Some(Err(Box::new((up, mid, down))))
        } else {
            let slot = self.slot();
            Some(Ok(ops::barrier(self.rank(), self.size(), alg).map(|m| Comm::drive(slot, m))))
        };
        obs.wrap(Collective::boxed(async move {
            if let Some(comm) = multicast {
                // The skew-tolerant token barrier of the reliable multicast layer. Boxed, as
                // every rare path here: its set-up future is large, and would otherwise size
                // (and be copied with) every message-based barrier's future.
                return Box::pin(async move {
                    comm.collective_gate()?;
                    let barrier = comm.coll().token_barrier.get_or_try_init(|| TokenBarrier::new(&comm)).await?;
                    barrier.wait().await
                })
                .await;
            }
            match plan {
                None => Err(Error::Internal { what: "a multicast barrier planned without its channel" }),
                Some(Ok(run)) => run?.await.map(drop),
                Some(Err(hier)) => {
                    Box::pin(async move {
                        let (up, mid, down) = *hier;
                        Comm::drive(up.0, up.1?).await?;
                        if let Some((s, m)) = mid {
                            Comm::drive(s, m?).await?;
                        }
                        Comm::drive(down.0, down.1?).await.map(drop)
                    })
                    .await
                }
            }
        }))
    }

    /// Broadcasts the root's `buf` into every rank's `buf` (all ranks pass the same length).
    pub fn broadcast<'a, T: Element>(
        &self,
        root: Rank,
        buf: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (bytes, me) = (size_of_val(buf), self.rank());
        let alg = self.choose(Operation::Bcast, bytes, true);
        let obs = self.observe(Operation::Bcast, alg, bytes);
        if root < self.size() && alg == Algorithm::SharedMemory {
            let input = if me == root { bytemuck::cast_slice(buf) } else { &[] };
            if me == root && self.board().is_ok_and(|seg| seg.root_now(input)) {
                return obs.wrap(Collective::Ready(Some(Ok(()))));
            }
            let call = self.board_call(BoardOp::Bcast { root }, bytes, input, size_of::<T>());
            return obs.wrap(Collective::board(call, (me != root).then(|| bytemuck::cast_slice_mut(buf))));
        }
        let direct = (root < self.size() && alg == Algorithm::SingleCopy).then(|| {
            let lent = (me == root).then(|| Lent::of(bytemuck::cast_slice(buf)));
            self.lending(BoardOp::Bcast { root }, lent, &[BoardOp::Fanin { root }])
        });
        let run = direct.is_none().then(|| {
            let pool = self.coll().pool.clone();
            let data = (me == root).then(|| pool.copy(buf));
            // The root's copy, whole: the algorithm may cut it into pieces, which cannot go back
            // to the pool one by one.
            let whole = data.clone();
            (self.bcast_with(root, data, alg, size_of::<T>(), Some(bytes)), pool, whole)
        });
        obs.wrap(Collective::boxed(async move {
            let Some((run, pool, whole)) = run else {
                let call = direct.expect("one of the two")?;
                return Box::pin(bcast_single_copy(call, root, me, bytemuck::cast_slice_mut(buf))).await;
            };
            let parts = run.await?;
            if me != root {
                copy_parts(buf, &parts)?;
            }
            // The received (or sent) buffers serve the next large calls: without this, a root
            // whose data went in pieces took (and zeroed) a fresh buffer for its copy every call.
            parts.into_iter().filter_map(|b| b.try_into_mut().ok()).for_each(|b| pool.give(b));
            if let Some(Ok(b)) = whole.map(Bytes::try_into_mut) {
                pool.give(b);
            }
            Ok(())
        }))
    }

    /// Broadcasts bytes whose length only the root knows (binomial tree).
    pub fn broadcast_bytes(
        &self,
        root: Rank,
        data: Option<Bytes>,
    ) -> impl Future<Output = Result<Bytes>> + Send + use<> {
        let early = match (&data, self.rank() == root) {
            (None, true) => Some(InvalidArgument::RootWithoutData { op: "broadcast" }.into()),
            _ => None,
        };
        let obs = self.observe(Operation::Bcast, Algorithm::Binomial, data.as_ref().map_or(0, Bytes::len));
        let run = self.bcast_with(root, data.filter(|_| self.rank() == root), Algorithm::Binomial, 1, None);
        obs.wrap(async move {
            match early {
                Some(e) => Err(e),
                // Binomial: one part, shared as it came.
                None => Ok(ops::join(run.await?)),
            }
        })
    }

    /// `len`: the length every rank knows the data has, if they do. The data comes back in pieces
    /// (one, except for scatter + all-gather), to be copied out or joined by the caller.
    pub(super) fn bcast_with(
        &self,
        root: Rank,
        data: Option<Bytes>,
        alg: Algorithm,
        elem: usize,
        len: Option<usize>,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root);
        let multicast = (alg == Algorithm::Multicast && early.is_none()).then(|| (self.clone(), data.clone()));
        let plan = if early.is_some() || multicast.is_some() {
            None
        } else if alg == Algorithm::Hierarchical {
            // Root -> its node's leader -> every leader -> every node. A root that leads its
            // node skips the first step: its node takes the last one with the others, so the
            // call is two steps deep, as a flat binomial tree across the hosts is, not three.
            let h = self.hierarchy().expect("chosen");
            let (node, root_node) = (&h.node, h.node_of[root as usize]);
            let mine = h.node_of[r as usize] == root_node;
            let node_root = node_rank_of(h, root);
            let leads = node_root == 0;
            let at = |c: &Comm, root: Rank| (c.slot(), c.rank(), c.size(), root);
            let first = (mine && !leads).then(|| at(node, node_root));
            let leaders = h.leaders.as_ref().map(|l| at(l, h.leader_position(root_node)));
            let last = (!mine || leads).then(|| at(node, 0));
            Some(Err(Box::new((data, [first, leaders, last]))))
        } else {
            let m = match (alg, len) {
                (Algorithm::Pipeline, Some(len)) => {
                    // No segment above the largest message a peer takes.
                    let segment = self.collective_table().bcast_segment_for(len).min(self.settings().max_message);
                    let segments = ops::pipeline_segments(len, segment);
                    ops::bcast_pipeline(r, n, root, data, segments, elem)
                        .map(|m| m.with_segment_lens(len, segments, elem).with_lookahead(ops::PIPELINE_LOOKAHEAD))
                }
                (_, len) => ops::bcast(r, n, root, alg, data, elem).map(|m| match len {
                    Some(len) => m.with_block_len(len),
                    None => m,
                }),
            };
            let slot = self.slot();
            Some(Ok((m.map(|m| Comm::drive(slot, m)), alg, n)))
        };
        async move {
            if let Some((comm, data)) = multicast {
                // Boxed, as in the barrier: a large future kept out of every broadcast's.
                return Box::pin(async move {
                    comm.collective_gate()?;
                    let chan = comm.coll().multicast.get_or_try_init(|| Channel::new(&comm)).await?;
                    crate::multicast::broadcast(chan, root, data).await.map(|b| vec![b])
                })
                .await;
            }
            match plan {
                None => Err(early.expect("set")),
                Some(Ok((run, alg, n))) => Ok(ops::bcast_parts(&run?.await?, n, alg)?),
                Some(Err(hier)) => {
                    Box::pin(async move {
                        // Root's node, then the leaders, then the other nodes; each step's root
                        // holds the data by the time it starts.
                        let (have, [first, leaders, last]) = *hier;
                        let step = |(slot, r, n, root): HierStep, have: &Option<Bytes>| {
                            let data = if r == root { have.clone() } else { None };
                            // Received straight into a reused buffer where every rank knows the length.
                            let m = ops::bcast(r, n, root, Algorithm::Binomial, data, elem).map(|m| match len {
                                Some(len) => m.with_block_len(len),
                                None => m,
                            });
                            async move {
                                let blocks = Comm::drive(slot, m?).await?;
                                Ok::<_, Error>(Some(ops::bcast_result(&blocks, n, Algorithm::Binomial)?))
                            }
                        };
                        let mut have = match first {
                            Some(s) => step(s, &have).await?,
                            None => have,
                        };
                        match (leaders, last) {
                            // The root's node's leader, holding the data, sends to the other
                            // leaders and its node at once (as a flat tree's root sends to all
                            // its children at once), not one step after the other.
                            (Some(l), Some(s)) if have.is_some() && s.1 == s.3 => {
                                let (a, b) = futures::future::join(step(l, &have), step(s, &have)).await;
                                a?;
                                b?;
                            }
                            (leaders, last) => {
                                for s in [leaders, last].into_iter().flatten() {
                                    have = step(s, &have).await?;
                                }
                            }
                        }
                        have.map(|b| vec![b])
                            .ok_or_else(|| Error::Internal { what: "a hierarchical broadcast ended without data" })
                    })
                    .await
                }
            }
        }
    }

    pub(super) fn check_root(&self, root: Rank) -> Option<Error> {
        (root >= self.size()).then(|| Error::UnknownRank { rank: root, size: self.size() })
    }

    /// Combines every rank's `data` with `op` at `root`: `Some(result)` there, `None` elsewhere.
    /// The future borrows `data`: by single copy (large calls on one host) the root reads it where
    /// it is.
    pub fn reduce<'a, T: Element>(
        &self,
        root: Rank,
        data: &'a [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<'a, T> {
        self.reduce_to(root, data, None, op)
    }

    /// Combines every rank's `data` with `op` into the root's `out` (`data.len()` elements; the
    /// other ranks pass `None`), as MPI's reduce fills its receive buffer: no allocation per call,
    /// and by single copy the root combines the ranks' data straight into `out`. A root without
    /// `out`, or with one of another length, fails with [`Error::Invalid`] before the call starts.
    pub fn reduce_into<'a, T: Element>(
        &self,
        root: Rank,
        data: &'a [T],
        out: Option<&'a mut [T]>,
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (bytes, r) = (size_of_val(data), self.rank());
        let alg = self.choose(Operation::Reduce, bytes, op.is_commutative());
        let into = Some(out.as_ref().map(|o| o.len()));
        if alg == Algorithm::SharedMemory && self.reduce_refusal(root, data.len(), into, &op).is_none() {
            // On the board, as a broadcast: the result straight into `out`, with nothing boxed.
            let obs = self.observe(Operation::Reduce, alg, bytes);
            let input = bytemuck::cast_slice(data);
            // The other ranks post their part and are done, as a broadcast's root.
            if r != root && self.board().is_ok_and(|seg| seg.root_now(input)) {
                return futures::future::Either::Left(obs.wrap(Collective::Ready(Some(Ok(())))));
            }
            let kind = BoardOp::Reduce { root, op: op.erase() };
            let call = self.board_call(kind, bytes, input, size_of::<T>());
            let dst = out.filter(|_| r == root).map(bytemuck::cast_slice_mut);
            return futures::future::Either::Left(obs.wrap(Collective::board(call, dst)));
        }
        let run = self.reduce_to(root, data, Some(out), op);
        futures::future::Either::Right(async move { run.await.map(drop) })
    }

    /// Why a reduce of `len` elements to `root` cannot be made: the root, the operator, or for
    /// [`Comm::reduce_into`] (`into`: `Some(the length of the caller's buffer, if any)`) the
    /// root's buffer. Shared by the board's branch of `reduce_into` and the general path, so that
    /// both refuse alike; nothing is built unless the call is refused.
    fn reduce_refusal<T: Element>(
        &self,
        root: Rank,
        len: usize,
        into: Option<Option<usize>>,
        op: &ReduceOp<T>,
    ) -> Option<Error> {
        let root_here = self.rank() == root;
        self.check_root(root).or_else(|| check_op(op).err()).or_else(|| match into {
            Some(None) if root_here => Some(InvalidArgument::RootWithoutData { op: "reduce_into" }.into()),
            Some(Some(got)) if root_here && got != len => {
                Some(InvalidArgument::LengthMismatch { expected: len, got }.into())
            }
            _ => None,
        })
    }

    /// [`Comm::reduce`] (`into`: `None`, the root allocates its result) and
    /// [`Comm::reduce_into`] (`into`: `Some(the caller's buffer)`).
    fn reduce_to<'a, T: Element>(
        &self,
        root: Rank,
        data: &'a [T],
        into: Option<Option<&'a mut [T]>>,
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<'a, T> {
        let alg = self.choose(Operation::Reduce, size_of_val(data), op.is_commutative());
        let obs = self.observe(Operation::Reduce, alg, size_of_val(data));
        let (r, n) = (self.rank(), self.size());
        let early = self.reduce_refusal(root, data.len(), into.as_ref().map(|o| o.as_ref().map(|o| o.len())), &op);
        let len = size_of_val(data);
        let board = (early.is_none() && alg == Algorithm::SharedMemory).then(|| {
            let kind = BoardOp::Reduce { root, op: op.erase() };
            self.board_future(kind, len, bytemuck::cast_slice(data), size_of::<T>())
        });
        // The root's result: the caller's buffer, or one it returns (made now: single copy on
        // 2 ranks lends it).
        let mut owned = (r == root && into.is_none()).then(|| vec![T::zeroed(); data.len()]);
        let mut into = into;
        // Single copy: on 2 ranks the other rank combines half and writes it into the root's
        // result; on more the combining split between the ranks from REDUCE_SPLIT_MIN, the root
        // combining alone below it.
        let pair = n == 2;
        let split = !pair && len >= REDUCE_SPLIT_MIN;
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| match (pair, split) {
            (true, _) => {
                let dst = owned.as_deref().or(into.as_mut().and_then(|o| o.as_deref()).filter(|_| r == root));
                self.lend_for_reduce_pair(data, dst.map(bytemuck::cast_slice::<T, u8>))
            }
            (false, true) => self.lend_for_reduce(data, root),
            (false, false) => self.lend(data, Lend::InPlace),
        });
        let plan = (early.is_none() && board.is_none() && direct.is_none()).then(|| {
            let m = ops::reduce(r, n, root, alg, to_bytes(data), op.erase()).map(|m| m.with_block_len(len));
            (self.slot(), m)
        });
        let pool = self.coll().pool.clone();
        obs.wrap(async move {
            if let Some(e) = early {
                return Err(e);
            }
            let dst: Option<&mut [u8]> = match (owned.as_deref_mut(), into) {
                (Some(v), _) => Some(bytemuck::cast_slice_mut(v)),
                (None, Some(o)) => o.filter(|_| r == root).map(bytemuck::cast_slice_mut),
                (None, None) => None,
            };
            if let Some(call) = direct {
                // Straight from the others' memory, this rank's own data from `data`, which the
                // future borrows (the others' calls lend theirs in place too).
                let own: &[u8] = bytemuck::cast_slice(data);
                if pair {
                    Box::pin(reduce_pair(call?, root, r, own, dst, op.erase(), &pool)).await?;
                } else if split {
                    Box::pin(reduce_single_copy(call?, root, r, n, own, dst, op.erase(), &pool)).await?;
                } else {
                    gather_single_copy(call?, n, len, &pool, |call, lent| match dst {
                        Some(dst) => combine(call, lent, r as usize, &op.erase(), 0, Some(own), dst, &pool),
                        None => Ok(()),
                    })
                    .await?;
                }
            } else if let Some(call) = board {
                let pieces = call?.await?;
                if let Some(dst) = dst {
                    copy_parts(dst, &pieces)?;
                }
            } else {
                let (slot, m) = plan.ok_or(Error::Internal { what: "a reduce planned without a path" })?;
                let blocks = Comm::drive(slot, m?).await?;
                if let Some(dst) = dst {
                    copy_parts(dst, &[ops::concat(&blocks, [0])?])?;
                }
            }
            Ok(owned)
        })
    }

    /// Gathers every rank's `data` (all of one length) at `root`, concatenated in rank order.
    pub fn gather<T: Element>(
        &self,
        root: Rank,
        data: &[T],
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<T> {
        let (bytes, r, n) = (size_of_val(data), self.rank(), self.size());
        let alg = self.choose(Operation::Gather, bytes, true);
        if self.check_root(root).is_none() && matches!(alg, Algorithm::SharedMemory | Algorithm::SingleCopy) {
            let obs = self.observe(Operation::Gather, alg, bytes);
            let count = data.len() * n as usize;
            // The root's result, lent to the others by single copy (they may push their parts).
            let mut out = (r == root).then(|| vec![T::zeroed(); count]);
            let call = if alg == Algorithm::SharedMemory {
                let input = bytemuck::cast_slice(data);
                Ok(self.board_future(BoardOp::Gather { root }, bytes, input, size_of::<T>()))
            } else {
                // The future does not borrow `data`: the call lends a pooled copy.
                let dst = out.as_deref().map(bytemuck::cast_slice::<T, u8>);
                Err(self.lend_for_gather(data, Lend::Copy, dst))
            };
            let pool = self.coll().pool.clone();
            return futures::future::Either::Left(obs.wrap(async move {
                let dst = out.as_deref_mut().map(bytemuck::cast_slice_mut::<T, u8>);
                match call {
                    Ok(call) => {
                        let pieces = call?.await?;
                        if let Some(dst) = dst {
                            copy_gathered(dst, &pieces, n as usize)?;
                        }
                    }
                    Err(call) => Box::pin(gather_direct(call?, root, r, n, bytes, None, dst, &pool)).await?,
                }
                Ok(out)
            }));
        }
        // Messages: the input in a pooled buffer, the parts laid end to end straight into the
        // result (one allocation), and the buffers back to the pool.
        let pool = self.coll().pool.clone();
        let run = self.gather_plan(root, pool.copy(data), bytes);
        futures::future::Either::Right(async move {
            let Some(parts) = run.await? else { return Ok(None) };
            let mut out = vec![T::zeroed(); parts.iter().map(Bytes::len).sum::<usize>() / size_of::<T>()];
            copy_parts(&mut out, &parts)?;
            parts.into_iter().filter_map(|b| b.try_into_mut().ok()).for_each(|b| pool.give(b));
            Ok(Some(out))
        })
    }

    /// Gathers every rank's `data` (all of one length) into the root's `out`, concatenated in
    /// rank order (`out`: `data.len()` elements per rank; the other ranks pass `None`). The
    /// future borrows `data`: by single copy (large calls on one host) the root reads it where it
    /// is, and writes every part straight into `out`.
    pub fn gather_into<'a, T: Element>(
        &self,
        root: Rank,
        data: &'a [T],
        out: Option<&'a mut [T]>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (bytes, r, n) = (size_of_val(data), self.rank(), self.size());
        let alg = self.choose(Operation::Gather, bytes, true);
        let obs = self.observe(Operation::Gather, alg, bytes);
        let out = out.filter(|_| r == root);
        let early = self.check_root(root).or_else(|| match &out {
            None if r == root => Some(InvalidArgument::RootWithoutData { op: "gather_into" }.into()),
            Some(o) if o.len() != data.len() * n as usize => {
                Some(InvalidArgument::LengthMismatch { expected: data.len() * n as usize, got: o.len() }.into())
            }
            _ => None,
        });
        let own: &[u8] = bytemuck::cast_slice(data);
        if early.is_none() && alg == Algorithm::SharedMemory {
            // On the board, as an all-gather: the parts straight into the root's `out`, with
            // nothing boxed; the other ranks are done once they have posted. Why not in the future
            // below: it holds every path's state, and those ranks would move it right after their
            // post, behind the line the root is reading (see `Collective`). They post their part
            // and are done, as a broadcast's root.
            if r != root && self.board().is_ok_and(|seg| seg.root_now(own)) {
                return futures::future::Either::Left(obs.wrap(Collective::Ready(Some(Ok(())))));
            }
            let call = self.board_call(BoardOp::Gather { root }, bytes, own, size_of::<T>());
            let dst = out.map(bytemuck::cast_slice_mut::<T, u8>);
            return futures::future::Either::Left(obs.wrap(Collective::board_gathered(call, dst, n)));
        }
        let on_host = early.is_none() && matches!(alg, Algorithm::SharedMemory | Algorithm::SingleCopy);
        let call = on_host.then(|| match alg {
            Algorithm::SharedMemory => Ok(self.board_future(BoardOp::Gather { root }, bytes, own, size_of::<T>())),
            _ => Err(self.lend_for_gather(data, Lend::InPlace, out.as_deref().map(bytemuck::cast_slice::<T, u8>))),
        });
        let pool = self.coll().pool.clone();
        let run = (early.is_none() && call.is_none()).then(|| self.gather_plan(root, pool.copy(data), bytes));
        futures::future::Either::Right(obs.wrap(async move {
            if let Some(e) = early {
                return Err(e);
            }
            let dst = out.map(bytemuck::cast_slice_mut::<T, u8>);
            match (call, run) {
                (Some(Ok(call)), _) => {
                    let pieces = call?.await?;
                    dst.map_or(Ok(()), |dst| copy_gathered(dst, &pieces, n as usize))
                }
                (Some(Err(call)), _) => Box::pin(gather_direct(call?, root, r, n, bytes, Some(own), dst, &pool)).await,
                (None, Some(run)) => {
                    let Some(parts) = run.await? else { return Ok(()) };
                    let copied = dst.map_or(Ok(()), |dst| copy_parts(dst, &parts));
                    parts.into_iter().filter_map(|b| b.try_into_mut().ok()).for_each(|b| pool.give(b));
                    copied
                }
                (None, None) => Err(Error::Internal { what: "a gather planned without a path" }),
            }
        }))
    }

    /// Gathers every rank's `data` (lengths may differ) at `root`: one vector per rank.
    pub fn gatherv<T: Element>(
        &self,
        root: Rank,
        data: &[T],
    ) -> impl Future<Output = Result<Option<Vec<Vec<T>>>>> + Send + use<T> {
        let run = self.gather_bytes(root, to_bytes(data));
        async move {
            let Some(parts) = run.await? else { return Ok(None) };
            parts.iter().map(to_vec).collect::<Result<Vec<_>>>().map(Some)
        }
    }

    /// Gathers one message per rank at `root` (any lengths).
    pub fn gather_bytes(
        &self,
        root: Rank,
        data: Bytes,
    ) -> impl Future<Output = Result<Option<Vec<Bytes>>>> + Send + use<> {
        // Lengths may differ between ranks, so the choice may not depend on them.
        self.gather_plan(root, data, 0)
    }

    pub(super) fn gather_plan(
        &self,
        root: Rank,
        data: Bytes,
        bytes: usize,
    ) -> impl Future<Output = Result<Option<Vec<Bytes>>>> + Send + use<> {
        // Messages: the tiers on one host serve the typed calls (`Comm::gather`).
        let alg = self.choose_messages(Operation::Gather, bytes, true);
        let obs = self.observe(Operation::Gather, alg, data.len());
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root);
        let plan = early.is_none().then(|| (self.slot(), ops::gather(r, n, root, alg, data)));
        let pool = self.coll().pool.clone();
        obs.wrap(async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            let blocks = Comm::drive(slot, m?).await?;
            if r != root {
                pool.recycle(blocks);
                return Ok(None);
            }
            Ok(Some(ops::gather_result(&blocks, n, root)?))
        })
    }

    /// Splits the root's `data` into equal parts, one per rank in rank order, and returns this
    /// rank's part. Other ranks pass `None`.
    pub fn scatter<T: Element>(
        &self,
        root: Rank,
        data: Option<&[T]>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let n = self.size() as usize;
        // The root's data in one pooled buffer, the parts slices of it.
        let pool = self.coll().pool.clone();
        let whole = data.filter(|d| d.len().is_multiple_of(n)).map(|d| pool.copy(d));
        let parts = match data {
            Some(d) if !d.len().is_multiple_of(n) => {
                Err(InvalidArgument::Indivisible { len: d.len(), parts: n }.into())
            }
            Some(d) => {
                let k = size_of_val(d) / n;
                Ok(whole.as_ref().map(|w| (0..n).map(|i| w.slice(i * k..(i + 1) * k)).collect()))
            }
            None => Ok(None),
        };
        let run = self.scatter_bytes_typed::<T>(root, parts);
        async move {
            let out = run.await;
            // Every slice is gone once the call is over: the buffer serves the next calls.
            if let Some(b) = whole.and_then(|w| w.try_into_mut().ok()) {
                pool.give(b);
            }
            out
        }
    }

    /// Splits the root's `data` into equal blocks, one per rank in rank order, and copies this
    /// rank's into `out`. Every rank passes its block's length (`out`, as MPI's receive count) and
    /// the root its data (`out.len()` elements per rank); the others pass `None`. Since every rank
    /// knows the size, the call takes the tiers of one host ([`Comm::gather`]'s): the
    /// shared-memory board for small blocks, single copy for large ones (each rank copies its
    /// block straight out of the root's `data`, which the future borrows), messages otherwise.
    pub fn scatter_into<'a, T: Element>(
        &self,
        root: Rank,
        data: Option<&'a [T]>,
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (bytes, r, n) = (size_of_val(out), self.rank(), self.size());
        let alg = self.choose(Operation::Scatter, bytes, true);
        let obs = self.observe(Operation::Scatter, alg, bytes);
        let data = data.filter(|_| r == root);
        let early = self.check_root(root).or_else(|| match data {
            None if r == root => Some(InvalidArgument::RootWithoutData { op: "scatter" }.into()),
            Some(d) if d.len() != out.len() * n as usize => {
                Some(InvalidArgument::LengthMismatch { expected: out.len() * n as usize, got: d.len() }.into())
            }
            _ => None,
        });
        let input: &[u8] = data.map_or(&[], bytemuck::cast_slice);
        let own = move || input.get(r as usize * bytes..(r as usize + 1) * bytes).unwrap_or_default();
        if early.is_none() && alg == Algorithm::SharedMemory {
            // On the board, as a broadcast: the root copies its own block and is done once it has
            // posted; the others' blocks straight into `out`, with nothing boxed.
            let dst: &mut [u8] = bytemuck::cast_slice_mut(out);
            if r == root {
                dst.copy_from_slice(own());
                if self.board().is_ok_and(|seg| seg.scatter_root_now(input)) {
                    return obs.wrap(Collective::Ready(Some(Ok(()))));
                }
            }
            let call = self.board_call(BoardOp::Scatter { root }, bytes * n as usize, input, size_of::<T>());
            return obs.wrap(Collective::board(call, (r != root).then_some(dst)));
        }
        // Single copy: this rank's block straight from the root's data.
        let call = (early.is_none() && alg == Algorithm::SingleCopy).then(|| {
            let lent = (r == root).then(|| Lent::of(input));
            self.lending(BoardOp::Bcast { root }, lent, &[BoardOp::Fanin { root }])
        });
        // Messages: the root's data in one pooled buffer, the parts slices of it.
        let pool = self.coll().pool.clone();
        let run = (early.is_none() && call.is_none()).then(|| {
            let whole = data.map(|d| pool.copy(d));
            let parts = whole.as_ref().map(|w| (0..n as usize).map(|i| w.slice(i * bytes..(i + 1) * bytes)).collect());
            (self.scatter_bytes(root, parts), whole)
        });
        obs.wrap(Collective::boxed(async move {
            if let Some(e) = early {
                return Err(e);
            }
            let dst: &mut [u8] = bytemuck::cast_slice_mut(out);
            match (call, run) {
                (Some(call), _) => scatter_single_copy(call?, root, r, own(), dst).await,
                (None, Some((run, whole))) => {
                    let part = run.await;
                    // Every slice is gone once the call is over: the buffer serves the next calls.
                    if let Some(b) = whole.and_then(|w| w.try_into_mut().ok()) {
                        pool.give(b);
                    }
                    let part = part?;
                    if part.len() != dst.len() {
                        return Err(InvalidArgument::LengthMismatch { expected: dst.len(), got: part.len() }.into());
                    }
                    dst.copy_from_slice(&part);
                    if let Ok(b) = part.try_into_mut() {
                        pool.give(b);
                    }
                    Ok(())
                }
                (None, None) => Err(Error::Internal { what: "a scatter planned without a path" }),
            }
        }))
    }

    /// Sends `parts[i]` of the root to rank i (lengths may differ); returns this rank's part.
    pub fn scatterv<T: Element>(
        &self,
        root: Rank,
        parts: Option<&[Vec<T>]>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        self.scatter_bytes_typed::<T>(root, Ok(parts.map(|p| p.iter().map(|v| to_bytes(v)).collect())))
    }

    pub(super) fn scatter_bytes_typed<T: Element>(
        &self,
        root: Rank,
        parts: Result<Option<Vec<Bytes>>>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let run = parts.map(|p| self.scatter_bytes(root, p));
        let pool = self.coll().pool.clone();
        async move {
            let part = run?.await?;
            let out = to_vec(&part);
            // A received part (a pooled receive buffer) serves the next calls.
            if let Ok(b) = part.try_into_mut() {
                pool.give(b);
            }
            out
        }
    }

    /// Sends message `parts[i]` of the root to rank i; returns this rank's.
    pub fn scatter_bytes(
        &self,
        root: Rank,
        parts: Option<Vec<Bytes>>,
    ) -> impl Future<Output = Result<Bytes>> + Send + use<> {
        // Lengths are known to the root only: messages (`Comm::scatter_into` takes the tiers).
        let alg = self.choose_messages(Operation::Scatter, 0, true);
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root).or_else(|| match (&parts, r == root) {
            (Some(p), true) if p.len() != n as usize => {
                Some(InvalidArgument::CountMismatch { expected: n as usize, got: p.len() }.into())
            }
            (None, true) => Some(InvalidArgument::RootWithoutData { op: "scatter" }.into()),
            _ => None,
        });
        // Bytes the root sends (what the others receive is known only once it arrives).
        let sent = if r == root { parts.iter().flatten().map(Bytes::len).sum() } else { 0 };
        let obs = self.observe(Operation::Scatter, alg, sent);
        let plan = early.is_none().then(|| (self.slot(), ops::scatter(r, n, root, alg, parts.filter(|_| r == root))));
        obs.wrap(async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            // (The other blocks are dropped here: the result is unique, for the caller to reuse.)
            Ok(ops::scatter_result(&Comm::drive(slot, m?).await?, r, n, root)?)
        })
    }
}
