//! Reliable multicast on the simulated network: each rank's [`McastCore`] gets the simulated
//! datagram path as its multicast group and its [`Node`] as the reliable point-to-point half, as
//! the facade's channel driver (`src/multicast.rs`) gives it a UDP group and a communicator: one
//! wildcard receive with the protocol's tag, re-posted after each message; a receive failing with
//! `PeerLost` tells the core that rank is gone, and when the loss revoked the channel's context
//! (every rank's loss does: the context is a communicator of the whole job) the channel ends, as
//! the facade's channel ends with its revoked communicator.
//!
//! The core takes time as an [`Instant`]; here that is one fixed origin plus the virtual time,
//! so the run depends on nothing but the seed.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::Error;
use ferrocomm::p2p::engine::Completion;
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm_multicast::{Config, Event, McastCore, SendError, Transmit};
use ferrocomm_transports::Rank;
use ferrocomm_transports::sim::{SimDatagrams, SimNet, Time};

use crate::cluster::{Node, OpKey, Process};

/// The context of the protocol's point-to-point messages (the channel's private communicator).
pub const CONTEXT: u32 = 0x4d43_0001;
/// Their tag (as `src/multicast.rs`).
pub const TAG: u64 = 0x6d63;
/// The multicast group of the channel on the simulated network.
pub const GROUP: u32 = 1;

/// One rank of a multicast channel: sends its `outbox` as a root, reads every root's messages.
pub struct McastRank {
    node: Node,
    core: McastCore,
    group: SimDatagrams,
    origin: Instant,
    outbox: VecDeque<Bytes>,
    /// Send only once the group test is over (so that messages go by multicast, not by the
    /// point-to-point fallback of an unconfirmed group).
    wait_for_group: bool,
    recv: Option<OpKey>,
    /// Messages read, with their root, in the order the application took them.
    pub got: Vec<(Rank, Bytes)>,
    /// How many messages this rank must read before it is done.
    pub expect: usize,
    /// When the group test ended at this root.
    pub confirmed_at: Option<Time>,
    /// When this root's first message went out.
    pub first_send_at: Option<Time>,
    /// When the last expected message was read here.
    pub read_all_at: Option<Time>,
    /// When this root's last message was acknowledged by every receiver (its window empty).
    pub acked_at: Option<Time>,
    /// Core errors (refused datagrams or control messages) and failed operations.
    pub errors: Vec<String>,
    /// Why the channel ended: a loss revoked its context (as the facade's channel ends with its
    /// revoked communicator). Nothing more is sent or read.
    pub ended: Option<String>,
    /// Share of received datagrams this rank drops before its core sees them, as the facade's
    /// `FERROCOMM_MCAST_TEST_DROP` does in its driver (the link's loss applies to frames too).
    drop: f64,
    /// The drop's generator (xorshift, seeded by [`McastRank::with_drop`]).
    drop_rng: u64,
}

impl McastRank {
    /// Rank `node.rank` of a channel whose every rank uses `cfg` (its `me` is set here). Only
    /// ranks with something to send run the group test (`cfg.multicast` is on for them alone):
    /// the test's ping answers are one point-to-point message per receiver and root.
    pub fn new(node: Node, net: &SimNet, origin: Instant, cfg: Config, outbox: Vec<Bytes>, expect: usize) -> McastRank {
        let me = node.rank;
        let multicast = cfg.multicast && !outbox.is_empty();
        let core = McastCore::new(Config { me, multicast, ..cfg }, origin);
        McastRank {
            group: net.join(me, GROUP),
            node,
            core,
            origin,
            outbox: outbox.into(),
            wait_for_group: multicast,
            recv: None,
            got: Vec::new(),
            expect,
            confirmed_at: None,
            first_send_at: None,
            read_all_at: None,
            acked_at: None,
            ended: None,
            errors: Vec::new(),
            drop: 0.0,
            drop_rng: 1,
        }
    }

    /// The rank, dropping `share` of the datagrams it receives (seeded by `seed`).
    pub fn with_drop(self, share: f64, seed: u64) -> McastRank {
        McastRank { drop: share, drop_rng: seed | 1, ..self }
    }

    fn drop_datagram(&mut self) -> bool {
        if self.drop <= 0.0 {
            return false;
        }
        let mut x = self.drop_rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.drop_rng = x;
        ((x >> 11) as f64 / (1u64 << 53) as f64) < self.drop
    }

    /// Its protocol core.
    pub fn core(&self) -> &McastCore {
        &self.core
    }

    fn at(&self, now: Time) -> Instant {
        self.origin + Duration::from_nanos(now)
    }

