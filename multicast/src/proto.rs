//! The reliability protocol (chapter 5 of the multicast dissertation), sans-IO.
//!
//! One [`McastCore`] per rank and channel plays every role at once: root of its own message stream
//! ([`RootSender`]) and, for each other rank's stream, co-root or leaf ([`Receiver`]). It never
//! reads the clock and never does I/O: the driver feeds datagrams ([`McastCore::handle_datagram`]),
//! point-to-point control messages ([`McastCore::handle_control`]), lost peers and timer expiries
//! in, and takes datagrams and point-to-point messages out ([`McastCore::poll_transmit`]) and
//! completions ([`McastCore::poll_event`]), as quinn-proto does. So the tests script the network
//! (loss, duplicates, reordering, dead ranks) and the clock exactly.
//!
//! Why each piece:
//! * **Sliding window.** The root copies each message into one of `window` slots and the send is
//!   done; it waits only when every slot holds a message not yet acknowledged by every receiver.
//!   The window also bounds every receiver's memory: nothing beyond `consumed + window` is kept.
//! * **Co-roots** (against ACK implosion). The receivers of a root's stream are cut into about
//!   sqrt(N) sub-groups; the root collects ACKs from its own sub-group, which includes the
//!   co-roots, and each co-root from its leaves. The sub-groups are sized so that every collector
//!   handles the same number of ACK senders, which makes the root's share 1/(number of sub-groups).
//!   The root also sends each message to every co-root over reliable point-to-point; a co-root
//!   takes whichever copy comes first, keeps it, and retransmits to its own leaves, so nothing
//!   waits on an intermediate node's progress (the weakness of tree ACK collection).
//! * **Cumulative, delayed ACKs**: "consumed everything below `upto`", sent every `ack_every`
//!   messages or `ack_delay` after the first unacknowledged one. ACKs count messages the
//!   application has taken, so a receiver that stops reading stalls the root's window instead of
//!   growing memory anywhere.
//! * **NACK** on a gap (a later message arrived first) asks the collector at once (a leaf only: a
//!   co-root's reliable copies are already on their way), and again only after a hold that doubles
//!   while the NACKs bring nothing; **timeouts**
//!   (RTO from a smoothed RTT estimate, Karn's rule, exponential back-off) catch the rest.
//!   Retransmissions go to the missing rank only, over reliable point-to-point.
//! * **Failures**: a dead leaf is dropped from its collector; a dead co-root's leaves are adopted by
//!   the root, and they switch their ACKs to the root. A dead root ends its stream with an error.
//! * **Group test**: the root pings the group until every receiver has answered (over
//!   point-to-point); until then, and for good if `confirm_timeout` passes, messages go to every
//!   receiver over point-to-point instead, through the same sequence numbers and ACKs.
//!
//! Sequence numbers are per root, `u32`, wrapping, compared in serial-number arithmetic; a window
//! is far below 2^31 so comparisons are unambiguous.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::wire::{self, Control, ControlError, Datagram, DatagramError, Expect, Rank};

/// `a` comes before `b` in serial-number order.
pub fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// Number of sequence numbers in `from..to`.
fn dist(from: u32, to: u32) -> u32 {
    to.wrapping_sub(from)
}

/// Protocol parameters. Every rank of a channel must use the same values for `window`,
/// `subgroups`, `datagram`, `first_seq`, `job` and `channel`.
#[derive(Clone, Debug)]
pub struct Config {
    /// This rank.
    pub me: Rank,
    /// Ranks in the channel.
    pub size: u32,
    /// Hash of the job token: datagrams carrying another value are refused.
    pub job: u64,
    /// Channel id (the communicator's context).
    pub channel: u32,
    /// W: messages the root may have unacknowledged.
    pub window: usize,
    /// k: a receiver acknowledges at least every k messages ...
    pub ack_every: u32,
    /// T: ... or this long after the first unacknowledged one.
    pub ack_delay: Duration,
    /// Number of sub-groups (the root's plus one per co-root); `None`: about sqrt(receivers).
    pub subgroups: Option<usize>,
    /// Largest datagram, header included.
    pub datagram: usize,
    /// Largest message.
    pub max_message: usize,
    /// Retransmission timeout before any RTT sample.
    pub rto_initial: Duration,
    /// Lower bound of the retransmission timeout.
    pub rto_min: Duration,
    /// Upper bound of the retransmission timeout.
    pub rto_max: Duration,
    /// Re-ping period of the group test.
    pub ping_interval: Duration,
    /// How long the group test may take before the group is declared unusable (point-to-point
    /// from then on).
    pub confirm_timeout: Duration,
    /// First sequence number of every stream (tests start near the wrap-around).
    pub first_seq: u32,
    /// False: never use the multicast transport (point-to-point only).
    pub multicast: bool,
}

impl Config {
    /// Defaults for rank `me` of `size`.
    pub fn new(me: Rank, size: u32) -> Config {
        Config {
            me,
            size,
            job: 0,
            channel: 0,
            window: 64,
            ack_every: 8,
            ack_delay: Duration::from_micros(200),
            subgroups: None,
            datagram: 1400,
            max_message: 4 << 20,
            rto_initial: Duration::from_millis(20),
            rto_min: Duration::from_millis(2),
            rto_max: Duration::from_millis(500),
            ping_interval: Duration::from_millis(20),
            confirm_timeout: Duration::from_secs(2),
            first_seq: 0,
            multicast: true,
        }
    }

    fn expect(&self) -> Expect {
        Expect {
            job: self.job,
            channel: self.channel,
            size: self.size,
            datagram: self.datagram,
            max_message: self.max_message,
        }
    }
}

/// Who acknowledges to whom in one root's stream.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The stream's root.
    pub root: Rank,
    /// The co-roots, in order.
    pub coroots: Vec<Rank>,
    /// `collector[r]`: the rank that collects `r`'s ACKs (the root for its own sub-group, which
    /// includes the co-roots).
    collector: Vec<Rank>,
}

impl Layout {
    /// The receivers (every rank but `root`, starting after it) are cut into `subgroups` chunks of
    /// nearly equal size. The first chunk is the root's and starts with the co-roots; chunk `j > 0`
    /// holds the leaves of co-root `j - 1`. So each collector handles the same number of senders.
    pub fn new(root: Rank, size: u32, subgroups: Option<usize>) -> Layout {
        let recv: Vec<Rank> = (1..size).map(|i| (root + i) % size).collect();
        let r = recv.len();
        let mut g = subgroups.unwrap_or_else(|| (r as f64).sqrt().round() as usize).clamp(1, r.max(1));
        // The root's chunk must hold the co-roots.
        while g > 1 && r.div_ceil(g) < g - 1 {
            g -= 1;
        }
        let sizes: Vec<usize> = (0..g).map(|i| r / g + usize::from(i < r % g)).collect();
        let coroots = recv[..g - 1].to_vec();
        let mut collector = vec![root; size as usize];
        let mut at = sizes.first().copied().unwrap_or(0);
        for j in 1..g {
            for &m in &recv[at..at + sizes[j]] {
                collector[m as usize] = coroots[j - 1];
            }
            at += sizes[j];
        }
        Layout { root, coroots, collector }
    }

