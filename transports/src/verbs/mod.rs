//! RDMA verbs (InfiniBand, RoCE, Soft-RoCE) between ranks: cargo feature `verbs`.
//!
//! The protocol pieces ([`link`]: slots and slot credits; [`regcache`]: the registration cache)
//! are plain Rust and always compiled and tested; the transport itself needs the feature (it
//! links the system `libibverbs.so.1` through the `ibverbs` crate; see `sys` for why its raw
//! `ffi` bindings are used rather than its safe types).
//!
//! Design, after DCFA (thesis 000) with its known defects fixed:
//! * **Connections are made eagerly at start-up**, one RC queue pair per peer, addresses
//!   exchanged through the bootstrap key-value store. Lazy connection on first use would need the
//!   store (or a connection manager) after start-up, and the store lives only during
//!   bootstrap; a QP and two small rings per peer are cheap at the job sizes where every pair
//!   talks over RC anyway (UD will carry the large-scale cases, see below).
//! * **Eager path**, two ways ([`Eager`]), one slot format and one credit scheme ([`link`]: slot
//!   credits with monotonic counters piggybacked on every slot, the last slot reserved for credit
//!   updates). The receiver copies a slot out when its completion is polled (the engine's own
//!   credits bound what it keeps). A slot carries only what its kind needs; an eager message
//!   has a compact one (24 bytes before its payload against 64 for a full frame), and eager
//!   slots are posted unsignaled but one in [`link::SIGNAL_EVERY`] ([`link::SendQueue`]), as
//!   `ib_send_lat` does: no send completion to raise and poll per message.
//!   - *Rings* ([`Eager::Ring`], default): per-peer rings of fixed slots in the receiver's
//!     memory, written by RDMA write-with-immediate (DCFA's eager ring).
//!   - *Shared receive queue* ([`Eager::SharedQueue`]): the slot travels by send-with-immediate
//!     into whichever buffer the receiver's one SRQ hands out; the buffers are a pool shared by
//!     all peers, reposted as soon as they are copied out. Receive memory then grows with the
//!     pool, not with peers x slots: a pool smaller than that is allowed, and when a burst
//!     finds it empty the device holds the sender back (RNR retry, without limit) until a
//!     buffer is reposted, so nothing is lost, only delayed.
//! * **Rendezvous without copies**. The engine always runs RTS -> CTS -> data; the transport maps
//!   this onto DCFA's two zero-copy protocols:
//!   - *RTR / RDMA write* ([`Rendezvous::Write`], default): when the receiver's CTS leaves, the
//!     transport asks the engine for the whole destination buffer ([`Sink::data_dest`]),
//!     registers it and sends it with the CTS (DCFA's RTR: receiver buffer address + key). The
//!     sender RDMA-writes each data chunk straight into it, then writes a `DataWritten` slot on
//!     the same QP; RC ordering places the data before that slot completes, so the slot is the
//!     DONE. One round trip (RTS/CTS) plus the data.
//!   - *RTS / RDMA read* ([`Rendezvous::Read`], or when the receiver sent a plain CTS): the
//!     sender lends each chunk (registered through the cache, kept alive by the transport) and
//!     sends its address and key; the receiver RDMA-reads it into the destination and answers
//!     DONE (`ReadDone`), which releases the chunk.
//!   - *Crossing*: in DCFA a receiver-initiated RTR and a sender's RTS can cross, and the rule
//!     is "the sender ignores the RTR, the receiver reads using the RTS". Here the receiver's
//!     buffer only ever travels *in answer to* an RTS (the engine's receive side does not send
//!     before it has matched an RTS, so a wildcard receive needs no special case either), so the
//!     two never cross on the wire: a sender that receives a plain CTS lends (read), one that
//!     receives a CTS with a buffer writes, and a receiver that gets a read offer reads. All
//!     three orders of posting (send first, receive first, both at once) end in one of these two
//!     paths; the p2p suite exercises all three over both.
//! * **Progress**: [`Transport::progress`] polls the one completion queue (no system call when
//!   idle) and writes queued slots. A frame with nothing queued before it is posted by
//!   [`Transport::send`] itself, and the receive requests that arrived slots used up are posted
//!   again once a progress call finds nothing (the queue holds twice the slots), so neither a
//!   send nor a receive waits for the other's bookkeeping. For sleeping,
//!   [`Transport::poll_ready`] arms the CQ and registers the completion channel's fd with tokio,
//!   as shared memory does with its eventfd.
//! * **Peer loss**: a peer's bootstrap TCP connection stays open as a liveness channel (its
//!   kernel closes it when the process dies, at once), watched while sleeping and polled every
//!   [`VerbsConfig::liveness_polls`] idle progress calls; failed work completions (retry
//!   exceeded) also end the connection. The QP is then moved to the error state, which flushes
//!   every outstanding work request; only when none is left (no RDMA into a receive buffer can
//!   still happen) are the registrations of its buffers dropped and the loss reported.
//!
//! Room for what comes next (not built): reliable multicast will use a UD queue pair and
//! multicast attach, and one-sided operations RDMA atomics. Both fit beside this transport: a UD
//! QP is one more QP on the same device, PD and CQ (its completions carry their own `wr_id`
//! kind), and atomics are one more `sys::Op` on the existing RC QPs toward a registered
//! segment. They will be exposed as separate capability traits implemented by
//! `VerbsTransport`, so the [`Transport`] trait itself does not change.

