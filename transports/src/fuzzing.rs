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
