//! Transports move frames between ranks; they know nothing of matching, tags or collectives.
//!
//! Every transport has the same completion-driven shape, so the reactor can drive any of them:
//! [`Transport::send`] only queues, [`Transport::progress`] moves bytes without blocking and hands
//! whole frames to a [`Sink`], and [`Transport::poll_ready`] registers a waker so the progress loop
//! can sleep until there is something to do. Payloads of rendezvous data frames are written straight
//! into the receiver's posted buffer ([`Sink::data_dest`]), so large messages are not copied twice.

pub mod auth;
pub mod mapping;
pub mod one_sided;
pub mod rails;
pub mod relay;
pub mod route;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod sim;
pub mod tcp;
pub mod verbs;
pub mod wire;

#[doc(hidden)]
pub mod fuzzing;

use std::io;
use std::task::{Context, Poll};

use bytes::Bytes;

pub use wire::{Header, Kind, Limits, Rank, WireError};

/// Why a connection to a peer ended, or why a peer is known to be gone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer broke the wire protocol; the connection was closed.
    #[error("protocol violation: {0}")]
    Wire(#[from] WireError),
    /// The connection's handshake failed (wrong job token, not a rank of this job, ...).
    #[error("handshake: {0}")]
    Handshake(#[from] auth::HandshakeError),
    /// The connection failed at the operating-system level.
    #[error("i/o error: {0}")]
    Io(io::ErrorKind),
    /// The peer closed the connection without saying goodbye (crash, kill).
    #[error("connection closed by peer")]
    Closed,
    /// The peer said goodbye.
    #[error("peer left the job")]
    Left,
    /// Another rank reported the peer lost (it saw the loss itself, or heard of it).
    #[error("reported lost by rank {by}")]
    Reported {
        /// The reporting rank.
        by: Rank,
    },
    /// The peer announced that it is leaving without finishing (its program panicked).
    #[error("the peer aborted")]
    Aborted,
    /// The launcher saw the peer's process end before it said goodbye.
    #[error("the launcher saw its process end")]
    Launcher,
    /// Its connection to the job's key-value store (hosted by a rank, under a launcher other than
    /// `ferrorun`) closed without a goodbye: its process ended.
    #[error("its connection to the job's store closed without a goodbye")]
    StoreClosed,
}

impl From<io::Error> for TransportError {
    fn from(e: io::Error) -> Self {
        TransportError::Io(e.kind())
    }
}

/// Receives what a transport reads.
///
/// # Safety
/// A slice returned by [`Sink::data_dest`] must stay valid, unmoved and unaliased until the same
/// sink has received that frame through [`Sink::frame`] or the peer through [`Sink::peer_lost`]:
/// a completion-based transport (io_uring, verbs) may have the kernel or the NIC write into it
/// in the meantime.
pub unsafe trait Sink {
    /// Where the payload of rendezvous `Data` frame `h` from `peer` must land (exactly `h.len`
    /// bytes). `Ok(None)` discards the payload; `Err` closes the connection.
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError>;
    /// Whether `Data` frame `h` from `peer` has no destination yet but may get one soon: it
    /// belongs to a pushed message whose receive is not posted, none of whose data has been
    /// dropped. [`Sink::data_dest`] would discard it now; a byte-stream transport may instead hold
    /// it back, unread, for a few progress rounds so that the caller can post the receive. The
    /// default: never.
    fn awaits_receive(&mut self, peer: Rank, h: &Header) -> bool {
        let _ = (peer, h);
        false
    }
    /// A complete frame. For `Data` frames the payload already sits in the destination and
    /// `payload` is empty.
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes);
    /// A complete non-`Data` frame whose payload is only lent: it still sits in the transport's
    /// buffer (a shared-memory ring) and is gone when this returns. The default copies it into a
    /// [`Bytes`] for [`Sink::frame`]; a sink that has a destination for it already (a posted
    /// receive buffer) copies it there instead and saves an allocation on the latency path.
    fn frame_ref(&mut self, peer: Rank, h: Header, payload: &[u8]) {
        self.frame(peer, h, Bytes::copy_from_slice(payload))
    }
    /// The connection to `peer` is gone; no more frames will come from it.
    fn peer_lost(&mut self, peer: Rank, err: TransportError);
}

