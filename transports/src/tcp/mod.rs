//! TCP: one stream per pair of ranks, the authenticated handshake, and two backends.
//!
//! * [`uring`] (Linux): one io_uring per rank; receives land directly in posted buffers, sends are
//!   vectored `sendmsg` submissions; the ring's eventfd is what the progress loop sleeps on.
//! * [`portable`]: non-blocking sockets watched by tokio; the laptop mode, and the fallback where
//!   io_uring is missing or disabled.
//!
//! Both share `framing`, so they differ only in how bytes cross the kernel boundary.

pub(crate) mod framing;
pub mod portable;
#[cfg(target_os = "linux")]
pub mod uring;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, TOKEN_LEN, WireError, flags};
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

fn hello(me: Rank, token: &[u8; TOKEN_LEN], accept: bool) -> Vec<u8> {
    let h = Header {
        src: me,
        len: TOKEN_LEN as u32,
        flags: if accept { flags::ACCEPT } else { 0 },
        ..Header::new(Kind::Hello)
    };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(token);
    v
}

async fn read_hello(s: &mut TcpStream, limits: &Limits) -> Result<(Header, [u8; TOKEN_LEN]), TransportError> {
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).await?;
    let h = Header::decode(&raw, limits)?;
    if h.kind != Kind::Hello || h.len as usize != TOKEN_LEN {
        return Err(WireError::Unexpected(h.kind).into());
    }
    let mut token = [0u8; TOKEN_LEN];
    s.read_exact(&mut token).await?;
    Ok((h, token))
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timing.
fn same_token(a: &[u8; TOKEN_LEN], b: &[u8; TOKEN_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Connecting side: proves the job token, then waits for the acceptor's proof.
pub async fn handshake_connect(
    s: &mut TcpStream,
    me: Rank,
    expect: Rank,
    token: &[u8; TOKEN_LEN],
    limits: &Limits,
) -> Result<(), TransportError> {
    s.write_all(&hello(me, token, false)).await?;
    let (h, theirs) = read_hello(s, limits).await?;
    if !same_token(&theirs, token) {
        return Err(WireError::BadToken.into());
    }
    if h.src != expect {
        return Err(WireError::WrongSource { expected: expect, got: h.src }.into());
    }
    Ok(())
}

/// Accepting side: checks the peer's token and claimed rank; answers only a peer that proved it.
pub async fn handshake_accept(
    s: &mut TcpStream,
    me: Rank,
    token: &[u8; TOKEN_LEN],
    limits: &Limits,
) -> Result<Rank, TransportError> {
    let (h, theirs) = read_hello(s, limits).await?;
    if !same_token(&theirs, token) {
        return Err(WireError::BadToken.into());
    }
    s.write_all(&hello(me, token, true)).await?;
    Ok(h.src)
}
