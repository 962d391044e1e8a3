//! Multi-rail striping (channel bonding): one transport over several connections per peer.
//!
//! Rail 0 is the transport the rank would use anyway (the bootstrap TCP connections); rails 1..
//! are more TCP transports, each over another pair of addresses (another interface, another
//! network). To a peer with more than one rail, [`stripe`] decides what goes where: the
//! rendezvous data of messages is cut into parts spread over the rails in proportion to each
//! rail's measured bandwidth; every other frame travels in order on one rail (rail 0 until it
//! fails), numbered and kept until acknowledged; and when any rail fails, its parts and its
//! unacknowledged frames move to the rails still up. A part carries its own offset, so each part
//! completes on its own, in any order, and the engine above sees ordinary data frames; it sees
//! the peer lost only when its last rail is.
//!
//! Parts are read into a staging buffer and copied into their destination only when complete and
//! not delivered before: a connection that fails mid-part may still have a read in flight, and it
//! must not write into a receive buffer the engine has since completed (the same part may have
//! come whole on another rail meanwhile). A frame that is a copy of one delivered already (sent
//! again after its rail failed) is dropped before the engine sees it.

pub mod stripe;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;

use crate::wire::{Header, Kind, Rank, WireError, flags};
use crate::{Sink, Transport, TransportError};
pub use stripe::{RailStats, Stripe, StripeConfig};

/// A staging buffer of one rail and peer: the part being read, and its bytes.
#[derive(Default)]
struct Staged {
    id: Option<u64>,
    buf: Vec<u8>,
}

/// Several transports to the same peers, striping large messages across them.
pub struct Bonded {
    rails: Vec<Box<dyn Transport>>,
    core: Stripe,
    /// `staging[rail][peer]`.
    staging: Vec<Vec<Staged>>,
    timer: Pin<Box<tokio::time::Sleep>>,
    stats: SharedStats,
}

/// Figures of a [`Bonded`] transport that outlive it: `[peer][rail]`, refreshed on progress.
pub type SharedStats = std::sync::Arc<std::sync::Mutex<Vec<Vec<Option<RailStats>>>>>;

impl Bonded {
    /// `rails[0]` reaches every peer; `links[peer][rail]` says which rails also reach `peer`.
    /// Call inside the tokio runtime that runs the progress loop (for the stall timer).
    pub fn new(me: Rank, rails: Vec<Box<dyn Transport>>, links: &[Vec<bool>], cfg: StripeConfig) -> Bonded {
        assert!(!rails.is_empty(), "rail 0 is needed");
        assert!(links.iter().all(|l| l.len() == rails.len()), "one link flag per rail");
        let now = Instant::now();
        let staging = (0..rails.len()).map(|_| (0..links.len()).map(|_| Staged::default()).collect()).collect();
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(86400 * 365);
        Bonded {
            core: Stripe::new(me, cfg, links, now),
            rails,
            staging,
            timer: Box::pin(tokio::time::sleep_until(far)),
            stats: Default::default(),
        }
    }

    /// A handle to the per-peer, per-rail figures, updated as the transport makes progress.
    pub fn shared_stats(&self) -> SharedStats {
        self.stats.clone()
    }

    /// Writes what the core decided: parts, held frames, acknowledgements; closes what it cut.
    fn drain(&mut self) {
        while let Some((rail, peer, h, payload)) = self.core.poll_transmit() {
            self.rails[rail].send(peer, h, payload);
        }
        while let Some((rail, peer, h)) = self.core.poll_ack() {
            self.rails[rail].send(peer, h, Bytes::new());
        }
        while let Some((rail, peer)) = self.core.poll_cut() {
            self.rails[rail].disconnect(peer, TransportError::Io(std::io::ErrorKind::TimedOut));
        }
        while let Some((peer, e)) = self.core.poll_violation() {
            self.disconnect(peer, TransportError::Wire(e));
        }
    }

    fn refresh_stats(&mut self, peers: usize) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.clear();
        s.extend((0..peers as Rank).map(|p| self.core.stats(p)));
    }
}

impl Transport for Bonded {
    fn name(&self) -> &'static str {
        self.rails[0].name()
    }

    fn name_for(&self, peer: Rank) -> &'static str {
        self.rails[0].name_for(peer)
    }

    fn eager_limit(&self) -> usize {
        self.rails[0].eager_limit()
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        if self.core.takes(peer, &header) {
            self.core.send(peer, header, payload, Instant::now());
            self.drain();
        } else {
            self.rails[0].send(peer, header, payload);
        }
    }

    fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
        if self.core.takes(peer, &header) {
            self.core.send(peer, header, Bytes::copy_from_slice(payload), Instant::now());
            self.drain();
        } else {
            self.rails[0].send_copy(peer, header, payload);
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        let now = Instant::now();
        self.core.handle_timeout(now);
        let mut n = 0;
        for (rail, t) in self.rails.iter_mut().enumerate() {
            let mut rs = RailSink { rail, core: &mut self.core, staged: &mut self.staging[rail], up: sink, now };
            n += t.progress(&mut rs);
        }
        self.drain();
        if n > 0 {
            let peers = self.staging[0].len();
            self.refresh_stats(peers);
        }
        n
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut ready = self.rails.iter_mut().fold(false, |r, t| t.poll_ready(cx).is_ready() | r);
        if let Some(at) = self.core.poll_timeout() {
            self.timer.as_mut().reset(tokio::time::Instant::from_std(at));
            ready |= self.timer.as_mut().poll(cx).is_ready();
        }
        if ready { Poll::Ready(()) } else { Poll::Pending }
    }

    fn awake(&mut self) {
        self.rails.iter_mut().for_each(|t| t.awake());
    }

    fn stand_aside(&mut self) {
        self.rails.iter_mut().for_each(|t| t.stand_aside());
    }

    /// Also while frames are unacknowledged: until then they may have to be sent again on
    /// another rail, so an orderly shutdown waits for them (or for the peer's loss).
    fn has_pending_output(&self) -> bool {
        self.core.has_queued() || self.core.unacknowledged() || self.rails.iter().any(|t| t.has_pending_output())
    }

    fn has_queued_output(&self) -> bool {
        self.core.has_queued() || self.rails.iter().any(|t| t.has_queued_output())
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        for t in &mut self.rails[1..] {
            t.disconnect(peer, reason.clone());
        }
        self.rails[0].disconnect(peer, reason);
    }
}

