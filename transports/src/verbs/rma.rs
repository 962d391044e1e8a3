//! One-sided operations over the RC queue pairs ([`OneSided`]): RDMA write and read of a peer's
//! registered memory, and RDMA atomics (fetch-and-add, compare-and-swap) on its 8-byte words.
//!
//! * **Posting.** An operation whose queue pair has nothing waiting and room for all its
//!   requests is posted by the caller, in `post`; otherwise its requests wait in a
//!   per-connection backlog, in issue order, until the send queue has room (two entries stay
//!   free for slots).
//! * **Staging.** A write whose runs all fit the queue pair's inline size and that is posted in
//!   the call goes from the caller's bytes: the provider copies them into the work requests
//!   (`IBV_SEND_INLINE`), so the write needs no registered memory (an 8 B put is one work
//!   request and no copy of ours). Any other write copies its source into a registered staging
//!   buffer before `post` returns (the caller's borrow ends there); a read lands in one and is
//!   copied out when it completes (the caller's buffer may be gone by then: a dropped future
//!   does not cancel an operation); an atomic's previous value lands in one. Buffers come from a
//!   pool by power-of-two size, registered once and reused ([`KEEP_BYTES`] kept at most), so the
//!   latency path registers nothing. A write from the transport's own registration
//!   (`WriteRegistered`, the RDMA collectives' zero-copy path) stages nothing: the device reads
//!   the caller's memory.
//! * **Registrations outlive their requests.** A registration of the caller's
//!   ([`OneSided::register`]) that is deregistered while a `WriteRegistered` request from it waits
//!   in the backlog or is posted is kept ([`Registrations`]) until that request completes: the
//!   device never meets a dead local key (which would put the queue pair, and so the connection,
//!   into error), and a request for a handle already deregistered fails at `post` with
//!   `InvalidInput`. A request through the loopback that targets one of these registrations
//!   keeps it alike. The memory is the caller's: the registration pins its pages, so what the
//!   device reads after the caller let go of it is the old pages, never another process's.
//! * **Work requests.** One per run (a strided or sub-array transfer is several, one per
//!   contiguous run after merging adjacent ones), each signaled: an operation completes when its
//!   last request's completion is polled.
//! * **Loopback.** A rank's own atomics on its registered words go through a pair of queue pairs
//!   connected to each other on the same device: RDMA atomics are atomic only with respect to the
//!   device's other atomics (Soft-RoCE applies them under a lock of its own), so every atomic on a
//!   registered word, the owner's included, must take the device.
//! * **Failures.** A failed request fails its connection (RC: the queue pair is in error), like
//!   any other; flushed requests complete their operations with the connection's end.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::io;

use bytes::Bytes;
use ibverbs_sys as ffi;
use slab::Slab;

use super::super::link::SendQueue;
use super::super::sys::{Device, Mr, Op, Qp, QpAddr, access};
use super::{RD_ATOMIC, VerbsTransport, Wr, random_u32, wr_id};
use crate::one_sided::{Done, OneSided, RemoteAccess, RemoteKey, Request, Run};
use crate::{Rank, TransportError};

/// The connection index of the loopback pair in work request ids.
const LOOPBACK: usize = 0xff_ffff;
/// Staging bytes kept registered in the pool at most.
const KEEP_BYTES: usize = 64 << 20;
/// Send queue entries left to slot writes on a peer's queue pair.
const SLOT_RESERVE: u32 = 2;

/// A registered buffer for the device (the region is dropped before the memory).
struct Staging {
    mr: Option<Mr>,
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: plain heap memory and a region handle.
unsafe impl Send for Staging {}

impl Staging {
    fn new(dev: &Device, cap: usize) -> io::Result<Staging> {
        let b: Box<[u8]> = vec![0u8; cap].into_boxed_slice();
        let ptr: *mut u8 = Box::into_raw(b).cast();
        let mut s = Staging { mr: None, ptr, cap };
        // SAFETY: the memory lives until `drop`, which drops the region first.
        s.mr = Some(unsafe { dev.register(ptr, cap, access::LOCAL)? });
        Ok(s)
    }

    fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, Mr::lkey)
    }

    fn addr(&self, at: usize) -> u64 {
        self.ptr as u64 + at as u64
    }

    /// The first `len` bytes (nothing but polled completions wrote them).
    fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: `len <= cap` (callers ask for what they staged); the device is done with it.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.cap)) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.mr = None;
        // SAFETY: made from a boxed slice of `cap` bytes in `new`, freed once, after its region.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.cap)) });
    }
}

enum Kind {
    Write,
    Read(usize),
    Atomic,
}

/// An operation in flight.
struct OpState {
    token: u64,
    /// Work requests not yet completed (posted or waiting in the backlog).
    left: u32,
    kind: Kind,
    /// `None`: an inline write, posted in its call from the caller's bytes, or a write from a
    /// registration of the caller's (`local` says where).
    staging: Option<Staging>,
    /// Registrations of the caller's kept until this operation is over: the one its local stream
    /// lies in (`WriteRegistered`), and, through the loopback, the one it targets.
    pins: [Option<u64>; 2],
    /// The local stream's address and key (the staging buffer's, the registration's, or the
    /// caller's bytes for an inline write).
    local: (u64, u32),
    err: Option<TransportError>,
}

/// A work request waiting for room in its send queue.
#[derive(Clone, Copy)]
enum Spec {
    Rdma { write: bool, stream: usize, addr: u64, len: usize, rkey: u32 },
    Atomic { addr: u64, rkey: u32, compare: Option<u64>, add: u64 },
}

/// An operation's work requests: one per (merged) run, or one atomic.
enum Specs<'a> {
    Rdma { write: bool, runs: Cow<'a, [Run]>, rkey: u32 },
    Atomic(Spec),
}

impl Specs<'_> {
    fn len(&self) -> usize {
        match self {
            Specs::Rdma { runs, .. } => runs.len(),
            Specs::Atomic(_) => 1,
        }
    }

    fn get(&self, i: usize) -> Spec {
        match self {
            Specs::Rdma { write, runs, rkey } => {
                let r = runs[i];
                Spec::Rdma { write: *write, stream: r.stream, addr: r.addr, len: r.len, rkey: *rkey }
            }
            Specs::Atomic(s) => *s,
        }
    }
}

/// The one-sided state of a verbs transport.
pub(super) struct RmaState {
    /// The loopback pair: requests go on `lo_a`, `lo_b` answers. Declared first: dropped before
    /// the registrations.
    lo_a: Qp,
    _lo_b: Qp,
    lo_sq: SendQueue,
    sq_depth: u32,
    /// The registrations of the caller's memory.
    regs: Registrations<Mr>,
    ops: Slab<OpState>,
    /// By connection index (the loopback's too): requests in issue order.
    backlog: HashMap<usize, VecDeque<(usize, Spec)>>,
    /// Staging buffers by size class: index `i` holds buffers of `2^i` bytes.
    pool: Vec<Vec<Staging>>,
    kept: usize,
    done: VecDeque<(u64, Result<Done, TransportError>)>,
}

impl RmaState {
    /// Creates the loopback pair (connected to each other) on `dev`.
    pub(super) fn new(dev: &Device, sq_depth: u32) -> io::Result<RmaState> {
        let a = dev.create_qp(sq_depth, 1, 0, None)?;
        let b = dev.create_qp(sq_depth, 1, 0, None)?;
        let (pa, pb) = (random_u32() & 0xff_ffff, random_u32() & 0xff_ffff);
        let at = |qp: &Qp, psn| QpAddr { qpn: qp.qpn(), psn, lid: dev.lid, gid: dev.gid };
        a.connect(dev, pa, &at(&b, pb), RD_ATOMIC)?;
        b.connect(dev, pb, &at(&a, pa), RD_ATOMIC)?;
        Ok(RmaState {
            lo_a: a,
            _lo_b: b,
            lo_sq: SendQueue::default(),
            sq_depth,
            regs: Registrations::default(),
            ops: Slab::new(),
            backlog: HashMap::new(),
            pool: Vec::new(),
            kept: 0,
            done: VecDeque::new(),
        })
    }

