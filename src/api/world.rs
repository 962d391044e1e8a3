//! The public API: a [`World`] (this rank's place in the job) and its communicators ([`Comm`]).
//!
//! Operations start when called (like MPI's `Isend`/`Irecv`) and return an [`Op`] future. Awaiting
//! it drives progress according to the progress mode; dropping it cancels the operation cleanly
//! (see [`Comm::send`] and [`Comm::recv`] for what that means on each side). Any operation can
//! take a deadline through [`Deadline`].
//!
//! Starting and finishing an operation are `#[inline(always)]`, down to the protocol engine (see
//! the engine's module documentation); polling it is one function per result type, with the
//! reactor's spin inlined into it.

use std::cell::Cell;
use std::future::Future;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ferrocomm_reactor::{HybridStats, OpKey, ProgressMode, Reactor, ReactorThread, Wait};
use ferrocomm_transports::{Outgoing, Rank};
use parking_lot::Mutex;

use crate::config::Settings;
use crate::error::{Error, Result};
use crate::p2p::driver::{Driver, SlabEngine};
use crate::p2p::engine::{Completion, RecvBuf};
use crate::p2p::failure::{Fate, Watch};
use crate::p2p::{Payload, Source, Status, TagMatch};

/// A connection attempt that was refused (wrong token, malformed frames, ...).
#[derive(Clone, Debug)]
pub struct Refused {
    /// Where the attempt came from.
    pub from: std::net::SocketAddr,
    /// Why it was refused.
    pub error: ferrocomm_transports::TransportError,
}

/// How this rank leaves its job's store: the goodbye on its watch and, where this rank hosts the
/// store, the store itself. The bootstrap provides it; the world only asks it to leave.
pub(crate) trait StoreLeave: Send {
    /// Says goodbye unless `aborting` (then the watch's end reports this rank dead), and stops
    /// the store if this rank hosts it, once the store told every rank's watch of the loss `lost`
    /// (the first one this rank learnt: the rank, and how), if there is one.
    fn leave(&mut self, aborting: bool, lost: Option<(Rank, String)>);
    /// The bootstrap's own type behind it.
    fn as_any(&mut self) -> &mut dyn std::any::Any;
}

pub(crate) struct Inner {
    pub rank: Rank,
    pub size: u32,
    pub settings: Settings,
    pub reactor: Reactor<Driver>,
    pub refused: Arc<Mutex<Vec<Refused>>>,
    pub listen_addr: std::net::SocketAddr,
    /// The node (host) index of every rank.
    pub nodes: Vec<u32>,
    /// The shared-memory domain of every rank: its host's ranks that can share memory, or itself
    /// alone.
    pub domains: Vec<u32>,
    /// Whether each rank busy-polls.
    pub busy: Vec<bool>,
    /// Whether each rank may read its neighbours' memory (cross-memory attach).
    pub single_copy: Vec<bool>,
    /// Derived from the job token: tells this job's multicast datagrams from another's.
    pub job_id: u64,
    /// Authenticates this job's multicast datagrams.
    pub datagram_key: ferrocomm_transports::auth::DatagramKey,
    /// The name of this job's shared-memory files, when this rank has peers over shared memory.
    pub shm_job: Option<String>,
    pub closed: AtomicBool,
    /// Per peer and rail, what striping measured and carried (when the rank has rails).
    pub rail_stats: Option<ferrocomm_transports::rails::SharedStats>,
    /// How each peer is reached, with proxy routes on.
    pub ways: Option<Vec<ferrocomm_transports::relay::Way>>,
    /// The store, where this rank hosts it, and the watch's goodbye (the bootstrap's).
    pub store_link: Mutex<Box<dyn StoreLeave>>,
    pub thread: Mutex<Option<ReactorThread>>,
    /// Departures and losses this rank knows of ([`crate::p2p::failure::Failures::changes`]): the
    /// collectives' gate asks the engine only once it is not zero.
    pub changes: Arc<AtomicU32>,
    /// The collective calls' metrics.
    pub coll_meters: crate::observe::coll::CollMeters,
}

/// The users' hold on a rank's world: every [`World`] and [`Comm`] shares one, and the last to go
/// shuts the rank down. Operations in flight hold the world itself (`Arc<Inner>`) but not this:
/// they need the world's state to finish or cancel, but they do not keep the job going, so that
/// an awaited operation can put off dropping its reference (see [`Op`]'s poll) without putting
/// off the end of the job.
struct Live(Arc<Inner>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.shut_down(Duration::from_secs(2));
    }
}