    /// `rank` is lost: the core learns it, and the channel ends if that revoked its context.
    fn lost(&mut self, t: Instant, rank: Rank) {
        self.core.peer_lost(t, rank);
        if let Some(e) = self.node.engine.revoked(CONTEXT) {
            self.ended.get_or_insert(e.to_string());
        }
    }

    fn round(&mut self, now: Time) -> usize {
        let t = self.at(now);
        let mut work = self.node.pump();
        if self.ended.is_some() {
            while self.node.completion().is_some() {}
            return 0;
        }
        if self.recv.is_none() {
            self.recv = Some(self.node.recv(CONTEXT, Source::Any, TagMatch::Exact(TAG)));
        }
        while let Some((op, c)) = self.node.completion() {
            work += 1;
            match c {
                Completion::Recv(r) if Some(op) == self.recv => {
                    self.recv = None;
                    match r {
                        Ok((payload, status)) => {
                            if let Err(e) = self.core.handle_control(t, status.source, payload.into_bytes()) {
                                self.errors.push(format!("control from {}: {e}", status.source));
                            }
                        }
                        Err(Error::PeerLost { rank, .. }) => self.lost(t, rank),
                        Err(e) => self.errors.push(format!("receive: {e}")),
                    }
                    if self.ended.is_some() {
                        return work;
                    }
                    self.recv = Some(self.node.recv(CONTEXT, Source::Any, TagMatch::Exact(TAG)));
                }
                Completion::Send(Err(Error::PeerLost { rank, .. })) => self.lost(t, rank),
                Completion::Send(Err(e)) => self.errors.push(format!("send: {e}")),
                _ => {}
            }
        }
        while let Some(d) = self.group.recv() {
            work += 1;
            if self.drop_datagram() {
                continue;
            }
            if let Err(e) = self.core.handle_datagram(t, d) {
                self.errors.push(format!("datagram: {e}"));
            }
        }
        if self.core.poll_timeout().is_some_and(|d| d <= t) {
            self.core.handle_timeout(t);
            work += 1;
        }
        if !self.wait_for_group || self.core.confirmed() || self.core.degraded() {
            while let Some(m) = self.outbox.front() {
                match self.core.send(t, m.clone()) {
                    Ok(_) => {
                        self.first_send_at.get_or_insert(now);
                        self.outbox.pop_front();
                        work += 1;
                    }
                    Err(SendError::WindowFull) => break,
                    Err(e) => {
                        self.errors.push(format!("send: {e}"));
                        self.outbox.pop_front();
                    }
                }
            }
        }
        while let Some((root, m)) = self.core.pop_any(t) {
            self.got.push((root, m));
            work += 1;
        }
        if self.read_all_at.is_none() && self.got.len() >= self.expect {
            self.read_all_at = Some(now);
        }
        while let Some(x) = self.core.poll_transmit() {
            work += 1;
            match x {
                Transmit::Multicast(d) => {
                    if !self.group.send(d) {
                        self.errors.push("datagram longer than the group carries".into());
                    }
                }
                Transmit::Unicast { to, msg } => {
                    // Completions of these sends matter only when they fail (above). Flushed
                    // at once, as the facade's driver starts them: the port then carries
                    // datagrams and copies in the order the core emitted them.
                    self.node.send(to, CONTEXT, TAG, msg);
                    self.node.flush();
                }
            }
        }
        if self.acked_at.is_none()
            && self.first_send_at.is_some()
            && self.outbox.is_empty()
            && self.core.in_flight() == 0
        {
            self.acked_at = Some(now);
        }
        while let Some(e) = self.core.poll_event() {
            if e == Event::GroupConfirmed {
                self.confirmed_at = Some(now);
            }
        }
        work + self.node.flush()
    }
}

impl Process for McastRank {
    fn step(&mut self, now: Time) {
        while self.round(now) > 0 {}
    }

    fn timer(&self) -> Option<Time> {
        if self.ended.is_some() {
            return None;
        }
        self.core.poll_timeout().map(|d| d.saturating_duration_since(self.origin).as_nanos() as Time)
    }

    /// Everything sent is delivered to every live receiver, everything expected is read, and
    /// this rank owes no acknowledgement.
    fn is_done(&self) -> bool {
        self.ended.is_some()
            || self.outbox.is_empty()
                && self.core.in_flight() == 0
                && self.got.len() >= self.expect
                && self.core.settled()
    }
}

/// The protocol settings of a simulated channel: the facade's defaults
/// (`McastSettings::default()`), with the datagram size of the network.
pub fn config(size: u32, datagram: usize) -> Config {
    Config { job: 0x0053_494d, channel: 1, datagram, ..Config::new(0, size) }
}
