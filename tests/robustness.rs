//! Bad input from the network: strangers knocking with garbage, a wrong token, wrong versions and
//! huge lengths, and a peer that completes the handshake and then breaks the protocol. Each gives a
//! typed error for that one connection; the rank keeps serving everyone else.

use std::time::Duration;

use bytes::Bytes;
use ferrocomm::bootstrap::{self, kv::KvClient, kv::KvServer};
use ferrocomm::transports::tcp::{handshake_accept, handshake_connect};
use ferrocomm::transports::wire::{HEADER_LEN, Header, Kind, Limits, TOKEN_LEN};
use ferrocomm::{Deadline, Error, Settings, Source, TagMatch, TransportChoice, TransportError, WireError, testing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(30);

fn hello_bytes(src: u32, token: &[u8; TOKEN_LEN]) -> Vec<u8> {
    let mut v = Header { src, len: TOKEN_LEN as u32, ..Header::new(Kind::Hello) }.encode().to_vec();
    v.extend_from_slice(token);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_the_rank_keeps_serving() {
    let worlds = testing::cluster(2, Settings::default()).await.unwrap();
    let addr = worlds[0].listen_addr();
    let mut bad_magic = Header::new(Kind::Hello).encode();
    bad_magic[0..4].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    let mut bad_version = hello_bytes(1, &[0; TOKEN_LEN]);
    bad_version[4] = 99;
    let huge = Header { len: u32::MAX, ..Header::new(Kind::Hello) }.encode().to_vec();
    let random: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let wrong_token = hello_bytes(1, &[7; TOKEN_LEN]);
    let unknown_rank = Header { src: 9, ..Header::new(Kind::Hello) }.encode().to_vec();
    let attempts: Vec<Vec<u8>> =
        vec![random, bad_magic.to_vec(), bad_version, huge, wrong_token, unknown_rank, vec![1, 2, 3]];
    for bytes in &attempts {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(bytes).await;
        let _ = s.shutdown().await;
        // The rank closes on us without answering (no token proof from it either).
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut buf)).await.expect("closed, not hung");
        assert!(buf.is_empty(), "a refused stranger learns nothing");
    }
    let mut refused = Vec::new();
    for _ in 0..100 {
        refused = worlds[0].refused_connections();
        if refused.len() == attempts.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let errors: Vec<TransportError> = refused.into_iter().map(|r| r.error).collect();
    let has = |f: &dyn Fn(&TransportError) -> bool| errors.iter().any(f);
    assert_eq!(errors.len(), attempts.len(), "{errors:?}");
    println!("refused: {errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::BadMagic(_)))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::BadVersion(99)))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::Oversize { .. }))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::BadToken))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::UnknownRank { rank: 9, .. }))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Io(std::io::ErrorKind::UnexpectedEof))), "{errors:?}");
    // Still serving its real peer, both directions, both protocols.
    for len in [10usize, 1 << 20] {
        let rx = worlds[1].recv(0, 1u64);
        worlds[0].send(1, 1, vec![3u8; len]).timeout(T).await.unwrap();
        assert_eq!(rx.timeout(T).await.unwrap().data.len(), len);
    }
}

/// How the impostor misbehaves after an honest handshake.
#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// One good eager message, then a frame with a bad magic.
    GarbageAfterGoodFrame,
    /// An eager frame longer than the eager limit.
    OversizeEager,
    /// More unmatched eager messages than it has credits for.
    CreditOverrun,
    /// A CTS for a rendezvous that never was.
    StrayCts,
}

/// Ranks 0 and 2 are real; rank 1 is an impostor that knows the token, joins properly, then
/// misbehaves toward rank 0. Rank 0 cuts rank 1 off, alone: it gets a typed peer-lost error naming
/// rank 1, and tells rank 2 over their connection, which stays up (the loss revokes the world at
/// both: see docs/failure.md).
async fn impostor(m: Misbehaviour) {
    let mut token = [0u8; TOKEN_LEN];
    token[0] = 42;
    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), token).await.unwrap();
    let coord = store.addr().to_string();
    let settings = Settings {
        bind: [127, 0, 0, 1].into(),
        max_credit: 4,
        transports: TransportChoice::Tcp,
        ..Settings::default()
    };
    let eager_limit = settings.eager_limit;
    let real = |rank| {
        let (coord, settings) = (coord.clone(), settings.clone());
        tokio::spawn(async move { bootstrap::join(rank, 3, &coord, token, None, settings).await.unwrap() })
    };
    let (r0, r2) = (real(0), real(2));
    let limits = Limits { world_size: 3, eager_limit, chunk: 1 << 19, max_message: 1 << 30 };
    let mut kv = KvClient::connect(&coord, &token, T).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    kv.put("addr/1", listener.local_addr().unwrap().to_string().as_bytes()).await.unwrap();
    // It announces itself as rank 0 did (same host, settings and collective table): its bootstrap
    // is in order, its frames will not be.
    let announced = kv.get("host/0", T).await.unwrap();
    kv.put("host/1", &announced).await.unwrap();
    let addr0 = String::from_utf8(kv.get("addr/0", T).await.unwrap()).unwrap();
    let mut to0 = TcpStream::connect(addr0).await.unwrap();
    handshake_connect(&mut to0, 1, 0, &token, &limits).await.unwrap();
    let (mut from2, _) = listener.accept().await.unwrap();
    assert_eq!(handshake_accept(&mut from2, 1, &token, &limits).await.unwrap(), 2);
    kv.put("ready/1", b"1").await.unwrap();
    let (w0, w2) = (r0.await.unwrap(), r2.await.unwrap());

    let eager = |tag: u64, len: usize| {
        let mut v = Header { src: 1, tag, len: len as u32, ..Header::new(Kind::Eager) }.encode().to_vec();
        v.extend(std::iter::repeat_n(0xab, len));
        v
    };
    let mut bytes = Vec::new();
    match m {
        Misbehaviour::GarbageAfterGoodFrame => {
            bytes.extend(eager(5, 10));
            bytes.extend([0u8; HEADER_LEN]);
        }
        Misbehaviour::OversizeEager => bytes.extend(eager(5, eager_limit + 1)),
        Misbehaviour::CreditOverrun => (0..5).for_each(|t| bytes.extend(eager(100 + t, 8))),
        Misbehaviour::StrayCts => bytes.extend(Header { src: 1, seq: 77, ..Header::new(Kind::Cts) }.encode()),
    }
    let pending = w0.recv(1, 6u64);
    let good = matches!(m, Misbehaviour::GarbageAfterGoodFrame).then(|| w0.recv(1, 5u64));
    let at2 = w2.recv(Source::Any, TagMatch::Any);
    to0.write_all(&bytes).await.unwrap();
    let err = pending.timeout(T).await.unwrap_err();
    let Error::PeerLost { rank: 1, reason: TransportError::Wire(w) } = &err else { panic!("{m:?}: {err:?}") };
    match m {
        Misbehaviour::GarbageAfterGoodFrame => {
            assert_eq!(*w, WireError::BadMagic(0));
            // The good frame before the garbage was delivered.
            let got = good.expect("posted").timeout(T).await.unwrap();
            assert_eq!(got.data, Bytes::from(vec![0xab; 10]));
        }
        Misbehaviour::OversizeEager => assert!(matches!(w, WireError::Oversize { kind: Kind::Eager, .. })),
        Misbehaviour::CreditOverrun => assert_eq!(*w, WireError::Unexpected(Kind::Eager)),
        Misbehaviour::StrayCts => assert_eq!(*w, WireError::Unexpected(Kind::Cts)),
    }
    // The world is revoked: new operations fail at once, naming the lost rank, whoever they name.
    assert!(matches!(w0.send(1, 0, vec![1]).timeout(T).await, Err(Error::PeerLost { rank: 1, .. })));
    assert!(matches!(w0.send(2, 0, vec![1]).timeout(T).await, Err(Error::PeerLost { rank: 1, .. })));
    // Rank 2 hears of it from rank 0, over their connection, which stays up: its receive fails
    // naming rank 1 too.
    let heard = at2.timeout(T).await;
    assert!(matches!(heard, Err(Error::PeerLost { rank: 1, reason: TransportError::Reported { by: 0 } })), "{heard:?}");
    // The connection to the impostor was closed.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, to0.read_to_end(&mut rest)).await.expect("closed");
    drop(store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_breaks_the_protocol_is_cut_off_alone() {
    for m in [
        Misbehaviour::GarbageAfterGoodFrame,
        Misbehaviour::OversizeEager,
        Misbehaviour::CreditOverrun,
        Misbehaviour::StrayCts,
    ] {
        impostor(m).await;
    }
}