    /// Number of sub-groups: the root's plus one per co-root.
    pub fn subgroups(&self) -> usize {
        self.coroots.len() + 1
    }

    /// Who collects `r`'s ACKs.
    pub fn collector_of(&self, r: Rank) -> Rank {
        self.collector[r as usize]
    }

    /// Whose ACKs `c` collects.
    pub fn members_of(&self, c: Rank) -> Vec<Rank> {
        (0..self.collector.len() as Rank)
            .filter(|&m| m != self.root && m != c && self.collector[m as usize] == c)
            .collect()
    }

    /// Whether `r` is a co-root of this stream.
    pub fn is_coroot(&self, r: Rank) -> bool {
        self.coroots.contains(&r)
    }
}

/// What the core wants sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transmit {
    /// One datagram to the multicast group.
    Multicast(Bytes),
    /// An encoded [`Control`] message to one rank, over reliable point-to-point.
    Unicast {
        /// The destination rank.
        to: Rank,
        /// The encoded message.
        msg: Bytes,
    },
}

/// What the core tells the application.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Messages of `root` are ready: [`McastCore::pop`].
    Ready {
        /// The stream's root.
        root: Rank,
    },
    /// Every live receiver has consumed this rank's messages below `upto`.
    DeliveredToAll {
        /// First sequence number not yet consumed by every live receiver.
        upto: u32,
    },
    /// The window has room again.
    WindowOpen,
    /// The multicast test succeeded: this rank's messages now go by multicast.
    GroupConfirmed,
    /// The multicast test never succeeded: this rank's messages go by point-to-point.
    GroupDegraded,
    /// `root` died: its stream ends once what arrived has been consumed.
    RootLost {
        /// The dead root.
        root: Rank,
    },
    /// Receiver `rank` died: it no longer holds up the window.
    ReceiverLost {
        /// The dead receiver.
        rank: Rank,
    },
    /// This rank reported to `root`'s stream that it consumed everything below `upto` (its whole
    /// sub-group, as a co-root): what [`McastCore::settled`] waits for.
    Acknowledged {
        /// The stream's root.
        root: Rank,
        /// First sequence number not reported.
        upto: u32,
    },
}

/// Why a send was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// [`Config::window`] messages are unacknowledged: wait for [`Event::WindowOpen`].
    #[error("the window is full")]
    WindowFull,
    /// The message exceeds [`Config::max_message`].
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The message's length.
        len: usize,
        /// [`Config::max_message`].
        max: usize,
    },
}

/// A control message that made no sense here (dropped and counted).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// A control message that did not decode.
    #[error(transparent)]
    Decode(#[from] ControlError),
    /// A datagram that did not pass its checks.
    #[error(transparent)]
    Datagram(#[from] DatagramError),
    /// A well-formed message that its sender's role does not send to this rank.
    #[error("{what} from rank {from} for root {root}, which it has no business sending here")]
    Unexpected {
        /// Which message.
        what: &'static str,
        /// The sender.
        from: Rank,
        /// The stream's root.
        root: Rank,
    },
    /// An ACK or report beyond the last message sent.
    #[error("acknowledgement from rank {from} of messages never sent")]
    AckBeyondSent {
        /// The acknowledging rank.
        from: Rank,
    },
    /// A reliable copy larger than [`Config::max_message`].
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The message's length.
        len: usize,
        /// [`Config::max_message`].
        max: usize,
    },
}

/// Counters; the driver publishes them as metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams sent to the multicast group (fragments and pings).
    pub datagrams_sent: u64,
    /// Reliable point-to-point copies sent by the root (to co-roots, or to everyone without the group).
    pub copies_sent: u64,
    /// ACKs and co-root reports received by this rank as a root.
    pub acks_at_root: u64,
    /// ACKs received by this rank as a co-root.
    pub acks_at_coroot: u64,
    /// ACKs and co-root reports sent.
    pub acks_sent: u64,
    /// NACKs sent.
    pub nacks_sent: u64,
    /// NACKs received.
    pub nacks_received: u64,
    /// Retransmissions sent (as root or co-root).
    pub retransmissions: u64,
    /// Retransmissions received for a message already here.
    pub false_retransmissions: u64,
    /// Times a send found the window full.
    pub window_stalls: u64,
    /// Tail probes multicast (when the window fills, and `ack_delay` after the last send).
    pub tail_probes: u64,
    /// Datagrams or copies of messages already complete.
    pub duplicates: u64,
    /// Data beyond the receive window (dropped).
    pub out_of_window: u64,
    /// Datagrams or control messages refused.
    pub malformed: u64,
    /// Datagrams the driver dropped before the core saw them: no valid tag of this job (the
    /// driver authenticates datagrams; see [`McastCore::refused_unauthenticated`]).
    pub unauthenticated: u64,
    /// 1 once the group test failed.
    pub groups_degraded: u64,
}

impl Stats {
    /// Adds what changed since `prev` to the `metrics` counters.
    pub fn publish(&self, prev: &Stats) {
        let c = |name: &'static str, now: u64, was: u64| {
            if now > was {
                metrics::counter!(name).increment(now - was);
            }
        };
        c("ferrocomm_mcast_datagrams_sent", self.datagrams_sent, prev.datagrams_sent);
        c("ferrocomm_mcast_copies_sent", self.copies_sent, prev.copies_sent);
        c("ferrocomm_mcast_acks_at_root", self.acks_at_root, prev.acks_at_root);
        c("ferrocomm_mcast_acks_at_coroot", self.acks_at_coroot, prev.acks_at_coroot);
        c("ferrocomm_mcast_nacks_sent", self.nacks_sent, prev.nacks_sent);
        c("ferrocomm_mcast_nacks_received", self.nacks_received, prev.nacks_received);
        c("ferrocomm_mcast_retransmissions", self.retransmissions, prev.retransmissions);
        c("ferrocomm_mcast_false_retransmissions", self.false_retransmissions, prev.false_retransmissions);
        c("ferrocomm_mcast_window_stalls", self.window_stalls, prev.window_stalls);
        c("ferrocomm_mcast_tail_probes", self.tail_probes, prev.tail_probes);
        c("ferrocomm_mcast_duplicates", self.duplicates, prev.duplicates);
        c("ferrocomm_mcast_malformed", self.malformed, prev.malformed);
        c("ferrocomm_mcast_datagrams_unauthenticated", self.unauthenticated, prev.unauthenticated);
        c("ferrocomm_mcast_groups_degraded", self.groups_degraded, prev.groups_degraded);
    }
}