    fn take(&mut self, dev: &Device, len: usize) -> io::Result<Staging> {
        let class = len.max(64).next_power_of_two();
        if let Some(s) = self.pool.get_mut(class.trailing_zeros() as usize).and_then(Vec::pop) {
            self.kept -= class;
            return Ok(s);
        }
        Staging::new(dev, class)
    }

    fn give(&mut self, s: Staging) {
        if self.kept + s.cap <= KEEP_BYTES {
            self.kept += s.cap;
            // Staging capacities are powers of two (`take`).
            let i = s.cap.trailing_zeros() as usize;
            if self.pool.len() <= i {
                self.pool.resize_with(i + 1, Vec::new);
            }
            self.pool[i].push(s);
        }
    }

    /// Whether requests of connection `k` wait in the backlog.
    fn waiting(&self, k: usize) -> bool {
        !self.backlog.is_empty() && self.backlog.get(&k).is_some_and(|q| !q.is_empty())
    }

    /// One of operation `key`'s requests is over (`err`: failed, or never posted).
    fn one_done(&mut self, key: usize, err: Option<TransportError>) {
        let Some(op) = self.ops.get_mut(key) else { return };
        if let Some(e) = err {
            op.err.get_or_insert(e);
        }
        op.left = op.left.saturating_sub(1);
        if op.left > 0 {
            return;
        }
        let op = self.ops.remove(key);
        for h in op.pins.into_iter().flatten() {
            self.regs.unpin(h);
        }
        let staged = |len| op.staging.as_ref().map_or(&[][..], |s| s.bytes(len));
        let r = match (op.err, op.kind) {
            (Some(e), _) => Err(e),
            (None, Kind::Write) => Ok(Done::Unit),
            (None, Kind::Read(len)) => Ok(Done::Data(Bytes::copy_from_slice(staged(len)))),
            (None, Kind::Atomic) => match staged(8).try_into() {
                Ok(b) => Ok(Done::Value(u64::from_ne_bytes(b))),
                Err(_) => Err(TransportError::Io(io::ErrorKind::Other)),
            },
        };
        self.done.push_back((op.token, r));
        if let Some(s) = op.staging {
            self.give(s);
        }
    }
}

/// Adjacent runs (next in the stream and in remote memory) as one, without empty ones; a single
/// run as it is (no allocation on the latency path).
fn merged(runs: &[Run]) -> Cow<'_, [Run]> {
    if let [r] = runs
        && r.len > 0
    {
        return Cow::Borrowed(runs);
    }
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs.iter().filter(|r| r.len > 0) {
        match out.last_mut() {
            Some(p) if p.stream + p.len == r.stream && p.addr + p.len as u64 == r.addr => p.len += r.len,
            _ => out.push(*r),
        }
    }
    Cow::Owned(out)
}

impl VerbsTransport {
    /// A completion of a one-sided request of connection `k` (or the loopback).
    pub(super) fn on_rma_wc(&mut self, wc: &ffi::ibv_wc, k: usize, token: u32) {
        let err = if wc.is_valid() {
            None
        } else if k == LOOPBACK {
            let (status, vendor) = wc.error().unwrap_or_default();
            tracing::error!(status, vendor, "a loopback one-sided request failed");
            Some(TransportError::Io(io::ErrorKind::Other))
        } else {
            self.failed(k, wc);
            Some(self.conns.get(k).and_then(|c| c.failing.clone()).unwrap_or(TransportError::Closed))
        };
        if k == LOOPBACK {
            self.rma.lo_sq.retire();
        } else if let Some(c) = self.conns.get_mut(k) {
            c.sq.retire();
        }
        self.rma.one_done(token as usize, err);
    }

    /// Posts what waits in the backlogs as far as the send queues have room; fails what waits
    /// for a connection that ended. Returns how many requests moved.
    pub(super) fn rma_flush(&mut self) -> usize {
        if self.rma.backlog.is_empty() {
            return 0;
        }
        let keys: Vec<usize> = self.rma.backlog.keys().copied().collect();
        keys.into_iter().map(|k| self.flush_conn(k)).sum()
    }