/// This rank's handle on the job. Cheap to clone; the job ends for this rank when the last clone
/// (and every [`Comm`]) is dropped, or at [`World::finalize`]. Operations still in flight then
/// fail with [`Error::Shutdown`].
#[derive(Clone)]
pub struct World {
    inner: Arc<Inner>,
    comm: Comm,
}

/// A communicator: a group of ranks with its own message space. Messages sent on one communicator
/// never match receives on another.
///
/// Cloning gives a second handle on the same communicator (not a [`Comm::dup`]).
#[derive(Clone)]
pub struct Comm {
    inner: Arc<Inner>,
    /// Keeps the job going while a handle exists. The same world as `inner`, which stays a field
    /// of its own so that starting an operation reaches the world without a second indirection.
    live: Arc<Live>,
    context: u32,
    /// What every handle on this communicator shares, the upper layers' state included.
    pub(crate) state: Arc<CommState>,
    /// The member ranks, for a communicator made by [`Comm::split`] (`None`: every rank).
    pub(crate) group: Option<Arc<Group>>,
    /// The collective selection table of this handle (default: the settings').
    pub(crate) table: Option<Arc<ferrocomm_collectives::Table>>,
    /// Whose loss revokes this communicator's contexts: its members, or for a communicator made
    /// for a parent's collectives, the parent's (see [`crate::p2p::failure`]).
    pub(crate) watch: Watch,
}

/// What every handle on one communicator shares: the count of duplicates that every rank advances
/// in the same order, and the state of the layers above point-to-point (collectives, the board,
/// the hierarchy, multicast), which they make on first use and this layer only stores.
#[derive(Default)]
pub(crate) struct CommState {
    pub dups: AtomicU32,
    /// The upper layers' state of this communicator (see [`Upper`]).
    pub upper: std::sync::OnceLock<Box<dyn Upper>>,
}

/// The per-communicator state of the layers above point-to-point, as this layer sees it: a value
/// it stores and, at [`World::finalize`], asks to settle what it sent.
pub(crate) trait Upper: std::any::Any + Send + Sync {
    /// Waits (at most `limit`) until what these layers sent outside point-to-point (multicast)
    /// has been consumed, before the goodbye.
    fn drain<'a>(&'a self, comm: &'a Comm, limit: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}

/// The members of a sub-communicator: `members[i]` is the world rank of its rank `i`.
pub(crate) struct Group {
    pub members: Vec<Rank>,
    pub rank: Rank,
    pub index: std::collections::HashMap<Rank, Rank>,
}

impl Group {
    pub(crate) fn new(members: Vec<Rank>, me: Rank) -> Group {
        let index: std::collections::HashMap<Rank, Rank> =
            members.iter().enumerate().map(|(i, &w)| (w, i as Rank)).collect();
        Group { rank: index[&me], members, index }
    }
}

/// A received message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its bytes.
    pub data: Bytes,
    /// The sender (its rank in the communicator).
    pub source: Rank,
    /// The tag it was sent with.
    pub tag: u64,
}

/// Context ids with this bit set carry collective traffic of the communicator without it.
pub(crate) const COLLECTIVE_BIT: u32 = 1 << 31;

impl World {
    pub(crate) fn from_inner(inner: Arc<Inner>) -> World {
        let live = Arc::new(Live(inner.clone()));
        inner.reactor.with(|d| d.engine.watch(0, Watch::All));
        let comm = Comm {
            inner: inner.clone(),
            live,
            context: 0,
            state: Default::default(),
            group: None,
            table: None,
            watch: Watch::All,
        };
        World { inner, comm }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.inner.rank
    }

    /// Number of ranks in the job.
    pub fn size(&self) -> u32 {
        self.inner.size
    }

    /// The communicator of all ranks.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The settings this rank runs with.
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// What adaptive mode's hybrid polling did so far: alarms set ahead of foreseeable waits'
    /// ends, and waits that completed after theirs rang.
    pub fn hybrid_stats(&self) -> HybridStats {
        self.inner.reactor.hybrid_stats()
    }

