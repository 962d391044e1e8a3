//! Why a call's arguments cannot work: one variant per kind of mistake, each with the values that
//! show it, so that a caller can match on the mistake instead of parsing a message.

use ferrocomm_transports::Rank;

use super::rma::Access;

/// The arguments of a call cannot work. Variants may be added in any release: a `match` needs a
/// wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgument {
    /// A buffer's length differs from the one the call needs (in bytes): a receive buffer
    /// shorter or longer than the result, an output that does not hold every rank's part, or
    /// ranks that passed buffers of different lengths to one collective.
    #[error("a buffer of {got} bytes where the call needs {expected}")]
    LengthMismatch {
        /// The length the call needs, in bytes.
        expected: usize,
        /// The length given, in bytes.
        got: usize,
    },
    /// Data that the call splits into one equal part per rank does not split evenly.
    #[error("{len} elements do not split into {parts} equal parts")]
    Indivisible {
        /// The number of elements given.
        len: usize,
        /// The number of parts (ranks).
        parts: usize,
    },
    /// A list with one entry per rank (parts, counts) has another number of entries.
    #[error("{got} entries for {expected} ranks")]
    CountMismatch {
        /// The communicator's size.
        expected: usize,
        /// The number of entries given.
        got: usize,
    },
    /// Per-rank counts that do not add up to the data's length.
    #[error("counts summing to {sum} for data of {len} elements")]
    CountSum {
        /// What the counts add up to (`usize::MAX` if the sum overflows).
        sum: usize,
        /// The data's length, in elements.
        len: usize,
    },
    /// Bytes that are not a whole number of elements of the call's type.
    #[error("{len} bytes are not a whole number of {element}")]
    PartialElement {
        /// The number of bytes.
        len: usize,
        /// The element type.
        element: &'static str,
    },
    /// A reduction operator that is not defined on the element type (a bitwise operator on
    /// floating point).
    #[error("{op} is not defined on {element}")]
    UnsupportedOp {
        /// The operator.
        op: &'static str,
        /// The element type.
        element: &'static str,
    },
    /// The root of a rooted collective (broadcast, scatter) passed no data.
    #[error("the root of a {op} must provide the data")]
    RootWithoutData {
        /// The collective.
        op: &'static str,
    },
    /// A collective pinned to the shared-memory board in a job without shared memory between
    /// its ranks.
    #[error("the shared-memory algorithm needs shared memory between the ranks, which this job does not have")]
    NoSharedMemory,
    /// A future polled again after it returned its result.
    #[error("a future polled after it completed")]
    PolledAfterCompletion,
    /// An operation that continues on a task of its own was completed outside a tokio runtime.
    #[error("{what} needs a tokio runtime")]
    NoRuntime {
        /// The operation.
        what: &'static str,
    },
    /// A window (a non-queue segment) published with rights it cannot grant.
    #[error("a window allows {allowed} at most, not {asked}")]
    WindowAccess {
        /// The rights asked for.
        asked: Access,
        /// The most a window allows.
        allowed: Access,
    },
    /// A remote queue of records or a capacity outside the limits.
    #[error(
        "a queue needs records of 1 to {max_record} bytes and a power-of-two capacity up to {max_capacity}, not \
         {record} and {capacity}"
    )]
    QueueShape {
        /// The record size asked for, in bytes.
        record: usize,
        /// The capacity asked for, in records.
        capacity: usize,
        /// The largest record allowed.
        max_record: usize,
        /// The largest capacity allowed.
        max_capacity: usize,
    },
    /// One-sided operations through messages need a larger `max_message` than this rank
    /// (`rank: None`) or the segment's owner (`rank: Some`) allows.
    #[error("one-sided operations need max_message of {needed} bytes, {} allows {max_message}", who(.rank))]
    MessageLimit {
        /// The rank whose limit is too small; `None` for this rank's own setting.
        rank: Option<Rank>,
        /// Its `max_message`.
        max_message: usize,
        /// The least one-sided operations need.
        needed: usize,
    },
    /// Every segment id of this rank has been used.
    #[error("segment ids exhausted")]
    SegmentIdsExhausted,
}

/// The rank a limit belongs to, for messages.
fn who(rank: &Option<Rank>) -> String {
    rank.map_or_else(|| "this rank".to_string(), |r| format!("rank {r}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_values() {
        let e = InvalidArgument::LengthMismatch { expected: 64, got: 32 };
        assert_eq!(e.to_string(), "a buffer of 32 bytes where the call needs 64");
        let e = InvalidArgument::MessageLimit { rank: Some(3), max_message: 100, needed: 4096 };
        assert_eq!(e.to_string(), "one-sided operations need max_message of 4096 bytes, rank 3 allows 100");
        let e = InvalidArgument::MessageLimit { rank: None, max_message: 100, needed: 4096 };
        assert!(e.to_string().contains("this rank allows 100"), "{e}");
        let e = InvalidArgument::WindowAccess { asked: Access::QUEUE, allowed: Access::WINDOW };
        assert_eq!(e.to_string(), "a window allows GET|PUT|ATOMIC at most, not QUEUE");
    }
}