/// Output shared by the roles.
#[derive(Default)]
struct Out {
    transmit: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: Stats,
}

impl Out {
    fn unicast(&mut self, to: Rank, c: Control) {
        match &c {
            Control::Ack { .. } | Control::Report { .. } => self.stats.acks_sent += 1,
            Control::Nack { .. } => self.stats.nacks_sent += 1,
            Control::Data { copy: false, .. } => self.stats.retransmissions += 1,
            Control::Data { copy: true, .. } => self.stats.copies_sent += 1,
            Control::PingAck { .. } => {}
        }
        self.transmit.push_back(Transmit::Unicast { to, msg: c.encode() });
    }
}

/// Jacobson/Karels RTT estimate.
#[derive(Clone, Debug)]
struct Rtt {
    srtt: Option<Duration>,
    rttvar: Duration,
    initial: Duration,
    min: Duration,
    max: Duration,
}

impl Rtt {
    fn sample(&mut self, s: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(s);
                self.rttvar = s / 2;
            }
            Some(srtt) => {
                let err = srtt.abs_diff(s);
                self.rttvar = (self.rttvar * 3 + err) / 4;
                self.srtt = Some((srtt * 7 + s) / 8);
            }
        }
    }

    fn rto(&self) -> Duration {
        match self.srtt {
            None => self.initial,
            Some(s) => (s + self.rttvar * 4).clamp(self.min, self.max),
        }
    }
}

struct Slot {
    data: Bytes,
    sent: Instant,
    retransmitted: bool,
}

struct Acker {
    rank: Rank,
    /// Everything below is acknowledged.
    acked: u32,
    /// Got its copy over reliable point-to-point: never retransmitted to.
    reliable: bool,
    alive: bool,
    /// When the retransmission timer of this acker started.
    since: Instant,
    backoff: u32,
    /// Messages a NACK asked for that the collector did not hold yet (a co-root whose own copy
    /// is still on its way): each goes out as soon as it comes. At most `2 * window` entries.
    wants: HashSet<u32>,
}

/// ACK collection and retransmission for one sub-group (the root's or a co-root's): the messages
/// not yet acknowledged by every member, and where each member stands.
struct Collector {
    /// The root's collector (the origin of the messages) rather than a co-root's.
    origin: bool,
    ackers: Vec<Acker>,
    index: HashMap<Rank, usize>,
    base: u32,
    store: VecDeque<Slot>,
    rtt: Rtt,
    /// The channel's window (bounds what a member may ask for ahead).
    window: usize,
}

/// How far a co-root's leaf may be acknowledged ahead of the co-root's own copies.
const MAX_LEAD: u32 = 1 << 20;

/// Messages retransmitted to one acker on its first timeout (more would mostly be false: the
/// member usually lacks only the oldest, and a NACK asks for gaps).
const TIMEOUT_BURST: u32 = 1;
/// Cap on the exponential back-off (2^6 RTO).
const MAX_BACKOFF: u32 = 6;

impl Collector {
    fn new(
        origin: bool,
        members: impl IntoIterator<Item = (Rank, bool)>,
        first: u32,
        cfg: &Config,
        now: Instant,
    ) -> Collector {
        let ackers: Vec<Acker> = members
            .into_iter()
            .map(|(rank, reliable)| Acker {
                rank,
                acked: first,
                reliable,
                alive: true,
                since: now,
                backoff: 0,
                wants: HashSet::new(),
            })
            .collect();
        let index = ackers.iter().enumerate().map(|(i, a)| (a.rank, i)).collect();
        let rtt =
            Rtt { srtt: None, rttvar: Duration::ZERO, initial: cfg.rto_initial, min: cfg.rto_min, max: cfg.rto_max };
        Collector { origin, ackers, index, base: first, store: VecDeque::new(), rtt, window: cfg.window }
    }

    fn next(&self) -> u32 {
        self.base.wrapping_add(self.store.len() as u32)
    }

    fn push(&mut self, data: Bytes, now: Instant, root: Rank, out: &mut Out) {
        let seq = self.next();
        let mut asked = Vec::new();
        for a in self.ackers.iter_mut().filter(|a| a.alive) {
            if a.acked == seq {
                a.since = now;
            }
            if a.wants.remove(&seq) && !before(seq, a.acked) {
                asked.push(a.rank);
            }
        }
        self.store.push_back(Slot { data, sent: now, retransmitted: false });
        for r in asked {
            self.retransmit(r, seq, root, out);
        }
    }

    fn slot(&mut self, seq: u32) -> Option<&mut Slot> {
        let i = dist(self.base, seq) as usize;
        if before(seq, self.base) { None } else { self.store.get_mut(i) }
    }

    /// `Ok(true)` if `from`'s position moved.
    fn on_ack(&mut self, from: Rank, upto: u32, now: Instant) -> Result<bool, ProtoError> {
        let next = self.next();
        let Some(&i) = self.index.get(&from) else { return Ok(false) };
        // At the root nothing can be acknowledged beyond what it sent. A co-root may lag its
        // leaves (they had the multicast before its own copy came), but by less than a window.
        if before(next, upto) && (self.origin || dist(next, upto) > MAX_LEAD) {
            return Err(ProtoError::AckBeyondSent { from });
        }
        let a = &self.ackers[i];
        if !a.alive || !before(a.acked, upto) {
            return Ok(false);
        }
        // Karn, over the whole acknowledged run: an ACK that waited for a retransmission of any
        // message it covers (the receiver consumes in order) measures the repair, not the round
        // trip, and would inflate the timeout that the repairs of tail losses wait for.
        let was = a.acked;
        let repaired = (0..dist(was, upto)).any(|k| self.slot(was.wrapping_add(k)).is_some_and(|s| s.retransmitted));
        if !repaired && let Some(s) = self.slot(upto.wrapping_sub(1)) {
            let sample = now.saturating_duration_since(s.sent);
            self.rtt.sample(sample);
        }
        let a = &mut self.ackers[i];
        a.acked = upto;
        a.since = now;
        a.backoff = 0;
        Ok(true)
    }

