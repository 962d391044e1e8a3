//! Shared memory between the ranks of one host (Linux).
//!
//! Why it looks the way it does:
//! * **One SPSC byte ring per ordered pair of ranks** (module `ring`), in a segment file owned by the
//!   receiver. Monotonic u64 head/tail counters on separate cache lines, release/acquire only; a
//!   waiting receiver polls the stamp of the next frame (one cache line per small message), so a
//!   busy-polling [`Transport::progress`] on idle rings is a few loads and no system call.
//! * **Frames are a byte stream**, header + payload, wrapping at the end of the ring. A frame larger
//!   than the ring (a 512 KiB rendezvous chunk in a 256 KiB ring) simply streams through it while
//!   the receiver copies the pieces straight into [`Sink::data_dest`].
//! * **Single copy for large `Data` frames**: the ring carries a descriptor (address and length in
//!   the sender's memory) and the receiver copies with `process_vm_readv` into the destination. The
//!   sender keeps the bytes until the ring's tail passes the descriptor, which the receiver only
//!   publishes after its copy. Whether the kernel allows it (ptrace rules, seccomp) is probed once
//!   per peer at [`ShmEndpoint::connect`]; if not, one warning, the `ferrocomm_shm_cma_fallback`
//!   counter, and large frames stream through the ring instead.
//! * **Doorbells only for sleepers**: each rank has one eventfd and a "sleeping" flag in its
//!   segment; senders write the eventfd only when the flag is set (Dekker-style, SeqCst fences on
//!   both sides; model-checked with shuttle and loom in `model.rs`). The eventfd reaches the peers
//!   through `pidfd_getfd`; where that is refused, through a datagram socket in the abstract
//!   namespace. Sleeping itself is tokio's: the transport must be connected inside the runtime of
//!   the progress loop.
//! * **Peer death** is seen through a pidfd per peer: polled every [`ShmConfig::liveness_polls`]
//!   idle progress calls and watched by tokio while sleeping. A single-copy read also fails once the
//!   peer is gone. A dead peer's memory is never read again.
//! * **No files left behind**: segment files live in /dev/shm only between
//!   [`ShmEndpoint::create`] and the moment every local peer has mapped them (the last peer to map a
//!   segment unlinks it); then a crash leaves nothing. [`ShmTransport::unlink`] and
//!   [`remove_leftovers`] cover peers that never arrive.

mod ring;
mod segment;
mod stream;
mod sys;

#[cfg(test)]
mod model;

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use self::ring::{Atomics, Flushed, Inbox, Outbox, Remote, Ring, Std};
pub use self::segment::ShmError;
use self::segment::{Desc, MAX_CAPACITY, MIN_CAPACITY, Segment, check_job_id};
use crate::mapping::{shared_file_name as segment_name, shared_file_path as segment_path};
use crate::wire::{Header, Limits, Rank};
use crate::{Outgoing, Sink, Transport, TransportError};

/// Whether large `Data` frames are copied straight from the sender's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SingleCopy {
    /// Use `process_vm_readv` where the kernel allows it; otherwise stream through the ring.
    Auto,
    /// Always stream through the ring.
    Off,
    /// Behave as if the kernel refused `process_vm_readv` (tests the fallback: warning, counter).
    SimulateDenied,
}

/// How a sender reaches a sleeping receiver's doorbell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbell {
    /// The receiver's eventfd, fetched with `pidfd_getfd`; the socket where that is refused.
    Auto,
    /// Always the abstract-namespace datagram socket (tests the fallback).
    Socket,
}

