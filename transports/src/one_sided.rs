//! One-sided operations on registered memory: the capability a transport offers beside its frames
//! when its device reads, writes and updates a peer's memory without the peer's CPU (RDMA verbs).
//! The facade reaches it through [`Transport::one_sided`](crate::Transport::one_sided); transports
//! without it return `None` there and the facade emulates the operations with messages.
//!
//! The caller registers the memory it exposes ([`OneSided::register`]) and sends the returned
//! address and key to its peers by its own means; a peer posts operations against them
//! ([`OneSided::post`]) with a token of its choosing and collects each operation's completion,
//! once, from [`OneSided::poll_done`] after the transport's progress.

use std::io;

use bytes::Bytes;

use crate::{Rank, TransportError};

/// What a registration lets peers do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteAccess {
    /// RDMA read.
    pub read: bool,
    /// RDMA write.
    pub write: bool,
    /// Remote atomics on 8-byte aligned words.
    pub atomic: bool,
}

/// Where registered memory is, for peers: its address in the owner's address space and its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteKey {
    /// The first byte's address.
    pub addr: u64,
    /// The remote key (0: not registered).
    pub rkey: u32,
}

/// One contiguous piece of a transfer: `len` bytes at `stream` in the operation's contiguous
/// local stream and at `addr` in the target's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Offset in the local stream.
    pub stream: usize,
    /// Remote address.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
}

/// An operation to post.
#[derive(Debug)]
pub enum Request<'a> {
    /// Writes the runs of `src` (the whole local stream; copied before [`OneSided::post`]
    /// returns, so the caller may reuse it at once).
    Write {
        /// The local stream.
        src: &'a [u8],
        /// Where its runs go.
        runs: &'a [Run],
        /// The target's key.
        rkey: u32,
    },
    /// Writes the runs of a local stream that lies in this transport's own registration
    /// `handle` (from [`OneSided::register`]): `len` bytes from its `offset`, which the device
    /// reads where they are (nothing is copied). The caller keeps the memory unchanged until the
    /// operation completes; the registration stays in place until then even if the caller
    /// deregisters it meanwhile (a handle deregistered before `post` fails with `InvalidInput`).
    WriteRegistered {
        /// The local registration holding the stream.
        handle: u64,
        /// Where the stream starts in it.
        offset: usize,
        /// Bytes of the stream.
        len: usize,
        /// Where its runs go.
        runs: &'a [Run],
        /// The target's key.
        rkey: u32,
    },
    /// Reads the runs into a local stream of `len` bytes, returned as [`Done::Data`].
    Read {
        /// Bytes of the local stream.
        len: usize,
        /// Where its runs come from.
        runs: &'a [Run],
        /// The target's key.
        rkey: u32,
    },
    /// Adds `add` (wrapping) to the 8-byte aligned word at `addr`; [`Done::Value`] is its
    /// previous value.
    FetchAdd {
        /// The word's address.
        addr: u64,
        /// The target's key.
        rkey: u32,
        /// What to add.
        add: u64,
    },
    /// Stores `swap` in the word at `addr` if it holds `compare`; [`Done::Value`] is the value
    /// it held.
    CompareSwap {
        /// The word's address.
        addr: u64,
        /// The target's key.
        rkey: u32,
        /// The expected value.
        compare: u64,
        /// The new value.
        swap: u64,
    },
}

/// What a completed operation gives back.
#[derive(Debug, PartialEq, Eq)]
pub enum Done {
    /// A write is in the target's memory.
    Unit,
    /// A read's local stream.
    Data(Bytes),
    /// An atomic's previous value.
    Value(u64),
}

/// The one-sided capability of a transport (see the module documentation).
pub trait OneSided {
    /// Registers `len` bytes at `addr` for peers' operations as `access` allows; returns a
    /// handle (for [`OneSided::deregister`]) and where peers find it.
    ///
    /// # Safety
    /// The memory must stay allocated until it is deregistered (or the transport is dropped).
    unsafe fn register(&mut self, addr: *mut u8, len: usize, access: RemoteAccess) -> io::Result<(u64, RemoteKey)>;
    /// Ends a registration: peers' operations with its key fail from then on (and break their
    /// connection), so the caller deregisters only once no peer uses the key any more. The
    /// transport's own requests from it (`WriteRegistered`) still pending keep it until they
    /// complete.
    fn deregister(&mut self, handle: u64);
    /// Posts `req` to `peer` (this rank itself: through a loopback connection, so that its own
    /// atomics are atomic with its peers'), completing later with `token`. An error means it was
    /// not posted (the peer is unknown or its connection is gone).
    fn post(&mut self, peer: Rank, req: Request<'_>, token: u64) -> Result<(), TransportError>;
    /// The next completed operation: its token and result (a failed one: the connection's end).
    fn poll_done(&mut self) -> Option<(u64, Result<Done, TransportError>)>;
    /// Whether operations are posted or waiting to be.
    fn busy(&self) -> bool;
}
