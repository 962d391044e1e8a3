//! TCP: one stream per pair of ranks, the authenticated handshake ([`crate::auth`]), and two
//! backends.
//!
//! * [`uring`] (Linux): one io_uring per rank; receives land directly in posted buffers, sends are
//!   vectored `sendmsg` submissions; the ring's eventfd is what the progress loop sleeps on.
//! * [`portable`]: non-blocking sockets (in an epoll set of their own on Linux, else watched by
//!   tokio); the laptop mode, and the fallback where io_uring is missing or disabled.
//!
//! Both share `framing`, so they differ only in how bytes cross the kernel boundary (and in how
//! they sleep: the ring's eventfd, or `oneshot`'s epoll set on Linux).

pub(crate) mod framing;
#[cfg(target_os = "linux")]
mod oneshot;
pub mod portable;
#[cfg(target_os = "linux")]
pub mod uring;

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::auth::{
    CHALLENGE_LEN, Challenge, Connector, Ends, HandshakeError, JobSecret, Listener, NONCE_LEN, PROOF_LEN, Protocol,
};
use crate::wire::{HEADER_LEN, HELLO_MAX, Header, Kind, Limits, Rank, TOKEN_LEN, WireError, flags};
use crate::{Transport, TransportError};

/// Which TCP backend to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// io_uring where the kernel allows it, else portable.
    Auto,
    /// io_uring (Linux only).
    Uring,
    /// tokio sockets.
    Portable,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Backend::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(Backend::Uring),
            "portable" | "tokio" => Ok(Backend::Portable),
            _ => Err(format!("unknown TCP backend {s:?} (auto, uring, portable)")),
        }
    }
}

/// Builds the transport over already authenticated streams (`conns[r]`: the stream to rank `r`).
/// Call inside the tokio runtime that will run the progress loop.
pub fn build(
    backend: Backend,
    conns: Vec<Option<std::net::TcpStream>>,
    limits: Limits,
    eager_limit: usize,
) -> std::io::Result<Box<dyn Transport>> {
    #[cfg(target_os = "linux")]
    if backend != Backend::Portable {
        match uring::UringTcp::new(conns, limits, eager_limit) {
            Ok(t) => return Ok(Box::new(t)),
            Err((e, _)) if backend == Backend::Uring => return Err(e),
            Err((e, conns_back)) => {
                tracing::warn!("io_uring unavailable ({e}); using the portable TCP backend");
                return Ok(Box::new(portable::PortableTcp::new(conns_back, limits, eager_limit)?));
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    if backend == Backend::Uring {
        return Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "io_uring needs Linux"));
    }
    Ok(Box::new(portable::PortableTcp::new(conns, limits, eager_limit)?))
}

/// Tunes a freshly connected stream: no Nagle delay, keep-alive probing so that a vanished host
/// is noticed within about `peer_timeout`.
pub fn tune(stream: &TcpStream, peer_timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    let interval = (peer_timeout / 4).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new().with_time(interval).with_interval(interval);
    #[cfg(any(target_os = "linux", target_os = "macos"))]
    let ka = ka.with_retries(3);
    sock.set_tcp_keepalive(&ka)?;
    #[cfg(target_os = "linux")]
    sock.set_tcp_user_timeout(Some(peer_timeout))?;
    Ok(())
}

/// A `Hello` frame of the handshake step `flags`, from `me` to `to`.
fn hello(me: Rank, to: Rank, flags: u16, payload: &[u8]) -> Vec<u8> {
    let h = Header { src: me, aux: u64::from(to), len: payload.len() as u32, flags, ..Header::new(Kind::Hello) };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

/// Reads one `Hello` frame: its header, and its payload into a fixed buffer (the header's
/// check bounds `len` by [`HELLO_MAX`], so nothing is sized by the peer).
async fn read_hello<S: AsyncRead + Unpin>(
    s: &mut S,
    limits: &Limits,
) -> Result<(Header, [u8; HELLO_MAX]), TransportError> {
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).await?;
    let h = Header::decode(&raw, limits)?;
    if h.kind != Kind::Hello {
        return Err(WireError::Unexpected(h.kind).into());
    }
    let mut payload = [0u8; HELLO_MAX];
    s.read_exact(&mut payload[..h.len as usize]).await?;
    Ok((h, payload))
}

fn malformed(what: &'static str) -> TransportError {
    HandshakeError::Malformed(what).into()
}

/// Connecting side of the peers' handshake ([`crate::auth`]): sends a nonce, checks the
/// acceptor's proof, and only then proves the job token itself. A listener that fails its proof
/// gets a refusal and nothing keyed. `s` is the connection (a `TcpStream`; generic so that the
/// fuzz targets can run it over bytes in memory).
pub async fn handshake_connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: Rank,
    expect: Rank,
    token: &[u8; TOKEN_LEN],
    limits: &Limits,
) -> Result<(), TransportError> {
    let key = JobSecret::new(*token).handshake_key(Protocol::Peers);
    let c = Connector::new(key, Ends { connector: me, listener: expect })?;
    s.write_all(&hello(me, expect, 0, c.hello())).await?;
    let (h, payload) = read_hello(s, limits).await?;
    if h.src != expect {
        return Err(WireError::WrongSource { expected: expect, got: h.src }.into());
    }
    if h.flags != flags::CHALLENGE || h.len as usize != CHALLENGE_LEN || h.aux != u64::from(me) {
        return Err(malformed("expected the listener's challenge"));
    }
    let challenge = Challenge::from_bytes(payload[..CHALLENGE_LEN].try_into().expect("challenge length"));
    match c.answer(&challenge) {
        Ok(proof) => s.write_all(&hello(me, expect, flags::PROOF, &proof)).await?,
        Err(e) => {
            // Tell the listener why we leave (best effort): a rank with another token then
            // reports the mismatch too, instead of a closed connection.
            let _ = s.write_all(&hello(me, expect, flags::REFUSE, &[])).await;
            return Err(e.into());
        }
    }
    Ok(())
}

