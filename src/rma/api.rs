//! The one-sided API: segments a rank publishes ([`Segment`], [`RemoteQueue`]), handles on its peers'
//! ([`RemoteSegment`]), the operations on [`World`], and their completions ([`RmaOp`],
//! [`GetOp`], [`Event`]).
//!
//! Completion: an operation copies its source (or, on a mapping, writes it) before the call
//! returns, so the source buffer may be reused at once (local completion is the call's return;
//! the borrow of the source ends there). Remote completion (the data is visible at the target, an
//! atomic has been applied) is the returned future's, or an [`Event`]'s: [`RmaOp::on`] hands an
//! operation to an event and returns a [`Ticket`]; a batch of any size completes through one
//! event (a counter compared with the ticket), with no allocation per operation. Dropping an
//! operation's future does not cancel it: it was issued, and it takes effect.
//!
//! Ordering: operations from one rank on one segment take effect in the order they were issued
//! (on a mapping they are done by the call itself; requests are applied by the target in arrival
//! order, and the engine keeps one sender's order). [`World::fence`] waits until every earlier
//! operation on a segment is remotely complete.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use ferrocomm_reactor::{ProgressMode, Until, Wait};
use ferrocomm_transports::one_sided::{RemoteKey, Request};
use ferrocomm_transports::{Rank, TransportError};

use super::geometry::{Geometry, Layout};
use super::hook::Hook;
use super::memory::{AtomicOp, MAX_CAPACITY, MAX_RECORD, SegMem, SegmentKind, WAIT_NOTIFY, WAIT_QUEUE, queue_shape_ok};
use super::service::{EventShared, Key, Remote, Reply, Service};
use super::wire::{AttachInfo, MAX_CHUNK, Msg, OVERHEAD};
use super::{Access, RmaError, SegmentId};
use crate::api::world::{Inner, World};
use crate::error::{Error, Result};
use crate::p2p::driver::{Driver, Upper};

/// A producer facing a full queue on a mapping retries this many times at once (yielding to its
/// executor in between), then every [`NAP`].
const SPIN_TRIES: u32 = 64;
const NAP: Duration = Duration::from_millis(1);
/// The smallest message limit the emulated path works with.
const MIN_MESSAGE: usize = 4 * OVERHEAD;

/// Runs `f` on the locked driver, then hands the one-sided service's messages to the engine and
/// the engine's to the transport (calling the background task in where nobody spins).
fn locked<R>(inner: &Inner, f: impl FnOnce(&mut Driver) -> R) -> R {
    let mut g = inner.reactor.lock();
    let r = f(&mut g);
    handed_on(inner, &mut g);
    r
}

/// After `locked`'s (or a device operation's) call: the one-sided service's messages to the
/// engine, the engine's to the transport, and the background task called in where nobody spins.
fn handed_on(inner: &Inner, d: &mut Driver) {
    pump(d);
    d.flush();
    if inner.reactor.mode() == ProgressMode::Blocking && d.transport.has_queued_output() {
        inner.reactor.kick();
    }
}

/// The one-sided service of this rank (the service the driver runs in its progress is always the
/// one-sided hook, installed at bootstrap).
fn service(d: &mut Driver) -> &mut Service {
    &mut hook(&mut *d.upper).service
}

fn hook(upper: &mut dyn Upper) -> &mut Hook {
    let any: &mut dyn std::any::Any = upper;
    any.downcast_mut().expect("the driver's upper service is the one-sided hook")
}

/// Hands the one-sided service's messages to the engine.
fn pump(d: &mut Driver) {
    hook(&mut *d.upper).pump(&mut d.engine);
}

fn rma(e: RmaError) -> Error {
    Error::Rma(e)
}

/// Memory this rank publishes: its peers reach it by [`Segment::id`]. The handle keeps the memory
/// alive; dropping it unpublishes (without waiting, see [`Segment::unpublish`]).
///
/// Local access goes through copies ([`Segment::read`], [`Segment::write`]) and atomic words
/// ([`Segment::word`]): peers write this memory concurrently, so it is never lent out as a slice.
pub struct Segment {
    mem: Arc<SegMem>,
    inner: Arc<Inner>,
    live: bool,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("id", &self.mem.id).field("len", &self.mem.len).finish()
    }
}

impl Segment {
    /// The global id peers attach with.
    pub fn id(&self) -> SegmentId {
        self.mem.id
    }

    /// Data bytes.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether its length is zero.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.mem.access
    }

    fn local(&self, off: usize, len: usize) -> Result<()> {
        if off.checked_add(len).is_none_or(|e| e > self.mem.len) {
            return Err(rma(RmaError::OutOfBounds {
                offset: off as u64,
                len: len as u64,
                segment_len: self.mem.len as u64,
            }));
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from offset `off` into `dst`.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.local(off, dst.len())?;
        self.mem.read_at(off, dst);
        Ok(())
    }

    /// Copies `src` to offset `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.local(off, src.len())?;
        self.mem.write_at(off, src);
        Ok(())
    }

    /// The 64-bit word at `off` (8-byte aligned), for local atomics on the words peers update
    /// with remote atomics. Over verbs the device's atomics are atomic only among themselves:
    /// update such words with [`World::fetch_add`] and the others on the own segment (they go
    /// through the device too), and use this word to read them.
    pub fn word(&self, off: usize) -> Result<&AtomicU64> {
        if !off.is_multiple_of(8) {
            return Err(rma(RmaError::Misaligned { offset: off as u64 }));
        }
        self.local(off, 8)?;
        Ok(self.mem.word(off))
    }

    /// The data's first byte. Peers may read and write the memory at any time; accesses through
    /// the pointer must not assume exclusivity (no `&mut` slices over it).
    pub fn as_ptr(&self) -> *mut u8 {
        if self.mem.len == 0 {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        self.mem.data_ptr()
    }

    /// The notification counter: puts with notify ([`World::put_notify`]) and notifies
    /// ([`World::notify`]) add one each, after their data.
    pub fn notifications(&self) -> u64 {
        self.mem.notified()
    }

    /// Waits until the notification counter reaches `n`; returns its value. Once it returns, the
    /// data of the puts whose notifications it counted is visible here.
    pub fn wait_notifications(&self, n: u64) -> impl Future<Output = Result<u64>> + Send + 'static {
        let mem = self.mem.clone();
        let serial = mem.id.serial();
        Until::new(self.inner.reactor.clone(), move |d: &mut Driver, cx: Option<&mut Context<'_>>| {
            let v = mem.notified();
            if v >= n {
                return Poll::Ready(Ok(v));
            }
            if !mem.is_open() {
                return Poll::Ready(Err(rma(RmaError::Unpublished { id: mem.id })));
            }
            if service(d).is_closed() {
                return Poll::Ready(Err(Error::Shutdown));
            }
            if let Some(cx) = cx {
                service(d).wait_owner(serial, WAIT_NOTIFY, cx.waker());
                let v = mem.notified();
                if v >= n {
                    return Poll::Ready(Ok(v));
                }
            }
            Poll::Pending
        })
    }

    /// Unpublishes: operations from now on fail with [`RmaError::Unpublished`] (requests are
    /// refused by this rank's progress, peers mapping the segment see it closed), and enqueues
    /// waiting for room fail. An operation already under way on a peer's mapping finishes into
    /// pages that stay allocated until that peer lets go: no late operation ever touches freed
    /// memory, and none can be observed by this rank any more.
    pub async fn unpublish(mut self) -> Result<()> {
        self.live = false;
        let serial = self.mem.id.serial();
        locked(&self.inner, |d| service(d).unpublish(serial));
        Ok(())
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        self.mem.close();
        let serial = self.mem.id.serial();
        locked(&self.inner, |d| service(d).unpublish(serial));
    }
}

