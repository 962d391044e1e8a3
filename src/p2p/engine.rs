//! The point-to-point protocol core: matching, eager and rendezvous, credits. Sans-IO.
//!
//! It consumes events (an operation was posted or cancelled, a frame arrived, a peer was lost)
//! and emits actions: frames to transmit ([`Engine::poll_transmit`]) and completed operations,
//! which it leaves where [`Completions`] says: straight in the slot of the driver's operation
//! slab that the operation's future polls, or in a queue ([`Engine::poll_event`], for tests).
//! It never does I/O and never reads the clock, so it is tested deterministically, by property
//! tests against a reference model among others.
//!
//! The steps of a small message's receive and send are `#[inline(always)]`: the latency path
//! runs through the transport, this engine, the operation slab and the future, and inlined into
//! one another its steps can pass their values in registers instead of through memory. The marks
//! pay only together with those of the other crates on the path (8 B over shared memory about
//! 7 ns faster one way: `ferrocomm-bench pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer`).
//!
//! Rules it keeps:
//! * Matching is MPI's: source and tag match exactly or by wildcard; messages from one sender on one
//!   context match in the order they were sent; receives match in the order they were posted,
//!   wildcard or not (one posted queue per context, searched front to back).
//! * Messages up to the eager limit travel whole; larger ones send an RTS, the receiver answers with
//!   a CTS once a matching receive is posted, and the data lands straight in the posted buffer.
//! * Pushed rendezvous (peers set with [`Engine::set_push`], those reached over a byte stream, where
//!   a CTS buys no zero-copy): the data follows the RTS at once. A receive that matches before the
//!   first data frame arrives takes it all in place and answers with a `TAKEN` CTS; otherwise the
//!   pushed data is read and dropped, and the message is sent again after a plain CTS, as above.
//!   A stream transport asks first ([`Engine::awaits_receive`]) and holds such a frame back for a
//!   few rounds, so that a receive posted in reply to the frames before it is still in time.
//!   So the receiver never holds more for a pushed message than the posted buffer, and its state
//!   per peer is one pushed message in progress (the sender pushes one message's data whole,
//!   right behind its RTS).
//! * Credits: every eager message and RTS uses one of `max_credit` credits toward its receiver; the
//!   receiver hands credits back (piggybacked on every frame, or in a `Credit` frame when the sender
//!   runs low) only when the message has been matched. A sender out of credits queues locally, so the
//!   memory a receiver spends on unexpected messages is bounded by `max_credit * eager_limit` per
//!   peer; a peer that sends beyond its credits breaks the protocol and is disconnected.
//!   Counters are monotonic and wrapping, so full and empty can never be confused.
//! * Failures (`engine/revoke.rs`, with the knowledge in `p2p/failure.rs`): a peer's
//!   goodbye fails what names it; a loss also revokes every context whose watch holds the lost
//!   rank (everything posted there fails, naming it) and is told to every live peer once.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use bytes::{Bytes, BytesMut};
use ferrocomm_reactor::{OpKey, Ops};
use ferrocomm_transports::wire::flags;
use ferrocomm_transports::{Header, Kind, Outgoing, Rank, Sink, TransportError, WireError};
use metrics::{Counter, Histogram};
use slab::Slab;

use super::failure::Failures;
use super::{Payload, Source, Status, TagMatch};
use crate::error::Error;

/// Protocol parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Largest message sent eagerly.
    pub eager_limit: usize,
    /// Credit-consuming frames (eager, RTS) a sender may have unmatched at one receiver.
    pub max_credit: u32,
    /// The receiver sends an explicit credit update once this many of a peer's frames are
    /// unacknowledged.
    pub credit_sync: u32,
    /// Largest rendezvous data frame.
    pub chunk: usize,
    /// Largest message a receive without a buffer accepts.
    pub max_message: usize,
}

/// Where a receive puts its message.
#[derive(Debug)]
pub enum RecvBuf {
    /// Allocate (or, for eager messages, hand over the arrived bytes without copying).
    Alloc,
    /// Into this buffer; its length is the capacity.
    User(BytesMut),
}

impl RecvBuf {
    fn capacity(&self, max_message: usize) -> usize {
        match self {
            RecvBuf::Alloc => max_message,
            RecvBuf::User(b) => b.len(),
        }
    }
}

/// The outcome of an operation.
#[derive(Debug)]
pub enum Completion {
    Send(Result<(), Error>),
    Recv(Result<(Payload, Status), Error>),
    Probe(Result<Status, Error>),
}

struct Posted {
    op: OpKey,
    src: Source,
    tag: TagMatch,
    buf: RecvBuf,
}

enum Body {
    Eager(Bytes),
    /// A rendezvous announcement: the sender's message id and the total length (for a pushed
    /// one, the data may be arriving; see [`PushIn`]).
    Rts {
        msg: u64,
        len: usize,
    },
}

struct Unexpected {
    src: Rank,
    tag: u64,
    body: Body,
}

impl Unexpected {
    fn status(&self) -> Status {
        let len = match &self.body {
            Body::Eager(b) => b.len(),
            Body::Rts { len, .. } => *len,
        };
        Status { source: self.src, tag: self.tag, len }
    }
}

struct Probe {
    op: OpKey,
    src: Source,
    tag: TagMatch,
}

#[derive(Default)]
struct Queues {
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    probes: Vec<Probe>,
}

/// A rendezvous send waiting for its CTS. `op` is `None` once the caller stopped waiting.
struct RndvSend {
    op: Option<OpKey>,
    peer: Rank,
    context: u32,
    data: Bytes,
}

/// A matched rendezvous receive taking data. `op` is `None` once the caller stopped waiting: the
/// data still lands (the sender is already sending) and is then dropped.
struct RndvRecv {
    op: Option<OpKey>,
    peer: Rank,
    context: u32,
    buf: BytesMut,
    got: usize,
    tag: u64,
    user_buf: bool,
}

/// A credit-consuming frame waiting for credit.
struct Backlogged {
    header: Header,
    payload: Bytes,
    /// Eager send to complete once the frame leaves.
    op: Option<OpKey>,
}

