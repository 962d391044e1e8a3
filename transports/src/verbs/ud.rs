//! Unreliable multicast on the fabric: one UD send reaches every queue pair attached to the
//! group, through the switch (or, on one host, the RDMA device's loopback). This is the
//! datagram layer under reliable multicast (the `ferrocomm-multicast` crate implements its
//! `MulticastTransport` trait on [`UdMulticast`]); the reliability protocol on top copes with
//! loss, duplication and reordering, so nothing here retries.
//!
//! Why a device context of its own rather than the point-to-point transport's: the multicast
//! transport is polled from the channel's driver task and from the application's sending calls
//! (`&self`, any thread), while the verbs point-to-point transport is owned by one engine thread;
//! sharing its completion queue would route completions between the two. A second context costs
//! a protection domain and two completion queues per channel, and lets reliable multicast use UD
//! whatever carries the point-to-point half.
//!
//! * **Group**: a multicast GID derived from an IPv4 group address (the one the communicator
//!   agrees for UDP multicast): on RoCE v2 the IPv4-mapped `::ffff:a.b.c.d`, which the device sends
//!   as an IPv4 multicast packet to `a.b.c.d`. The queue pair attaches to it
//!   (`ibv_attach_mcast`), and a UDP socket joins `a.b.c.d` on the device's interface (IGMP), as
//!   `rdma_cm` does for RoCE groups: the NIC's attach only programs its own filter, while switches
//!   (IGMP snooping) and, on one host, the kernel's IP layer deliver a group only to members
//!   they know of. InfiniBand groups need the subnet manager (an SA join through `rdma_cm`),
//!   which ferrocomm does not link: on an InfiniBand port [`UdMulticast::join`] fails with
//!   `Unsupported`, and the caller falls back to UDP or point-to-point.
//! * **Datagrams** of at most the port's active MTU (payload; each receive buffer has 40 more
//!   bytes in front for the global route header the device writes there).
//! * **Receive pool**: `recv_buffers` buffers (or a byte budget's worth at the MTU,
//!   [`UdConfig::recv_bytes`]) in one registration, all posted at start; a
//!   buffer is posted again as soon as its datagram is copied out (or dropped), so the pool stays
//!   posted while the reader keeps up, and a reader that falls behind loses datagrams at the
//!   device (what UDP's socket buffer does too), never grows memory.
//! * **Send buffers**: `send_buffers` slots in one registration; a send copies the datagram into a
//!   free slot. One send in [`SIGNAL_EVERY`] (and the one that takes the last free slot) asks for
//!   a completion entry: a send queue completes in order, so that entry frees its slot and every
//!   slot sent before it. Per datagram that saves the device a completion entry and the sender a
//!   poll (a 1 MiB message over a 1 KiB MTU is a thousand datagrams).
//! * **Own datagrams**: the device delivers a group's datagram to every queue pair attached,
//!   the sender's own included (Soft-RoCE does). Those are recognized by their source (this queue
//!   pair's number and this device's IPv4 address, from the work completion and the IPv4 header
//!   in the GRH space) and their buffer goes straight back to the device: no copy, no
//!   authentication above for a datagram the sender would only discard.
//! * **Waiting**: receive completions go to the device context's completion queue, send
//!   completions to a second one; each has its own completion channel registered with tokio, so
//!   a receiver and a sender waiting at once each get their wake-up.
//! * **Loss injection** for tests ([`UdConfig::test_drop`]): a fraction of the datagrams received
//!   is dropped here, in the receive path, as if the fabric had lost them.

use std::collections::VecDeque;
use std::io;
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use ibverbs_sys as ffi;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::sys::udqp::{Ah, CompQueue, GRH, UdQp};
use super::sys::{Device, Mr, access, wc_array};

/// The largest receive pool a byte budget ([`UdConfig::recv_bytes`]) buys.
pub const MAX_RECV_BUFFERS: u32 = 8192;

/// One send in this many asks for a completion entry (see the module documentation).
pub const SIGNAL_EVERY: u32 = 16;

/// Where the source IPv4 address sits in a receive buffer's 40-byte GRH space on RoCE v2 over
/// IPv4 (the IPv4 header fills its last 20 bytes).
const GRH_IPV4_SOURCE: usize = 20 + 12;