/// Accepting side of the peers' handshake: answers a hello meant for `me` with a challenge, then
/// checks the connector's proof. Returns the rank the connector proved to be (its claim is bound
/// into both proofs). `s` as for [`handshake_connect`].
pub async fn handshake_accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: Rank,
    token: &[u8; TOKEN_LEN],
    limits: &Limits,
) -> Result<Rank, TransportError> {
    let (h, payload) = read_hello(s, limits).await?;
    if h.flags != 0 || h.len as usize != NONCE_LEN {
        return Err(malformed("expected a hello"));
    }
    if h.aux != u64::from(me) {
        return Err(HandshakeError::WrongListener { wanted: h.aux, me }.into());
    }
    let key = JobSecret::new(*token).handshake_key(Protocol::Peers);
    let nonce = payload[..NONCE_LEN].try_into().expect("nonce length");
    let (l, challenge) = Listener::new(key, Ends { connector: h.src, listener: me }, nonce)?;
    s.write_all(&hello(me, h.src, flags::CHALLENGE, &challenge.to_bytes())).await?;
    let (p, payload) = read_hello(s, limits).await?;
    if p.src != h.src {
        return Err(WireError::WrongSource { expected: h.src, got: p.src }.into());
    }
    match (p.flags, p.len as usize) {
        (flags::PROOF, PROOF_LEN) => l.check(&payload[..PROOF_LEN])?,
        (flags::REFUSE, 0) => return Err(HandshakeError::Refused.into()),
        _ => return Err(malformed("expected the connector's proof")),
    }
    Ok(h.src)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    const TOKEN: [u8; TOKEN_LEN] = [9; TOKEN_LEN];
    const LIMITS: Limits = Limits { world_size: 4, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 };

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        (c, l.accept().await.unwrap().0)
    }

    /// Rank 2 connects to rank 1: (connector's result, acceptor's result).
    async fn handshake(
        c_token: [u8; TOKEN_LEN],
        a_token: [u8; TOKEN_LEN],
    ) -> (Result<(), TransportError>, Result<Rank, TransportError>) {
        let (mut c, mut a) = pair().await;
        tokio::join!(handshake_connect(&mut c, 2, 1, &c_token, &LIMITS), handshake_accept(&mut a, 1, &a_token, &LIMITS))
    }

    fn is(r: &TransportError, e: HandshakeError) -> bool {
        matches!(r, TransportError::Handshake(x) if *x == e)
    }

    #[tokio::test]
    async fn one_token_passes() {
        let (c, a) = handshake(TOKEN, TOKEN).await;
        c.unwrap();
        assert_eq!(a.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_wrong_token_fails_on_both_sides_either_way() {
        let mut other = TOKEN;
        other[0] ^= 0x80;
        for (c_token, a_token) in [(other, TOKEN), (TOKEN, other)] {
            let (c, a) = handshake(c_token, a_token).await;
            let (c, a) = (c.unwrap_err(), a.unwrap_err());
            assert!(is(&c, HandshakeError::BadProof), "{c}");
            assert!(is(&a, HandshakeError::Refused), "{a}");
            assert!(c.to_string().contains("different tokens"), "{c}");
            assert!(a.to_string().contains("different tokens"), "{a}");
        }
    }

    #[tokio::test]
    async fn a_stranger_without_the_token_gets_no_connection() {
        let (mut c, mut a) = pair().await;
        let stranger = async {
            c.write_all(&hello(3, 1, 0, &[5; NONCE_LEN])).await.unwrap();
            let (h, _) = read_hello(&mut c, &LIMITS).await.unwrap();
            assert_eq!((h.flags, h.len as usize), (flags::CHALLENGE, CHALLENGE_LEN));
            c.write_all(&hello(3, 1, flags::PROOF, &[0xee; PROOF_LEN])).await.unwrap();
        };
        let (_, r) = tokio::join!(stranger, handshake_accept(&mut a, 1, &TOKEN, &LIMITS));
        assert!(is(&r.unwrap_err(), HandshakeError::BadProof));
    }

    #[tokio::test]
    async fn a_reflected_challenge_is_no_proof() {
        let (mut c, mut a) = pair().await;
        let stranger = async {
            c.write_all(&hello(3, 1, 0, &[5; NONCE_LEN])).await.unwrap();
            let (_, payload) = read_hello(&mut c, &LIMITS).await.unwrap();
            c.write_all(&hello(3, 1, flags::PROOF, &payload[NONCE_LEN..CHALLENGE_LEN])).await.unwrap();
        };
        let (_, r) = tokio::join!(stranger, handshake_accept(&mut a, 1, &TOKEN, &LIMITS));
        assert!(is(&r.unwrap_err(), HandshakeError::BadProof));
    }

    #[tokio::test]
    async fn misdirected_and_malformed_hellos_are_refused() {
        // Meant for rank 3.
        let (mut c, mut a) = pair().await;
        c.write_all(&hello(2, 3, 0, &[1; NONCE_LEN])).await.unwrap();
        let r = handshake_accept(&mut a, 1, &TOKEN, &LIMITS).await.unwrap_err();
        assert!(is(&r, HandshakeError::WrongListener { wanted: 3, me: 1 }), "{r}");
        // A proof where the hello belongs.
        let (mut c, mut a) = pair().await;
        c.write_all(&hello(2, 1, flags::PROOF, &[1; PROOF_LEN])).await.unwrap();
        let r = handshake_accept(&mut a, 1, &TOKEN, &LIMITS).await.unwrap_err();
        assert!(matches!(r, TransportError::Handshake(HandshakeError::Malformed(_))), "{r}");
        // A longer payload than any handshake step: refused by the header check, unread.
        let (mut c, mut a) = pair().await;
        let h = Header { src: 2, aux: 1, len: HELLO_MAX as u32 + 1, ..Header::new(Kind::Hello) };
        c.write_all(&h.encode()).await.unwrap();
        let r = handshake_accept(&mut a, 1, &TOKEN, &LIMITS).await.unwrap_err();
        assert!(matches!(r, TransportError::Wire(WireError::Oversize { .. })), "{r}");
        // A listener that answers the hello with something else than a challenge.
        let (mut c, mut a) = pair().await;
        let fake = async {
            let _ = read_hello(&mut a, &LIMITS).await.unwrap();
            a.write_all(&hello(1, 2, flags::PROOF, &[0; PROOF_LEN])).await.unwrap();
        };
        let (r, _) = tokio::join!(handshake_connect(&mut c, 2, 1, &TOKEN, &LIMITS), fake);
        assert!(matches!(r, Err(TransportError::Handshake(HandshakeError::Malformed(_)))), "{r:?}");
    }
}