/// The pushed rendezvous message arriving from a peer.
struct PushIn {
    /// The sender's message id.
    msg: u64,
    /// Its length, and the bytes of it that have arrived.
    len: usize,
    next: usize,
    /// The matched receive taking the data in place (`rndv_recvs` key); `None`: dropped.
    into: Option<usize>,
    /// A data frame was told to be dropped: the rest can no longer be taken in place.
    dropping: bool,
}

#[derive(Default)]
struct Peer {
    /// Credit-consuming frames sent to the peer.
    sent: u32,
    /// The peer's latest count of our frames it has freed.
    peer_freed: u32,
    backlog: VecDeque<Backlogged>,
    /// Credit-consuming frames received from the peer.
    received: u32,
    /// Of those, how many we have freed.
    freed: u32,
    /// The `freed` value the peer last heard from us.
    advertised: u32,
    /// Why operations naming the peer fail: it departed or was lost (see [`Failures`]).
    lost: Option<TransportError>,
    /// Rendezvous messages to the peer are pushed ([`Engine::set_push`]).
    push: bool,
    /// The pushed message whose data is arriving from the peer.
    push_in: Option<PushIn>,
    /// Messages and bytes exchanged with the peer, and their peer-labelled metrics: made at the
    /// first message either way (a job of thousands of ranks talks to few of them).
    traffic: Option<Box<Traffic>>,
}

/// The point-to-point protocol state of one rank.
pub struct Engine<C: Completions = VecDeque<(OpKey, Completion)>> {
    me: Rank,
    cfg: Config,
    peers: Vec<Peer>,
    contexts: Contexts,
    rndv_sends: Slab<RndvSend>,
    rndv_recvs: Slab<RndvRecv>,
    transmit: VecDeque<(Rank, Header, Bytes)>,
    done: C,
    violations: VecDeque<(Rank, WireError)>,
    meters: Meters,
    /// Set by [`Engine::close`]: operations posted from then on fail at once.
    closed: bool,
    /// What this rank knows of the others' fate, and the contexts' watches.
    failures: Failures,
    /// Peers reported lost whose connection the driver must cut ([`Engine::poll_cut`]).
    cuts: VecDeque<Rank>,
    /// This rank said goodbye (or is aborting): losses seen from now on are not worth a warning.
    leaving: bool,
}

/// The matching queues of every context: a map by context id, with the context looked up last in
/// front of it. Nearly every message is on the context of the one before (a program's traffic sits
/// on one or two communicators), and the map's probe (hash, control group, key) sat on the 8 B
/// message's path (8 B over shared memory about 2 ns faster one way with this cache in front:
/// `ferrocomm-bench pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer`).
#[derive(Default)]
struct Contexts {
    queues: Vec<Queues>,
    /// Index into `queues` by context id. Contexts are never removed. A
    /// peer's messages make new ones only up to its credit: each unexpected message holds its
    /// credit until a receive of this rank matches it.
    index: HashMap<u32, usize, BuildHasherDefault<ContextHasher>>,
    /// The context found last, and its index.
    last: Option<(u32, usize)>,
}

impl Contexts {
    #[inline(always)]
    fn get_mut(&mut self, context: u32) -> Option<&mut Queues> {
        let i = match self.last {
            Some((c, i)) if c == context => i,
            _ => self.find(context)?,
        };
        self.queues.get_mut(i)
    }

    /// The map's look-up, which the next [`Contexts::get_mut`] of the same context skips.
    #[inline(never)]
    fn find(&mut self, context: u32) -> Option<usize> {
        let i = *self.index.get(&context)?;
        self.last = Some((context, i));
        Some(i)
    }

    fn get(&self, context: u32) -> Option<&Queues> {
        self.index.get(&context).map(|&i| &self.queues[i])
    }

