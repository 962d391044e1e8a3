//! Reliable multicast on a communicator: a [`Channel`] (every rank may send; each rank reads
//! each root's messages exactly once and in order), a multicast [`broadcast`], and the
//! skew-tolerant [`TokenBarrier`].
//!
//! The protocol is the sans-IO core of [`ferrocomm_multicast::proto`]; this module is its thin
//! I/O driver. Per channel, one tokio task owns the multicast socket's receive side, one posted
//! wildcard receive on a private duplicate of the communicator (the reliable point-to-point half:
//! ACKs, NACKs, co-root copies, retransmissions, ping answers), the in-flight point-to-point
//! sends, and the core's timer. Application calls lock the core, feed it, and push its output at
//! once (datagrams straight to the socket, point-to-point sends started on the communicator) so a
//! send does not wait for the task to be scheduled. The task makes progress while the
//! application computes: ACKs and retransmissions for other ranks never wait on the caller.
//!
//! Group set-up follows the dissertation's lazy multicast test: from the start each root pings
//! the group in the background and sends over point-to-point until every receiver has answered;
//! a group that never confirms (multicast filtered, no multicast route) stays on point-to-point
//! with a warning and the `ferrocomm_mcast_groups_degraded` metric. The API works either way.
//!
//! Every datagram of the job carries a 16-byte tag after the core's bytes
//! ([`ferrocomm_transports::auth::DatagramKey`], keyed from the job token): the driver appends it
//! on the way out and checks it first on the way in; a datagram without a valid tag (another
//! job's, a stranger's, an altered one) is dropped and counted (`Stats::unauthenticated`, metric
//! `ferrocomm_mcast_datagrams_unauthenticated`). The tag counts within
//! `FERROCOMM_MCAST_DATAGRAM`, so the core fragments into datagrams 16 bytes shorter. Cost: one
//! keyed BLAKE3 over each datagram sent and received (`examples/handshake_cost.rs` measures it),
//! and a copy of each datagram sent. A rank's own datagrams come back to its socket
//! (IP_MULTICAST_LOOP, needed for the other ranks on its host): the driver drops them by the
//! header's root before authenticating them.
//!
//! A channel holds a handle on the communicator: drop channels before finalizing the world, and
//! [`Channel::flush`] them first: a dropped channel abandons what it has not delivered yet.
//!
//! A loss that revokes the communicator ends the channel: its task stops, and every pending and
//! later call fails with the error naming the lost rank (see `docs/failure.md`).

use std::net::{IpAddr, Ipv4Addr};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm_multicast::barrier::{BarrierMsg, TokenBarrier as BarrierCore};
use ferrocomm_multicast::proto::{Config, Event, McastCore, SendError, Stats, Transmit};
use ferrocomm_multicast::transport::{GSO_MAX_BYTES, MulticastTransport, UdpConfig, UdpMulticast};
use ferrocomm_transports::auth::{DatagramKey, TAG_LEN};
use ferrocomm_transports::{Rank, TransportError};
use futures::FutureExt;
use futures::stream::{FuturesUnordered, Stream, StreamExt};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};

use crate::api::world::{Comm, Op};
use crate::config::TransportChoice;
use crate::error::{Error, McastError, Result};
use crate::p2p::{Source, TagMatch};

pub use crate::config::{McastNet, McastSettings};
pub use ferrocomm_multicast::proto::Stats as McastStats;

/// Datagrams handled per wake-up of the driver task before its output is pushed.
const DATAGRAM_BATCH: usize = 64;

/// Up to this many receivers a stream has no co-roots by default (`FERROCOMM_MCAST_SUBGROUPS=0`):
/// the root collects every ACK itself, 16/k per message at `ack_every` = k. Co-roots cost more
/// than that at this scale: the root sends every message to each co-root over point-to-point as
/// well, and each ACK takes a second hop (`ferrocomm-bench multicast`, 8 receivers: the stream
/// ran faster without them).
pub const FLAT_RECEIVERS: usize = 16;

