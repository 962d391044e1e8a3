//! The collectives in which every rank gets a result: allreduce, allgather, all-to-all,
//! reduce-scatter, scans.

use super::*;

/// Why an all-to-all of `data` into `out` over `n` ranks cannot be made, if it cannot.
pub(super) fn alltoall_misfit<T>(data: &[T], out: &[T], n: u32) -> Option<Error> {
    if !data.len().is_multiple_of(n as usize) {
        Some(InvalidArgument::Indivisible { len: data.len(), parts: n as usize }.into())
    } else if out.len() != data.len() {
        Some(InvalidArgument::LengthMismatch { expected: size_of_val(data), got: size_of_val(out) }.into())
    } else {
        None
    }
}

impl Comm {
    /// Combines every rank's `buf` with `op` and leaves the result in every rank's `buf`.
    pub fn allreduce<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let alg = self.choose(Operation::Allreduce, size_of_val(buf), op.is_commutative());
        let obs = self.observe(Operation::Allreduce, alg, size_of_val(buf));
        let early = check_op(&op).err();
        let (r, n) = (self.rank(), self.size());
        if early.is_none() && alg == Algorithm::SharedMemory {
            let kind = BoardOp::Allreduce(op.erase());
            let call = self.board_call(kind, size_of_val(buf), bytemuck::cast_slice(buf), size_of::<T>());
            return obs.wrap(Collective::board(call, Some(bytemuck::cast_slice_mut(buf))));
        }
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| {
            let lent = Lent::of(bytemuck::cast_slice(buf));
            self.lending(BoardOp::Allgather, Some(lent), &[BoardOp::Barrier, BoardOp::Barrier])
        });
        let pool = self.coll().pool.clone();
        let data = if direct.is_none() { pool.copy(buf) } else { Bytes::new() };
        let plan = if early.is_some() || direct.is_some() {
            None
        } else if alg == Algorithm::Hierarchical {
            let h = self.hierarchy().expect("chosen");
            let node = &h.node;
            // Every step's bare blocks are the whole vector: received straight into reused
            // buffers, as in the flat algorithms.
            let bytes = size_of_val(buf);
            let reduce = ops::reduce(node.rank(), node.size(), 0, Algorithm::Binomial, data, op.erase());
            let up = (node.slot(), reduce.map(|m| m.with_block_len(bytes)));
            let mid = h.leaders.as_ref().map(|l| {
                let a = l.choose(Operation::Allreduce, bytes, true);
                (l.slot(), l.size(), a, op.erase())
            });
            let down = (node.slot(), bytes);
            let (nr, nn) = (node.rank(), node.size());
            Some(Err(Box::new((up, mid, down, nr, nn))))
        } else {
            let (bytes, slot) = (size_of_val(buf), self.slot());
            Some(Ok(ops::allreduce(r, n, alg, data, op.erase()).map(|m| Comm::drive(slot, m.with_block_len(bytes)))))
        };
        obs.wrap(Collective::boxed(async move {
            if let Some(call) = direct {
                let buf = bytemuck::cast_slice_mut(buf);
                return Box::pin(allreduce_single_copy(call?, buf, op.erase(), r, n, &pool)).await;
            }
            let out = match plan {
                None => return Err(early.expect("set")),
                Some(Ok(run)) => {
                    let blocks = run?.await?;
                    // Segments straight into `buf` (not laid end to end first).
                    copy_parts(buf, &ops::allreduce_parts(&blocks, n, alg)?)?;
                    pool.recycle(blocks);
                    return Ok(());
                }
                Some(Err(hier)) => {
                    Box::pin(async move {
                        let (up, mid, (down, bytes), nr, nn) = *hier;
                        let partial = ops::concat(&Comm::drive(up.0, up.1?).await?, [0])?;
                        let mut have = (nr == 0).then_some(partial);
                        if let (Some((slot, ln, a, reducer)), Some(d)) = (mid, have.take()) {
                            let lr = slot.comm.rank();
                            let m = ops::allreduce(lr, ln, a, d, reducer)?.with_block_len(bytes);
                            have = Some(ops::allreduce_result(&Comm::drive(slot, m).await?, ln, a)?);
                        }
                        let m = ops::bcast(nr, nn, 0, Algorithm::Binomial, have, size_of::<T>())?.with_block_len(bytes);
                        Ok::<_, Error>(ops::bcast_result(&Comm::drive(down, m).await?, nn, Algorithm::Binomial)?)
                    })
                    .await?
                }
            };
            copy_into(buf, &out)
        }))
    }

    /// Every rank's `data` (all of one length), concatenated in rank order, at every rank.
    pub fn allgather<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let mut out = vec![T::zeroed(); data.len() * self.size() as usize];
        let run = self.allgather_plan(data, &mut out, Lend::Copy);
        let mut out = self.hold_result(Operation::Allgather, size_of_val(data), out);
        async move {
            run(out.get()).await?;
            Ok(out.into_inner())
        }
    }

    /// [`Comm::allgather`] into `out` (`size` times the length of `data`), like `MPI_Allgather`.
    /// The future borrows `data`: by single copy (large calls on one host) the other ranks read it
    /// where it is.
    pub fn allgather_into<'a, T: Element>(
        &self,
        data: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        // On the board: the blocks straight into `out`, with nothing boxed (as a broadcast).
        if self.choose(Operation::Allgather, size_of_val(data), true) == Algorithm::SharedMemory {
            let obs = self.observe(Operation::Allgather, Algorithm::SharedMemory, size_of_val(data));
            let call =
                self.board_call(BoardOp::Allgather, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>());
            return obs.wrap(Collective::board_gathered(call, Some(bytemuck::cast_slice_mut(out)), self.size()));
        }
        let run = self.allgather_plan(data, out, Lend::InPlace);
        Observe::ELSEWHERE.wrap(Collective::boxed(lending_in_place(data, run(out))))
    }

    /// Plans an all-gather of `data` into `out` (this rank's own block goes in now, by single
    /// copy); the returned closure runs the rest into the same `out`. `lend`: see [`Lend`].
    pub(super) fn allgather_plan<T: Element>(
        &self,
        data: &[T],
        out: &mut [T],
        lend: Lend,
    ) -> impl FnOnce(&mut [T]) -> futures::future::BoxFuture<'_, Result<()>> + use<T> {
        let alg = self.choose(Operation::Allgather, size_of_val(data), true);
        let obs = self.observe(Operation::Allgather, alg, size_of_val(data));
        let (r, n) = (self.rank(), self.size());
        let pool = self.coll().pool.clone();
        let bytes = bytemuck::cast_slice(data);
        let len = bytes.len();
        let board =
            (alg == Algorithm::SharedMemory).then(|| self.board_future(BoardOp::Allgather, len, bytes, size_of::<T>()));
        let direct = (alg == Algorithm::SingleCopy).then(|| {
            let out: &mut [u8] = bytemuck::cast_slice_mut(out);
            if out.len() != n as usize * len {
                return Err(InvalidArgument::LengthMismatch { expected: n as usize * len, got: out.len() }.into());
            }
            out[r as usize * len..(r as usize + 1) * len].copy_from_slice(bytes);
            self.lend(data, lend)
        });
        let rdma = (alg == Algorithm::Rdma).then(|| {
            let out: &mut [u8] = bytemuck::cast_slice_mut(out);
            // A mismatch still takes the call's slot: the peers learn of it (a refusal).
            let misfit = (out.len() != n as usize * len).then(|| {
                Error::Invalid(InvalidArgument::LengthMismatch { expected: n as usize * len, got: out.len() })
            });
            if misfit.is_none() {
                // The own block goes from here to the peers: nothing else is copied.
                out[r as usize * len..(r as usize + 1) * len].copy_from_slice(bytes);
            }
            (self.slot(), self.coll().rdma.turn(), misfit)
        });
        let plan = (board.is_none() && direct.is_none() && rdma.is_none())
            .then(|| (self.slot(), ops::allgather(r, n, alg, pool.copy(data))));
        move |out: &mut [T]| {
            Box::pin(obs.wrap(async move {
                if let Some((slot, turn, misfit)) = rdma {
                    if let Some(e) = misfit {
                        return rdma::refuse(slot, turn, rdma::Refusal::Length, e).await;
                    }
                    let (shape, src) = (rdma::Shape::Allgather, rdma::Source::OwnBlock);
                    return rdma::run(slot, turn, shape, src, len, bytemuck::cast_slice_mut(out)).await;
                }
                if let Some(call) = direct {
                    // Every other block straight from its rank's memory into `out`.
                    let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                    return gather_single_copy(call?, n, len, &pool, |call, lent| {
                        for (i, block) in out.chunks_exact_mut(len.max(1)).enumerate().take(n as usize) {
                            if i != r as usize {
                                call.read(i as Rank, &lent[i], 0, block)?;
                            }
                        }
                        Ok(())
                    })
                    .await;
                }
                let Some(plan) = plan else {
                    let pieces = board.expect("one of the two")?.await?;
                    return copy_gathered(out, &pieces, n as usize);
                };
                let blocks = Comm::drive(plan.0, plan.1?).await?;
                copy_parts(out, &ops::allgather_result(&blocks, n)?)?;
                pool.recycle(blocks);
                Ok(())
            }))
        }
    }

    /// An owned call's result vector: held by the RDMA tier when the call goes by RDMA writes
    /// (retired, not freed, if the call ends early: a peer may still write into it).
    fn hold_result<T: Element>(&self, op: Operation, bytes: usize, out: Vec<T>) -> rdma::HeldResult<T> {
        if self.choose(op, bytes, true) == Algorithm::Rdma {
            self.coll().rdma.hold(out)
        } else {
            rdma::HeldResult::plain(out)
        }
    }

    /// Every rank's `data` (lengths may differ), one vector per rank, at every rank.
    pub fn allgatherv<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<Vec<T>>>> + Send + use<T> {
        let run = self.allgather_bytes(to_bytes(data));
        async move { run.await?.iter().map(to_vec).collect() }
    }

    /// Every rank's message (any lengths) at every rank.
    pub fn allgather_bytes(&self, data: Bytes) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        // Lengths differ between ranks: not for the board, whose all-gather parts are all alike,
        // nor for single copy; and all-gather has no multicast or node-leader form: the table's.
        let alg = self.collective_table().choose(Call {
            op: Operation::Allgather,
            ranks: self.size(),
            bytes: 0,
            commutative: true,
        });
        self.allgather_with(data, alg)
    }

    pub(super) fn allgather_with(
        &self,
        data: Bytes,
        alg: Algorithm,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let obs = self.observe(Operation::Allgather, alg, data.len());
        let (slot, m) = (self.slot(), ops::allgather(r, n, alg, data));
        obs.wrap(async move { Ok(ops::allgather_result(&Comm::drive(slot, m?).await?, n)?) })
    }

    /// All-to-all: `data` holds one equal part per rank in rank order; the result holds what each
    /// rank sent to this one, in rank order.
    pub fn alltoall<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let mut out = vec![T::zeroed(); data.len()];
        let run = self.alltoall_plan(data, &mut out, Lend::Copy);
        let part = size_of_val(data) / self.size() as usize;
        let mut out = self.hold_result(Operation::Alltoall, part, out);
        async move {
            run(out.get()).await?;
            Ok(out.into_inner())
        }
    }

    /// [`Comm::alltoall`] into `out` (as long as `data`), like `MPI_Alltoall`. The future borrows
    /// `data`: by single copy (large calls on one host) the other ranks read it where it is.
    pub fn alltoall_into<'a, T: Element>(
        &self,
        data: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        // On the board (always one piece): this rank's block of every rank's data, in rank order,
        // straight into `out`, with nothing boxed.
        let part = size_of_val(data) / self.size() as usize;
        if alltoall_misfit(data, out, self.size()).is_none()
            && self.choose(Operation::Alltoall, part, true) == Algorithm::SharedMemory
        {
            let obs = self.observe(Operation::Alltoall, Algorithm::SharedMemory, size_of_val(data));
            let call =
                self.board_call(BoardOp::Alltoall, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>());
            return obs.wrap(Collective::board(call, Some(bytemuck::cast_slice_mut(out))));
        }
        let run = self.alltoall_plan(data, out, Lend::InPlace);
        Observe::ELSEWHERE.wrap(Collective::boxed(lending_in_place(data, run(out))))
    }

    /// Plans an all-to-all of `data` into `out`. This rank's own part goes from `data` to `out`
    /// now, directly: only the parts that travel are copied into the call's buffers (and only
    /// received ones copied out), one pass over the own part instead of two. The returned
    /// closure runs the rest into the same `out`. `lend`: see [`Lend`].
    pub(super) fn alltoall_plan<T: Element>(
        &self,
        data: &[T],
        out: &mut [T],
        lend: Lend,
    ) -> impl FnOnce(&mut [T]) -> futures::future::BoxFuture<'_, Result<()>> + use<T> {
        let (r, n) = (self.rank(), self.size());
        let early = alltoall_misfit(data, out, n);
        let elems = data.len() / n as usize;
        let part = elems * size_of::<T>();
        let pool = self.coll().pool.clone();
        let mine = r as usize * elems..(r as usize + 1) * elems;
        let alg = self.choose(Operation::Alltoall, part, true);
        let obs = self.observe(Operation::Alltoall, alg, size_of_val(data));
        let board = (early.is_none() && alg == Algorithm::SharedMemory).then(|| {
            self.board_future(BoardOp::Alltoall, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>())
        });
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| self.lend(data, lend));
        if early.is_none() && board.is_none() {
            // Messages and single copy alike: the own part does not travel.
            out[mine.clone()].copy_from_slice(&data[mine.clone()]);
        }
        let rdma = (alg == Algorithm::Rdma).then(|| {
            if let Some(e) = &early {
                // A mismatch still takes the call's slot: the peers learn of it (a refusal).
                return (self.slot(), self.coll().rdma.turn(), Err(e.clone()));
            }
            let src = match lend {
                // SAFETY: `Lend::InPlace` is only for a future that borrows `data` until its end
                // (`lending_in_place`), unchanged: the device reads it where it is.
                Lend::InPlace => rdma::Source::Borrowed(unsafe { rdma::Lent::new(bytemuck::cast_slice(data)) }),
                Lend::Copy => rdma::Source::Owned(Bytes::copy_from_slice(bytemuck::cast_slice(data))),
            };
            (self.slot(), self.coll().rdma.turn(), Ok(src))
        });
        let plan = (early.is_none() && board.is_none() && direct.is_none() && rdma.is_none()).then(|| {
            let travel = (0..n as usize).filter(|&i| i != r as usize).map(|i| &data[i * elems..(i + 1) * elems]);
            let mut all = pool.take(part * (n as usize - 1));
            for (chunk, src) in all.chunks_mut(part.max(1)).zip(travel) {
                chunk.copy_from_slice(bytemuck::cast_slice(src));
            }
            let all = all.freeze();
            // The own part is an empty block: it never travels (no algorithm sends a rank's own
            // block) and is not read back. Part i > r sits at i - 1 in `all`.
            let parts = (0..n as usize)
                .map(|i| match i.cmp(&(r as usize)) {
                    std::cmp::Ordering::Less => all.slice(i * part..(i + 1) * part),
                    std::cmp::Ordering::Equal => Bytes::new(),
                    std::cmp::Ordering::Greater => all.slice((i - 1) * part..i * part),
                })
                .collect();
            (self.slot(), ops::alltoall(r, n, alg, parts))
        });
        move |out: &mut [T]| {
            Box::pin(obs.wrap(async move {
                if let Some(call) = direct {
                    // Block `r` of every rank's data straight from its memory (the own one is in).
                    let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                    return gather_single_copy(call?, n, part * n as usize, &pool, |call, lent| {
                        for (i, block) in out.chunks_exact_mut(part.max(1)).enumerate().take(n as usize) {
                            if i != r as usize {
                                call.read(i as Rank, &lent[i], r as usize * part, block)?;
                            }
                        }
                        Ok(())
                    })
                    .await;
                }
                if let Some(call) = board {
                    return copy_parts(out, &call?.await?);
                }
                if let Some((slot, turn, src)) = rdma {
                    let src = match src {
                        Ok(src) => src,
                        Err(e) => return rdma::refuse(slot, turn, rdma::Refusal::Length, e).await,
                    };
                    // The own part is in `out` already.
                    let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                    return rdma::run(slot, turn, rdma::Shape::Alltoall, src, part, out).await;
                }
                let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
                let blocks = Comm::drive(slot, m?).await?;
                let got = ops::alltoall_result(&blocks, r, n)?;
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
                for (i, b) in got.iter().enumerate().filter(|&(i, _)| i != r as usize) {
                    if b.len() != part {
                        let why = "an all-to-all part of another length";
                        return Err(CollError::Malformed { from: i as u32, why }.into());
                    }
                    bytes[i * part..(i + 1) * part].copy_from_slice(b);
                }
                pool.recycle(blocks);
                Ok(())
            }))
        }
    }

    /// All-to-all with parts of any lengths: `parts[i]` goes to rank i.
    pub fn alltoallv<T: Element>(&self, parts: &[Vec<T>]) -> impl Future<Output = Result<Vec<Vec<T>>>> + Send + use<T> {
        let run = self.alltoall_bytes(parts.iter().map(|p| to_bytes(p)).collect());
        async move { run.await?.iter().map(to_vec).collect() }
    }

    /// All-to-all of messages: `parts[i]` goes to rank i (pairwise exchange: lengths may differ).
    pub fn alltoall_bytes(&self, parts: Vec<Bytes>) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let table = self.collective_table();
        // Lengths differ between ranks: a pinned algorithm if it can take that, pairwise otherwise.
        let pinned = table.overrides.get(&Operation::Alltoall).copied();
        let alg = pinned.filter(|a| a.serves(Operation::Alltoall)).unwrap_or(Algorithm::Pairwise);
        self.alltoall_with(parts, alg)
    }

    pub(super) fn alltoall_with(
        &self,
        parts: Vec<Bytes>,
        alg: Algorithm,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let obs = self.observe(Operation::Alltoall, alg, parts.iter().map(Bytes::len).sum());
        let (slot, m) = (self.slot(), ops::alltoall(r, n, alg, parts));
        obs.wrap(async move { Ok(ops::alltoall_result(&Comm::drive(slot, m?).await?, r, n)?) })
    }

    /// Reduces `data` element-wise over all ranks and scatters the result: rank i gets
    /// `counts[i]` elements (in order). Every rank passes the same `counts`.
    pub fn reduce_scatter<T: Element>(
        &self,
        data: &[T],
        counts: &[usize],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let (r, elem) = (self.rank() as usize, size_of::<T>());
        let alg = self.choose(Operation::ReduceScatter, size_of_val(data), op.is_commutative());
        if alg == Algorithm::SharedMemory && self.reduce_scatter_refusal(counts, data.len(), &op).is_none() {
            // On the board the call copies `data` as it posts it: no pooled copy of it first and
            // no segments, which a small call would pay for every time; and its future holds the
            // call boxed, as the other small collectives' do.
            let obs = self.observe(Operation::ReduceScatter, alg, size_of_val(data));
            let start = counts[..r].iter().sum::<usize>() * elem;
            let count = counts[r];
            let kind = BoardOp::ReduceScatter { op: op.erase(), part: start..start + count * elem };
            let call = self.board_call(kind, size_of_val(data), bytemuck::cast_slice(data), elem);
            return futures::future::Either::Left(obs.wrap(BoardVec::new(call, count)));
        }
        futures::future::Either::Right(self.reduce_scatter_with(self.coll().pool.copy(data), data.len(), counts, op))
    }

    /// Why a reduce-scatter of `len` elements into `counts` cannot be made: one count per rank,
    /// summing to `len`, and an operator for the element type. Shared by the board's branch of
    /// [`Comm::reduce_scatter`] and the general path, so that both refuse alike.
    fn reduce_scatter_refusal<T: Element>(&self, counts: &[usize], len: usize, op: &ReduceOp<T>) -> Option<Error> {
        let n = self.size() as usize;
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).unwrap_or(usize::MAX);
        if counts.len() != n {
            Some(InvalidArgument::CountMismatch { expected: n, got: counts.len() }.into())
        } else if total != len {
            Some(InvalidArgument::CountSum { sum: total, len }.into())
        } else {
            check_op(op).err()
        }
    }

    /// [`Comm::reduce_scatter`] of `whole`, the bytes of `len` elements: the segments are slices
    /// of it.
    pub(super) fn reduce_scatter_with<T: Element>(
        &self,
        whole: Bytes,
        len: usize,
        counts: &[usize],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let early = self.reduce_scatter_refusal(counts, len, &op);
        let elem = size_of::<T>();
        let alg = self.choose(Operation::ReduceScatter, len * elem, op.is_commutative());
        let obs = self.observe(Operation::ReduceScatter, alg, len * elem);
        let (r, n) = (self.rank(), self.size());
        // This rank's bytes of the vector.
        let mine = {
            let start = counts.iter().take(r as usize).sum::<usize>().min(len);
            let end = start.saturating_add(counts.get(r as usize).copied().unwrap_or(0)).min(len);
            start * elem..end * elem
        };
        let count = mine.len() / elem;
        let board = (early.is_none() && alg == Algorithm::SharedMemory).then(|| {
            let kind = BoardOp::ReduceScatter { op: op.erase(), part: mine.clone() };
            self.board_future(kind, whole.len(), &whole, elem)
        });
        // The future does not borrow the caller's data: the call lends `whole` itself where it is
        // a pooled copy nobody else holds (or else a copy of it), and keeps it until nobody reads
        // it.
        let mut whole = Some(whole);
        let direct =
            (early.is_none() && alg == Algorithm::SingleCopy).then(|| match whole.take().map(Bytes::try_into_mut) {
                Some(Ok(buf)) => self.lend_owned(buf),
                Some(Err(shared)) => self.lend(&shared[..], Lend::Copy),
                None => Err(Error::Internal { what: "a reduce-scatter's input taken twice" }),
            });
        let plan = (early.is_none() && board.is_none() && direct.is_none()).then(|| {
            let mut at = 0usize;
            let whole = whole.as_ref().expect("kept for the messages");
            let segments: Vec<Bytes> = counts
                .iter()
                .map(|&c| {
                    let end = at.saturating_add(c).min(len);
                    let s = whole.slice(at.min(end) * elem..end * elem);
                    at = end;
                    s
                })
                .collect();
            (self.slot(), ops::reduce_scatter(r, n, alg, segments, op.erase()))
        });
        let pool = self.coll().pool.clone();
        obs.wrap(async move {
            if let Some(call) = board {
                return vec_of(&call?.await?, count);
            }
            if let Some(call) = direct {
                let mut out = vec![T::zeroed(); count];
                let dst = bytemuck::cast_slice_mut(&mut out);
                Box::pin(reduce_scatter_direct(call?, None, mine, op.erase(), r, n, dst, &pool)).await?;
                return Ok(out);
            }
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            let blocks = Comm::drive(slot, m?).await?;
            let out = to_vec(&ops::reduce_scatter_result(&blocks, r)?);
            // The received buffers and the input's serve the next calls.
            pool.recycle(blocks);
            if let Some(Ok(b)) = whole.map(Bytes::try_into_mut) {
                pool.give(b);
            }
            out
        })
    }

    /// [`Comm::reduce_scatter`] with equal counts: `data.len() / size` elements per rank.
    pub fn reduce_scatter_block<T: Element>(
        &self,
        data: &[T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let n = self.size() as usize;
        // A length that does not divide leaves counts that do not sum up: reported as invalid.
        // (Inline up to 8 ranks: no allocation for the counts of a small call.)
        let counts: SmallVec<[usize; 8]> = smallvec::smallvec![data.len() / n; n];
        self.reduce_scatter(data, &counts, op)
    }

    /// [`Comm::reduce_scatter_block`] into `out` (`data.len() / size` elements), like
    /// `MPI_Reduce_scatter_block`. The future borrows `data`: by single copy (large calls on one
    /// host) the other ranks read it where it is, with no copy of it first (a copy made at the
    /// call is still in its writer's cache when the others read it, which costs them more than
    /// reading the caller's data).
    pub fn reduce_scatter_block_into<'a, T: Element>(
        &self,
        data: &'a [T],
        out: &'a mut [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (r, n, elem) = (self.rank(), self.size(), size_of::<T>());
        let misfit = if !data.len().is_multiple_of(n as usize) {
            Some(InvalidArgument::Indivisible { len: data.len(), parts: n as usize }.into())
        } else if out.len() != data.len() / n as usize {
            Some(
                InvalidArgument::LengthMismatch { expected: size_of_val(data) / n as usize, got: size_of_val(out) }
                    .into(),
            )
        } else {
            check_op(&op).err()
        };
        if let Some(e) = misfit {
            return Observe::ELSEWHERE.wrap(Collective::Ready(Some(Err(e))));
        }
        let alg = self.choose(Operation::ReduceScatter, size_of_val(data), op.is_commutative());
        let mine = r as usize * size_of_val(out)..(r as usize + 1) * size_of_val(out);
        if alg == Algorithm::SharedMemory {
            let obs = self.observe(Operation::ReduceScatter, alg, size_of_val(data));
            let kind = BoardOp::ReduceScatter { op: op.erase(), part: mine };
            let call = self.board_call(kind, size_of_val(data), bytemuck::cast_slice(data), elem);
            return obs.wrap(Collective::board(call, Some(bytemuck::cast_slice_mut(out))));
        }
        if alg == Algorithm::SingleCopy {
            let obs = self.observe(Operation::ReduceScatter, alg, size_of_val(data));
            let call = self.lend(data, Lend::InPlace);
            let pool = self.coll().pool.clone();
            let run = async move {
                let (bytes, dst) = (bytemuck::cast_slice(data), bytemuck::cast_slice_mut(out));
                reduce_scatter_direct(call?, Some(bytes), mine, op.erase(), r, n, dst, &pool).await
            };
            return obs.wrap(Collective::boxed(lending_in_place(data, run)));
        }
        // By messages: the call's own copies of the data, the result copied into `out`.
        let run = self.reduce_scatter_block(data, op);
        Observe::ELSEWHERE.wrap(Collective::boxed(async move {
            out.copy_from_slice(&run.await?);
            Ok(())
        }))
    }

    /// Inclusive prefix reduction: rank r's `buf` becomes `data_0 ⊕ ... ⊕ data_r`.
    pub fn scan<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let bytes = size_of_val(buf);
        let alg = self.choose(Operation::Scan, bytes, op.is_commutative());
        if check_op(&op).is_ok() && alg == Algorithm::SharedMemory {
            // On the board: the result straight into `buf`, as an all-reduce's.
            let obs = self.observe(Operation::Scan, alg, bytes);
            let kind = BoardOp::Scan { op: op.erase(), inclusive: true };
            let call = self.board_call(kind, bytes, bytemuck::cast_slice(buf), size_of::<T>());
            return obs.wrap(Collective::board(call, Some(bytemuck::cast_slice_mut(buf))));
        }
        if check_op(&op).is_ok() && alg == Algorithm::SingleCopy {
            // The others read `buf` where it is (the future borrows it); the result goes in once
            // nobody reads it any more.
            let obs = self.observe(Operation::Scan, alg, bytes);
            let (r, n, pool) = (self.rank(), self.size(), self.coll().pool.clone());
            if n <= SCAN_CHAIN_RANKS {
                // Down a chain: each rank's prefix straight into its `buf`, read by the next.
                let call =
                    self.lending(BoardOp::Allgather, Some(Lent::of(bytemuck::cast_slice(buf))), &[BoardOp::Barrier]);
                let buf = bytemuck::cast_slice_mut(buf);
                return obs.wrap(Collective::boxed(async move {
                    scan_chain(call?, buf, op.erase(), r, n, true, &pool).await
                }));
            }
            if bytes >= SCAN_SPLIT_MIN && n > 1 {
                // The combining shared out by parts.
                let call = self.lend_for_scan(buf, true);
                let buf = bytemuck::cast_slice_mut(buf);
                return obs.wrap(Collective::boxed(async move {
                    scan_split(call?, buf, bytes, op.erase(), r, n, true, &pool).await
                }));
            }
            let call = self.lending(BoardOp::Allgather, Some(Lent::of(bytemuck::cast_slice(buf))), &[BoardOp::Barrier]);
            let buf = bytemuck::cast_slice_mut(buf);
            return obs
                .wrap(Collective::boxed(async move { scan_direct(call?, buf, op.erase(), r, n, true, &pool).await }));
        }
        let pool = self.coll().pool.clone();
        let run = self.scan_with(pool.copy(buf), op, true);
        Observe::ELSEWHERE.wrap(Collective::boxed(async move {
            let out = run.await?.ok_or_else(|| Error::Internal { what: "an inclusive scan produced no result" })?;
            copy_into(buf, &out)?;
            if let Ok(b) = out.try_into_mut() {
                pool.give(b);
            }
            Ok(())
        }))
    }

    /// Exclusive prefix reduction: `data_0 ⊕ ... ⊕ data_(r-1)`, `None` at rank 0.
    pub fn exscan<T: Element>(
        &self,
        data: &[T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<T> {
        let (bytes, r, n) = (size_of_val(data), self.rank(), self.size());
        let alg = self.choose(Operation::Scan, bytes, op.is_commutative());
        let count = data.len();
        if check_op(&op).is_ok() && matches!(alg, Algorithm::SharedMemory | Algorithm::SingleCopy) {
            let obs = self.observe(Operation::Scan, alg, bytes);
            // Single copy: down a chain on few ranks, else the combining shared out by parts from
            // SCAN_SPLIT_MIN.
            let chain = n <= SCAN_CHAIN_RANKS;
            let split = !chain && bytes >= SCAN_SPLIT_MIN && n > 1;
            let call = if alg == Algorithm::SharedMemory {
                let kind = BoardOp::Scan { op: op.erase(), inclusive: false };
                Ok(self.board_future(kind, bytes, bytemuck::cast_slice(data), size_of::<T>()))
            } else if split {
                // The future does not borrow `data`: the call lends a pooled copy.
                Err(self.lend_for_scan(data, false))
            } else {
                Err(self.lend(data, Lend::Copy))
            };
            let pool = self.coll().pool.clone();
            return futures::future::Either::Left(obs.wrap(async move {
                let mut out = (r > 0).then(|| vec![T::zeroed(); count]);
                match call {
                    Ok(call) => {
                        let pieces = call?.await?;
                        if let Some(out) = out.as_mut() {
                            copy_parts(out, &pieces)?;
                        }
                    }
                    Err(call) => {
                        let dst = out.as_deref_mut().map(bytemuck::cast_slice_mut::<T, u8>).unwrap_or_default();
                        if chain {
                            Box::pin(scan_chain(call?, dst, op.erase(), r, n, false, &pool)).await?;
                        } else if split {
                            Box::pin(scan_split(call?, dst, bytes, op.erase(), r, n, false, &pool)).await?;
                        } else {
                            Box::pin(scan_direct(call?, dst, op.erase(), r, n, false, &pool)).await?;
                        }
                    }
                }
                Ok(out)
            }));
        }
        let pool = self.coll().pool.clone();
        let run = self.scan_with(pool.copy(data), op, false);
        futures::future::Either::Right(async move {
            let out = run.await?;
            let v = out.as_ref().map(to_vec).transpose();
            if let Some(b) = out.and_then(|b| b.try_into_mut().ok()) {
                pool.give(b);
            }
            v
        })
    }

    pub(super) fn scan_with<T: Element>(
        &self,
        data: Bytes,
        op: ReduceOp<T>,
        inclusive: bool,
    ) -> impl Future<Output = Result<Option<Bytes>>> + Send + use<T> {
        let early = check_op(&op).err();
        // Messages: always recursive doubling (`ops::scan`).
        let obs = self.observe(Operation::Scan, Algorithm::RecursiveDoubling, data.len());
        let plan =
            early.is_none().then(|| (self.slot(), ops::scan(self.rank(), self.size(), data, op.erase(), inclusive)));
        let pool = self.coll().pool.clone();
        obs.wrap(async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            let mut blocks = Comm::drive(slot, m).await?;
            let out = ops::scan_result(&blocks);
            // The result stays with the caller; the other buffers serve the next calls.
            blocks.remove(&1);
            pool.recycle(blocks);
            Ok(out)
        })
    }
}