    /// The queues of `context`, made empty if it has none yet.
    #[inline(always)]
    fn entry(&mut self, context: u32) -> &mut Queues {
        if self.get_mut(context).is_none() {
            self.index.insert(context, self.queues.len());
            self.queues.push(Queues::default());
        }
        self.get_mut(context).expect("just made")
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Queues> {
        self.queues.iter_mut()
    }
}

/// Hashes context ids (which come from a mixing function or are small) with one multiplication:
/// the context map is looked up on every message, where SipHash showed in profiles.
#[derive(Default)]
struct ContextHasher(u64);

impl Hasher for ContextHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (v as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A receive into `b` (whose length is the capacity) of eager `data`.
#[inline(always)]
fn fill(mut b: BytesMut, data: &[u8], status: Status) -> Result<(Payload, Status), Error> {
    if data.len() > b.len() {
        return Err(Error::Truncated { len: data.len(), capacity: b.len() });
    }
    b.truncate(data.len());
    b.copy_from_slice(data);
    Ok((Payload::Owned(b), status))
}

/// The engine's metrics, registered once with the recorder in force when the engine is made.
/// `metrics::counter!` looks its key up in the recorder's registry on every use (a hash of the
/// key and a sharded map): on the message path, with a recorder installed, that doubled the cost
/// of an 8 B send and receive. The per-peer metrics are in [`Traffic`].
struct Meters {
    message_bytes: Histogram,
    credit_stalls: Counter,
    unexpected_messages: Counter,
    peers_lost: Counter,
}

impl Meters {
    fn new() -> Meters {
        crate::observe::describe();
        Meters {
            message_bytes: metrics::histogram!(crate::observe::MESSAGE_BYTES),
            credit_stalls: metrics::counter!(crate::observe::CREDIT_STALLS),
            unexpected_messages: metrics::counter!(crate::observe::UNEXPECTED_MESSAGES),
            peers_lost: metrics::counter!(crate::observe::PEERS_LOST),
        }
    }
}

/// How a message travels: whole (eager), or announced and pulled (rendezvous).
#[derive(Clone, Copy)]
enum Protocol {
    Eager = 0,
    Rendezvous = 1,
}

/// What this rank exchanged with one peer (see [`Engine::traffic`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerCounts {
    /// Messages sent to the peer (eager and rendezvous).
    pub messages_sent: u64,
    /// Their payload bytes.
    pub bytes_sent: u64,
    /// Of the messages sent, those that went by rendezvous.
    pub rendezvous_sent: u64,
    /// Messages received from the peer (eager, or rendezvous once all the data is in).
    pub messages_received: u64,
    /// Their payload bytes.
    pub bytes_received: u64,
    /// Of the messages received, those that came by rendezvous.
    pub rendezvous_received: u64,
}

/// One peer's counts and the handles of its metrics, labelled `peer` and `protocol`, registered
/// once (at the first message) so that the message path does no registry look-up.
struct Traffic {
    counts: PeerCounts,
    /// `[messages, bytes]` by protocol, sent and received.
    sent: [[Counter; 2]; 2],
    received: [[Counter; 2]; 2],
}

impl Traffic {
    #[cold]
    #[inline(never)]
    fn new(peer: Rank) -> Box<Traffic> {
        use crate::observe::{BYTES_RECEIVED, BYTES_SENT, MESSAGES_RECEIVED, MESSAGES_SENT};
        let peer = peer.to_string();
        let by = |name: &'static str, protocol: &'static str| metrics::counter!(name, "peer" => peer.clone(), "protocol" => protocol);
        let pair = |messages, bytes, protocol| [by(messages, protocol), by(bytes, protocol)];
        Box::new(Traffic {
            counts: PeerCounts::default(),
            sent: [pair(MESSAGES_SENT, BYTES_SENT, "eager"), pair(MESSAGES_SENT, BYTES_SENT, "rendezvous")],
            received: [
                pair(MESSAGES_RECEIVED, BYTES_RECEIVED, "eager"),
                pair(MESSAGES_RECEIVED, BYTES_RECEIVED, "rendezvous"),
            ],
        })
    }
}

/// Element `i` of a matching queue. The match is nearly always the first element, which
/// `pop_front` takes without `remove`'s general shuffle of the rest.
#[inline(always)]
fn take_at<T>(q: &mut VecDeque<T>, i: usize) -> Option<T> {
    if i == 0 { q.pop_front() } else { q.remove(i) }
}

#[inline(always)]
fn matches(src: Source, tag: TagMatch, msrc: Rank, mtag: u64) -> bool {
    (match src {
        Source::Any => true,
        Source::Rank(r) => r == msrc,
    }) && (match tag {
        TagMatch::Any => true,
        TagMatch::Exact(t) => t == mtag,
    })
}

/// Where the engine leaves completed operations.
pub trait Completions: Default {
    /// Operation `op` completed with `c`.
    fn complete(&mut self, op: OpKey, c: Completion);
    /// Whether completions wait to be taken ([`Engine::has_output`]).
    fn waiting(&self) -> bool;
}

/// A queue, drained by [`Engine::poll_event`].
impl Completions for VecDeque<(OpKey, Completion)> {
    fn complete(&mut self, op: OpKey, c: Completion) {
        self.push_back((op, c));
    }
    fn waiting(&self) -> bool {
        !self.is_empty()
    }
}

/// The operation slab itself: a completion lands in the slot its future polls, with no queue and
/// no second move on the latency path.
impl Completions for Ops<Completion> {
    #[inline(always)]
    fn complete(&mut self, op: OpKey, c: Completion) {
        Ops::complete(self, op, c);
    }
    fn waiting(&self) -> bool {
        false
    }
}

impl Engine {
    /// The engine of rank `me` in a job of `size` ranks, queueing its completions.
    pub fn new(me: Rank, size: u32, cfg: Config) -> Engine {
        Engine::with_completions(me, size, cfg)
    }

    /// The next completed operation.
    pub fn poll_event(&mut self) -> Option<(OpKey, Completion)> {
        self.done.pop_front()
    }
}

impl<C: Completions> Engine<C> {
    /// The engine of rank `me` in a job of `size` ranks, leaving its completions in a `C`.
    pub fn with_completions(me: Rank, size: u32, cfg: Config) -> Engine<C> {
        Engine {
            me,
            cfg,
            peers: (0..size).map(|_| Peer::default()).collect(),
            contexts: Contexts::default(),
            rndv_sends: Slab::new(),
            rndv_recvs: Slab::new(),
            transmit: VecDeque::new(),
            done: C::default(),
            violations: VecDeque::new(),
            meters: Meters::new(),
            closed: false,
            failures: Failures::new(size),
            cuts: VecDeque::new(),
            leaving: false,
        }
    }

    /// The next frame to hand to the transport.
    pub fn poll_transmit(&mut self) -> Option<(Rank, Header, Bytes)> {
        self.transmit.pop_front()
    }

    /// Where completed operations are.
    pub fn completions(&mut self) -> &mut C {
        &mut self.done
    }

    /// Whether [`Engine::poll_transmit`], [`Engine::poll_violation`] or [`Engine::poll_cut`] has
    /// something, or completions wait in a queue.
    pub fn has_output(&self) -> bool {
        !(self.transmit.is_empty() && self.violations.is_empty() && self.cuts.is_empty()) || self.done.waiting()
    }

    /// The next peer that broke the protocol: disconnect it, then call [`Engine::peer_lost`].
    pub fn poll_violation(&mut self) -> Option<(Rank, WireError)> {
        self.violations.pop_front()
    }

    /// The protocol parameters.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Why `peer` is gone, if it is.
    pub fn lost(&self, peer: Rank) -> Option<&TransportError> {
        self.peers.get(peer as usize).and_then(|p| p.lost.as_ref())
    }

    /// Unexpected messages held for `peer`'s sake (for tests of the memory bound).
    pub fn unexpected_from(&self, peer: Rank) -> usize {
        let p = &self.peers[peer as usize];
        p.received.wrapping_sub(p.freed) as usize
    }

    /// Pushes rendezvous data to `peer` right behind its RTS instead of waiting for a CTS. Worth it
    /// where the CTS buys no zero-copy (a byte stream: TCP); the receiver's memory bound is the
    /// same either way. Both ends accept pushed messages whatever this says.
    pub fn set_push(&mut self, peer: Rank, on: bool) {
        if let Some(p) = self.peers.get_mut(peer as usize) {
            p.push = on && peer != self.me;
        }
    }

    /// Sends queued locally for lack of credit toward `peer`.
    pub fn backlog_to(&self, peer: Rank) -> usize {
        self.peers[peer as usize].backlog.len()
    }