/// A remote queue this rank owns: peers enqueue fixed-size records ([`World::enqueue`]), the
/// owner takes them in order. Flow control is by slot: a producer waits while the queue is a
/// whole capacity ahead of the owner.
#[derive(Debug)]
pub struct RemoteQueue {
    seg: Segment,
    record: usize,
}

impl RemoteQueue {
    /// The segment's global id (its peers attach it by this id).
    pub fn id(&self) -> SegmentId {
        self.seg.id()
    }

    /// Bytes per record.
    pub fn record_len(&self) -> usize {
        self.record
    }

    /// Records it holds at most.
    pub fn capacity(&self) -> usize {
        self.seg.mem.queue_shape().map_or(0, |s| s.1)
    }

    /// Records waiting now.
    pub fn len(&self) -> usize {
        self.seg.mem.queued() as usize
    }

    /// Whether its length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the oldest record into `out` (exactly [`RemoteQueue::record_len`] bytes), if any.
    pub fn try_dequeue_into(&self, out: &mut [u8]) -> Result<bool> {
        if out.len() != self.record {
            return Err(rma(RmaError::RecordSize { len: out.len() as u64, record: self.record as u64 }));
        }
        let got = self.seg.mem.try_dequeue(out);
        if got && self.seg.mem.held.load(Ordering::Relaxed) > 0 {
            // Peers' enqueues wait at this rank for room: the progress task lets them in.
            self.seg.inner.reactor.kick();
        }
        Ok(got)
    }

    /// The oldest record, if any.
    pub fn try_dequeue(&self) -> Option<Vec<u8>> {
        let mut v = vec![0u8; self.record];
        self.try_dequeue_into(&mut v).ok()?.then_some(v)
    }

    /// Waits for the next record.
    pub fn dequeue(&self) -> impl Future<Output = Result<Vec<u8>>> + Send + 'static {
        let mem = self.seg.mem.clone();
        let (serial, record) = (mem.id.serial(), self.record);
        Until::new(self.seg.inner.reactor.clone(), move |d: &mut Driver, cx: Option<&mut Context<'_>>| {
            let mut out = vec![0u8; record];
            let mut take = |d: &mut Driver| {
                if !mem.try_dequeue(&mut out) {
                    return false;
                }
                if mem.held.load(Ordering::Relaxed) > 0 {
                    service(d).serve_held();
                    pump(d);
                    d.flush();
                }
                true
            };
            if take(d) {
                return Poll::Ready(Ok(std::mem::take(&mut out)));
            }
            if !mem.is_open() {
                return Poll::Ready(Err(rma(RmaError::Unpublished { id: mem.id })));
            }
            if service(d).is_closed() {
                return Poll::Ready(Err(Error::Shutdown));
            }
            if let Some(cx) = cx {
                service(d).wait_owner(serial, WAIT_QUEUE, cx.waker());
                if take(d) {
                    return Poll::Ready(Ok(std::mem::take(&mut out)));
                }
            }
            Poll::Pending
        })
    }

    /// The records as a stream, in order; it ends after an error (unpublished, shutdown).
    pub fn stream(&self) -> impl futures::Stream<Item = Result<Vec<u8>>> + '_ {
        futures::stream::unfold(false, move |ended| async move {
            if ended {
                return None;
            }
            let r = self.dequeue().await;
            let ended = r.is_err();
            Some((r, ended))
        })
    }

    /// Unpublishes the queue (see [`Segment::unpublish`]); enqueues waiting for room fail.
    pub async fn unpublish(self) -> Result<()> {
        self.seg.unpublish().await
    }
}

/// A segment of a peer (or of this rank), attached by id ([`World::attach`]). Cheap to clone.
#[derive(Clone)]
pub struct RemoteSegment {
    r: Arc<Remote>,
}

impl std::fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("id", &self.r.id)
            .field("len", &self.r.info.len)
            .field("access", &self.r.info.access)
            .field("mapped", &self.r.mapped.is_some())
            .finish()
    }
}

impl RemoteSegment {
    /// The segment's global id (its peers attach it by this id).
    pub fn id(&self) -> SegmentId {
        self.r.id
    }

    /// The owner's world rank.
    pub fn owner(&self) -> Rank {
        self.r.id.owner()
    }

    /// Data bytes.
    pub fn len(&self) -> usize {
        self.r.info.len
    }

    /// Whether its length is zero.
    pub fn is_empty(&self) -> bool {
        self.r.info.len == 0
    }

    /// What the owner allows.
    pub fn access(&self) -> Access {
        self.r.info.access
    }

    /// Whether operations go straight to a mapping of the owner's memory (shared memory), rather
    /// than as requests that the owner's progress applies.
    pub fn is_mapped(&self) -> bool {
        self.r.mapped.is_some()
    }

