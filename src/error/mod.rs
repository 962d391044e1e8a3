//! The one error type of the public API.

pub(crate) mod job;
pub(crate) mod rma;

use ferrocomm_transports::{Rank, TransportError};

/// Everything a ferrocomm operation can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A rank this operation needs is gone: lost (crashed, killed, cut off, silent past the peer
    /// timeout, broke the protocol), or departed (`reason` [`TransportError::Left`]). `rank` is
    /// a world rank. A loss revokes every communicator that contains the lost rank: all their
    /// operations fail with this error naming it, whoever they involve (see `docs/failure.md`).
    #[error("rank {rank} is lost: {reason}")]
    PeerLost {
        /// The world rank.
        rank: Rank,
        /// Why it is gone.
        reason: TransportError,
    },
    /// The matching message is longer than the posted receive buffer. The message is consumed.
    #[error("message of {len} bytes does not fit the receive buffer of {capacity} bytes")]
    Truncated {
        /// The length asked for, in bytes.
        len: usize,
        /// The receive buffer's length.
        capacity: usize,
    },
    /// The receiver's buffer was too small for this (rendezvous) message; nothing was delivered.
    #[error("the receiver's buffer of rank {rank} was too small; the message was not delivered")]
    RemoteTruncated {
        /// The world rank.
        rank: Rank,
    },
    /// The operation's deadline passed; it was cancelled.
    #[error("deadline expired")]
    Timeout,
    /// A rank outside the communicator.
    #[error("rank {rank} is not in this communicator of {size} ranks")]
    UnknownRank {
        /// The world rank.
        rank: Rank,
        /// The communicator's size.
        size: u32,
    },
    /// A message larger than the configured maximum.
    #[error("message of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// The length asked for, in bytes.
        len: usize,
        /// The largest allowed.
        max: usize,
    },
    /// This rank has been shut down.
    #[error("the world has been shut down")]
    Shutdown,
    /// Setting up the job failed (environment, key-value store, connections).
    #[error("bootstrap failed: {0}")]
    Bootstrap(String),
    /// The job's environment cannot be used, or its key-value store cannot be hosted or reached:
    /// each case names the variable and, for addresses, the address. (Boxed: every operation's
    /// result carries this type, and the other variants are small.)
    #[error("bootstrap failed: {0}")]
    Job(Box<job::EnvError>),
    /// The multicast layer could not do what was asked (see the message).
    #[error("multicast: {0}")]
    Multicast(String),
    /// A setting has a value that cannot be used.
    #[error("invalid setting {name}: {reason}")]
    Config {
        /// The setting (its variable).
        name: &'static str,
        /// Why it is gone.
        reason: String,
    },
    /// A collective failed: a peer sent a message that does not fit the algorithm, or the call's
    /// arguments are inconsistent.
    #[error(transparent)]
    Collective(#[from] ferrocomm_collectives::CollError),
    /// The arguments of a call cannot work (mismatched lengths, an unsupported operator, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A one-sided operation was refused (bounds, rights, alignment, an unknown or unpublished
    /// segment, ...); the target memory is untouched.
    #[error(transparent)]
    Rma(#[from] rma::RmaError),
}

/// Shorthand for results of ferrocomm operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<job::EnvError> for Error {
    fn from(e: job::EnvError) -> Error {
        Error::Job(Box::new(e))
    }
}

impl Error {
    pub(crate) fn bootstrap(what: impl std::fmt::Display) -> Error {
        Error::Bootstrap(what.to_string())
    }
}