/// Where a UD multicast group lives and how it is sized.
#[derive(Clone, Debug)]
pub struct UdConfig {
    /// Device name (`rxe0`, `mlx5_0`); the first device when `None`.
    pub device: Option<String>,
    /// GID table index; by default the first RoCE v2 entry with an IPv4 address.
    pub gid_index: Option<u8>,
    /// IPv4 multicast address the group's GID is derived from (224.0.0.0/4).
    pub group: Ipv4Addr,
    /// Largest datagram wanted; the group carries the smaller of this and the port's MTU.
    pub datagram: usize,
    /// Receive buffers kept posted (when `recv_bytes` is 0).
    pub recv_buffers: u32,
    /// Bytes of datagrams the receive pool holds (0: `recv_buffers` buffers): the pool gets
    /// this many bytes' worth of buffers at the port's MTU, 256 to [`MAX_RECV_BUFFERS`]. A
    /// budget in bytes rather than buffers, because a UD datagram is at most the MTU (1 to 4 KiB)
    /// whatever the datagram size configured: a pool counted in configured datagrams (60 KB on a
    /// loopback) holds a few hundred MTU-sized ones, and a receiver that falls that far behind a
    /// burst loses what arrives while no buffer is posted (UD has no receiver-not-ready retry).
    pub recv_bytes: usize,
    /// Send slots (datagrams in flight from this member).
    pub send_buffers: u32,
    /// Test setting: probability of dropping each datagram received. 0 in production.
    pub test_drop: f64,
    /// Seed of the drop decisions (any value; different per member for independent losses).
    pub seed: u64,
}

impl UdConfig {
    /// Defaults for `group`: 512 receive buffers, 128 send slots, datagrams up to the MTU.
    pub fn new(group: Ipv4Addr) -> UdConfig {
        UdConfig {
            device: None,
            gid_index: None,
            group,
            datagram: usize::MAX,
            recv_buffers: 512,
            recv_bytes: 0,
            send_buffers: 128,
            test_drop: 0.0,
            seed: 1,
        }
    }
}

/// Counters of one member.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UdStats {
    /// Datagrams posted for sending.
    pub sent: u64,
    /// Datagrams received and handed out.
    pub received: u64,
    /// Datagrams received and dropped by [`UdConfig::test_drop`].
    pub dropped: u64,
    /// Failed work completions (receive or send) and runt datagrams.
    pub errors: u64,
    /// Datagrams cut to the reader's buffer.
    pub truncated: u64,
    /// This member's own datagrams, delivered back by the device and skipped.
    pub own: u64,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    dropped: AtomicU64,
    errors: AtomicU64,
    truncated: AtomicU64,
    own: AtomicU64,
}

/// A completion channel's descriptor, for tokio (owned by the device or the send queue).
struct Watch(RawFd);

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// One member of a UD multicast group (see the module documentation).
pub struct UdMulticast {
    // Declared before `inner`: deregistered from tokio before the descriptors close.
    recv_ready: AsyncFd<Watch>,
    send_ready: AsyncFd<Watch>,
    inner: Mutex<Inner>,
    counters: Counters,
    datagram: usize,
    mtu: usize,
    recv_buffers: u32,
    test_drop: f64,
}

/// Verbs state, behind the lock. Field order is drop order: the IGMP membership, the QP (which
/// flushes and detaches), its address handle and send CQ, the registrations, their memory, and
/// the device (its receive CQ, PD and context) last.
struct Inner {
    _igmp: UdpSocket,
    qp: UdQp,
    ah: Ah,
    send_cq: CompQueue,
    recv_mr: Mr,
    send_mr: Mr,
    recv_mem: Box<[u8]>,
    send_mem: Box<[u8]>,
    dev: Device,
    /// Bytes per receive buffer (GRH + MTU) and per send slot (MTU).
    recv_slot: usize,
    send_slot: usize,
    /// Receive buffers holding a datagram not yet read: (buffer, payload length).
    ready: VecDeque<(u32, u32)>,
    free_send: Vec<u32>,
    /// Slots sent and not known complete, in send order.
    in_flight: VecDeque<u32>,
    /// Sends since the last one that asked for a completion entry.
    unsignaled: u32,
    /// This member's source: its queue pair's number and its IPv4 address.
    own_qpn: u32,
    own_ip: [u8; 4],
    rng: u64,
    /// Why the queue pair stopped working (flushed receives): no datagram will come any more.
    broken: Option<String>,
}

