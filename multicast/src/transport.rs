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
    /// Receives into `buf`: one datagram, or several the group sent in one segmented send laid
    /// end to end as they were sent (a transport that coalesces them on receipt, as UDP's
    /// generic receive offload does). `buf` should hold [`GSO_MAX_BYTES`]; what does not fit is
    /// lost, as a datagram would be.
    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<Received>>;
    /// `Some(s)`: [`MulticastTransport::try_send`] also takes several datagrams at once, laid end
    /// to end, each `s` bytes but the last (at most `s`), at most [`GSO_MAX_BYTES`] in all; the
    /// group receives them as separate datagrams. `None` (the default): one datagram per send.
    fn segment_size(&self) -> Option<usize> {
        None
    }
}

/// Most bytes one segmented send may carry (UDP's 65,507-byte payload limit, rounded down).
pub const GSO_MAX_BYTES: usize = 65_000;

/// What one receive put into the buffer: `len` bytes, datagrams of `segment` bytes each but the
/// last (which may be shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Bytes received.
    pub len: usize,
    /// Length of each datagram but the last (`len` for a single datagram).
    pub segment: usize,
}

impl Received {
    /// One datagram of `len` bytes.
    pub fn one(len: usize) -> Received {
        Received { len, segment: len }
    }

    /// The datagrams in `buf` (the buffer this receive filled).
    pub fn datagrams<'a>(&self, buf: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + use<'a> {
        buf[..self.len.min(buf.len())].chunks(self.segment.max(1))
    }
}

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
///
/// It receives with generic receive offload (`UDP_GRO`): a segmented send that reaches it
/// whole (over loopback, a veth pair or a bridge) is read by one system call instead of one per
/// datagram, the datagrams laid end to end with their size beside them ([`Received`]).
pub struct UdpMulticast {
    socket: UdpSocket,
    target: SocketAddr,
    datagram: usize,
    /// The segment size while segmentation offload is on; 0 when off.
    segment: AtomicUsize,
    /// Whether receives may return several datagrams at once (`UDP_GRO` is on; Linux only).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    coalesced: bool,
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
        let coalesced = set_gro(&s, true);
        let socket = UdpSocket::from_std(s.into())?;
        Ok(UdpMulticast {
            socket,
            target: SocketAddrV4::new(cfg.group, cfg.port).into(),
            datagram: cfg.datagram,
            segment: AtomicUsize::new(segment),
            coalesced,
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
    libc::c_int::try_from(size).is_ok_and(|v| set_udp_option(s, libc::UDP_SEGMENT, v))
}

/// Turns UDP generic receive offload on or off; false if the kernel refuses.
#[cfg(target_os = "linux")]
fn set_gro(s: &impl std::os::fd::AsRawFd, on: bool) -> bool {
    set_udp_option(s, libc::UDP_GRO, libc::c_int::from(on))
}

/// Sets the int option `name` at the UDP level of `s`; false if the kernel refuses.
#[cfg(target_os = "linux")]
fn set_udp_option(s: &impl std::os::fd::AsRawFd, name: libc::c_int, value: libc::c_int) -> bool {
    // SAFETY: a valid descriptor, and an int option of the right length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_UDP,
            name,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn set_segment<S>(_: &S, _: usize) -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn set_gro<S>(_: &S, _: bool) -> bool {
    false
}

/// One `recvmsg` on `fd` into `buf`, with the segment size the kernel reports for a coalesced
/// receive (`UDP_GRO`). A receive larger than `buf` is refused (`InvalidData`): its datagrams are
/// lost, as a datagram too large for the buffer would be.
#[cfg(target_os = "linux")]
fn recv_coalesced(fd: std::os::fd::RawFd, buf: &mut [u8]) -> io::Result<Received> {
    // Room for one control message of one int, aligned for `cmsghdr`.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero `msghdr` is valid (no name, no buffers); the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` points at `iov` (which covers `buf`) and `control`, all alive for the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let len = n as usize;
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a coalesced receive larger than the buffer"));
    }
    let mut segment = len;
    // SAFETY: the kernel filled `msg_control` up to `msg_controllen`; the CMSG macros walk it
    // within that length, and the UDP_GRO message carries one int.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                let size = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                segment = usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(len);
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received { len, segment })
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

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<Received>> {
        #[cfg(target_os = "linux")]
        if self.coalesced {
            use std::os::fd::AsRawFd;
            let fd = self.socket.as_raw_fd();
            loop {
                if let Err(e) = std::task::ready!(self.socket.poll_recv_ready(cx)) {
                    return Poll::Ready(Err(e));
                }
                match self.socket.try_io(tokio::io::Interest::READABLE, || recv_coalesced(fd, buf)) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    r => return Poll::Ready(r),
                }
            }
        }
        let mut rb = ReadBuf::new(buf);
        match self.socket.poll_recv_from(cx, &mut rb) {
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(Received::one(rb.filled().len()))),
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
                Ok(Ok(r)) => assert_eq!(r.datagrams(&buf).collect::<Vec<_>>(), [b"hello"]),
                _ => {
                    eprintln!("SKIPPED: loopback does not deliver multicast here (`ip link set lo multicast on`)");
                    return;
                }
            }
        }
    }

    /// Datagrams laid end to end in one send arrive as the same datagrams: sent with segmentation
    /// offload and after it was turned off (the transport then sends them one by one), received
    /// with receive offload (coalesced or not, as the kernel delivers them) and without.
    #[tokio::test]
    async fn a_run_of_datagrams_arrives_datagram_by_datagram() {
        let Some((a, mut b)) = two_members(2, 7, 1000) else { return };
        let run: Vec<u8> = (0..2500u32).map(|i| (i / 1000) as u8 + 1).collect();
        #[cfg(target_os = "linux")]
        {
            assert_eq!(a.segment_size(), Some(1000), "UDP_SEGMENT refused");
            assert!(b.coalesced, "UDP_GRO refused");
        }
        for (offload, gro) in [(true, true), (false, true), (true, false), (false, false)] {
            a.segment.store(if offload { 1000 } else { 0 }, Ordering::Relaxed);
            #[cfg(target_os = "linux")]
            assert!(set_segment(&a.socket, a.segment.load(Ordering::Relaxed)));
            #[cfg(target_os = "linux")]
            assert!(set_gro(&b.socket, gro));
            b.coalesced = gro;
            if !sent(&a, &run).await {
                return;
            }
            let (mut got, mut receives): (Vec<Vec<u8>>, u32) = (Vec::new(), 0);
            let mut buf = vec![0u8; GSO_MAX_BYTES];
            while got.len() < 3 {
                let r = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    std::future::poll_fn(|cx| b.poll_recv(cx, &mut buf)),
                )
                .await;
                match r {
                    Ok(Ok(r)) => {
                        receives += 1;
                        got.extend(r.datagrams(&buf).map(<[u8]>::to_vec));
                    }
                    _ => {
                        eprintln!("SKIPPED: loopback does not deliver multicast here (`ip link set lo multicast on`)");
                        return;
                    }
                }
            }
            let want: Vec<Vec<u8>> = run.chunks(1000).map(<[u8]>::to_vec).collect();
            assert_eq!(got, want, "offload {offload}, receive offload {gro}");
            // Loopback keeps a segmented send whole up to a socket that takes it so: one read.
            #[cfg(target_os = "linux")]
            assert_eq!(receives, if offload && gro { 1 } else { 3 }, "offload {offload}, receive offload {gro}");
        }
    }

    #[test]
    fn a_coalesced_receive_splits_at_its_segment_size() {
        let buf: Vec<u8> = (0..25u8).collect();
        let r = Received { len: 25, segment: 10 };
        let parts: Vec<&[u8]> = r.datagrams(&buf).collect();
        assert_eq!(parts, [&buf[..10], &buf[10..20], &buf[20..]]);
        assert_eq!(Received::one(7).datagrams(&buf).collect::<Vec<_>>(), [&buf[..7]]);
        assert_eq!(Received::one(0).datagrams(&buf).count(), 0);
        // A length past the buffer (never from a receive) stays within it.
        assert_eq!(Received { len: 99, segment: 0 }.datagrams(&buf).map(<[u8]>::len).sum::<usize>(), 25);
    }
}
