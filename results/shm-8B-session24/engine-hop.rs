//! The protocol engine's cost per 8 B hop on one core, without transport, reactor or futures: two
//! engines (completing into the operation slab, as the driver's) hand each other eager frames.
//! Each iteration posts the receive (untimed), then times the send (`send_now_via`), the frame's
//! arrival (`frame_ref`) and the completion's take from the slab, by the cycle counter.
//! Run as an example of the root crate: `cp engine-hop.rs ../../examples/ && cargo run --release
//! --example engine-hop` (then remove it again), pinned: `taskset -c 1 target/release/examples/engine-hop`.
use std::arch::x86_64::_rdtsc;
use std::task::Poll;

use bytes::BytesMut;
use ferrocomm::p2p::engine::{Completion, Config, Engine, RecvBuf};
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm::transports::{Header, Sink};
use ferrocomm_reactor::Ops;

type E = Engine<Ops<Completion>>;

fn main() {
    let cfg = Config { eager_limit: 64 << 10, max_credit: 32, credit_sync: 16, chunk: 512 << 10, max_message: 1 << 20 };
    let mut e: [E; 2] = [Engine::with_completions(0, 2, cfg), Engine::with_completions(1, 2, cfg)];
    let mut bufs = [Some(BytesMut::zeroed(8)), Some(BytesMut::zeroed(8))];
    let data = [7u8; 8];
    let n = 10_000_000u64;
    for round in 0..3 {
        let (mut hop, mut empty) = (0u64, 0u64);
        for i in 0..n {
            let (me, peer) = ((i & 1) as usize, 1 - (i & 1) as usize);
            let b = bufs[peer].take().unwrap();
            let key = e[peer].completions().insert();
            e[peer].post_recv(key, 0, Source::Rank(me as u32), TagMatch::Exact(7), RecvBuf::User(b));
            let t0 = unsafe { _rdtsc() };
            let t1 = unsafe { _rdtsc() };
            let mut frame: Option<Header> = None;
            let r = e[me].send_now_via(peer as u32, 0, 7, &data[..], |_, h, _| frame = Some(h));
            assert!(matches!(r, Ok(Ok(()))));
            let h = std::hint::black_box(frame.unwrap());
            let (lo, hi) = e.split_at_mut(1);
            let pe = if peer == 0 { &mut lo[0] } else { &mut hi[0] };
            pe.frame_ref(me as u32, h, std::hint::black_box(&data[..]));
            match pe.completions().poll(key, None) {
                Poll::Ready(Completion::Recv(Ok((p, _)))) => bufs[peer] = Some(std::hint::black_box(p).into_bytes_mut()),
                _ => panic!(),
            }
            let t2 = unsafe { _rdtsc() };
            hop += t2 - t1;
            empty += t1 - t0;
        }
        println!("round {round}: send + receive {:.1} ticks per hop, of which an empty stamp pair {:.1}", hop as f64 / n as f64, empty as f64 / n as f64);
    }
}
