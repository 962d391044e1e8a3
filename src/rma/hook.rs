//! The glue between the one-sided [`Service`] and the point-to-point engine, run by the reactor's
//! progress (the background task's and every spinning caller's), so that a target serves requests
//! without any call by its application.
//!
//! One-sided messages travel on a reserved context ([`CONTEXT`]). The hook keeps one receive
//! posted there, for any source and tag; the engine matches arrivals to it in order and handles
//! credits and large messages (rendezvous). A loss revokes communicators, never this context (it
//! only interrupts the posted receive), so one-sided traffic between the survivors goes
//! on, and each operation on a lost rank's segment fails by itself. The receive's completion sets
//! a flag through the waker registered on its slab slot, so the progress routine calls the hook
//! only when a message came, when a rank departed or was lost (the engine's count of such
//! changes, read without a lock), or while the service has work of its own (operations in flight
//! whose targets it watches, held enqueues): a program that does no one-sided communication pays
//! two loads per progress round.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use ferrocomm_reactor::OpKey;
use ferrocomm_transports::{Rank, Transport, TransportError};

use super::service::Service;
use crate::error::Error;
use crate::p2p::driver::{SlabEngine, Upper};
use crate::p2p::engine::{Completion, RecvBuf};
use crate::p2p::failure::Watch;
use crate::p2p::{Source, TagMatch};

/// The context of one-sided messages: above every communicator's (duplicates derive theirs with
/// the top bit clear; collective traffic sets it on a communicator's own id, which would need a
/// communicator of id `0x7fff_ffff`, one chance in 2^31 per duplicate).
pub(crate) const CONTEXT: u32 = u32::MAX;

/// How many hook calls pass, while operations are in flight, between two looks at the fates of
/// their targets (besides the look at every change the engine counts).
const LOSS_CHECK_EVERY: u32 = 64;

/// Why rank `r` is gone, if it departed or was lost.
fn fate(engine: &SlabEngine, r: Rank) -> Option<TransportError> {
    match engine.failures().error(r) {
        Some(Error::PeerLost { reason, .. }) => Some(reason),
        _ => None,
    }
}

/// Set by the posted receive's completion.
struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}

/// The one-sided part of a rank's progress state (a field of the driver).
pub(crate) struct Hook {
    flag: Arc<Flag>,
    waker: Waker,
    /// The posted receive.
    key: Option<OpKey>,
    pub service: Service,
    calls: u32,
    /// The engine's count of departures and losses, and its value at the last look.
    changes: Arc<AtomicU32>,
    seen: u32,
}

impl Hook {
    /// The hook of rank `me`, with its receive posted on `engine`.
    pub(crate) fn new(engine: &mut SlabEngine, me: Rank) -> Hook {
        // The service fails what a loss ends itself and serves the others: its context is never
        // revoked (a revoked one would fail every receive posted again at once), a loss only
        // interrupts the posted receive.
        engine.watch(CONTEXT, Watch::Interrupt);
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let service = Service::new(me, engine.config().max_message);
        let changes = engine.failures().changes();
        let mut h = Hook { flag, waker, key: None, service, calls: 0, changes, seen: 0 };
        h.repost(engine);
        // The first progress call registers the flag's waker on the receive (each later receive
        // is registered by the loop that posts it).
        h.flag.0.store(true, Ordering::Relaxed);
        h
    }

    fn repost(&mut self, engine: &mut SlabEngine) {
        let key = engine.completions().insert();
        engine.post_recv(key, CONTEXT, Source::Any, TagMatch::Any, RecvBuf::Alloc);
        self.key = Some(key);
    }

    /// Hands the service's messages to the engine (whose output the driver then flushes).
    pub(crate) fn pump(&mut self, engine: &mut SlabEngine) -> usize {
        let mut n = 0;
        while let Some((to, tag, data)) = self.service.poll_transmit() {
            n += 1;
            if let Err(data) = engine.send_now(to, CONTEXT, tag, data) {
                // Waiting for credit, or large: tracked by the engine, nobody awaits it (a lost
                // peer shows in the operation that the message belongs to).
                let key = engine.completions().insert();
                engine.post_send(key, to, CONTEXT, tag, data);
                engine.completions().detach(key);
            }
        }
        n
    }
}

impl Upper for Hook {
    /// Whether the progress routine must call [`Upper::progress`].
    #[inline(always)]
    fn wants(&self) -> bool {
        self.flag.0.load(Ordering::Relaxed) || self.service.busy() || self.changes.load(Ordering::Relaxed) != self.seen
    }

    /// Takes what arrived, lets the service act on it, and hands its messages to the engine.
    fn progress(&mut self, engine: &mut SlabEngine, transport: &mut dyn Transport) -> usize {
        let mut work = 0;
        if let Some(os) = transport.one_sided() {
            // Device operations that ended; registrations that nobody uses any more.
            while let Some((token, r)) = os.poll_done() {
                self.service.native_done(token, r);
                work += 1;
            }
            for h in self.service.take_deregister() {
                os.deregister(h);
            }
        }
        self.flag.0.store(false, Ordering::Relaxed);
        while let Some(key) = self.key {
            let mut cx = Context::from_waker(&self.waker);
            let Poll::Ready(c) = engine.completions().poll(key, Some(&mut cx)) else { break };
            self.key = None;
            work += 1;
            match c {
                Completion::Recv(Ok((payload, status))) => {
                    self.service.handle(status.source, status.tag, payload.into_bytes())
                }
                Completion::Recv(Err(Error::PeerLost { rank, reason })) => self.service.peer_lost(rank, reason),
                Completion::Recv(Err(Error::Shutdown)) => self.service.close(),
                Completion::Recv(Err(e)) => tracing::warn!(error = %e, "one-sided message dropped"),
                other => unreachable!("receive completed as {other:?}"),
            }
            if !self.service.is_closed() {
                self.repost(engine);
            }
        }
        let changes = self.changes.load(Ordering::Acquire);
        if changes != self.seen {
            self.seen = changes;
            work += self.service.scan_lost(|r| fate(engine, r));
        }
        if self.service.busy() {
            self.calls = self.calls.wrapping_add(1);
            if self.calls.is_multiple_of(LOSS_CHECK_EVERY) {
                work += self.service.scan_lost(|r| fate(engine, r));
            }
            if self.service.serve_held() {
                work += 1;
            }
            work += self.service.release_ready();
        }
        work + self.pump(engine)
    }

    /// The engine was closed (shutdown): every one-sided operation fails, every waiter wakes.
    fn close(&mut self, engine: &mut SlabEngine, transport: &mut dyn Transport) {
        self.progress(engine, transport);
        self.service.close();
    }
}
