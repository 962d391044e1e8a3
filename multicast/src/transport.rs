//! The unreliable multicast transport: one datagram to every member of a group, maybe.
//!
//! The trait says nothing of UDP (addresses, ports, TTL): an InfiniBand UD multicast QP can sit
//! behind it as well. Datagrams may be lost, duplicated or reordered; the reliability protocol in
//! [`crate::proto`] copes. Everything is non-blocking and poll-based so a tokio task can drive it.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tokio::io::ReadBuf;
use tokio::net::UdpSocket;

/// An unreliable multicast group this process has joined.
pub trait MulticastTransport: Send + Sync {
    /// Short name for logs (`udp4`, ...).
    fn name(&self) -> &'static str;
    /// Largest datagram (header included) the group carries.
    fn max_datagram(&self) -> usize;
    /// Sends one datagram to the group without blocking. `Ok(false)`: no room now, try again after
    /// [`MulticastTransport::poll_send_ready`].
    fn try_send(&self, datagram: &[u8]) -> io::Result<bool>;
    /// `Ready` when a send may succeed.
    fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Receives one datagram into `buf`, returning its length.
    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>>;
    /// `Some(s)`: [`MulticastTransport::try_send`] also takes several datagrams at once, laid end
    /// to end, each `s` bytes but the last (at most `s`), at most [`GSO_MAX_BYTES`] in all; the
    /// group receives them as separate datagrams. `None` (the default): one datagram per send.
    fn segment_size(&self) -> Option<usize> {
        None
    }
}

/// Most bytes one segmented send may carry (UDP's 65,507-byte payload limit, rounded down).
pub const GSO_MAX_BYTES: usize = 65_000;

/// Where a UDP multicast group lives.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// Group address (224.0.0.0/4).
    pub group: Ipv4Addr,
    /// UDP port of the group.
    pub port: u16,
    /// Local interface address to send from and join on (127.0.0.1 for loopback,
    /// 0.0.0.0 for the kernel's choice).
    pub interface: Ipv4Addr,
    /// Largest datagram, header included; keep it under the path MTU (1472 B on Ethernet)
    /// so that IP fragmentation does not multiply the loss rate.
    pub datagram: usize,
    /// Hops a datagram may cross (1: this subnet only).
    pub ttl: u32,
    /// Socket buffer size asked for (both directions).
    pub buffer: usize,
}

/// UDP/IPv4 multicast (Linux, macOS).
///
/// On Linux the socket sends with UDP generic segmentation offload (`UDP_SEGMENT` at the
/// datagram size): a message of several datagrams goes down the stack as one packet, cut into
/// datagrams by the NIC or at the last moment, so the route, the netfilter hooks, a bridge's
/// flooding to each port and the receiving hosts' IP layers run once per message instead of once
/// per datagram (on a Linux bridge with 8,900-byte datagrams, what bounds a multicast stream).
/// A kernel or route that refuses it (no checksum offload, datagrams above the MTU) turns it off
/// at the first failed send; the datagrams then go one by one.
pub struct UdpMulticast {
    socket: UdpSocket,
    target: SocketAddr,
    datagram: usize,
    /// The segment size while segmentation offload is on; 0 when off.
    segment: AtomicUsize,
}

