//! The TCP byte-stream parser (`transports/src/tcp/framing.rs`), fed as a socket would feed it:
//! a stream of valid frames followed by arbitrary bytes, cut into arbitrary reads. The valid
//! frames must come out exactly as they went in whatever the cuts; whatever follows must give
//! frames within the limits or a typed error, never a panic, a read of zero bytes, or a payload
//! larger than the limits allow.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use ferrocomm_transports::fuzzing::StreamReader;
use ferrocomm_transports::wire::{Header, Kind, Limits, Rank, WireError};
use ferrocomm_transports::{Sink, TransportError};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Frame {
    kind: u8,
    flags: u16,
    context: u32,
    tag: u64,
    seq: u64,
    credit: u32,
    aux: u64,
    len: u16,
    fill: u8,
}

#[derive(Arbitrary, Debug)]
struct Input {
    world: u8,
    peer: u8,
    eager: u16,
    chunk: u16,
    max_message: u32,
    frames: Vec<Frame>,
    garbage: Vec<u8>,
    reads: Vec<u16>,
}

/// What the sink does with a data frame, chosen by its `seq`: a destination, discard, refuse.
fn data_mode(h: &Header) -> u64 {
    h.seq % 3
}

#[derive(Default)]
struct Recorder {
    limits: Option<Limits>,
    peer: Rank,
    frames: Vec<(Header, Vec<u8>)>,
    /// The destination of the data frame being read (asked for again on every read).
    dest: Option<(Header, Vec<u8>)>,
}

// SAFETY: the destination handed out lives in `self.dest` until the frame is delivered (the
// parser asks for the same frame's destination again and gets the same buffer).
unsafe impl Sink for Recorder {
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        assert_eq!(peer, self.peer);
        match data_mode(h) {
            0 => {
                if self.dest.as_ref().is_none_or(|(d, _)| d != h) {
                    self.dest = Some((*h, vec![0; h.len as usize]));
                }
                Ok(Some(&mut self.dest.as_mut().unwrap().1[..]))
            }
            1 => Ok(None),
            _ => Err(WireError::Unexpected(Kind::Data)),
        }
    }

    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        let limits = self.limits.unwrap();
        assert_eq!(peer, self.peer);
        assert_eq!(h.src, self.peer, "a frame from another source than the connection's");
        assert!(h.len as usize <= limits.max_payload(h.kind));
        let payload = if h.kind == Kind::Data {
            assert!(payload.is_empty(), "data lands in the destination");
            match self.dest.take() {
                Some((d, buf)) if d == h => buf,
                _ => Vec::new(),
            }
        } else {
            assert_eq!(payload.len(), h.len as usize);
            payload.to_vec()
        };
        self.frames.push((h, payload));
    }

    fn peer_lost(&mut self, _: Rank, _: TransportError) {
        panic!("the parser does not report losses itself");
    }
}

fuzz_target!(|input: Input| {
    let world = u32::from(input.world % 8) + 1;
    let peer = u32::from(input.peer) % world;
    let limits = Limits {
        world_size: world,
        eager_limit: usize::from(input.eager % 2048),
        chunk: usize::from(input.chunk % 4096) + 1,
        max_message: (input.max_message % (1 << 20)) as usize,
    };

    // The valid part of the stream, and what the sink must see of it.
    let mut stream = Vec::new();
    let mut expect = Vec::new();
    let mut refused = false;
    for f in &input.frames {
        let kind = match f.kind % 7 {
            0 => Kind::Hello,
            1 => Kind::Eager,
            2 => Kind::Rts,
            3 => Kind::Cts,
            4 => Kind::Data,
            5 => Kind::Credit,
            _ => Kind::Bye,
        };
        let len = usize::from(f.len).min(limits.max_payload(kind)) as u32;
        let aux = if kind == Kind::Rts { f.aux % (limits.max_message as u64 + 1) } else { f.aux };
        let h = Header {
            kind,
            flags: f.flags,
            src: peer,
            context: f.context,
            tag: f.tag,
            seq: f.seq,
            len,
            credit: f.credit,
            aux,
        };
        let payload = vec![f.fill; len as usize];
        stream.extend_from_slice(&h.encode());
        stream.extend_from_slice(&payload);
        refused = kind == Kind::Data && len > 0 && data_mode(&h) == 2;
        if refused {
            break;
        }
        let seen = if kind == Kind::Data && data_mode(&h) == 1 { Vec::new() } else { payload };
        expect.push((h, seen));
    }
    let valid = expect.len();
    stream.extend_from_slice(&input.garbage);

    let mut reader = StreamReader::new(peer, limits);
    let mut sink = Recorder { limits: Some(limits), peer, ..Recorder::default() };
    let mut at = 0;
    let mut reads = input.reads.iter().cycle();
    let mut failed = None;
    while at < stream.len() {
        let want = reads.next().map_or(usize::MAX, |&r| usize::from(r).max(1));
        let end = stream.len().min(at.saturating_add(want));
        match reader.read(&stream[at..end], &mut sink) {
            Ok(n) => {
                assert!(n > 0, "the parser asked for a read of zero bytes");
                at += n;
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if refused {
        // The refused data frame ends the valid part, and the connection.
        assert!(failed.is_some(), "a refused data frame did not fail the connection");
        assert_eq!(sink.frames.len(), valid);
    } else {
        assert!(sink.frames.len() >= valid, "valid frames lost: {failed:?}");
    }
    assert_eq!(sink.frames[..valid], expect[..], "valid frames changed on the way");
});