    /// What this rank knows of `peer`'s fate.
    pub(crate) fn peer_state(&self, peer: Rank) -> crate::observe::PeerState {
        use super::failure::Fate;
        match self.failures.fate(peer) {
            Fate::Alive => crate::observe::PeerState::Alive,
            Fate::Departed => crate::observe::PeerState::Departed,
            Fate::Lost(why) => crate::observe::PeerState::Lost(why.clone()),
        }
    }

    /// What this rank exchanged with `peer` so far (zero for a rank it never talked to).
    pub fn traffic(&self, peer: Rank) -> PeerCounts {
        self.peers.get(peer as usize).and_then(|p| p.traffic.as_ref()).map_or_else(PeerCounts::default, |t| t.counts)
    }

    /// Counts a message of `len` bytes sent to `peer` (its counts and metrics, and the size
    /// histogram).
    #[inline(always)]
    fn count_sent(&mut self, peer: Rank, len: usize, protocol: Protocol) {
        self.meters.message_bytes.record(len as f64);
        let t = self.peers[peer as usize].traffic.get_or_insert_with(|| Traffic::new(peer));
        t.counts.messages_sent += 1;
        t.counts.bytes_sent += len as u64;
        if let Protocol::Rendezvous = protocol {
            t.counts.rendezvous_sent += 1;
        }
        let [messages, bytes] = &t.sent[protocol as usize];
        messages.increment(1);
        bytes.increment(len as u64);
    }

    /// Counts a message of `len` bytes received from `peer`.
    #[inline(always)]
    fn count_received(&mut self, peer: Rank, len: usize, protocol: Protocol) {
        let t = self.peers[peer as usize].traffic.get_or_insert_with(|| Traffic::new(peer));
        t.counts.messages_received += 1;
        t.counts.bytes_received += len as u64;
        if let Protocol::Rendezvous = protocol {
            t.counts.rendezvous_received += 1;
        }
        let [messages, bytes] = &t.received[protocol as usize];
        messages.increment(1);
        bytes.increment(len as u64);
    }

    #[inline(always)]
    fn lost_error(&self, peer: Rank) -> Option<Error> {
        self.peers[peer as usize].lost.clone().map(|reason| Error::PeerLost { rank: peer, reason })
    }

    // ---- sending ----

    /// Sends `data` to `dest` (which must be a rank of the job) at once if nothing stands in its
    /// way, and returns its outcome: a message to this rank, an eager message with credit and
    /// nothing queued before it, or a lost peer. Otherwise gives the data back, for
    /// [`Engine::post_send`]: no operation needs tracking for a send that completes here.
    pub fn send_now(&mut self, dest: Rank, context: u32, tag: u64, data: Bytes) -> Result<Result<(), Error>, Bytes> {
        let mut frame = None;
        let r = self.send_now_via(dest, context, tag, data, |dest, h, payload| frame = Some((dest, h, payload)));
        self.transmit.extend(frame);
        r
    }

    /// [`Engine::send_now`] for a driver that can put a frame on the wire at once: when the send
    /// completes here by one eager frame and no frame or violation waits in the engine before it,
    /// that frame goes to `wire` instead of the transmit queue (one hop less on the latency path).
    ///
    /// The data may be borrowed (see [`Outgoing`]): it is copied only where it must be kept.
    #[inline]
    pub fn send_now_via<D: Outgoing>(
        &mut self,
        dest: Rank,
        context: u32,
        tag: u64,
        data: D,
        wire: impl FnOnce(Rank, Header, D),
    ) -> Result<Result<(), Error>, D> {
        if self.failures.any_lost()
            && let Some(e) = self.revoked(context)
        {
            return Ok(Err(e));
        }
        if let Some(e) = self.lost_error(dest) {
            return Ok(Err(e));
        }
        if dest == self.me {
            // To ourselves: no wire, no credit, no copy (of owned data).
            let len = data.as_ref().len();
            self.count_sent(dest, len, Protocol::Eager);
            self.count_received(dest, len, Protocol::Eager);
            self.arrive_eager(dest, context, tag, data.into_bytes());
            return Ok(Ok(()));
        }
        if data.as_ref().len() > self.cfg.eager_limit
            || !self.peers[dest as usize].backlog.is_empty()
            || !self.has_credit(dest)
        {
            return Err(data);
        }
        self.count_sent(dest, data.as_ref().len(), Protocol::Eager);
        self.peers[dest as usize].sent += 1;
        let header =
            self.stamp(dest, Header { context, tag, len: data.as_ref().len() as u32, ..Header::new(Kind::Eager) });
        if !(self.transmit.is_empty() && self.violations.is_empty()) {
            self.transmit.push_back((dest, header, data.into_bytes()));
        } else {
            wire(dest, header, data);
        }
        Ok(Ok(()))
    }

    /// Posts a send of `data` to `dest` (which must be a rank of the job); `op` completes through
    /// the engine's [`Completions`].
    pub fn post_send(&mut self, op: OpKey, dest: Rank, context: u32, tag: u64, data: Bytes) {
        if self.closed {
            return self.done.complete(op, Completion::Send(Err(Error::Shutdown)));
        }
        let data = match self.send_now(dest, context, tag, data) {
            Ok(r) => return self.done.complete(op, Completion::Send(r)),
            Err(data) => data,
        };
        let header = Header { context, tag, ..Header::new(Kind::Eager) };
        if data.len() <= self.cfg.eager_limit {
            self.count_sent(dest, data.len(), Protocol::Eager);
            // Behind others, or out of credit: queued.
            self.queue_credited(dest, Header { len: data.len() as u32, ..header }, data, Some(op));
        } else {
            self.count_sent(dest, data.len(), Protocol::Rendezvous);
            let len = data.len() as u64;
            let msg = self.rndv_sends.insert(RndvSend { op: Some(op), peer: dest, context, data });
            let push = if self.peers[dest as usize].push { flags::PUSH } else { 0 };
            let rts = Header { kind: Kind::Rts, seq: msg as u64, aux: len, flags: push, ..header };
            let _span = tracing::trace_span!("rts", dest, tag, len, msg).entered();
            self.queue_credited(dest, rts, Bytes::new(), None);
        }
    }