impl UdpMulticast {
    /// Joins the group. Needs a tokio runtime (the socket registers with its reactor).
    ///
    /// The socket binds the group address itself (not 0.0.0.0): on Linux a socket bound to the
    /// wildcard address receives every group joined by any socket on the host with that port.
    /// Several ranks on one host share the port (`SO_REUSEADDR`/`SO_REUSEPORT`); each gets a copy.
    pub fn join(cfg: &UdpConfig) -> io::Result<UdpMulticast> {
        if !cfg.group.is_multicast() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a multicast address", cfg.group),
            ));
        }
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        s.set_reuse_address(true)?;
        #[cfg(unix)]
        s.set_reuse_port(true)?;
        s.set_nonblocking(true)?;
        let _ = s.set_recv_buffer_size(cfg.buffer);
        let _ = s.set_send_buffer_size(cfg.buffer);
        #[cfg(target_os = "linux")]
        let bind = SocketAddrV4::new(cfg.group, cfg.port);
        #[cfg(not(target_os = "linux"))]
        let bind = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, cfg.port);
        s.bind(&SockAddr::from(bind))?;
        s.join_multicast_v4(&cfg.group, &cfg.interface)?;
        if !cfg.interface.is_unspecified() {
            s.set_multicast_if_v4(&cfg.interface)?;
        }
        s.set_multicast_loop_v4(true)?;
        s.set_multicast_ttl_v4(cfg.ttl)?;
        let segment = if set_segment(&s, cfg.datagram) { cfg.datagram } else { 0 };
        let socket = UdpSocket::from_std(s.into())?;
        Ok(UdpMulticast {
            socket,
            target: SocketAddrV4::new(cfg.group, cfg.port).into(),
            datagram: cfg.datagram,
            segment: AtomicUsize::new(segment),
        })
    }

    fn send_one(&self, datagram: &[u8]) -> io::Result<bool> {
        match self.socket.try_send_to(datagram, self.target) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Turns UDP segmentation offload on at `size` bytes per datagram (0: off); false if the kernel
/// refuses.
#[cfg(target_os = "linux")]
fn set_segment(s: &impl std::os::fd::AsRawFd, size: usize) -> bool {
    let Ok(v) = libc::c_int::try_from(size) else { return false };
    // SAFETY: a valid descriptor, and an int option of the right length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_SEGMENT,
            std::ptr::from_ref(&v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn set_segment<S>(_: &S, _: usize) -> bool {
    false
}

/// How the kernel refuses a segmented send: no checksum offload on the route (`EIO`), datagrams
/// above the path MTU (`EMSGSIZE`), too many segments or no offload at all (`EINVAL`,
/// `EOPNOTSUPP`).
fn refuses_segmentation(e: &io::Error) -> bool {
    #[cfg(target_os = "linux")]
    return matches!(e.raw_os_error(), Some(libc::EIO | libc::EMSGSIZE | libc::EINVAL | libc::EOPNOTSUPP));
    #[cfg(not(target_os = "linux"))]
    {
        let _ = e;
        true
    }
}

impl MulticastTransport for UdpMulticast {
    fn name(&self) -> &'static str {
        "udp4"
    }

    fn max_datagram(&self) -> usize {
        self.datagram
    }

    fn try_send(&self, datagrams: &[u8]) -> io::Result<bool> {
        if self.segment.load(Ordering::Relaxed) != 0 {
            match self.send_one(datagrams) {
                Err(e) if refuses_segmentation(&e) => {
                    tracing::debug!(error = %e, "UDP segmentation offload refused: sending datagram by datagram");
                    self.segment.store(0, Ordering::Relaxed);
                    set_segment(&self.socket, 0);
                }
                r => return r,
            }
        }
        if datagrams.len() <= self.datagram {
            return self.send_one(datagrams);
        }
        // Several datagrams without offload: one by one (when the socket fills half-way, those
        // already out come again on the retry, duplicates that the protocol drops).
        for d in datagrams.chunks(self.datagram) {
            if !self.send_one(d)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.socket.poll_send_ready(cx)
    }

    fn segment_size(&self) -> Option<usize> {
        Some(self.segment.load(Ordering::Relaxed)).filter(|&s| s > 0)
    }

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut rb = ReadBuf::new(buf);
        match self.socket.poll_recv_from(cx, &mut rb) {
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(rb.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two members of group 239.255.77.`group` on loopback, with `datagram`-byte datagrams, on a
    /// port of this process (`port_offset` keeps tests of one process apart); `None`, saying it
    /// skipped, where the loopback interface cannot join a multicast group.
    fn two_members(group: u8, port_offset: u32, datagram: usize) -> Option<(UdpMulticast, UdpMulticast)> {
        let cfg = UdpConfig {
            group: Ipv4Addr::new(239, 255, 77, group),
            port: 40000 + ((std::process::id() + port_offset) % 20000) as u16,
            interface: Ipv4Addr::LOCALHOST,
            datagram,
            ttl: 0,
            buffer: 1 << 20,
        };
        match (UdpMulticast::join(&cfg), UdpMulticast::join(&cfg)) {
            (Ok(a), Ok(b)) => Some((a, b)),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("SKIPPED: cannot join a multicast group on loopback here: {e}");
                None
            }
        }
    }

    /// Sends `datagrams` once the socket is writable (a socket tokio has not yet seen writable
    /// refuses `try_send` with `WouldBlock`, as the driver's retry on `poll_send_ready` expects);
    /// false, saying it skipped, where loopback cannot send multicast.
    async fn sent(m: &UdpMulticast, datagrams: &[u8]) -> bool {
        let ready =
            tokio::time::timeout(std::time::Duration::from_secs(2), std::future::poll_fn(|cx| m.poll_send_ready(cx)))
                .await;
        let ok = matches!(ready, Ok(Ok(()))) && m.try_send(datagrams).unwrap_or(false);
        if !ok {
            eprintln!("SKIPPED: cannot send multicast on loopback (is `ip link set lo multicast on` done?)");
        }
        ok
    }

    /// Two members of a group on loopback see each other's datagrams (and their own:
    /// IP_MULTICAST_LOOP is on). Skipped when the loopback interface cannot do multicast.
    #[tokio::test]
    async fn loopback_group_delivers_to_every_member() {
        let Some((a, b)) = two_members(1, 0, 1400) else { return };
        if !sent(&a, b"hello").await {
            return;
        }
        let mut buf = [0u8; 64];
        for m in [&a, &b] {
            let got = tokio::time::timeout(
                std::time::Duration::from_secs(2),
                std::future::poll_fn(|cx| m.poll_recv(cx, &mut buf)),
            )
            .await;
            match got {
                Ok(Ok(n)) => assert_eq!(&buf[..n], b"hello"),
                _ => {
                    eprintln!("SKIPPED: loopback does not deliver multicast here (`ip link set lo multicast on`)");
                    return;
                }
            }
        }
    }

    /// Datagrams laid end to end in one send arrive as separate datagrams: with segmentation
    /// offload, and after it was turned off (the transport then sends them one by one).
    #[tokio::test]
    async fn a_run_of_datagrams_arrives_datagram_by_datagram() {
        let Some((a, b)) = two_members(2, 7, 1000) else { return };
        let run: Vec<u8> = (0..2500u32).map(|i| (i / 1000) as u8 + 1).collect();
        #[cfg(target_os = "linux")]
        assert_eq!(a.segment_size(), Some(1000), "UDP_SEGMENT refused");
        for offload in [true, false] {
            if !offload {
                a.segment.store(0, Ordering::Relaxed);
                #[cfg(target_os = "linux")]
                assert!(set_segment(&a.socket, 0));
            }
            if !sent(&a, &run).await {
                return;
            }
            let mut buf = [0u8; 4096];
            for (k, len) in [1000, 1000, 500].into_iter().enumerate() {
                let got = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    std::future::poll_fn(|cx| b.poll_recv(cx, &mut buf)),
                )
                .await;
                match got {
                    Ok(Ok(n)) => {
                        assert_eq!(n, len, "datagram {k} (offload {offload})");
                        assert!(buf[..n].iter().all(|&x| x == k as u8 + 1), "datagram {k} (offload {offload})");
                    }
                    _ => {
                        eprintln!("SKIPPED: loopback does not deliver multicast here (`ip link set lo multicast on`)");
                        return;
                    }
                }
            }
        }
    }
}
