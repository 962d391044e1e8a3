//! Byte stream <-> frames, shared by both TCP backends.
//!
//! [`Reader`] is a small state machine: it says where the next bytes should land
//! ([`Reader::target`]: its own buffer, or straight into a posted receive buffer for rendezvous
//! data) and is told how many arrived ([`Reader::advance`]). It does no I/O itself, so the same code
//! serves synchronous reads and io_uring completions. [`Writer`] is the ordered output queue.
//!
//! Pushed rendezvous data (see the engine) that arrives before its receive is posted would be
//! read and dropped, and the whole message sent again after the receiver's CTS: a second transfer
//! and a round trip. That happens whenever a reply overtakes the frame that lets the caller post
//! its receive (a ping-pong's send completes on the CTS that a 1 MiB reply follows at once, and
//! one read delivers both). So a data frame the sink still hopes to match
//! ([`Sink::awaits_receive`]) is held back, unread, for up to [`HOLD_ROUNDS`] progress rounds
//! ([`Reader::held`], [`Reader::resume`]): the caller, woken by what that round delivered, can
//! post its receive in between, and the data lands in place. After that the frame is taken as
//! before (dropped if still unmatched), so a receive that never comes costs a few rounds, and a
//! peer's later frames are never stuck behind it.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Bytes, BytesMut};

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError, flags};
use crate::{Sink, TransportError};

