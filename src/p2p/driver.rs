//! The thin I/O driver: glues the protocol engine to a transport and to the operation slab.
//!
//! Everything here runs under the reactor's lock, from whichever thread drives progress.

use std::task::{Context, Poll};

use ferrocomm_reactor::{Ops, Progress};
use ferrocomm_transports::{Outgoing, Rank, Transport, TransportError};

use crate::error::Error;
use crate::p2p::engine::{Completion, Engine};

/// The protocol core as the driver runs it: completing operations straight into the slab.
pub(crate) type SlabEngine = Engine<Ops<Completion>>;

pub(crate) struct Driver {
    /// The protocol core; it completes operations straight into its operation slab.
    pub engine: SlabEngine,
    pub transport: Box<dyn Transport>,
    /// The work of the layers above point-to-point that runs in this progress (one-sided
    /// communication: its target-side handlers, see `rma::hook`).
    pub upper: Box<dyn Upper>,
}

/// Work of a layer above point-to-point that runs inside the progress routine, so that it goes on
/// without calls by the application (a one-sided target serves requests). The driver runs it
/// without knowing the layer.
pub(crate) trait Upper: std::any::Any + Send {
    /// Whether [`Upper::progress`] has anything to do; asked every progress round, so cheap.
    fn wants(&self) -> bool;
    /// Does the layer's work (with the transport, for what its device does itself: one-sided
    /// operations over RDMA); returns how much was done (0: nothing).
    fn progress(&mut self, engine: &mut SlabEngine, transport: &mut dyn Transport) -> usize;
    /// The engine was closed (shutdown): the layer fails what it has in flight.
    fn close(&mut self, engine: &mut SlabEngine, transport: &mut dyn Transport);
}

impl Driver {
    /// The operation slab: in-flight operations by key.
    #[inline]
    pub(crate) fn ops(&mut self) -> &mut Ops<Completion> {
        self.engine.completions()
    }

    /// Moves the engine's output to the transport (its completions are in the slab already),
    /// writing right away so that a posted send leaves without waiting for the background task.
    /// Inlined up to the test for output: every round of a spinning caller flushes, and usually
    /// finds nothing (the whole function's entry and exit cost more than that test).
    #[inline]
    pub(crate) fn flush(&mut self) -> usize {
        if self.engine.has_output() { self.flush_output() } else { 0 }
    }

    /// [`Engine::send_now`] of owned or borrowed data, handing a frame that can go at once
    /// straight to the transport (borrowed data is copied before this returns).
    #[inline]
    pub(crate) fn send_now<D: Outgoing>(
        &mut self,
        dest: Rank,
        context: u32,
        tag: u64,
        data: D,
    ) -> Result<Result<(), Error>, D> {
        let (transport, mut wired) = (&mut self.transport, false);
        let r = self.engine.send_now_via(dest, context, tag, data, |peer, h, payload| {
            wired = true;
            payload.send_to(&mut **transport, peer, h)
        });
        if wired {
            self.push_queued();
        }
        r
    }

    /// After a frame went straight to the transport: what it could not write at once (TCP) goes
    /// out now, as after a flush. A send reported complete must not wait in this process for a
    /// progress call that may never come (the caller may exit, or be killed, right after). Frames
    /// that went to the engine's queue instead are pushed by the caller's flush.
    #[inline]
    fn push_queued(&mut self) {
        if self.transport.has_queued_output() {
            self.transport_progress();
        }
    }

    #[inline(never)]
    fn flush_output(&mut self) -> usize {
        let mut work = 0;
        loop {
            while let Some((peer, err)) = self.engine.poll_violation() {
                // The transport reports the loss back through the sink once the connection is
                // quiet, so no buffer of a receive is freed under an in-flight read.
                self.transport.disconnect(peer, TransportError::Wire(err));
            }
            // Peers reported lost by others: their connections go the same way.
            while let Some((peer, why)) = self.engine.poll_cut() {
                self.transport.disconnect(peer, why);
            }
            let mut queued = false;
            while let Some((peer, h, payload)) = self.engine.poll_transmit() {
                self.transport.send(peer, h, payload);
                queued = true;
            }
            if !queued {
                return work;
            }
            if !self.transport.has_queued_output() {
                // The transport wrote it all already (shared memory, verbs: nothing queued
                // before).
                return work + 1;
            }
            work += 1 + self.transport_progress();
        }
    }
}

impl Driver {
    /// The transport's progress, and then the upper layers' (the one-sided service) if a message
    /// for them came (or they have work of their own): every path that lets frames into the engine runs it, so that a
    /// request delivered while a send pushed its bytes is served without waiting for the next
    /// wake-up (which that delivery consumed).
    #[inline]
    fn transport_progress(&mut self) -> usize {
        let n = self.transport.progress(&mut self.engine);
        if self.upper.wants() { n + self.upper.progress(&mut self.engine, &mut *self.transport) } else { n }
    }
}

impl Progress for Driver {
    /// Inlined into the awaiting future's spin (`Op`'s poll, compiled in the application's crate):
    /// without it, every spin round of an application built without LTO makes one more call
    /// across crates.
    #[inline]
    fn progress(&mut self) -> usize {
        let n = self.transport_progress();
        n + self.flush()
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.transport.poll_ready(cx)
    }

    fn awake(&mut self) {
        self.transport.awake()
    }

    fn stand_aside(&mut self) {
        self.transport.stand_aside()
    }
}