/// Settings of the shared-memory transport.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Bytes of each ring (rounded up to a power of two, 4 KiB to 1 GiB).
    pub ring_capacity: usize,
    /// Largest eager payload this transport asks for (the engine's limit may be lower).
    pub eager_limit: usize,
    /// `Data` frames of at least this many bytes go by single copy (when allowed); from 64 KiB the
    /// sender copies half of it into the receiver meanwhile (`ring::Split`). Smaller ones stream
    /// through the ring: a frame that fits is written at once and costs no system call.
    ///
    /// The default, 64 KiB, sends every rendezvous chunk (messages above the 64 KiB eager limit, in
    /// 512 KiB chunks) by split single copy: on a 2-CPU VM, 4 MiB messages at about 20 GB/s split,
    /// against 6-8 GB/s streamed through the ring and about 10 GB/s for `process_vm_readv` by the
    /// receiver alone (`ferrocomm-bench pingpong --transport shm --recv-into --no-peer` with each
    /// threshold). Where streaming is faster than single copy, raise it.
    pub cma_threshold: usize,
    /// Bodies of at least this many bytes are copied into the ring with non-temporal stores, so
    /// that the receiver reads them from memory and not out of this CPU's cache (module `stream`:
    /// robust where CPUs are slow to hand each other dirty cache lines, as across dies or sockets);
    /// 0: never. Default 8 KiB; bootstrap turns it off on a host with more ranks than CPUs.
    pub nt_copy_min: usize,
    /// Whether large `Data` frames are copied straight from the sender's memory.
    pub single_copy: SingleCopy,
    /// How a sender reaches a sleeping receiver's doorbell.
    pub doorbell: Doorbell,
    /// Idle progress calls between two checks of the peers' liveness (busy calls count 1/16).
    pub liveness_polls: u32,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            ring_capacity: 256 * 1024,
            eager_limit: 16 * 1024,
            cma_threshold: 64 << 10,
            nt_copy_min: stream::MIN,
            single_copy: SingleCopy::Auto,
            doorbell: Doorbell::Auto,
            liveness_polls: 4096,
        }
    }
}

/// Counters of one transport (for tests and tuning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmStats {
    /// `Data` frames sent as descriptors.
    pub single_copy_sent: u64,
    /// `Data` frames received by `process_vm_readv`.
    pub single_copy_received: u64,
    /// `Data` frames streamed through a ring.
    pub streamed_data_sent: u64,
    /// Single copies received whose second half the sender was offered (the split copy).
    pub single_copy_split: u64,
    /// Second halves of split copies this rank wrote into a receiver.
    pub single_copy_halves_written: u64,
    /// Doorbells this rank rang (each one system call).
    pub doorbells_rung: u64,
    /// Peers for which single copy had to be given up.
    pub cma_fallbacks: u64,
    /// Peers reached through the socket doorbell.
    pub socket_doorbells: u64,
    /// Liveness checks (each one `poll` system call).
    pub liveness_checks: u64,
}

/// This rank's segment file; unlinked at the latest when dropped.
struct OwnSeg {
    seg: Segment,
    unlinked: bool,
}

impl OwnSeg {
    fn unlink(&mut self) {
        if !self.unlinked {
            self.unlinked = true;
            let _ = std::fs::remove_file(&self.seg.path);
        }
    }
}

impl Drop for OwnSeg {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// First set-up phase: this rank's segment, doorbell and descriptor exist; peers not yet known.
pub struct ShmEndpoint {
    job: String,
    me: Rank,
    cfg: ShmConfig,
    /// Local peers, sorted; ring `k` of our segment is written by `slots[k]`.
    slots: Vec<Rank>,
    own: Option<OwnSeg>,
    eventfd: OwnedFd,
    sock: UnixDatagram,
    probe: Box<[u64; 2]>,
}

impl ShmEndpoint {
    /// Creates this rank's segment (rings from every local peer) and doorbell. Publish the returned
    /// descriptor to the local peers (job key-value store), then call [`ShmEndpoint::connect`].
    /// `local_peers` may include `me`.
    pub fn create(job_id: &str, me: Rank, local_peers: &[Rank], cfg: ShmConfig) -> io::Result<(ShmEndpoint, Vec<u8>)> {
        check_job_id(job_id)?;
        let mut slots: Vec<Rank> = local_peers.iter().copied().filter(|&r| r != me).collect();
        slots.sort_unstable();
        slots.dedup();
        let cap = cfg.ring_capacity.clamp(MIN_CAPACITY, MAX_CAPACITY).next_power_of_two();
        let eventfd = sys::eventfd()?;
        let mut tries = 0;
        let (nonce, sock) = loop {
            let nonce = sys::random_u64();
            match sys::bell_socket(&segment_name(job_id, me, nonce)) {
                Ok(s) => break (nonce, s),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < 8 => tries += 1,
                Err(e) => return Err(e),
            }
        };
        let own = if slots.is_empty() {
            None
        } else {
            let seg = Segment::create(segment_path(job_id, me, nonce), me, &slots, cap, nonce)?;
            Some(OwnSeg { seg, unlinked: false })
        };
        let probe = Box::new([sys::random_u64(), sys::random_u64()]);
        let desc = Desc {
            rank: me,
            pid: std::process::id() as i32,
            eventfd: eventfd.as_raw_fd(),
            capacity: cap,
            nonce,
            start_time: sys::start_time("self").unwrap_or(0),
            probe_addr: probe.as_ptr() as u64,
            probe: *probe,
            slots: slots.clone(),
        };
        let ep = ShmEndpoint { job: job_id.to_owned(), me, cfg, slots, own, eventfd, sock, probe };
        Ok((ep, desc.encode()))
    }

