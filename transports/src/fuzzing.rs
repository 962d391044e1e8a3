//! Internals reachable from the fuzz targets in `fuzz/` (not a stable API; hidden from the docs).
//!
//! The TCP byte-stream parser is private to the TCP backends, which feed it from sockets; the
//! fuzz targets feed it from memory through [`StreamReader`], exactly as a read would.

use crate::tcp::framing::Reader;
use crate::wire::{Limits, Rank};
use crate::{Sink, TransportError};

/// One TCP connection's frame parser, fed from memory.
pub struct StreamReader(Reader);

impl StreamReader {
    /// The parser of the connection from `peer`.
    pub fn new(peer: Rank, limits: Limits) -> StreamReader {
        StreamReader(Reader::new(peer, limits))
    }

    /// One read of at most `bytes.len()` bytes (fewer if the parser asks for fewer, as a socket
    /// read into its target would give): delivers every frame they complete to `sink`. Returns
    /// how many bytes were taken; an error closes the connection in a real backend.
    pub fn read(&mut self, bytes: &[u8], sink: &mut dyn Sink) -> Result<usize, TransportError> {
        // A data frame held back for its receive: the rounds a backend would run pass at once.
        while self.0.held() {
            self.0.resume(sink)?;
        }
        let t = self.0.target(sink)?;
        let n = t.len.min(bytes.len());
        // SAFETY: `target` returned a place valid for `t.len` bytes (the reader's buffer, its
        // scratch space, or the sink's destination, which the `Sink` contract keeps in place
        // until the frame is delivered); nothing touches the reader or the sink before `advance`,
        // and `bytes` is the caller's memory, which cannot overlap either.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.ptr, n) };
        self.0.advance(n, sink)?;
        Ok(n)
    }
}

/// Runs `f` (a handshake over [`Memory`]) to its end: reading from memory never waits.
fn run_now<T>(f: impl std::future::Future<Output = T>) -> T {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(t) => t,
        std::task::Poll::Pending => unreachable!("a handshake over memory never waits"),
    }
}

/// A connection in memory: what the peer sent, and what this side writes.
pub type Memory<'a> = tokio::io::Join<&'a [u8], Vec<u8>>;

/// The accepting side of the peers' handshake ([`crate::tcp::handshake_accept`]) as rank `me`
/// with `token`, reading `from_peer` as what the connecting side sent. Returns its verdict and
/// what it wrote.
pub fn peer_accept(
    from_peer: &[u8],
    me: Rank,
    token: &[u8; crate::wire::TOKEN_LEN],
    limits: &Limits,
) -> (Result<Rank, TransportError>, Vec<u8>) {
    let mut conn: Memory<'_> = tokio::io::join(from_peer, Vec::new());
    let verdict = run_now(crate::tcp::handshake_accept(&mut conn, me, token, limits));
    (verdict, conn.into_inner().1)
}

/// The connecting side of the peers' handshake ([`crate::tcp::handshake_connect`]) as rank `me`
/// to rank `expect`, reading `from_peer` as what the listener sent. Returns its verdict and what
/// it wrote.
pub fn peer_connect(
    from_peer: &[u8],
    me: Rank,
    expect: Rank,
    token: &[u8; crate::wire::TOKEN_LEN],
    limits: &Limits,
) -> (Result<(), TransportError>, Vec<u8>) {
    let mut conn: Memory<'_> = tokio::io::join(from_peer, Vec::new());
    let verdict = run_now(crate::tcp::handshake_connect(&mut conn, me, expect, token, limits));
    (verdict, conn.into_inner().1)
}
