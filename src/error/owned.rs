//! The error of an owned collective: the [`Error`] together with the caller's buffer, so that a
//! failed call does not cost the buffer (a training loop retries with it, or reuses it).

use super::Error;

/// An owned collective (`Comm::allreduce_owned`, ...) failed: why, and the buffer it was given.
///
/// `buffer` holds what the caller passed in, element for element: the all-reduce, broadcast and
/// reduce give back the vector itself (its contents may be partly overwritten where the call
/// failed after writing results into it: a broadcast or all-reduce that wrote part of the result
/// before a peer was lost); the reduce-scatter and scan, which sent the vector as message bytes
/// that the transport may still hold, give back a copy of its (unchanged) contents. A future polled
/// again after it completed has no buffer left to give: `buffer` is empty then.
///
/// `?` converts it into [`Error`] (dropping the buffer) where the buffer is not wanted.
#[derive(Clone)]
pub struct OwnedError<T> {
    /// Why the call failed.
    pub error: Error,
    /// The caller's buffer.
    pub buffer: Vec<T>,
}

impl<T> OwnedError<T> {
    /// The error, without the buffer.
    pub fn into_error(self) -> Error {
        self.error
    }
}

impl<T> From<OwnedError<T>> for Error {
    fn from(e: OwnedError<T>) -> Error {
        e.error
    }
}

/// The buffer is shown by its length: it may hold millions of elements.
impl<T> std::fmt::Debug for OwnedError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedError").field("error", &self.error).field("buffer_len", &self.buffer.len()).finish()
    }
}

impl<T> std::fmt::Display for OwnedError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

/// Its source is the error's own: the message is the error's, so the error is not a link of the
/// chain by itself.
impl<T> std::error::Error for OwnedError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}