    /// Second phase: maps every local peer's segment (given its published descriptor) and builds
    /// the transport. Must be called inside the tokio runtime of the progress loop. Every local
    /// peer needs exactly one descriptor; each is checked, and a bad one fails with a [`ShmError`]
    /// inside the `io::Error`.
    pub fn connect(self, peers: Vec<(Rank, Vec<u8>)>, limits: Limits) -> io::Result<ShmTransport> {
        tokio::runtime::Handle::try_current().map_err(|_| ShmError::NoRuntime)?;
        if let Some(&r) = self.slots.iter().find(|&&r| r >= limits.world_size) {
            return Err(ShmError::UnexpectedPeer(r).into());
        }
        let mut descs: Vec<Option<Desc>> = vec![None; self.slots.len()];
        for (rank, bytes) in &peers {
            let k = self.slots.binary_search(rank).map_err(|_| ShmError::UnexpectedPeer(*rank))?;
            if descs[k].is_some() {
                return Err(ShmError::DuplicatePeer(*rank).into());
            }
            descs[k] = Some(Desc::decode(*rank, bytes, self.me, limits.world_size)?);
        }
        let mut stats = ShmStats::default();
        let mut links = Vec::with_capacity(descs.len());
        for (k, d) in descs.into_iter().enumerate() {
            let d = d.ok_or(ShmError::MissingPeer(self.slots[k]))?;
            links.push(self.attach(k, d, limits, &mut stats)?);
        }
        // Producers wait for our `ready`; wake those already asleep.
        for l in &links {
            if let Some(c) = &l.conn {
                c.bell.ring();
            }
        }
        let ShmEndpoint { cfg, slots, mut own, eventfd, sock, probe, me, .. } = self;
        if let Some(o) = own.as_mut().filter(|o| o.seg.all_attached()) {
            o.unlink();
        }
        let bell = Bell { efd: watch(eventfd)?, sock: watch(sock)? };
        Ok(ShmTransport {
            me,
            eager_limit: cfg.eager_limit.min(limits.eager_limit),
            slots,
            links,
            own,
            bell,
            lost: Vec::new(),
            tick: 0,
            liveness_polls: cfg.liveness_polls.max(1),
            check_now: false,
            asleep: false,
            stats,
            _probe: probe,
        })
    }

