//! What the transport tests share: deterministic payloads, the frames built from them, a
//! connected loopback socket pair, and a sink that records what a transport delivers.

// Each test crate uses part of this module.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};

use bytes::Bytes;
use ferrocomm_transports::{Header, Kind, Rank, Sink, TransportError, WireError};

/// A `Data` frame with this `seq` is discarded by [`TestSink`] (`data_dest` -> `None`).
pub(crate) const DISCARD: u64 = u64::MAX;
/// A `Data` frame with this `seq` is refused by [`TestSink`] (`data_dest` -> `Err`).
pub(crate) const REFUSE: u64 = u64::MAX - 1;

/// `len` pseudo-random bytes determined by `seed` (xorshift), so that a misplaced or mixed-up
/// byte shows.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An `Eager` frame from `src` with tag `tag` and `len` bytes of `pattern(tag, len)`.
pub(crate) fn eager(src: Rank, tag: u64, len: usize) -> (Header, Bytes) {
    let h = Header { src, tag, len: len as u32, ..Header::new(Kind::Eager) };
    (h, Bytes::from(pattern(tag, len)))
}

/// A `Data` frame from `src` for receiver operation `seq`, at byte `offset`, with `len` bytes of
/// `pattern(seq, len)`.
pub(crate) fn data(src: Rank, seq: u64, offset: usize, len: usize) -> (Header, Bytes) {
    let h = Header { src, seq, aux: offset as u64, len: len as u32, ..Header::new(Kind::Data) };
    (h, Bytes::from(pattern(seq, len)))
}

/// Checks that `frames` (as a sink recorded them) are exactly `sent`, from `from`, in order: each
/// header, each non-`Data` payload, and, through `landed(i, header, want)`, where each `Data` frame
/// not discarded wrote its bytes (`Data` frames carry no payload of their own).
pub(crate) fn check_frames(
    frames: &[(Rank, Header, Bytes)],
    from: Rank,
    sent: &[(Header, Bytes)],
    landed: impl Fn(usize, &Header, &[u8]) -> bool,
) {
    assert_eq!(frames.len(), sent.len(), "frame count");
    for (i, ((peer, h, payload), (want_h, want_p))) in frames.iter().zip(sent).enumerate() {
        assert_eq!(*peer, from, "frame {i}: peer");
        assert_eq!(h, want_h, "frame {i}: header");
        if h.kind == Kind::Data {
            assert!(payload.is_empty(), "frame {i}: data frames carry no payload");
            if h.seq != DISCARD {
                assert!(landed(i, h, want_p), "frame {i}: data content");
            }
        } else {
            assert!(payload == want_p, "frame {i}: payload content");
        }
    }
}

/// Two connected loopback TCP sockets, with Nagle off.
pub(crate) fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

/// Records frames and losses; `Data` payloads land in `data` at offset `h.aux` (a range beyond
/// it is refused as oversize), except for the `seq`s [`DISCARD`] and [`REFUSE`].
#[derive(Default)]
pub(crate) struct TestSink {
    pub(crate) frames: Vec<(Rank, Header, Bytes)>,
    pub(crate) lost: Vec<(Rank, TransportError)>,
    pub(crate) data: Vec<u8>,
}

impl TestSink {
    /// A sink whose `Data` frames land in `data_len` zero bytes.
    pub(crate) fn with_data(data_len: usize) -> TestSink {
        TestSink { data: vec![0; data_len], ..TestSink::default() }
    }
}

// SAFETY: `data` is sized before any transfer and never resized or touched by a test while a
// transport that may write into it is alive (every test drops its transports before their sinks).
unsafe impl Sink for TestSink {
    fn data_dest(&mut self, _peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        match h.seq {
            DISCARD => Ok(None),
            REFUSE => Err(WireError::Unexpected(Kind::Data)),
            _ => {
                let end = h.aux as usize + h.len as usize;
                if end > self.data.len() {
                    return Err(WireError::Oversize { kind: Kind::Data, len: end as u64, max: self.data.len() as u64 });
                }
                Ok(Some(&mut self.data[h.aux as usize..end]))
            }
        }
    }
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        self.frames.push((peer, h, payload));
    }
    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        self.lost.push((peer, err));
    }
}
