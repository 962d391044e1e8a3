//! The users' API of point-to-point communication: the rank's [`World`], its communicators
//! ([`Comm`]) and their operations ([`Op`]). Layers above (collectives, multicast, one-sided) add
//! methods to [`Comm`] and keep their per-communicator state behind one handle that this layer
//! only stores.

pub(crate) mod world;

pub use world::{Comm, Deadline, Message, Op, Refused, World};
