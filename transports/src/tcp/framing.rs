//! Byte stream <-> frames, shared by both TCP backends.
//!
//! [`Reader`] is a small state machine: it says where the next bytes should land
//! ([`Reader::target`]: its own buffer, or straight into a posted receive buffer for rendezvous
//! data) and is told how many arrived ([`Reader::advance`]). It does no I/O itself, so the same code
//! serves synchronous reads and io_uring completions. [`Writer`] is the ordered output queue.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Bytes, BytesMut};

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError};
use crate::{Sink, TransportError};

/// Size of each connection's read buffer.
const READ_BUF: usize = 64 * 1024;
/// Largest payload copied out of the read buffer before switching to direct reads.
const MAX_IOVECS: usize = 64;

enum State {
    /// Waiting for (the rest of) a header.
    Header,
    /// Reading an owned payload (eager, hello).
    Owned { h: Header, buf: BytesMut },
    /// Reading rendezvous data into the sink's destination; `got` bytes are in.
    Direct { h: Header, got: usize, discard: bool },
}

/// Where the next read must put its bytes.
pub(crate) struct ReadTarget {
    pub ptr: *mut u8,
    pub len: usize,
    /// The bytes belong to the current data frame, all of them due: a completion-based backend
    /// may wait for the whole target (`MSG_WAITALL`) instead of taking it piece by piece.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub whole: bool,
}

/// Parses one connection's byte stream into frames.
pub(crate) struct Reader {
    peer: Rank,
    limits: Limits,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    state: State,
    scratch: Box<[u8]>,
}