    /// Whether the RDMA device carries out puts, gets and atomics on it (a peer's segment
    /// reached over verbs), rather than a mapping or requests.
    pub fn is_device(&self) -> bool {
        self.r.native.is_some() && self.r.mapped.is_none()
    }

    /// Bytes per record, for a queue.
    pub fn record_len(&self) -> Option<usize> {
        match self.r.info.kind {
            SegmentKind::Queue { record, .. } => Some(record),
            SegmentKind::Window => None,
        }
    }
}

/// A ticket of an [`Event`]: the number of completions that mark this operation's turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// A completion counter for batches of operations (AOS's event): each operation handed to it
/// ([`RmaOp::on`]) gets the next ticket, each completion adds one, and waiting for ticket `t`
/// ends once `t` operations completed. Waiting for the last ticket of a batch waits for the whole
/// batch. The first error of any of its operations is kept and returned by the waits.
#[derive(Clone)]
pub struct Event {
    shared: Arc<EventShared>,
    inner: Arc<Inner>,
}

impl Event {
    /// Tickets handed out.
    pub fn issued(&self) -> u64 {
        self.shared.issued.load(Ordering::Acquire)
    }

    /// Operations completed.
    pub fn completed(&self) -> u64 {
        self.shared.done.load(Ordering::Acquire)
    }

    /// Whether ticket `t` has come.
    pub fn test(&self, t: Ticket) -> bool {
        self.completed() >= t.0
    }

    /// The first error an operation of this event failed with, if any.
    pub fn error(&self) -> Option<Error> {
        self.shared.error.lock().clone()
    }

    /// Waits until ticket `t` has come; fails with the first error of the event's operations.
    pub fn wait(&self, t: Ticket) -> impl Future<Output = Result<()>> + Send + 'static {
        let shared = self.shared.clone();
        Until::new(self.inner.reactor.clone(), move |_: &mut Driver, cx: Option<&mut Context<'_>>| {
            let check = || {
                (shared.done.load(Ordering::Acquire) >= t.0).then(|| shared.error.lock().clone().map_or(Ok(()), Err))
            };
            if let Some(r) = check() {
                return Poll::Ready(r);
            }
            if let Some(cx) = cx {
                shared.register(cx.waker());
                if let Some(r) = check() {
                    return Poll::Ready(r);
                }
            }
            Poll::Pending
        })
    }

    /// Waits for every operation issued so far.
    pub fn wait_all(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        self.wait(Ticket(self.issued()))
    }
}

/// An operation waiting for its replies.
struct Waiting<T> {
    inner: Arc<Inner>,
    key: Key,
    wait: Wait,
    conv: fn(Reply) -> Result<T>,
}

enum St<T> {
    Ready(T),
    Failed(Box<Error>),
    Pending(Box<Waiting<T>>),
    /// An enqueue on a mapping, waiting for room.
    Retry(Box<Retry>, fn(Reply) -> Result<T>),
    /// Steps that follow each other (a device put, then its notification; a swap made of
    /// compare-and-swaps).
    Chain(Chain<T>),
    Done,
}

type Chain<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// A one-sided operation in flight. Await it for remote completion and its result, or hand it to
/// an [`Event`]. Dropping it does not cancel the operation.
///
/// An operation that completed in its call (on a mapping) is two words, returned in registers:
/// the latency path of a put on a mapping moves nothing through memory.
#[must_use = "an operation completes remotely only when awaited or handed to an event"]
pub struct RmaOp<T: Send + 'static> {
    st: St<T>,
}

fn unit(_: Reply) -> Result<()> {
    Ok(())
}

fn value(r: Reply) -> Result<u64> {
    match r {
        Reply::Value(v) => Ok(v),
        other => unreachable!("an atomic answered {other:?}"),
    }
}

fn raw(r: Reply) -> Result<Reply> {
    Ok(r)
}

impl<T: Send + 'static> RmaOp<T> {
    #[inline]
    fn done(v: T) -> RmaOp<T> {
        RmaOp { st: St::Ready(v) }
    }

    #[cold]
    fn failed(e: Error) -> RmaOp<T> {
        RmaOp { st: St::Failed(Box::new(e)) }
    }

    fn chain(f: impl Future<Output = Result<T>> + Send + 'static) -> RmaOp<T> {
        RmaOp { st: St::Chain(Box::pin(f)) }
    }

    #[inline]
    fn of(r: Result<T>) -> RmaOp<T> {
        match r {
            Ok(v) => RmaOp::done(v),
            Err(e) => RmaOp::failed(e),
        }
    }

    /// Whether the operation has completed (it was done by the call itself: on a mapping, or
    /// refused before anything was sent).
    pub fn is_complete(&self) -> bool {
        matches!(self.st, St::Ready(_) | St::Failed(_))
    }

    /// Hands the operation to `ev` (its result, beyond success or failure, is dropped) and
    /// returns its ticket.
    pub fn on(mut self, ev: &Event) -> Ticket {
        let t = Ticket(ev.shared.issued.fetch_add(1, Ordering::AcqRel) + 1);
        match std::mem::replace(&mut self.st, St::Done) {
            St::Ready(_) => ev.shared.complete(Ok(())),
            St::Failed(e) => ev.shared.complete(Err(*e)),
            St::Pending(w) => service(&mut w.inner.reactor.lock()).on_event(w.key, ev.shared.clone()),
            St::Retry(mut retry, _) => {
                let shared = ev.shared.clone();
                let drive = async move { std::future::poll_fn(|cx| retry.poll(cx)).await };
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => _ = h.spawn(async move { shared.complete(drive.await) }),
                    Err(_) => shared
                        .complete(
                            Err(crate::InvalidArgument::NoRuntime { what: "an enqueue waiting for room" }.into()),
                        ),
                }
            }
            St::Chain(f) => {
                let shared = ev.shared.clone();
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => _ = h.spawn(async move { shared.complete(f.await.map(drop)) }),
                    Err(_) => {
                        shared.complete(Err(crate::InvalidArgument::NoRuntime { what: "a chained operation" }.into()))
                    }
                }
            }
            St::Done => ev.shared.complete(Err(Error::Shutdown)),
        }
        t
    }
}

// The result is only ever moved out whole, never pinned.
impl<T: Send + 'static> Unpin for RmaOp<T> {}