    /// Name of the transport in use.
    pub fn transport_name(&self) -> &'static str {
        self.inner.reactor.with(|d| d.transport.name())
    }

    /// The address this rank accepts connections on.
    pub fn listen_addr(&self) -> std::net::SocketAddr {
        self.inner.listen_addr
    }

    /// Name of the transport that reaches `peer` (`shm`, `tcp-uring`, `tcp-portable`).
    pub fn transport_for(&self, peer: Rank) -> &'static str {
        self.inner.reactor.with(|d| d.transport.name_for(peer))
    }

    /// What the rails to `peer` carried and measured, rail 0 (the bootstrap connection) first;
    /// `None` for a rail that does not reach `peer`. Empty without rails (docs/routes.md).
    pub fn rail_stats(&self, peer: Rank) -> Vec<Option<ferrocomm_transports::rails::RailStats>> {
        let Some(s) = &self.inner.rail_stats else { return Vec::new() };
        s.lock().unwrap_or_else(|e| e.into_inner()).get(peer as usize).cloned().unwrap_or_default()
    }

    /// The route a message of `len` bytes to `peer` takes: direct, or staged through a proxy
    /// rank (docs/routes.md). Always direct with proxy routes off.
    pub fn route_for(&self, peer: Rank, len: usize) -> ferrocomm_transports::relay::Route {
        use ferrocomm_transports::relay::{Route, Way};
        match self.inner.ways.as_ref().and_then(|w| w.get(peer as usize)) {
            Some(Way::Via(p)) => Route::Via(*p),
            // Only rendezvous data is staged: eager messages keep the direct connection.
            Some(Way::Split(plan)) if len > self.inner.settings.eager_limit => plan.route(len),
            _ => Route::Direct,
        }
    }

    /// Connection attempts this rank refused (most recent last, at most 64 kept).
    pub fn refused_connections(&self) -> Vec<Refused> {
        self.inner.refused.lock().clone()
    }

    /// A snapshot of this rank's traffic with every rank of the job, by world rank (this rank's
    /// own entry counts what it sent itself): messages and bytes each way, the transport, and
    /// whether the peer is alive, departed or lost. Taken under the progress lock, so every
    /// count is consistent with the messages completed so far.
    pub fn stats(&self) -> Vec<crate::observe::PeerStats> {
        self.inner.reactor.with(|d| {
            (0..self.inner.size)
                .map(|peer| {
                    let c = d.engine.traffic(peer);
                    crate::observe::PeerStats {
                        rank: peer,
                        transport: if peer == self.inner.rank { "self" } else { d.transport.name_for(peer) },
                        state: d.engine.peer_state(peer),
                        messages_sent: c.messages_sent,
                        bytes_sent: c.bytes_sent,
                        rendezvous_sent: c.rendezvous_sent,
                        messages_received: c.messages_received,
                        bytes_received: c.bytes_received,
                        rendezvous_received: c.rendezvous_received,
                    }
                })
                .collect()
        })
    }

    /// Unmatched messages held for `peer` (bounded by the credit limit).
    pub fn unexpected_from(&self, peer: Rank) -> usize {
        self.inner.reactor.with(|d| d.engine.unexpected_from(peer))
    }

    /// Leaves the job in order: flushes what was sent (and waits until the multicast collectives'
    /// messages are consumed and acknowledged), says goodbye, stops progress.
    pub async fn finalize(self) -> Result<()> {
        if let Some(upper) = self.comm.state.upper.get() {
            upper.drain(&self.comm, Duration::from_secs(10)).await;
        }
        let inner = self.inner.clone();
        let done = tokio::task::spawn_blocking(move || inner.shut_down(Duration::from_secs(10))).await;
        // Shut down already: dropping the last handle finds nothing more to do.
        drop(self);
        done.map_err(Error::bootstrap("shutting down"))
    }
}

impl std::ops::Deref for World {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.comm
    }
}

