//! The verbs transport driver: set-up, completion handling, slot writing. The protocol rules
//! live in [`super::link`] and [`super::regcache`]; this file only moves work between them, the
//! device and the [`Sink`].

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::task::{Context, Poll};

use bytes::Bytes;
use ibverbs_sys as ffi;
use slab::Slab;
use tokio::io::Interest;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};

use super::link::{self, Credits, LinkKind, Remote, SLOT_HEADER, SendQueue};
use super::regcache::{Pin, RegCache, Registrar};
use super::sys::{self, Device, Mr, Op, Qp, QpAddr, Srq, access};
use super::{Eager, Rendezvous, VerbsConfig};
use crate::wire::{Header, Kind, Limits, Rank, WireError, flags};
use crate::{Outgoing, Sink, Transport, TransportError};

pub use super::sys::device_names;

// A child of this module: it reaches the connections and the device.
#[path = "rma.rs"]
mod rma;

/// Descriptor magic, `"FCVB"`.
const MAGIC: u32 = u32::from_le_bytes(*b"FCVB");
/// 4: eager messages travel in compact slots ([`link`]); a peer of version 3 could not read them.
const DESC_VERSION: u8 = 4;
const DESC_HEAD: usize = 40;
const DESC_PEER: usize = 24;
/// Outstanding RDMA reads per QP (initiator and responder).
const RD_ATOMIC: u8 = 16;
/// Completions taken per poll.
const POLL_BATCH: usize = 32;
/// RTS lengths remembered per peer (a legitimate peer has at most its engine credits pending).
const MAX_RTS_PENDING: usize = 1 << 16;
const IDLE_WEIGHT: u32 = 16;
/// Inline data asked of each QP: a slot header plus a small payload (`ib_send_lat` inlines up
/// to 236 bytes too); the device may grant less, or none.
const INLINE: u32 = 256;

/// `wr_id` = peer index << 40 | kind << 32 | token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wr {
    /// A ring's receive (no buffer: write-with-immediate only consumes it).
    Recv = 0,
    /// A signaled slot write.
    Slot = 1,
    Write = 2,
    Read = 3,
    /// A pool buffer in the shared receive queue (token: its index; the peer is told by the
    /// completion's QP number).
    SharedRecv = 4,
    /// An unsignaled slot write: it has a completion only if it fails (or is flushed).
    QuietSlot = 5,
    /// A one-sided operation's work request (`rma`).
    Rma = 6,
}

fn wr_id(peer: usize, kind: Wr, token: u32) -> u64 {
    ((peer as u64) << 40) | ((kind as u64) << 32) | u64::from(token)
}

fn split_wr(id: u64) -> (usize, u64, u32) {
    ((id >> 40) as usize, (id >> 32) & 0xff, id as u32)
}

/// Whether a completion of this kind is a signaled send request's, which retires it and the
/// unsignaled ones posted before it (receives retire nothing; an unsignaled request only
/// completes when it fails, and its signaled successor still completes after it).
fn is_signaled_send(kind: u64) -> bool {
    [Wr::Slot, Wr::Write, Wr::Read].iter().any(|&w| w as u64 == kind)
}

/// Where an arrived slot lies.
#[derive(Clone, Copy)]
enum Landed {
    /// In the connection's ring, at the slot the immediate names.
    Ring,
    /// In pool buffer `buf` of the shared receive queue, `len` bytes.
    Pool { buf: u32, len: usize },
}

impl Registrar for Device {
    type Region = Mr;
    fn register(&mut self, addr: *const u8, len: usize, access: u32) -> io::Result<Mr> {
        // SAFETY: the registration cache keeps the memory alive for the region's lifetime.
        unsafe { Device::register(self, addr as *mut u8, len, access) }
    }
}

