//! Bad input from the network: strangers knocking with garbage, a wrong token, wrong versions and
//! huge lengths, and a peer that completes the handshake and then breaks the protocol. Each gives a
//! typed error for that one connection; the rank keeps serving everyone else. And the other way
//! round: a fake store or a fake peer that a real rank connects to learns nothing it can replay.

use std::time::Duration;

use bytes::Bytes;
use ferrocomm::bootstrap::{self, kv::KvClient, kv::KvError, kv::KvServer};
use ferrocomm::{Deadline, Error, Settings, Source, TagMatch, TransportChoice, TransportError, WireError, testing};
use ferrocomm_transports::auth::{CHALLENGE_LEN, HandshakeError, NONCE_LEN, PROOF_LEN};
use ferrocomm_transports::tcp::{handshake_accept, handshake_connect};
use ferrocomm_transports::wire::{HEADER_LEN, Header, Kind, Limits, TOKEN_LEN, flags};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(30);

/// A `Hello` frame of handshake step `flags` from `src` to rank `to`.
fn hello_bytes(src: u32, to: u32, flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = Header { src, aux: u64::from(to), flags, len: payload.len() as u32, ..Header::new(Kind::Hello) }
        .encode()
        .to_vec();
    v.extend_from_slice(payload);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_the_rank_keeps_serving() {
    let worlds = testing::cluster(2, Settings::default()).await.unwrap();
    let addr = worlds[0].listen_addr();
    let mut bad_magic = Header::new(Kind::Hello).encode();
    bad_magic[0..4].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    let mut bad_version = hello_bytes(1, 0, 0, &[0; NONCE_LEN]);
    bad_version[4] = 99;
    let huge = Header { len: u32::MAX, ..Header::new(Kind::Hello) }.encode().to_vec();
    let random: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let unknown_rank = Header { src: 9, ..Header::new(Kind::Hello) }.encode().to_vec();
    let attempts: Vec<Vec<u8>> = vec![random, bad_magic.to_vec(), bad_version, huge, unknown_rank, vec![1, 2, 3]];
    for bytes in &attempts {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(bytes).await;
        let _ = s.shutdown().await;
        // The rank closes on us without answering.
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut buf)).await.expect("closed, not hung");
        assert!(buf.is_empty(), "a refused stranger learns nothing");
    }
    // A stranger with the wrong token runs the real handshake: the rank's proof fails at the
    // stranger, which refuses it; the rank records the refusal.
    let limits = Limits { world_size: 2, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 };
    let mut s = TcpStream::connect(addr).await.unwrap();
    let err = handshake_connect(&mut s, 1, 0, &[7; TOKEN_LEN], &limits).await.unwrap_err();
    assert!(matches!(err, TransportError::Handshake(HandshakeError::BadProof)), "{err}");
    drop(s);
    // A stranger that follows the protocol and guesses a proof: the challenge it gets is all it
    // learns, and the rank closes.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&hello_bytes(1, 0, 0, &[1; NONCE_LEN])).await.unwrap();
    let mut challenge = [0u8; HEADER_LEN + CHALLENGE_LEN];
    s.read_exact(&mut challenge).await.unwrap();
    s.write_all(&hello_bytes(1, 0, flags::PROOF, &[2; PROOF_LEN])).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut rest)).await.expect("closed, not hung");
    assert!(rest.is_empty());
    let expected = attempts.len() + 2;
    let mut refused = Vec::new();
    for _ in 0..100 {
        refused = worlds[0].refused_connections();
        if refused.len() == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let errors: Vec<TransportError> = refused.into_iter().map(|r| r.error).collect();
    let has = |f: &dyn Fn(&TransportError) -> bool| errors.iter().any(f);
    assert_eq!(errors.len(), expected, "{errors:?}");
    println!("refused: {errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::BadMagic(_)))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::BadVersion(99)))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Wire(WireError::Oversize { .. }))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Handshake(HandshakeError::Refused))), "{errors:?}");
    assert!(has(&|e| matches!(e, TransportError::Handshake(HandshakeError::BadProof))), "{errors:?}");
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
    let settings =
        Settings::builder().bind([127, 0, 0, 1].into()).max_credit(4).transports(TransportChoice::Tcp).build();
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

/// Every `len`-byte window of the recordings (and the zero-padded tail of a shorter one).
fn windows(recordings: &[Vec<u8>], len: usize) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = recordings.iter().flat_map(|r| r.windows(len).map(<[u8]>::to_vec)).collect();
    for r in recordings.iter().filter(|r| r.len() < len) {
        let mut w = r.clone();
        w.resize(len, 0);
        out.push(w);
    }
    out
}

/// No 8 consecutive bytes of the token anywhere in the recordings.
fn assert_no_token(recordings: &[Vec<u8>], token: &[u8; TOKEN_LEN]) {
    for r in recordings {
        assert!(!r.windows(8).any(|w| token.windows(8).any(|t| t == w)), "token bytes in {r:?}");
    }
}

/// The key-value store's handshake (see `ferrocomm::bootstrap::kv`'s wire format): magic,
/// version, and the store's "challenge follows" status.
const KV_MAGIC: &[u8; 4] = b"FCKV";
const KV_VERSION: u8 = 3;

/// A fake store bound where the ranks look for the coordinator (as a process that took the port
/// first would be): it records everything a real rank sends while bootstrapping, luring it on
/// with a well-formed challenge it cannot make right. The recording holds no token bytes, and
/// nothing in it opens the real store: neither the recording replayed, nor any 32 bytes of it
/// offered as the proof for a fresh challenge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_coordinator_learns_nothing_it_can_replay() {
    let mut token = [0u8; TOKEN_LEN];
    getrandom::fill(&mut token).unwrap();
    let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let coord = fake.local_addr().unwrap().to_string();
    let recorder = tokio::spawn(async move {
        let (mut s, _) = fake.accept().await.unwrap();
        let mut hello = [0u8; 4 + 1 + NONCE_LEN];
        s.read_exact(&mut hello).await.unwrap();
        let mut lure = [&KV_MAGIC[..], &[KV_VERSION, 0]].concat();
        lure.extend((0..CHALLENGE_LEN).map(|i| i as u8));
        s.write_all(&lure).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut rest)).await;
        [&hello[..], &rest].concat()
    });
    let settings = Settings::builder().connect_timeout(Duration::from_secs(5)).build();
    let err = match bootstrap::join(0, 2, &coord, token, None, settings).await {
        Err(e) => e,
        Ok(_) => panic!("joined through a fake store"),
    };
    println!("the rank says: {err}");
    assert!(err.to_string().contains("did not prove it holds the job token"), "{err}");
    let recorded = vec![recorder.await.unwrap()];
    assert_no_token(&recorded, &token);

    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), token).await.unwrap();
    let addr = store.addr().to_string();
    // The recording replayed, followed by a request: a fresh challenge, then the store closes.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&recorded[0]).await.unwrap();
    let _ = s.write_all(&[2, 1, 0, b'k', 0, 0, 0, 0]).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut answer)).await.expect("closed, not hung");
    assert_eq!(answer.len(), 6 + CHALLENGE_LEN, "only the challenge: {answer:?}");
    // Any 32 bytes of the recording as the proof for a fresh challenge.
    for proof in windows(&recorded, PROOF_LEN) {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&[&KV_MAGIC[..], &[KV_VERSION], &recorded[0][5..5 + NONCE_LEN]].concat()).await.unwrap();
        let mut challenge = [0u8; 6 + CHALLENGE_LEN];
        s.read_exact(&mut challenge).await.unwrap();
        s.write_all(&[&[0u8][..], &proof].concat()).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut rest)).await.expect("closed, not hung");
        assert!(rest.is_empty(), "the store accepted recorded bytes as a proof");
    }
    // The real client still gets in.
    let mut c = KvClient::connect(&addr, &token, T).await.unwrap();
    c.put("k", b"v").await.unwrap();
}