    fn flush_conn(&mut self, k: usize) -> usize {
        let mut n = 0;
        loop {
            let Some(&(key, spec)) = self.rma.backlog.get(&k).and_then(VecDeque::front) else {
                self.rma.backlog.remove(&k);
                return n;
            };
            if k != LOOPBACK && !self.conns[k].live() {
                let why = self.conns[k].failing.clone().unwrap_or(TransportError::Closed);
                for (key, _) in self.rma.backlog.remove(&k).unwrap_or_default() {
                    self.rma.one_done(key, Some(why.clone()));
                }
                return n;
            }
            if self.room(k) < 1 {
                return n;
            }
            self.rma.backlog.get_mut(&k).and_then(VecDeque::pop_front);
            // Operations in the backlog are staged or registered (only one posted in its call
            // goes inline).
            let Some(local) = self.rma.ops.get(key).map(|op| op.local) else {
                continue;
            };
            // SAFETY: the staging buffer belongs to the operation, which stays in the slab (and
            // the buffer registered) until this request's completion is polled, or its queue
            // pair is flushed and reaped; a registration of the caller's is pinned by the
            // operation until then (`Registrations`), and the device only reads it.
            if unsafe { self.post_spec(k, key, spec, local) }.is_ok() {
                n += 1;
            }
        }
    }

    /// Send queue entries of connection `k` (or the loopback) free for one-sided requests.
    fn room(&self, k: usize) -> u32 {
        let (used, reserve) =
            if k == LOOPBACK { (self.rma.lo_sq.used(), 0) } else { (self.conns[k].sq.used(), SLOT_RESERVE) };
        self.rma.sq_depth.saturating_sub(used + reserve)
    }

    /// Posts one request of operation `key` on connection `k` (or the loopback), its local
    /// stream at `(base, lkey)`. A failure completes the request with it (and ends the
    /// connection).
    ///
    /// # Safety
    /// As [`Qp::post_send`] and [`Qp::post_atomic`] for the local memory: staged memory stays
    /// valid until the request completes; a write that goes inline (its length within the queue
    /// pair's inline size) reads it during the call only.
    unsafe fn post_spec(&mut self, k: usize, key: usize, spec: Spec, (base, lkey): (u64, u32)) -> Result<(), ()> {
        let qp = if k == LOOPBACK { &self.rma.lo_a } else { &self.conns[k].qp };
        let id = wr_id(k, Wr::Rma, key as u32);
        // SAFETY: the caller's contract.
        let r = unsafe {
            match spec {
                Spec::Rdma { write, stream, addr, len, rkey } => {
                    let op = if write { Op::Write } else { Op::Read };
                    qp.post_send(id, op, base + stream as u64, len as u32, lkey, addr, rkey, true)
                }
                Spec::Atomic { addr, rkey, compare, add } => {
                    qp.post_atomic(id, (base, lkey), (addr, rkey), compare, add)
                }
            }
        };
        match r {
            Ok(()) => {
                if k == LOOPBACK {
                    self.rma.lo_sq.posted(false);
                } else {
                    self.conns[k].sq.posted(false);
                }
                Ok(())
            }
            Err(e) => {
                tracing::debug!(peer = k, error = %e, "posting a one-sided request failed");
                let why = TransportError::Io(e.kind());
                self.rma.one_done(key, Some(why.clone()));
                if k != LOOPBACK {
                    self.fail(k, why);
                }
                Err(())
            }
        }
    }
}