impl<T: Send + 'static> Future for RmaOp<T> {
    type Output = Result<T>;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        let r = match &mut this.st {
            St::Pending(w) => {
                let (k, conv) = (w.key, w.conv);
                let r = std::task::ready!(w.inner.reactor.poll_until(cx, &mut w.wait, |d, cx| service(d).poll(k, cx)));
                this.st = St::Done;
                return Poll::Ready(r.and_then(conv));
            }
            St::Retry(retry, conv) => {
                let conv = *conv;
                let r = std::task::ready!(retry.poll(cx));
                this.st = St::Done;
                return Poll::Ready(r.and_then(|()| conv(Reply::Unit)));
            }
            St::Chain(f) => {
                let r = std::task::ready!(f.as_mut().poll(cx));
                this.st = St::Done;
                return Poll::Ready(r);
            }
            _ => std::mem::replace(&mut this.st, St::Done),
        };
        Poll::Ready(match r {
            St::Ready(v) => Ok(v),
            St::Failed(e) => Err(*e),
            _ => Err(Error::Shutdown),
        })
    }
}

impl<T: Send + 'static> Drop for RmaOp<T> {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.st, St::Done) {
            St::Pending(w) => service(&mut w.inner.reactor.lock()).detach(w.key),
            // Not cancelled: its remaining steps run on their own.
            St::Chain(f) => {
                if let Ok(h) = tokio::runtime::Handle::try_current() {
                    h.spawn(async move { drop(f.await) });
                }
            }
            _ => {}
        }
    }
}

/// An enqueue into a full queue on a mapping: it retries until a slot is free.
struct Retry {
    inner: Arc<Inner>,
    remote: Arc<Remote>,
    mem: Arc<SegMem>,
    record: Box<[u8]>,
    tries: u32,
    nap: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Retry {
    /// One attempt: `Some` once done or failed.
    fn attempt(&self) -> Option<Result<()>> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Some(Err(Error::Shutdown));
        }
        if let Some(reason) = self.remote.lost.get() {
            return Some(Err(Error::PeerLost { rank: self.remote.id.owner(), reason: reason.clone() }));
        }
        if let Err(e) = self.mem.check_open() {
            return Some(Err(rma(e)));
        }
        if !self.mem.try_enqueue(&self.record) {
            return None;
        }
        if self.mem.waiting(WAIT_QUEUE) {
            let (owner, serial) = (self.remote.id.owner(), self.remote.id.serial());
            locked(&self.inner, |d| service(d).ring(owner, serial));
        }
        Some(Ok(()))
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            if let Some(r) = self.attempt() {
                return Poll::Ready(r);
            }
            self.tries += 1;
            if self.tries < SPIN_TRIES {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let nap = self.nap.get_or_insert_with(|| Box::pin(tokio::time::sleep(NAP)));
            std::task::ready!(nap.as_mut().poll(cx));
            self.nap = None;
        }
    }
}

/// A get in flight: its data lands in the borrowed buffer when it completes.
#[must_use = "a get completes only when awaited"]
pub struct GetOp<'a> {
    /// `None`: done in the call.
    op: Option<Box<PendingGet>>,
    failed: Option<Box<Error>>,
    dst: &'a mut [u8],
}

/// A get over requests: the operation, and how its replies map to the local buffer.
struct PendingGet {
    op: RmaOp<Reply>,
    local: Layout,
    owner: Rank,
}

impl<'a> GetOp<'a> {
    fn done(dst: &'a mut [u8]) -> GetOp<'a> {
        GetOp { op: None, failed: None, dst }
    }

    #[cold]
    fn failed(e: Error, dst: &'a mut [u8]) -> GetOp<'a> {
        GetOp { op: None, failed: Some(Box::new(e)), dst }
    }

    /// Whether the get has completed (done by the call itself: on a mapping, by a device that
    /// completed it within its posting, or refused before anything was sent); awaiting it then
    /// only hands over the data or the error.
    pub fn is_complete(&self) -> bool {
        self.op.as_ref().is_none_or(|p| p.op.is_complete())
    }
}

impl Future for GetOp<'_> {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.failed.take() {
            return Poll::Ready(Err(*e));
        }
        let Some(p) = this.op.as_mut() else { return Poll::Ready(Ok(())) };
        let r = std::task::ready!(Pin::new(&mut p.op).poll(cx));
        let (local, owner) = (p.local, p.owner);
        this.op = None;
        Poll::Ready(r.and_then(|reply| {
            let Reply::Data(pieces) = reply else { return Ok(()) };
            let total = local.bytes().map_err(rma)?;
            for (start, data) in pieces {
                if start.checked_add(data.len()).is_none_or(|e| e > total) {
                    return Err(rma(RmaError::Malformed { rank: owner, what: "data outside the get" }));
                }
                for (off, s, len) in local.pieces(start..start + data.len()) {
                    this.dst[off..off + len].copy_from_slice(&data[s - start..s - start + len]);
                }
            }
            Ok(())
        }))
    }
}

/// Packs stream bytes `range` of `layout` over `src`.
fn gather(layout: &Layout, src: &[u8], range: std::ops::Range<usize>) -> Bytes {
    let mut v = Vec::with_capacity(range.len());
    for (off, _, len) in layout.pieces(range) {
        v.extend_from_slice(&src[off..off + len]);
    }
    v.into()
}

impl World {
    fn rma_inner(&self) -> &Arc<Inner> {
        self.comm().inner()
    }

    fn new_segment(&self, len: usize, access: Access, kind: SegmentKind) -> Result<Segment> {
        let inner = self.rma_inner().clone();
        if inner.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        let serial = inner.reactor.with(|d| service(d).reserve())?;
        let id = SegmentId::new(inner.rank, serial);
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(Error::system("randomness for a segment nonce"))?;
        let mem = SegMem::create(id, len, access, kind, u64::from_le_bytes(nonce))
            .map_err(Error::system(format!("segment memory of {len} bytes")))?;
        let mem = Arc::new(mem);
        inner.reactor.with(|d| {
            service(d).publish(mem.clone());
            super::verbs::register(d, service, &mem);
        });
        Ok(Segment { mem, inner, live: true })
    }

    /// Publishes `len` zeroed bytes that peers may access as `access` says (any of
    /// [`Access::GET`], [`Access::PUT`], [`Access::ATOMIC`]). The memory is shared memory that
    /// peers on this host map; the returned handle keeps it.
    pub fn publish(&self, len: usize, access: Access) -> Result<Segment> {
        if !Access::WINDOW.contains(access) {
            return Err(crate::InvalidArgument::WindowAccess { asked: access, allowed: Access::WINDOW }.into());
        }
        self.new_segment(len, access, SegmentKind::Window)
    }