    /// The caller stopped waiting for send `op` to `dest`. A send still queued for credit is
    /// withdrawn; one already on the wire finishes in the background.
    pub fn cancel_send(&mut self, op: OpKey, dest: Rank) {
        let peer = &mut self.peers[dest as usize];
        if let Some(i) = peer.backlog.iter().position(|b| b.op == Some(op)) {
            peer.backlog.remove(i);
            return;
        }
        let rndv = self.rndv_sends.iter().find(|(_, s)| s.op == Some(op)).map(|(k, _)| k);
        if let Some(k) = rndv {
            let queued = peer.backlog.iter().position(|b| b.header.kind == Kind::Rts && b.header.seq == k as u64);
            match queued {
                Some(i) => {
                    peer.backlog.remove(i);
                    self.rndv_sends.remove(k);
                }
                None => self.rndv_sends[k].op = None,
            }
        }
    }

    #[inline(always)]
    fn has_credit(&self, dest: Rank) -> bool {
        let p = &self.peers[dest as usize];
        p.sent.wrapping_sub(p.peer_freed) < self.cfg.max_credit
    }

    fn queue_credited(&mut self, dest: Rank, header: Header, payload: Bytes, op: Option<OpKey>) {
        if self.peers[dest as usize].backlog.is_empty() && self.has_credit(dest) {
            self.peers[dest as usize].sent += 1;
            self.emit_credited(dest, header, payload);
            if let Some(op) = op {
                self.done.complete(op, Completion::Send(Ok(())));
            }
        } else {
            self.meters.credit_stalls.increment(1);
            self.peers[dest as usize].backlog.push_back(Backlogged { header, payload, op });
        }
    }

    /// Emits a credit-consuming frame; a pushed RTS takes its data right behind it.
    fn emit_credited(&mut self, dest: Rank, header: Header, payload: Bytes) {
        self.emit(dest, header, payload);
        if header.kind == Kind::Rts && header.flags & flags::PUSH != 0 {
            let data = self.rndv_sends[header.seq as usize].data.clone();
            self.emit_data(dest, header.seq, flags::PUSH, &data);
        }
    }

    /// Emits `data` in data frames of at most `chunk` bytes, addressed by `seq`.
    fn emit_data(&mut self, dest: Rank, seq: u64, fl: u16, data: &Bytes) {
        let chunk = self.cfg.chunk;
        let mut off = 0;
        while off < data.len() {
            let end = (off + chunk).min(data.len());
            let d = Header { seq, aux: off as u64, len: (end - off) as u32, flags: fl, ..Header::new(Kind::Data) };
            self.emit(dest, d, data.slice(off..end));
            off = end;
        }
    }

    fn emit(&mut self, dest: Rank, header: Header, payload: Bytes) {
        let header = self.stamp(dest, header);
        self.transmit.push_back((dest, header, payload));
    }

    /// Fills in the header of a frame about to go to `dest`: our rank, and the credit we hand back.
    #[inline]
    fn stamp(&mut self, dest: Rank, mut header: Header) -> Header {
        let p = &mut self.peers[dest as usize];
        header.src = self.me;
        header.credit = p.freed;
        p.advertised = p.freed;
        header
    }

    #[inline(always)]
    fn on_credit(&mut self, from: Rank, credit: u32) {
        let p = &mut self.peers[from as usize];
        if (credit.wrapping_sub(p.peer_freed) as i32) > 0 {
            p.peer_freed = credit;
        }
        while !self.peers[from as usize].backlog.is_empty() && self.has_credit(from) {
            let b = self.peers[from as usize].backlog.pop_front().unwrap();
            self.peers[from as usize].sent += 1;
            self.emit_credited(from, b.header, b.payload);
            if let Some(op) = b.op {
                self.done.complete(op, Completion::Send(Ok(())));
            }
        }
    }

    /// A credit-consuming frame from `peer` has been matched: hand the credit back when the peer
    /// is running low (otherwise it rides on the next frame we send anyway).
    #[inline(always)]
    fn free_credit(&mut self, peer: Rank) {
        if peer == self.me {
            return;
        }
        let p = &mut self.peers[peer as usize];
        p.freed += 1;
        if p.lost.is_none() && p.received.wrapping_sub(p.advertised) >= self.cfg.credit_sync {
            self.emit(peer, Header::new(Kind::Credit), Bytes::new());
        }
    }

    // ---- receiving ----

    /// Receives from the messages already here: when the first that matches is eager, the receive
    /// completes now and its outcome is returned. Otherwise gives the buffer back, for
    /// [`Engine::post_recv`]: no operation needs tracking for a receive that completes here.
    #[inline(always)]
    pub fn recv_now(
        &mut self,
        context: u32,
        src: Source,
        tag: TagMatch,
        buf: RecvBuf,
    ) -> Result<Result<(Payload, Status), Error>, RecvBuf> {
        if self.failures.any_lost()
            && let Some(e) = self.revoked(context)
        {
            return Ok(Err(e));
        }
        let Some(q) = self.contexts.get_mut(context) else { return Err(buf) };
        match q.unexpected.iter().position(|u| matches(src, tag, u.src, u.tag)) {
            Some(i) if matches!(q.unexpected[i].body, Body::Eager(_)) => {
                let Some(Unexpected { src, tag, body: Body::Eager(data) }) = take_at(&mut q.unexpected, i) else {
                    unreachable!()
                };
                self.free_credit(src);
                Ok(self.eager_outcome(src, tag, data, buf))
            }
            _ => Err(buf),
        }
    }

    /// Posts a receive on `context`. The source must be a rank of the job or `Any`.
    #[inline(always)]
    pub fn post_recv(&mut self, op: OpKey, context: u32, src: Source, tag: TagMatch, buf: RecvBuf) {
        if self.closed {
            return self.done.complete(op, Completion::Recv(Err(Error::Shutdown)));
        }
        if self.failures.any_lost()
            && let Some(e) = self.revoked(context)
        {
            return self.done.complete(op, Completion::Recv(Err(e)));
        }
        let q = self.contexts.entry(context);
        if let Some(i) = q.unexpected.iter().position(|u| matches(src, tag, u.src, u.tag)) {
            let u = take_at(&mut q.unexpected, i).unwrap();
            self.deliver(op, context, u.src, u.tag, u.body, buf);
            return;
        }
        if let Source::Rank(r) = src
            && let Some(reason) = self.peers[r as usize].lost.clone()
        {
            self.done.complete(op, Completion::Recv(Err(Error::PeerLost { rank: r, reason })));
            return;
        }
        q.posted.push_back(Posted { op, src, tag, buf });
    }

