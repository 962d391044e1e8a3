//! One transport made of several: each peer is reached through exactly one of them (shared memory
//! for ranks on this host, TCP for the others), chosen at bootstrap.

use std::task::{Context, Poll};

use bytes::Bytes;

use crate::wire::{Header, Rank};
use crate::{Sink, Transport, TransportError};

/// Routes every peer to the transport chosen for it.
pub struct Routed {
    parts: Vec<Box<dyn Transport>>,
    /// `route[peer]` indexes `parts`.
    route: Vec<usize>,
    name: &'static str,
}

impl Routed {
    /// `route[peer]` names the part (index into `parts`) that reaches `peer`.
    pub fn new(parts: Vec<Box<dyn Transport>>, route: Vec<usize>) -> Routed {
        assert!(route.iter().all(|&i| i < parts.len()), "route names a missing transport");
        let name = match parts.iter().map(|p| p.name()).collect::<Vec<_>>()[..] {
            [one] => one,
            _ => "mixed",
        };
        Routed { parts, route, name }
    }
}

impl Transport for Routed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn name_for(&self, peer: Rank) -> &'static str {
        self.parts[self.route[peer as usize]].name_for(peer)
    }

    fn eager_limit(&self) -> usize {
        self.parts.iter().map(|p| p.eager_limit()).min().unwrap_or(0)
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        self.parts[self.route[peer as usize]].send(peer, header, payload)
    }

    fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
        self.parts[self.route[peer as usize]].send_copy(peer, header, payload)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        self.parts.iter_mut().map(|p| p.progress(sink)).sum()
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // Poll every part, so that each registers the waker.
        let ready = self.parts.iter_mut().fold(false, |r, p| p.poll_ready(cx).is_ready() | r);
        if ready { Poll::Ready(()) } else { Poll::Pending }
    }

    fn awake(&mut self) {
        self.parts.iter_mut().for_each(|p| p.awake());
    }

    fn stand_aside(&mut self) {
        self.parts.iter_mut().for_each(|p| p.stand_aside());
    }

    fn has_pending_output(&self) -> bool {
        self.parts.iter().any(|p| p.has_pending_output())
    }

    fn has_queued_output(&self) -> bool {
        self.parts.iter().any(|p| p.has_queued_output())
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        self.parts[self.route[peer as usize]].disconnect(peer, reason)
    }

    fn one_sided(&mut self) -> Option<&mut dyn crate::one_sided::OneSided> {
        // At most one part has a device of its own (verbs); the caller picks peers by their
        // route (`name_for`).
        self.parts.iter_mut().find_map(|p| p.one_sided())
    }
}