impl Inner {
    /// Flushes queued output and sends still awaited (for at most `limit`), says goodbye to every
    /// peer (which fails what is still unsent), stops progress.
    /// On a thread that is panicking, the rank aborts instead: it tells every peer that it is
    /// lost, so that they fail what needs it at once (a goodbye would let them wait on it).
    pub(crate) fn shut_down(&self, limit: Duration) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // The store first: its watch's goodbye goes before the process can exit. A store that
        // goes after a loss tells every rank of the loss first: a rank still in its bootstrap
        // would otherwise see only the store's end, and blame this rank for it.
        let lost = self.reactor.with(|d| {
            let f = d.engine.failures();
            f.lost().iter().find_map(|&r| match f.fate(r) {
                Fate::Lost(why) => Some((r, format!("was lost ({why}), as rank {} saw", self.rank))),
                _ => None,
            })
        });
        self.store_link.lock().leave(std::thread::panicking(), lost);
        let start = Instant::now();
        let flush = |start: Instant| {
            while start.elapsed() < limit {
                let pending = {
                    let mut d = self.reactor.lock();
                    d.progress_all();
                    d.transport.has_pending_output() || d.engine.sends_waiting()
                };
                if !pending {
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        };
        let aborting = std::thread::panicking();
        if !aborting {
            flush(start);
        }
        self.reactor.with(|d| {
            if aborting {
                d.engine.abort();
            } else {
                d.engine.say_goodbye();
            }
            d.flush();
        });
        flush(Instant::now());
        // Operations still in flight (their handles outlived the world's) can no longer finish.
        self.reactor.with(|d| {
            d.engine.close();
            d.upper.close(&mut d.engine, &mut *d.transport);
        });
        self.reactor.stop();
        self.thread.lock().take();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shut_down(Duration::from_secs(2));
    }
}

impl Driver {
    fn progress_all(&mut self) {
        ferrocomm_reactor::Progress::progress(self);
    }
}

#[derive(Clone, Copy)]
enum OpKind {
    Send { dest: Rank },
    Recv { context: u32 },
    Probe { context: u32 },
}

thread_local! {
    /// The world reference of the operation whose completion an await on this thread took last,
    /// until the thread next starts an operation (see [`park`]).
    static PARKED: Cell<Option<Arc<Inner>>> = const { Cell::new(None) };
}

/// Keeps an awaited operation's reference to its world until this thread next starts an
/// operation, instead of dropping it on completion. The drop is an atomic read-modify-write, and
/// between a message's arrival and the reply the caller sends, such an instruction costs far more
/// than its own few nanoseconds: it apparently waits until the shared-memory transport's prefetch
/// of the reply's cache line completes (`Outbox::prefetch_next`), and the peer, polling that line,
/// takes it back meanwhile (8 B over shared memory one way: about 0.080 us parked, 0.09-0.10 us
/// dropped there: `ferrocomm-bench pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer`). A second completion before the next start drops the first reference
/// then. The reference does not keep the job going ([`Live`] does); a thread that starts no
/// operation again drops it when it ends.
#[inline(always)]
fn park(inner: Arc<Inner>) {
    // Only while the thread's locals are torn down is the slot gone: the reference drops then.
    let _ = PARKED.try_with(|p| drop(p.replace(Some(inner))));
}

/// Drops the reference [`park`] kept on this thread, if any.
#[inline(always)]
fn drop_parked() {
    let _ = PARKED.try_with(|p| drop(p.take()));
}

/// A started operation. Await it for the result; drop it to cancel.
pub struct Op<T> {
    /// Dropped by the `Drop` of `Op` only when not `OpState::Done` (see there).
    state: ManuallyDrop<OpState>,
    /// Translates sources back to communicator ranks (sub-communicators only).
    group: Option<Arc<Group>>,
    _t: PhantomData<fn() -> T>,
}

enum OpState {
    /// Completed while it was started (an eager send with credit, a receive of a message already
    /// there): awaiting it takes no lock and no progress round, and it holds no reference to the
    /// world (whose reference count is an atomic read-modify-write on the latency path).
    Ready(Completion),
    /// In flight: its completion will land in slot `key` of the operation slab.
    Pending { inner: Arc<Inner>, key: OpKey, kind: OpKind, wait: Wait },
    /// The result was taken.
    Done,
}

/// How an operation's completion becomes its result.
pub trait FromCompletion: Sized {
    fn from_completion(c: Completion) -> Result<Self>;
}

impl FromCompletion for () {
    #[inline(always)]
    fn from_completion(c: Completion) -> Result<()> {
        match c {
            Completion::Send(r) => r,
            other => unreachable!("send completed as {other:?}"),
        }
    }
}

impl FromCompletion for Message {
    #[inline(always)]
    fn from_completion(c: Completion) -> Result<Message> {
        match c {
            Completion::Recv(r) => r.map(|(p, s)| Message { data: p.into_bytes(), source: s.source, tag: s.tag }),
            other => unreachable!("receive completed as {other:?}"),
        }
    }
}

impl FromCompletion for (BytesMut, Status) {
    #[inline(always)]
    fn from_completion(c: Completion) -> Result<(BytesMut, Status)> {
        match c {
            Completion::Recv(r) => r.map(|(p, s)| (Payload::into_bytes_mut(p), s)),
            other => unreachable!("receive completed as {other:?}"),
        }
    }
}

impl FromCompletion for Status {
    #[inline(always)]
    fn from_completion(c: Completion) -> Result<Status> {
        match c {
            Completion::Probe(r) => r,
            other => unreachable!("probe completed as {other:?}"),
        }
    }
}

impl<T: FromCompletion> Future for Op<T> {
    type Output = Result<T>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        if let OpState::Pending { inner, key, wait, .. } = &mut *this.state {
            let key = *key;
            let c = std::task::ready!(inner.reactor.poll_until(cx, wait, |d, cx| d.ops().poll(key, cx)));
            if let OpState::Pending { inner, .. } = std::mem::replace(&mut *this.state, OpState::Done) {
                park(inner);
            }
            return Poll::Ready(T::from_completion(this.translate(c)));
        }
        match std::mem::replace(&mut *this.state, OpState::Done) {
            OpState::Ready(c) => Poll::Ready(T::from_completion(this.translate(c))),
            _ => Poll::Ready(Err(Error::Shutdown)),
        }
    }
}