    /// Publishes a copy of `data` (see [`World::publish`]).
    pub fn publish_from(&self, data: &[u8], access: Access) -> Result<Segment> {
        let seg = self.publish(data.len(), access)?;
        seg.write(0, data)?;
        Ok(seg)
    }

    /// Publishes a remote queue of `capacity` records (a power of two, at most 2^20) of `record`
    /// bytes (1 to 4096) that peers enqueue into.
    pub fn publish_queue(&self, record: usize, capacity: usize) -> Result<RemoteQueue> {
        if !queue_shape_ok(record, capacity) {
            let (max_record, max_capacity) = (MAX_RECORD, MAX_CAPACITY);
            return Err(crate::InvalidArgument::QueueShape { record, capacity, max_record, max_capacity }.into());
        }
        let seg = self.new_segment(0, Access::QUEUE, SegmentKind::Queue { record, capacity })?;
        Ok(RemoteQueue { seg, record })
    }

    /// Attaches to segment `id` (one round trip to its owner, then cached: attaching again is
    /// free). Over shared memory the owner's memory is mapped here and operations go straight
    /// to it; otherwise they are requests that the owner's progress serves.
    pub async fn attach(&self, id: SegmentId) -> Result<RemoteSegment> {
        let inner = self.rma_inner().clone();
        if id.owner() >= inner.size {
            return Err(Error::UnknownRank { rank: id.owner(), size: inner.size });
        }
        if inner.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        if let Some(r) = inner.reactor.with(|d| service(d).cached(id)) {
            return Ok(RemoteSegment { r });
        }
        let remote = if id.owner() == inner.rank {
            let mem = inner.reactor.with(|d| service(d).own(id.serial())).map_err(rma)?;
            let info = AttachInfo {
                len: mem.len,
                access: mem.access,
                kind: mem.kind,
                pid: std::process::id() as i32,
                fd: mem.raw_fd(),
                nonce: mem.nonce,
                max_message: inner.settings.max_message,
                rdma: RemoteKey::default(),
            };
            // Its own atomics on a registered segment go through the device (loopback).
            let native = inner.reactor.with(|d| service(d).own_key(id.serial()));
            Remote { id, info, mapped: Some(mem), lost: OnceLock::new(), native, revoked: false.into() }
        } else {
            if inner.settings.max_message < MIN_MESSAGE {
                let max_message = inner.settings.max_message;
                return Err(
                    crate::InvalidArgument::MessageLimit { rank: None, max_message, needed: MIN_MESSAGE }.into()
                );
            }
            let serial = id.serial();
            let reply = emulated(&inner, id, |req| vec![Msg::Attach { req, serial }], raw).await?;
            let Reply::Attached(info) = reply else {
                return Err(rma(RmaError::Malformed { rank: id.owner(), what: "attach answered without a segment" }));
            };
            if info.max_message < MIN_MESSAGE {
                let (rank, max_message) = (Some(id.owner()), info.max_message);
                return Err(crate::InvalidArgument::MessageLimit { rank, max_message, needed: MIN_MESSAGE }.into());
            }
            let route = inner.reactor.with(|d| d.transport.name_for(id.owner()));
            let mapped = if route == "shm" { map_peer(id, &info) } else { None };
            let native = (route == "verbs" && info.rdma.rkey != 0).then_some(info.rdma);
            Remote { id, info, mapped, lost: OnceLock::new(), native, revoked: false.into() }
        };
        let r = inner.reactor.with(|d| service(d).cache(Arc::new(remote)));
        Ok(RemoteSegment { r })
    }

    /// Common checks: rights and bounds at the initiator, a lost owner, shutdown.
    fn precheck(&self, r: &Remote, needed: Access, span: (usize, usize)) -> Result<()> {
        if self.rma_inner().closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        RmaError::check(needed, r.info.access, span.0 as u64, span.1 as u64, r.info.len as u64).map_err(rma)?;
        if !matches!(r.info.kind, SegmentKind::Window) && needed != Access::QUEUE {
            return Err(rma(RmaError::NotPermitted { needed, granted: r.info.access }));
        }
        if let Some(reason) = r.lost.get() {
            return Err(Error::PeerLost { rank: r.id.owner(), reason: reason.clone() });
        }
        if r.revoked.load(Ordering::Acquire) {
            return Err(rma(RmaError::Unpublished { id: r.id }));
        }
        Ok(())
    }

    /// An error of an operation on a mapping; an unpublished segment leaves the cache.
    fn mapped_err(&self, r: &Remote, e: RmaError) -> Error {
        if matches!(e, RmaError::Unpublished { .. }) {
            self.rma_inner().reactor.with(|d| service(d).forget(r.id));
        }
        rma(e)
    }

    /// Writes `src` at `offset` of `dst`.
    pub fn put(&self, dst: &RemoteSegment, offset: usize, src: &[u8]) -> RmaOp<()> {
        if let Some(mem) = &dst.r.mapped {
            // The common case on a mapping, without a geometry: one check and one copy.
            let r = self.precheck(&dst.r, Access::PUT, (offset, src.len())).and_then(|()| {
                mem.check_open().map_err(|e| self.mapped_err(&dst.r, e))?;
                mem.write_at(offset, src);
                Ok(())
            });
            return RmaOp::of(r);
        }
        self.put_impl(dst, &Geometry::contiguous(0, offset, src.len()), src, false)
    }

    /// Writes the runs of `geometry` from `src` into `dst` (strided, sub-arrays, ...).
    pub fn put_with(&self, dst: &RemoteSegment, geometry: &Geometry, src: &[u8]) -> RmaOp<()> {
        self.put_impl(dst, geometry, src, false)
    }

    /// [`World::put`], then adds one to the segment's notification counter once the data is in
    /// place: the owner learns that it landed ([`Segment::wait_notifications`]) without a message
    /// of its own.
    pub fn put_notify(&self, dst: &RemoteSegment, offset: usize, src: &[u8]) -> RmaOp<()> {
        self.put_impl(dst, &Geometry::contiguous(0, offset, src.len()), src, true)
    }