    /// Maps peer `slots[k]`'s segment, fetches its doorbell, probes single copy, and tells it we
    /// are ready to receive.
    fn attach(&self, k: usize, d: Desc, limits: Limits, stats: &mut ShmStats) -> io::Result<Link> {
        let rank = d.rank;
        let gone = |e: io::Error| -> io::Error {
            if e.raw_os_error() == Some(libc::ESRCH) { ShmError::PeerGone(rank).into() } else { e }
        };
        let pidfd = sys::pidfd_open(d.pid).map_err(gone)?;
        if d.start_time != 0 && sys::start_time(&d.pid.to_string()).is_some_and(|t| t != d.start_time) {
            return Err(ShmError::PeerGone(rank).into());
        }
        let seg = Segment::open(&self.job, &d)?;
        let slot = d.slots.binary_search(&self.me).expect("checked by Desc::decode");
        seg.populate_ring(slot);
        let out_ring = seg.ring(slot);

        let fetched = match self.cfg.doorbell {
            Doorbell::Auto => match sys::pidfd_getfd(pidfd.as_fd(), d.eventfd) {
                Ok(fd) if sys::is_eventfd(fd.as_fd()) => Some(PeerBell::Event(fd)),
                Ok(_) => return Err(ShmError::BadDescriptor { rank, what: "eventfd" }.into()),
                Err(e) if sys::is_denied(&e) => {
                    tracing::debug!("pidfd_getfd refused ({e}); doorbell of rank {rank} via socket");
                    None
                }
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => {
                    return Err(ShmError::BadDescriptor { rank, what: "eventfd" }.into());
                }
                Err(e) => return Err(gone(e)),
            },
            Doorbell::Socket => None,
        };
        let bell = match fetched {
            Some(b) => b,
            None => {
                stats.socket_doorbells += 1;
                let s = sys::bell_connect(&segment_name(&self.job, rank, d.nonce)).map_err(|e| match e.kind() {
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => ShmError::PeerGone(rank).into(),
                    _ => e,
                })?;
                PeerBell::Socket(s)
            }
        };

        let threshold = match self.cfg.single_copy {
            SingleCopy::Off => 0,
            SingleCopy::SimulateDenied => {
                cma_fallback(rank, &io::Error::from_raw_os_error(libc::EPERM), stats);
                0
            }
            SingleCopy::Auto => {
                let mut got = [0u8; 16];
                match sys::read_remote(d.pid, d.probe_addr, &mut got) {
                    Ok(()) if got[..8] == d.probe[0].to_ne_bytes() && got[8..] == d.probe[1].to_ne_bytes() => {
                        self.cfg.cma_threshold.max(1) as u64
                    }
                    Ok(()) => return Err(ShmError::BadDescriptor { rank, what: "single-copy probe" }.into()),
                    Err(e) if sys::is_denied(&e) => {
                        cma_fallback(rank, &e, stats);
                        0
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(ShmError::PeerGone(rank).into()),
                    Err(_) => return Err(ShmError::BadDescriptor { rank, what: "single-copy probe address" }.into()),
                }
            }
        };
        let own = self.own.as_ref().expect("a segment exists when there are peers");
        let in_ring = own.seg.ring(k);
        let key = sys::random_u64();
        in_ring.hdr().ctl.cma_threshold.store(threshold, Relaxed);
        in_ring.hdr().ctl.stamp_key.store(key, Relaxed);
        in_ring.hdr().ctl.ready.store(1, Release);
        if seg.attach() {
            // Every peer of that rank has mapped its segment: the file is no longer needed.
            let _ = std::fs::remove_file(&seg.path);
        }
        Ok(Link {
            rank,
            conn: Some(Conn {
                out_ring,
                in_ring,
                seg,
                outbox: Outbox::new(self.cfg.nt_copy_min),
                inbox: Inbox::new(rank, limits, threshold, key, SPLIT_MIN),
                pid: d.pid,
                pidfd: watch(pidfd)?,
                bell,
                wait_set: false,
            }),
        })
    }
}

/// Registers a descriptor with tokio's reactor, for readability.
fn watch<T: std::os::fd::AsRawFd>(t: T) -> io::Result<AsyncFd<T>> {
    // SAFETY: `t` owns its descriptor and keeps it open and unchanged for the `AsyncFd`'s lifetime.
    Ok(unsafe { AsyncFd::register_with_interest(t, Interest::READABLE) }?)
}

/// Single copy is not allowed towards `rank`: one warning per process, one count per peer.
fn cma_fallback(rank: Rank, e: &io::Error, stats: &mut ShmStats) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "process_vm_readv refused ({e}, first seen with rank {rank}); large shared-memory messages are streamed \
             through the rings instead of copied once"
        )
    });
    metrics::counter!("ferrocomm_shm_cma_fallback").increment(1);
    stats.cma_fallbacks += 1;
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (`process_vm_readv`): the
/// single-copy collectives' reads. Fails (never blocks) if the kernel refuses or the range is not
/// mapped in that process.
pub fn copy_from_process(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    sys::read_remote(pid, addr, dst)
}