/// What one rail reads goes through this on its way to the engine.
struct RailSink<'a> {
    rail: usize,
    core: &'a mut Stripe,
    staged: &'a mut [Staged],
    up: &'a mut dyn Sink,
    now: Instant,
}

/// The header the engine sees: the part as an ordinary data frame.
fn plain(h: &Header) -> Header {
    Header { flags: h.flags & !flags::RAIL_PART, tag: 0, ..*h }
}

/// A frame the rails consume themselves: an acknowledgement or a mark.
fn rail_frame(h: &Header) -> bool {
    h.kind == Kind::Credit && h.flags & flags::RAIL_ACK != 0
}

// SAFETY: a slice from `data_dest` is either the upper sink's (rail 0 only, for a data frame that
// is not a part, which this sink then delivers to it through `frame`, or whose connection's loss
// it forwards through `peer_lost`: the upper sink's own contract) or `staged[peer]`'s buffer,
// which is replaced only when the next part's header arrives on this connection (after the frame
// was delivered) and dropped only in `peer_lost`.
unsafe impl Sink for RailSink<'_> {
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        if h.flags & flags::RAIL_PART == 0 {
            if self.rail != 0 {
                return Err(WireError::Unexpected(Kind::Data));
            }
            return self.up.data_dest(peer, h);
        }
        self.core.check_part(peer, h.tag)?;
        let s = self.staged.get_mut(peer as usize).ok_or(WireError::Unexpected(Kind::Data))?;
        if s.id != Some(h.tag) {
            s.id = Some(h.tag);
            s.buf.clear();
            s.buf.resize(h.len as usize, 0);
        }
        Ok(Some(&mut s.buf[..h.len as usize]))
    }

    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        if rail_frame(&h) {
            return self.core.on_rail_frame(peer, self.rail, &h, self.now);
        }
        if h.kind == Kind::Data && h.flags & flags::RAIL_PART != 0 {
            let Some(s) = self.staged.get_mut(peer as usize) else { return };
            // A part of no bytes comes without a `data_dest` call: the staging buffer may still
            // hold an earlier part's bytes, and is not this part's.
            let len = h.len as usize;
            let staged = s.id.take() == Some(h.tag) && s.buf.len() == len;
            if len > 0 && !staged {
                return self.core.violation(peer, WireError::Link("rail part without its bytes"));
            }
            if !self.core.arrived(peer, self.rail, h.tag) {
                return;
            }
            let p = plain(&h);
            match self.up.data_dest(peer, &p) {
                Ok(Some(dest)) if dest.len() == len => {
                    dest.copy_from_slice(&s.buf[..len]);
                    self.up.frame(peer, p, Bytes::new());
                }
                // The sink's contract is a destination of exactly `h.len` bytes.
                Ok(Some(_)) => self.core.violation(peer, WireError::Link("rail part's destination of another length")),
                // Discarded, as a connection discards a frame without a destination: the sink
                // still gets the frame.
                Ok(None) => self.up.frame(peer, p, Bytes::new()),
                // Like a broken frame on one connection: the peer is disconnected, on every rail.
                Err(e) => self.core.violation(peer, e),
            }
            return;
        }
        if h.kind == Kind::Data {
            // Not a part: only rail 0 gets here (`data_dest` refuses it elsewhere), untracked.
            return self.up.frame(peer, h, payload);
        }
        match self.core.control(peer, self.rail, self.now) {
            Ok(true) => self.up.frame(peer, h, payload),
            Ok(false) => {}
            Err(e) => self.core.violation(peer, e),
        }
    }

    fn frame_ref(&mut self, peer: Rank, h: Header, payload: &[u8]) {
        if h.kind == Kind::Data || rail_frame(&h) {
            return self.frame(peer, h, Bytes::copy_from_slice(payload));
        }
        match self.core.control(peer, self.rail, self.now) {
            Ok(true) => self.up.frame_ref(peer, h, payload),
            Ok(false) => {}
            Err(e) => self.core.violation(peer, e),
        }
    }

    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        if let Some(s) = self.staged.get_mut(peer as usize) {
            *s = Staged::default();
        }
        if self.core.rail_lost(peer, self.rail, self.now) {
            self.up.peer_lost(peer, err);
        }
    }
}

#[cfg(test)]
mod tests;