impl OneSided for VerbsTransport {
    unsafe fn register(&mut self, addr: *mut u8, len: usize, a: RemoteAccess) -> io::Result<(u64, RemoteKey)> {
        use ffi::ibv_access_flags as A;
        let mut bits = A::IBV_ACCESS_LOCAL_WRITE.0;
        if a.read {
            bits |= A::IBV_ACCESS_REMOTE_READ.0;
        }
        if a.write {
            bits |= A::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if a.atomic {
            bits |= A::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        // SAFETY: the caller keeps the memory allocated until `deregister` or the drop.
        let mr = unsafe { self.dev.register(addr, len, bits)? };
        let key = RemoteKey { addr: addr as u64, rkey: mr.rkey() };
        let rkey = mr.rkey();
        Ok((self.rma.regs.insert(mr, addr as u64, len, rkey), key))
    }

    fn deregister(&mut self, handle: u64) {
        self.rma.regs.release(handle);
    }

    fn post(&mut self, peer: Rank, req: Request<'_>, token: u64) -> Result<(), TransportError> {
        let k = if peer == self.me {
            LOOPBACK
        } else {
            let k = self.index(peer).ok_or(TransportError::Closed)?;
            let c = &self.conns[k];
            if !c.live() {
                return Err(c.failing.clone().unwrap_or(TransportError::Closed));
            }
            k
        };
        // `reg`: the local stream is in a registration of the caller's (no staging).
        let mut reg = None;
        let (kind, len, src, specs) = match req {
            Request::Write { src, runs, rkey } => {
                let runs = merged(runs);
                if !runs_fit(&runs, src.len()) {
                    return Err(TransportError::Io(io::ErrorKind::InvalidInput));
                }
                (Kind::Write, src.len(), Some(src), Specs::Rdma { write: true, runs, rkey })
            }
            Request::WriteRegistered { handle, offset, len, runs, rkey } => {
                let Some((mr, base, reg_len)) = self.rma.regs.get(handle) else {
                    return Err(TransportError::Io(io::ErrorKind::InvalidInput));
                };
                let runs = merged(runs);
                let inside = offset.checked_add(len).is_some_and(|end| end <= reg_len);
                if !inside || !runs_fit(&runs, len) {
                    return Err(TransportError::Io(io::ErrorKind::InvalidInput));
                }
                reg = Some((handle, (base + offset as u64, mr.lkey())));
                (Kind::Write, len, None, Specs::Rdma { write: true, runs, rkey })
            }
            Request::Read { len, runs, rkey } => {
                let runs = merged(runs);
                if !runs_fit(&runs, len) {
                    return Err(TransportError::Io(io::ErrorKind::InvalidInput));
                }
                (Kind::Read(len), len, None, Specs::Rdma { write: false, runs, rkey })
            }
            Request::FetchAdd { addr, rkey, add } => {
                (Kind::Atomic, 8, None, Specs::Atomic(Spec::Atomic { addr, rkey, compare: None, add }))
            }
            Request::CompareSwap { addr, rkey, compare, swap } => {
                (Kind::Atomic, 8, None, Specs::Atomic(Spec::Atomic { addr, rkey, compare: Some(compare), add: swap }))
            }
        };
        let n = specs.len();
        // Posted now, in issue order, when nothing of this connection waits before it and the
        // send queue has room for all of its requests.
        let now = !self.rma.waiting(k) && n <= self.room(k) as usize;
        let max_inline = if k == LOOPBACK { self.rma.lo_a.max_inline() } else { self.conns[k].qp.max_inline() };
        let inline = match (&specs, src) {
            (Specs::Rdma { runs, .. }, Some(_)) => now && runs.iter().all(|r| r.len <= max_inline as usize),
            _ => false,
        };
        let staging = if inline || n == 0 || reg.is_some() {
            None
        } else {
            let s = self.rma.take(&self.dev, len).map_err(|e| TransportError::Io(e.kind()))?;
            if let Some(src) = src {
                // SAFETY: the buffer holds at least `src.len()` bytes and the device does not
                // touch it before the requests are posted.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), s.ptr, src.len()) };
            }
            Some(s)
        };
        let local = match (reg, &staging, src) {
            (Some((_, r)), _, _) => r,
            (None, Some(s), _) => (s.addr(0), s.lkey()),
            (None, None, Some(src)) => (src.as_ptr() as u64, 0),
            (None, None, None) => (0, 0),
        };
        // Through the loopback, the target may be a registration of this transport's own.
        let target = match (&specs, k == LOOPBACK) {
            (Specs::Rdma { rkey, .. } | Specs::Atomic(Spec::Atomic { rkey, .. }), true) => self.rma.regs.by_rkey(*rkey),
            _ => None,
        };
        let pins = [reg.map(|(h, _)| h), target];
        for h in pins.into_iter().flatten() {
            self.rma.regs.pin(h);
        }
        let op = OpState { token, left: (n as u32).max(1), kind, staging, pins, local, err: None };
        let key = self.rma.ops.insert(op);
        if n == 0 {
            self.rma.one_done(key, None);
            return Ok(());
        }
        if !now {
            self.rma.backlog.entry(k).or_default().extend((0..n).map(|i| (key, specs.get(i))));
            self.flush_conn(k);
            return Ok(());
        }
        for i in 0..n {
            // SAFETY: staged memory belongs to the operation, which stays in the slab (and the
            // buffer registered) until its requests complete or their queue pair is flushed and
            // reaped; a registration of the caller's is pinned by the operation until then
            // (`Registrations`); otherwise every request is a write within
            // the inline size, which the provider copies from the caller's bytes during the call.
            if unsafe { self.post_spec(k, key, specs.get(i), local) }.is_err() {
                // The connection has ended (or the loopback refused): the rest fail with it.
                let why = self.conns.get(k).and_then(|c| c.failing.clone()).unwrap_or(TransportError::Closed);
                for _ in i + 1..n {
                    self.rma.one_done(key, Some(why.clone()));
                }
                break;
            }
        }
        Ok(())
    }

    fn poll_done(&mut self) -> Option<(u64, Result<Done, TransportError>)> {
        self.rma.done.pop_front()
    }

    fn busy(&self) -> bool {
        !self.rma.ops.is_empty() || !self.rma.done.is_empty()
    }
}

/// Registrations of the caller's memory by handle. A deregistered one is kept while operations
/// posted against it are pending ([`Registrations::pin`]), and dropped (its region deregistered)
/// when the last of them is over.
struct Registrations<M> {
    by_handle: HashMap<u64, Held<M>>,
    next: u64,
}

struct Held<M> {
    region: M,
    base: u64,
    len: usize,
    rkey: u32,
    /// Operations pending on it.
    pins: u32,
    /// The caller has deregistered it: no new operation may use it.
    released: bool,
}

impl<M> Default for Registrations<M> {
    fn default() -> Self {
        Registrations { by_handle: HashMap::new(), next: 1 }
    }
}

impl<M> Registrations<M> {
    /// Adds a region (`len` bytes at `base`, remote key `rkey`); returns its handle.
    fn insert(&mut self, region: M, base: u64, len: usize, rkey: u32) -> u64 {
        let h = self.next;
        self.next += 1;
        self.by_handle.insert(h, Held { region, base, len, rkey, pins: 0, released: false });
        h
    }

    /// The handle of the registration with remote key `rkey` (released or not), if one is held.
    fn by_rkey(&self, rkey: u32) -> Option<u64> {
        self.by_handle.iter().find(|(_, h)| h.rkey == rkey).map(|(&k, _)| k)
    }

    /// A registration new operations may use: its region, first byte's address and length.
    fn get(&self, handle: u64) -> Option<(&M, u64, usize)> {
        self.by_handle.get(&handle).filter(|h| !h.released).map(|h| (&h.region, h.base, h.len))
    }

    /// An operation on `handle` is pending.
    fn pin(&mut self, handle: u64) {
        if let Some(h) = self.by_handle.get_mut(&handle) {
            h.pins += 1;
        }
    }

    /// An operation on `handle` is over: the registration goes if it was released.
    fn unpin(&mut self, handle: u64) {
        if let Some(h) = self.by_handle.get_mut(&handle) {
            h.pins = h.pins.saturating_sub(1);
            if h.released && h.pins == 0 {
                self.by_handle.remove(&handle);
            }
        }
    }

    /// The caller deregisters `handle`: dropped now, or when its last pending operation is over.
    fn release(&mut self, handle: u64) {
        if let Some(h) = self.by_handle.get_mut(&handle) {
            h.released = true;
            if h.pins == 0 {
                self.by_handle.remove(&handle);
            }
        }
    }

    /// Regions held (released ones still pinned included).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.by_handle.len()
    }
}

/// Whether every run lies within a local stream of `len` bytes and fits one work request (a
/// length the device takes as 32 bits).
fn runs_fit(runs: &[Run], len: usize) -> bool {
    runs.iter().all(|r| r.stream.checked_add(r.len).is_some_and(|end| end <= len) && r.len <= u32::MAX as usize)
}

#[cfg(test)]
mod tests {