    /// Frees what every live member has; returns the new base if it moved.
    fn advance(&mut self) -> Option<u32> {
        let next = self.next();
        let low = self
            .ackers
            .iter()
            .filter(|a| a.alive)
            .map(|a| dist(self.base, a.acked).min(dist(self.base, next)))
            .min()
            .unwrap_or(dist(self.base, next));
        if low == 0 {
            return None;
        }
        self.store.drain(..low as usize);
        self.base = self.base.wrapping_add(low);
        Some(self.base)
    }

    fn deadline(&self) -> Option<Instant> {
        let next = self.next();
        let rto = self.rtt.rto();
        self.ackers
            .iter()
            .filter(|a| a.alive && !a.reliable && before(a.acked, next))
            .map(|a| a.since + (rto * (1 << a.backoff)).min(self.rtt.max * 4))
            .min()
    }

    fn retransmit(&mut self, to: Rank, seq: u32, root: Rank, out: &mut Out) {
        if let Some(s) = self.slot(seq) {
            s.retransmitted = true;
            let data = s.data.clone();
            out.unicast(to, Control::Data { root, seq, copy: false, data });
        }
    }

    fn on_timeout(&mut self, now: Instant, root: Rank, out: &mut Out) {
        let next = self.next();
        let rto = self.rtt.rto();
        let max = self.rtt.max * 4;
        let mut due = Vec::new();
        for a in self.ackers.iter_mut().filter(|a| a.alive && !a.reliable && before(a.acked, next)) {
            if now >= a.since + (rto * (1 << a.backoff)).min(max) {
                // After the first timeout, one message probes: the member may just be asleep.
                let burst = if a.backoff == 0 { TIMEOUT_BURST } else { 1 };
                due.push((a.rank, a.acked, burst));
                a.since = now;
                a.backoff = (a.backoff + 1).min(MAX_BACKOFF);
            }
        }
        for (rank, from, burst) in due {
            for i in 0..burst.min(dist(from, next)) {
                self.retransmit(rank, from.wrapping_add(i), root, out);
            }
        }
    }

    fn on_nack(&mut self, from_rank: Rank, from: u32, to: u32, now: Instant, root: Rank, out: &mut Out) {
        let Some(&i) = self.index.get(&from_rank) else { return };
        let next = self.next();
        let start = if before(from, self.base) { self.base } else { from };
        let end = if before(next, to) { next } else { to };
        let n = if before(start, end) { dist(start, end).min(self.store.len() as u32) } else { 0 };
        for k in 0..n {
            self.retransmit(from_rank, start.wrapping_add(k), root, out);
        }
        if n > 0 {
            self.ackers[i].since = now;
        }
        // What this collector lacks yet goes out when it comes (a co-root only: the root holds
        // everything it sent).
        let a = &mut self.ackers[i];
        if !self.origin && before(next, to) {
            let start = if before(start, next) { next } else { start };
            let cap = 2 * self.window;
            a.wants.retain(|&k| !before(k, a.acked));
            for k in 0..dist(start, to).min(cap as u32) {
                if a.wants.len() >= cap {
                    break;
                }
                a.wants.insert(start.wrapping_add(k));
            }
        }
    }

    /// Marks `r` dead; returns where it stood if it was a live member.
    fn lost(&mut self, r: Rank) -> Option<u32> {
        let i = *self.index.get(&r)?;
        let a = &mut self.ackers[i];
        if !a.alive {
            return None;
        }
        a.alive = false;
        Some(a.acked)
    }

    fn adopt(&mut self, rank: Rank, acked: u32, now: Instant) {
        if self.index.contains_key(&rank) {
            return;
        }
        let acked = if before(acked, self.base) { self.base } else { acked };
        self.index.insert(rank, self.ackers.len());
        self.ackers.push(Acker {
            rank,
            acked,
            reliable: false,
            alive: true,
            since: now,
            backoff: 0,
            wants: HashSet::new(),
        });
    }
}

enum Mode {
    /// Group test running: pinging, messages go point-to-point.
    Testing { started: Instant, last_ping: Option<Instant>, answered: Vec<bool> },
    /// The group works.
    Multicast,
    /// Point-to-point only (test failed or multicast disabled).
    PointToPoint,
}

/// Rank `me` as the root of its own stream.
pub struct RootSender {
    layout: Layout,
    collector: Collector,
    mode: Mode,
    alive: Vec<bool>,
    stalled: bool,
    window: usize,
    /// When to send a tail probe if nothing is sent meanwhile (`ack_delay` after the last send).
    probe_at: Option<Instant>,
}

const PING_NONCE: u32 = 0x5049_4e47;

impl RootSender {
    fn new(cfg: &Config, now: Instant) -> RootSender {
        let layout = Layout::new(cfg.me, cfg.size, cfg.subgroups);
        let members = layout.members_of(cfg.me).into_iter().map(|m| (m, layout.is_coroot(m)));
        let collector = Collector::new(true, members, cfg.first_seq, cfg, now);
        let mode = if !cfg.multicast {
            Mode::PointToPoint
        } else if cfg.size <= 1 {
            Mode::Multicast
        } else {
            Mode::Testing { started: now, last_ping: None, answered: vec![false; cfg.size as usize] }
        };
        RootSender {
            layout,
            collector,
            mode,
            alive: vec![true; cfg.size as usize],
            stalled: false,
            window: cfg.window,
            probe_at: None,
        }
    }