/// Memory the device reads or writes: a heap block addressed only through raw pointers while
/// it is registered.
struct Block {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap memory.
unsafe impl Send for Block {}

impl Block {
    fn new(len: usize) -> Block {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        Block { len, ptr: Box::into_raw(b).cast() }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: made by `Block::new` from a boxed slice of `len` bytes, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// A registered block (region dropped before the memory).
struct RegBlock {
    mr: Mr,
    block: Block,
}

impl RegBlock {
    fn new(dev: &Device, len: usize, access: u32) -> io::Result<RegBlock> {
        let block = Block::new(len);
        // SAFETY: the block outlives its region (the region is dropped first).
        Ok(RegBlock { mr: unsafe { dev.register(block.ptr, block.len, access)? }, block })
    }

    /// Slot `i` of `size` bytes.
    fn slot(&self, i: u32, size: usize) -> *mut u8 {
        assert!((i as usize + 1) * size <= self.block.len, "slot {i} outside its block");
        // SAFETY: inside the block, as just checked.
        unsafe { self.block.ptr.add(i as usize * size) }
    }
}

/// The shared receive queue and its pool of slot-sized buffers ([`Eager::SharedQueue`]).
/// Dropped after every QP that uses it (field order of its owners), the queue before the pool.
struct SharedRecv {
    srq: Srq,
    pool: RegBlock,
    buffers: u32,
    /// QP number -> connection index, sorted by QP number.
    by_qpn: Vec<(u32, usize)>,
}

impl SharedRecv {
    /// Hands pool buffer `i` (back) to the device.
    fn post(&self, i: u32, slot_size: usize) -> io::Result<()> {
        // SAFETY: the pool lives as long as the queue; the buffer is not read again before its
        // next completion.
        unsafe {
            self.srq.post_recv(
                wr_id(0, Wr::SharedRecv, i),
                self.pool.slot(i, slot_size) as u64,
                slot_size as u32,
                self.pool.mr.lkey(),
            )
        }
    }

    fn conn_of(&self, qpn: u32) -> Option<usize> {
        self.by_qpn.binary_search_by_key(&qpn, |&(q, _)| q).ok().map(|i| self.by_qpn[i].1)
    }
}

/// Counters of one transport (for tests and tuning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerbsStats {
    /// Slots written to peers (credit updates included).
    pub slots_sent: u64,
    /// Slots received from peers.
    pub slots_received: u64,
    /// Buffers in the shared receive queue's pool (0 with rings).
    pub srq_buffers: u32,
    /// Credit-only slots sent.
    pub credit_updates: u64,
    /// Rendezvous chunks moved by RDMA write.
    pub rdma_writes: u64,
    /// Rendezvous chunks moved by RDMA read.
    pub rdma_reads: u64,
    /// Chunk-sized receive buffers registered for one operation.
    pub recv_registrations: u64,
    /// The registration cache's counters.
    pub cache: super::regcache::CacheStats,
}

/// First set-up phase: device open, one QP and ring per peer; nothing connected yet.
pub struct VerbsEndpoint {
    me: Rank,
    cfg: VerbsConfig,
    slot_size: usize,
    peers: Vec<Setup>,
    shared: Option<SharedRecv>,
    dev: Device,
}

struct Setup {
    rank: Rank,
    qp: Qp,
    psn: u32,
    /// Where the peer writes (rings only).
    ring: Option<RegBlock>,
    stage: RegBlock,
}

impl VerbsEndpoint {
    /// Opens the device and prepares a connection to every other rank of `world_size`. Publish
    /// the returned descriptor (job key-value store), then call [`VerbsEndpoint::connect`].
    pub fn create(me: Rank, limits: Limits, cfg: VerbsConfig) -> io::Result<(VerbsEndpoint, Vec<u8>)> {
        let slots = cfg.slots.clamp(2, 1 << 16);
        let cfg = VerbsConfig { slots, ..cfg };
        let slot_size = (SLOT_HEADER + limits.eager_limit).next_multiple_of(64);
        let npeers = limits.world_size.saturating_sub(1) as usize;
        // Per peer: twice `slots` receives (some may wait to be posted again, see
        // `VerbsTransport::repost`), plus per slot one write, one RDMA write and reads.
        let recv_wr = 2 * slots;
        let send_wr = 2 * slots + 2 * u32::from(RD_ATOMIC) + 8;
        // Plus the one-sided loopback pair's send queue (`rma`), which shares the CQ.
        let cq = ((recv_wr + send_wr) as usize * npeers.max(1) + send_wr as usize).min(32_000) as i32;
        let dev = Device::open(cfg.device.as_deref(), cfg.gid_index, cq)?;
        let ring_len = slot_size * slots as usize;
        let shared = match cfg.eager {
            Eager::Ring => None,
            Eager::SharedQueue => {
                let want = if cfg.srq_buffers == 0 { slots.saturating_mul(npeers as u32) } else { cfg.srq_buffers };
                let buffers = want.clamp(1, dev.max_srq_wr()?.max(1));
                if buffers < want {
                    tracing::warn!(want, buffers, device = %dev.name, "shared receive queue capped by the device");
                }
                let srq = dev.create_srq(buffers)?;
                let pool = RegBlock::new(&dev, slot_size * buffers as usize, access::LOCAL)?;
                Some(SharedRecv { srq, pool, buffers, by_qpn: Vec::new() })
            }
        };
        let mut peers = Vec::with_capacity(npeers);
        for rank in (0..limits.world_size).filter(|&r| r != me) {
            let qp = dev.create_qp(send_wr, recv_wr, INLINE, shared.as_ref().map(|s| &s.srq))?;
            let psn = random_u32() & 0xff_ffff;
            let ring = match shared {
                None => Some(RegBlock::new(&dev, ring_len, access::REMOTE_WRITE)?),
                Some(_) => None,
            };
            let stage = RegBlock::new(&dev, ring_len, access::LOCAL)?;
            peers.push(Setup { rank, qp, psn, ring, stage });
        }
        let entries: Vec<DescEntry> = peers
            .iter()
            .map(|p| DescEntry {
                rank: p.rank,
                qpn: p.qp.qpn(),
                psn: p.psn,
                ring: p.ring.as_ref().map_or((0, 0), |r| (r.block.ptr as u64, r.mr.rkey())),
            })
            .collect();
        let d = encode_desc(me, (dev.lid, dev.gid), (slots, slot_size, cfg.eager), &entries);
        tracing::debug!(rank = me, device = %dev.name, gid_index = dev.gid_index, roce = dev.roce,
                        eager = ?cfg.eager, srq_buffers = shared.as_ref().map(|s| s.buffers), "verbs endpoint");
        Ok((VerbsEndpoint { me, cfg, slot_size, peers, shared, dev }, d))
    }