impl<T> Op<T> {
    /// Whether the result is here: the next poll returns it at once, taking no lock.
    pub(crate) fn is_ready(&self) -> bool {
        !matches!(*self.state, OpState::Pending { .. })
    }

    /// Moves this operation's completion, if it has come, out of the locked driver into the
    /// operation (see [`Op::is_ready`]); otherwise registers `cx`, when given. For callers that
    /// wait on several operations under one spin loop ([`Comm::poll_progress`]).
    pub(crate) fn harvest(&mut self, d: &mut Driver, cx: Option<&mut Context<'_>>) -> bool {
        let OpState::Pending { key, .. } = &*self.state else { return true };
        match d.ops().poll(*key, cx) {
            Poll::Ready(c) => {
                *self.state = OpState::Ready(c);
                true
            }
            Poll::Pending => false,
        }
    }

    /// Sources in a sub-communicator's ranks.
    #[inline(always)]
    fn translate(&self, mut c: Completion) -> Completion {
        if let Some(g) = &self.group {
            let local = |s: &mut Status| s.source = g.index.get(&s.source).copied().unwrap_or(Rank::MAX);
            match &mut c {
                Completion::Recv(Ok((_, s))) | Completion::Probe(Ok(s)) => local(s),
                _ => {}
            }
        }
        c
    }
}

impl<T> Drop for Op<T> {
    /// Inlined up to the test for an operation whose result was taken: every awaited operation
    /// is dropped so, right after its completion, on the way from a message to its reply. The
    /// state's own drop (a call in a build without LTO, where it is not inlined) runs only for
    /// the others.
    #[inline(always)]
    fn drop(&mut self) {
        match *self.state {
            OpState::Done => return,
            OpState::Pending { .. } => self.cancel(),
            OpState::Ready(_) => {}
        }
        // SAFETY: `state` is dropped here only, once, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.state) }
    }
}

impl<T> Op<T> {
    /// Withdraws the operation, dropped while in flight.
    #[inline(never)]
    fn cancel(&mut self) {
        let OpState::Pending { inner, key, kind, .. } = &*self.state else { return };
        let (key, mut d) = (*key, inner.reactor.lock());
        if d.ops().detach(key) {
            match *kind {
                OpKind::Send { dest } => d.engine.cancel_send(key, dest),
                OpKind::Recv { context } => d.engine.cancel_recv(key, context),
                OpKind::Probe { context } => d.engine.cancel_probe(key, context),
            }
            d.flush();
        }
    }
}

/// Deadlines for any ferrocomm operation (needs a tokio runtime with time enabled).
pub trait Deadline<T>: Future<Output = Result<T>> + Sized {
    /// Fails with [`Error::Timeout`] at `at`, cancelling the operation.
    fn deadline(self, at: Instant) -> impl Future<Output = Result<T>> {
        async move { tokio::time::timeout_at(at.into(), self).await.unwrap_or(Err(Error::Timeout)) }
    }
    /// Fails with [`Error::Timeout`] after `d`, cancelling the operation.
    fn timeout(self, d: Duration) -> impl Future<Output = Result<T>> {
        self.deadline(Instant::now() + d)
    }
}