impl UdMulticast {
    /// Opens the device, creates the UD queue pair, attaches it to the group and posts the
    /// receive pool. Needs a tokio runtime (the completion channels register with its reactor).
    pub fn join(cfg: &UdConfig) -> io::Result<UdMulticast> {
        if !cfg.group.is_multicast() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a multicast address", cfg.group),
            ));
        }
        if !(0.0..=1.0).contains(&cfg.test_drop) || cfg.recv_buffers == 0 || cfg.send_buffers == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad UD multicast settings {cfg:?}")));
        }
        let most = if cfg.recv_bytes > 0 { MAX_RECV_BUFFERS } else { cfg.recv_buffers };
        let dev = Device::open(cfg.device.as_deref(), cfg.gid_index, most as i32 + 16)?;
        if !dev.roce {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "{}: InfiniBand multicast groups are made by the subnet manager (rdma_cm), not supported",
                    dev.name
                ),
            ));
        }
        if dev.gid[..12] != [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: GID index {} has no IPv4 address (RoCE v2 over IPv4 is needed)", dev.name, dev.gid_index),
            ));
        }
        let iface = Ipv4Addr::new(dev.gid[12], dev.gid[13], dev.gid[14], dev.gid[15]);
        let mtu = 128usize << dev.active_mtu.clamp(1, 5);
        let datagram = cfg.datagram.min(mtu);
        let mut mgid = [0u8; 16];
        mgid[10] = 0xff;
        mgid[11] = 0xff;
        mgid[12..].copy_from_slice(&cfg.group.octets());
        // Every member derives the same Q_Key from the group; the high bit (controlled Q_Keys)
        // stays clear.
        let qkey = u32::from(cfg.group) & 0x7fff_ffff;

        let recv_buffers = if cfg.recv_bytes > 0 {
            (cfg.recv_bytes / (GRH + mtu)).clamp(256, MAX_RECV_BUFFERS as usize) as u32
        } else {
            cfg.recv_buffers
        };
        let send_cq = CompQueue::new(&dev, cfg.send_buffers as i32 + 16)?;
        let mut qp = dev.create_ud_qp(&send_cq, cfg.send_buffers, recv_buffers, qkey)?;
        qp.attach(mgid)?;
        let igmp = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        igmp.join_multicast_v4(&cfg.group, &iface)
            .map_err(|e| io::Error::new(e.kind(), format!("IGMP join of {} on {iface}: {e}", cfg.group)))?;
        let ah = dev.create_ah(mgid)?;

        let recv_slot = GRH + mtu;
        let mut recv_mem = vec![0u8; recv_slot * recv_buffers as usize].into_boxed_slice();
        let mut send_mem = vec![0u8; mtu * cfg.send_buffers as usize].into_boxed_slice();
        // SAFETY: both allocations are owned by `Inner`, which drops the registrations first.
        let recv_mr = unsafe { dev.register(recv_mem.as_mut_ptr(), recv_mem.len(), access::LOCAL) }?;
        // SAFETY: as above.
        let send_mr = unsafe { dev.register(send_mem.as_mut_ptr(), send_mem.len(), access::LOCAL) }?;

        let mut inner = Inner {
            _igmp: igmp,
            qp,
            ah,
            send_cq,
            recv_mr,
            send_mr,
            recv_mem,
            send_mem,
            dev,
            recv_slot,
            send_slot: mtu,
            ready: VecDeque::new(),
            free_send: (0..cfg.send_buffers).rev().collect(),
            in_flight: VecDeque::with_capacity(cfg.send_buffers as usize),
            unsignaled: 0,
            own_qpn: 0,
            own_ip: iface.octets(),
            rng: cfg.seed | 1,
            broken: None,
        };
        inner.own_qpn = inner.qp.qpn();
        for i in 0..recv_buffers {
            inner.post_recv(i)?;
        }
        inner.dev.arm()?;
        inner.send_cq.arm()?;
        // Registered last, so that no early return leaves a registration behind a closed channel.
        // SAFETY: each descriptor stays open while its `Watch` exists: `UdMulticast` drops the
        // `AsyncFd`s before `inner`, which owns the channels.
        let recv_ready = unsafe { AsyncFd::register_with_interest(Watch(inner.dev.channel_fd()), Interest::READABLE) }?;
        // SAFETY: as above.
        let send_ready = unsafe { AsyncFd::register_with_interest(Watch(inner.send_cq.fd()), Interest::READABLE) }?;
        Ok(UdMulticast {
            recv_ready,
            send_ready,
            inner: Mutex::new(inner),
            counters: Counters::default(),
            datagram,
            mtu,
            recv_buffers,
            test_drop: cfg.test_drop,
        })
    }

    /// Receive buffers in the pool.
    pub fn recv_buffers(&self) -> u32 {
        self.recv_buffers
    }

    /// Largest datagram the group carries.
    pub fn max_datagram(&self) -> usize {
        self.datagram
    }

    /// The port's active MTU in bytes.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// Counters of this member.
    pub fn stats(&self) -> UdStats {
        let c = &self.counters;
        UdStats {
            sent: c.sent.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            truncated: c.truncated.load(Ordering::Relaxed),
            own: c.own.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends one datagram to the group without blocking; `Ok(false)` when every send slot is in
    /// flight (wait with [`UdMulticast::poll_send_ready`]). A datagram over
    /// [`UdMulticast::max_datagram`] is refused with `InvalidInput`.
    pub fn try_send(&self, datagram: &[u8]) -> io::Result<bool> {
        if datagram.len() > self.datagram {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("datagram of {} bytes over the group's {}", datagram.len(), self.datagram),
            ));
        }
        let mut g = self.lock();
        g.reap_sends(&self.counters)?;
        let Some(slot) = g.free_send.pop() else { return Ok(false) };
        let at = slot as usize * g.send_slot;
        g.send_mem[at..at + datagram.len()].copy_from_slice(datagram);
        let addr = g.send_mem.as_ptr() as u64 + at as u64;
        let lkey = g.send_mr.lkey();
        // The last free slot's send is always signaled: whoever waits for a slot then has a
        // completion entry coming.
        let signaled = g.unsignaled + 1 >= SIGNAL_EVERY || g.free_send.is_empty();
        // SAFETY: the slot is registered, owned by this send until it is known complete (it is
        // off the free list until then: `reap_sends`), and lives as long as the QP.
        match unsafe { g.qp.post_send(u64::from(slot), &g.ah, (addr, datagram.len() as u32, lkey), signaled) } {
            Ok(()) => {
                g.in_flight.push_back(slot);
                g.unsignaled = if signaled { 0 } else { g.unsignaled + 1 };
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) => {
                g.free_send.push(slot);
                Err(e)
            }
        }
    }

    /// `Ready` when a send slot is free.
    pub fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = self.lock();
        loop {
            if let Err(e) = g.reap_sends(&self.counters) {
                return Poll::Ready(Err(e));
            }
            if !g.free_send.is_empty() {
                return Poll::Ready(Ok(()));
            }
            match self.send_ready.poll_read_ready(cx) {
                Poll::Ready(Ok(mut r)) => {
                    g.send_cq.drain_events();
                    r.clear_ready();
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
            // Arm, then look once more: a completion that came before arming raises no event.
            if let Err(e) = g.send_cq.arm() {
                return Poll::Ready(Err(e));
            }
            if let Err(e) = g.reap_sends(&self.counters) {
                return Poll::Ready(Err(e));
            }
            return if g.free_send.is_empty() { Poll::Pending } else { Poll::Ready(Ok(())) };
        }
    }

    /// Receives one datagram into `buf` (cut to its length), returning its length.
    pub fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut g = self.lock();
        loop {
            if let Some(n) = g.take(buf, &self.counters) {
                return Poll::Ready(n);
            }
            match g.reap_recvs(&self.counters, self.test_drop) {
                Ok(0) => {}
                Ok(_) => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
            if g.broken.is_some() {
                // Nothing will arrive any more: the protocol recovers over point-to-point.
                return Poll::Pending;
            }
            match self.recv_ready.poll_read_ready(cx) {
                Poll::Ready(Ok(mut r)) => {
                    g.dev.drain_events();
                    r.clear_ready();
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
            if let Err(e) = g.dev.arm() {
                return Poll::Ready(Err(e));
            }
            match g.reap_recvs(&self.counters, self.test_drop) {
                Ok(0) => return Poll::Pending,
                Ok(_) => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl Inner {
    fn post_recv(&mut self, i: u32) -> io::Result<()> {
        let addr = self.recv_mem.as_ptr() as u64 + (i as usize * self.recv_slot) as u64;
        // SAFETY: buffer `i` is registered, lives as long as the QP, and is not read again until
        // its completion is polled (it is neither in `ready` nor handed out meanwhile).
        unsafe { self.qp.post_recv(u64::from(i), addr, self.recv_slot as u32, self.recv_mr.lkey()) }
    }

    /// Copies the oldest datagram received into `buf` and posts its buffer again.
    fn take(&mut self, buf: &mut [u8], c: &Counters) -> Option<io::Result<usize>> {
        let (i, len) = self.ready.pop_front()?;
        let at = i as usize * self.recv_slot + GRH;
        let n = (len as usize).min(buf.len());
        if n < len as usize {
            c.truncated.fetch_add(1, Ordering::Relaxed);
        }
        buf[..n].copy_from_slice(&self.recv_mem[at..at + n]);
        c.received.fetch_add(1, Ordering::Relaxed);
        Some(self.post_recv(i).map(|()| n))
    }

    /// Moves polled receive completions into `ready` (or straight back to the device: failed,
    /// runt or test-dropped); returns how many completions there were.
    fn reap_recvs(&mut self, c: &Counters, test_drop: f64) -> io::Result<usize> {
        let mut wcs = wc_array::<32>();
        let n = self.dev.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            let i = wc.wr_id() as u32;
            if let Some((status, vendor)) = wc.error() {
                if status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                    self.broken.get_or_insert_with(|| "receive queue flushed".into());
                    continue;
                }
                tracing::debug!(status, vendor, "UD receive failed");
                c.errors.fetch_add(1, Ordering::Relaxed);
                self.post_recv(i)?;
            } else if wc.len() < GRH || wc.len() > self.recv_slot {
                c.errors.fetch_add(1, Ordering::Relaxed);
                self.post_recv(i)?;
            } else if wc.src_qp == self.own_qpn && self.source_ip(i) == self.own_ip {
                c.own.fetch_add(1, Ordering::Relaxed);
                self.post_recv(i)?;
            } else if test_drop > 0.0 && self.coin() < test_drop {
                c.dropped.fetch_add(1, Ordering::Relaxed);
                self.post_recv(i)?;
            } else {
                self.ready.push_back((i, (wc.len() - GRH) as u32));
            }
        }
        Ok(n)
    }

    /// Frees the send slots whose completions have come.
    fn reap_sends(&mut self, c: &Counters) -> io::Result<()> {
        let mut wcs = wc_array::<32>();
        loop {
            let n = self.send_cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                if let Some((status, vendor)) = wc.error() {
                    tracing::debug!(status, vendor, "UD send failed");
                    c.errors.fetch_add(1, Ordering::Relaxed);
                }
                // This send and every one before it are done (in order; a failed send completes
                // with an entry whether it asked for one or not).
                let done = wc.wr_id() as u32;
                if self.in_flight.contains(&done) {
                    while let Some(slot) = self.in_flight.pop_front() {
                        self.free_send.push(slot);
                        if slot == done {
                            break;
                        }
                    }
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// The source IPv4 address of the datagram in receive buffer `i` (RoCE v2 over IPv4).
    fn source_ip(&self, i: u32) -> [u8; 4] {
        let at = i as usize * self.recv_slot + GRH_IPV4_SOURCE;
        self.recv_mem[at..at + 4].try_into().expect("4 bytes")
    }

    /// A uniform draw in [0, 1) (xorshift64).
    fn coin(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}