    /// Second phase: connects every QP given the peers' descriptors and their liveness channels
    /// (`liveness[rank]`, the bootstrap TCP connections), posts the receives, and builds the
    /// transport. Call every rank's `connect` before any sends (a barrier through the store):
    /// a QP that is not yet connected drops what arrives. Must run inside the tokio runtime of
    /// the progress loop.
    pub fn connect(
        self,
        descs: Vec<(Rank, Vec<u8>)>,
        mut liveness: Vec<Option<TcpStream>>,
        limits: Limits,
    ) -> io::Result<VerbsTransport> {
        let VerbsEndpoint { me, cfg, slot_size, peers, mut shared, mut dev } = self;
        let mut conns = Vec::with_capacity(peers.len());
        let bad = |r: Rank, what: &str| {
            io::Error::new(io::ErrorKind::InvalidData, format!("verbs descriptor of rank {r}: {what}"))
        };
        for (k, s) in peers.into_iter().enumerate() {
            let (_, d) = descs.iter().find(|(r, _)| *r == s.rank).ok_or_else(|| bad(s.rank, "missing"))?;
            let remote = parse_desc(d, s.rank, me, (cfg.slots, slot_size, cfg.eager)).map_err(|w| bad(s.rank, w))?;
            s.qp.connect(&dev, s.psn, &remote.qp, RD_ATOMIC)?;
            match &mut shared {
                None => {
                    for _ in 0..2 * cfg.slots {
                        s.qp.post_recv(wr_id(k, Wr::Recv, 0))?;
                    }
                }
                Some(sh) => sh.by_qpn.push((s.qp.qpn(), k)),
            }
            let sock = liveness.get_mut(s.rank as usize).and_then(Option::take);
            let sock = match sock {
                Some(t) => {
                    t.set_nonblocking(true)?;
                    // SAFETY: the stream owns its descriptor for the AsyncFd's lifetime.
                    Some(unsafe { AsyncFd::register_with_interest(t, Interest::READABLE) }?)
                }
                None => None,
            };
            conns.push(Conn {
                rank: s.rank,
                qp: s.qp,
                ring: s.ring,
                stage: s.stage,
                remote_ring: remote.ring,
                credits: Credits::new(cfg.slots),
                out: VecDeque::new(),
                sq: SendQueue::default(),
                recv_owed: 0,
                rts_len: HashMap::new(),
                exposed: HashMap::new(),
                targets: HashMap::new(),
                lent: Slab::new(),
                writes: Slab::new(),
                reads: Slab::new(),
                sock,
                failing: None,
                dead: false,
                bye: false,
            });
        }
        if let Some(sh) = &mut shared {
            sh.by_qpn.sort_unstable();
            for i in 0..sh.buffers {
                sh.post(i, slot_size)?;
            }
        }
        let chan = dev.channel_fd();
        // SAFETY: the channel's descriptor stays open while `Watch` (declared before the device
        // in `VerbsTransport`) exists; the device owns it.
        let channel = unsafe { AsyncFd::register_with_interest(Watch(chan), Interest::READABLE) }?;
        dev.arm()?;
        let send_wr = 2 * cfg.slots + 2 * u32::from(RD_ATOMIC) + 8;
        Ok(VerbsTransport {
            me,
            eager_limit: limits.eager_limit,
            limits,
            slot_size,
            sq_depth: send_wr,
            rendezvous: cfg.rendezvous,
            liveness_polls: cfg.liveness_polls.max(1),
            rma: rma::RmaState::new(&dev, send_wr)?,
            conns,
            stats: VerbsStats { srq_buffers: shared.as_ref().map_or(0, |s| s.buffers), ..VerbsStats::default() },
            shared,
            cache: RegCache::new(cfg.cache_entries, cfg.cache_bytes),
            lost: Vec::new(),
            wcs: Vec::new(),
            wc_buf: Box::new(sys::wc_array()),
            tick: 0,
            check_now: false,
            channel,
            dev,
        })
    }
}

/// A raw descriptor watched by tokio (owned elsewhere).
struct Watch(i32);

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> i32 {
        self.0
    }
}

struct RemoteDesc {
    qp: QpAddr,
    ring: (u64, u32),
}

fn eager_code(e: Eager) -> u8 {
    match e {
        Eager::Ring => 0,
        Eager::SharedQueue => 1,
    }
}

/// One peer's queue pair and ring in a descriptor.
struct DescEntry {
    rank: Rank,
    qpn: u32,
    psn: u32,
    /// Ring address and key (zero without rings).
    ring: (u64, u32),
}

/// A rank's descriptor, published through the store: its address (LID, GID), its slot geometry
/// and eager path, and one entry per peer.
fn encode_desc(me: Rank, (lid, gid): (u16, [u8; 16]), geometry: (u32, usize, Eager), peers: &[DescEntry]) -> Vec<u8> {
    let (slots, slot_size, eager) = geometry;
    let mut d = Vec::with_capacity(DESC_HEAD + DESC_PEER * peers.len());
    d.extend_from_slice(&MAGIC.to_le_bytes());
    d.push(DESC_VERSION);
    d.push(eager_code(eager));
    d.extend_from_slice(&lid.to_le_bytes());
    d.extend_from_slice(&me.to_le_bytes());
    d.extend_from_slice(&slots.to_le_bytes());
    d.extend_from_slice(&(slot_size as u32).to_le_bytes());
    d.extend_from_slice(&(peers.len() as u32).to_le_bytes());
    d.extend_from_slice(&gid);
    for p in peers {
        d.extend_from_slice(&p.rank.to_le_bytes());
        d.extend_from_slice(&p.qpn.to_le_bytes());
        d.extend_from_slice(&p.psn.to_le_bytes());
        d.extend_from_slice(&p.ring.1.to_le_bytes());
        d.extend_from_slice(&p.ring.0.to_le_bytes());
    }
    d
}

/// Finds `me`'s entry in `peer`'s descriptor and checks the slot geometry and eager path match
/// ours. Never trusts a length it has not checked: a bad descriptor is an error, not a panic.
fn parse_desc(
    d: &[u8],
    peer: Rank,
    me: Rank,
    (slots, slot_size, eager): (u32, usize, Eager),
) -> Result<RemoteDesc, &'static str> {
    if d.len() < DESC_HEAD {
        return Err("too short");
    }
    let u32_at = |i: usize| u32::from_le_bytes(d[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().unwrap());
    if u32_at(0) != MAGIC || d[4] != DESC_VERSION {
        return Err("bad magic or version");
    }
    let lid = u16::from_le_bytes([d[6], d[7]]);
    if u32_at(8) != peer {
        return Err("names another rank");
    }
    if u32_at(12) != slots || u32_at(16) as usize != slot_size {
        return Err("slot geometry differs (slots, eager limit): every rank needs the same settings");
    }
    if d[5] != eager_code(eager) {
        return Err("eager path differs (ring or srq): every rank needs the same setting");
    }
    let n = u32_at(20) as usize;
    if d.len() != DESC_HEAD + n * DESC_PEER {
        return Err("length does not match its peer count");
    }
    let gid: [u8; 16] = d[24..40].try_into().unwrap();
    (0..n)
        .map(|i| DESC_HEAD + i * DESC_PEER)
        .find(|&o| u32_at(o) == me)
        .map(|o| RemoteDesc {
            qp: QpAddr { qpn: u32_at(o + 4), psn: u32_at(o + 8), lid, gid },
            ring: (u64_at(o + 16), u32_at(o + 12)),
        })
        .ok_or("has no queue pair for this rank")
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: writes at most 4 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    if n == 4 { u32::from_ne_bytes(b) } else { std::process::id().wrapping_mul(2_654_435_761) }
}

/// Something waiting to be written to a peer.
enum Out {
    Frame(Header, Bytes),
    ReadDone(u32),
}

/// A receive buffer registered for the peer to write into (write rendezvous).
struct Exposed {
    _mr: Mr,
    len: u64,
    remaining: u64,
}

/// A peer's buffer we write into.
struct Target {
    remote: Remote,
    remaining: u64,
}

/// A chunk lent to the peer for reading, or the source of an RDMA write in flight.
struct Lent {
    pin: Pin,
    _data: Bytes,
}

/// An RDMA read in flight into a sink buffer.
struct Reading {
    header: Header,
    token: u32,
    mr: Mr,
}

struct Conn {
    rank: Rank,
    // Declared before the rings: the QP goes first (no more device access to them).
    qp: Qp,
    ring: Option<RegBlock>,
    stage: RegBlock,
    remote_ring: (u64, u32),
    credits: Credits,
    out: VecDeque<Out>,
    /// Send work requests posted and not yet known complete.
    sq: SendQueue,
    /// Receive work requests (rings) used up by arrived slots and not posted again yet.
    recv_owed: u32,
    /// Receiver side: rendezvous lengths announced by the peer's RTS frames, by message id.
    rts_len: HashMap<u64, u64>,
    /// Receiver side (write rendezvous): our buffers the peer may write, by receive id.
    exposed: HashMap<u64, Exposed>,
    /// Sender side (write rendezvous): the peer's buffers, by its receive id.
    targets: HashMap<u64, Target>,
    /// Sender side (read rendezvous): chunks lent, by token.
    lent: Slab<Lent>,
    /// RDMA writes in flight, by token.
    writes: Slab<Lent>,
    /// RDMA reads in flight, by token.
    reads: Slab<Reading>,
    sock: Option<AsyncFd<TcpStream>>,
    /// Why the connection is ending; reported once no work request is outstanding.
    failing: Option<TransportError>,
    /// Ended and reported: nothing more happens on it.
    dead: bool,
    bye: bool,
}

impl Conn {
    fn live(&self) -> bool {
        self.failing.is_none() && !self.dead
    }