    #[test]
    fn runs_must_fit_the_stream_without_overflow() {
        let r = |stream, len| Run { stream, addr: 0, len };
        assert!(runs_fit(&[r(0, 8), r(8, 8)], 16));
        assert!(!runs_fit(&[r(0, 8), r(9, 8)], 16));
        assert!(!runs_fit(&[r(usize::MAX, 2)], 16));
        assert!(runs_fit(&[], 0));
    }
    use super::*;

    /// A region that records its deregistration.
    struct Region(std::rc::Rc<std::cell::Cell<bool>>);

    impl Drop for Region {
        fn drop(&mut self) {
            self.0.set(true);
        }
    }

    #[test]
    fn a_registration_outlives_the_operations_posted_against_it() {
        let mut regs = Registrations::default();
        let gone = std::rc::Rc::new(std::cell::Cell::new(false));
        let h = regs.insert(Region(gone.clone()), 4096, 100, 77);
        assert_eq!(regs.by_rkey(77), Some(h));
        assert_eq!(regs.by_rkey(78), None);
        assert!(matches!(regs.get(h), Some((_, 4096, 100))));
        regs.pin(h);
        regs.pin(h);
        regs.release(h);
        assert!(!gone.get(), "deregistered with operations pending");
        assert!(regs.get(h).is_none(), "a released handle takes no new operation");
        regs.unpin(h);
        assert!(!gone.get());
        regs.unpin(h);
        assert!(gone.get(), "the last operation's end drops it");
        assert_eq!(regs.held(), 0);
        // Unpinned: released at once; unknown handles are ignored.
        let g = regs.insert(Region(std::rc::Rc::new(std::cell::Cell::new(false))), 0, 8, 5);
        regs.release(g);
        regs.release(g);
        regs.unpin(g);
        assert_eq!(regs.held(), 0);
        assert_ne!(g, h, "handles are not reused");
    }

