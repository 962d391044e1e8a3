//! A scripted point-to-point workload: every rank sends messages of mixed sizes (empty, eager,
//! rendezvous) to peers drawn from a seeded generator, and receives what is sent to it with a
//! mix of exact and wildcard receives, some posted before the messages come and some after
//! (unexpected messages, credit stalls). The script says what must arrive, so a run is checked
//! message by message.

use std::collections::HashMap;

use bytes::Bytes;
use ferrocomm::p2p::engine::Completion;
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm_transports::Rank;
use ferrocomm_transports::sim::Time;

use crate::cluster::{Node, OpKey, Process};

/// The context of the messages taken by exact receives, and of those taken by wildcard
/// receives `(Any, Any)` (a wildcard on the first could take a message an exact receive waits
/// for).
pub const CONTEXT: u32 = 7;
/// See [`CONTEXT`].
pub const WILD_CONTEXT: u32 = 8;

/// One message of the script.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    /// The sender.
    pub src: Rank,
    /// The receiver.
    pub dst: Rank,
    /// Unique per (src, dst): the message's index among those from `src` to `dst`.
    pub index: u32,
    /// Its length in bytes.
    pub len: usize,
    /// Received by a wildcard receive.
    pub wild: bool,
}

impl Msg {
    /// Its tag: the index, so that exact receives name one message.
    pub fn tag(&self) -> u64 {
        u64::from(self.index)
    }

    /// Its context: [`WILD_CONTEXT`] for a wildcard receive, else [`CONTEXT`].
    pub fn context(&self) -> u32 {
        if self.wild { WILD_CONTEXT } else { CONTEXT }
    }

    /// Its bytes: a pattern of (src, dst, index), so that any mix-up shows.
    pub fn data(&self) -> Bytes {
        let seed = (self.src as u64) << 40 ^ (self.dst as u64) << 20 ^ self.index as u64;
        (0..self.len).map(|i| (seed.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 31) >> 7) as u8).collect()
    }
}

/// A workload: `per_rank` messages from each rank to peers chosen by `seed`, with lengths from
/// `lens` in turn; every `wild_every`-th is for a wildcard receive (0: none).
pub fn script(size: u32, per_rank: u32, lens: &[usize], wild_every: u32, seed: u64) -> Vec<Msg> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut count: HashMap<(Rank, Rank), u32> = HashMap::new();
    let mut out = Vec::new();
    for k in 0..per_rank {
        for src in 0..size {
            let dst = if size == 1 { 0 } else { (src + 1 + (next() % (size as u64 - 1)) as u32) % size };
            let index = count.entry((src, dst)).or_default();
            let len = lens[(k as usize + src as usize) % lens.len()];
            let wild = wild_every > 0 && (k + src) % wild_every == 0;
            out.push(Msg { src, dst, index: *index, len, wild });
            *index += 1;
        }
    }
    out
}

/// One rank of the workload.
pub struct P2pRank {
    node: Node,
    /// Messages to send, in script order.
    to_send: Vec<Msg>,
    /// Messages to receive, in the order each sender sends them.
    to_recv: Vec<Msg>,
    /// Receives are posted at this time (0: at once, before anything arrives).
    post_at: Time,
    posted: bool,
    /// Posted receives, and whether each is a wildcard.
    recvs: HashMap<OpKey, bool>,
    sends: usize,
    /// What arrived, as (context, source, tag, bytes), in completion order.
    pub got: Vec<(u32, Rank, u64, Bytes)>,
    /// Failed operations.
    pub errors: Vec<String>,
}

impl P2pRank {
    /// Rank `node`'s part of `script`: it sends its messages at once and posts its receives at
    /// virtual time `post_at`.
    pub fn new(node: Node, script: &[Msg], post_at: Time) -> P2pRank {
        let me = node.rank;
        P2pRank {
            node,
            to_send: script.iter().filter(|m| m.src == me).copied().collect(),
            to_recv: script.iter().filter(|m| m.dst == me).copied().collect(),
            post_at,
            posted: false,
            recvs: HashMap::new(),
            sends: 0,
            got: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Its engine and transport.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Checks what arrived against the script: each message exactly once, intact, and the
    /// messages of one sender that wildcard receives took in the order they were sent.
    pub fn check(&self) -> Result<(), String> {
        if let Some(e) = self.errors.first() {
            return Err(format!("rank {}: {e}", self.node.rank));
        }
        let me = self.node.rank;
        let mut want: HashMap<(Rank, u64), Msg> = self.to_recv.iter().map(|m| ((m.src, m.tag()), *m)).collect();
        let mut last_wild: HashMap<Rank, u64> = HashMap::new();
        for (context, src, tag, data) in &self.got {
            let m =
                want.remove(&(*src, *tag)).ok_or_else(|| format!("rank {me}: unexpected or duplicate {src}/{tag}"))?;
            if *data != m.data() || *context != m.context() {
                return Err(format!("rank {me}: message {src}/{tag} corrupted or on the wrong context"));
            }
            if m.wild && last_wild.insert(*src, *tag).is_some_and(|before| before > *tag) {
                return Err(format!("rank {me}: wildcard receives took {src}'s messages out of order"));
            }
        }
        if !want.is_empty() {
            return Err(format!("rank {}: {} messages missing", self.node.rank, want.len()));
        }
        Ok(())
    }

    fn round(&mut self, now: Time) -> usize {
        let mut work = self.node.pump();
        if !self.to_send.is_empty() {
            for m in std::mem::take(&mut self.to_send) {
                self.node.send(m.dst, m.context(), m.tag(), m.data());
                self.sends += 1;
            }
            work += 1;
        }
        if !self.posted && now >= self.post_at {
            self.posted = true;
            for m in &self.to_recv {
                let op = if m.wild {
                    self.node.recv(WILD_CONTEXT, Source::Any, TagMatch::Any)
                } else {
                    self.node.recv(CONTEXT, Source::Rank(m.src), TagMatch::Exact(m.tag()))
                };
                self.recvs.insert(op, m.wild);
            }
            work += 1;
        }
        while let Some((op, c)) = self.node.completion() {
            work += 1;
            match c {
                Completion::Send(Ok(())) => self.sends -= 1,
                Completion::Recv(Ok((payload, status))) => {
                    let wild = self.recvs.remove(&op).unwrap_or(false);
                    let context = if wild { WILD_CONTEXT } else { CONTEXT };
                    self.got.push((context, status.source, status.tag, payload.into_bytes()));
                }
                Completion::Send(Err(e)) | Completion::Recv(Err(e)) => {
                    self.recvs.remove(&op);
                    self.errors.push(e.to_string());
                }
                Completion::Probe(_) => {}
            }
        }
        work + self.node.flush()
    }
}

impl Process for P2pRank {
    fn step(&mut self, now: Time) {
        while self.round(now) > 0 {}
    }

    fn timer(&self) -> Option<Time> {
        (!self.posted).then_some(self.post_at)
    }

    fn is_done(&self) -> bool {
        self.posted && self.recvs.is_empty() && self.sends == 0 && self.to_send.is_empty()
    }
}