    /// [`World::put_with`] with a notification (see [`World::put_notify`]).
    pub fn put_with_notify(&self, dst: &RemoteSegment, geometry: &Geometry, src: &[u8]) -> RmaOp<()> {
        self.put_impl(dst, geometry, src, true)
    }

    fn put_impl(&self, dst: &RemoteSegment, g: &Geometry, src: &[u8], notify: bool) -> RmaOp<()> {
        let r = &dst.r;
        let (bytes, span) = match g.check_local(src.len()) {
            Ok(x) => x,
            Err(e) => return RmaOp::failed(rma(e)),
        };
        if let Err(e) = self.precheck(r, Access::PUT, span) {
            return RmaOp::failed(e);
        }
        if let Some(mem) = &r.mapped {
            let res = mem.check_open().map(|()| mem.put(g, src));
            if res.is_ok() && notify && mem.notify(1) {
                let (owner, serial) = (r.id.owner(), r.id.serial());
                locked(self.rma_inner(), |d| service(d).ring(owner, serial));
            }
            return RmaOp::of(res.map_err(|e| self.mapped_err(r, e)));
        }
        if bytes == 0 && !notify {
            return RmaOp::done(());
        }
        if let Some(key) = r.native {
            return self.device_put(r, key, g, src, bytes, notify);
        }
        let chunk = r.info.max_message.min(MAX_CHUNK) - OVERHEAD;
        let local = g.local_layout();
        let pieces: Vec<(usize, Bytes)> = (0..bytes.div_ceil(chunk).max(1))
            .map(|i| (i * chunk, gather(&local, src, i * chunk..((i + 1) * chunk).min(bytes))))
            .collect();
        let (layout, serial, n) = (g.remote_layout(), r.id.serial(), pieces.len());
        emulated(
            self.rma_inner(),
            r.id,
            |req| {
                pieces
                    .into_iter()
                    .enumerate()
                    .map(|(i, (start, data))| Msg::Put {
                        req,
                        serial,
                        notify: notify && i + 1 == n,
                        layout,
                        start,
                        data,
                    })
                    .collect()
            },
            unit,
        )
    }

    /// Adds one to `dst`'s notification counter, after every earlier put of this rank to it.
    pub fn notify(&self, dst: &RemoteSegment) -> RmaOp<()> {
        let r = &dst.r;
        if let Err(e) = self.precheck(r, Access::PUT, (0, 0)) {
            return RmaOp::failed(e);
        }
        if let Some(mem) = &r.mapped {
            let res = mem.check_open().map(|()| mem.notify(1));
            if res == Ok(true) {
                let (owner, serial) = (r.id.owner(), r.id.serial());
                locked(self.rma_inner(), |d| service(d).ring(owner, serial));
            }
            return RmaOp::of(res.map(drop).map_err(|e| self.mapped_err(r, e)));
        }
        let (inner, id, serial) = (self.rma_inner().clone(), r.id, r.id.serial());
        if r.native.is_some() {
            // The notification message must not overtake device writes still in flight (or
            // waiting for room in the send queue): after them, then.
            let fence = self.fence(dst);
            return RmaOp::chain(async move {
                fence.await?;
                emulated(&inner, id, |req| vec![Msg::Notify { req, serial, n: 1 }], unit).await
            });
        }
        emulated(&inner, id, |req| vec![Msg::Notify { req, serial, n: 1 }], unit)
    }

    /// A put carried out by the device: RDMA writes of the geometry's runs (the source copied
    /// into registered memory first), then, with `notify`, the notification message once the
    /// data is in place.
    fn device_put(
        &self,
        r: &Remote,
        key: RemoteKey,
        g: &Geometry,
        src: &[u8],
        bytes: usize,
        notify: bool,
    ) -> RmaOp<()> {
        let inner = self.rma_inner();
        let local = g.local_layout();
        let packed;
        let stream: &[u8] = if local.count == [1, 1] {
            &src[local.side.offset..local.side.offset + bytes]
        } else {
            packed = gather(&local, src, 0..bytes);
            &packed
        };
        let runs = super::verbs::runs(g, key.addr);
        let op = if bytes == 0 {
            RmaOp::done(())
        } else {
            native(inner, r.id, Request::Write { src: stream, runs: &runs, rkey: key.rkey }, unit)
        };
        if !notify {
            return op;
        }
        let (inner, id, serial) = (inner.clone(), r.id, r.id.serial());
        RmaOp::chain(async move {
            op.await?;
            emulated(&inner, id, |req| vec![Msg::Notify { req, serial, n: 1 }], unit).await
        })
    }

    // ---- the device for the RDMA collectives (coll/rdma.rs): memory of the caller's ----

