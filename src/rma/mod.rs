//! One-sided communication: segments that a rank publishes and its peers read, write and update
//! without the owner's application taking part (the model is Kalray's AOS layer: segments
//! published under a global id and attached by id, put/get with strided and sub-array geometries,
//! remote atomics, remote queues, events made of a counter and tickets, `fence`).
//!
//! Layers:
//! * `geometry`: transfer shapes (contiguous, strided, 2-D and 3-D sub-arrays) and their bounds
//!   arithmetic, pure;
//! * `memory`: a segment's memory (a file-backed shared mapping with a header) and every
//!   operation on it, as loads, stores and atomics: what the target applies, and what a peer that
//!   maps the segment (shared memory) does itself;
//! * `wire`: the request/response messages of the emulated path, encoded and checked;
//! * `service`: the sans-IO protocol core of both sides of the emulated path (the target's
//!   handlers, the initiator's pending operations, peer loss, events), driven by
//! * `hook`: the thin glue that runs the service inside the reactor's progress, over the
//!   point-to-point engine on a reserved context, so the target serves requests without any call
//!   by its application;
//! * `api`: [`Segment`], [`RemoteSegment`], [`RemoteQueue`], [`Event`] and the operations on
//!   [`World`](crate::World).
//!
//! Routes: a peer reached over shared memory maps the owner's segment (`pidfd_getfd` of the
//! owner's memfd) and does every operation itself on the mapping; any other peer (TCP, or shared
//! memory where the kernel refuses `pidfd_getfd`) sends requests that the target's progress
//! applies, checking bounds and rights again.

mod api;
mod geometry;
pub(crate) mod hook;
pub(crate) mod memory;
pub(crate) mod service;
mod sys;
mod verbs;
pub(crate) mod wire;

pub use crate::error::rma::{Access, RmaError, SegmentId};
pub use api::{Event, GetOp, RemoteQueue, RemoteSegment, RmaOp, Segment, Ticket};
pub use geometry::{ArrayView, Geometry, Side};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags() {
        let a = Access::GET | Access::ATOMIC;
        assert!(a.contains(Access::GET) && a.contains(Access::ATOMIC) && !a.contains(Access::PUT));
        assert!(Access::WINDOW.contains(a) && !a.contains(Access::WINDOW));
        assert_eq!(format!("{a:?}"), "GET|ATOMIC");
        assert_eq!(format!("{:?}", Access::NONE), "NONE");
        assert_eq!(Access::from_bits(a.bits()), Some(a));
        assert_eq!(Access::from_bits(16), None);
    }

    #[test]
    fn ids() {
        let id = SegmentId::new(7, 42);
        assert_eq!((id.owner(), id.serial()), (7, 42));
        assert_eq!(SegmentId::from_u64(id.to_u64()), id);
        assert_eq!(id.to_string(), "7/42");
    }

    #[test]
    fn checks() {
        let w = Access::WINDOW;
        assert_eq!(RmaError::check(Access::PUT, w, 0, 100, 100), Ok(()));
        assert_eq!(RmaError::check(Access::PUT, w, 100, 0, 100), Ok(()));
        assert_eq!(
            RmaError::check(Access::PUT, w, 1, 100, 100),
            Err(RmaError::OutOfBounds { offset: 1, len: 100, segment_len: 100 })
        );
        assert!(matches!(RmaError::check(Access::PUT, w, u64::MAX, 2, 100), Err(RmaError::OutOfBounds { .. })));
        assert_eq!(
            RmaError::check(Access::PUT, Access::GET, 200, 1, 100),
            Err(RmaError::NotPermitted { needed: Access::PUT, granted: Access::GET })
        );
        assert_eq!(RmaError::check_word(w, 8, 16), Ok(()));
        assert_eq!(RmaError::check_word(w, 4, 16), Err(RmaError::Misaligned { offset: 4 }));
        assert!(matches!(RmaError::check_word(w, 16, 16), Err(RmaError::OutOfBounds { .. })));
        assert!(matches!(RmaError::check_word(Access::GET, 0, 16), Err(RmaError::NotPermitted { .. })));
    }
}