    /// Whether a frame's slot may be written now: live, a slot credit free (the last is kept for
    /// credit updates) and room in a send queue of `sq_depth` (a slot may bring an RDMA write).
    fn can_write(&self, sq_depth: u32) -> bool {
        self.live() && self.credits.can_send(false) && self.sq.used() + 2 <= sq_depth
    }

    /// How the connection ends when the peer goes: it left (said goodbye) or it was lost.
    fn ending(&self) -> TransportError {
        if self.bye { TransportError::Left } else { TransportError::Closed }
    }
}

/// The verbs transport of one rank.
pub struct VerbsTransport {
    me: Rank,
    eager_limit: usize,
    limits: Limits,
    slot_size: usize,
    sq_depth: u32,
    rendezvous: Rendezvous,
    liveness_polls: u32,
    /// Declared before the cache and the device: QPs and receive registrations go first.
    conns: Vec<Conn>,
    /// One-sided operations (after the connections, before the device).
    rma: rma::RmaState,
    /// After the QPs that use it.
    shared: Option<SharedRecv>,
    cache: RegCache<Mr>,
    lost: Vec<(Rank, TransportError)>,
    /// Completions polled by `poll_ready`, handled by the next `progress`.
    wcs: Vec<ffi::ibv_wc>,
    /// Where the completion queue is polled into (not zeroed on every call).
    wc_buf: Box<[ffi::ibv_wc; POLL_BATCH]>,
    tick: u32,
    check_now: bool,
    stats: VerbsStats,
    channel: AsyncFd<Watch>,
    dev: Device,
}

impl VerbsTransport {
    /// This rank.
    pub fn rank(&self) -> Rank {
        self.me
    }

    /// [`Transport::send`] of an owned or borrowed payload.
    fn send_with(&mut self, peer: Rank, header: Header, payload: impl Outgoing) {
        let Some(k) = self.index(peer).filter(|&k| self.conns[k].live()) else { return };
        let c = &self.conns[k];
        // Nothing queued before it, a slot and room in the send queue: written now (copied into
        // a registered slot), so the caller's send does not wait for a progress round (which
        // polls the completion queue first). The others take the queue, where `progress` has
        // the sink.
        if c.out.is_empty() && one_slot(&header) && c.can_write(self.sq_depth) {
            if let Err(e) = self.write_slot(k, LinkKind::Frame, Some(&header), Remote::default(), payload.as_ref()) {
                self.fail(k, e);
            }
            return;
        }
        self.conns[k].out.push_back(Out::Frame(header, payload.into_bytes()));
    }

    /// Counters since creation.
    pub fn stats(&self) -> VerbsStats {
        VerbsStats { cache: self.cache.stats(), ..self.stats }
    }

    /// Work still involving the device or a peer: posted requests, chunks lent or being
    /// written, reads in flight (0 when quiet).
    pub fn in_flight(&self) -> usize {
        self.conns
            .iter()
            .filter(|c| !c.dead)
            .map(|c| c.sq.confirmable() as usize + c.lent.len() + c.writes.len() + c.reads.len() + c.out.len())
            .sum()
    }

    /// Invalidates now the cached registrations of buffers the program has freed (otherwise
    /// done at the next registration).
    pub fn sweep_registrations(&mut self) {
        self.cache.sweep();
    }

    /// The device in use (`rxe0`, ...).
    pub fn device(&self) -> &str {
        &self.dev.name
    }

    fn index(&self, peer: Rank) -> Option<usize> {
        let k = if peer < self.me { peer } else { peer.checked_sub(1)? } as usize;
        (peer != self.me && k < self.conns.len()).then_some(k)
    }

    /// Starts ending connection `k`: no more traffic; outstanding work is flushed.
    fn fail(&mut self, k: usize, err: TransportError) {
        let c = &mut self.conns[k];
        if c.failing.is_some() || c.dead {
            return;
        }
        tracing::debug!(peer = c.rank, %err, "verbs connection ends");
        c.qp.set_error();
        if let Some(s) = &c.sock {
            let _ = s.get_ref().shutdown(Shutdown::Both);
        }
        c.out.clear();
        c.targets.clear();
        c.rts_len.clear();
        c.failing = Some(err);
    }