    /// Registers `len` bytes at `ptr` with the device (for peers' RDMA writes and reads if
    /// `remote`); `None` without a device, or if it refuses.
    ///
    /// # Safety
    /// The memory stays allocated until [`World::device_deregister`] of the handle returned.
    pub(crate) unsafe fn device_register(&self, ptr: *mut u8, len: usize, remote: bool) -> Option<(u64, RemoteKey)> {
        use ferrocomm_transports::one_sided::RemoteAccess;
        let access = RemoteAccess { read: remote, write: remote, atomic: false };
        locked(self.rma_inner(), |d| {
            let os = d.transport.one_sided()?;
            // SAFETY: the caller keeps the memory allocated until the handle is deregistered.
            match unsafe { os.register(ptr, len, access) } {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::debug!(len, error = %e, "the device refused a collective's buffer");
                    None
                }
            }
        })
    }

    /// Ends a registration of [`World::device_register`]: peers' operations with its key fail
    /// from then on. Writes from it still waiting or posted ([`World::device_write`]) keep it
    /// until they complete (the transport holds it), so a call dropped mid-way leaves the
    /// connection sound.
    pub(crate) fn device_deregister(&self, handle: u64) {
        locked(self.rma_inner(), |d| {
            if let Some(os) = d.transport.one_sided() {
                os.deregister(handle);
            }
        });
    }

    /// RDMA-writes `len` bytes at `offset` of registration `handle` (read by the device where
    /// they are) to `addr` under `rkey` at world rank `peer`. The transport keeps the registration
    /// (which pins the memory's pages) until the write completes, even if the caller deregisters
    /// it before; a handle already deregistered fails the write.
    pub(crate) fn device_write(&self, peer: Rank, handle: u64, offset: usize, len: usize, to: RemoteKey) -> RmaOp<()> {
        if len == 0 {
            return RmaOp::done(());
        }
        let runs = [ferrocomm_transports::one_sided::Run { stream: 0, addr: to.addr, len }];
        let req = Request::WriteRegistered { handle, offset, len, runs: &runs, rkey: to.rkey };
        native(self.rma_inner(), SegmentId::new(peer, u32::MAX), req, unit)
    }

    /// Reads `len` bytes at `at` of this rank's own registration (through the device's loopback
    /// connection): what peers' RDMA writes put there, whatever the rank's mapping shows now.
    pub(crate) fn device_read_own(&self, at: RemoteKey, len: usize) -> RmaOp<Bytes> {
        let runs = [ferrocomm_transports::one_sided::Run { stream: 0, addr: at.addr, len }];
        let me = self.comm().rank();
        let req = Request::Read { len, runs: &runs, rkey: at.rkey };
        native(self.rma_inner(), SegmentId::new(me, u32::MAX), req, |r| match r {
            Reply::Data(mut pieces) if pieces.len() == 1 => Ok(pieces.pop().expect("one piece").1),
            other => unreachable!("a device read answered {other:?}"),
        })
    }

    /// Reads `dst.len()` bytes at `offset` of `src` into `dst`.
    pub fn get<'a>(&self, src: &RemoteSegment, offset: usize, dst: &'a mut [u8]) -> GetOp<'a> {
        let g = Geometry::contiguous(0, offset, dst.len());
        if let Some(mem) = &src.r.mapped {
            // The common case on a mapping, without a geometry: one check and one copy.
            let r = self.precheck(&src.r, Access::GET, (offset, dst.len())).and_then(|()| {
                mem.check_open().map_err(|e| self.mapped_err(&src.r, e))?;
                mem.read_at(offset, dst);
                Ok(())
            });
            return match r {
                Ok(()) => GetOp::done(dst),
                Err(e) => GetOp::failed(e, dst),
            };
        }
        self.get_with(src, &g, dst)
    }

    /// Reads the runs of `geometry` from `src` into `dst`.
    pub fn get_with<'a>(&self, src: &RemoteSegment, geometry: &Geometry, dst: &'a mut [u8]) -> GetOp<'a> {
        let r = &src.r;
        let checked = (|| {
            let (bytes, span) = geometry.check_local(dst.len()).map_err(rma)?;
            self.precheck(r, Access::GET, span)?;
            Ok(bytes)
        })();
        let bytes = match checked {
            Ok(b) => b,
            Err(e) => return GetOp::failed(e, dst),
        };
        if let Some(mem) = &r.mapped {
            if let Err(e) = mem.check_open() {
                return GetOp::failed(self.mapped_err(r, e), dst);
            }
            mem.get(geometry, dst);
            return GetOp::done(dst);
        }
        if bytes == 0 {
            return GetOp::done(dst);
        }
        let inner = self.rma_inner();
        if let Some(key) = r.native {
            let runs = super::verbs::runs(geometry, key.addr);
            let op = native(inner, r.id, Request::Read { len: bytes, runs: &runs, rkey: key.rkey }, raw);
            let pending = PendingGet { op, local: geometry.local_layout(), owner: r.id.owner() };
            return GetOp { op: Some(Box::new(pending)), failed: None, dst };
        }
        if inner.settings.max_message < MIN_MESSAGE {
            let max_message = inner.settings.max_message;
            let e = crate::InvalidArgument::MessageLimit { rank: None, max_message, needed: MIN_MESSAGE }.into();
            return GetOp::failed(e, dst);
        }
        let chunk = inner.settings.max_message.min(MAX_CHUNK) - OVERHEAD;
        let (layout, serial) = (geometry.remote_layout(), r.id.serial());
        let op = emulated(
            inner,
            r.id,
            |req| {
                (0..bytes.div_ceil(chunk))
                    .map(|i| {
                        let start = i * chunk;
                        Msg::Get { req, serial, layout, start, len: chunk.min(bytes - start) }
                    })
                    .collect()
            },
            raw,
        );
        let pending = PendingGet { op, local: geometry.local_layout(), owner: r.id.owner() };
        GetOp { op: Some(Box::new(pending)), failed: None, dst }
    }

    fn atomic<T: Send + 'static>(
        &self,
        dst: &RemoteSegment,
        offset: usize,
        op: AtomicOp,
        conv: fn(Reply) -> Result<T>,
    ) -> RmaOp<T> {
        let r = &dst.r;
        if let Err(e) = RmaError::check_word(r.info.access, offset as u64, r.info.len as u64)
            .map_err(rma)
            .and_then(|()| self.precheck(r, Access::ATOMIC, (offset, 8)))
        {
            return RmaOp::failed(e);
        }
        if let Some(key) = r.native {
            if let Some(Err(e)) = r.mapped.as_ref().map(|m| m.check_open()) {
                return RmaOp::failed(self.mapped_err(r, e));
            }
            let (inner, id, addr, rkey) = (self.rma_inner(), r.id, key.addr + offset as u64, key.rkey);
            return match op {
                AtomicOp::FetchAdd(add) => native(inner, id, Request::FetchAdd { addr, rkey, add }, conv),
                AtomicOp::CompareSwap { current, new } => {
                    native(inner, id, Request::CompareSwap { addr, rkey, compare: current, swap: new }, conv)
                }
                AtomicOp::Swap(v) => {
                    // The device has no swap: compare-and-swap from a guess until it holds.
                    let inner = inner.clone();
                    RmaOp::chain(async move {
                        let mut guess = 0;
                        loop {
                            let req = Request::CompareSwap { addr, rkey, compare: guess, swap: v };
                            let held = native(&inner, id, req, value).await?;
                            if held == guess {
                                return conv(Reply::Value(held));
                            }
                            guess = held;
                        }
                    })
                }
            };
        }
        if let Some(mem) = &r.mapped {
            let res = mem.check_open().map(|()| mem.atomic(op, offset));
            return RmaOp::of(res.map_err(|e| self.mapped_err(r, e)).and_then(|v| conv(Reply::Value(v))));
        }
        let serial = r.id.serial();
        emulated(self.rma_inner(), r.id, |req| vec![Msg::Atomic { req, serial, op, off: offset }], conv)
    }

    /// Adds `v` (wrapping) to the 64-bit word at `offset` of `dst`; returns its previous value.
    pub fn fetch_add(&self, dst: &RemoteSegment, offset: usize, v: u64) -> RmaOp<u64> {
        self.atomic(dst, offset, AtomicOp::FetchAdd(v), value)
    }

    /// Replaces the word at `offset` with `new` if it holds `current`; returns the value it held
    /// (equal to `current` exactly when the swap happened).
    pub fn compare_and_swap(&self, dst: &RemoteSegment, offset: usize, current: u64, new: u64) -> RmaOp<u64> {
        self.atomic(dst, offset, AtomicOp::CompareSwap { current, new }, value)
    }

    /// Stores `v` in the word at `offset`; returns the value it held.
    pub fn swap(&self, dst: &RemoteSegment, offset: usize, v: u64) -> RmaOp<u64> {
        self.atomic(dst, offset, AtomicOp::Swap(v), value)
    }

    /// Adds `v` to the word at `offset` without fetching (AOS's posted add): hand it to an event
    /// or drop it; awaiting it waits for remote completion.
    pub fn add(&self, dst: &RemoteSegment, offset: usize, v: u64) -> RmaOp<()> {
        self.atomic(dst, offset, AtomicOp::FetchAdd(v), unit)
    }

    /// Waits until every operation this rank started on `dst` before the call is remotely
    /// complete (a put before a get of the same bytes needs nothing more: one rank's operations
    /// on one segment take effect in order; the fence is for completion).
    pub fn fence(&self, dst: &RemoteSegment) -> impl Future<Output = Result<()>> + Send + 'static {
        let inner = self.rma_inner().clone();
        let (id, mapped) = (dst.r.id, dst.r.mapped.is_some());
        let at = inner.reactor.with(|d| service(d).fence_point());
        Until::new(inner.reactor.clone(), move |d: &mut Driver, cx: Option<&mut Context<'_>>| {
            if mapped {
                std::sync::atomic::fence(Ordering::SeqCst);
            }
            if service(d).fenced(id, at, cx) { Poll::Ready(Ok(())) } else { Poll::Pending }
        })
    }

    /// Appends `record` (exactly the queue's record length) to the remote queue `dst`. It waits
    /// while the queue is full; over requests, the owner holds a few enqueues per peer waiting for
    /// room and refuses more with [`RmaError::QueueFull`].
    pub fn enqueue(&self, dst: &RemoteSegment, record: &[u8]) -> RmaOp<()> {
        let r = &dst.r;
        if let Err(e) = self.precheck(r, Access::QUEUE, (0, 0)) {
            return RmaOp::failed(e);
        }
        let SegmentKind::Queue { record: rlen, .. } = r.info.kind else {
            return RmaOp::failed(rma(RmaError::NotPermitted { needed: Access::QUEUE, granted: r.info.access }));
        };
        if record.len() != rlen {
            return RmaOp::failed(rma(RmaError::RecordSize { len: record.len() as u64, record: rlen as u64 }));
        }
        if let Some(mem) = &r.mapped {
            let retry = Retry {
                inner: self.rma_inner().clone(),
                remote: r.clone(),
                mem: mem.clone(),
                record: record.into(),
                tries: 0,
                nap: None,
            };
            return match retry.attempt() {
                Some(res) => RmaOp::of(res),
                None => RmaOp { st: St::Retry(Box::new(retry), unit) },
            };
        }
        let (serial, record) = (r.id.serial(), Bytes::copy_from_slice(record));
        emulated(self.rma_inner(), r.id, |req| vec![Msg::Enqueue { req, serial, record }], unit)
    }

    /// A new completion counter for batches of operations.
    pub fn event(&self) -> Event {
        Event { shared: Arc::default(), inner: self.rma_inner().clone() }
    }
}