impl<T, F: Future<Output = Result<T>>> Deadline<T> for F {}

impl Comm {
    /// This rank's index in the communicator.
    pub fn rank(&self) -> Rank {
        self.group.as_ref().map_or(self.inner.rank, |g| g.rank)
    }

    /// Number of ranks in the communicator.
    #[inline(always)]
    pub fn size(&self) -> u32 {
        self.group.as_ref().map_or(self.inner.size, |g| g.members.len() as u32)
    }

    /// The world rank of this communicator's rank `r` (which must be in range).
    #[inline(always)]
    pub(crate) fn world_rank(&self, r: Rank) -> Rank {
        self.group.as_ref().map_or(r, |g| g.members[r as usize])
    }

    /// This communicator's rank of world rank `w` (`Rank::MAX` for a non-member).
    pub(crate) fn local_rank(&self, w: Rank) -> Rank {
        self.group.as_ref().map_or(w, |g| g.index.get(&w).copied().unwrap_or(Rank::MAX))
    }

    /// Drives progress until `check` is ready, as an awaited [`Op`] does, but under one spin loop
    /// for whatever `check` looks at (several operations at once, through [`Op::harvest`]).
    pub(crate) fn poll_progress<R>(
        &self,
        cx: &mut Context<'_>,
        wait: &mut Wait,
        check: impl FnMut(&mut Driver, Option<&mut Context<'_>>) -> Poll<R>,
    ) -> Poll<R> {
        self.inner.reactor.poll_until(cx, wait, check)
    }

    /// A world handle on this communicator's world (the one-sided operations are `World`'s).
    pub(crate) fn world(&self) -> World {
        World { inner: self.inner.clone(), comm: self.clone() }
    }

    /// The world this communicator belongs to.
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// The same ranks on another context (collective traffic, derived communicators), revoked by
    /// the same losses as this one.
    pub(crate) fn with_context(&self, context: u32) -> Comm {
        self.inner.reactor.with(|d| d.engine.watch(context, self.watch.clone()));
        Comm {
            inner: self.inner.clone(),
            live: self.live.clone(),
            context,
            state: Default::default(),
            group: self.group.clone(),
            table: self.table.clone(),
            watch: self.watch.clone(),
        }
    }

    /// A communicator of `members` (world ranks, in their new order) on `context`, revoked only
    /// by their losses.
    pub(crate) fn with_members(&self, context: u32, members: Vec<Rank>) -> Comm {
        let mut c = self.with_context(context);
        c.watch = Watch::ranks(members.iter().copied());
        self.inner.reactor.with(|d| d.engine.watch(context, c.watch.clone()));
        c.group = Some(Arc::new(Group::new(members, self.inner.rank)));
        c
    }

    /// Why a collective on this communicator cannot run: a loss revoked it. One atomic load while
    /// no rank has departed or been lost.
    #[inline]
    pub(crate) fn collective_gate(&self) -> Result<()> {
        if self.inner.changes.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        self.inner.reactor.with(|d| d.engine.gate(self.context)).map_or(Ok(()), Err)
    }

    /// The error of every operation on this communicator once a loss revoked it.
    pub(crate) fn revoked(&self) -> Option<Error> {
        if self.inner.changes.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.inner.reactor.with(|d| d.engine.revoked(self.context))
    }

    /// The same communicator (same messages, same collective sequence) choosing collective
    /// algorithms from `table`: for pinning algorithms per communicator, in tests and tuning.
    /// Every rank must use the same table for a given call.
    pub fn with_collective_table(&self, table: ferrocomm_collectives::Table) -> Comm {
        Comm { table: Some(Arc::new(table)), ..self.clone() }
    }

    /// The collective selection table in use.
    pub fn collective_table(&self) -> &ferrocomm_collectives::Table {
        self.table.as_deref().unwrap_or(&self.inner.settings.collectives)
    }

    /// The communicator's context id.
    pub fn context(&self) -> u32 {
        self.context
    }

    /// The settings this rank runs with.
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// Derived from the job token (multicast datagrams carry it).
    pub(crate) fn job_id(&self) -> u64 {
        self.inner.job_id
    }

    /// The key of the job's multicast datagram tags.
    pub(crate) fn datagram_key(&self) -> &ferrocomm_transports::auth::DatagramKey {
        &self.inner.datagram_key
    }

    /// The address this rank accepts connections on.
    pub(crate) fn listen_addr(&self) -> std::net::SocketAddr {
        self.inner.listen_addr
    }

    /// Starts an operation: `now` completes it at once if it can (no slot of the operation slab
    /// is taken then), or gives back what `post` needs to track it under a key of the slab.
    #[inline(always)]
    fn start<T, X>(
        &self,
        kind: OpKind,
        early: Option<Error>,
        now: impl FnOnce(&mut Driver) -> std::result::Result<Completion, X>,
        post: impl FnOnce(&mut SlabEngine, OpKey, X),
    ) -> Op<T> {
        // Not `then_some`: that builds (and drops) an error on every call.
        let early = match early {
            None if self.inner.closed.load(Ordering::Acquire) => Some(Error::Shutdown),
            early => early,
        };
        let state = match early {
            Some(e) => OpState::Ready(match kind {
                OpKind::Send { .. } => Completion::Send(Err(e)),
                OpKind::Recv { .. } => Completion::Recv(Err(e)),
                OpKind::Probe { .. } => Completion::Probe(Err(e)),
            }),
            None => {
                let polled = {
                    let mut d = self.inner.reactor.lock();
                    let tracked = now(&mut d).map_err(|x| {
                        let key = d.ops().insert();
                        post(&mut d.engine, key, x);
                        key
                    });
                    d.flush();
                    // A blocking caller will not push what the transport still queues: the
                    // background task must. (Work already handed to the device or the kernel needs
                    // no push: its completion wakes the task.) Spinning callers push it while they
                    // spin (and call the task in when they stop).
                    if self.inner.reactor.mode() == ProgressMode::Blocking && d.transport.has_queued_output() {
                        self.inner.reactor.kick();
                    }
                    tracked.or_else(|key| match d.ops().poll(key, None) {
                        Poll::Ready(c) => Ok(c),
                        Poll::Pending => Err(key),
                    })
                };
                match polled {
                    Ok(c) => OpState::Ready(c),
                    Err(key) => OpState::Pending { inner: self.inner.clone(), key, kind, wait: Wait::default() },
                }
            }
        };
        // After the send a completion was waiting for, if any (see `park`).
        drop_parked();
        Op { state: ManuallyDrop::new(state), group: self.group.clone(), _t: PhantomData }
    }

    #[inline(always)]
    fn check_rank(&self, r: Rank) -> Option<Error> {
        (r >= self.size()).then(|| Error::UnknownRank { rank: r, size: self.size() })
    }

    #[inline(always)]
    fn world_source(&self, s: Source, early: &Option<Error>) -> Source {
        match s {
            Source::Rank(r) if early.is_none() => Source::Rank(self.world_rank(r)),
            other => other,
        }
    }

    #[inline(always)]
    fn check_source(&self, s: Source) -> Option<Error> {
        match s {
            Source::Any => None,
            Source::Rank(r) => self.check_rank(r),
        }
    }

    /// Sends `data` to `dest` with `tag`. Completes when the data is handed off: the bytes are
    /// shared, never copied, so the caller may drop its handle at once. Dropping the future before
    /// completion withdraws a send still waiting for credit; one already on the wire finishes in
    /// the background.
    pub fn send(&self, dest: Rank, tag: u64, data: impl Into<Bytes>) -> Op<()> {
        self.send_outgoing(dest, tag, data.into())
    }

    /// Sends a copy of `data` to `dest` with `tag`: the caller may reuse its buffer as soon as
    /// this returns. A message that can go at once (eager, with credit, nothing queued before it)
    /// is written straight from `data` into a transport that takes it so (shared memory), with no
    /// allocation: the cheapest small send. Anything else is copied into a buffer of its own and
    /// proceeds as [`Comm::send`].
    #[inline(always)]
    pub fn send_from(&self, dest: Rank, tag: u64, data: &[u8]) -> Op<()> {
        self.send_outgoing(dest, tag, data)
    }

    /// [`Comm::send`] and [`Comm::send_from`]: owned data is kept as it is, borrowed data copied
    /// only where it must be kept.
    #[inline(always)]
    fn send_outgoing(&self, dest: Rank, tag: u64, data: impl Outgoing) -> Op<()> {
        let (len, max) = (data.as_ref().len(), self.inner.settings.max_message);
        // Not `then_some`: that builds (and drops) an error on every call.
        let early = match self.check_rank(dest) {
            None if len > max => Some(Error::TooLarge { len, max }),
            early => early,
        };
        let dest = if early.is_none() { self.world_rank(dest) } else { dest };
        let ctx = self.context;
        self.start(
            OpKind::Send { dest },
            early,
            |d| d.send_now(dest, ctx, tag, data).map(Completion::Send),
            |e, key, data| e.post_send(key, dest, ctx, tag, data.into_bytes()),
        )
    }

    /// Receives the next message matching `src` and `tag` (each may be a wildcard), of any length
    /// up to the `max_message` setting. Dropping the future before a message matched withdraws the
    /// receive; a message that already matched is discarded with it.
    pub fn recv(&self, src: impl Into<Source>, tag: impl Into<TagMatch>) -> Op<Message> {
        self.recv_with(src.into(), tag.into(), RecvBuf::Alloc)
    }

    /// Receives into `buf`, whose length is the capacity: a longer message is an
    /// [`Error::Truncated`]. Returns the buffer truncated to the message's length.
    #[inline(always)]
    pub fn recv_into(&self, src: impl Into<Source>, tag: impl Into<TagMatch>, buf: BytesMut) -> Op<(BytesMut, Status)> {
        self.recv_with(src.into(), tag.into(), RecvBuf::User(buf))
    }

    #[inline(always)]
    fn recv_with<T>(&self, src: Source, tag: TagMatch, buf: RecvBuf) -> Op<T> {
        let ctx = self.context;
        let early = self.check_source(src);
        let src = self.world_source(src, &early);
        self.start(
            OpKind::Recv { context: ctx },
            early,
            |d| d.engine.recv_now(ctx, src, tag, buf).map(Completion::Recv),
            |e, key, buf| e.post_recv(key, ctx, src, tag, buf),
        )
    }

    /// Waits until a message matching `src` and `tag` has arrived, and says what it is, without
    /// receiving it.
    pub fn probe(&self, src: impl Into<Source>, tag: impl Into<TagMatch>) -> Op<Status> {
        let (src, tag, ctx) = (src.into(), tag.into(), self.context);
        let early = self.check_source(src);
        let src = self.world_source(src, &early);
        self.start(OpKind::Probe { context: ctx }, early, |_| Err(()), |e, key, ()| e.post_probe(key, ctx, src, tag))
    }

    /// The first message matching `src` and `tag` that has arrived, if any.
    pub fn iprobe(&self, src: impl Into<Source>, tag: impl Into<TagMatch>) -> Option<Status> {
        let (src, tag) = (src.into(), tag.into());
        if self.check_source(src).is_some() {
            return None;
        }
        let src = self.world_source(src, &None);
        let mut d = self.inner.reactor.lock();
        ferrocomm_reactor::Progress::progress(&mut *d);
        d.engine.iprobe(self.context, src, tag).map(|mut s| {
            s.source = self.local_rank(s.source);
            s
        })
    }

    /// Sends to `dest` and receives from `src` at once (no deadlock however the peers pair up).
    pub async fn sendrecv(
        &self,
        dest: Rank,
        send_tag: u64,
        data: impl Into<Bytes>,
        src: impl Into<Source>,
        recv_tag: impl Into<TagMatch>,
    ) -> Result<Message> {
        let recv = self.recv(src, recv_tag);
        let send = self.send(dest, send_tag, data);
        let (s, r) = futures::join!(send, recv);
        s?;
        r
    }

    /// A new communicator with the same ranks and a separate message space. Collective: every rank
    /// must call `dup` on this communicator in the same order.
    pub fn dup(&self) -> Result<Comm> {
        let n = self.state.dups.fetch_add(1, Ordering::Relaxed) + 1;
        let context = derive_context(self.context, n);
        Ok(self.with_context(context))
    }
}

/// The context id of the `n`-th duplicate of `parent`: a fixed mixing function, so that every rank
/// derives the same id without talking (dup is collective), kept clear of the collective bit.
pub(crate) fn derive_context(parent: u32, n: u32) -> u32 {
    let mut x = (u64::from(parent) << 32) | u64::from(n);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    ((x as u32) & !COLLECTIVE_BIT).max(1)
}
