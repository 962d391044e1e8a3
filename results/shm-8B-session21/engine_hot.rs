//! EXPERIMENT (not committed): the engine's receive and send paths in a hot loop.
use bytes::BytesMut;
use ferrocomm::p2p::engine::{Completion, Config, Engine, RecvBuf};
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm::transports::{Header, Kind};
use std::time::Instant;

fn main() {
    let cfg = Config { eager_limit: 64 << 10, max_credit: 1 << 30, credit_sync: 16, chunk: 512 << 10, max_message: 1 << 20 };
    let mut e = Engine::new(0, 2, cfg);
    let mut buf = Some(BytesMut::zeroed(8));
    let payload = [7u8; 8];
    let n = 20_000_000u64;
    let mode = std::env::args().nth(1).unwrap_or_default();
    for round in 0..3 {
        let t = Instant::now();
        let mut credit = 0u32;
        for i in 0..n {
            e.post_recv(1, 0, Source::Rank(1), TagMatch::Exact(7), RecvBuf::User(buf.take().unwrap()));
            // The peer's frame, with the credit it would piggyback.
            let h = Header { src: 1, tag: 7, len: 8, credit, seq: i, ..Header::new(Kind::Eager) };
            e.handle_frame_ref(1, h, &payload);
            match e.poll_event() {
                Some((1, Completion::Recv(Ok((p, _))))) => buf = Some(p.into_bytes_mut()),
                other => panic!("{other:?}"),
            }
            if mode == "recv" { while e.poll_transmit().is_some() {} continue; }
            // Our reply, as the driver sends it.
            let r = e.send_now_via(1, 0, 7, &payload[..], |_, h, _| credit = h.credit.wrapping_add(0));
            assert!(r.is_ok(), "iteration {i}");
            credit = (i + 1) as u32; // the peer has freed all we sent
            while e.poll_transmit().is_some() {}
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("round {round}: {ns:.1} ns per receive + reply through the engine");
    }
}