    /// Reports connections whose flushed work has all completed.
    fn reap(&mut self) {
        for c in &mut self.conns {
            if c.sq.settled()
                && let Some(err) = c.failing.take()
            {
                // Nothing can touch the sink's buffers any more: drop their registrations first.
                c.exposed.clear();
                c.reads.clear();
                for l in c.lent.drain().chain(c.writes.drain()) {
                    self.cache.release(l.pin);
                }
                c.sock = None;
                self.lost.push((c.rank, err));
                c.dead = true;
            }
        }
    }

    fn handle_wc(&mut self, wc: &ffi::ibv_wc, sink: &mut dyn Sink) {
        let (k, kind, token) = split_wr(wc.wr_id());
        if kind == Wr::Rma as u64 {
            return self.on_rma_wc(wc, k, token);
        }
        if kind == Wr::SharedRecv as u64 {
            return self.on_shared_recv(wc, token, sink);
        }
        let Some(c) = self.conns.get_mut(k) else { return };
        if is_signaled_send(kind) {
            c.sq.retire();
        }
        let ok = wc.is_valid();
        if kind == Wr::Write as u64 && c.writes.contains(token as usize) {
            let l = c.writes.remove(token as usize);
            self.cache.release(l.pin);
        }
        if kind == Wr::Read as u64 && c.reads.contains(token as usize) {
            // Deregister before the engine may free the buffer.
            let r = c.reads.remove(token as usize);
            if ok && c.live() {
                drop(r.mr);
                self.stats.rdma_reads += 1;
                sink.frame(c.rank, r.header, Bytes::new());
                c.out.push_back(Out::ReadDone(r.token));
            }
        }
        if !ok {
            self.failed(k, wc);
        } else if kind == Wr::Recv as u64
            && c.live()
            && let Err(e) = self.on_slot(k, imm_of(wc), Landed::Ring, sink)
        {
            self.fail(k, e);
        }
    }

    /// A work request of connection `k` failed (or was flushed): the connection ends.
    fn failed(&mut self, k: usize, wc: &ffi::ibv_wc) {
        let c = &self.conns[k];
        if c.live() {
            let (status, vendor) = wc.error().unwrap_or_default();
            tracing::debug!(peer = c.rank, status, vendor, "verbs work request failed");
            self.fail(k, c.ending());
        }
    }

    /// A pool buffer of the shared receive queue completed: a slot from the peer whose QP
    /// took it, or a flush. The buffer goes back to the queue in any case, once read.
    fn on_shared_recv(&mut self, wc: &ffi::ibv_wc, buf: u32, sink: &mut dyn Sink) {
        let ss = self.slot_size;
        let Some(sh) = &self.shared else { return };
        if buf >= sh.buffers {
            return;
        }
        match sh.conn_of(wc.qp_num) {
            Some(k) if !wc.is_valid() => self.failed(k, wc),
            Some(k) if self.conns[k].live() => {
                let landed = Landed::Pool { buf, len: wc.len().min(ss) };
                if let Err(e) = self.on_slot(k, imm_of(wc), landed, sink) {
                    self.fail(k, e);
                }
            }
            _ => {}
        }
        let sh = self.shared.as_ref().expect("checked above");
        if let Err(e) = sh.post(buf, ss) {
            // Only a broken device refuses a buffer it just gave back: every peer is lost.
            tracing::error!("reposting a shared receive buffer failed: {e}");
            for k in 0..self.conns.len() {
                self.fail(k, TransportError::Io(e.kind()));
            }
        }
    }

    /// Slot `imm` from peer `k` arrived where `landed` says.
    fn on_slot(&mut self, k: usize, imm: u32, landed: Landed, sink: &mut dyn Sink) -> Result<(), TransportError> {
        let (limits, ss) = (self.limits, self.slot_size);
        let c = &mut self.conns[k];
        let slot = c.credits.arrive(imm)?;
        if let Landed::Ring = landed {
            // Its receive request is used up: posted again once idle (`repost`), or now if half
            // of the spare ones are owed.
            c.recv_owed += 1;
            if c.recv_owed * 2 >= c.credits.slots() {
                Self::repost(k, c)?;
            }
        }
        let (ptr, len) = match (landed, &c.ring, &self.shared) {
            (Landed::Ring, Some(ring), _) => (ring.slot(slot, ss), ss),
            (Landed::Pool { buf, len }, _, Some(sh)) => (sh.pool.slot(buf, ss), len),
            _ => return Err(WireError::Link("slot where this transport has no buffer").into()),
        };
        // SAFETY: the device placed the slot completely (its completion was polled). Neither
        // does the peer rewrite it (it hears of the release below only with our next slot) nor
        // is the pool buffer reposted before this returns.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        let p = link::decode(bytes, c.rank, &limits)?;
        // Lent to the sink, for as long as this call (see above).
        let payload = p.payload(bytes);
        c.credits.release();
        c.credits.on_freed(p.freed)?;
        self.stats.slots_received += 1;
        let peer = c.rank;
        match (p.kind, p.header) {
            (LinkKind::Credit, _) => {}
            (LinkKind::ReadDone, _) => {
                let t = p.remote.token as usize;
                if !c.lent.contains(t) {
                    return Err(WireError::Link("DONE for nothing lent").into());
                }
                let l = c.lent.remove(t);
                self.cache.release(l.pin);
            }
            (LinkKind::Frame | LinkKind::Eager, Some(h)) => {
                match h.kind {
                    Kind::Rts => {
                        if c.rts_len.len() >= MAX_RTS_PENDING {
                            return Err(WireError::Unexpected(Kind::Rts).into());
                        }
                        c.rts_len.insert(h.seq, h.aux);
                    }
                    Kind::Bye => c.bye = true,
                    _ => {}
                }
                sink.frame_ref(peer, h, payload);
            }
            (LinkKind::CtsBuf, Some(h)) => {
                c.targets.insert(h.aux, Target { remote: p.remote, remaining: p.remote.len });
                sink.frame(peer, h, Bytes::new());
            }
            (LinkKind::DataWritten, Some(h)) => {
                let Some(e) = c.exposed.get_mut(&h.seq) else {
                    return Err(WireError::Unexpected(Kind::Data).into());
                };
                let len = u64::from(h.len);
                if h.aux.checked_add(len).is_none_or(|end| end > e.len) || len > e.remaining {
                    return Err(
                        WireError::Oversize { kind: Kind::Data, len: h.aux.saturating_add(len), max: e.len }.into()
                    );
                }
                e.remaining -= len;
                if e.remaining == 0 {
                    // Deregister before the engine may free the buffer.
                    c.exposed.remove(&h.seq);
                }
                sink.frame(peer, h, Bytes::new());
            }
            (LinkKind::DataRead, Some(h)) => {
                let Some(dst) = sink.data_dest(peer, &h)? else {
                    c.out.push_back(Out::ReadDone(p.remote.token));
                    sink.frame(peer, h, Bytes::new());
                    return Ok(());
                };
                let (ptr, len) = (dst.as_mut_ptr(), dst.len());
                if len == 0 {
                    c.out.push_back(Out::ReadDone(p.remote.token));
                    sink.frame(peer, h, Bytes::new());
                    return Ok(());
                }
                // SAFETY: the sink keeps the slice valid until it gets this frame or the loss.
                let mr = unsafe { self.dev.register(ptr, len, access::LOCAL)? };
                self.stats.recv_registrations += 1;
                let lkey = mr.lkey();
                let token = c.reads.insert(Reading { header: h, token: p.remote.token, mr }) as u32;
                // SAFETY: the destination stays registered and valid until the completion.
                unsafe {
                    c.qp.post_send(
                        wr_id(k, Wr::Read, token),
                        Op::Read,
                        ptr as u64,
                        len as u32,
                        lkey,
                        p.remote.addr,
                        p.remote.rkey,
                        true,
                    )?
                };
                c.sq.posted(false);
            }
            _ => return Err(WireError::Link("slot without header").into()),
        }
        Ok(())
    }

