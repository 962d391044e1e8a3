//! The portable TCP backend: non-blocking sockets registered with tokio's reactor.
//!
//! Bytes move through plain non-blocking `send`/`recv` calls (socket2), so a busy-polling caller
//! makes progress without waiting for tokio's event loop to notice readiness; readiness is only
//! used to sleep ([`Transport::poll_ready`]). On Linux the sockets sit in an epoll set of their
//! own, armed one-shot only by a sleeper (the `oneshot` module), so that segments read by a spinning
//! caller do not wake the reactor thread too; elsewhere tokio watches them. This backend compiles
//! wherever tokio does.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::task::{Context, Poll};

use bytes::Bytes;
use socket2::SockRef;
#[cfg(not(target_os = "linux"))]
use tokio::io::Interest;

#[cfg(target_os = "linux")]
use super::oneshot::Bell;

use super::framing::{Reader, Writer};
use crate::wire::{Header, Limits, Rank};
use crate::{Sink, Transport, TransportError};

/// A connection's socket: non-blocking, in the [`Bell`]'s epoll set (Linux) or watched by tokio.
#[cfg(target_os = "linux")]
type TcpStream = std::net::TcpStream;
#[cfg(not(target_os = "linux"))]
type TcpStream = tokio::net::TcpStream;

struct Conn {
    stream: TcpStream,
    reader: Reader,
    writer: Writer,
    /// Why a send failed (set once): nothing more is sent, but the connection is read until its
    /// read side ends too, so that what the peer sent before it went (a goodbye, a loss notice) is
    /// not thrown away; then it fails for this reason. A socket whose send failed is reset or
    /// timed out, so its read side ends once the bytes already received are read.
    write_failed: Option<TransportError>,
}

/// TCP over tokio sockets; one connection per peer.
pub struct PortableTcp {
    conns: Vec<Option<Conn>>,
    eager_limit: usize,
    lost: Vec<(Rank, TransportError)>,
    #[cfg(target_os = "linux")]
    bell: Bell,
}

impl PortableTcp {
    /// Takes over connected, authenticated sockets (`conns[r]` is the socket to rank `r`).
    /// Must be called inside the tokio runtime whose reactor will watch the sockets.
    pub fn new(conns: Vec<Option<std::net::TcpStream>>, limits: Limits, eager_limit: usize) -> io::Result<PortableTcp> {
        #[cfg(target_os = "linux")]
        let mut bell = Bell::new(conns.len())?;
        let conns = conns
            .into_iter()
            .enumerate()
            .map(|(peer, s)| {
                s.map(|s| {
                    s.set_nonblocking(true)?;
                    #[cfg(target_os = "linux")]
                    bell.add(peer, std::os::fd::AsRawFd::as_raw_fd(&s))?;
                    #[cfg(not(target_os = "linux"))]
                    let s = TcpStream::from_std(s)?;
                    Ok(Conn {
                        stream: s,
                        reader: Reader::new(peer as Rank, limits),
                        writer: Writer::default(),
                        write_failed: None,
                    })
                })
                .transpose()
            })
            .collect::<io::Result<_>>()?;
        Ok(PortableTcp {
            conns,
            eager_limit,
            lost: Vec::new(),
            #[cfg(target_os = "linux")]
            bell,
        })
    }

    /// Whether a connection holds back a data frame for its receive (see `framing`): the next
    /// round has work without any readiness.
    fn holds(&self) -> bool {
        self.conns.iter().flatten().any(|c| c.reader.held())
    }

    fn fail(&mut self, peer: Rank, err: TransportError) {
        if self.conns[peer as usize].take().is_some() {
            self.lost.push((peer, err));
        }
    }
}

fn recv(stream: &TcpStream, ptr: *mut u8, len: usize) -> io::Result<usize> {
    // SAFETY: `ptr..ptr+len` is writable memory handed out by `Reader::target`.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut MaybeUninit<u8>, len) };
    SockRef::from(stream).recv(buf)
}

fn write_some(c: &mut Conn) -> io::Result<usize> {
    let mut iov: Vec<IoSlice<'_>> = Vec::new();
    c.writer.slices(&mut iov);
    let n = SockRef::from(&c.stream).send_vectored(&iov)?;
    c.writer.advance(n);
    Ok(n)
}

