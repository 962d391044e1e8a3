//! The sans-IO core of the emulated path, both sides: it takes events (a message from a peer, a
//! peer lost, an operation started or abandoned by the local application) and emits messages to
//! send ([`Service::poll_transmit`]) and completions (wakers woken, events counted). It does no
//! I/O and reads no clock; [`hook`](super::hook) runs it inside the reactor's progress.
//!
//! **Target side.** Requests are applied in the order they arrive, and the engine delivers one
//! sender's messages on one context in the order they were sent: every operation of one initiator
//! on one target takes effect in issue order (stronger than AOS, which orders only gets among
//! themselves and atomics after puts). Each request is checked again against the segment's bounds
//! and rights; a refused one leaves the memory untouched and is answered with the reason. An
//! enqueue into a full queue waits at the target (at most [`HELD_PER_PEER`] per peer, beyond
//! which it is refused as full) until the owner dequeues.
//!
//! **Initiator side.** An operation is a slab entry (no allocation per operation once the slab has
//! grown) keyed by its request id, the slab key with a generation so that a late reply to an
//! abandoned operation cannot complete a newer one. It completes when its last reply comes (large
//! transfers are cut into several messages), or fails with the first refusal, the loss of its
//! target, or shutdown. Its result goes to the future that polls it, or, for an operation handed
//! to an [`EventShared`], to that event's counter.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use ferrocomm_transports::one_sided::{Done, RemoteKey};
use ferrocomm_transports::{Rank, TransportError};
use parking_lot::Mutex;
use slab::Slab;

use super::memory::{SegMem, SegmentKind};
use super::wire::{AttachInfo, MAX_CHUNK, Msg};
use super::{Access, RmaError, SegmentId};
use crate::error::Error;

/// Enqueues one peer may have waiting for room at this target.
pub(crate) const HELD_PER_PEER: u32 = 64;

/// The result of a finished operation, before the API turns it into its own type.
#[derive(Debug)]
pub(crate) enum Reply {
    Unit,
    Value(u64),
    /// Pieces of a get: (stream offset, bytes).
    Data(Vec<(usize, Bytes)>),
    Attached(AttachInfo),
}

/// The completion counter of an [`Event`](super::Event): operations issued and completed, and the
/// first error among them.
#[derive(Default)]
pub(crate) struct EventShared {
    pub issued: AtomicU64,
    pub done: AtomicU64,
    pub error: Mutex<Option<Error>>,
    pub wakers: Mutex<Vec<Waker>>,
}

impl EventShared {
    /// One operation finished with `r`.
    pub(crate) fn complete(&self, r: Result<(), Error>) {
        if let Err(e) = r {
            self.error.lock().get_or_insert(e);
        }
        self.done.fetch_add(1, Ordering::AcqRel);
        for w in std::mem::take(&mut *self.wakers.lock()) {
            w.wake();
        }
    }

    /// Registers `w` to be woken at the next completion.
    pub(crate) fn register(&self, w: &Waker) {
        let mut ws = self.wakers.lock();
        if !ws.iter().any(|x| x.will_wake(w)) {
            ws.push(w.clone());
        }
    }
}

/// What the initiator knows of an attached segment; shared by every handle on it.
pub(crate) struct Remote {
    pub id: SegmentId,
    pub info: AttachInfo,
    /// The owner's memory, mapped here (shared memory); `None`: requests to the owner.
    pub mapped: Option<Arc<SegMem>>,
    /// Why the owner is gone, once it is known lost.
    pub lost: std::sync::OnceLock<TransportError>,
    /// Where the device reaches the owner's memory (RDMA verbs): operations go straight to it.
    pub native: Option<RemoteKey>,
    /// The owner revoked the segment (unpublished it): operations fail as unpublished.
    pub revoked: std::sync::atomic::AtomicBool,
}

/// A segment registered with the device (RDMA verbs): its registration and who attached to it.
struct Registered {
    handle: u64,
    key: RemoteKey,
    /// Ranks that attached to it (told when it is unpublished).
    attached: Vec<Rank>,
}

/// An unpublished segment whose registration stays until every rank that may still have device
/// operations on it in flight says it has none (its memory stays too).
struct Retired {
    handle: u64,
    _mem: Arc<SegMem>,
    waiting: Vec<Rank>,
}

enum State {
    Running,
    Done(Result<Reply, Error>),
}

struct Pending {
    generation: u32,
    peer: Rank,
    seg: SegmentId,
    seq: u64,
    /// Replies still expected.
    left: usize,
    data: Vec<(usize, Bytes)>,
    state: State,
    waker: Option<Waker>,
    event: Option<Arc<EventShared>>,
    /// Nobody polls it any more (its future was dropped or handed to an event).
    detached: bool,
}

/// An enqueue waiting for room.
struct Held {
    from: Rank,
    req: u64,
    serial: u32,
    record: Bytes,
}

/// The handle on a started operation: its slab key and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    key: usize,
    generation: u32,
}

impl Key {
    fn req(self) -> u64 {
        (u64::from(self.generation) << 32) | self.key as u64
    }
}

/// Both sides of one rank's emulated one-sided communication.
pub(crate) struct Service {
    me: Rank,
    /// The largest message this rank receives: attaching peers cut their puts to it.
    max_message: usize,
    segments: HashMap<u32, Arc<SegMem>>,
    next_serial: u32,
    held: VecDeque<Held>,
    held_from: HashMap<Rank, u32>,
    waiters: HashMap<u32, Vec<Waker>>,
    pending: Slab<Pending>,
    generation: u32,
    seq: u64,
    /// Operations in flight per target rank.
    inflight: HashMap<Rank, usize>,
    lost: HashMap<Rank, TransportError>,
    remotes: HashMap<SegmentId, Arc<Remote>>,
    out: VecDeque<(Rank, u64, Bytes)>,
    /// Fences waiting for operations to complete (woken at every completion).
    fence_waiters: Vec<Waker>,
    closed: bool,
    /// Owner side: segments registered with the device, by serial.
    registered: HashMap<u32, Registered>,
    /// Owner side: unpublished registered segments, by serial.
    retired: HashMap<u32, Retired>,
    /// Registrations to end (the hook hands them to the transport).
    deregister: Vec<u64>,
    /// Initiator side: revoked segments to report released once no operation on them runs.
    releasing: Vec<SegmentId>,
}