    #[test]
    fn adjacent_runs_merge() {
        let r = |stream, addr, len| Run { stream, addr, len };
        assert_eq!(
            merged(&[r(0, 100, 8), r(8, 108, 8), r(16, 200, 8), r(24, 208, 0)]),
            vec![r(0, 100, 16), r(16, 200, 8)]
        );
        assert_eq!(merged(&[r(0, 100, 8), r(16, 108, 8)]), vec![r(0, 100, 8), r(16, 108, 8)]);
    }

    #[test]
    fn a_single_run_is_borrowed_and_an_empty_one_dropped() {
        let one = [Run { stream: 0, addr: 64, len: 8 }];
        assert!(matches!(merged(&one), Cow::Borrowed(r) if r == one));
        assert!(merged(&[Run { stream: 0, addr: 64, len: 0 }]).is_empty());
        assert!(merged(&[]).is_empty());
    }

    #[test]
    fn specs_follow_the_runs() {
        let runs = [Run { stream: 0, addr: 100, len: 8 }, Run { stream: 8, addr: 200, len: 4 }];
        let s = Specs::Rdma { write: true, runs: merged(&runs), rkey: 7 };
        assert_eq!(s.len(), 2);
        assert!(matches!(s.get(1), Spec::Rdma { write: true, stream: 8, addr: 200, len: 4, rkey: 7 }));
        let a = Specs::Atomic(Spec::Atomic { addr: 8, rkey: 3, compare: Some(1), add: 2 });
        assert_eq!(a.len(), 1);
        assert!(matches!(a.get(0), Spec::Atomic { addr: 8, rkey: 3, compare: Some(1), add: 2 }));
    }
}