/// Tag of the protocol's point-to-point messages on the channel's private communicator.
const TAG: u64 = 0x6d63;

struct Shared {
    core: Mutex<McastCore>,
    comm: Comm,
    net: Option<Box<dyn MulticastTransport>>,
    /// Tags the datagrams sent and checks the ones received.
    key: DatagramKey,
    /// Datagrams waiting for room in the socket.
    backlog: Mutex<std::collections::VecDeque<Bytes>>,
    sends: mpsc::UnboundedSender<Op<()>>,
    /// Application -> task: new timers or output.
    kick: Notify,
    /// Task -> application: messages ready, window open, group state changed.
    ready: Notify,
    published: Mutex<Stats>,
    closed: AtomicBool,
    /// Why the task stopped, when a loss revoked the communicator.
    failed: Mutex<Option<Error>>,
    drop_rng: AtomicU64,
    test_drop: f64,
}

impl Shared {
    /// Pushes the core's output to the network and its events to the waiting application calls.
    fn pump(&self) {
        let mut woke = false;
        {
            let mut core = self.core.lock();
            let mut datagrams = Vec::new();
            while let Some(t) = core.poll_transmit() {
                match t {
                    Transmit::Multicast(d) => datagrams.push(d),
                    Transmit::Unicast { to, msg } => {
                        let _ = self.sends.send(self.comm.send(to, TAG, msg));
                    }
                }
            }
            self.send_datagrams(&datagrams);
            while let Some(e) = core.poll_event() {
                if e == Event::GroupDegraded {
                    tracing::warn!(rank = self.comm.rank(), "multicast group degraded to point-to-point");
                }
                woke = true;
            }
            let mut prev = self.published.lock();
            if *prev != *core.stats() {
                core.stats().publish(&prev);
                *prev = core.stats().clone();
            }
        }
        if woke {
            self.ready.notify_waiters();
        }
    }

    /// Seals `datagrams` and sends them, several per send where the transport segments (a full
    /// datagram may be followed by more; a short one ends a send).
    fn send_datagrams(&self, datagrams: &[Bytes]) {
        let Some(net) = &self.net else { return };
        let Some(segment) = net.segment_size() else {
            for d in datagrams {
                self.send_sealed(Bytes::from(self.key.seal(d)));
            }
            return;
        };
        let mut run: Vec<u8> = Vec::new();
        let mut last = segment;
        for d in datagrams {
            let sealed = d.len() + TAG_LEN;
            if !run.is_empty() && (last < segment || run.len() + sealed > GSO_MAX_BYTES) {
                self.send_sealed(Bytes::from(std::mem::take(&mut run)));
            }
            run.extend_from_slice(d);
            run.extend_from_slice(&self.key.tag(d));
            last = sealed;
        }
        if !run.is_empty() {
            self.send_sealed(Bytes::from(run));
        }
    }

    /// Sends sealed datagrams (one, or a run for a segmenting transport), or queues them until
    /// the socket has room.
    fn send_sealed(&self, d: Bytes) {
        let Some(net) = &self.net else { return };
        let mut backlog = self.backlog.lock();
        if backlog.is_empty() {
            match net.try_send(&d) {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => {
                    // The network lost it; the protocol recovers.
                    tracing::debug!(error = %e, "multicast send failed");
                    return;
                }
            }
        }
        backlog.push_back(d);
        self.kick.notify_one();
    }

    fn flush_backlog(&self) {
        let Some(net) = &self.net else { return };
        let mut backlog = self.backlog.lock();
        while let Some(d) = backlog.front() {
            match net.try_send(d) {
                Ok(false) => return,
                Ok(true) | Err(_) => {
                    backlog.pop_front();
                }
            }
        }
    }

    /// Test hook: drop this received datagram?
    fn drop_datagram(&self) -> bool {
        if self.test_drop <= 0.0 {
            return false;
        }
        let mut x = self.drop_rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.drop_rng.store(x, Ordering::Relaxed);
        ((x >> 11) as f64 / (1u64 << 53) as f64) < self.test_drop
    }