impl Service {
    pub(crate) fn new(me: Rank, max_message: usize) -> Service {
        Service {
            me,
            max_message,
            segments: HashMap::new(),
            next_serial: 1,
            held: VecDeque::new(),
            held_from: HashMap::new(),
            waiters: HashMap::new(),
            pending: Slab::new(),
            generation: 0,
            seq: 0,
            inflight: HashMap::new(),
            lost: HashMap::new(),
            remotes: HashMap::new(),
            out: VecDeque::new(),
            fence_waiters: Vec::new(),
            closed: false,
            registered: HashMap::new(),
            retired: HashMap::new(),
            deregister: Vec::new(),
            releasing: Vec::new(),
        }
    }

    /// The next message to send: (destination, tag, payload).
    pub(crate) fn poll_transmit(&mut self) -> Option<(Rank, u64, Bytes)> {
        self.out.pop_front()
    }

    /// Whether the service needs progress rounds of its own: operations in flight, whose targets
    /// it watches, or held enqueues to retry.
    pub(crate) fn busy(&self) -> bool {
        !self.pending.is_empty() || !self.held.is_empty() || !self.releasing.is_empty() || !self.deregister.is_empty()
    }

    /// Learns of the lost ranks among those it watches (targets of operations in flight, owners of
    /// attached segments) from `lost`; returns how many. Allocates only when it finds one.
    pub(crate) fn scan_lost(&mut self, lost: impl Fn(Rank) -> Option<TransportError>) -> usize {
        let mut found = Vec::new();
        let owners = self.remotes.values().filter(|r| r.lost.get().is_none()).map(|r| r.id.owner());
        for r in self.inflight.keys().copied().chain(owners) {
            if !self.lost.contains_key(&r)
                && !found.iter().any(|(f, _)| *f == r)
                && let Some(reason) = lost(r)
            {
                found.push((r, reason));
            }
        }
        let n = found.len();
        for (r, reason) in found {
            self.peer_lost(r, reason);
        }
        n
    }

    fn send(&mut self, to: Rank, m: Msg) {
        if self.closed {
            return;
        }
        let (tag, payload) = m.encode();
        self.out.push_back((to, tag, payload));
    }

    // ---- target side ----

    /// Publishes `mem` (made by [`Service::reserve`]'s id).
    pub(crate) fn publish(&mut self, mem: Arc<SegMem>) {
        self.segments.insert(mem.id.serial(), mem);
    }

    /// A fresh serial for a segment about to be published.
    pub(crate) fn reserve(&mut self) -> Result<u32, Error> {
        let s = self.next_serial;
        self.next_serial = s.checked_add(1).ok_or_else(|| Error::from(crate::InvalidArgument::SegmentIdsExhausted))?;
        Ok(s)
    }

    /// Unpublishes segment `serial`: requests from now on are refused; held enqueues fail; the
    /// owner's waiters wake (to see it closed).
    pub(crate) fn unpublish(&mut self, serial: u32) {
        let Some(mem) = self.segments.remove(&serial) else { return };
        mem.close();
        let id = mem.id;
        if let Some(reg) = self.registered.remove(&serial) {
            // Peers that attached may have device operations in flight: the registration (and
            // the memory) stays until each says it has none. This rank's own (loopback) ones too.
            let mut waiting: Vec<Rank> = reg.attached.into_iter().filter(|r| !self.lost.contains_key(r)).collect();
            for &r in &waiting {
                self.send(r, Msg::Revoke { serial });
            }
            waiting.push(self.me);
            self.retired.insert(serial, Retired { handle: reg.handle, _mem: mem.clone(), waiting });
            if let Some(own) = self.remotes.remove(&id) {
                own.revoked.store(true, Ordering::Release);
            }
            self.releasing.push(id);
        }
        let mut kept = VecDeque::new();
        for h in std::mem::take(&mut self.held) {
            if h.serial == serial {
                self.unhold(h.from, h.serial);
                self.send(h.from, Msg::Fail { req: h.req, error: RmaError::Unpublished { id } });
            } else {
                kept.push_back(h);
            }
        }
        self.held = kept;
        self.wake_owner(serial);
    }

