//! The bonded transport over real TCP connections (two rails between two ranks, on loopback):
//! what the engine above sees of striped data frames.

use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::tcp;
use crate::wire::Limits;

const LIMITS: Limits = Limits { world_size: 2, eager_limit: 1024, chunk: 1 << 20, max_message: 1 << 30 };

/// The engine's part: a destination buffer per message (`seq`), the frames it was handed.
#[derive(Default)]
struct Upper {
    dest: HashMap<u64, Vec<u8>>,
    frames: Vec<Header>,
    lost: Vec<Rank>,
}

// SAFETY: the buffers are made before any frame arrives and neither moved nor dropped until the
// test ends.
unsafe impl Sink for Upper {
    fn data_dest(&mut self, _peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        let buf = self.dest.get_mut(&h.seq).ok_or(WireError::Unexpected(Kind::Data))?;
        let range = h.aux as usize..h.aux as usize + h.len as usize;
        buf.get_mut(range).map(Some).ok_or(WireError::Unexpected(Kind::Data))
    }
    fn frame(&mut self, _peer: Rank, h: Header, _payload: Bytes) {
        self.frames.push(h);
    }
    fn peer_lost(&mut self, peer: Rank, _err: TransportError) {
        self.lost.push(peer);
    }
}

/// Rank 0's and rank 1's bonded transports, joined by two TCP connections (two rails).
fn two_ranks() -> (Bonded, Bonded) {
    let mut ends: [Vec<Box<dyn Transport>>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..2 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let b = l.accept().unwrap().0;
        for (rank, stream) in [(0, a), (1, b)] {
            stream.set_nodelay(true).unwrap();
            let conns = if rank == 0 { vec![None, Some(stream)] } else { vec![Some(stream), None] };
            ends[rank].push(tcp::build(tcp::Backend::Portable, conns, LIMITS, LIMITS.eager_limit).unwrap());
        }
    }
    let [zero, one] = ends;
    let cfg = StripeConfig { threshold: 64 * 1024, part: 32 * 1024, ..StripeConfig::default() };
    let links = |me: usize| (0..2).map(|p| vec![p != me; 2]).collect::<Vec<_>>();
    (Bonded::new(0, zero, &links(0), cfg), Bonded::new(1, one, &links(1), cfg))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8).collect()
}

#[tokio::test]
async fn zero_length_data_frames_among_striped_ones_reach_the_engine_once() {
    let (mut tx, mut rx) = two_ranks();
    // Messages (by `seq`) of 0 bytes between striped ones: a rail's staging buffer holds the
    // bytes of an earlier part when a part of no bytes comes on it.
    let lens = [200_000, 0, 100_000, 0, 0, 70_000, 0, 1, 0];
    let mut up = Upper::default();
    for (seq, &len) in lens.iter().enumerate() {
        up.dest.insert(seq as u64, vec![0; len]);
    }
    let mut back = Upper::default();
    for (seq, &len) in lens.iter().enumerate() {
        let h = Header { src: 0, seq: seq as u64, len: len as u32, ..Header::new(Kind::Data) };
        tx.send(1, h, Bytes::from(pattern(len, seq as u8)));
        // Each message is acknowledged before the next: both rails took parts of the first.
        for _ in 0..10_000 {
            tx.progress(&mut back);
            rx.progress(&mut up);
            if !tx.core.busy() {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        assert!(!tx.core.busy(), "message {seq} ({len} bytes) never acknowledged");
    }
    let carried: Vec<u64> = tx.core.stats(1).iter().map(|s| s.unwrap().carried).collect();
    assert!(carried.iter().all(|&c| c > 0), "every rail carries parts: {carried:?}");
    for (seq, &len) in lens.iter().enumerate() {
        let frames: Vec<&Header> = up.frames.iter().filter(|h| h.seq == seq as u64).collect();
        let got: usize = frames.iter().map(|h| h.len as usize).sum();
        assert_eq!(got, len, "message {seq}: bytes delivered");
        if len == 0 {
            assert_eq!(frames.len(), 1, "message {seq} of 0 bytes: delivered once");
            assert_eq!((frames[0].kind, frames[0].flags & flags::RAIL_PART), (Kind::Data, 0));
        }
        assert!(up.dest[&(seq as u64)] == pattern(len, seq as u8), "message {seq}'s bytes");
    }
    assert!(up.lost.is_empty() && back.lost.is_empty());
}