impl Conn {
    /// Non-blocking writes and reads until the socket would block (bounded for fairness).
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize, TransportError> {
        let mut work = 0;
        while !self.writer.is_empty() {
            match write_some(self) {
                Ok(_) => work += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.write_failed = Some(e.into());
                    self.writer = Writer::default();
                }
            }
        }
        // A data frame held back for its receive (see `framing`) gets one look per round.
        work += self.reader.resume(sink)?;
        for _ in 0..64 {
            if self.reader.held() {
                break;
            }
            let t = self.reader.target(sink)?;
            match recv(&self.stream, t.ptr, t.len) {
                Ok(0) => return Err(self.write_failed.take().unwrap_or(TransportError::Closed)),
                Ok(n) => work += 1 + self.reader.advance(n, sink)?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.write_failed.take().unwrap_or(e.into())),
            }
        }
        Ok(work)
    }

    /// Ready when the socket has data (or EOF) or output could be written. Clears tokio's cached
    /// readiness only through a real attempt, so no wake-up is lost.
    #[cfg(not(target_os = "linux"))]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match self.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {
                    let mut probe = [MaybeUninit::uninit(); 1];
                    match self.stream.try_io(Interest::READABLE, || SockRef::from(&self.stream).peek(&mut probe)) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                        _ => return Poll::Ready(()),
                    }
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => break,
            }
        }
        while !self.writer.is_empty() {
            match self.stream.poll_write_ready(cx) {
                Poll::Ready(Ok(())) => {
                    let stream = &self.stream;
                    let writer = &mut self.writer;
                    let r = stream.try_io(Interest::WRITABLE, || {
                        let mut iov = Vec::new();
                        writer.slices(&mut iov);
                        SockRef::from(stream).send_vectored(&iov)
                    });
                    match r {
                        Ok(n) => {
                            self.writer.advance(n);
                            return Poll::Ready(());
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                        Err(_) => return Poll::Ready(()),
                    }
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => break,
            }
        }
        Poll::Pending
    }
}

impl Transport for PortableTcp {
    fn name(&self) -> &'static str {
        "tcp-portable"
    }

    fn eager_limit(&self) -> usize {
        self.eager_limit
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        if let Some(c) = self.conns.get_mut(peer as usize).and_then(Option::as_mut)
            && c.write_failed.is_none()
        {
            c.writer.push(&header, payload);
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        let mut work = 0;
        for peer in 0..self.conns.len() {
            let Some(c) = self.conns[peer].as_mut() else { continue };
            match c.progress(sink) {
                Ok(n) => work += n,
                Err(e) => self.fail(peer as Rank, e),
            }
        }
        for (peer, err) in self.lost.drain(..) {
            sink.peer_lost(peer, err);
            work += 1;
        }
        work
    }

    #[cfg(not(target_os = "linux"))]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut ready = !self.lost.is_empty() || self.holds();
        for c in self.conns.iter_mut().flatten() {
            ready |= c.poll_ready(cx).is_ready();
        }
        if ready { Poll::Ready(()) } else { Poll::Pending }
    }

    #[cfg(target_os = "linux")]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // Sockets that fired since the last sleep may have work; the rest are still armed. A
        // held data frame sits in its reader's buffer, where no readiness announces it.
        if !self.lost.is_empty() || self.holds() || self.bell.take_fired() > 0 {
            return Poll::Ready(());
        }
        for peer in 0..self.conns.len() {
            let Some(c) = self.conns[peer].as_ref() else { continue };
            let fd = std::os::fd::AsRawFd::as_raw_fd(&c.stream);
            if let Err(e) = self.bell.arm(peer, fd, !c.writer.is_empty()) {
                // No doorbell for this connection: it cannot be slept on, so it ends.
                self.fail(peer as Rank, e.into());
                return Poll::Ready(());
            }
        }
        self.bell.poll_fired(cx)
    }

    #[cfg(target_os = "linux")]
    fn stand_aside(&mut self) {
        // What fired is disarmed by being taken; what is still armed would fire once a caller's
        // next message comes and then ring at every segment after it.
        self.bell.take_fired();
        for (peer, c) in self.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            // A failure leaves the socket armed: it may wake the reactor thread, nothing worse.
            let _ = self.bell.disarm(peer, std::os::fd::AsRawFd::as_raw_fd(&c.stream));
        }
    }

    fn has_pending_output(&self) -> bool {
        self.conns.iter().flatten().any(|c| !c.writer.is_empty())
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        if (peer as usize) < self.conns.len() {
            self.fail(peer, reason);
        }
    }
}