/// A payload to send: owned ([`Bytes`], kept as it is) or borrowed (`&[u8]`, copied only where
/// it must be kept: queued, or delivered to this rank), so that a frame a transport writes at once
/// needs no buffer of its own.
pub trait Outgoing: AsRef<[u8]> {
    /// The payload as a buffer that can be kept (a copy, for borrowed data).
    fn into_bytes(self) -> Bytes;
    /// Hands a frame with this payload to `t`: [`Transport::send`] or [`Transport::send_copy`].
    fn send_to(self, t: &mut dyn Transport, peer: Rank, header: Header);
}

impl Outgoing for Bytes {
    #[inline]
    fn into_bytes(self) -> Bytes {
        self
    }
    #[inline]
    fn send_to(self, t: &mut dyn Transport, peer: Rank, header: Header) {
        t.send(peer, header, self)
    }
}

impl Outgoing for &[u8] {
    #[inline]
    fn into_bytes(self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
    #[inline]
    fn send_to(self, t: &mut dyn Transport, peer: Rank, header: Header) {
        t.send_copy(peer, header, self)
    }
}

/// A way of moving frames to and from every peer of one rank.
///
/// Deliberately two-sided and frame-shaped. What RDMA adds beyond frames is meant to come as
/// separate capability traits next to this one, implemented by the transports that can, not as
/// new methods here: unreliable datagrams with multicast attach (for reliable multicast, with
/// the windows and ACKs in a sans-IO core above) and one-sided put/get/atomics on registered
/// segments. A verbs transport can serve both from the device, protection domain and completion
/// queue it already has (see [`verbs`]).
pub trait Transport: Send {
    /// Short name for logs and metrics (`tcp-uring`, `tcp-portable`, ...).
    fn name(&self) -> &'static str;
    /// The name of the transport that reaches `peer` (differs from [`Transport::name`] only for a
    /// transport made of several).
    fn name_for(&self, _peer: Rank) -> &'static str {
        self.name()
    }
    /// The largest eager payload this transport wants.
    fn eager_limit(&self) -> usize;
    /// Queues a frame for `peer`. Never blocks; [`Transport::progress`] writes it (a transport may
    /// also write it at once when nothing is queued before it: see
    /// [`Transport::has_pending_output`]). Frames to one peer are delivered in the order they were
    /// queued.
    fn send(&mut self, peer: Rank, header: Header, payload: Bytes);
    /// [`Transport::send`] of a borrowed payload, copied before this returns. A transport that
    /// can write the frame at once takes it straight from `payload`; by default it is copied into
    /// a buffer and queued.
    fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
        self.send(peer, header, Bytes::copy_from_slice(payload))
    }
    /// Moves whatever can move without blocking. Returns how much happened (0 = idle).
    fn progress(&mut self, sink: &mut dyn Sink) -> usize;
    /// `Ready` when [`Transport::progress`] has work; otherwise arranges for `cx` to be woken
    /// when it may have.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()>;
    /// The sleeper that called [`Transport::poll_ready`] is awake again: undo what announcing the
    /// sleep set up (doorbell flags). Progress made meanwhile by other threads must not undo it,
    /// since the sleeper still relies on it. (The reactor also calls it when a caller woken early
    /// by hybrid polling starts spinning: it then wakes the sleeper itself at once, so nothing
    /// relies on the flags any more.)
    fn awake(&mut self) {}
    /// Nothing will sleep on this transport until the next [`Transport::poll_ready`]: a doorbell
    /// that readiness of its own would keep ringing (waking the reactor thread at every message
    /// while callers spin) should be taken down.
    fn stand_aside(&mut self) {}
    /// True while queued frames are not yet handed to the operating system.
    fn has_pending_output(&self) -> bool;
    /// True while frames wait in a queue of this transport that only [`Transport::progress`]
    /// writes; unlike [`Transport::has_pending_output`], not for frames already handed to the
    /// operating system or the device and not yet confirmed (posted verbs work requests).
    fn has_queued_output(&self) -> bool {
        self.has_pending_output()
    }
    /// Drops the connection to `peer` (it broke the protocol one level up). The transport reports
    /// the loss through [`Sink::peer_lost`] with `reason` once no read into a sink buffer is in flight.
    fn disconnect(&mut self, peer: Rank, reason: TransportError);
    /// The one-sided capability ([`one_sided::OneSided`]), for a transport whose device reaches
    /// peers' memory itself; `None` (the default) otherwise.
    fn one_sided(&mut self) -> Option<&mut dyn one_sided::OneSided> {
        None
    }
}
