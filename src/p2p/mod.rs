//! Tagged point-to-point messaging: the sans-IO [`engine`] and the types of its API.

pub(crate) mod driver;
pub mod engine;
pub(crate) mod failure;

use bytes::{Bytes, BytesMut};
use ferrocomm_transports::Rank;

/// Which sender a receive accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// Any rank of the communicator.
    Any,
    /// Exactly this rank.
    Rank(Rank),
}

impl From<Rank> for Source {
    fn from(r: Rank) -> Self {
        Source::Rank(r)
    }
}

/// Which tag a receive accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TagMatch {
    /// Any tag.
    Any,
    /// Exactly this tag.
    Exact(u64),
}

impl From<u64> for TagMatch {
    fn from(t: u64) -> Self {
        TagMatch::Exact(t)
    }
}

/// What arrived: who sent it, with which tag, how long it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// The sender (its rank in the communicator).
    pub source: Rank,
    /// The tag it was sent with.
    pub tag: u64,
    /// Its length in bytes.
    pub len: usize,
}

/// A received message's bytes: shared when the transport's buffer could be handed over as is,
/// owned when they landed in the caller's buffer.
#[derive(Debug)]
pub enum Payload {
    Shared(Bytes),
    Owned(BytesMut),
}

impl Payload {
    /// The bytes, without copying.
    #[inline(always)]
    pub fn into_bytes(self) -> Bytes {
        match self {
            Payload::Shared(b) => b,
            Payload::Owned(b) => b.freeze(),
        }
    }

    /// The bytes as a mutable buffer (copies only if they were shared).
    #[inline(always)]
    pub fn into_bytes_mut(self) -> BytesMut {
        match self {
            Payload::Shared(b) => BytesMut::from(&b[..]),
            Payload::Owned(b) => b,
        }
    }
}