    fn receivers(&self) -> impl Iterator<Item = Rank> + '_ {
        let root = self.layout.root;
        (0..self.alive.len() as Rank).filter(move |&r| r != root && self.alive[r as usize])
    }

    fn send(&mut self, cfg: &Config, now: Instant, data: Bytes, out: &mut Out) -> Result<u32, SendError> {
        if data.len() > cfg.max_message {
            return Err(SendError::TooLarge { len: data.len(), max: cfg.max_message });
        }
        if self.collector.store.len() >= cfg.window {
            if !self.stalled {
                self.stalled = true;
                out.stats.window_stalls += 1;
                // Nothing more comes until ACKs free the window: say where the stream ends, so
                // that a receiver that lost its last datagrams asks for them now.
                self.probe(cfg, out);
            }
            return Err(SendError::WindowFull);
        }
        let seq = self.collector.next();
        self.probe_at = Some(now + cfg.ack_delay);
        self.collector.push(data.clone(), now, cfg.me, out);
        let root = cfg.me;
        let copy = |out: &mut Out, to| out.unicast(to, Control::Data { root, seq, copy: true, data: data.clone() });
        if let Mode::Multicast = self.mode {
            for d in wire::encode_data(cfg.job, cfg.channel, root, seq, &data, cfg.datagram) {
                out.stats.datagrams_sent += 1;
                out.transmit.push_back(Transmit::Multicast(d));
            }
            for &c in self.layout.coroots.iter().filter(|&&c| self.alive[c as usize]) {
                copy(out, c);
            }
        } else {
            let all: Vec<Rank> = self.receivers().collect();
            for r in all {
                copy(out, r);
            }
        }
        if self.collector.ackers.iter().all(|a| !a.alive) {
            self.advanced(out);
        }
        Ok(seq)
    }

    /// Multicasts a tail probe (the next sequence number), if messages are unacknowledged.
    fn probe(&mut self, cfg: &Config, out: &mut Out) {
        self.probe_at = None;
        if matches!(self.mode, Mode::Multicast) && !self.collector.store.is_empty() {
            out.stats.datagrams_sent += 1;
            out.stats.tail_probes += 1;
            let next = self.collector.next();
            out.transmit.push_back(Transmit::Multicast(wire::encode_tail(cfg.job, cfg.channel, cfg.me, next)));
        }
    }

    fn advanced(&mut self, out: &mut Out) {
        if let Some(upto) = self.collector.advance() {
            out.events.push_back(Event::DeliveredToAll { upto });
        }
        if self.stalled && self.collector.store.len() < self.window {
            self.stalled = false;
            out.events.push_back(Event::WindowOpen);
        }
    }

    fn on_ack(&mut self, from: Rank, upto: u32, now: Instant, out: &mut Out) -> Result<(), ProtoError> {
        out.stats.acks_at_root += 1;
        if self.collector.on_ack(from, upto, now)? {
            self.advanced(out);
        }
        Ok(())
    }

    fn on_ping_ack(&mut self, from: Rank, nonce: u32, out: &mut Out) {
        if let Mode::Testing { answered, .. } = &mut self.mode
            && nonce == PING_NONCE
        {
            answered[from as usize] = true;
            self.check_confirmed(out);
        }
    }

    fn check_confirmed(&mut self, out: &mut Out) {
        if let Mode::Testing { answered, .. } = &self.mode {
            let root = self.layout.root;
            let all = (0..answered.len()).all(|r| r as Rank == root || answered[r] || !self.alive[r]);
            if all {
                tracing::debug!(root, "multicast group confirmed");
                self.mode = Mode::Multicast;
                out.events.push_back(Event::GroupConfirmed);
            }
        }
    }

    fn deadline(&self, cfg: &Config) -> Option<Instant> {
        let ping = match &self.mode {
            Mode::Testing { last_ping: None, started, .. } => Some(*started),
            Mode::Testing { last_ping: Some(t), .. } => Some(*t + cfg.ping_interval),
            _ => None,
        };
        let probe = self.probe_at.filter(|_| !self.collector.store.is_empty());
        [ping, probe, self.collector.deadline()].into_iter().flatten().min()
    }

    fn on_timeout(&mut self, cfg: &Config, now: Instant, out: &mut Out) {
        if let Mode::Testing { started, last_ping, .. } = &mut self.mode
            && last_ping.is_none_or(|t| now >= t + cfg.ping_interval)
        {
            if now >= *started + cfg.confirm_timeout {
                tracing::warn!(
                    root = cfg.me,
                    channel = cfg.channel,
                    "multicast group not confirmed within {:?}: using point-to-point",
                    cfg.confirm_timeout
                );
                out.stats.groups_degraded += 1;
                self.mode = Mode::PointToPoint;
                out.events.push_back(Event::GroupDegraded);
            } else {
                *last_ping = Some(now);
                out.stats.datagrams_sent += 1;
                out.transmit.push_back(Transmit::Multicast(wire::encode_ping(
                    cfg.job,
                    cfg.channel,
                    cfg.me,
                    PING_NONCE,
                )));
            }
        }
        if self.probe_at.is_some_and(|t| now >= t) {
            self.probe(cfg, out);
        }
        self.collector.on_timeout(now, cfg.me, out);
    }

    fn lost(&mut self, r: Rank, now: Instant, out: &mut Out) {
        if r == self.layout.root || !std::mem::replace(&mut self.alive[r as usize], false) {
            return;
        }
        out.events.push_back(Event::ReceiverLost { rank: r });
        if let Some(acked) = self.collector.lost(r)
            && self.layout.is_coroot(r)
        {
            // Its leaves acknowledge to the root from now on; they stand at least where the
            // co-root's last report said.
            for leaf in self.layout.members_of(r) {
                if self.alive[leaf as usize] {
                    self.collector.adopt(leaf, acked, now);
                }
            }
        }
        self.check_confirmed(out);
        self.advanced(out);
    }
}

enum Part {
    Partial { len: usize, have: u16, got: Vec<bool>, buf: BytesMut },
    Done(Bytes),
}

/// A co-root's extra duties for one stream.
struct CoRoot {
    collector: Collector,
}

/// A receiver's last NACK: what it asked for, and how long it holds off asking again.
#[derive(Clone, Copy, Debug)]
struct Nacked {
    /// Everything below this was asked for (what is missing of it).
    upto: u32,
    at: Instant,
    /// The receiver's next in-order message when it asked.
    next: u32,
    /// Asked again without progress this many times in a row: each doubles the hold, so that a
    /// repair slower than the initial RTO (a slow or loaded path) is not asked for over and over
    /// while it is on its way, each time costing the collector a retransmission.
    backoff: u32,
}

impl Nacked {
    fn hold(&self, cfg: &Config) -> Duration {
        (cfg.rto_initial * (1 << self.backoff)).min(cfg.rto_max)
    }
}

/// Rank `me` receiving the stream of one other root, as a leaf or a co-root.
pub struct Receiver {
    root: Rank,
    /// Next message to complete in order.
    next: u32,
    /// Next message the application will take; everything below is acknowledged (eventually).
    consumed: u32,
    ready: VecDeque<Bytes>,
    parts: HashMap<u32, Part>,
    /// Who collects this rank's ACKs.
    target: Rank,
    acked: u32,
    ack_since: Option<Instant>,
    nacked: Option<Nacked>,
    coroot: Option<CoRoot>,
    root_lost: bool,
}