    /// Hands one received datagram to the protocol, once authenticated; this rank's own
    /// datagrams, looped back, are never used and so not authenticated.
    fn take_datagram(&self, datagram: &[u8]) {
        let me = self.comm.rank();
        if ferrocomm_multicast::wire::peek_root(datagram) == Some(me) || self.drop_datagram() {
            return;
        }
        match self.key.open(datagram) {
            Ok(d) => {
                if let Err(e) = self.core.lock().handle_datagram(Instant::now(), Bytes::copy_from_slice(d)) {
                    tracing::trace!(rank = me, error = %e, "datagram refused");
                }
            }
            Err(e) => {
                tracing::trace!(rank = me, error = %e, "datagram dropped");
                self.core.lock().refused_unauthenticated();
            }
        }
    }

    /// Why the channel can no longer serve: a loss revoked its communicator.
    fn failure(&self) -> Option<Error> {
        let failed = self.failed.lock().clone();
        failed.or_else(|| self.comm.revoked())
    }

    /// Waits until `f` gives an answer, re-trying it whenever the task reports progress; fails
    /// once a loss revoked the communicator (then nothing would ever change).
    async fn wait_for<T>(&self, mut f: impl FnMut(&mut McastCore) -> Option<T>) -> Result<T> {
        loop {
            let mut notified = pin!(self.ready.notified());
            notified.as_mut().enable();
            if let Some(e) = self.failure() {
                return Err(e);
            }
            let r = f(&mut self.core.lock());
            if let Some(v) = r {
                self.pump();
                self.kick.notify_one();
                return Ok(v);
            }
            if self.closed.load(Ordering::Acquire) {
                // The task is gone: nothing will change; let `f` see the final state once more.
                if let Some(v) = f(&mut self.core.lock()) {
                    return Ok(v);
                }
                return Err(self.failure().unwrap_or(Error::Shutdown));
            }
            notified.await;
        }
    }

    /// A point-to-point operation of the channel failed for the loss of world rank `rank`: the
    /// protocol forgets that member; true if the loss revoked the communicator (the task stops).
    fn lost(&self, rank: Rank) -> bool {
        let local = self.comm.local_rank(rank);
        if local != Rank::MAX {
            self.core.lock().peer_lost(Instant::now(), local);
        }
        match self.comm.revoked() {
            Some(e) => {
                *self.failed.lock() = Some(e);
                true
            }
            None => false,
        }
    }
}