/// Starts an operation of the emulated path.
fn emulated<T: Send + 'static>(
    inner: &Arc<Inner>,
    seg: SegmentId,
    msgs: impl FnOnce(u64) -> Vec<Msg>,
    conv: fn(Reply) -> Result<T>,
) -> RmaOp<T> {
    let (key, now) = locked(inner, |d| {
        let key = service(d).start(seg, msgs);
        (key, service(d).poll(key, None))
    });
    match now {
        Poll::Ready(r) => RmaOp::of(r.and_then(conv)),
        Poll::Pending => {
            RmaOp { st: St::Pending(Box::new(Waiting { inner: inner.clone(), key, wait: Wait::default(), conv })) }
        }
    }
}

/// Starts an operation that the device carries out: posted, then collected in the same hold
/// of the lock ([`super::verbs::collect`]), so that an operation the device completes within
/// its posting call completes in its own call.
fn native<T: Send + 'static>(
    inner: &Arc<Inner>,
    seg: SegmentId,
    req: Request<'_>,
    conv: fn(Reply) -> Result<T>,
) -> RmaOp<T> {
    let (key, now) = inner.reactor.with_spinning(|d| {
        let (key, post) = service(d).start_native(seg);
        if post {
            let token = Service::token(key);
            let posted = match d.transport.one_sided() {
                Some(os) => os.post(seg.owner(), req, token),
                None => Err(TransportError::Closed),
            };
            match posted {
                Ok(()) => super::verbs::collect(d),
                Err(e) => service(d).native_done(token, Err(e)),
            }
        }
        let now = service(d).poll(key, None);
        handed_on(inner, d);
        (key, now)
    });
    match now {
        Poll::Ready(r) => RmaOp::of(r.and_then(conv)),
        Poll::Pending => {
            RmaOp { st: St::Pending(Box::new(Waiting { inner: inner.clone(), key, wait: Wait::default(), conv })) }
        }
    }
}

/// Maps a peer's segment, if its descriptor can be fetched (same host, ptrace rights).
fn map_peer(id: SegmentId, info: &AttachInfo) -> Option<Arc<SegMem>> {
    let file = super::sys::fetch_fd(info.pid, info.fd)
        .map_err(|e| tracing::debug!(%id, error = %e, "cannot fetch the segment's descriptor; using requests"))
        .ok()?;
    SegMem::open(file, id, info.nonce, info.len, info.access, info.kind)
        .map_err(|e| tracing::warn!(%id, error = e, "cannot map the segment; using requests"))
        .ok()
        .map(Arc::new)
}
