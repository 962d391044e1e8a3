//! One rank's engine on the simulated network ([`Node`]), and the event loop that runs many
//! ranks ([`run`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use bytes::Bytes;
use ferrocomm::p2p::engine::{Completion, Config, Engine, RecvBuf};
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm_transports::sim::{NetStats, SimNet, SimTransport, Time};
use ferrocomm_transports::{Rank, Transport, TransportError};

use crate::SimError;

/// Key of an operation posted on a [`Node`].
pub type OpKey = usize;

/// The engine's settings in a simulated job: the facade's defaults (`Settings::default()`),
/// with the network's eager limit.
pub fn engine_config(eager_limit: usize) -> Config {
    Config { eager_limit, max_credit: 32, credit_sync: 16, chunk: 512 << 10, max_message: 1 << 30 }
}

/// One rank's point-to-point engine and its transport, glued as the facade's driver glues them
/// (`src/driver.rs`): frames in through the engine's `Sink`, frames out from its transmit queue,
/// protocol violations and peers reported lost by others to `disconnect`.
pub struct Node {
    pub rank: Rank,
    pub engine: Engine,
    pub transport: SimTransport,
    next_op: OpKey,
}

impl Node {
    /// Rank `rank` of a job of `size` on `net`.
    pub fn new(net: &SimNet, rank: Rank, size: u32, cfg: Config) -> Node {
        Node { rank, engine: Engine::new(rank, size, cfg), transport: net.transport(rank), next_op: 0 }
    }

    /// A node with the default engine settings ([`engine_config`]).
    pub fn with_defaults(net: &SimNet, rank: Rank) -> Node {
        let t = net.transport(rank);
        let cfg = engine_config(t.eager_limit());
        Node { rank, engine: Engine::new(rank, net.size(), cfg), transport: t, next_op: 0 }
    }

    fn op(&mut self) -> OpKey {
        self.next_op += 1;
        self.next_op
    }

    /// Posts a send; its completion comes out of [`Node::completion`].
    pub fn send(&mut self, dest: Rank, context: u32, tag: u64, data: Bytes) -> OpKey {
        let op = self.op();
        self.engine.post_send(op, dest, context, tag, data);
        op
    }

    /// Posts a receive (into a buffer the engine allocates).
    pub fn recv(&mut self, context: u32, src: Source, tag: TagMatch) -> OpKey {
        let op = self.op();
        self.engine.post_recv(op, context, src, tag, RecvBuf::Alloc);
        op
    }

    /// The next completed operation.
    pub fn completion(&mut self) -> Option<(OpKey, Completion)> {
        self.engine.poll_event()
    }

    /// Frames that arrived go into the engine; its output goes out. Returns how much happened.
    pub fn pump(&mut self) -> usize {
        let n = self.transport.progress(&mut self.engine);
        n + self.flush()
    }

    /// The engine's output to the transport.
    pub fn flush(&mut self) -> usize {
        let mut work = 0;
        while let Some((peer, err)) = self.engine.poll_violation() {
            // The transport reports the loss back through the engine's sink on the next pump.
            self.transport.disconnect(peer, TransportError::Wire(err));
            work += 1;
        }
        // Peers reported lost by others: their connections go the same way.
        while let Some((peer, why)) = self.engine.poll_cut() {
            self.transport.disconnect(peer, why);
            work += 1;
        }
        while let Some((peer, h, payload)) = self.engine.poll_transmit() {
            self.transport.send(peer, h, payload);
            work += 1;
        }
        work
    }
}

/// A simulated rank: whatever runs on top of a [`Node`] (a collective, a multicast channel, a
/// scripted workload).
pub trait Process {
    /// Reacts to what arrived, and to timers due by `now`: called at time 0, then whenever the
    /// network delivered something to this rank or [`Process::timer`] is due. It should do all it
    /// can before returning (nothing else calls it for work it left undone).
    fn step(&mut self, now: Time);
    /// When this process must be stepped even if nothing arrives.
    fn timer(&self) -> Option<Time> {
        None
    }
    /// True once the process has done its part.
    fn is_done(&self) -> bool;
}

/// What a run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Virtual time at which each rank was first done (`None`: not done, e.g. killed).
    pub done_at: Vec<Option<Time>>,
    /// When the last rank was done.
    pub time: Time,
    /// Steps taken (process calls).
    pub steps: u64,
    pub stats: NetStats,
    /// The network's fingerprint of the run ([`SimNet::trace`]).
    pub trace: u64,
}

/// Runs `procs` (rank i is `procs[i]`) on `net` until every live rank is done. Killed ranks
/// ([`SimNet::kill`], possibly by `hook`) are not stepped and not waited for. `hook` runs before
/// each instant's steps (fault injection at chosen times). Fails when the ranks wait on each
/// other with nothing in flight, or when virtual time passes `limit`.
pub fn run<P: Process>(
    net: &SimNet,
    procs: &mut [P],
    limit: Time,
    mut hook: impl FnMut(Time, &SimNet),
) -> Result<Report, SimError> {
    let n = procs.len();
    let mut done_at: Vec<Option<Time>> = vec![None; n];
    let mut armed: Vec<Option<Time>> = vec![None; n];
    let mut timers: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let mut steps = 0u64;
    let mut in_due = vec![false; n];
    let mut now = net.now();
    hook(now, net);
    let mut due: Vec<usize> = (0..n).collect();
    loop {
        for &r in &due {
            if net.is_dead(r as Rank) {
                continue;
            }
            procs[r].step(now);
            steps += 1;
            if done_at[r].is_none() && procs[r].is_done() {
                done_at[r] = Some(now);
            }
            // A timer at or before now would spin in place: it is due at the next instant.
            let t = procs[r].timer().map(|t| t.max(now + 1));
            if t != armed[r] {
                armed[r] = t;
                if let Some(t) = t {
                    timers.push(Reverse((t, r)));
                }
            }
        }
        let waiting = || (0..n).filter(|&r| done_at[r].is_none() && !net.is_dead(r as Rank)).map(|r| r as u32);
        if waiting().next().is_none() {
            break;
        }
        // Stale timers (re-armed since) are dropped here.
        while let Some(&Reverse((t, r))) = timers.peek() {
            if armed[r] == Some(t) && !net.is_dead(r as Rank) {
                break;
            }
            timers.pop();
        }
        let next_timer = timers.peek().map(|Reverse((t, _))| *t);
        let Some(t) = net.advance(next_timer) else {
            return Err(SimError::Deadlock { at: now, waiting: waiting().collect() });
        };
        if t > limit {
            return Err(SimError::TimeLimit { limit, waiting: waiting().collect() });
        }
        now = t;
        hook(now, net);
        due = net.take_touched().into_iter().map(|r| r as usize).collect();
        due.iter().for_each(|&r| in_due[r] = true);
        while let Some(&Reverse((t, r))) = timers.peek() {
            if t > now {
                break;
            }
            timers.pop();
            if armed[r] == Some(t) {
                armed[r] = None;
                if !std::mem::replace(&mut in_due[r], true) {
                    due.push(r);
                }
            }
        }
        due.iter().for_each(|&r| in_due[r] = false);
    }
    let time = done_at.iter().flatten().copied().max().unwrap_or(0);
    Ok(Report { done_at, time, steps, stats: net.stats(), trace: net.trace() })
}