/// Copies `src` to `addr` in process `pid` (`process_vm_writev`): the single-copy collectives'
/// split copies. Fails (never blocks) as [`copy_from_process`].
pub fn copy_to_process(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    sys::write_remote(pid, addr, src)
}

/// Why this process cannot run the shared-memory transport, if it cannot: the transport watches
/// its peers' lives through pidfds, which kernels before 5.3, some container sandboxes (seccomp
/// profiles that predate the call) and tools such as valgrind refuse. Peers on the same host then
/// talk over TCP instead (the bootstrap asks every rank this before choosing).
pub fn unavailable() -> Option<io::Error> {
    // Only a refusal counts: another failure (out of descriptors, say) is not a property of this
    // kernel, and the transport's own setup then fails with it.
    // SAFETY: getpid has no preconditions.
    sys::pidfd_open(unsafe { libc::getpid() }).err().filter(sys::is_denied)
}

/// Whether the kernel's ptrace rules let a rank read its sibling ranks' memory (same user, not
/// each other's descendants): Yama's `ptrace_scope` 0 or absent, or 1-2 for a process that may
/// ptrace anything (root). Every rank of a host reads the same answer, so all choose alike.
pub fn single_copy_permitted() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => true,
        Ok(s) => match s.trim() {
            "0" => true,
            // SAFETY: geteuid has no preconditions.
            "1" | "2" => (unsafe { libc::geteuid() }) == 0,
            _ => false,
        },
    }
}

/// Removes segment files of `job_id` left in /dev/shm (a rank died before every peer mapped its
/// segment). For launchers, once no rank of the job runs any more. Returns how many were removed.
pub fn remove_leftovers(job_id: &str) -> io::Result<usize> {
    check_job_id(job_id)?;
    let prefix = format!("ferrocomm-{job_id}-");
    let mut n = 0;
    for e in std::fs::read_dir("/dev/shm")? {
        let e = e?;
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|s| s.strip_prefix(&prefix)) else { continue };
        // `<rank>-<16 hex digits>`, so that job "a" does not remove job "a-1"'s files.
        let ours = rest.split_once('-').is_some_and(|(r, nonce)| {
            r.parse::<Rank>().is_ok() && nonce.len() == 16 && nonce.bytes().all(|b| b.is_ascii_hexdigit())
        });
        if ours && std::fs::remove_file(e.path()).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// How we ring a peer.
enum PeerBell {
    Event(OwnedFd),
    Socket(UnixDatagram),
}

impl PeerBell {
    fn ring(&self) {
        match self {
            PeerBell::Event(fd) => sys::eventfd_signal(fd.as_fd()),
            PeerBell::Socket(s) => sys::socket_signal(s),
        }
    }
}

/// Our own doorbell, watched by tokio.
struct Bell {
    efd: AsyncFd<OwnedFd>,
    sock: AsyncFd<UnixDatagram>,
}

impl Bell {
    /// Empties both doorbells; true if either was rung. Leaves both registered with `cx`.
    fn poll_rung(&self, cx: &mut Context<'_>) -> bool {
        let mut rung = false;
        loop {
            match self.efd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => match sys::eventfd_drain(g.get_inner().as_fd()) {
                    Ok(true) => rung = true,
                    Ok(false) => g.clear_ready(),
                    Err(_) => return true,
                },
                Poll::Ready(Err(_)) => return true,
                Poll::Pending => break,
            }
        }
        loop {
            match self.sock.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => match sys::socket_drain(g.get_inner()) {
                    Ok(true) => rung = true,
                    Ok(false) => g.clear_ready(),
                    Err(_) => return true,
                },
                Poll::Ready(Err(_)) => return true,
                Poll::Pending => break,
            }
        }
        rung
    }
}

/// One local peer.
struct Link {
    rank: Rank,
    /// `None` once the connection is gone.
    conn: Option<Conn>,
}

