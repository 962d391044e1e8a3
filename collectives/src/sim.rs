//! The sim transport: an in-memory, seeded network that drives many [`Machine`]s in one process.
//!
//! Messages get a random latency (so they arrive out of order across pairs and rounds) and wait,
//! like unexpected messages in the point-to-point engine, until the receiver posts the matching
//! receive. The simulator also measures each algorithm's latency term: every message carries the
//! length of the longest causal chain of messages before it, and the longest chain at the end is
//! the number of communication rounds the algorithm needed, which tests compare with its formula.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use bytes::Bytes;

use crate::CollError;
use crate::schedule::{Action, Blocks, Machine};

/// What a simulated run produced.
#[derive(Debug)]
pub struct Outcome {
    /// Each rank's final blocks.
    pub blocks: Vec<Blocks>,
    /// The longest causal chain of messages: the algorithm's number of rounds.
    pub rounds: u32,
    /// Messages sent, by all ranks.
    pub messages: u64,
    /// Bytes sent, by all ranks.
    pub bytes: u64,
    /// Virtual time at which the last rank finished.
    pub time: u64,
}

/// Network parameters.
#[derive(Clone, Copy, Debug)]
pub struct Network {
    /// Seed of the latency draws (the same seed, the same run).
    pub seed: u64,
    /// Latencies are drawn uniformly from 1..=max_latency virtual time units.
    pub max_latency: u64,
}

impl Default for Network {
    fn default() -> Network {
        Network { seed: 1, max_latency: 16 }
    }
}

/// splitmix64: small, seedable, good enough to shuffle a simulation.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

type Key = (u32, u32, u32); // (to, from, round)

struct Msg {
    data: Bytes,
    depth: u32,
}

/// Runs `machines` (rank i is `machines[i]`) to completion on a simulated network.
pub fn run(machines: Vec<Machine>, net: Network) -> Result<Outcome, CollError> {
    let mut sim = Sim {
        machines,
        clock: Vec::new(),
        rng: Rng(net.seed),
        max_latency: net.max_latency.max(1),
        now: 0,
        seq: 0,
        flying: BinaryHeap::new(),
        arrived: HashMap::new(),
        posted: HashMap::new(),
        in_air: HashMap::new(),
        last_arrival: HashMap::new(),
        finish: Vec::new(),
        messages: 0,
        bytes: 0,
    };
    let n = sim.machines.len();
    sim.clock = vec![0; n];
    sim.finish = vec![0; n];
    for r in 0..n {
        sim.drain(r as u32)?;
    }
    while let Some(Reverse((t, seq, key))) = sim.flying.pop() {
        sim.now = t;
        let msg = sim.in_air.remove(&seq).expect("in the air");
        if let Some(part) = sim.posted.get_mut(&key).and_then(VecDeque::pop_front) {
            sim.deliver(key, part, msg)?;
        } else {
            sim.arrived.entry(key).or_default().push_back(msg);
        }
    }
    if let Some(r) = sim.machines.iter().position(|m| !m.is_done()) {
        return Err(CollError::Invalid(format!(
            "rank {r} never finished (waiting in round {:?})",
            sim.machines[r].round()
        )));
    }
    Ok(Outcome {
        rounds: sim.clock.iter().copied().max().unwrap_or(0),
        time: sim.finish.iter().copied().max().unwrap_or(0),
        blocks: sim.machines.into_iter().map(Machine::into_blocks).collect(),
        messages: sim.messages,
        bytes: sim.bytes,
    })
}

struct Sim {
    machines: Vec<Machine>,
    clock: Vec<u32>,
    rng: Rng,
    max_latency: u64,
    now: u64,
    seq: u64,
    flying: BinaryHeap<Reverse<(u64, u64, Key)>>,
    /// Messages that arrived before their receive was posted, in order.
    arrived: HashMap<Key, VecDeque<Msg>>,
    /// Receives (their part numbers) posted before their message arrived, in order.
    posted: HashMap<Key, VecDeque<u32>>,
    in_air: HashMap<u64, Msg>,
    /// Arrival time of the last message of each key: later ones never overtake it (the
    /// point-to-point layer keeps order between one sender and one receiver on one tag).
    last_arrival: HashMap<Key, u64>,
    finish: Vec<u64>,
    messages: u64,
    bytes: u64,
}

impl Sim {
    fn drain(&mut self, r: u32) -> Result<(), CollError> {
        while let Some(a) = self.machines[r as usize].poll_action() {
            match a {
                Action::Send { to, round, data } => {
                    if to as usize >= self.machines.len() {
                        return Err(CollError::Invalid(format!("rank {r} sends to unknown rank {to}")));
                    }
                    self.messages += 1;
                    self.bytes += data.len() as u64;
                    let key = (to, r, round);
                    let last = self.last_arrival.entry(key).or_default();
                    let at = (self.now + 1 + self.rng.next() % self.max_latency).max(*last);
                    *last = at;
                    self.seq += 1;
                    self.flying.push(Reverse((at, self.seq, key)));
                    self.in_air.insert(self.seq, Msg { data, depth: self.clock[r as usize] + 1 });
                }
                Action::Recv { from, round, part, .. } => {
                    let key = (r, from, round);
                    match self.arrived.get_mut(&key).and_then(VecDeque::pop_front) {
                        Some(msg) => self.deliver(key, part, msg)?,
                        None => self.posted.entry(key).or_default().push_back(part),
                    }
                }
            }
        }
        if self.machines[r as usize].is_done() {
            self.finish[r as usize] = self.now;
        }
        Ok(())
    }

    fn deliver(&mut self, (to, from, round): Key, part: u32, msg: Msg) -> Result<(), CollError> {
        let c = &mut self.clock[to as usize];
        *c = (*c).max(msg.depth);
        self.machines[to as usize].deliver(from, round, part, msg.data)?;
        self.drain(to)
    }
}