/// A reliable multicast channel over a communicator. See the module docs.
pub struct Channel {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// Joins the UD multicast group derived from `group` on the verbs device of the job's settings
/// (`FERROCOMM_VERBS_DEVICE`, `FERROCOMM_VERBS_GID_INDEX`); `None`, with a warning, when that fails
/// or ferrocomm is built without verbs.
fn join_ud(comm: &Comm, group: Ipv4Addr, h: u64) -> Option<Box<dyn MulticastTransport>> {
    #[cfg(feature = "verbs")]
    {
        let (s, v) = (&comm.settings().multicast, &comm.settings().verbs);
        let cfg = ferrocomm_multicast::UdConfig {
            device: v.device.clone(),
            gid_index: v.gid_index,
            datagram: s.datagram,
            // About what the UDP socket's buffer holds, in datagrams of the group's MTU.
            recv_bytes: s.buffer,
            test_drop: s.test_drop,
            seed: mix(&[h, u64::from(comm.rank()), 0x7564]),
            ..ferrocomm_multicast::UdConfig::new(group)
        };
        match ferrocomm_multicast::UdMulticast::join(&cfg) {
            Ok(u) => {
                // The group's MTU decides the datagram: it must leave room for the protocol's
                // header and the tag, and keep the largest message within 65535 fragments.
                let core = u.max_datagram().saturating_sub(ferrocomm_transports::auth::TAG_LEN);
                let fits = core >= ferrocomm_multicast::wire::HEADER + 64
                    && ferrocomm_multicast::wire::fragments(s.max_message, core) <= usize::from(u16::MAX);
                if fits {
                    return Some(Box::new(u));
                }
                tracing::warn!(rank = comm.rank(), mtu = u.mtu(), %group, "UD multicast datagrams too small for FERROCOMM_MCAST_MAX_MESSAGE");
            }
            Err(e) => tracing::warn!(rank = comm.rank(), error = %e, %group, "cannot join the UD multicast group"),
        }
    }
    #[cfg(not(feature = "verbs"))]
    let _ = (comm, group, h);
    None
}

/// FNV-1a of a few words: derived group addresses and ports.
fn mix(words: &[u64]) -> u64 {
    crate::bootstrap::env::fnv1a64_bytes(words.iter().flat_map(|w| w.to_le_bytes()))
}

impl Channel {
    /// Creates a channel on `comm`. Collective: every rank of `comm` calls it in the same order
    /// (it duplicates the communicator for its point-to-point traffic). Needs a tokio runtime.
    pub async fn new(comm: &Comm) -> Result<Channel> {
        let s = comm.settings().multicast.clone();
        let p2p = comm.dup()?;
        let channel = p2p.context();
        let job = comm.job_id();
        let h = mix(&[job, u64::from(channel)]);
        let mut cfg = Config {
            job,
            channel,
            window: s.window,
            ack_every: s.ack_every,
            ack_delay: s.ack_delay,
            subgroups: match s.subgroups {
                0 if comm.size() as usize <= FLAT_RECEIVERS + 1 => Some(1),
                0 => None,
                g => Some(g),
            },
            datagram: s.core_datagram(),
            max_message: s.max_message,
            confirm_timeout: s.confirm_timeout,
            multicast: s.enabled,
            ..Config::new(comm.rank(), comm.size())
        };
        let group = s.group.unwrap_or(Ipv4Addr::new(239, 255, (h >> 8) as u8, h as u8));
        let over_verbs = comm.settings().transports == TransportChoice::Verbs;
        let ud = s.enabled
            && match s.network {
                McastNet::Ud => true,
                McastNet::Auto => over_verbs,
                McastNet::Udp => false,
            };
        let mut test_drop = s.test_drop;
        let net: Option<Box<dyn MulticastTransport>> = if let Some(u) = ud.then(|| join_ud(comm, group, h)).flatten() {
            // The group's MTU may be below the configured datagram; the UD transport drops test
            // losses in its own receive path.
            cfg.datagram = u.max_datagram() - ferrocomm_transports::auth::TAG_LEN;
            test_drop = 0.0;
            Some(u)
        } else if s.enabled && s.network != McastNet::Ud {
            let interface = s.interface.unwrap_or(match comm.listen_addr().ip() {
                IpAddr::V4(a) => a,
                IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
            });
            let udp = UdpConfig {
                group,
                port: s.port.unwrap_or(20000 + ((h >> 16) % 40000) as u16),
                interface,
                datagram: s.datagram,
                ttl: 1,
                buffer: s.buffer,
            };
            match UdpMulticast::join(&udp) {
                Ok(u) => Some(Box::new(u)),
                Err(e) => {
                    tracing::warn!(rank = comm.rank(), error = %e, ?udp, "cannot join the multicast group: point-to-point only");
                    metrics::counter!("ferrocomm_mcast_groups_degraded").increment(1);
                    cfg.multicast = false;
                    None
                }
            }
        } else {
            if s.enabled {
                // UD asked for and not available.
                metrics::counter!("ferrocomm_mcast_groups_degraded").increment(1);
                cfg.multicast = false;
            }
            None
        };
        let core = McastCore::new(cfg, Instant::now());
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            comm: p2p,
            net,
            key: comm.datagram_key().clone(),
            backlog: Default::default(),
            sends: tx,
            kick: Notify::new(),
            ready: Notify::new(),
            published: Default::default(),
            closed: AtomicBool::new(false),
            failed: Mutex::new(None),
            drop_rng: AtomicU64::new(mix(&[h, u64::from(comm.rank())]) | 1),
            test_drop,
        });
        let task = tokio::spawn(drive(shared.clone(), rx));
        Ok(Channel { shared, task })
    }

    /// Which network carries this channel's datagrams: `ud` (an RDMA UD multicast group),
    /// `udp4`, or `none` (point-to-point only).
    pub fn network(&self) -> &'static str {
        self.shared.net.as_ref().map_or("none", |n| n.name())
    }

    /// This rank in the channel's communicator.
    pub fn rank(&self) -> Rank {
        self.shared.comm.rank()
    }

    /// The number of ranks in the channel's communicator.
    pub fn size(&self) -> u32 {
        self.shared.comm.size()
    }

    /// Sends `data` to every other rank. Completes as soon as the message is in the window
    /// (it is then this channel's to deliver); waits only while the window is full.
    /// Returns the message's sequence number.
    pub async fn send(&self, data: impl Into<Bytes>) -> Result<u32> {
        let data = data.into();
        let now = Instant::now;
        self.shared
            .wait_for(|core| match core.send(now(), data.clone()) {
                Ok(seq) => Some(Ok(seq)),
                Err(SendError::WindowFull) => None,
                Err(SendError::TooLarge { len, max }) => Some(Err(Error::TooLarge { len, max })),
            })
            .await?
    }

    /// The next message from `root`, exactly once and in the order `root` sent them.
    /// Fails with [`Error::PeerLost`] once `root` died and everything that arrived was read, or
    /// at once when a loss revoked the communicator (the error names the world rank lost).
    pub async fn recv(&self, root: Rank) -> Result<Bytes> {
        if root >= self.size() || root == self.rank() {
            return Err(Error::UnknownRank { rank: root, size: self.size() });
        }
        let gone = || {
            let rank = self.shared.comm.world_rank(root);
            self.shared.failure().unwrap_or(Error::PeerLost { rank, reason: TransportError::Closed })
        };
        self.shared
            .wait_for(|core| match core.pop(root, Instant::now()) {
                Ok(Some(m)) => Some(Ok(m)),
                Ok(None) => None,
                Err(()) => Some(Err(gone())),
            })
            .await?
    }

    /// The next message from any root.
    pub async fn recv_any(&self) -> Result<(Rank, Bytes)> {
        self.shared.wait_for(|core| core.pop_any(Instant::now())).await
    }

    /// The messages of `root`, as a stream.
    pub fn stream(&self, root: Rank) -> impl Stream<Item = Result<Bytes>> + '_ {
        futures::stream::unfold(false, move |ended| async move {
            if ended {
                return None;
            }
            let r = self.recv(root).await;
            let end = r.is_err();
            Some((r, end))
        })
    }

    /// Waits until every live rank has consumed every message this rank sent.
    pub async fn flush(&self) -> Result<()> {
        self.shared.wait_for(|core| (core.in_flight() == 0).then_some(())).await
    }

    /// Waits until this rank may leave without abandoning anything: every live rank consumed what
    /// it sent, and it acknowledged what it consumed (as a co-root, with its sub-group).
    /// (A channel that a loss ended has nothing left to settle.)
    async fn settle(&self) {
        let _ = self.shared.wait_for(|core| (core.in_flight() == 0 && core.settled()).then_some(())).await;
    }

    /// Waits (at most `limit`) for this rank's multicast test to finish: true if the group
    /// works, false if it degraded to point-to-point or is still testing.
    pub async fn wait_group(&self, limit: Duration) -> bool {
        let done = self.shared.wait_for(|core| (core.confirmed() || core.degraded()).then(|| core.confirmed()));
        tokio::time::timeout(limit, done).await.is_ok_and(|r| r.unwrap_or(false))
    }

    /// True if this rank's messages go by multicast.
    pub fn confirmed(&self) -> bool {
        self.shared.core.lock().confirmed()
    }

    /// Protocol counters of this rank.
    pub fn stats(&self) -> Stats {
        self.shared.core.lock().stats().clone()
    }

    /// Number of ACK sub-groups of this rank's stream.
    pub fn subgroups(&self) -> usize {
        self.shared.core.lock().layout().subgroups()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The driver task of one channel.
async fn drive(shared: Arc<Shared>, mut new_sends: mpsc::UnboundedReceiver<Op<()>>) {
    let me = shared.comm.rank();
    let mut sends = FuturesUnordered::new();
    let mut recv = shared.comm.recv(Source::Any, TagMatch::Exact(TAG));
    // Room for the largest UDP payload: one datagram or a coalesced run of them.
    let mut buf = vec![0u8; 65_536];
    loop {
        shared.pump();
        let deadline = shared.core.lock().poll_timeout();
        let backlog = !shared.backlog.lock().is_empty();
        let timer = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        let datagram = async {
            match &shared.net {
                Some(n) => std::future::poll_fn(|cx| n.poll_recv(cx, &mut buf)).await,
                None => std::future::pending().await,
            }
        };
        let writable = async {
            match &shared.net {
                Some(n) if backlog => std::future::poll_fn(|cx| n.poll_send_ready(cx)).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            r = datagram => {
                // Take what else is queued in the socket too (up to a batch) before pumping.
                // The next datagram is read only when it will be handled in this batch: one
                // read past the batch's end would be dropped, a loss that every receiver with a
                // backlog of the same stream suffers at once.
                let mut r = r;
                for i in 1..=DATAGRAM_BATCH {
                    match r {
                        Ok(got) => got.datagrams(&buf).for_each(|d| shared.take_datagram(d)),
                        Err(e) => tracing::debug!(rank = me, error = %e, "multicast receive failed"),
                    }
                    let Some(net) = &shared.net else { break };
                    if i == DATAGRAM_BATCH {
                        break;
                    }
                    match std::future::poll_fn(|cx| net.poll_recv(cx, &mut buf)).now_or_never() {
                        Some(next) => r = next,
                        None => break,
                    }
                }
            }
            m = &mut recv => {
                match m {
                    Ok(m) => {
                        if let Err(e) = shared.core.lock().handle_control(Instant::now(), m.source, m.data) {
                            tracing::debug!(rank = me, from = m.source, error = %e, "control message refused");
                        }
                    }
                    Err(Error::PeerLost { rank, .. }) => {
                        if shared.lost(rank) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
                recv = shared.comm.recv(Source::Any, TagMatch::Exact(TAG));
            }
            Some(op) = new_sends.recv() => sends.push(op),
            Some(r) = sends.next(), if !sends.is_empty() => {
                if let Err(Error::PeerLost { rank, .. }) = r
                    && shared.lost(rank)
                {
                    break;
                }
            }
            r = writable => {
                if r.is_ok() {
                    shared.flush_backlog();
                }
            }
            _ = timer => shared.core.lock().handle_timeout(Instant::now()),
            _ = shared.kick.notified() => {}
        }
    }
    shared.closed.store(true, Ordering::Release);
    shared.ready.notify_waiters();
}

/// Waits (at most `limit`) until the channels of a communicator's pinned multicast collectives,
/// which it owns and finalize drops, have settled (see [`Channel::settle`]). Before the goodbye: a
/// rank that hears it ends this rank's stream at once, dropping a datagram still on the way
/// (multicast is not ordered with point-to-point), and nobody would retransmit a lost one.
pub(crate) async fn drain(rank: Rank, channel: Option<&Channel>, barrier: Option<&TokenBarrier>, limit: Duration) {
    let barrier = barrier.map(TokenBarrier::channel);
    let settled = [channel, barrier].into_iter().flatten().map(Channel::settle);
    if tokio::time::timeout(limit, futures::future::join_all(settled)).await.is_err() {
        tracing::warn!(rank, "multicast channels not settled within {limit:?}: leaving anyway");
    }
}

/// Broadcast over a multicast channel: `root` passes `Some(data)`, everyone else `None`; every
/// rank returns the data. For the collectives table.
pub async fn broadcast(chan: &Channel, root: Rank, data: Option<Bytes>) -> Result<Bytes> {
    if chan.rank() == root {
        let data = data.ok_or_else(|| Error::from(crate::InvalidArgument::RootWithoutData { op: "broadcast" }))?;
        chan.send(data.clone()).await?;
        Ok(data)
    } else {
        chan.recv(root).await
    }
}

/// The skew-tolerant token barrier (see [`ferrocomm_multicast::barrier`]): a combining tree
/// whose token moves to the last rank still missing, which releases everyone by one reliable
/// multicast.
pub struct TokenBarrier {
    chan: Channel,
    comm: Comm,
    degree: u32,
    state: tokio::sync::Mutex<BarrierState>,
}

struct BarrierState {
    epoch: u64,
    /// The receive posted for the next barrier message; kept across barriers, since dropping a
    /// receive that already matched would lose the message.
    recv: Option<Op<crate::api::world::Message>>,
    /// Messages of the next barrier that arrived during this one.
    early: Vec<(Rank, u64)>,
}

impl TokenBarrier {
    /// Collective over `comm`, like [`Channel::new`].
    pub async fn new(comm: &Comm) -> Result<TokenBarrier> {
        let chan = Channel::new(comm).await?;
        let p2p = comm.dup()?;
        Ok(TokenBarrier {
            chan,
            degree: comm.settings().multicast.barrier_degree,
            state: tokio::sync::Mutex::new(BarrierState { epoch: 0, recv: None, early: Vec::new() }),
            comm: p2p,
        })
    }

    /// The release channel (for its statistics and group state).
    pub fn channel(&self) -> &Channel {
        &self.chan
    }

    /// Waits until every rank has entered this barrier.
    pub async fn wait(&self) -> Result<()> {
        let mut st = self.state.lock().await;
        let epoch = st.epoch;
        st.epoch += 1;
        let (me, size) = (self.comm.rank(), self.comm.size());
        let mut b = BarrierCore::new(me, size, self.degree);
        b.enter();
        let tag = |kind: BarrierMsg| (epoch << 1) | u64::from(kind == BarrierMsg::Token);
        for (from, t) in std::mem::take(&mut st.early) {
            if t >> 1 == epoch {
                b.handle(from, if t & 1 == 1 { BarrierMsg::Token } else { BarrierMsg::Arrive });
            }
        }
        let mut sends = Vec::new();
        let mut recv = st.recv.take().unwrap_or_else(|| self.comm.recv(Source::Any, TagMatch::Any));
        let result = loop {
            while let Some((to, m)) = b.poll_transmit() {
                sends.push(self.comm.send(to, tag(m), Bytes::new()));
            }
            if b.take_release() {
                break self.chan.send(Bytes::copy_from_slice(&epoch.to_le_bytes())).await.map(|_| ());
            }
            if b.is_done() {
                break Ok(());
            }
            tokio::select! {
                m = &mut recv => {
                    let m = match m {
                        Ok(m) => m,
                        Err(e) => break Err(e),
                    };
                    recv = self.comm.recv(Source::Any, TagMatch::Any);
                    match m.tag >> 1 {
                        e if e == epoch => {
                            b.handle(m.source, if m.tag & 1 == 1 { BarrierMsg::Token } else { BarrierMsg::Arrive })
                        }
                        e if e > epoch => st.early.push((m.source, m.tag)),
                        _ => {} // a late Arrive of an earlier barrier (race rule): ignored
                    }
                }
                r = self.chan.recv_any() => {
                    let (root, data) = r?;
                    if data[..] != epoch.to_le_bytes() {
                        break Err(McastError::ForeignRelease { root }.into());
                    }
                    b.released();
                }
            }
        };
        st.recv = Some(recv);
        for s in sends {
            s.await?;
        }
        result
    }
}