    /// The caller stopped waiting for receive `op`: withdraw it if unmatched; a rendezvous already
    /// under way finishes into its buffer, which is then dropped.
    pub fn cancel_recv(&mut self, op: OpKey, context: u32) {
        if let Some(q) = self.contexts.get_mut(context)
            && let Some(i) = q.posted.iter().position(|p| p.op == op)
        {
            q.posted.remove(i);
            return;
        }
        if let Some((_, r)) = self.rndv_recvs.iter_mut().find(|(_, r)| r.op == Some(op)) {
            r.op = None;
        }
    }

    /// The first unexpected message that a receive of (`src`, `tag`) would match now.
    pub fn iprobe(&self, context: u32, src: Source, tag: TagMatch) -> Option<Status> {
        if self.failures.any_lost() && self.failures.revoked(context).is_some() {
            return None;
        }
        let q = self.contexts.get(context)?;
        q.unexpected.iter().find(|u| matches(src, tag, u.src, u.tag)).map(Unexpected::status)
    }

    /// Completes `op` with the status of the first matching message, as soon as one has arrived.
    pub fn post_probe(&mut self, op: OpKey, context: u32, src: Source, tag: TagMatch) {
        if self.closed {
            return self.done.complete(op, Completion::Probe(Err(Error::Shutdown)));
        }
        if self.failures.any_lost()
            && let Some(e) = self.revoked(context)
        {
            return self.done.complete(op, Completion::Probe(Err(e)));
        }
        if let Some(s) = self.iprobe(context, src, tag) {
            self.done.complete(op, Completion::Probe(Ok(s)));
        } else if let Some(e) = match src {
            Source::Rank(r) => self.lost_error(r),
            Source::Any => None,
        } {
            self.done.complete(op, Completion::Probe(Err(e)));
        } else {
            self.contexts.entry(context).probes.push(Probe { op, src, tag });
        }
    }

    /// The caller stopped waiting for probe `op`.
    pub fn cancel_probe(&mut self, op: OpKey, context: u32) {
        if let Some(q) = self.contexts.get_mut(context) {
            q.probes.retain(|p| p.op != op);
        }
    }

    /// An eager message (or a message to ourselves) arrived.
    fn arrive_eager(&mut self, src: Rank, context: u32, tag: u64, data: Bytes) {
        self.arrive(src, context, tag, Body::Eager(data));
    }

    fn arrive(&mut self, src: Rank, context: u32, tag: u64, body: Body) {
        if self.failures.any_lost() && self.discards(context) {
            return self.discard(src, body);
        }
        let q = self.contexts.entry(context);
        if let Some(i) = q.posted.iter().position(|p| matches(p.src, p.tag, src, tag)) {
            let p = take_at(&mut q.posted, i).unwrap();
            self.deliver(p.op, context, src, tag, body, p.buf);
            return;
        }
        let u = Unexpected { src, tag, body };
        let status = u.status();
        q.probes.retain(|p| {
            let hit = matches(p.src, p.tag, src, tag);
            if hit {
                self.done.complete(p.op, Completion::Probe(Ok(status)));
            }
            !hit
        });
        q.unexpected.push_back(u);
        self.meters.unexpected_messages.increment(1);
    }

    /// A message meets its receive.
    fn deliver(&mut self, op: OpKey, context: u32, src: Rank, tag: u64, body: Body, buf: RecvBuf) {
        self.free_credit(src);
        let capacity = buf.capacity(self.cfg.max_message);
        match body {
            Body::Eager(data) => {
                let r = self.eager_outcome(src, tag, data, buf);
                self.done.complete(op, Completion::Recv(r));
            }
            Body::Rts { .. } if let Some(reason) = self.peers[src as usize].lost.clone() => {
                // Announced before the sender was lost (an orderly goodbye, or a crash): the data
                // can no longer come.
                self.done.complete(op, Completion::Recv(Err(Error::PeerLost { rank: src, reason })));
            }
            Body::Rts { msg, len } => {
                let cts = Header { seq: msg, ..Header::new(Kind::Cts) };
                if len > capacity {
                    self.no_place_for_push(src, msg);
                    self.emit(src, Header { flags: flags::TRUNCATED, ..cts }, Bytes::new());
                    self.done.complete(op, Completion::Recv(Err(Error::Truncated { len, capacity })));
                    return;
                }
                let (buf, user_buf) = match buf {
                    RecvBuf::Alloc => (BytesMut::zeroed(len), false),
                    RecvBuf::User(mut b) => {
                        b.truncate(len);
                        (b, true)
                    }
                };
                let key =
                    self.rndv_recvs.insert(RndvRecv { op: Some(op), peer: src, context, buf, got: 0, tag, user_buf });
                let _span = tracing::trace_span!("cts", src, tag, len, msg).entered();
                // A pushed message none of whose data has been dropped yet lands here in place.
                let taken = match &mut self.peers[src as usize].push_in {
                    Some(p) if p.msg == msg && p.into.is_none() && !p.dropping && p.len == len => {
                        p.into = Some(key);
                        flags::TAKEN
                    }
                    _ => 0,
                };
                self.emit(src, Header { aux: key as u64, flags: taken, ..cts }, Bytes::new());
            }
        }
    }

    /// What a receive into `buf` of eager message `data` from `src` gets.
    #[inline(always)]
    fn eager_outcome(&self, src: Rank, tag: u64, data: Bytes, buf: RecvBuf) -> Result<(Payload, Status), Error> {
        let status = Status { source: src, tag, len: data.len() };
        match buf {
            RecvBuf::User(b) => fill(b, &data, status),
            RecvBuf::Alloc if data.len() > self.cfg.max_message => {
                Err(Error::Truncated { len: data.len(), capacity: self.cfg.max_message })
            }
            RecvBuf::Alloc => Ok((Payload::Shared(data), status)),
        }
    }

    // ---- frames from the transport ----

    fn violation(&mut self, peer: Rank, e: WireError) {
        tracing::warn!(peer, error = %e, "peer broke the protocol; disconnecting");
        self.violations.push_back((peer, e));
    }

