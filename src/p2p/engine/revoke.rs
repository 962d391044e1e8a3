//! The engine's side of failure handling: what a departure or a loss fails, the notices that
//! spread a loss, and the revocation of the contexts a loss ends. What is known, and which
//! contexts that ends, is [`Failures`]'s business; this applies it to the engine's operations.
//!
//! Rules kept here:
//! * A rendezvous receive's buffer is freed only once the *transport* reported its peer lost
//!   ([`Engine::peer_lost`]): a loss learnt any other way (a notice, the launcher) may come while
//!   the transport still writes into it. Such a loss asks the driver to cut the connection
//!   ([`Engine::poll_cut`]), after which the transport reports it.
//! * A revoked context keeps its protocol state: a rendezvous under way still takes its CTS and
//!   data (and drops them), so the peer, which may not know of the loss yet, is never answered with
//!   a protocol violation. Messages arriving on a revoked context that was registered are dropped
//!   and their credit handed back, so a revoked communicator never holds up traffic between two
//!   survivors on another one.

use super::*;
use crate::p2p::failure::Watch;

impl<C: Completions> Engine<C> {
    /// What this rank knows of the others' fate.
    pub fn failures(&self) -> &Failures {
        &self.failures
    }

    /// Registers which ranks' loss revokes `context` (see [`Watch`]). Call it before operations
    /// are posted there: a context nobody registered watches every rank. Registered after a loss
    /// that revokes it, it drops what arrived there meanwhile, as a revocation would have.
    pub fn watch(&mut self, context: u32, watch: Watch) {
        self.failures.watch(context, watch);
        if self.failures.any_lost() && self.failures.revoked(context).is_some() {
            let waiting = self.contexts.get_mut(context).map(|q| std::mem::take(&mut q.unexpected));
            for u in waiting.into_iter().flatten() {
                self.discard(u.src, u.body);
            }
        }
    }

    /// The error an operation on `context` fails with, if a loss revoked it.
    #[inline(never)]
    pub fn revoked(&self, context: u32) -> Option<Error> {
        self.failures.revoked(context).and_then(|r| self.failures.error(r))
    }

    /// Why a collective on `context` cannot run: the loss that revoked it (see
    /// [`Failures::gate`]).
    pub fn gate(&self, context: u32) -> Option<Error> {
        self.failures.gate(context).and_then(|r| self.failures.error(r))
    }

    /// The next peer whose connection must be cut (reported lost by someone else than the
    /// transport): hand it to the transport's `disconnect`, which reports it lost in turn.
    pub fn poll_cut(&mut self) -> Option<(Rank, TransportError)> {
        let peer = self.cuts.pop_front()?;
        let reason = self.peers[peer as usize].lost.clone().unwrap_or(TransportError::Closed);
        Some((peer, reason))
    }

    /// The transport's report: the connection to `peer` is gone, and nothing it reads lands in
    /// this engine's buffers any more. A goodbye's connection closing is no loss.
    pub fn peer_lost(&mut self, peer: Rank, reason: TransportError) {
        if reason == TransportError::Left {
            self.depart(peer);
        } else {
            self.lose(peer, reason);
        }
        // The buffers of receives from the peer can go now (their operations were failed).
        self.rndv_recvs.retain(|_, r| r.peer != peer);
        self.peers[peer as usize].push_in = None;
    }

    /// A loss learnt other than from the transport (the launcher saw the process end): recorded
    /// and spread like one the transport saw; the connection is cut, so that a rank the others
    /// take for lost is not left talking to this one.
    pub fn report_lost(&mut self, peer: Rank, reason: TransportError) {
        if self.lose(peer, reason) && peer != self.me {
            self.cuts.push_back(peer);
        }
    }

    /// This rank leaves without finishing (its program panicked): it tells every live peer that
    /// it is lost, so that they fail what needs it at once instead of waiting on it.
    pub fn abort(&mut self) {
        self.leaving = true;
        let notice = Header { aux: u64::from(self.me), ..Header::new(Kind::Lost) };
        for peer in 0..self.peers.len() as Rank {
            if peer != self.me && self.failures.is_alive(peer) {
                self.emit(peer, notice, Bytes::new());
            }
        }
    }

    /// A `Lost` notice from `peer` about rank `about` (itself, when it aborts).
    pub(super) fn on_lost(&mut self, peer: Rank, about: u64) {
        let size = self.peers.len() as u32;
        let Some(lost) = u32::try_from(about).ok().filter(|&r| r < size) else {
            let rank = u32::try_from(about).unwrap_or(u32::MAX);
            return self.violation(peer, WireError::UnknownRank { rank, size });
        };
        let reason = if lost == peer { TransportError::Aborted } else { TransportError::Reported { by: peer } };
        self.report_lost(lost, reason);
    }

    /// `peer` said goodbye: what names it fails (a collective fails where it waits for a message
    /// from it). Nothing is revoked: it finished what it meant to send.
    pub(super) fn depart(&mut self, peer: Rank) {
        if !self.failures.depart(peer) {
            return;
        }
        tracing::debug!(peer, "peer left the job");
        self.fail_peer(peer, TransportError::Left);
    }

    /// `lost` is gone (news, or not: then nothing happens). What names it fails, the contexts it
    /// revokes are revoked, and every live peer is told. True if it was news.
    pub(super) fn lose(&mut self, lost: Rank, reason: TransportError) -> bool {
        if !self.failures.lose(lost, reason.clone()) {
            return false;
        }
        if self.leaving {
            tracing::debug!(peer = lost, %reason, "peer lost while this rank leaves");
        } else {
            tracing::warn!(peer = lost, %reason, "peer lost");
        }
        self.meters.peers_lost.increment(1);
        self.fail_peer(lost, reason);
        // The notices go before anything the revocation sends (a refused rendezvous): a peer
        // then fails its send for the loss, not for the refusal.
        let notice = Header { aux: u64::from(lost), ..Header::new(Kind::Lost) };
        let tell: Vec<Rank> = self.failures.to_tell(self.me, lost).collect();
        for peer in tell {
            self.emit(peer, notice, Bytes::new());
        }
        self.revoke(lost);
        true
    }

