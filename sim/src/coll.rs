//! Collectives on the simulated network: each rank runs its [`Machine`]s one after another over
//! its point-to-point [`Node`], exactly as `Comm::run` (`src/collective/mod.rs`) runs them over a
//! communicator: the call's messages on the collective context with tag `sequence << 16 | round`,
//! one receive posted per `Action::Recv` (exact source and tag), each send posted as it is asked
//! for, and the call finished once the machine is done and its sends have completed.

use std::collections::{HashMap, HashSet, VecDeque};

use ferrocomm::p2p::engine::Completion;
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm_collectives::{Action, Blocks, Machine};
use ferrocomm_transports::sim::{SimNet, Time};

use crate::SimError;
use crate::cluster::{Node, OpKey, Process, Report, run};

/// The context the calls' messages travel on: a collective context, as the facade derives them
/// (its top bit set).
pub const CONTEXT: u32 = 1 << 31 | 1;

/// The tag of round `round` of the call with sequence number `seq` (as `Comm::run`).
pub fn tag(seq: u64, round: u32) -> u64 {
    (seq << 16) | u64::from(round)
}

/// One rank running a list of collective calls in order.
pub struct CollRank {
    node: Node,
    calls: VecDeque<Machine>,
    current: Option<Machine>,
    seq: u64,
    /// Posted receives: `(from, round, part)` by operation.
    recvs: HashMap<OpKey, (u32, u32, u32)>,
    sends: HashSet<OpKey>,
    /// Each finished call's final blocks, in call order.
    pub results: Vec<Blocks>,
    /// When each call finished here.
    pub finished: Vec<Time>,
    /// The first failure (a failed operation, a malformed message); the rank stops there.
    pub error: Option<String>,
}

impl CollRank {
    /// Rank `node` running `calls` (each rank's machine of each collective) one after the other.
    pub fn new(node: Node, calls: impl IntoIterator<Item = Machine>) -> CollRank {
        let mut calls: VecDeque<Machine> = calls.into_iter().collect();
        let current = calls.pop_front();
        CollRank {
            node,
            calls,
            current,
            seq: 0,
            recvs: HashMap::new(),
            sends: HashSet::new(),
            results: Vec::new(),
            finished: Vec::new(),
            error: None,
        }
    }

    /// Its engine and transport.
    pub fn node(&self) -> &Node {
        &self.node
    }

    fn fail(&mut self, why: String) {
        self.error.get_or_insert(why);
        self.current = None;
        self.calls.clear();
    }

    /// One pass: completions into the machine, its actions out. Returns how much happened.
    fn round(&mut self, now: Time) -> usize {
        let mut work = self.node.pump();
        while let Some((op, c)) = self.node.completion() {
            work += 1;
            match c {
                Completion::Recv(Ok((payload, _))) => {
                    let Some((from, round, part)) = self.recvs.remove(&op) else { continue };
                    if let Some(m) = &mut self.current
                        && let Err(e) = m.deliver(from, round, part, payload.into_bytes())
                    {
                        self.fail(format!("call {}: {e}", self.seq));
                    }
                }
                Completion::Send(Ok(())) => {
                    self.sends.remove(&op);
                }
                Completion::Recv(Err(e)) | Completion::Send(Err(e)) => {
                    self.fail(format!("call {}: {e}", self.seq));
                }
                Completion::Probe(_) => {}
            }
        }
        let seq = self.seq;
        if let Some(m) = &mut self.current {
            while let Some(a) = m.poll_action() {
                work += 1;
                match a {
                    Action::Send { to, round, data } => {
                        let op = self.node.send(to, CONTEXT, tag(seq, round), data);
                        self.sends.insert(op);
                    }
                    Action::Recv { from, round, part, .. } => {
                        let op = self.node.recv(CONTEXT, Source::Rank(from), TagMatch::Exact(tag(seq, round)));
                        self.recvs.insert(op, (from, round, part));
                    }
                }
            }
            if m.is_done() && self.sends.is_empty() {
                let m = self.current.take().expect("running");
                self.results.push(m.into_blocks());
                self.finished.push(now);
                self.seq += 1;
                self.current = self.calls.pop_front();
                work += 1;
            }
        }
        work + self.node.flush()
    }
}

impl Process for CollRank {
    fn step(&mut self, now: Time) {
        while self.round(now) > 0 {}
    }

    fn is_done(&self) -> bool {
        self.error.is_some() || (self.current.is_none() && self.calls.is_empty())
    }
}

/// Runs on `net` the calls `calls(rank)` of every rank (all ranks must call the same
/// collectives in the same order), with the default engine settings.
pub fn run_calls(
    net: &SimNet,
    calls: impl Fn(u32) -> Vec<Machine>,
    limit: Time,
) -> Result<(Report, Vec<CollRank>), SimError> {
    let mut ranks: Vec<CollRank> =
        (0..net.size()).map(|r| CollRank::new(Node::with_defaults(net, r), calls(r))).collect();
    let report = run(net, &mut ranks, limit, |_, _| {})?;
    Ok((report, ranks))
}