    /// Where the payload of rendezvous data frame `h` goes.
    pub fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        let key = if h.flags & flags::PUSH != 0 {
            let p = self.pushed_chunk(peer, h)?;
            match p.into {
                Some(key) => key,
                None => {
                    p.dropping = true;
                    return Ok(None);
                }
            }
        } else {
            h.seq as usize
        };
        let Some(r) = self.rndv_recvs.get_mut(key).filter(|r| r.peer == peer) else {
            return Err(WireError::Unexpected(Kind::Data));
        };
        let start = h.aux as usize;
        let end = start.checked_add(h.len as usize).filter(|&e| e <= r.buf.len());
        match end {
            Some(end) => Ok(Some(&mut r.buf[start..end])),
            None => Err(WireError::Oversize { kind: Kind::Data, len: h.aux + h.len as u64, max: r.buf.len() as u64 }),
        }
    }

    /// Whether pushed data frame `h` from `peer` would be dropped now only because its receive is
    /// not posted yet (see [`Sink::awaits_receive`]): the first data of a pushed message that no
    /// receive has matched and none of whose data has been dropped.
    pub fn awaits_receive(&self, peer: Rank, h: &Header) -> bool {
        h.flags & flags::PUSH != 0
            && self
                .peers
                .get(peer as usize)
                .and_then(|p| p.push_in.as_ref())
                .is_some_and(|p| p.msg == h.seq && p.next == 0 && h.aux == 0 && p.into.is_none() && !p.dropping)
    }

    /// Pushed message `msg` from `peer`, if its data is arriving, has no receive to land in and
    /// will get none (refused): its data is dropped without waiting (see [`Engine::awaits_receive`]).
    fn no_place_for_push(&mut self, peer: Rank, msg: u64) {
        if let Some(p) = self.peers[peer as usize].push_in.as_mut().filter(|p| p.msg == msg) {
            p.dropping = true;
        }
    }

    /// The pushed message that data frame `h` from `peer` belongs to, checked: the next bytes of
    /// the message in progress, and no more than it has left.
    fn pushed_chunk(&mut self, peer: Rank, h: &Header) -> Result<&mut PushIn, WireError> {
        match self.peers.get_mut(peer as usize).and_then(|p| p.push_in.as_mut()) {
            Some(p) if p.msg == h.seq && h.aux == p.next as u64 => {
                if h.len as usize > p.len - p.next {
                    return Err(WireError::Oversize { kind: Kind::Data, len: h.aux + h.len as u64, max: p.len as u64 });
                }
                Ok(p)
            }
            _ => Err(WireError::Unexpected(Kind::Data)),
        }
    }