    /// Posts again the receive requests of connection `k` that arrived slots used up (no buffer,
    /// no system call). Off the latency path when called from an idle [`Transport::progress`].
    ///
    /// Why this may wait: the queue holds `2 * slots` requests and the peer can have at most
    /// `slots` writes that we have not handled yet (its slot credits), so with at most `slots / 2`
    /// owed, at least `slots / 2` requests stay spare and an arriving write always finds one.
    fn repost(k: usize, c: &mut Conn) -> Result<(), TransportError> {
        while c.recv_owed > 0 {
            c.qp.post_recv(wr_id(k, Wr::Recv, 0))?;
            c.recv_owed -= 1;
        }
        Ok(())
    }

    /// Writes what is queued for peer `k` while slots and send queue allow.
    fn flush(&mut self, k: usize, sink: &mut dyn Sink) -> Result<usize, TransportError> {
        let mut work = 0;
        loop {
            let c = &mut self.conns[k];
            if c.out.is_empty() || !c.can_write(self.sq_depth) {
                break;
            }
            let out = c.out.pop_front().unwrap();
            self.write_out(k, out, sink)?;
            work += 1;
        }
        let c = &mut self.conns[k];
        // An explicit update when nothing can carry the credit now: nothing queued, or the
        // queue is stalled on slots (both sides stalled that way would otherwise wait forever;
        // the reserved slot is for this).
        if c.live()
            && (c.out.is_empty() || !c.credits.can_send(false))
            && c.credits.wants_update()
            && c.credits.can_send(true)
            && c.sq.used() < self.sq_depth
        {
            self.write_slot(k, LinkKind::Credit, None, Remote::default(), &[])?;
            self.stats.credit_updates += 1;
            work += 1;
        }
        Ok(work)
    }

    fn write_out(&mut self, k: usize, out: Out, sink: &mut dyn Sink) -> Result<(), TransportError> {
        let h = match out {
            Out::ReadDone(token) => {
                return self.write_slot(k, LinkKind::ReadDone, None, Remote { token, ..Remote::default() }, &[]);
            }
            Out::Frame(h, payload) if one_slot(&h) => {
                return self.write_slot(k, LinkKind::Frame, Some(&h), Remote::default(), &payload);
            }
            Out::Frame(h, payload) if h.kind == Kind::Data => return self.send_data(k, h, payload),
            Out::Frame(h, _) => h,
        };
        // A CTS: announce the whole destination buffer with it (write rendezvous).
        let c = &mut self.conns[k];
        let total = c.rts_len.remove(&h.seq);
        let (peer, want) = (c.rank, self.rendezvous == Rendezvous::Write && h.flags & flags::TRUNCATED == 0);
        if let Some(total) = total.filter(|&t| want && t > 0 && t <= u64::from(u32::MAX)) {
            let probe = Header {
                kind: Kind::Data,
                src: peer,
                seq: h.aux,
                aux: 0,
                len: total as u32,
                ..Header::new(Kind::Data)
            };
            if let Ok(Some(dst)) = sink.data_dest(peer, &probe) {
                let (ptr, len) = (dst.as_mut_ptr(), dst.len());
                // SAFETY: the sink keeps the buffer valid until the last data frame or the loss.
                let mr = unsafe { self.dev.register(ptr, len, access::REMOTE_WRITE)? };
                self.stats.recv_registrations += 1;
                let remote = Remote { addr: ptr as u64, rkey: mr.rkey(), token: 0, len: len as u64 };
                self.conns[k].exposed.insert(h.aux, Exposed { _mr: mr, len: len as u64, remaining: len as u64 });
                return self.write_slot(k, LinkKind::CtsBuf, Some(&h), remote, &[]);
            }
        }
        self.write_slot(k, LinkKind::Frame, Some(&h), Remote::default(), &[])
    }

