//! The driver loop: one call's place on its communicator (its sequence number and context) and
//! the loop that runs a sans-IO machine of `ferrocomm-collectives` over point-to-point messages.

use super::*;

/// One call's place on its communicator: where its messages go and the sequence number that keeps
/// them apart from other calls'.
pub(super) struct Slot {
    pub(super) comm: Arc<Comm>,
    pub(super) seq: u64,
    /// The calling communicator's buffer pool.
    pub(super) pool: Arc<Pool>,
    /// Why the call cannot run, as known when it was made: a member lost (the communicator
    /// revoked).
    pub(super) refused: Option<Error>,
}

/// A posted receive of a collective: of any length, or into a buffer of the announced length.
pub(super) enum Incoming {
    Plain(Op<Message>),
    Into(Op<(BytesMut, Status)>),
}

impl Incoming {
    pub(super) fn is_ready(&self) -> bool {
        match self {
            Incoming::Plain(op) => op.is_ready(),
            Incoming::Into(op) => op.is_ready(),
        }
    }

    pub(super) fn harvest(&mut self, d: &mut Driver, cx: Option<&mut Context<'_>>) -> bool {
        match self {
            Incoming::Plain(op) => op.harvest(d, cx),
            Incoming::Into(op) => op.harvest(d, cx),
        }
    }

    /// The received bytes of a ready receive ([`Incoming::is_ready`]).
    pub(super) fn take(&mut self) -> Result<Bytes> {
        let mut cx = Context::from_waker(Waker::noop());
        let r = match self {
            Incoming::Plain(op) => Pin::new(op).poll(&mut cx).map_ok(|m| m.data),
            Incoming::Into(op) => Pin::new(op).poll(&mut cx).map_ok(|(b, _)| b.freeze()),
        };
        match r {
            Poll::Ready(r) => r,
            Poll::Pending => Err(Error::Internal { what: "a collective receive taken before it completed" }),
        }
    }
}

/// A collective's driving future ([`Comm::drive`]).
pub(super) type Drive = Pin<Box<dyn Future<Output = Result<Blocks>> + Send>>;

/// A call's sends in flight: a handful at a time (inline, no allocation).
pub(super) type Sends = SmallVec<[Op<()>; 4]>;

/// A call's posted receives: `(from, round, part, receive)`.
pub(super) type Recvs = SmallVec<[(u32, u32, u32, Incoming); 4]>;

/// Drops the completed sends (their results were harvested: no lock is taken); the first failure
/// is returned.
pub(super) fn take_sends(sends: &mut Sends) -> Result<()> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut failed = None;
    sends.retain(|op| {
        if !op.is_ready() {
            return true;
        }
        if let Poll::Ready(Err(e)) = Pin::new(op).poll(&mut cx) {
            failed.get_or_insert(e);
        }
        false
    });
    failed.map_or(Ok(()), Err)
}

impl Comm {
    /// Takes the next sequence number of this communicator for one collective call.
    pub(super) fn slot(&self) -> Slot {
        let seq = self.coll().calls.fetch_add(1, Ordering::Relaxed);
        let comm = self.coll().collective.get_or_init(|| Arc::new(self.with_context(self.context() | COLLECTIVE_BIT)));
        Slot { comm: comm.clone(), seq, pool: self.coll().pool.clone(), refused: self.collective_gate().err() }
    }

    /// Runs `machine` on `slot`: posts what it asks, feeds it what arrives, until it is done and
    /// its sends have completed.
    ///
    /// One progress loop serves all of the call's operations: each wait spins once and looks at
    /// every posted receive (an [`Op`] awaited alone would spin on itself only, for up to a few
    /// hundred rounds, before the next one is looked at), and everything that arrived is delivered
    /// before the next wait.
    ///
    /// Boxed: the machine and the driving state stay put on the heap, so the futures of the calls
    /// that await it stay small (they are moved, i.e. copied, on every call; a future of several
    /// kilobytes is a measurable share of a small collective).
    pub(super) fn drive(slot: Slot, m: Machine) -> Drive {
        Box::pin(Comm::run(slot, m))
    }

    pub(super) async fn run(slot: Slot, m: Machine) -> Result<Blocks> {
        let Slot { comm, seq, pool, refused } = slot;
        // A member already lost when the call was made, or lost since: the call could never
        // complete.
        if let Some(e) = refused.or_else(|| comm.revoked()) {
            return Err(e);
        }
        // A peer's message, or the blocks its header announces, cannot exceed what a receive takes.
        // Buffers the machine fills come from the pool, as do the receives' (see `Pool`).
        let alloc = pool.clone();
        let mut m = m.with_max_message(comm.settings().max_message).with_alloc(Arc::new(move |len| alloc.take(len)));
        let tag = |round: u32| (seq << 16) | u64::from(round);
        // A handful of operations at a time: inline vectors (no task allocations).
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        loop {
            while let Some(a) = m.poll_action() {
                match a {
                    Action::Send { to, round, data } => sends.push(comm.send(to, tag(round), data)),
                    Action::Recv { from, round, part, len: Some(len) } if len >= Pool::MIN => {
                        // A block of known length: straight into a reused buffer.
                        let op = comm.recv_into(from, tag(round), pool.take(len));
                        recvs.push((from, round, part, Incoming::Into(op)));
                    }
                    Action::Recv { from, round, part, .. } => {
                        recvs.push((from, round, part, Incoming::Plain(comm.recv(from, tag(round)))));
                    }
                }
            }
            if m.is_done() {
                break;
            }
            if recvs.is_empty() {
                return Err(Error::Internal { what: "a collective waits with nothing posted" });
            }
            if !recvs.iter().any(|r| r.3.is_ready()) {
                let mut wait = Wait::default();
                futures::future::poll_fn(|cx| {
                    comm.poll_progress(cx, &mut wait, |d, mut cx| {
                        let mut any = false;
                        for r in recvs.iter_mut() {
                            any |= r.3.harvest(d, cx.as_deref_mut());
                        }
                        sends.iter_mut().for_each(|s| _ = s.harvest(d, None));
                        if any { Poll::Ready(()) } else { Poll::Pending }
                    })
                })
                .await;
            }
            // Everything that has arrived, in posting order (the machine orders what it applies).
            let mut i = 0;
            while i < recvs.len() {
                if !recvs[i].3.is_ready() {
                    i += 1;
                    continue;
                }
                let (from, round, part, mut op) = recvs.remove(i);
                let data = op.take()?;
                m.deliver(from, round, part, data)?;
                m.take_spare().into_iter().for_each(|b| pool.give(b));
            }
            take_sends(&mut sends)?;
        }
        if !sends.iter().all(Op::is_ready) {
            let mut wait = Wait::default();
            futures::future::poll_fn(|cx| {
                comm.poll_progress(cx, &mut wait, |d, mut cx| {
                    // Every send is looked at (and, before a sleep, registers its waker).
                    let pending = sends.iter_mut().map(|s| s.harvest(d, cx.as_deref_mut())).filter(|&r| !r).count();
                    if pending == 0 { Poll::Ready(()) } else { Poll::Pending }
                })
            })
            .await;
        }
        take_sends(&mut sends)?;
        Ok(m.into_blocks())
    }
}