    /// A whole frame from `peer` (for data frames, the payload is already in place).
    pub fn handle_frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        if !self.accept(peer, &h) {
            return;
        }
        match h.kind {
            Kind::Eager => self.arrive_eager(peer, h.context, h.tag, payload),
            Kind::Rts => {
                if h.flags & flags::PUSH != 0 && h.aux > 0 {
                    let p = &mut self.peers[peer as usize];
                    if p.push_in.is_some() {
                        // Pushed data comes whole behind its RTS: this one cut into the last.
                        return self.violation(peer, WireError::Unexpected(Kind::Rts));
                    }
                    let len = h.aux as usize;
                    p.push_in = Some(PushIn { msg: h.seq, len, next: 0, into: None, dropping: false });
                }
                self.arrive(peer, h.context, h.tag, Body::Rts { msg: h.seq, len: h.aux as usize })
            }
            Kind::Cts => self.on_cts(peer, h),
            Kind::Data => self.on_data(peer, h),
            Kind::Credit => {}
            Kind::Bye => self.depart(peer),
            Kind::Lost => self.on_lost(peer, h.aux),
            Kind::Hello => self.violation(peer, WireError::Unexpected(h.kind)),
        }
    }

    /// A whole frame from `peer` whose payload is only lent (see [`Sink::frame_ref`]): an eager
    /// message that meets a posted `recv_into` goes straight into its buffer, without an
    /// intermediate allocation; anything else takes the [`Engine::handle_frame`] path.
    #[inline(always)]
    pub fn handle_frame_ref(&mut self, peer: Rank, h: Header, payload: &[u8]) {
        if h.kind != Kind::Eager {
            return self.handle_frame(peer, h, Bytes::copy_from_slice(payload));
        }
        if !self.accept(peer, &h) {
            return;
        }
        let at = self.contexts.get_mut(h.context).and_then(|q| {
            let i = q.posted.iter().position(|p| matches(p.src, p.tag, peer, h.tag))?;
            Some((q, i))
        });
        match at {
            Some((q, i)) if matches!(q.posted[i].buf, RecvBuf::User(_)) => {
                let Some(Posted { op, buf: RecvBuf::User(b), .. }) = take_at(&mut q.posted, i) else { unreachable!() };
                let r = fill(b, payload, Status { source: peer, tag: h.tag, len: payload.len() });
                self.done.complete(op, Completion::Recv(r));
                self.free_credit(peer);
            }
            _ => self.arrive_eager(peer, h.context, h.tag, Bytes::copy_from_slice(payload)),
        }
    }

    /// Frame bookkeeping before its content: credit piggybacked on it, the credit it consumes.
    /// False if the frame must be ignored (peer lost, or it just broke the credit rule).
    #[inline(always)]
    fn accept(&mut self, peer: Rank, h: &Header) -> bool {
        if self.peers[peer as usize].lost.is_some() {
            return false;
        }
        self.on_credit(peer, h.credit);
        if matches!(h.kind, Kind::Eager | Kind::Rts) {
            let p = &mut self.peers[peer as usize];
            p.received += 1;
            if p.received.wrapping_sub(p.freed) > self.cfg.max_credit {
                self.violation(peer, WireError::Unexpected(h.kind));
                return false;
            }
            if h.kind == Kind::Eager {
                self.count_received(peer, h.len as usize, Protocol::Eager);
            }
        }
        true
    }

    fn on_cts(&mut self, peer: Rank, h: Header) {
        let key = h.seq as usize;
        if self.rndv_sends.get(key).is_none_or(|s| s.peer != peer) {
            return self.violation(peer, WireError::Unexpected(Kind::Cts));
        }
        let s = self.rndv_sends.remove(key);
        if self.leaving {
            // Its goodbye has gone out (`say_goodbye` failed the send): the data must not follow.
            return;
        }
        if h.flags & flags::TRUNCATED != 0 {
            if let Some(op) = s.op {
                self.done.complete(op, Completion::Send(Err(Error::RemoteTruncated { rank: peer })));
            }
            return;
        }
        if h.flags & flags::TAKEN == 0 {
            let _span = tracing::trace_span!("rendezvous_data", peer, len = s.data.len()).entered();
            self.emit_data(peer, h.aux, 0, &s.data);
        }
        if let Some(op) = s.op {
            self.done.complete(op, Completion::Send(Ok(())));
        }
    }

    fn on_data(&mut self, peer: Rank, h: Header) {
        let key = if h.flags & flags::PUSH != 0 {
            let p = match self.pushed_chunk(peer, &h) {
                Ok(p) => p,
                Err(e) => return self.violation(peer, e),
            };
            p.next += h.len as usize;
            let into = p.into;
            if p.next == p.len {
                self.peers[peer as usize].push_in = None;
            }
            match into {
                Some(key) => key,
                None => return,
            }
        } else {
            h.seq as usize
        };
        let Some(r) = self.rndv_recvs.get_mut(key).filter(|r| r.peer == peer) else {
            return self.violation(peer, WireError::Unexpected(Kind::Data));
        };
        r.got += h.len as usize;
        if r.got < r.buf.len() {
            return;
        }
        let r = self.rndv_recvs.remove(key);
        self.count_received(peer, r.buf.len(), Protocol::Rendezvous);
        tracing::trace!(peer, len = r.buf.len(), "rendezvous complete");
        if let Some(op) = r.op {
            let status = Status { source: peer, tag: r.tag, len: r.buf.len() };
            let payload = if r.user_buf { Payload::Owned(r.buf) } else { Payload::Shared(r.buf.freeze()) };
            self.done.complete(op, Completion::Recv(Ok((payload, status))));
        }
    }

    /// Fails, with `err()`, every posted receive and probe whose source `involves` names.
    fn fail_posted(&mut self, involves: impl Fn(Source) -> bool, err: impl Fn() -> Error) {
        for q in self.contexts.values_mut() {
            q.posted.retain(|p| {
                let hit = involves(p.src);
                if hit {
                    self.done.complete(p.op, Completion::Recv(Err(err())));
                }
                !hit
            });
            q.probes.retain(|p| {
                let hit = involves(p.src);
                if hit {
                    self.done.complete(p.op, Completion::Probe(Err(err())));
                }
                !hit
            });
        }
    }

    /// This rank shuts down: every operation in flight fails with [`Error::Shutdown`] (its
    /// awaiting future, if any, is woken), and so does every operation posted from now on (one
    /// that raced with the shutdown on another thread). Frames already queued stay queued.
    pub fn close(&mut self) {
        self.closed = true;
        self.fail_unsent();
        // Rendezvous receives keep their buffers, as when cancelled: a transport may still be
        // writing into them (see `Sink::data_dest`).
        for (_, r) in self.rndv_recvs.iter_mut() {
            if let Some(op) = r.op.take() {
                self.done.complete(op, Completion::Recv(Err(Error::Shutdown)));
            }
        }
        self.fail_posted(|_| true, || Error::Shutdown);
    }

    /// Fails with [`Error::Shutdown`] every send not yet gone out whole: those waiting for credit
    /// (dropped from the backlog) and rendezvous sends whose data has not gone (they keep their
    /// buffers, as when cancelled: a late clear-to-send finds them; see `on_cts`).
    fn fail_unsent(&mut self) {
        for p in &mut self.peers {
            for b in std::mem::take(&mut p.backlog) {
                if let Some(op) = b.op {
                    self.done.complete(op, Completion::Send(Err(Error::Shutdown)));
                }
            }
        }
        for (_, s) in self.rndv_sends.iter_mut() {
            if let Some(op) = s.op.take() {
                self.done.complete(op, Completion::Send(Err(Error::Shutdown)));
            }
        }
    }

    /// Whether a send that someone still awaits has not gone out whole: waiting for credit, or a
    /// rendezvous waiting for its clear-to-send. An orderly shutdown gives these time to go before
    /// [`Engine::say_goodbye`] fails them.
    pub fn sends_waiting(&self) -> bool {
        self.peers.iter().any(|p| p.backlog.iter().any(|b| b.op.is_some()))
            || self.rndv_sends.iter().any(|(_, s)| s.op.is_some())
    }

    /// Says goodbye to every peer not lost (before an orderly shutdown); a peer that departed
    /// already may still be reading while it leaves, and must not take this rank's closing
    /// connection for a loss.
    pub fn say_goodbye(&mut self) {
        self.leaving = true;
        // Nothing of this rank's may follow its goodbye: a peer that has seen it takes this rank
        // for gone and drops what comes after, while this side would count it delivered. Sends
        // still waiting for credit, and rendezvous sends still waiting for their clear-to-send,
        // fail here instead (their data is never sent; see `on_cts`).
        self.fail_unsent();
        for peer in 0..self.peers.len() as Rank {
            if peer != self.me && !matches!(self.failures.fate(peer), super::failure::Fate::Lost(_)) {
                self.emit(peer, Header::new(Kind::Bye), Bytes::new());
            }
        }
    }
}

// SAFETY: `data_dest` hands out slices of `rndv_recvs` buffers. They are never resized, and a
// receive's buffer is dropped only after its last data frame arrived (`handle_frame`) or the
// transport reported its peer lost (`peer_lost`); a cancelled receive, or one failed by a loss
// learnt otherwise (`revoke.rs`), keeps its buffer until then.
unsafe impl<C: Completions> Sink for Engine<C> {
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        Engine::data_dest(self, peer, h)
    }
    fn awaits_receive(&mut self, peer: Rank, h: &Header) -> bool {
        Engine::awaits_receive(self, peer, h)
    }
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        self.handle_frame(peer, h, payload)
    }
    #[inline(always)]
    fn frame_ref(&mut self, peer: Rank, h: Header, payload: &[u8]) {
        self.handle_frame_ref(peer, h, payload)
    }
    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        Engine::peer_lost(self, peer, err)
    }
}

mod revoke;
#[cfg(test)]
mod tests;