    fn unhold(&mut self, from: Rank, serial: u32) {
        if let Some(m) = self.segments.get(&serial) {
            m.held.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(n) = self.held_from.get_mut(&from) {
            *n -= 1;
            if *n == 0 {
                self.held_from.remove(&from);
            }
        }
    }

    /// Registers the owner's waker for segment `serial` (notifications, queue records) and tells
    /// writers through mappings to ring (`what`: a `WAIT_*` bit).
    pub(crate) fn wait_owner(&mut self, serial: u32, what: u64, w: &Waker) {
        let ws = self.waiters.entry(serial).or_default();
        if !ws.iter().any(|x| x.will_wake(w)) {
            ws.push(w.clone());
        }
        if let Some(m) = self.segments.get(&serial) {
            m.set_waiting(what);
        }
    }

    fn wake_owner(&mut self, serial: u32) {
        if let Some(m) = self.segments.get(&serial) {
            m.clear_waiting();
        }
        for w in self.waiters.remove(&serial).unwrap_or_default() {
            w.wake();
        }
    }

    fn segment(&self, serial: u32) -> Result<&Arc<SegMem>, RmaError> {
        let id = SegmentId::new(self.me, serial);
        match self.segments.get(&serial) {
            Some(m) => Ok(m),
            None if serial != 0 && serial < self.next_serial => Err(RmaError::Unpublished { id }),
            None => Err(RmaError::UnknownSegment { id }),
        }
    }

    /// A request from `from`: applied (or refused), and answered.
    fn serve(&mut self, from: Rank, m: Msg) {
        let reply = match m {
            Msg::Attach { req, serial } => match self.segment(serial) {
                Ok(_) => {
                    let rdma = match self.registered.get_mut(&serial) {
                        Some(reg) => {
                            if !reg.attached.contains(&from) {
                                reg.attached.push(from);
                            }
                            reg.key
                        }
                        None => RemoteKey::default(),
                    };
                    let mem = self.segments.get(&serial).expect("just found");
                    Msg::Attached {
                        req,
                        info: AttachInfo {
                            len: mem.len,
                            access: mem.access,
                            kind: mem.kind,
                            pid: std::process::id() as i32,
                            fd: mem.raw_fd(),
                            nonce: mem.nonce,
                            max_message: self.max_message,
                            rdma,
                        },
                    }
                }
                Err(error) => Msg::Fail { req, error },
            },
            Msg::Put { req, serial, notify, layout, start, data } => {
                let r = self.segment(serial).cloned().and_then(|mem| {
                    let bytes = layout.bytes()?;
                    if start.checked_add(data.len()).is_none_or(|e| e > bytes) {
                        return Err(RmaError::Geometry("data outside the transfer".into()));
                    }
                    mem.check(Access::PUT, layout.span()?)?;
                    mem.put_stream(&layout, start, &data);
                    if notify {
                        mem.notify(1);
                        self.wake_owner(serial);
                    }
                    Ok(())
                });
                match r {
                    Ok(()) => Msg::Ack { req },
                    Err(error) => Msg::Fail { req, error },
                }
            }
            Msg::Get { req, serial, layout, start, len } => {
                let r = self.segment(serial).and_then(|mem| {
                    let bytes = layout.bytes()?;
                    if start.checked_add(len).is_none_or(|e| e > bytes) {
                        return Err(RmaError::Geometry("range outside the transfer".into()));
                    }
                    // Initiators ask for at most a chunk per message: a larger reply (overlapping
                    // runs make a transfer longer than its reach) is refused, not allocated.
                    if len > MAX_CHUNK {
                        return Err(RmaError::Geometry(format!("a get of {len} bytes in one message")));
                    }
                    mem.check(Access::GET, layout.span()?)?;
                    let mut out = vec![0u8; len];
                    mem.get_stream(&layout, start, &mut out);
                    Ok(out)
                });
                match r {
                    Ok(data) => Msg::Data { req, start, data: data.into() },
                    Err(error) => Msg::Fail { req, error },
                }
            }
            Msg::Atomic { req, serial, op, off } => {
                let r = self.segment(serial).and_then(|mem| {
                    RmaError::check_word(mem.access, off as u64, mem.len as u64)?;
                    Ok(mem.atomic(op, off))
                });
                match r {
                    Ok(value) => Msg::Value { req, value },
                    Err(error) => Msg::Fail { req, error },
                }
            }
            Msg::Notify { req, serial, n } => {
                let r = self.segment(serial).cloned().and_then(|mem| {
                    RmaError::check(Access::PUT, mem.access, 0, 0, 0)?;
                    mem.notify(n);
                    self.wake_owner(serial);
                    Ok(())
                });
                match r {
                    Ok(()) => Msg::Ack { req },
                    Err(error) => Msg::Fail { req, error },
                }
            }
            Msg::Enqueue { req, serial, record } => match self.enqueue(from, req, serial, record) {
                Ok(None) => return,
                Ok(Some(())) => Msg::Ack { req },
                Err(error) => Msg::Fail { req, error },
            },
            Msg::Wake { serial } => {
                if self.segments.contains_key(&serial) {
                    self.wake_owner(serial);
                }
                return;
            }
            Msg::Revoke { serial } => {
                let id = SegmentId::new(from, serial);
                if let Some(r) = self.remotes.remove(&id) {
                    r.revoked.store(true, Ordering::Release);
                }
                if !self.releasing.contains(&id) {
                    self.releasing.push(id);
                }
                return;
            }
            Msg::Released { serial } => return self.released(from, serial),
            _ => unreachable!("not a request"),
        };
        self.send(from, reply);
    }

    /// An enqueue: done (`Some`), held for room (`None`), or refused.
    fn enqueue(&mut self, from: Rank, req: u64, serial: u32, record: Bytes) -> Result<Option<()>, RmaError> {
        let mem = self.segment(serial)?.clone();
        let SegmentKind::Queue { record: rlen, .. } = mem.kind else {
            return Err(RmaError::NotPermitted { needed: Access::QUEUE, granted: mem.access });
        };
        RmaError::check(Access::QUEUE, mem.access, 0, 0, 0)?;
        if record.len() != rlen {
            return Err(RmaError::RecordSize { len: record.len() as u64, record: rlen as u64 });
        }
        // Behind enqueues already waiting for this queue: keep their order.
        let behind = self.held.iter().any(|h| h.serial == serial);
        if !behind && mem.try_enqueue(&record) {
            self.wake_owner(serial);
            return Ok(Some(()));
        }
        let n = self.held_from.entry(from).or_default();
        if *n >= HELD_PER_PEER {
            return Err(RmaError::QueueFull { id: mem.id });
        }
        *n += 1;
        mem.held.fetch_add(1, Ordering::Relaxed);
        self.held.push_back(Held { from, req, serial, record });
        Ok(None)
    }

    /// Retries the held enqueues (after the owner dequeued); true if any went in.
    pub(crate) fn serve_held(&mut self) -> bool {
        let mut blocked: Vec<u32> = Vec::new();
        let mut kept = VecDeque::new();
        let mut moved = false;
        for h in std::mem::take(&mut self.held) {
            if blocked.contains(&h.serial) {
                kept.push_back(h);
                continue;
            }
            match self.segments.get(&h.serial).cloned() {
                Some(mem) if mem.try_enqueue(&h.record) => {
                    self.unhold(h.from, h.serial);
                    self.send(h.from, Msg::Ack { req: h.req });
                    self.wake_owner(h.serial);
                    moved = true;
                }
                Some(_) => {
                    blocked.push(h.serial);
                    kept.push_back(h);
                }
                None => {
                    self.unhold(h.from, h.serial);
                    let id = SegmentId::new(self.me, h.serial);
                    self.send(h.from, Msg::Fail { req: h.req, error: RmaError::Unpublished { id } });
                }
            }
        }
        self.held = kept;
        moved
    }

    /// Rings the owner of segment `serial` (a writer through a mapping saw it sleeping).
    pub(crate) fn ring(&mut self, owner: Rank, serial: u32) {
        if owner == self.me {
            self.wake_owner(serial);
        } else if !self.closed && !self.lost.contains_key(&owner) {
            self.send(owner, Msg::Wake { serial });
        }
    }

    /// Whether enqueues wait for room in segment `serial`.
    #[cfg(test)]
    pub(crate) fn has_held(&self, serial: u32) -> bool {
        self.held.iter().any(|h| h.serial == serial)
    }

    // ---- messages from peers ----

    /// A one-sided message from `from`.
    pub(crate) fn handle(&mut self, from: Rank, tag: u64, payload: Bytes) {
        if self.lost.contains_key(&from) {
            return;
        }
        let m = match Msg::decode(tag, payload) {
            Ok(m) => m,
            Err((req, what)) => {
                tracing::warn!(peer = from, tag, what, "malformed one-sided message");
                if let Some(req) = req {
                    if tag < 16 {
                        let error = RmaError::Malformed { rank: from, what };
                        self.send(from, Msg::Fail { req, error });
                    } else {
                        self.finish(from, req, Err(Error::Rma(RmaError::Malformed { rank: from, what })));
                    }
                }
                return;
            }
        };
        let Some(req) = m.reply_to() else { return self.serve(from, m) };
        let Some(p) = self.entry(from, req) else { return };
        match m {
            Msg::Ack { .. } => {
                p.left = p.left.saturating_sub(1);
                if p.left == 0 {
                    self.finish(from, req, Ok(Reply::Unit));
                }
            }
            Msg::Data { start, data, .. } => {
                p.data.push((start, data));
                p.left = p.left.saturating_sub(1);
                if p.left == 0 {
                    let data = std::mem::take(&mut p.data);
                    self.finish(from, req, Ok(Reply::Data(data)));
                }
            }
            Msg::Value { value, .. } => self.finish(from, req, Ok(Reply::Value(value))),
            Msg::Attached { info, .. } => self.finish(from, req, Ok(Reply::Attached(info))),
            Msg::Fail { error, .. } => {
                if let RmaError::Unpublished { id } = error {
                    // Ids are never reused: the cached attachment is dead for good.
                    self.remotes.remove(&id);
                }
                let error = match error {
                    RmaError::Malformed { what, .. } => RmaError::Malformed { rank: from, what },
                    e => e,
                };
                self.finish(from, req, Err(Error::Rma(error)))
            }
            _ => unreachable!("not a reply"),
        }
    }

    /// The running operation that `req` from `from` answers, if any.
    fn entry(&mut self, from: Rank, req: u64) -> Option<&mut Pending> {
        let (key, generation) = (req as u32 as usize, (req >> 32) as u32);
        self.pending
            .get_mut(key)
            .filter(|p| p.generation == generation && p.peer == from && matches!(p.state, State::Running))
    }

    /// Operation `req` to `from` is over.
    fn finish(&mut self, from: Rank, req: u64, r: Result<Reply, Error>) {
        let key = req as u32 as usize;
        if self.entry(from, req).is_none() {
            return;
        }
        self.settle(key, r);
    }

    fn settle(&mut self, key: usize, r: Result<Reply, Error>) {
        let p = &mut self.pending[key];
        if let Some(n) = self.inflight.get_mut(&p.peer) {
            *n -= 1;
            if *n == 0 {
                self.inflight.remove(&p.peer);
            }
        }
        if let Some(ev) = &p.event {
            ev.complete(r.as_ref().map(|_| ()).map_err(Clone::clone));
        }
        for w in self.fence_waiters.drain(..) {
            w.wake();
        }
        if p.detached {
            self.pending.remove(key);
            return;
        }
        p.state = State::Done(r);
        if let Some(w) = p.waker.take() {
            w.wake();
        }
    }

    /// `rank` is lost: its operations fail, its segments are marked, its held enqueues dropped.
    pub(crate) fn peer_lost(&mut self, rank: Rank, reason: TransportError) {
        if self.lost.contains_key(&rank) {
            return;
        }
        self.lost.insert(rank, reason.clone());
        let serials: Vec<u32> = self.retired.keys().copied().collect();
        for serial in serials {
            self.released(rank, serial);
        }
        self.releasing.retain(|id| id.owner() != rank);
        let keys: Vec<usize> = self
            .pending
            .iter()
            .filter(|(_, p)| p.peer == rank && matches!(p.state, State::Running))
            .map(|(k, _)| k)
            .collect();
        for k in keys {
            self.settle(k, Err(Error::PeerLost { rank, reason: reason.clone() }));
        }
        for r in self.remotes.values().filter(|r| r.id.owner() == rank) {
            let _ = r.lost.set(reason.clone());
        }
        let dropped: Vec<u32> = self.held.iter().filter(|h| h.from == rank).map(|h| h.serial).collect();
        for serial in dropped {
            self.unhold(rank, serial);
        }
        self.held.retain(|h| h.from != rank);
    }

    /// This rank shuts down: every operation fails, every waiter wakes.
    pub(crate) fn close(&mut self) {
        self.closed = true;
        self.out.clear();
        let keys: Vec<usize> =
            self.pending.iter().filter(|(_, p)| matches!(p.state, State::Running)).map(|(k, _)| k).collect();
        for k in keys {
            self.settle(k, Err(Error::Shutdown));
        }
        let serials: Vec<u32> = self.waiters.keys().copied().collect();
        for s in serials {
            self.wake_owner(s);
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    // ---- initiator side ----

    /// Starts an operation on segment `seg` whose requests `msgs` makes from the request id; it
    /// completes after as many replies as requests (at least one request).
    pub(crate) fn start(&mut self, seg: SegmentId, msgs: impl FnOnce(u64) -> Vec<Msg>) -> Key {
        let peer = seg.owner();
        self.generation = self.generation.wrapping_add(1);
        self.seq += 1;
        let entry = self.pending.vacant_entry();
        let key = Key { key: entry.key(), generation: self.generation };
        let msgs = msgs(key.req());
        debug_assert!(!msgs.is_empty());
        entry.insert(Pending {
            generation: key.generation,
            peer,
            seg,
            seq: self.seq,
            left: msgs.len(),
            data: Vec::new(),
            state: State::Running,
            waker: None,
            event: None,
            detached: false,
        });
        *self.inflight.entry(peer).or_default() += 1;
        if let Some(reason) = self.lost.get(&peer).cloned() {
            self.settle(key.key, Err(Error::PeerLost { rank: peer, reason }));
        } else if self.closed {
            self.settle(key.key, Err(Error::Shutdown));
        } else {
            for m in msgs {
                self.send(peer, m);
            }
        }
        key
    }

    fn get(&mut self, k: Key) -> Option<&mut Pending> {
        self.pending.get_mut(k.key).filter(|p| p.generation == k.generation)
    }

    /// The result of `k` if it is over (the entry is freed then); otherwise registers `cx`.
    pub(crate) fn poll(&mut self, k: Key, cx: Option<&mut Context<'_>>) -> Poll<Result<Reply, Error>> {
        let Some(p) = self.get(k) else { return Poll::Ready(Err(Error::Shutdown)) };
        match &p.state {
            State::Done(_) => {
                let State::Done(r) = self.pending.remove(k.key).state else { unreachable!() };
                Poll::Ready(r)
            }
            State::Running => {
                if let Some(cx) = cx
                    && p.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker()))
                {
                    p.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// Nobody waits for `k` any more; it still completes (its requests are out) and is then freed.
    pub(crate) fn detach(&mut self, k: Key) {
        let Some(p) = self.get(k) else { return };
        match p.state {
            State::Done(_) => _ = self.pending.remove(k.key),
            State::Running => {
                p.detached = true;
                p.waker = None;
            }
        }
    }

    /// Hands `k`'s completion to `ev` instead of a future.
    pub(crate) fn on_event(&mut self, k: Key, ev: Arc<EventShared>) {
        let Some(p) = self.get(k) else { return ev.complete(Err(Error::Shutdown)) };
        match p.state {
            State::Done(_) => {
                let State::Done(r) = self.pending.remove(k.key).state else { unreachable!() };
                ev.complete(r.map(|_| ()));
            }
            State::Running => {
                p.detached = true;
                p.waker = None;
                p.event = Some(ev);
            }
        }
    }

    /// The sequence number the next operation will get: a fence started now waits for the
    /// operations below it.
    pub(crate) fn fence_point(&self) -> u64 {
        self.seq + 1
    }

    /// Whether every operation on `seg` started before fence point `at` has completed; otherwise
    /// registers `cx` to be woken at the next completion.
    pub(crate) fn fenced(&mut self, seg: SegmentId, at: u64, cx: Option<&mut Context<'_>>) -> bool {
        let open = self.pending.iter().any(|(_, p)| p.seg == seg && p.seq < at && matches!(p.state, State::Running));
        if open
            && let Some(cx) = cx
            && !self.fence_waiters.iter().any(|w| w.will_wake(cx.waker()))
        {
            self.fence_waiters.push(cx.waker().clone());
        }
        !open
    }

    /// The attached segment `id`, if cached.
    pub(crate) fn cached(&self, id: SegmentId) -> Option<Arc<Remote>> {
        self.remotes.get(&id).cloned()
    }

    /// Caches an attached segment (the first one made wins).
    pub(crate) fn cache(&mut self, r: Arc<Remote>) -> Arc<Remote> {
        if let Some(reason) = self.lost.get(&r.id.owner()) {
            let _ = r.lost.set(reason.clone());
        }
        self.remotes.entry(r.id).or_insert(r).clone()
    }

    /// Forgets a cached segment that turned out unpublished (handles keep their own reference).
    pub(crate) fn forget(&mut self, id: SegmentId) {
        self.remotes.remove(&id);
    }

    // ---- device (RDMA verbs) operations ----

    /// Segment `serial` was registered with the device: attaching peers get `key`.
    pub(crate) fn registered(&mut self, serial: u32, handle: u64, key: RemoteKey) {
        self.registered.insert(serial, Registered { handle, key, attached: Vec::new() });
    }

    /// The device key of this rank's segment `serial`, if registered.
    pub(crate) fn own_key(&self, serial: u32) -> Option<RemoteKey> {
        self.registered.get(&serial).map(|r| r.key)
    }

    /// `from` has no device operation on retired segment `serial` in flight any more.
    fn released(&mut self, from: Rank, serial: u32) {
        let Some(r) = self.retired.get_mut(&serial) else { return };
        r.waiting.retain(|&w| w != from);
        if r.waiting.is_empty() {
            let r = self.retired.remove(&serial).expect("just found");
            self.deregister.push(r.handle);
        }
    }

    /// Registrations to end now (their memory may go once ended).
    pub(crate) fn take_deregister(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.deregister)
    }

    /// Reports revoked segments released once none of this rank's operations on them runs.
    pub(crate) fn release_ready(&mut self) -> usize {
        if self.releasing.is_empty() {
            return 0;
        }
        let ready: Vec<SegmentId> = self
            .releasing
            .iter()
            .copied()
            .filter(|id| !self.pending.iter().any(|(_, p)| p.seg == *id && matches!(p.state, State::Running)))
            .collect();
        self.releasing.retain(|id| !ready.contains(id));
        for id in &ready {
            if id.owner() == self.me {
                self.released(self.me, id.serial());
            } else if !self.lost.contains_key(&id.owner()) {
                self.send(id.owner(), Msg::Released { serial: id.serial() });
            }
        }
        ready.len()
    }

    /// Starts an operation that the device carries out (one completion ends it); returns its
    /// key, and whether to post it (not if it already failed: target lost, shutdown).
    pub(crate) fn start_native(&mut self, seg: SegmentId) -> (Key, bool) {
        let peer = seg.owner();
        self.generation = self.generation.wrapping_add(1);
        self.seq += 1;
        let key = self.pending.insert(Pending {
            generation: self.generation,
            peer,
            seg,
            seq: self.seq,
            left: 1,
            data: Vec::new(),
            state: State::Running,
            waker: None,
            event: None,
            detached: false,
        });
        let key = Key { key, generation: self.generation };
        *self.inflight.entry(peer).or_default() += 1;
        if let Some(reason) = self.lost.get(&peer).cloned() {
            self.settle(key.key, Err(Error::PeerLost { rank: peer, reason }));
            (key, false)
        } else if self.closed {
            self.settle(key.key, Err(Error::Shutdown));
            (key, false)
        } else {
            (key, true)
        }
    }

    /// The request id of `k`, the device's token for it.
    pub(crate) fn token(k: Key) -> u64 {
        k.req()
    }

    /// A device operation ended (`token`: its request id).
    pub(crate) fn native_done(&mut self, token: u64, r: Result<Done, TransportError>) {
        let key = token as u32 as usize;
        let Some(p) =
            self.pending.get(key).filter(|p| p.generation == (token >> 32) as u32 && matches!(p.state, State::Running))
        else {
            return;
        };
        let peer = p.peer;
        let r = match r {
            Ok(Done::Unit) => Ok(Reply::Unit),
            Ok(Done::Value(v)) => Ok(Reply::Value(v)),
            Ok(Done::Data(b)) => Ok(Reply::Data(vec![(0, b)])),
            Err(reason) => Err(self.lost.get(&peer).map_or(Error::PeerLost { rank: peer, reason }, |why| {
                Error::PeerLost { rank: peer, reason: why.clone() }
            })),
        };
        self.settle(key, r);
    }

    /// This rank's own published segment `serial`, for attaching to it locally.
    pub(crate) fn own(&self, serial: u32) -> Result<Arc<SegMem>, RmaError> {
        self.segment(serial).cloned()
    }

    /// Whether enqueue waiters are known for `serial` (for tests).
    #[cfg(test)]
    fn waiting_on(&self, serial: u32) -> usize {
        self.waiters.get(&serial).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rma::geometry::{Geometry, Layout, Side};
    use crate::rma::memory::AtomicOp;
    use std::task::Wake;

    struct Count(AtomicU64);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Rank 0 (initiator) and rank 1 (target), with messages moved by hand.
    struct Pair {
        a: Service,
        b: Service,
    }

    impl Pair {
        fn new() -> Pair {
            Pair { a: Service::new(0, 1 << 20), b: Service::new(1, 1 << 20) }
        }
        /// Delivers everything in flight, both ways, until quiet; returns messages moved.
        fn run(&mut self) -> usize {
            let mut n = 0;
            loop {
                let mut moved = false;
                while let Some((to, tag, p)) = self.a.poll_transmit() {
                    assert_eq!(to, 1);
                    self.b.handle(0, tag, p);
                    moved = true;
                    n += 1;
                }
                while let Some((to, tag, p)) = self.b.poll_transmit() {
                    assert_eq!(to, 0);
                    self.a.handle(1, tag, p);
                    moved = true;
                    n += 1;
                }
                if !moved {
                    return n;
                }
            }
        }
        fn window(&mut self, len: usize, access: Access) -> Arc<SegMem> {
            let serial = self.b.reserve().unwrap();
            let m = Arc::new(SegMem::create(SegmentId::new(1, serial), len, access, SegmentKind::Window, 7).unwrap());
            self.b.publish(m.clone());
            m
        }
        fn result(&mut self, k: Key) -> Result<Reply, Error> {
            match self.a.poll(k, None) {
                Poll::Ready(r) => r,
                Poll::Pending => panic!("not complete"),
            }
        }
    }

    fn put_msgs(serial: u32, g: &Geometry, src: &[u8], chunk: usize) -> impl FnOnce(u64) -> Vec<Msg> {
        let layout = g.remote_layout();
        let bytes = g.bytes().unwrap();
        let mut data = vec![0u8; bytes];
        for (lo, so, len) in g.local_layout().pieces(0..bytes) {
            data[so..so + len].copy_from_slice(&src[lo..lo + len]);
        }
        move |req| {
            (0..bytes.div_ceil(chunk).max(1))
                .map(|i| {
                    let (s, e) = (i * chunk, ((i + 1) * chunk).min(bytes));
                    let data = Bytes::copy_from_slice(&data[s..e]);
                    Msg::Put { req, serial, notify: false, layout, start: s, data }
                })
                .collect()
        }
    }

    /// The device route's protocol: the key travels in the attach answer; device operations
    /// complete by their tokens (once: a late or duplicate completion is ignored); unpublishing
    /// revokes the segment at the attached peer, which answers released only once its operation
    /// in flight is over, and only then is the registration handed back for ending.
    #[test]
    fn device_operations_and_revocation() {
        let mut p = Pair::new();
        let mem = p.window(4096, Access::WINDOW);
        let id = mem.id;
        let key = RemoteKey { addr: 0x1000, rkey: 77 };
        p.b.registered(id.serial(), 5, key);
        assert_eq!(p.b.own_key(id.serial()), Some(key));
        let k = p.a.start(id, |req| vec![Msg::Attach { req, serial: id.serial() }]);
        p.run();
        let Reply::Attached(info) = p.result(k).unwrap() else { panic!() };
        assert_eq!(info.rdma, key);
        let remote = p.a.cache(Arc::new(Remote {
            id,
            info,
            mapped: None,
            lost: std::sync::OnceLock::new(),
            native: Some(info.rdma),
            revoked: false.into(),
        }));

        // Completions by token: data, value, a failure naming the target; duplicates ignored.
        let (k, post) = p.a.start_native(id);
        assert!(post);
        p.a.native_done(Service::token(k), Ok(Done::Data(Bytes::from_static(b"abc"))));
        p.a.native_done(Service::token(k), Ok(Done::Unit));
        let Ok(Reply::Data(d)) = p.result(k) else { panic!() };
        assert_eq!(d, vec![(0, Bytes::from_static(b"abc"))]);
        let (k, _) = p.a.start_native(id);
        p.a.native_done(Service::token(k), Ok(Done::Value(9)));
        assert!(matches!(p.result(k), Ok(Reply::Value(9))));
        let (k, _) = p.a.start_native(id);
        p.a.native_done(Service::token(k), Err(TransportError::Closed));
        assert!(matches!(p.result(k), Err(Error::PeerLost { rank: 1, reason: TransportError::Closed })));

        // An operation in flight when the owner unpublishes.
        let (running, _) = p.a.start_native(id);
        p.b.unpublish(id.serial());
        p.run();
        assert!(remote.revoked.load(Ordering::Acquire), "the attached peer was told");
        assert!(p.a.cached(id).is_none());
        assert_eq!(p.a.release_ready(), 0, "not released while an operation runs");
        p.b.release_ready();
        assert!(p.b.take_deregister().is_empty(), "the registration stays while the peer may use it");
        p.a.native_done(Service::token(running), Ok(Done::Unit));
        assert!(matches!(p.result(running), Ok(Reply::Unit)), "an operation already posted completes");
        assert_eq!(p.a.release_ready(), 1);
        p.run();
        assert_eq!(p.b.take_deregister(), vec![5]);
        assert!(!p.a.busy() && !p.b.busy());
    }

    /// A peer lost while the owner waits for its release counts as released.
    #[test]
    fn a_lost_peer_releases_a_revoked_segment() {
        let mut p = Pair::new();
        let mem = p.window(64, Access::WINDOW);
        let id = mem.id;
        p.b.registered(id.serial(), 3, RemoteKey { addr: 8, rkey: 1 });
        let k = p.a.start(id, |req| vec![Msg::Attach { req, serial: id.serial() }]);
        p.run();
        p.result(k).unwrap();
        p.b.unpublish(id.serial());
        p.b.release_ready();
        assert!(p.b.take_deregister().is_empty());
        p.b.peer_lost(0, TransportError::Closed);
        assert_eq!(p.b.take_deregister(), vec![3]);
    }

    #[test]
    fn attach_put_get_atomics_through_requests() {
        let mut p = Pair::new();
        let mem = p.window(4096, Access::WINDOW);
        let id = mem.id;
        let k = p.a.start(id, |req| vec![Msg::Attach { req, serial: id.serial() }]);
        p.run();
        let Reply::Attached(info) = p.result(k).unwrap() else { panic!() };
        assert_eq!((info.len, info.access, info.kind, info.nonce), (4096, Access::WINDOW, SegmentKind::Window, 7));

        // A strided put cut into 7-byte messages, checked against the memory.
        let g = Geometry::strided(5, 6, Side::at(1, 9), Side::at(100, 13));
        let src: Vec<u8> = (0..100).collect();
        let k = p.a.start(id, put_msgs(id.serial(), &g, &src, 7));
        p.run();
        assert!(matches!(p.result(k), Ok(Reply::Unit)));
        let mut want = vec![0u8; 4096];
        for (l, r) in g.runs() {
            want[r..r + 5].copy_from_slice(&src[l..l + 5]);
        }
        let mut got = vec![0u8; 4096];
        mem.read_at(0, &mut got);
        assert_eq!(got, want);

        // A get of the same geometry, in two pieces.
        let layout = g.remote_layout();
        let k = p.a.start(id, |req| {
            vec![
                Msg::Get { req, serial: id.serial(), layout, start: 0, len: 12 },
                Msg::Get { req, serial: id.serial(), layout, start: 12, len: 18 },
            ]
        });
        p.run();
        let Reply::Data(mut pieces) = p.result(k).unwrap() else { panic!() };
        pieces.sort_by_key(|x| x.0);
        let packed: Vec<u8> = pieces.into_iter().flat_map(|(_, b)| b.to_vec()).collect();
        let mut expect = vec![0u8; 30];
        for (lo, so, len) in g.local_layout().pieces(0..30) {
            expect[so..so + len].copy_from_slice(&src[lo..lo + len]);
        }
        assert_eq!(packed, expect);

        // Atomics.
        let atomic = |p: &mut Pair, op, off| {
            let k = p.a.start(id, |req| vec![Msg::Atomic { req, serial: id.serial(), op, off }]);
            p.run();
            p.result(k)
        };
        assert!(matches!(atomic(&mut p, AtomicOp::FetchAdd(5), 8), Ok(Reply::Value(0))));
        assert!(matches!(atomic(&mut p, AtomicOp::CompareSwap { current: 5, new: 1 }, 8), Ok(Reply::Value(5))));
        assert!(matches!(atomic(&mut p, AtomicOp::Swap(9), 8), Ok(Reply::Value(1))));
        assert_eq!(mem.word(8).load(Ordering::SeqCst), 9);
        assert!(matches!(
            atomic(&mut p, AtomicOp::FetchAdd(1), 12),
            Err(Error::Rma(RmaError::Misaligned { offset: 12 }))
        ));
        assert!(matches!(atomic(&mut p, AtomicOp::FetchAdd(1), 4096), Err(Error::Rma(RmaError::OutOfBounds { .. }))));
        assert!(p.a.pending.is_empty(), "nothing left behind");
    }

    #[test]
    fn the_target_checks_again_and_leaves_memory_untouched() {
        let mut p = Pair::new();
        let ro = p.window(64, Access::GET);
        let rw = p.window(64, Access::WINDOW);
        rw.write_at(0, &[0xAA; 64]);
        // A put to a read-only segment, a put past the end, a get of a huge range, all refused.
        let cases: Vec<(SegmentId, Layout, RmaError)> = vec![
            (ro.id, Layout::contiguous(0, 8), RmaError::NotPermitted { needed: Access::PUT, granted: Access::GET }),
            (rw.id, Layout::contiguous(60, 8), RmaError::OutOfBounds { offset: 60, len: 8, segment_len: 64 }),
            (
                rw.id,
                Layout { block: 4, count: [2, 1], side: Side::at(0, 100) },
                RmaError::OutOfBounds { offset: 0, len: 104, segment_len: 64 },
            ),
        ];
        for (id, layout, want) in cases {
            let data = Bytes::from(vec![1u8; layout.bytes().unwrap()]);
            let k =
                p.a.start(id, |req| vec![Msg::Put { req, serial: id.serial(), notify: true, layout, start: 0, data }]);
            p.run();
            match p.result(k) {
                Err(Error::Rma(e)) => assert_eq!(e, want),
                other => panic!("{other:?}"),
            }
        }
        let mut got = [0u8; 64];
        rw.read_at(0, &mut got);
        assert_eq!(got, [0xAA; 64], "memory unchanged");
        assert_eq!((ro.notified(), rw.notified()), (0, 0), "no notification for a refused put");
        // Data beyond the transfer it names.
        let id = rw.id;
        let k = p.a.start(id, |req| {
            vec![Msg::Put {
                req,
                serial: id.serial(),
                notify: false,
                layout: Layout::contiguous(0, 4),
                start: 2,
                data: Bytes::from_static(&[1; 4]),
            }]
        });
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Geometry(_)))));
        let k = p.a.start(id, |req| {
            vec![Msg::Get { req, serial: id.serial(), layout: Layout::contiguous(0, 64), start: 0, len: 1 << 40 }]
        });
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Geometry(_)))), "no allocation sized by the peer");
        // Overlapping runs: a short reach, a huge transfer.
        let layout = Layout { block: 8, count: [1 << 40, 1], side: Side::at(0, 0) };
        let k = p.a.start(id, |req| vec![Msg::Get { req, serial: id.serial(), layout, start: 0, len: 1 << 39 }]);
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Geometry(_)))), "no allocation sized by the peer");
        // Unknown and unpublished ids.
        let unknown = SegmentId::new(1, 99);
        let k = p.a.start(unknown, |req| vec![Msg::Attach { req, serial: 99 }]);
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::UnknownSegment { id })) if id == unknown));
        p.b.unpublish(id.serial());
        let k = p.a.start(id, |req| vec![Msg::Atomic { req, serial: id.serial(), op: AtomicOp::Swap(1), off: 0 }]);
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Unpublished { id: i })) if i == id));
        assert!(!rw.is_open());
    }

    #[test]
    fn malformed_requests_and_replies_fail_their_operation() {
        let mut p = Pair::new();
        let mem = p.window(64, Access::WINDOW);
        // A request with a bad atomic code: the target answers "malformed".
        let k = p.a.start(mem.id, |_| vec![Msg::Ack { req: 0 }]);
        p.a.out.clear();
        let (tag, payload) = Msg::Atomic { req: k.req(), serial: 1, op: AtomicOp::Swap(1), off: 0 }.encode();
        let mut v = payload.to_vec();
        v[13] = 200;
        p.b.handle(0, tag, v.into());
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Malformed { rank: 1, .. }))));
        // A truncated reply fails the operation it names.
        let k = p.a.start(mem.id, |_| vec![Msg::Ack { req: 0 }]);
        p.a.out.clear();
        let (tag, payload) = Msg::Value { req: k.req(), value: 1 }.encode();
        p.a.handle(1, tag, payload.slice(..12));
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::Malformed { rank: 1, .. }))));
        // A reply from the wrong rank, or to an unknown request, is ignored.
        let k = p.a.start(mem.id, |_| vec![Msg::Ack { req: 0 }]);
        p.a.out.clear();
        let (tag, payload) = Msg::Ack { req: k.req() }.encode();
        p.a.handle(2, tag, payload.clone());
        let (tag2, stale) = Msg::Ack { req: k.req() + (1 << 32) }.encode();
        p.a.handle(1, tag2, stale);
        assert!(p.a.poll(k, None).is_pending());
        p.a.handle(1, tag, payload);
        assert!(matches!(p.result(k), Ok(Reply::Unit)));
    }

    #[test]
    fn peer_loss_fails_operations_and_events() {
        let mut p = Pair::new();
        let mem = p.window(64, Access::WINDOW);
        let id = mem.id;
        let ev = Arc::new(EventShared::default());
        let k1 = p.a.start(id, |req| vec![Msg::Notify { req, serial: id.serial(), n: 1 }]);
        let k2 = p.a.start(id, |req| vec![Msg::Notify { req, serial: id.serial(), n: 1 }]);
        p.a.on_event(k2, ev.clone());
        assert_eq!(p.a.scan_lost(|_| None), 0);
        assert_eq!(p.a.inflight.keys().copied().collect::<Vec<_>>(), vec![1]);
        p.a.peer_lost(1, TransportError::Closed);
        assert!(matches!(p.result(k1), Err(Error::PeerLost { rank: 1, .. })));
        assert_eq!(ev.done.load(Ordering::SeqCst), 1);
        assert!(matches!(*ev.error.lock(), Some(Error::PeerLost { rank: 1, .. })));
        // Later operations fail at once; late replies are ignored.
        let k3 = p.a.start(id, |req| vec![Msg::Notify { req, serial: id.serial(), n: 1 }]);
        assert!(matches!(p.result(k3), Err(Error::PeerLost { rank: 1, .. })));
        p.run();
        assert!(p.a.pending.is_empty() && p.a.inflight.is_empty());
        assert_eq!(p.a.scan_lost(|_| Some(TransportError::Closed)), 0, "rank 1 is known lost already");
    }

    #[test]
    fn events_count_a_batch_and_fences_wait_for_earlier_operations() {
        let mut p = Pair::new();
        let mem = p.window(64, Access::WINDOW);
        let id = mem.id;
        let ev = Arc::new(EventShared::default());
        for i in 0..10u64 {
            let k =
                p.a.start(id, |req| vec![Msg::Atomic { req, serial: id.serial(), op: AtomicOp::FetchAdd(i), off: 0 }]);
            p.a.on_event(k, ev.clone());
        }
        let at = p.a.fence_point();
        assert!(!p.a.fenced(id, at, None));
        assert_eq!(ev.done.load(Ordering::SeqCst), 0);
        p.run();
        assert_eq!(ev.done.load(Ordering::SeqCst), 10);
        assert!(ev.error.lock().is_none());
        assert!(p.a.fenced(id, at, None));
        assert_eq!(mem.word(0).load(Ordering::SeqCst), 45);
        assert!(p.a.pending.is_empty(), "detached entries freed");
    }

    #[test]
    fn queue_credits_hold_then_refuse() {
        let mut p = Pair::new();
        let serial = p.b.reserve().unwrap();
        let q = Arc::new(
            SegMem::create(
                SegmentId::new(1, serial),
                0,
                Access::QUEUE,
                SegmentKind::Queue { record: 8, capacity: 2 },
                1,
            )
            .unwrap(),
        );
        p.b.publish(q.clone());
        let id = q.id;
        let count = Arc::new(Count(AtomicU64::new(0)));
        p.b.wait_owner(serial, crate::rma::memory::WAIT_QUEUE, &Waker::from(count.clone()));
        assert!(q.waiting(crate::rma::memory::WAIT_QUEUE));
        let enqueue = |p: &mut Pair, v: u64| {
            let record = Bytes::copy_from_slice(&v.to_le_bytes());
            p.a.start(id, |req| vec![Msg::Enqueue { req, serial, record }])
        };
        let keys: Vec<Key> = (0..2 + HELD_PER_PEER as u64 + 1).map(|v| enqueue(&mut p, v)).collect();
        p.run();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the sleeping owner was woken");
        assert!(!q.waiting(crate::rma::memory::WAIT_QUEUE));
        assert_eq!(p.b.waiting_on(serial), 0);
        assert!(matches!(p.result(keys[0]), Ok(Reply::Unit)));
        assert!(matches!(p.result(keys[1]), Ok(Reply::Unit)));
        for k in &keys[2..2 + HELD_PER_PEER as usize] {
            assert!(p.a.poll(*k, None).is_pending(), "held for room");
        }
        let last = *keys.last().unwrap();
        assert!(matches!(p.result(last), Err(Error::Rma(RmaError::QueueFull { .. }))), "beyond the credit: refused");
        // The owner drains; the held ones go in, in order.
        let mut out = [0u8; 8];
        let mut seen = Vec::new();
        while seen.len() < 2 + HELD_PER_PEER as usize {
            if q.try_dequeue(&mut out) {
                seen.push(u64::from_le_bytes(out));
            } else {
                assert!(p.b.serve_held());
                p.run();
            }
        }
        assert_eq!(seen, (0..2 + HELD_PER_PEER as u64).collect::<Vec<_>>());
        for k in &keys[2..2 + HELD_PER_PEER as usize] {
            assert!(matches!(p.result(*k), Ok(Reply::Unit)));
        }
        // Wrong record length; enqueue into a window.
        let record = Bytes::from_static(&[0; 3]);
        let k = p.a.start(id, |req| vec![Msg::Enqueue { req, serial, record }]);
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::RecordSize { len: 3, record: 8 }))));
        let w = p.window(64, Access::WINDOW);
        let record = Bytes::from_static(&[0; 8]);
        let k = p.a.start(w.id, |req| vec![Msg::Enqueue { req, serial: w.id.serial(), record }]);
        p.run();
        assert!(matches!(p.result(k), Err(Error::Rma(RmaError::NotPermitted { .. }))));
        // Unpublishing fails what is held.
        for v in 0..3 {
            enqueue(&mut p, v);
        }
        p.run();
        assert!(p.b.has_held(serial));
        p.b.unpublish(serial);
        p.run();
        assert!(!p.b.has_held(serial) && p.a.inflight.is_empty());
    }

    #[test]
    fn close_fails_everything() {
        let mut p = Pair::new();
        let mem = p.window(64, Access::WINDOW);
        let k = p.a.start(mem.id, |req| vec![Msg::Notify { req, serial: 1, n: 1 }]);
        p.a.close();
        assert!(matches!(p.result(k), Err(Error::Shutdown)));
        let k = p.a.start(mem.id, |req| vec![Msg::Notify { req, serial: 1, n: 1 }]);
        assert!(matches!(p.result(k), Err(Error::Shutdown)));
        assert!(p.a.poll_transmit().is_none(), "nothing sent after close");
    }
}