struct Conn {
    /// Our ring in the peer's segment (we produce).
    out_ring: Ring<Std>,
    /// The peer's ring in our segment (we consume).
    in_ring: Ring<Std>,
    /// The peer's segment; outlives `out_ring` (fields drop in order, rings have no drop).
    seg: Segment,
    outbox: Outbox,
    inbox: Inbox,
    pid: i32,
    pidfd: AsyncFd<OwnedFd>,
    bell: PeerBell,
    /// We asked the peer to ring when it frees space in `out_ring`.
    wait_set: bool,
}

impl Conn {
    /// Writes what fits of the queued output into the ring; releases finished single-copy sources.
    #[inline(always)]
    fn flush(&mut self, stats: &mut ShmStats) -> Result<usize, TransportError> {
        if !self.outbox.pending() {
            return Ok(0);
        }
        self.flush_pending(stats)
    }

    #[inline(never)]
    fn flush_pending(&mut self, stats: &mut ShmStats) -> Result<usize, TransportError> {
        let f = self.outbox.flush(&self.out_ring, self.seg.sleeping())?;
        Ok(self.flushed(f, stats))
    }

    /// Rings the doorbell if a flush found the consumer asleep; counts what it sent.
    fn flushed(&mut self, f: Flushed, stats: &mut ShmStats) -> usize {
        if f.ring {
            self.bell.ring();
            stats.doorbells_rung += 1;
        }
        stats.single_copy_sent += f.descs;
        stats.streamed_data_sent += f.streamed;
        f.work
    }

    #[inline(always)]
    fn step(&mut self, sink: &mut dyn Sink, stats: &mut ShmStats) -> Result<usize, TransportError> {
        let mut work = self.flush(stats)?;
        let mut peer = PeerProcess { pid: self.pid, pidfd: &self.pidfd, in_ring: &self.in_ring };
        let helped = self.outbox.help(&self.out_ring, &mut peer);
        stats.single_copy_halves_written += helped;
        let p = self.inbox.parse(&self.in_ring, sink, &mut peer)?;
        if p.frames > 0 {
            self.outbox.prefetch_next(&self.out_ring);
        }
        stats.single_copy_received += p.copies;
        stats.single_copy_split += p.split;
        if p.released && self.inbox.producer_waits(&self.in_ring) {
            self.bell.ring();
            stats.doorbells_rung += 1;
        }
        work += p.frames + helped as usize;
        Ok(work)
    }

    /// Delivers the whole frames a closed or dead peer left in its ring (no single-copy reads).
    fn drain(&mut self, sink: &mut dyn Sink) {
        while let Ok(p) = self.inbox.parse(&self.in_ring, sink, &mut Gone) {
            if p.frames == 0 {
                break;
            }
        }
    }
}

/// The peer process of a connection, for single copies.
struct PeerProcess<'a> {
    pid: i32,
    pidfd: &'a AsyncFd<OwnedFd>,
    /// The ring it writes (closed when it closes the connection).
    in_ring: &'a Ring<Std>,
}

impl Remote for PeerProcess<'_> {
    /// Trusts the bytes only if the peer is still the same running process and has not closed
    /// the connection (and maybe freed the source).
    fn read(&mut self, addr: u64, dst: &mut [u8]) -> Result<(), TransportError> {
        if let Err(e) = sys::read_remote(self.pid, addr, dst) {
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Err(TransportError::Closed);
            }
            tracing::warn!("single-copy read from pid {} failed: {e}", self.pid);
            return Err(e.into());
        }
        if !self.alive() || self.in_ring.closed() {
            return Err(TransportError::Closed);
        }
        Ok(())
    }

    fn write(&mut self, addr: u64, src: &[u8]) -> Result<(), TransportError> {
        sys::write_remote(self.pid, addr, src).map_err(|e| {
            tracing::debug!("single-copy write to pid {} failed: {e}", self.pid);
            TransportError::from(e)
        })
    }

    fn alive(&mut self) -> bool {
        sys::exited(&[self.pidfd.get_ref().as_fd()]).is_empty()
    }
}