    /// A rendezvous chunk: RDMA-write it into the peer's announced buffer, or lend it.
    fn send_data(&mut self, k: usize, h: Header, payload: Bytes) -> Result<(), TransportError> {
        let c = &mut self.conns[k];
        let len = payload.len() as u64;
        if let Some(t) = c.targets.get_mut(&h.seq) {
            if h.aux.checked_add(len).is_none_or(|end| end > t.remote.len) || len > t.remaining {
                // Our own engine never does this; treat as a broken connection.
                return Err(WireError::Link("data beyond the announced buffer").into());
            }
            let dest = t.remote.addr + h.aux;
            let rkey = t.remote.rkey;
            t.remaining -= len;
            if t.remaining == 0 {
                c.targets.remove(&h.seq);
            }
            if len > 0 {
                let extent = extent(c, &h, &payload);
                let pin = self.cache.acquire_extent(&mut self.dev, &payload, extent, 0)?;
                let lkey = self.cache.region(&pin).lkey();
                let c = &mut self.conns[k];
                let token = c.writes.insert(Lent { pin, _data: payload.clone() }) as u32;
                // SAFETY: the source is kept alive (and registered) in `writes` until completion.
                unsafe {
                    c.qp.post_send(
                        wr_id(k, Wr::Write, token),
                        Op::Write,
                        payload.as_ptr() as u64,
                        len as u32,
                        lkey,
                        dest,
                        rkey,
                        true,
                    )?
                };
                c.sq.posted(false);
                self.stats.rdma_writes += 1;
            }
            return self.write_slot(k, LinkKind::DataWritten, Some(&h), Remote::default(), &[]);
        }
        let extent = extent(c, &h, &payload);
        let pin = self.cache.acquire_extent(&mut self.dev, &payload, extent, access::REMOTE_READ)?;
        let rkey = self.cache.region(&pin).rkey();
        let addr = payload.as_ptr() as u64;
        let token = self.conns[k].lent.insert(Lent { pin, _data: payload }) as u32;
        let remote = Remote { addr, rkey, token, len };
        self.write_slot(k, LinkKind::DataRead, Some(&h), remote, &[])
    }

    /// Fills the next slot of peer `k` and posts its write-with-immediate.
    fn write_slot(
        &mut self,
        k: usize,
        kind: LinkKind,
        h: Option<&Header>,
        remote: Remote,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let ss = self.slot_size;
        let c = &mut self.conns[k];
        let (slot, freed) = c.credits.take();
        let ptr = c.stage.slot(slot, ss);
        // SAFETY: our staging copy of this slot; the device last read it for the previous write
        // of this slot, which the peer has acknowledged by freeing it.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, ss) };
        let h = h.map(|h| Header { src: self.me, ..*h });
        let kind = link::slot_kind(kind, h.as_ref(), payload.len());
        let n = link::encode(buf, kind, freed, h.as_ref(), remote, payload);
        let raddr = c.remote_ring.0 + (slot as usize * ss) as u64;
        let op = if self.shared.is_some() { Op::SendImm { imm: slot } } else { Op::WriteImm { imm: slot } };
        let quiet = c.sq.quiet_next(kind == LinkKind::Eager);
        let wr = wr_id(k, if quiet { Wr::QuietSlot } else { Wr::Slot }, slot);
        // SAFETY: the staging block lives as long as the QP; this slot of it is written again
        // only once the peer has freed it, after the device has sent it.
        unsafe { c.qp.post_send(wr, op, ptr as u64, n as u32, c.stage.mr.lkey(), raddr, c.remote_ring.1, !quiet)? };
        c.sq.posted(quiet);
        self.stats.slots_sent += 1;
        Ok(())
    }

