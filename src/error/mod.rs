//! The one error type of the public API.

pub(crate) mod invalid;
pub(crate) mod job;
pub(crate) mod owned;
pub(crate) mod rma;

use std::borrow::Cow;
use std::sync::Arc;

use ferrocomm_transports::{Rank, TransportError};

pub use invalid::InvalidArgument;
pub use owned::OwnedError;

/// The error of a layer below, kept as it came: [`std::error::Error::source`] of an [`Error`]
/// gives it as itself, to downcast (to [`std::io::Error`], [`crate::bootstrap::kv::KvError`],
/// [`TransportError`], ...). Shared, so that [`Error`] stays `Clone`.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    pub(crate) fn new(e: impl std::error::Error + Send + Sync + 'static) -> Cause {
        Cause(Arc::new(e))
    }
}

/// The error itself (not the shared handle): what `source` hands out, so that it downcasts to its
/// own type.
impl std::ops::Deref for Cause {
    type Target = dyn std::error::Error + Send + Sync + 'static;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl std::fmt::Debug for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

/// `": cause"`, or nothing: the cause's message at the end of its error's own.
fn colon(cause: &Option<Cause>) -> String {
    cause.as_ref().map(|c| format!(": {c}")).unwrap_or_default()
}

/// Everything a ferrocomm operation can fail with. Variants may be added in any release: a `match`
/// needs a wildcard arm.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
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
    /// Setting up the job failed (key-value store, connections, the progress thread): what this
    /// rank was doing, and the error of the layer below when there is one.
    #[error("bootstrap failed: {what}{}", colon(.source))]
    Bootstrap {
        /// What this rank was doing.
        what: Cow<'static, str>,
        /// The error of the layer below, as it came.
        source: Option<Cause>,
    },
    /// The job's environment cannot be used, or its key-value store cannot be hosted or reached:
    /// each case names the variable and, for addresses, the address. (Boxed: every operation's
    /// result carries this type, and the other variants are small.)
    #[error("bootstrap failed: {0}")]
    Job(Box<job::EnvError>),
    /// The reliable multicast layer could not do what was asked.
    #[error(transparent)]
    Multicast(#[from] McastError),
    /// The operating system refused what an operation needs (memory, randomness, a file).
    #[error("{what}: {source}")]
    System {
        /// What was asked for.
        what: Cow<'static, str>,
        /// The system's error, as it came.
        source: Cause,
    },
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
    /// The arguments of a call cannot work (mismatched lengths, an unsupported operator, ...):
    /// which mistake, with the values that show it.
    #[error("invalid argument: {0}")]
    Invalid(#[from] InvalidArgument),
    /// An invariant of ferrocomm itself does not hold: a bug in ferrocomm, reported rather than
    /// panicking. `what` names the invariant.
    #[error("internal error (a bug in ferrocomm): {what}")]
    Internal {
        /// The invariant that failed.
        what: &'static str,
    },
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

/// Why the reliable multicast layer could not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum McastError {
    /// A token barrier's release, sent by `root`, names a barrier other than the one this rank
    /// waits in: that rank does not follow the protocol.
    #[error("rank {root} released another barrier than the one this rank waits in")]
    ForeignRelease {
        /// The rank whose release it is.
        root: Rank,
    },
}

impl Error {
    /// A bootstrap step that failed for `cause`: for `map_err`.
    pub(crate) fn bootstrap<E: std::error::Error + Send + Sync + 'static>(
        what: impl Into<Cow<'static, str>>,
    ) -> impl FnOnce(E) -> Error {
        move |e| Error::Bootstrap { what: what.into(), source: Some(Cause::new(e)) }
    }

    /// A bootstrap step that failed with no error below it.
    pub(crate) fn bootstrap_failed(what: impl Into<Cow<'static, str>>) -> Error {
        Error::Bootstrap { what: what.into(), source: None }
    }

    /// An operating-system failure while getting `what`.
    pub(crate) fn system<E: std::error::Error + Send + Sync + 'static>(
        what: impl Into<Cow<'static, str>>,
    ) -> impl FnOnce(E) -> Error {
        move |e| Error::System { what: what.into(), source: Cause::new(e) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of a layer below stays reachable, typed, through `source`, and its message ends
    /// the error's own.
    #[test]
    fn bootstrap_errors_keep_their_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "port taken");
        let e = Error::bootstrap("listening for peers")(io);
        assert_eq!(e.to_string(), "bootstrap failed: listening for peers: port taken");
        let cause = std::error::Error::source(&e).expect("a source");
        let io = cause.downcast_ref::<std::io::Error>().expect("an io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::AddrInUse);
        let bare = Error::bootstrap_failed("listener stopped");
        assert_eq!(bare.to_string(), "bootstrap failed: listener stopped");
        assert!(std::error::Error::source(&bare).is_none());
        let release = Error::from(McastError::ForeignRelease { root: 3 });
        assert!(matches!(release, Error::Multicast(McastError::ForeignRelease { root: 3 })), "{release}");
    }

    /// Results carry this type on every operation: it stays as small as it was (48 bytes, the
    /// `Config` variant's).
    #[test]
    fn the_error_stays_small() {
        assert!(size_of::<Error>() <= 48, "{}", size_of::<Error>());
    }
}