    /// Fails every operation that names `peer`: sends to it (queued, or waiting for a CTS),
    /// receives from it (posted, or taking rendezvous data: detached, their buffers kept for the
    /// transport), probes of it. Frames still queued for it are dropped.
    fn fail_peer(&mut self, peer: Rank, reason: TransportError) {
        let p = &mut self.peers[peer as usize];
        if p.lost.is_some() {
            return;
        }
        p.lost = Some(reason.clone());
        let err = || Error::PeerLost { rank: peer, reason: reason.clone() };
        for b in std::mem::take(&mut p.backlog) {
            if let Some(op) = b.op {
                self.done.complete(op, Completion::Send(Err(err())));
            }
        }
        self.transmit.retain(|(dest, ..)| *dest != peer);
        let sends: Vec<usize> = self.rndv_sends.iter().filter(|(_, s)| s.peer == peer).map(|(k, _)| k).collect();
        for k in sends {
            if let Some(op) = self.rndv_sends.remove(k).op {
                self.done.complete(op, Completion::Send(Err(err())));
            }
        }
        for (_, r) in self.rndv_recvs.iter_mut().filter(|(_, r)| r.peer == peer) {
            if let Some(op) = r.op.take() {
                self.done.complete(op, Completion::Recv(Err(err())));
            }
        }
        self.fail_posted(|src| src == Source::Rank(peer), err);
    }

    /// Fails every operation on the contexts that the loss of `lost` revokes (those it is the
    /// first loss of), and drops what waits unmatched there.
    fn revoke(&mut self, lost: Rank) {
        let Some(err) = self.failures.error(lost) else { return };
        let failures = &self.failures;
        let newly = |context: u32| failures.revoked(context) == Some(lost);
        let mut dropped = Vec::new();
        for (&context, &i) in &self.contexts.index {
            if failures.interrupts(context) {
                // Not revoked: only what waits for any source learns of the loss (the message it
                // waits for may have been the lost rank's).
                let q = &mut self.contexts.queues[i];
                let (hit, kept): (VecDeque<_>, _) =
                    std::mem::take(&mut q.posted).into_iter().partition(|p| p.src == Source::Any);
                q.posted = kept;
                for p in hit {
                    self.done.complete(p.op, Completion::Recv(Err(err.clone())));
                }
                let (hit, kept): (Vec<_>, _) =
                    std::mem::take(&mut q.probes).into_iter().partition(|p| p.src == Source::Any);
                q.probes = kept;
                for p in hit {
                    self.done.complete(p.op, Completion::Probe(Err(err.clone())));
                }
                continue;
            }
            if !newly(context) {
                continue;
            }
            let q = &mut self.contexts.queues[i];
            for p in q.posted.drain(..) {
                self.done.complete(p.op, Completion::Recv(Err(err.clone())));
            }
            for p in q.probes.drain(..) {
                self.done.complete(p.op, Completion::Probe(Err(err.clone())));
            }
            // Unregistered: it may belong to a communicator not made here yet, whose watch may
            // not hold the lost rank. Its messages stay.
            if failures.registered(context) {
                dropped.extend(q.unexpected.drain(..));
            }
        }
        let mut withdrawn = Vec::new();
        for p in &mut self.peers {
            p.backlog.retain(|b| {
                let hit = newly(b.header.context);
                if hit {
                    withdrawn.push((b.op, (b.header.kind == Kind::Rts).then_some(b.header.seq as usize)));
                }
                !hit
            });
        }
        for (op, rts) in withdrawn {
            let op = op.or_else(|| rts.and_then(|k| self.rndv_sends.try_remove(k)).and_then(|s| s.op));
            if let Some(op) = op {
                self.done.complete(op, Completion::Send(Err(err.clone())));
            }
        }
        for (_, s) in self.rndv_sends.iter_mut().filter(|(_, s)| newly(s.context)) {
            if let Some(op) = s.op.take() {
                self.done.complete(op, Completion::Send(Err(err.clone())));
            }
        }
        for (_, r) in self.rndv_recvs.iter_mut().filter(|(_, r)| newly(r.context)) {
            if let Some(op) = r.op.take() {
                self.done.complete(op, Completion::Recv(Err(err.clone())));
            }
        }
        for u in dropped {
            self.discard(u.src, u.body);
        }
    }

    /// Whether a message arriving on `context` is dropped: the context was registered and is
    /// revoked.
    #[inline(never)]
    pub(super) fn discards(&self, context: u32) -> bool {
        self.failures.registered(context) && self.failures.revoked(context).is_some()
    }

    /// Drops a message that arrived on a revoked context: its credit goes back to the sender, and
    /// a rendezvous announcement is refused (a truncation CTS), so the sender forgets it.
    #[inline(never)]
    pub(super) fn discard(&mut self, src: Rank, body: Body) {
        if src == self.me {
            return;
        }
        self.free_credit(src);
        if let Body::Rts { msg, .. } = body
            && self.peers[src as usize].lost.is_none()
        {
            self.no_place_for_push(src, msg);
            let cts = Header { seq: msg, flags: flags::TRUNCATED, ..Header::new(Kind::Cts) };
            self.emit(src, cts, Bytes::new());
        }
    }
}
