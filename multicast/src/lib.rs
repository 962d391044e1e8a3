//! Reliable multicast for ferrocomm.
//!
//! Network multicast sends one copy where point-to-point sends N, but loses and reorders
//! datagrams. This crate adds reliability the way chapter 5 of the MVAPICH multicast dissertation
//! does (sliding window at the root, co-roots that hold a copy and collect their sub-group's
//! ACKs, retransmission to the missing rank only over reliable point-to-point), plus the
//! skew-tolerant token barrier of its chapter 7:
//!
//! * [`transport`]: the unreliable multicast transport trait and its UDP/IPv4 implementation;
//! * `ud` (cargo feature `verbs`): the trait over an RDMA UD queue pair attached to a multicast
//!   group, one send reaching every member through the fabric;
//! * [`wire`]: datagram and control-message formats, every field checked;
//! * [`proto`]: the protocol roles (root, co-root, leaf) as one sans-IO state machine per rank;
//! * [`barrier`]: the token barrier, sans-IO.
//!
//! The I/O driver that binds these to a communicator lives in the `ferrocomm` crate
//! (`ferrocomm::multicast`), since the reliable point-to-point part is the communicator's.

pub mod barrier;
pub mod proto;
pub mod transport;
#[cfg(feature = "verbs")]
pub mod ud;
pub mod wire;

pub use proto::{Config, Event, Layout, McastCore, ProtoError, SendError, Stats, Transmit};
pub use transport::{MulticastTransport, Received, UdpConfig, UdpMulticast};
#[cfg(feature = "verbs")]
pub use ud::{UdConfig, UdMulticast, UdStats};
pub use wire::{DatagramError, Rank};
