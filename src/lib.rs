//! ferrocomm: async communication for programs made of many cooperating processes.
//!
//! ```no_run
//! # async fn demo() -> ferrocomm::Result<()> {
//! let world = ferrocomm::init().await?;          // under `ferrorun -n 4 prog`, mpirun or srun
//! let (rank, size) = (world.rank(), world.size());
//! world.send((rank + 1) % size, 7, vec![rank as u8]).await?;
//! let msg = world.recv((rank + size - 1) % size, 7u64).await?;
//! assert_eq!(msg.data[0] as u32, (rank + size - 1) % size);
//! world.barrier().await?;
//! # Ok(()) }
//! ```
//!
//! Layers: [`ferrocomm_reactor`] drives progress; [`ferrocomm_transports`] moves frames;
//! [`p2p::engine`] is the sans-IO matching and rendezvous core; [`World`] and [`Comm`] are the API.

mod api;
pub mod bootstrap;
mod coll;
pub mod config;
pub mod error;
pub mod launch;
pub mod mcast;
pub mod p2p;
pub mod rma;
pub mod testing;

pub use bootstrap::{init, init_with};
pub use config::{ProgressMode, Settings, TcpBackend, TransportChoice, VerbsEager, VerbsRendezvous, VerbsSettings};
pub use error::{Error, Result};
pub use ferrocomm_collectives::{Algorithm, CollError, Element, Operation, ReduceOp, Table};
pub use ferrocomm_reactor::HybridStats;
pub use ferrocomm_transports as transports;
pub use ferrocomm_transports::{Rank, TransportError, WireError};
pub use p2p::{Source, Status, TagMatch};
pub use rma::{
    Access, ArrayView, Event, Geometry, Queue, RemoteSegment, RmaError, RmaOp, Segment, SegmentId, Side, Ticket,
};
pub use api::{Comm, Deadline, Message, Op, Refused, World};

/// The README's examples compile.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