impl Reader {
    pub(crate) fn new(peer: Rank, limits: Limits) -> Reader {
        Reader {
            peer,
            limits,
            buf: vec![0; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            state: State::Header,
            scratch: Box::new([]),
        }
    }

    /// Where the next read should land. Direct reads go into the receiver's buffer when the read
    /// buffer holds nothing more of the current data frame.
    pub(crate) fn target(&mut self, sink: &mut dyn Sink) -> Result<ReadTarget, TransportError> {
        if let State::Direct { h, got, discard } = &self.state
            && self.start == self.end
        {
            let (h, got, discard) = (*h, *got, *discard);
            let want = h.len as usize - got;
            if discard {
                if self.scratch.is_empty() {
                    self.scratch = vec![0; READ_BUF].into_boxed_slice();
                }
                let n = want.min(self.scratch.len());
                return Ok(ReadTarget { ptr: self.scratch.as_mut_ptr(), len: n, whole: true });
            }
            let dest = sink.data_dest(self.peer, &h)?.ok_or(WireError::Unexpected(Kind::Data))?;
            return Ok(ReadTarget { ptr: dest[got..].as_mut_ptr(), len: want, whole: true });
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        Ok(ReadTarget { ptr: self.buf[self.end..].as_mut_ptr(), len: self.buf.len() - self.end, whole: false })
    }

    /// Accounts `n` bytes that arrived at the last [`Reader::target`], and delivers every frame
    /// they complete. Returns the number of frames delivered.
    pub(crate) fn advance(&mut self, n: usize, sink: &mut dyn Sink) -> Result<usize, TransportError> {
        if let State::Direct { got, .. } = &mut self.state
            && self.start == self.end
        {
            *got += n;
        } else {
            self.end += n;
        }
        self.parse(sink)
    }

    fn parse(&mut self, sink: &mut dyn Sink) -> Result<usize, TransportError> {
        let mut delivered = 0;
        loop {
            let avail = self.end - self.start;
            match &mut self.state {
                State::Header => {
                    if avail < HEADER_LEN {
                        return Ok(delivered);
                    }
                    let raw: &[u8; HEADER_LEN] = self.buf[self.start..self.start + HEADER_LEN].try_into().unwrap();
                    let h = Header::decode(raw, &self.limits)?;
                    if h.src != self.peer {
                        return Err(WireError::WrongSource { expected: self.peer, got: h.src }.into());
                    }
                    self.start += HEADER_LEN;
                    self.state = match h.kind {
                        _ if h.len == 0 => {
                            sink.frame(self.peer, h, Bytes::new());
                            delivered += 1;
                            State::Header
                        }
                        Kind::Data => {
                            let discard = sink.data_dest(self.peer, &h)?.is_none();
                            State::Direct { h, got: 0, discard }
                        }
                        _ => State::Owned { h, buf: BytesMut::with_capacity(h.len as usize) },
                    };
                }
                State::Owned { h, buf } => {
                    let take = avail.min(h.len as usize - buf.len());
                    buf.extend_from_slice(&self.buf[self.start..self.start + take]);
                    self.start += take;
                    if buf.len() < h.len as usize {
                        return Ok(delivered);
                    }
                    let (h, payload) = (*h, std::mem::take(buf).freeze());
                    self.state = State::Header;
                    sink.frame(self.peer, h, payload);
                    delivered += 1;
                }
                State::Direct { h, got, discard } => {
                    let take = avail.min(h.len as usize - *got);
                    if take > 0 && !*discard {
                        let dest = sink.data_dest(self.peer, h)?.ok_or(WireError::Unexpected(Kind::Data))?;
                        dest[*got..*got + take].copy_from_slice(&self.buf[self.start..self.start + take]);
                    }
                    *got += take;
                    self.start += take;
                    if *got < h.len as usize {
                        return Ok(delivered);
                    }
                    let h = *h;
                    self.state = State::Header;
                    sink.frame(self.peer, h, Bytes::new());
                    delivered += 1;
                }
            }
        }
    }
}

struct Item {
    header: [u8; HEADER_LEN],
    payload: Bytes,
}

/// One connection's ordered output queue; `sent` bytes of the front item are already written.
#[derive(Default)]
pub(crate) struct Writer {
    queue: VecDeque<Item>,
    sent: usize,
}

impl Writer {
    pub(crate) fn push(&mut self, h: &Header, payload: Bytes) {
        self.queue.push_back(Item { header: h.encode(), payload });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The unsent bytes as I/O slices, at most [`MAX_IOVECS`] of them.
    pub(crate) fn slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>) {
        self.each_slice(MAX_IOVECS, |s| out.push(IoSlice::new(s)));
    }

    /// Calls `f` on each unsent, non-empty run of bytes, in order, at most `max` times.
    pub(crate) fn each_slice<'a>(&'a self, max: usize, mut f: impl FnMut(&'a [u8])) {
        let mut skip = self.sent;
        let mut count = 0;
        for item in &self.queue {
            for part in [&item.header[..], &item.payload[..]] {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                f(&part[skip..]);
                skip = 0;
                count += 1;
                if count == max {
                    return;
                }
            }
        }
    }

    /// Moves up to `max` frames from the front of this queue to the (empty) `to`, together with
    /// the count of already written bytes. A completion-based backend sends from `to`, whose
    /// memory stays put while the kernel reads it, and hands the unsent rest back with
    /// [`Writer::put_back`].
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn move_front(&mut self, max: usize, to: &mut Writer) {
        debug_assert!(to.is_empty());
        let n = max.min(self.queue.len());
        to.queue.extend(self.queue.drain(..n));
        to.sent = std::mem::take(&mut self.sent);
    }

    /// Puts the frames left in `from` back at the front of this queue, in order (the inverse of
    /// [`Writer::move_front`]; nothing may have been moved out since).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn put_back(&mut self, from: &mut Writer) {
        if from.is_empty() {
            return;
        }
        debug_assert_eq!(self.sent, 0);
        while let Some(item) = from.queue.pop_back() {
            self.queue.push_front(item);
        }
        self.sent = std::mem::take(&mut from.sent);
    }

    /// Drops `n` written bytes from the front.
    pub(crate) fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let front = &self.queue[0];
            let left = HEADER_LEN + front.payload.len() - self.sent;
            if n < left {
                self.sent += n;
                return;
            }
            n -= left;
            self.sent = 0;
            self.queue.pop_front();
        }
    }
}
