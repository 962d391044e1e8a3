//! The errors of one-sided communication and the values they name (a segment's id and the
//! rights it grants), here so that [`Error`](super::Error) can hold them without depending on the
//! one-sided layer; `crate::rma` re-exports them.

use std::fmt;

use ferrocomm_transports::Rank;

/// What a segment allows its peers to do (a set of flags).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u8);

impl Access {
    /// Nothing.
    pub const NONE: Access = Access(0);
    /// Read with `get`.
    pub const GET: Access = Access(1);
    /// Write with `put` (and notify).
    pub const PUT: Access = Access(2);
    /// Remote atomics on aligned 64-bit words.
    pub const ATOMIC: Access = Access(4);
    /// Enqueue records (queue segments only).
    pub const QUEUE: Access = Access(8);
    /// Everything a window (non-queue segment) can allow.
    pub const WINDOW: Access = Access(7);

    /// Whether every flag of `other` is set here.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The flags as bits (GET 1, PUT 2, ATOMIC 4, QUEUE 8).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// The flags of `bits`, if they are all known.
    pub const fn from_bits(bits: u8) -> Option<Access> {
        if bits & !15 == 0 { Some(Access(bits)) } else { None }
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [(Access::GET, "GET"), (Access::PUT, "PUT"), (Access::ATOMIC, "ATOMIC"), (Access::QUEUE, "QUEUE")];
        let set: Vec<&str> = names.iter().filter(|(a, _)| self.contains(*a)).map(|(_, n)| *n).collect();
        if set.is_empty() { f.write_str("NONE") } else { f.write_str(&set.join("|")) }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The global id of a segment: its owner's world rank and a serial number that the owner never
/// reuses (so an id outlives its segment only as "unpublished").
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(u64);

impl SegmentId {
    pub(crate) const fn new(owner: Rank, serial: u32) -> SegmentId {
        SegmentId(((owner as u64) << 32) | serial as u64)
    }

    /// The world rank that owns the segment.
    pub const fn owner(self) -> Rank {
        (self.0 >> 32) as Rank
    }

    /// The owner's number for it.
    pub const fn serial(self) -> u32 {
        self.0 as u32
    }

    /// The id as one number (to send it to peers).
    pub const fn to_u64(self) -> u64 {
        self.0
    }

    /// The id a peer sent as [`SegmentId::to_u64`].
    pub const fn from_u64(v: u64) -> SegmentId {
        SegmentId(v)
    }
}

impl fmt::Debug for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.owner(), self.serial())
    }
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Why a one-sided operation was refused. The target memory is untouched whenever one of these is
/// returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RmaError {
    /// The access reaches outside the segment: `len` bytes from `offset` (the span of the whole
    /// geometry) in a segment of `segment_len` bytes.
    #[error("{len} bytes at offset {offset} reach outside the segment of {segment_len} bytes")]
    OutOfBounds {
        /// Where the access starts, in bytes.
        offset: u64,
        /// The length, in bytes.
        len: u64,
        /// The segment's length.
        segment_len: u64,
    },
    /// The segment does not allow this operation.
    #[error("the segment allows {granted}, not {needed}")]
    NotPermitted {
        /// The rights the operation needs.
        needed: Access,
        /// The rights the segment grants.
        granted: Access,
    },
    /// An atomic operation on a word that is not 8-byte aligned.
    #[error("atomic operations need an 8-byte aligned offset, not {offset}")]
    Misaligned {
        /// Where the access starts, in bytes.
        offset: u64,
    },
    /// The owner has no segment of that id.
    #[error("segment {id} does not exist")]
    UnknownSegment {
        /// The segment.
        id: SegmentId,
    },
    /// The segment existed but its owner unpublished it.
    #[error("segment {id} has been unpublished")]
    Unpublished {
        /// The segment.
        id: SegmentId,
    },
    /// The target holds too many enqueues waiting for room in this queue; try again later.
    #[error("queue {id} is full")]
    QueueFull {
        /// The segment.
        id: SegmentId,
    },
    /// A record of the wrong length for the queue.
    #[error("a record of {len} bytes for a queue of {record}-byte records")]
    RecordSize {
        /// The length, in bytes.
        len: u64,
        /// The queue's record length.
        record: u64,
    },
    /// The geometry is inconsistent (a sub-array outside its array, sizes that overflow, a local
    /// buffer too short).
    #[error("invalid geometry: {0}")]
    Geometry(String),
    /// A peer sent a one-sided message that does not parse; the operation it belonged to failed.
    #[error("malformed one-sided message from rank {rank}: {what}")]
    Malformed {
        /// The world rank that sent it.
        rank: Rank,
        /// What is wrong with it.
        what: &'static str,
    },
}

impl RmaError {
    /// The first of bounds and rights that `access` of `span` breaks in a segment of `len` bytes
    /// allowing `granted`: rights first (an access not allowed at all is refused whatever its
    /// range), then bounds.
    pub(crate) fn check(needed: Access, granted: Access, offset: u64, span: u64, len: u64) -> Result<(), RmaError> {
        if !granted.contains(needed) {
            return Err(RmaError::NotPermitted { needed, granted });
        }
        if span > 0 && offset.checked_add(span).is_none_or(|end| end > len) {
            return Err(RmaError::OutOfBounds { offset, len: span, segment_len: len });
        }
        Ok(())
    }

    /// Rights, alignment and bounds of an atomic operation on the word at `offset`.
    pub(crate) fn check_word(granted: Access, offset: u64, len: u64) -> Result<(), RmaError> {
        if !granted.contains(Access::ATOMIC) {
            return Err(RmaError::NotPermitted { needed: Access::ATOMIC, granted });
        }
        if !offset.is_multiple_of(8) {
            return Err(RmaError::Misaligned { offset });
        }
        RmaError::check(Access::ATOMIC, granted, offset, 8, len)
    }
}