/// A peer that died or closed: no single copies.
struct Gone;

impl Remote for Gone {
    fn read(&mut self, _: u64, _: &mut [u8]) -> Result<(), TransportError> {
        Err(TransportError::Closed)
    }
    fn write(&mut self, _: u64, _: &[u8]) -> Result<(), TransportError> {
        Err(TransportError::Closed)
    }
    fn alive(&mut self) -> bool {
        false
    }
}

/// The shared-memory transport of one rank: reaches its local peers.
pub struct ShmTransport {
    me: Rank,
    eager_limit: usize,
    slots: Vec<Rank>,
    /// `links[k]` is the peer `slots[k]`. Declared before `own`: its rings point into it.
    links: Vec<Link>,
    own: Option<OwnSeg>,
    bell: Bell,
    lost: Vec<(Rank, TransportError)>,
    /// Progress calls since the last liveness check (idle ones weigh [`IDLE_WEIGHT`]).
    tick: u32,
    liveness_polls: u32,
    check_now: bool,
    /// Our sleeping flag (and maybe `prod_wait` flags) are set.
    asleep: bool,
    stats: ShmStats,
    /// The single-copy probe peers read at connect.
    _probe: Box<[u64; 2]>,
}

const IDLE_WEIGHT: u32 = 16;

/// Single copies of at least this many bytes are split between receiver and sender (see
/// `ring::Split`): below it, a second system call and the wait for the sender to notice cost
/// more than half the copy.
const SPLIT_MIN: u64 = 64 * 1024;

impl ShmTransport {
    /// This rank.
    pub fn rank(&self) -> Rank {
        self.me
    }

    /// Counters since creation.
    pub fn stats(&self) -> ShmStats {
        self.stats
    }

    /// Removes this rank's segment file now (peers that have not mapped it yet cannot connect any
    /// more). Happens by itself once every local peer has mapped it, and on drop.
    pub fn unlink(&mut self) {
        if let Some(o) = self.own.as_mut() {
            o.unlink();
        }
    }

    /// Whether this rank's segment file is gone from /dev/shm.
    pub fn is_unlinked(&self) -> bool {
        self.own.as_ref().is_none_or(|o| o.unlinked)
    }

    fn index(&self, peer: Rank) -> Option<usize> {
        self.slots.binary_search(&peer).ok()
    }

    /// [`Transport::send`] of an owned or borrowed payload.
    #[inline]
    fn send_with(&mut self, peer: Rank, header: Header, payload: impl Outgoing) {
        let Some(k) = self.index(peer) else { return };
        let Some(c) = self.links[k].conn.as_mut() else { return };
        // The latency path: a small frame with nothing queued before it goes straight into the
        // ring.
        let r = match c.outbox.write_now(&c.out_ring, c.seg.sleeping(), &header, payload.as_ref()) {
            Some(r) => r.map(|f| c.flushed(f, &mut self.stats)),
            None => {
                c.outbox.push(&header, payload.into_bytes());
                // Nothing queued before it: write it into the ring now, instead of waiting for
                // the next progress call.
                if c.outbox.queued() == 1 { c.flush(&mut self.stats) } else { Ok(0) }
            }
        };
        if let Err(e) = r {
            self.fail(k, e, true);
        }
    }

    /// Ends the connection to `links[k]`. `notify`: the peer is alive, tell it (closed flag and
    /// doorbell); a dead peer's memory is not touched.
    fn fail(&mut self, k: usize, err: TransportError, notify: bool) {
        let link = &mut self.links[k];
        let Some(mut c) = link.conn.take() else { return };
        c.in_ring.close();
        if notify {
            c.out_ring.close();
            Std::fence();
            c.bell.ring();
        }
        // Only now may the single-copy sources go: the peer checks `closed` after each copy.
        c.outbox.clear();
        self.lost.push((link.rank, err));
    }