impl Receiver {
    /// The receiver of `root`'s stream, made after the ranks in `lost` were reported lost: with
    /// nothing of the stream received yet, their loss needs no message (nothing to acknowledge).
    fn new(cfg: &Config, root: Rank, now: Instant, lost: &BTreeSet<Rank>) -> Receiver {
        let layout = Layout::new(root, cfg.size, cfg.subgroups);
        let mut coroot = layout.is_coroot(cfg.me).then(|| CoRoot {
            collector: Collector::new(
                false,
                layout.members_of(cfg.me).into_iter().map(|m| (m, false)),
                cfg.first_seq,
                cfg,
                now,
            ),
        });
        if let Some(c) = &mut coroot {
            lost.iter().for_each(|&r| _ = c.collector.lost(r));
        }
        let mut target = layout.collector_of(cfg.me);
        if lost.contains(&target) {
            target = root;
        }
        Receiver {
            root,
            next: cfg.first_seq,
            consumed: cfg.first_seq,
            ready: VecDeque::new(),
            parts: HashMap::new(),
            target,
            acked: cfg.first_seq,
            ack_since: None,
            nacked: None,
            coroot,
            root_lost: false,
        }
    }

    fn in_window(&self, cfg: &Config, seq: u32, out: &mut Out) -> bool {
        if before(seq, self.next) {
            out.stats.duplicates += 1;
            false
        } else if dist(self.consumed, seq) as usize >= cfg.window {
            out.stats.out_of_window += 1;
            false
        } else {
            true
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_fragment(
        &mut self,
        cfg: &Config,
        seq: u32,
        len: usize,
        frag: u16,
        frags: u16,
        payload: Bytes,
        now: Instant,
        out: &mut Out,
    ) -> Result<(), ProtoError> {
        if !self.in_window(cfg, seq, out) {
            return Ok(());
        }
        // A message of one datagram is its payload (the decoder checked that the lengths agree):
        // no reassembly buffer, no copy.
        if frags == 1 && payload.len() == len && !self.parts.contains_key(&seq) {
            self.parts.insert(seq, Part::Done(payload));
            self.deliver(now, out);
            self.check_gap(cfg, seq, now, out);
            return Ok(());
        }
        let part = self.parts.entry(seq).or_insert_with(|| Part::Partial {
            len,
            have: 0,
            got: vec![false; frags as usize],
            buf: BytesMut::zeroed(len),
        });
        match part {
            Part::Done(_) => out.stats.duplicates += 1,
            Part::Partial { len: l, .. } if *l != len => {
                return Err(DatagramError::Inconsistent("fragments of one message disagree on its length").into());
            }
            Part::Partial { have, got, buf, .. } => {
                if got[frag as usize] {
                    out.stats.duplicates += 1;
                } else {
                    got[frag as usize] = true;
                    *have += 1;
                    let at = frag as usize * wire::fragment_payload(cfg.datagram);
                    buf[at..at + payload.len()].copy_from_slice(&payload);
                    if *have == frags {
                        let data = std::mem::take(buf).freeze();
                        *part = Part::Done(data);
                    }
                }
            }
        }
        self.deliver(now, out);
        self.check_gap(cfg, seq, now, out);
        Ok(())
    }

    fn on_data(&mut self, cfg: &Config, seq: u32, copy: bool, data: Bytes, now: Instant, out: &mut Out) {
        if before(seq, self.next) || matches!(self.parts.get(&seq), Some(Part::Done(_))) {
            out.stats.duplicates += 1;
            if !copy {
                out.stats.false_retransmissions += 1;
                // The sender thinks this rank lacks it: say at once how far it is (even if that
                // was said before: the sender may not have been able to take it then).
                self.send_ack(out);
            }
            return;
        }
        if !self.in_window(cfg, seq, out) {
            return;
        }
        self.parts.insert(seq, Part::Done(data));
        self.deliver(now, out);
        self.check_gap(cfg, seq, now, out);
    }

    fn deliver(&mut self, now: Instant, out: &mut Out) {
        let mut any = false;
        while let Some(Part::Done(_)) = self.parts.get(&self.next) {
            let Some(Part::Done(data)) = self.parts.remove(&self.next) else { unreachable!() };
            if let Some(c) = &mut self.coroot {
                c.collector.push(data.clone(), now, self.root, out);
                // Without live leaves the sub-group is complete at once.
                c.collector.advance();
            }
            self.ready.push_back(data);
            self.next = self.next.wrapping_add(1);
            any = true;
        }
        if any {
            out.events.push_back(Event::Ready { root: self.root });
        }
    }

    /// Something at `seq` arrived (or a tail probe says the root sent everything below `seq`)
    /// while `self.next` is incomplete: datagrams of one root come in order, so whatever below
    /// `seq` is incomplete lost a datagram. Each missing run is asked for at once, once (again
    /// after the initial RTO, doubled for each NACK in a row that brought nothing: the answer may
    /// be on its way).
    /// A co-root never asks: the root sends it every message over reliable, ordered
    /// point-to-point, so whatever it lacks below a later arrival is already on its way (its
    /// multicast copy merely came first), and a NACK would only make the root send it twice.
    fn check_gap(&mut self, cfg: &Config, seq: u32, now: Instant, out: &mut Out) {
        if !before(self.next, seq) || self.coroot.is_some() {
            return;
        }
        // Nothing beyond the receive window can be kept, so nothing beyond it is asked for.
        let limit = self.consumed.wrapping_add(cfg.window as u32);
        let seq = if before(limit, seq) { limit } else { seq };
        // What was asked for recently is not asked again; only what lies beyond it.
        let mut from = self.next;
        if let Some(n) = self.nacked
            && now < n.at + n.hold(cfg)
            && before(self.next, n.upto)
        {
            if !before(n.upto, seq) {
                return;
            }
            from = n.upto;
        }
        let mut k = from;
        let mut asked = false;
        while before(k, seq) {
            if matches!(self.parts.get(&k), Some(Part::Done(_))) {
                k = k.wrapping_add(1);
                continue;
            }
            let start = k;
            while before(k, seq) && !matches!(self.parts.get(&k), Some(Part::Done(_))) {
                k = k.wrapping_add(1);
            }
            out.unicast(self.target, Control::Nack { root: self.root, from: start, to: k });
            asked = true;
        }
        if asked {
            let backoff = match self.nacked {
                // The same gap asked for again, nothing completed since: wait longer next time.
                Some(n) if n.next == self.next && from == self.next => (n.backoff + 1).min(MAX_BACKOFF),
                // Only what lies beyond the last NACK: that one's back-off stands.
                Some(n) if n.next == self.next => n.backoff,
                _ => 0,
            };
            self.nacked = Some(Nacked { upto: seq, at: now, next: self.next, backoff });
        }
    }

    /// A tail probe: the root has sent everything below `next`.
    fn on_tail(&mut self, cfg: &Config, next: u32, now: Instant, out: &mut Out) {
        self.check_gap(cfg, next, now, out);
    }

    fn pop(&mut self, cfg: &Config, now: Instant, out: &mut Out) -> Option<Bytes> {
        let m = self.ready.pop_front()?;
        self.consumed = self.consumed.wrapping_add(1);
        self.maybe_ack(cfg, now, out);
        Some(m)
    }

    /// The position this rank reports: for a co-root, its whole sub-group's.
    fn position(&self) -> u32 {
        match &self.coroot {
            Some(c) if before(c.collector.base, self.consumed) => c.collector.base,
            _ => self.consumed,
        }
    }

    fn send_ack(&mut self, out: &mut Out) {
        let upto = self.position();
        let c = if self.coroot.is_some() && self.target == self.root {
            Control::Report { root: self.root, upto }
        } else {
            Control::Ack { root: self.root, upto }
        };
        out.unicast(self.target, c);
        out.events.push_back(Event::Acknowledged { root: self.root, upto });
        self.acked = upto;
        self.ack_since = None;
    }

    fn maybe_ack(&mut self, cfg: &Config, now: Instant, out: &mut Out) {
        let pending = dist(self.acked, self.position());
        if pending >= cfg.ack_every {
            self.send_ack(out);
        } else if pending > 0 && self.ack_since.is_none() {
            self.ack_since = Some(now);
        }
    }

    fn deadline(&self, cfg: &Config) -> Option<Instant> {
        let ack = self.ack_since.map(|t| t + cfg.ack_delay);
        let retx = self.coroot.as_ref().and_then(|c| c.collector.deadline());
        [ack, retx].into_iter().flatten().min()
    }

    fn on_timeout(&mut self, cfg: &Config, now: Instant, out: &mut Out) {
        if self.ack_since.is_some_and(|t| now >= t + cfg.ack_delay) {
            self.send_ack(out);
        }
        if let Some(c) = &mut self.coroot {
            c.collector.on_timeout(now, self.root, out);
        }
    }

    fn on_leaf_ack(
        &mut self,
        cfg: &Config,
        from: Rank,
        upto: u32,
        now: Instant,
        out: &mut Out,
    ) -> Result<(), ProtoError> {
        let Some(c) = &mut self.coroot else {
            return Err(ProtoError::Unexpected { what: "ACK", from, root: self.root });
        };
        out.stats.acks_at_coroot += 1;
        if c.collector.on_ack(from, upto, now)? {
            c.collector.advance();
            self.maybe_ack(cfg, now, out);
        }
        Ok(())
    }

    fn on_nack(&mut self, from: Rank, a: u32, b: u32, now: Instant, out: &mut Out) -> Result<(), ProtoError> {
        let Some(c) = &mut self.coroot else {
            return Err(ProtoError::Unexpected { what: "NACK", from, root: self.root });
        };
        out.stats.nacks_received += 1;
        c.collector.on_nack(from, a, b, now, self.root, out);
        Ok(())
    }

    fn lost(&mut self, cfg: &Config, r: Rank, now: Instant, out: &mut Out) {
        if r == self.root {
            if !self.root_lost {
                self.root_lost = true;
                self.parts.clear();
                out.events.push_back(Event::RootLost { root: r });
            }
            return;
        }
        if r == self.target {
            // Our co-root died: the root collects from us now, and must learn where we stand.
            self.target = self.root;
            self.send_ack(out);
        }
        if let Some(c) = &mut self.coroot
            && c.collector.lost(r).is_some()
        {
            c.collector.advance();
            self.maybe_ack(cfg, now, out);
        }
    }
}

/// Every role of one rank on one channel.
///
/// The receiver of another root's stream is made when something of that stream first arrives
/// (or the root is lost): a rank of a large job keeps state only for the roots that send, and
/// making a receiver costs a pass over the ranks (its ACK layout), which for every root at once
/// would be quadratic in the job's size per rank.
pub struct McastCore {
    cfg: Config,
    expect: Expect,
    root: RootSender,
    /// By root, in rank order (`pop_any` takes the lowest first).
    receivers: BTreeMap<Rank, Receiver>,
    /// Ranks reported lost, for receivers made later.
    lost: BTreeSet<Rank>,
    out: Out,
}

impl McastCore {
    /// The core of rank `cfg.me`, starting the group test at `now`.
    pub fn new(cfg: Config, now: Instant) -> McastCore {
        let root = RootSender::new(&cfg, now);
        McastCore {
            expect: cfg.expect(),
            cfg,
            root,
            receivers: BTreeMap::new(),
            lost: BTreeSet::new(),
            out: Out::default(),
        }
    }

    /// The receiver of `root`'s stream (another rank of the channel), made on first use.
    fn receiver(&mut self, root: Rank, now: Instant) -> &mut Receiver {
        debug_assert!(root < self.cfg.size && root != self.cfg.me);
        let (cfg, lost) = (&self.cfg, &self.lost);
        self.receivers.entry(root).or_insert_with(|| Receiver::new(cfg, root, now, lost))
    }

    /// The parameters it was made with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Its counters.
    pub fn stats(&self) -> &Stats {
        &self.out.stats
    }

    /// Counts a datagram the driver dropped because its tag did not verify.
    pub fn refused_unauthenticated(&mut self) {
        self.out.stats.unauthenticated += 1;
    }

    /// The ACK layout of this rank's stream.
    pub fn layout(&self) -> &Layout {
        &self.root.layout
    }

    /// True once this rank's messages go by multicast.
    pub fn confirmed(&self) -> bool {
        matches!(self.root.mode, Mode::Multicast)
    }

    /// True once the group test has failed for good.
    pub fn degraded(&self) -> bool {
        matches!(self.root.mode, Mode::PointToPoint)
    }

    /// Messages this rank has sent that some live receiver has not consumed yet.
    pub fn in_flight(&self) -> usize {
        self.root.collector.store.len()
    }

    /// True once this rank owes the other roots nothing: it has acknowledged everything it
    /// consumed, as a co-root with its sub-group. A rank must not leave before (nor before
    /// [`McastCore::in_flight`] is 0): the others would learn nothing more from it, and a root
    /// that hears of its departure drops its datagrams still on the way.
    pub fn settled(&self) -> bool {
        self.receivers.values().all(|r| r.root_lost || r.acked == r.consumed)
    }

    /// Sequence number the next message of this rank will get.
    pub fn next_seq(&self) -> u32 {
        self.root.collector.next()
    }

    /// Puts `data` into the window and sends it. [`SendError::WindowFull`]: wait for
    /// [`Event::WindowOpen`].
    pub fn send(&mut self, now: Instant, data: Bytes) -> Result<u32, SendError> {
        self.root.send(&self.cfg, now, data, &mut self.out)
    }

    /// The next message of `root`, in order. `Err(())`: the root died and nothing more will come.
    #[allow(clippy::result_unit_err)]
    pub fn pop(&mut self, root: Rank, now: Instant) -> Result<Option<Bytes>, ()> {
        let Some(r) = self.receivers.get_mut(&root) else { return Ok(None) };
        match r.pop(&self.cfg, now, &mut self.out) {
            Some(m) => Ok(Some(m)),
            None if r.root_lost => Err(()),
            None => Ok(None),
        }
    }

    /// The next message from any root (lowest rank first).
    pub fn pop_any(&mut self, now: Instant) -> Option<(Rank, Bytes)> {
        let root = self.receivers.values().find(|r| !r.ready.is_empty())?.root;
        self.pop(root, now).ok().flatten().map(|m| (root, m))
    }

    /// A datagram from the multicast group.
    pub fn handle_datagram(&mut self, now: Instant, d: Bytes) -> Result<(), ProtoError> {
        let r = self.datagram(now, d);
        if let Err(e) = &r
            && !matches!(e, ProtoError::Datagram(DatagramError::OtherChannel(_)))
        {
            self.out.stats.malformed += 1;
        }
        r
    }

    fn datagram(&mut self, now: Instant, d: Bytes) -> Result<(), ProtoError> {
        match wire::decode(d, &self.expect)? {
            // Our own datagrams come back (IP_MULTICAST_LOOP).
            Datagram::Data { root, .. } | Datagram::Ping { root, .. } | Datagram::Tail { root, .. }
                if root == self.cfg.me =>
            {
                Ok(())
            }
            Datagram::Tail { root, next } => {
                // Only a stream this rank has heard of: one whose first datagrams were all lost
                // is repaired by the collector's timeout.
                if let Some(r) = self.receivers.get_mut(&root)
                    && !r.root_lost
                {
                    r.on_tail(&self.cfg, next, now, &mut self.out);
                }
                Ok(())
            }
            Datagram::Ping { root, nonce } => {
                self.out.unicast(root, Control::PingAck { root, nonce });
                Ok(())
            }
            Datagram::Data { root, seq, len, frag, frags, payload } => {
                self.receiver(root, now);
                let r = self.receivers.get_mut(&root).expect("just made");
                if r.root_lost {
                    return Ok(());
                }
                r.on_fragment(&self.cfg, seq, len as usize, frag, frags, payload, now, &mut self.out)
            }
        }
    }

    /// A control message from rank `from` over point-to-point.
    pub fn handle_control(&mut self, now: Instant, from: Rank, msg: Bytes) -> Result<(), ProtoError> {
        let r = self.control(now, from, msg);
        if r.is_err() {
            self.out.stats.malformed += 1;
        }
        r
    }

    fn control(&mut self, now: Instant, from: Rank, msg: Bytes) -> Result<(), ProtoError> {
        let me = self.cfg.me;
        let c = Control::decode(msg, self.cfg.size)?;
        match c {
            Control::Ack { root, upto } | Control::Report { root, upto } if root == me => {
                self.root.on_ack(from, upto, now, &mut self.out)
            }
            Control::Nack { root, from: a, to: b } if root == me => {
                self.out.stats.nacks_received += 1;
                self.root.collector.on_nack(from, a, b, now, me, &mut self.out);
                Ok(())
            }
            Control::PingAck { root, nonce } if root == me => {
                self.root.on_ping_ack(from, nonce, &mut self.out);
                Ok(())
            }
            // A leaf may be ahead of its co-root: its ACK or NACK can come first.
            Control::Ack { root, upto } => {
                self.receiver(root, now);
                let (cfg, out) = (&self.cfg, &mut self.out);
                let r = self.receivers.get_mut(&root).expect("just made");
                r.on_leaf_ack(cfg, from, upto, now, out)
            }
            Control::Nack { root, from: a, to: b } => {
                self.receiver(root, now);
                let r = self.receivers.get_mut(&root).expect("just made");
                r.on_nack(from, a, b, now, &mut self.out)
            }
            Control::Data { root, seq, copy, data } if root != me && (from == root || !copy) => {
                if data.len() > self.cfg.max_message {
                    return Err(ProtoError::TooLarge { len: data.len(), max: self.cfg.max_message });
                }
                self.receiver(root, now);
                let cfg = &self.cfg;
                let r = self.receivers.get_mut(&root).expect("just made");
                if !r.root_lost {
                    r.on_data(cfg, seq, copy, data, now, &mut self.out);
                }
                Ok(())
            }
            Control::Report { root, .. } => Err(ProtoError::Unexpected { what: "report", from, root }),
            Control::PingAck { root, .. } => Err(ProtoError::Unexpected { what: "ping answer", from, root }),
            Control::Data { root, .. } => Err(ProtoError::Unexpected { what: "data", from, root }),
        }
    }

    /// Rank `r` is gone (its point-to-point connection failed).
    pub fn peer_lost(&mut self, now: Instant, r: Rank) {
        if r >= self.cfg.size || r == self.cfg.me {
            return;
        }
        self.lost.insert(r);
        // Its own stream ends whether or not anything of it came: made now, it reports that.
        self.receiver(r, now);
        self.root.lost(r, now, &mut self.out);
        for rec in self.receivers.values_mut() {
            rec.lost(&self.cfg, r, now, &mut self.out);
        }
    }

    /// When [`McastCore::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let rec = self.receivers.values().filter_map(|r| r.deadline(&self.cfg)).min();
        [self.root.deadline(&self.cfg), rec].into_iter().flatten().min()
    }

    /// Runs the timers due at `now` (ACK delay, retransmission, pings).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.root.on_timeout(&self.cfg, now, &mut self.out);
        for r in self.receivers.values_mut() {
            r.on_timeout(&self.cfg, now, &mut self.out);
        }
    }

    /// The next datagram or control message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmit.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.out.events.pop_front()
    }

    /// True if `root`'s stream has messages waiting to be popped.
    pub fn has_ready(&self, root: Rank) -> bool {
        self.receivers.get(&root).is_some_and(|r| !r.ready.is_empty())
    }

    /// True if `root` died (its stream may still hold messages).
    pub fn root_lost(&self, root: Rank) -> bool {
        self.receivers.get(&root).is_some_and(|r| r.root_lost)
    }

    /// Messages (complete or partial) this rank holds for `root` beyond what the application took.
    pub fn buffered(&self, root: Rank) -> usize {
        self.receivers.get(&root).map_or(0, |r| r.ready.len() + r.parts.len())
    }
}

#[cfg(test)]
mod tests;
