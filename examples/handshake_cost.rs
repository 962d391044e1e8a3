//! What authentication costs, on loopback: the key-value store's connect (TCP connect, handshake,
//! accepted) and a peers' TCP connection (connect, `handshake_connect` / `handshake_accept`),
//! median and 10th/90th percentiles of N sequential connections; and the multicast datagram tag
//! (sealing and opening a default-size datagram).
//!
//! `cargo run --release --example handshake_cost`
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::kv::{KvClient, KvServer};
use ferrocomm_transports::auth::{JobSecret, TAG_LEN};
use ferrocomm_transports::tcp::{handshake_accept, handshake_connect};
use ferrocomm_transports::wire::Limits;
use tokio::net::{TcpListener, TcpStream};

const N: usize = 2000;

fn report(what: &str, mut t: Vec<Duration>) {
    t.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (median, p10, p90) = (us(t[t.len() / 2]), us(t[t.len() / 10]), us(t[t.len() * 9 / 10]));
    println!("{what}: median {median:.1} us, p10 {p10:.1} us, p90 {p90:.1} us ({} connections)", t.len());
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let token = [3u8; 32];
    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), token).await.unwrap();
    let addr = store.addr().to_string();
    let mut t = Vec::with_capacity(N);
    for _ in 0..N {
        let start = Instant::now();
        let c = KvClient::connect(&addr, &token, Duration::from_secs(5)).await.unwrap();
        t.push(start.elapsed());
        drop(c);
    }
    report("store connect", t);

    let limits = Limits { world_size: 2, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 };
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    let acceptor = tokio::spawn(async move {
        for _ in 0..N {
            let (mut s, _) = l.accept().await.unwrap();
            handshake_accept(&mut s, 0, &token, &limits).await.unwrap();
        }
    });
    let mut t = Vec::with_capacity(N);
    for _ in 0..N {
        let start = Instant::now();
        let mut s = TcpStream::connect(a).await.unwrap();
        s.set_nodelay(true).unwrap();
        handshake_connect(&mut s, 1, 0, &token, &limits).await.unwrap();
        t.push(start.elapsed());
    }
    acceptor.await.unwrap();
    report("peer connect", t);

    // The default 1400-byte datagram: 1384 bytes from the protocol core, then the tag.
    let key = JobSecret::new(token).datagram_key();
    let datagram = vec![0x5au8; 1400 - TAG_LEN];
    const M: u32 = 200_000;
    let start = Instant::now();
    let mut sealed = Vec::new();
    for _ in 0..M {
        sealed = key.seal(std::hint::black_box(&datagram));
    }
    let seal = start.elapsed() / M;
    let start = Instant::now();
    for _ in 0..M {
        key.open(std::hint::black_box(&sealed)).unwrap();
    }
    let open = start.elapsed() / M;
    println!("datagram of 1400 B: seal {:.2} us, open {:.2} us", seal.as_secs_f64() * 1e6, open.as_secs_f64() * 1e6);
}