/// Size of each connection's read buffer.
const READ_BUF: usize = 64 * 1024;
/// Most slices handed to one vectored write.
const MAX_IOVECS: usize = 64;
/// An owned payload (eager message) with at least this much still to come once the read buffer
/// is empty is read straight into its own buffer, whole: no copy out of the read buffer, and on
/// io_uring one completion (`MSG_WAITALL`) instead of a progress round per piece the kernel has
/// at hand. Below it, reading into the read buffer may take the frames behind it in the same read.
const DIRECT_OWNED: usize = 16 * 1024;
/// Progress rounds a pushed data frame without a receive yet is held back before it is taken
/// (and dropped) anyway. One round is what an inline caller needs (it looks for its completion
/// after every round); the rest covers a caller woken by another thread.
pub(crate) const HOLD_ROUNDS: u32 = 32;

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
    /// A data frame's header sits unparsed at `start`, held back for its receive: no reads until
    /// [`Reader::resume`].
    held: bool,
    /// Rounds the current data frame has been held so far.
    hold_rounds: u32,
    /// Bytes of pushed rendezvous data still to come, as announced by the last pushed RTS: the
    /// next frame is one of its data frames, so only its header is read into the read buffer
    /// (see [`Reader::target`]).
    pushed_left: u64,
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
            held: false,
            hold_rounds: 0,
            pushed_left: 0,
        }
    }

    /// A data frame is held back for its receive: the caller must not read this connection
    /// again in this progress round, and calls [`Reader::resume`] in the next one.
    pub(crate) fn held(&self) -> bool {
        self.held
    }

    /// Starts a new progress round for a held data frame: parses on, holding it once more if its
    /// receive is still missing and it has rounds left. Returns the number of frames delivered.
    pub(crate) fn resume(&mut self, sink: &mut dyn Sink) -> Result<usize, TransportError> {
        if !self.held {
            return Ok(0);
        }
        self.held = false;
        self.hold_rounds += 1;
        self.parse(sink)
    }

    /// Where the next read should land. Direct reads go into the receiver's buffer when the read
    /// buffer holds nothing more of the current data frame.
    pub(crate) fn target(&mut self, sink: &mut dyn Sink) -> Result<ReadTarget, TransportError> {
        debug_assert!(!self.held, "a held reader reads on only after resume");
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
        if let Some(want) = self.owned_direct() {
            let State::Owned { buf, .. } = &mut self.state else { unreachable!("owned_direct") };
            // The payload's buffer was allocated whole (`with_capacity(h.len)`) and is not
            // touched before `advance`: its spare capacity stays put for the read.
            let spare = buf.spare_capacity_mut();
            debug_assert!(spare.len() >= want);
            return Ok(ReadTarget { ptr: spare.as_mut_ptr().cast(), len: want, whole: true });
        }
        // What parsing leaves in the buffer is less than a header: moved to the front when less
        // than a header's room is left behind it.
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < HEADER_LEN {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        // Between the data frames of a pushed message: just the next header (its sender writes
        // them back to back), so that the frame's data lands in place, not in the read buffer
        // to be copied from there. The reads per frame stay two: header, then data.
        let header_due = HEADER_LEN.saturating_sub(self.end - self.start);
        if self.pushed_left > 0 && matches!(self.state, State::Header) && header_due > 0 {
            let at = &mut self.buf[self.end..self.end + header_due];
            return Ok(ReadTarget { ptr: at.as_mut_ptr(), len: header_due, whole: true });
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
        } else if let Some(want) = self.owned_direct() {
            let State::Owned { buf, .. } = &mut self.state else { unreachable!("owned_direct") };
            assert!(n <= want, "a read returned more than its target");
            // SAFETY: the last target was this spare capacity (`owned_direct` said so then, and
            // nothing changed since), and the read initialised its first `n` bytes.
            unsafe { buf.set_len(buf.len() + n) };
        } else {
            self.end += n;
        }
        self.parse(sink)
    }

    /// The bytes still due for the owned payload being read, when they are read straight into
    /// its buffer (the read buffer holds none of them, and they are at least [`DIRECT_OWNED`]).
    fn owned_direct(&self) -> Option<usize> {
        match &self.state {
            State::Owned { h, buf } if self.start == self.end => {
                Some(h.len as usize - buf.len()).filter(|&want| want >= DIRECT_OWNED)
            }
            _ => None,
        }
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
                    if h.kind == Kind::Data && h.len > 0 {
                        if self.hold_rounds < HOLD_ROUNDS && sink.awaits_receive(self.peer, &h) {
                            self.held = true;
                            return Ok(delivered);
                        }
                        self.hold_rounds = 0;
                    }
                    // A read-size hint only: a peer that breaks the pushing rules is caught by
                    // the sink's checks of its frames, not here.
                    if h.flags & flags::PUSH != 0 {
                        self.pushed_left = match h.kind {
                            Kind::Rts => h.aux,
                            Kind::Data => self.pushed_left.saturating_sub(u64::from(h.len)),
                            _ => self.pushed_left,
                        };
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

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { world_size: 2, eager_limit: 64, chunk: 4096, max_message: 1 << 20 };

    /// A sink with one pushed message (id 7) from rank 1 whose receive is posted once `posted`
    /// is set; records what it is given.
    #[derive(Default)]
    struct OneReceive {
        posted: bool,
        buf: Vec<u8>,
        frames: Vec<Kind>,
        asked_for_dest: usize,
    }

    // SAFETY: `buf` is neither moved nor resized while a test reads into it.
    unsafe impl Sink for OneReceive {
        fn data_dest(&mut self, _: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
            self.asked_for_dest += 1;
            let (at, len) = (h.aux as usize, h.len as usize);
            Ok(self.posted.then(|| &mut self.buf[at..at + len]))
        }
        fn awaits_receive(&mut self, _: Rank, h: &Header) -> bool {
            h.flags & flags::PUSH != 0 && h.aux == 0 && !self.posted
        }
        fn frame(&mut self, _: Rank, h: Header, _: Bytes) {
            self.frames.push(h.kind);
        }
        fn peer_lost(&mut self, _: Rank, _: TransportError) {}
    }

    /// A CTS, then the pushed message's one data frame (`data`), as one stream.
    fn cts_then_pushed(data: &[u8]) -> Vec<u8> {
        let cts = Header { src: 1, ..Header::new(Kind::Cts) };
        let d = Header { src: 1, seq: 7, len: data.len() as u32, flags: flags::PUSH, ..Header::new(Kind::Data) };
        let mut v = cts.encode().to_vec();
        v.extend_from_slice(&d.encode());
        v.extend_from_slice(data);
        v
    }

    /// [`cts_then_pushed`] of `data`, a sink whose receive (of `data`'s length) is not posted
    /// yet, and a fresh reader.
    fn pushed_to_a_late_receive(data: &[u8]) -> (Vec<u8>, OneReceive, Reader) {
        let sink = OneReceive { buf: vec![0; data.len()], ..Default::default() };
        (cts_then_pushed(data), sink, Reader::new(1, LIMITS))
    }

    /// One read of `bytes` into the reader's target, as a socket read would; returns how many
    /// bytes it took and the frames delivered.
    fn read(r: &mut Reader, bytes: &[u8], sink: &mut OneReceive) -> (usize, usize) {
        let t = r.target(sink).unwrap();
        let n = put(&t, bytes);
        (n, r.advance(n, sink).unwrap())
    }

    /// Copies as much of `bytes` as fits to read target `t`, as a socket read would; returns how
    /// many bytes that was.
    fn put(t: &ReadTarget, bytes: &[u8]) -> usize {
        let n = t.len.min(bytes.len());
        // SAFETY: a target (taken from the reader just before, with nothing in between) is valid
        // for `t.len` bytes, and it does not overlap `bytes`, the test's own memory.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.ptr, n) };
        n
    }

    #[test]
    fn a_pushed_frame_waits_for_the_receive_posted_after_the_frame_before_it() {
        let data: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let (stream, mut sink, mut r) = pushed_to_a_late_receive(&data);
        let (n, frames) = read(&mut r, &stream, &mut sink);
        assert_eq!((n, frames), (stream.len(), 1), "the CTS is delivered");
        assert!(r.held(), "the data waits, unread");
        assert_eq!(sink.asked_for_dest, 0, "no destination asked for, so nothing is dropped");
        // The caller, woken by the CTS, posts its receive; the next round lands the data in place.
        sink.posted = true;
        assert_eq!(r.resume(&mut sink).unwrap(), 1);
        assert!(!r.held());
        assert_eq!(sink.frames, [Kind::Cts, Kind::Data]);
        assert_eq!(sink.buf, data);
    }

    #[test]
    fn a_pushed_frame_whose_receive_never_comes_is_taken_after_the_hold() {
        let data = [5u8; 100];
        let (stream, mut sink, mut r) = pushed_to_a_late_receive(&data);
        read(&mut r, &stream, &mut sink);
        for _ in 1..HOLD_ROUNDS {
            assert_eq!(r.resume(&mut sink).unwrap(), 0);
            assert!(r.held());
        }
        // The last round takes it: dropped (no receive), delivered as a frame all the same.
        assert_eq!(r.resume(&mut sink).unwrap(), 1);
        assert!(!r.held());
        assert_eq!(sink.frames, [Kind::Cts, Kind::Data]);
        assert_eq!(sink.buf, [0; 100]);
        let (_, frames) = read(&mut r, &cts_then_pushed(&data), &mut sink);
        assert_eq!(frames, 1);
        assert!(r.held(), "a later message gets its own hold");
    }

    /// A sink that keeps the whole frames it is given.
    #[derive(Default)]
    struct Frames(Vec<(Header, Bytes)>);

    // SAFETY: it hands out no destinations.
    unsafe impl Sink for Frames {
        fn data_dest(&mut self, _: Rank, _: &Header) -> Result<Option<&mut [u8]>, WireError> {
            Ok(None)
        }
        fn frame(&mut self, _: Rank, h: Header, payload: Bytes) {
            self.0.push((h, payload));
        }
        fn peer_lost(&mut self, _: Rank, _: TransportError) {}
    }

    #[test]
    fn a_large_owned_payload_is_read_straight_into_its_buffer_whole() {
        let limits = Limits { eager_limit: 64 * 1024, ..LIMITS };
        let payload: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
        let h = Header { src: 1, tag: 3, len: payload.len() as u32, ..Header::new(Kind::Eager) };
        let small = Header { src: 1, tag: 4, len: 5, ..Header::new(Kind::Eager) };
        let mut stream = h.encode().to_vec();
        stream.extend_from_slice(&payload);
        stream.extend_from_slice(&small.encode());
        stream.extend_from_slice(b"after");
        let mut sink = Frames::default();
        let mut r = Reader::new(1, limits);
        // The first read brings the header and part of the payload into the read buffer.
        let first = HEADER_LEN + 10_000;
        let t = r.target(&mut sink).unwrap();
        assert!(!t.whole && t.len >= first);
        assert_eq!(put(&t, &stream[..first]), first);
        assert_eq!(r.advance(first, &mut sink).unwrap(), 0);
        // The rest goes straight to the payload's buffer, asked for whole, in two pieces here.
        let t = r.target(&mut sink).unwrap();
        assert_eq!((t.len, t.whole), (30_000, true));
        assert_eq!(put(&t, &stream[first..first + 12_000]), 12_000);
        assert_eq!(r.advance(12_000, &mut sink).unwrap(), 0);
        let t = r.target(&mut sink).unwrap();
        assert_eq!((t.len, t.whole), (18_000, true));
        assert_eq!(put(&t, &stream[first + 12_000..]), 18_000);
        assert_eq!(r.advance(18_000, &mut sink).unwrap(), 1);
        // Then reads go to the read buffer again.
        let rest = &stream[HEADER_LEN + payload.len()..];
        let t = r.target(&mut sink).unwrap();
        assert!(!t.whole && t.len >= rest.len());
        assert_eq!(put(&t, rest), rest.len());
        assert_eq!(r.advance(rest.len(), &mut sink).unwrap(), 1);
        assert_eq!(sink.0.len(), 2);
        assert_eq!((sink.0[0].0.tag, &sink.0[0].1[..]), (3, &payload[..]));
        assert_eq!((sink.0[1].0.tag, &sink.0[1].1[..]), (4, &b"after"[..]));
    }

    #[test]
    fn between_the_frames_of_a_pushed_message_only_the_next_header_is_read() {
        let data: Vec<u8> = (0..6000u32).map(|i| (i * 13) as u8).collect();
        let rts = Header { src: 1, seq: 7, aux: data.len() as u64, flags: flags::PUSH, ..Header::new(Kind::Rts) };
        let chunk = |at: usize| Header {
            src: 1,
            seq: 7,
            aux: at as u64,
            len: 3000,
            flags: flags::PUSH,
            ..Header::new(Kind::Data)
        };
        let mut stream = rts.encode().to_vec();
        for at in [0, 3000] {
            stream.extend_from_slice(&chunk(at).encode());
            stream.extend_from_slice(&data[at..at + 3000]);
        }
        let after = Header { src: 1, ..Header::new(Kind::Credit) };
        stream.extend_from_slice(&after.encode());
        let mut sink = OneReceive { posted: true, buf: vec![0; data.len()], ..Default::default() };
        let mut r = Reader::new(1, LIMITS);
        let mut at = 0usize;
        let mut step = |r: &mut Reader, sink: &mut OneReceive, most: usize| {
            let t = r.target(sink).unwrap();
            let n = put(&t, &stream[at..at.saturating_add(most).min(stream.len())]);
            at += n;
            r.advance(n, sink).unwrap();
            (t.len, t.whole)
        };
        // The RTS, the first data header and a little data come through the read buffer.
        assert!(!step(&mut r, &mut sink, 2 * HEADER_LEN + 100).1);
        assert_eq!(step(&mut r, &mut sink, usize::MAX), (2900, true), "the rest of the first chunk, in place");
        assert_eq!(step(&mut r, &mut sink, usize::MAX), (HEADER_LEN, true), "then the next header alone");
        assert_eq!(step(&mut r, &mut sink, usize::MAX), (3000, true), "the whole second chunk, in place");
        let (len, whole) = step(&mut r, &mut sink, usize::MAX);
        assert!(len > HEADER_LEN && !whole, "the message is in: reads fill the buffer again");
        assert_eq!(at, stream.len());
        assert_eq!(sink.buf, data);
        assert_eq!(sink.frames, [Kind::Rts, Kind::Data, Kind::Data, Kind::Credit]);
    }

    #[test]
    fn a_pushed_header_cut_at_the_end_of_the_read_buffer_is_completed_at_its_front() {
        let limits = Limits { max_message: 1 << 20, ..LIMITS };
        // 16 chunks of 4000 B, one of 657 and one of 100: the first read (65531 B, five short of
        // the buffer) ends 10 bytes into the last chunk's header.
        let sizes = [[4000; 16].as_slice(), &[657, 100]].concat();
        let total: usize = sizes.iter().sum();
        let data: Vec<u8> = (0..total as u32).map(|i| (i * 31) as u8).collect();
        let rts = Header { src: 1, seq: 7, aux: total as u64, flags: flags::PUSH, ..Header::new(Kind::Rts) };
        let mut stream = rts.encode().to_vec();
        let mut at = 0;
        for &len in &sizes {
            let d = Header {
                src: 1,
                seq: 7,
                aux: at as u64,
                len: len as u32,
                flags: flags::PUSH,
                ..Header::new(Kind::Data)
            };
            stream.extend_from_slice(&d.encode());
            stream.extend_from_slice(&data[at..at + len]);
            at += len;
        }
        let mut sink = OneReceive { posted: true, buf: vec![0; total], ..Default::default() };
        let mut r = Reader::new(1, limits);
        let first = READ_BUF - 5;
        assert_eq!(first, HEADER_LEN + 16 * (HEADER_LEN + 4000) + HEADER_LEN + 657 + 10);
        let (n, frames) = read(&mut r, &stream[..first], &mut sink);
        assert_eq!((n, frames), (first, 1 + 17));
        let t = r.target(&mut sink).unwrap();
        assert_eq!((t.len, t.whole), (HEADER_LEN - 10, true), "the header's missing bytes");
        let n = put(&t, &stream[first..]);
        assert_eq!(r.advance(n, &mut sink).unwrap(), 0);
        let (n, frames) = read(&mut r, &stream[first + HEADER_LEN - 10..], &mut sink);
        assert_eq!((n, frames), (100, 1));
        assert_eq!(sink.buf, data);
    }

    #[test]
    fn a_pushed_frame_split_across_reads_is_held_only_once_its_header_is_in() {
        let data = [9u8; 64];
        let (stream, mut sink, mut r) = pushed_to_a_late_receive(&data);
        // The CTS and half of the data frame's header.
        let (n, frames) = read(&mut r, &stream[..HEADER_LEN + HEADER_LEN / 2], &mut sink);
        assert_eq!((n, frames), (HEADER_LEN + HEADER_LEN / 2, 1));
        assert!(!r.held());
        let (_, frames) = read(&mut r, &stream[n..], &mut sink);
        assert_eq!(frames, 0);
        assert!(r.held());
        sink.posted = true;
        assert_eq!(r.resume(&mut sink).unwrap(), 1);
        assert_eq!(sink.buf, data);
    }
}