    /// Peers whose liveness socket reports end of file or an error.
    fn check_peers(&mut self) {
        self.tick = 0;
        self.check_now = false;
        let dead: Vec<usize> = (0..self.conns.len())
            .filter(|&k| {
                let c = &self.conns[k];
                c.live() && c.sock.as_ref().is_some_and(|s| socket_closed(s.get_ref()))
            })
            .collect();
        for k in dead {
            let err = self.conns[k].ending();
            self.fail(k, err);
        }
    }
}

/// Bytes from `payload`'s start through the following chunks of the same message queued for the
/// peer, while they continue it in memory: the engine cuts one buffer into consecutive slices,
/// so one registration can serve them all (see [`RegCache::acquire_extent`]).
fn extent(c: &Conn, h: &Header, payload: &Bytes) -> usize {
    let (mut end, mut off) = (payload.as_ptr() as usize + payload.len(), h.aux + payload.len() as u64);
    for o in &c.out {
        match o {
            Out::Frame(n, p)
                if n.kind == Kind::Data && n.seq == h.seq && n.aux == off && p.as_ptr() as usize == end =>
            {
                end += p.len();
                off += p.len() as u64;
            }
            _ => break,
        }
    }
    end - payload.as_ptr() as usize
}

/// The immediate of a receive completion (the slot index); out of range when it has none.
fn imm_of(wc: &ffi::ibv_wc) -> u32 {
    wc.imm_data().map_or(u32::MAX, u32::from_be)
}

/// A liveness socket is closed when it reads end of file or fails (the peer never writes).
fn socket_closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: reads at most one byte into `b`.
    let n = unsafe { libc::recv(s.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    match n {
        0 => true,
        n if n > 0 => false,
        _ => {
            let e = io::Error::last_os_error();
            !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
        }
    }
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "verbs"
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
        if !self.wcs.is_empty() {
            for wc in std::mem::take(&mut self.wcs) {
                self.handle_wc(&wc, sink);
                work += 1;
            }
        }
        loop {
            let n = match self.dev.poll(&mut self.wc_buf[..]) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!("polling the verbs completion queue failed: {e}");
                    for k in 0..self.conns.len() {
                        self.fail(k, TransportError::Io(e.kind()));
                    }
                    0
                }
            };
            for i in 0..n {
                let wc = self.wc_buf[i];
                self.handle_wc(&wc, sink);
            }
            work += n;
            if n < POLL_BATCH {
                break;
            }
        }
        work += self.rma_flush();
        if work == 0 {
            for k in 0..self.conns.len() {
                let c = &mut self.conns[k];
                if c.recv_owed > 0
                    && c.live()
                    && let Err(e) = Self::repost(k, c)
                {
                    self.fail(k, e);
                }
            }
        }
        for k in 0..self.conns.len() {
            match self.flush(k, sink) {
                Ok(n) => work += n,
                Err(e) => self.fail(k, e),
            }
        }
        self.tick += if work == 0 { IDLE_WEIGHT } else { 1 };
        if self.check_now || self.tick >= self.liveness_polls.saturating_mul(IDLE_WEIGHT) {
            self.check_peers();
        }
        self.reap();
        for (peer, err) in self.lost.drain(..) {
            sink.peer_lost(peer, err);
            work += 1;
        }
        work
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.lost.is_empty() || self.check_now || !self.wcs.is_empty() {
            return Poll::Ready(());
        }
        let sendable = self.conns.iter().any(|c| !c.out.is_empty() && c.can_write(self.sq_depth));
        if sendable || self.conns.iter().any(|c| c.failing.is_some() && c.sq.settled()) {
            return Poll::Ready(());
        }
        loop {
            match self.channel.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => {
                    self.dev.drain_events();
                    g.clear_ready();
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => break,
            }
        }
        // Arm, then look once more: a completion that came before arming raises no event.
        if self.dev.arm().is_err() {
            return Poll::Ready(());
        }
        if let Ok(n) = self.dev.poll(&mut self.wc_buf[..])
            && n > 0
        {
            self.wcs.extend_from_slice(&self.wc_buf[..n]);
            return Poll::Ready(());
        }
        let mut ready = false;
        for c in self.conns.iter().filter(|c| c.live()) {
            if let Some(s) = &c.sock {
                match s.poll_read_ready(cx) {
                    Poll::Ready(Ok(g)) => {
                        ready |= closed_or_clear(g);
                    }
                    Poll::Ready(Err(_)) => ready = true,
                    Poll::Pending => {}
                }
            }
        }
        if ready {
            self.check_now = true;
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Frames queued, or posted and not yet confirmed by a completion. Unsignaled eager slots
    /// are confirmed by the next signaled request, at the latest the goodbye (always signaled),
    /// which is what an orderly shutdown waits for.
    fn has_pending_output(&self) -> bool {
        self.conns.iter().any(|c| c.live() && (!c.out.is_empty() || !c.sq.settled()))
    }

    fn has_queued_output(&self) -> bool {
        self.conns.iter().any(|c| c.live() && !c.out.is_empty())
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        if let Some(k) = self.index(peer) {
            self.fail(k, reason);
        }
    }

    fn one_sided(&mut self) -> Option<&mut dyn crate::one_sided::OneSided> {
        Some(self)
    }
}

/// Whether frame `h` travels as one slot and nothing else. Not a CTS, which may announce a sink
/// buffer (write rendezvous), nor a rendezvous chunk, which goes by RDMA.
fn one_slot(h: &Header) -> bool {
    !matches!(h.kind, Kind::Cts | Kind::Data)
}

/// A readable liveness socket: closed (report), or spurious readiness (clear it).
fn closed_or_clear(mut g: AsyncFdReadyGuard<'_, TcpStream>) -> bool {
    if socket_closed(g.get_inner()) {
        true
    } else {
        g.clear_ready();
        false
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        // Stop the device before buffers go: flush every QP, then drain the completions.
        for c in &self.conns {
            c.qp.set_error();
        }
        let mut wcs = sys::wc_array::<POLL_BATCH>();
        for _ in 0..1000 {
            if self.conns.iter().all(|c| c.sq.settled()) {
                break;
            }
            let n = self.dev.poll(&mut wcs).unwrap_or(0);
            for wc in &wcs[..n] {
                let (k, kind, _) = split_wr(wc.wr_id());
                if let Some(c) = self.conns.get_mut(k)
                    && is_signaled_send(kind)
                {
                    c.sq.retire();
                }
            }
            if n == 0 {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
        for c in &mut self.conns {
            c.exposed.clear();
            c.reads.clear();
            for l in c.lent.drain().chain(c.writes.drain()) {
                self.cache.release(l.pin);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOMETRY: (u32, usize, Eager) = (32, 4096, Eager::Ring);

    fn desc_of(rank: Rank, peers: &[Rank]) -> Vec<u8> {
        let entries: Vec<DescEntry> = peers
            .iter()
            .map(|&r| DescEntry { rank: r, qpn: 100 + r, psn: 7, ring: (0x1000 * u64::from(r), 50 + r) })
            .collect();
        encode_desc(rank, (3, [9; 16]), GEOMETRY, &entries)
    }

    #[test]
    fn descriptors_round_trip() {
        let d = desc_of(2, &[0, 1, 3]);
        let r = parse_desc(&d, 2, 3, GEOMETRY).unwrap();
        assert_eq!(r.qp, QpAddr { qpn: 103, psn: 7, lid: 3, gid: [9; 16] });
        assert_eq!(r.ring, (0x3000, 53));
    }

    #[test]
    fn bad_descriptors_are_refused_with_a_reason() {
        let d = desc_of(2, &[0, 1, 3]);
        let refused = |d: &[u8], peer: Rank, me: Rank, g: (u32, usize, Eager)| parse_desc(d, peer, me, g).err();
        assert_eq!(refused(&d[..10], 2, 3, GEOMETRY), Some("too short"));
        let mut bad = d.clone();
        bad[0] ^= 1;
        assert_eq!(refused(&bad, 2, 3, GEOMETRY), Some("bad magic or version"));
        let mut old = d.clone();
        old[4] = 1;
        assert_eq!(refused(&old, 2, 3, GEOMETRY), Some("bad magic or version"));
        assert_eq!(refused(&d, 1, 3, GEOMETRY), Some("names another rank"));
        assert!(refused(&d, 2, 3, (16, 4096, Eager::Ring)).unwrap().starts_with("slot geometry differs"));
        assert!(refused(&d, 2, 3, (32, 8192, Eager::Ring)).unwrap().starts_with("slot geometry differs"));
        assert!(refused(&d, 2, 3, (32, 4096, Eager::SharedQueue)).unwrap().starts_with("eager path differs"));
        assert_eq!(refused(&d[..d.len() - 1], 2, 3, GEOMETRY), Some("length does not match its peer count"));
        let mut many = d.clone();
        many[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(refused(&many, 2, 3, GEOMETRY), Some("length does not match its peer count"));
        assert_eq!(refused(&d, 2, 4, GEOMETRY), Some("has no queue pair for this rank"));
    }
}