pub mod link;
pub mod regcache;

#[cfg(feature = "verbs")]
mod sys;
#[cfg(feature = "verbs")]
mod transport;
#[cfg(feature = "verbs")]
pub mod ud;

#[cfg(feature = "verbs")]
pub use transport::{VerbsEndpoint, VerbsStats, VerbsTransport, device_names};
#[cfg(feature = "verbs")]
pub use ud::{MAX_RECV_BUFFERS, UdConfig, UdMulticast, UdStats};

// For the module documentation's links, with or without the `verbs` feature.
#[allow(unused_imports)]
use crate::{Sink, Transport};

/// How large messages move (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// The receiver announces its buffer with the CTS; the sender RDMA-writes (DCFA's RTR path).
    Write,
    /// The sender lends each chunk; the receiver RDMA-reads it (DCFA's RTS path).
    Read,
}

impl std::str::FromStr for Rendezvous {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "write" => Ok(Rendezvous::Write),
            "read" => Ok(Rendezvous::Read),
            _ => Err(format!("unknown rendezvous mode {s:?} (write, read)")),
        }
    }
}

/// How eager slots travel (see the module documentation). Every rank needs the same choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eager {
    /// RDMA write-with-immediate into a ring per peer.
    Ring,
    /// Send-with-immediate into a shared receive queue's pool of buffers.
    SharedQueue,
}

impl std::str::FromStr for Eager {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ring" => Ok(Eager::Ring),
            "srq" => Ok(Eager::SharedQueue),
            _ => Err(format!("unknown eager path {s:?} (ring, srq)")),
        }
    }
}

/// Settings of the verbs transport.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// Device name (`rxe0`, `mlx5_0`); the first device when `None`.
    pub device: Option<String>,
    /// GID table index; by default the first RoCE v2 entry with an IPv4 address.
    pub gid_index: Option<u8>,
    /// Slot credits per connection and direction (with rings: slots per ring); one is reserved
    /// for credit updates.
    pub slots: u32,
    /// How eager slots travel.
    pub eager: Eager,
    /// With [`Eager::SharedQueue`]: receive buffers in the pool; 0 for `slots` per peer (a
    /// sender never waits on the pool then). Capped by what the device allows.
    pub srq_buffers: u32,
    /// How large messages move.
    pub rendezvous: Rendezvous,
    /// Registration cache budget: the most registrations kept.
    pub cache_entries: usize,
    /// Registration cache budget: the most bytes kept registered.
    pub cache_bytes: usize,
    /// Idle progress calls between two liveness checks of the peers (busy calls count 1/16).
    pub liveness_polls: u32,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            gid_index: None,
            slots: 32,
            eager: Eager::Ring,
            srq_buffers: 0,
            rendezvous: Rendezvous::Write,
            cache_entries: 64,
            cache_bytes: 256 << 20,
            liveness_polls: 4096,
        }
    }
}
