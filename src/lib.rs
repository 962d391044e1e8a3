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
//! Layers, bottom to top: [`ferrocomm_reactor`] drives progress; [`ferrocomm_transports`] moves
//! frames; the point-to-point engine matches messages (sans-IO) and its driver runs it over a
//! transport; [`World`] and [`Comm`] are the API; collectives, [`multicast`] and one-sided
//! communication ([`rma`]) build on it; [`bootstrap`] starts a rank; [`observe`] names the metrics,
//! spans and logs. `docs/architecture.md` maps
//! them to the source folders.

mod api;
pub mod bootstrap;
mod coll;
mod config;
mod error;
pub mod multicast;
pub mod observe;
// The point-to-point protocol core, public for the simulator, the benchmarks and the fuzz
// targets; applications use `Comm`'s methods.
#[doc(hidden)]
pub mod p2p;
pub mod rma;
pub mod testing;

pub use api::{Comm, Deadline, Message, Op, Refused, World};
pub use bootstrap::env::EnvError;
pub use bootstrap::{init, init_with};
pub use config::{
    McastNet, McastSettings, ProgressMode, RailList, RailSettings, RouteSettings, Settings, SettingsBuilder,
    TcpBackend, TransportChoice, VerbsEager, VerbsRendezvous, VerbsSettings,
};
pub use error::{Cause, Error, InvalidArgument, McastError, OwnedError, Result};
pub use ferrocomm_collectives::{Algorithm, CollError, Element, Operation, ReduceOp, Table, bf16, f16};
pub use ferrocomm_reactor::HybridStats;
// The transports crate, for the benchmarks and the fuzz targets that drive a transport alone.
#[doc(hidden)]
pub use ferrocomm_transports as transports;
pub use ferrocomm_transports::{Rank, TransportError, WireError};
pub use observe::{PeerState, PeerStats};
pub use p2p::{Source, Status, TagMatch};
pub use rma::{
    Access, ArrayView, Event, Geometry, GetOp, RemoteQueue, RemoteSegment, RmaError, RmaOp, Segment, SegmentId, Side,
    Ticket,
};

/// The README's examples compile.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The one-sided chapter's examples compile.
#[doc = include_str!("../docs/one-sided.md")]
#[cfg(doctest)]
pub struct OneSidedDoctests;

/// The observability chapter's examples compile.
#[doc = include_str!("../docs/observability.md")]
#[cfg(doctest)]
pub struct ObservabilityDoctests;