    /// Reports peers that died or closed the connection (one `poll` over all pidfds).
    fn check_peers(&mut self, sink: &mut dyn Sink) {
        self.tick = 0;
        self.check_now = false;
        self.stats.liveness_checks += 1;
        let live: Vec<usize> = (0..self.links.len()).filter(|&k| self.links[k].conn.is_some()).collect();
        let exited = {
            let fds: Vec<_> =
                live.iter().map(|&k| self.links[k].conn.as_ref().unwrap().pidfd.get_ref().as_fd()).collect();
            sys::exited(&fds)
        };
        for (i, &k) in live.iter().enumerate() {
            let c = self.links[k].conn.as_mut().unwrap();
            let dead = exited.contains(&i);
            if dead || c.in_ring.closed() {
                c.drain(sink);
                self.fail(k, TransportError::Closed, false);
            }
        }
        if let Some(o) = self.own.as_mut().filter(|o| !o.unlinked && o.seg.all_attached()) {
            o.unlink();
        }
    }

    /// Clears the flags set by `poll_ready` (we are awake again).
    fn wake(&mut self) {
        self.asleep = false;
        if let Some(o) = &self.own {
            let s = o.seg.sleeping();
            if s.load(Relaxed) != 0 {
                s.store(0, Relaxed);
            }
        }
        for c in self.links.iter_mut().filter_map(|l| l.conn.as_mut()) {
            if c.wait_set {
                c.wait_set = false;
                c.out_ring.hdr().prod_wait.0.store(0, Relaxed);
            }
        }
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn eager_limit(&self) -> usize {
        self.eager_limit
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        self.send_with(peer, header, payload)
    }

    fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
        self.send_with(peer, header, payload)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        let mut work = 0;
        for k in 0..self.links.len() {
            let Some(c) = self.links[k].conn.as_mut() else { continue };
            match c.step(sink, &mut self.stats) {
                Ok(n) => work += n,
                // A failed single-copy read of a process that is gone: nothing to tell it.
                Err(TransportError::Closed) => {
                    c.drain(sink);
                    self.fail(k, TransportError::Closed, false)
                }
                Err(e) => self.fail(k, e, true),
            }
        }
        self.tick += if work == 0 { IDLE_WEIGHT } else { 1 };
        if self.check_now || self.tick >= self.liveness_polls.saturating_mul(IDLE_WEIGHT) {
            self.check_peers(sink);
        }
        for (peer, err) in self.lost.drain(..) {
            sink.peer_lost(peer, err);
            work += 1;
        }
        work
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.lost.is_empty() || self.check_now {
            return Poll::Ready(());
        }
        let mut ready = self.bell.poll_rung(cx);
        for c in self.links.iter().filter_map(|l| l.conn.as_ref()) {
            if c.pidfd.poll_read_ready(cx).is_ready() {
                self.check_now = true;
                ready = true;
            }
        }
        if ready {
            return Poll::Ready(());
        }
        // Announce the sleep, then look once more (Dekker: the peers publish, fence, read the flags).
        self.asleep = true;
        if let Some(o) = &self.own {
            o.seg.sleeping().store(1, Relaxed);
        }
        for c in self.links.iter_mut().filter_map(|l| l.conn.as_mut()) {
            c.wait_set = c.outbox.announce_sleep(&c.out_ring);
        }
        Std::fence();
        for c in self.links.iter_mut().filter_map(|l| l.conn.as_mut()) {
            if c.in_ring.closed() {
                self.check_now = true;
                ready = true;
            }
            ready |= c.inbox.has_input(&c.in_ring) || c.outbox.can_progress(&c.out_ring);
        }
        if ready { Poll::Ready(()) } else { Poll::Pending }
    }

    fn awake(&mut self) {
        if self.asleep {
            self.wake();
        }
    }

    fn has_pending_output(&self) -> bool {
        self.links.iter().filter_map(|l| l.conn.as_ref()).any(|c| c.outbox.pending())
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        if let Some(k) = self.index(peer) {
            self.fail(k, reason, true);
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        // Tell every live peer we are gone, before the single-copy sources are freed.
        let conns: Vec<&Conn> = self.links.iter().filter_map(|l| l.conn.as_ref()).collect();
        for c in &conns {
            c.out_ring.close();
            c.in_ring.close();
        }
        Std::fence();
        for c in conns {
            c.bell.ring();
        }
    }
}