/// A fake peer: the store is real, but the address it gives for rank 0 is a fake listener's. It
/// records what rank 1 sends while connecting; the recording holds no token bytes and no proof a
/// real rank 0 would take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_peer_learns_nothing_it_can_replay() {
    let mut token = [0u8; TOKEN_LEN];
    getrandom::fill(&mut token).unwrap();
    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), token).await.unwrap();
    let coord = store.addr().to_string();
    let settings = Settings::builder()
        .bind([127, 0, 0, 1].into())
        .transports(TransportChoice::Tcp)
        .connect_timeout(Duration::from_secs(10))
        .build();
    let c = coord.clone();
    let rank1 = tokio::spawn(async move { bootstrap::join(1, 2, &c, token, None, settings).await.map(drop) });
    let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut kv = KvClient::connect(&coord, &token, T).await.unwrap();
    kv.put("addr/0", fake.local_addr().unwrap().to_string().as_bytes()).await.unwrap();
    let announced = kv.get("host/1", T).await.unwrap();
    kv.put("host/0", &announced).await.unwrap();

    let (mut s, _) = fake.accept().await.unwrap();
    let mut hello = [0u8; HEADER_LEN + NONCE_LEN];
    s.read_exact(&mut hello).await.unwrap();
    s.write_all(&hello_bytes(0, 1, flags::CHALLENGE, &[0x5a; CHALLENGE_LEN])).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut rest)).await;
    let recorded = vec![[&hello[..], &rest].concat()];
    let err = rank1.await.unwrap().unwrap_err().to_string();
    println!("rank 1 says: {err}");
    assert!(err.contains("handshake with rank 0") && err.contains("did not prove"), "{err}");
    assert_no_token(&recorded, &token);
    assert_eq!(recorded[0].len(), 2 * HEADER_LEN + NONCE_LEN, "hello and refusal only");

    // Replayed to a real rank 0's listener, and every 32 bytes as the proof for its challenge.
    let limits = Limits { world_size: 2, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 };
    let real0 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr0 = real0.local_addr().unwrap();
    let mut attempts = vec![recorded[0].clone()];
    for proof in windows(&recorded, PROOF_LEN) {
        attempts.push([&hello[..], &hello_bytes(1, 0, flags::PROOF, &proof)].concat());
    }
    for bytes in attempts {
        let mut c = TcpStream::connect(addr0).await.unwrap();
        let (mut a, _) = real0.accept().await.unwrap();
        c.write_all(&bytes).await.unwrap();
        let r = tokio::time::timeout(T, handshake_accept(&mut a, 0, &token, &limits)).await.expect("not hung");
        assert!(
            matches!(r, Err(TransportError::Handshake(HandshakeError::Refused | HandshakeError::BadProof))),
            "{r:?}"
        );
    }
    drop(store);
}

/// The wrong token on either side of the store, from a real rank's bootstrap: both sides say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_another_token_is_told_why() {
    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), [1; TOKEN_LEN]).await.unwrap();
    let coord = store.addr().to_string();
    let settings = Settings::builder().connect_timeout(Duration::from_secs(5)).build();
    let err = match bootstrap::join(0, 2, &coord, [2; TOKEN_LEN], None, settings).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("joined with another token"),
    };
    assert!(err.contains("different tokens"), "{err}");
    let direct = KvClient::connect(&coord, &[2; TOKEN_LEN], T).await;
    assert!(matches!(direct, Err(KvError::Handshake { source: HandshakeError::BadProof, .. })));
}
