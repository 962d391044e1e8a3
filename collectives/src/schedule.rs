//! Schedules and the machine that runs them.
//!
//! Every algorithm here is written as a [`Schedule`]: numbered rounds, each a list of sends and
//! receives of *blocks* (pieces of the operation's data, named by a `u32` id). A [`Machine`] runs a
//! schedule without doing any I/O: it emits [`Action`]s (send these bytes to that rank, expect a
//! message from that rank) and consumes deliveries. This is the design of libNBC's round
//! schedules; it keeps each algorithm to a few lines of index arithmetic and lets one executor carry
//! the hard parts (ordering, validation, cancellation) for all of them.
//!
//! Rules that make it correct on any transport:
//! - Round numbers are global: a message sent in round `k` is received in round `k`, and a pair of
//!   ranks exchanges at most one message per direction per round, so `(source, round)` names a
//!   message uniquely within one collective call.
//! - Sends of a round read the blocks as they are when the round starts (a snapshot), so a receive
//!   of the same round can overwrite what is being sent.
//! - Receives of a round are applied when the last one arrives, in the order the schedule lists
//!   them, so reductions combine in a fixed order whatever the arrival order: results are
//!   reproducible bit for bit, and non-commutative operators see their operands in rank order.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::CollError;
use crate::reduce::Reducer;

/// What a receive does with the blocks it brings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Apply {
    /// Store each block under its id (replacing what was there).
    Store,
    /// Combine each block into the one with the same id: `mine ⊕ incoming`, or `incoming ⊕ mine`
    /// when `incoming_first` (the sender's data comes earlier in rank order). A block not held yet
    /// is stored.
    Reduce {
        /// Whether the incoming block is the left operand.
        incoming_first: bool,
    },
    /// The message carries exactly one block; combine it (incoming first) into each of `into`.
    /// Used by scans, where one partial result feeds two accumulators.
    ReduceInto {
        /// The accumulators' block ids.
        into: Vec<u32>,
    },
}

/// Which blocks a send carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Select {
    /// These ids (those held; a missing one is skipped).
    Ids(Vec<u32>),
    /// Bruck's rule for all-to-all: the blocks whose destination (`id % n`) lies at a distance
    /// `(dest - me) mod n` with bit `bit` set. They are *moved*: the sender no longer holds them.
    DistanceBit {
        /// The sending rank.
        me: u32,
        /// Ranks in the collective.
        n: u32,
        /// The distance bit of this round.
        bit: u32,
    },
    /// One block sent bare ([`Form::Bare`]): the message is its bytes (empty for `None`, a signal).
    /// The receiving step must say [`Form::Bare`] with the same id.
    Bare(Option<u32>),
}

/// How a received message is laid out: the receiver must know, since messages carry no marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// A header naming the blocks (any number, any ids), long ones following as messages of their
    /// own.
    Framed,
    /// No header: the message is exactly block `id`'s bytes, or empty for `None`. For algorithms
    /// where both ends know what travels (a broadcast tree, recursive doubling, a barrier's
    /// signals): it saves encoding and decoding, and a long block travels as one message that the
    /// driver can receive straight into a buffer of its own (see [`Machine::with_block_len`]).
    Bare(Option<u32>),
}

/// One step of a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send the selected blocks to `to`.
    Send {
        /// The destination rank.
        to: u32,
        /// The blocks the message carries.
        blocks: Select,
    },
    /// Expect one message from `from`, laid out as `form`, then apply it.
    Recv {
        /// The source rank.
        from: u32,
        /// What to do with the blocks.
        apply: Apply,
        /// How the message is laid out.
        form: Form,
    },
}

/// A round: its global number and its steps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// The round's number in the whole collective (messages are tagged with it).
    pub number: u32,
    /// This rank's steps in the round.
    pub steps: Vec<Step>,
}

/// A rank's part in one collective: the rounds it takes part in, in increasing round number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    rounds: Vec<Round>,
}

impl Schedule {
    /// An empty schedule (nothing to do).
    pub fn new() -> Schedule {
        Schedule::default()
    }

    /// Adds a send to round `number` (rounds must be added in non-decreasing order).
    pub fn send(&mut self, number: u32, to: u32, blocks: impl IntoIterator<Item = u32>) -> &mut Self {
        self.round(number).steps.push(Step::Send { to, blocks: Select::Ids(blocks.into_iter().collect()) });
        self
    }

    /// Adds a send whose blocks are chosen when the round starts.
    pub fn send_selected(&mut self, number: u32, to: u32, blocks: Select) -> &mut Self {
        self.round(number).steps.push(Step::Send { to, blocks });
        self
    }

    /// Adds a receive to round `number`.
    pub fn recv(&mut self, number: u32, from: u32, apply: Apply) -> &mut Self {
        self.round(number).steps.push(Step::Recv { from, apply, form: Form::Framed });
        self
    }

    /// Adds a bare send of block `id` (a signal for `None`): see [`Form::Bare`].
    pub fn send_bare(&mut self, number: u32, to: u32, id: Option<u32>) -> &mut Self {
        self.send_selected(number, to, Select::Bare(id))
    }

    /// Adds a receive of a bare message carrying block `id` (nothing for `None`).
    pub fn recv_bare(&mut self, number: u32, from: u32, id: Option<u32>, apply: Apply) -> &mut Self {
        self.round(number).steps.push(Step::Recv { from, apply, form: Form::Bare(id) });
        self
    }

    fn round(&mut self, number: u32) -> &mut Round {
        if self.rounds.last().is_none_or(|r| r.number < number) {
            self.rounds.push(Round { number, steps: Vec::new() });
        }
        let last = self.rounds.last_mut().expect("just pushed");
        assert_eq!(last.number, number, "rounds must be added in order");
        last
    }

    /// Appends `other`, whose round numbers are shifted by `offset` (to chain two algorithms).
    pub fn then(&mut self, other: Schedule, offset: u32) -> &mut Self {
        for mut r in other.rounds {
            r.number += offset;
            assert!(self.rounds.last().is_none_or(|l| l.number < r.number), "chained rounds overlap");
            self.rounds.push(r);
        }
        self
    }

    /// The rounds, in increasing number.
    pub fn rounds(&self) -> &[Round] {
        &self.rounds
    }

    /// The highest round number used plus one (0 for an empty schedule).
    pub fn span(&self) -> u32 {
        self.rounds.last().map_or(0, |r| r.number + 1)
    }
}

/// The blocks a rank holds.
pub type Blocks = BTreeMap<u32, Bytes>;

/// What the machine asks of the point-to-point layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `data` to `to`, tagged with `round`.
    Send {
        /// The destination rank.
        to: u32,
        /// The round, for the tag.
        round: u32,
        /// The message.
        data: Bytes,
    },
    /// Post a receive for the message `from` sends in `round`. `part` 0 is the message itself;
    /// parts 1.. are its detached blocks, which follow it in order (post them in the order asked,
    /// and deliver each with its part number). `len` is the exact length when the header said it
    /// (detached blocks), so the driver can receive straight into a buffer of its own.
    Recv {
        /// The source rank.
        from: u32,
        /// The round, for the tag.
        round: u32,
        /// 0 for the message, 1.. for its detached blocks.
        part: u32,
        /// The exact length, when known.
        len: Option<usize>,
    },
}

/// Runs one rank's [`Schedule`]. Sans-IO: the driver posts what [`Machine::poll_action`] returns
/// and hands every arrived message to [`Machine::deliver`].
pub struct Machine {
    /// Shared: a schedule depends only on the algorithm and the rank's place, so calls of the same
    /// shape run one planned copy (see `ops`).
    schedule: Arc<Schedule>,
    /// The index of the next round to start.
    next: usize,
    /// The index of the round now waiting for messages.
    current: Option<usize>,
    /// Messages of the current round, by step index, until all have come.
    arrived: Vec<Option<Arrival>>,
    missing: usize,
    blocks: Blocks,
    reducer: Option<Reducer>,
    actions: VecDeque<Action>,
    /// Largest message accepted from a peer (guards memory against a misbehaving peer).
    max_message: usize,
    /// Buffers the machine is done with (reduced operands), for the driver to reuse.
    spare: Vec<BytesMut>,
    /// The length of every bare block of this call, when the caller knows it.
    block_len: Option<BlockLen>,
    /// Where a buffer to fill comes from (see [`Machine::with_alloc`]).
    alloc: Option<Alloc>,
    /// How many rounds past the current one may have their receives posted early (see
    /// [`Machine::with_lookahead`]); 0: none.
    lookahead: usize,
    /// The index of the first round whose receives have not been asked for yet (rounds between
    /// the current one and this one were posted ahead).
    posted_to: usize,
    /// Messages of rounds posted ahead that came before their round started:
    /// `(round index, from, data)`.
    early: Vec<(usize, u32, Bytes)>,
}

/// A source of buffers of a given length (contents unspecified) for a [`Machine`] that must copy
/// an operand: the driver's pool of reused buffers.
pub type Alloc = Arc<dyn Fn(usize) -> BytesMut + Send + Sync>;

impl Machine {
    /// A machine holding `blocks` at the start. `reducer` is needed only by schedules that reduce.
    pub fn new(schedule: impl Into<Arc<Schedule>>, blocks: Blocks, reducer: Option<Reducer>) -> Machine {
        let mut m = Machine {
            schedule: schedule.into(),
            next: 0,
            current: None,
            arrived: Vec::new(),
            missing: 0,
            blocks,
            reducer,
            actions: Default::default(),
            max_message: usize::MAX,
            spare: Vec::new(),
            block_len: None,
            alloc: None,
            lookahead: 0,
            posted_to: 0,
            early: Vec::new(),
        };
        m.advance();
        m
    }

    /// Declares that every bare block of this call is `len` bytes long (all ranks pass the same
    /// length): receives of bare blocks then say so ([`Action::Recv`]'s `len`), and a block of
    /// another length is a [`CollError::Malformed`]. Must be given before the first
    /// [`Machine::poll_action`].
    pub fn with_block_len(self, len: usize) -> Machine {
        self.with_lengths(BlockLen::Every(len))
    }

    /// Declares that the bare blocks of this call are the pieces [`crate::ops::split`] cuts
    /// `len` bytes into, `segments` of them on `elem`-byte boundaries (block `id` is piece `id`),
    /// as [`Machine::with_block_len`] does for blocks of one length.
    pub fn with_segment_lens(self, len: usize, segments: u32, elem: usize) -> Machine {
        self.with_lengths(BlockLen::Pieces { len, segments: segments.max(1), elem: elem.max(1) })
    }

    fn with_lengths(mut self, lengths: BlockLen) -> Machine {
        self.block_len = Some(lengths);
        let current = self.current.map(|i| &self.schedule.rounds[i]);
        for a in &mut self.actions {
            if let Action::Recv { len: l @ None, part: 0, from, round } = a
                && let Some(id) = current.filter(|c| c.number == *round).and_then(|c| bare_from(c, *from))
            {
                *l = Some(lengths.of(id));
            }
        }
        self
    }

    /// Takes the buffers it must fill (a reduction's operand that others still hold, copied to
    /// be combined into) from `alloc`. Why: a fresh allocation above the allocator's mmap
    /// threshold (128 KiB with glibc) is mapped, faulted in page by page and unmapped on every
    /// call, which costs more than the reduction itself.
    pub fn with_alloc(mut self, alloc: Alloc) -> Machine {
        self.alloc = Some(alloc);
        self
    }

    /// Asks for the receives of up to `rounds` rounds past the current one at once, where every
    /// receive of those rounds is a bare block of a known length ([`Machine::with_block_len`] or
    /// [`Machine::with_segment_lens`], given before this): a message that comes before its
    /// round starts is kept and applied when the round does, in the schedule's order as always.
    ///
    /// Why: a receive posted only once the previous round is done is often late where senders
    /// run ahead (the root of a pipelined chain sends every segment at once). A late message
    /// waits as an unexpected one, which costs a copy; one above the eager limit, pushed behind
    /// its announcement over TCP, is dropped and sent again. Posted ahead, each lands in its
    /// own buffer as it comes. Memory: the posted buffers are blocks this rank receives anyway.
    pub fn with_lookahead(mut self, rounds: usize) -> Machine {
        self.lookahead = rounds;
        self.post_ahead();
        self
    }

    /// Caps the size of a message this machine accepts.
    pub fn with_max_message(mut self, max: usize) -> Machine {
        self.max_message = max;
        self
    }

    /// The next thing to do, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// True once every round has completed (the driver still has to finish its sends).
    pub fn is_done(&self) -> bool {
        self.current.is_none() && self.actions.iter().all(|a| matches!(a, Action::Send { .. }))
    }

    /// The round now waiting for messages.
    pub fn round(&self) -> Option<u32> {
        self.current_round().map(|r| r.number)
    }

    fn current_round(&self) -> Option<&Round> {
        self.current.map(|i| &self.schedule.rounds[i])
    }

    /// The blocks held now (the result, once done).
    pub fn blocks(&self) -> &Blocks {
        &self.blocks
    }

    /// Buffers no longer needed (operands consumed by reductions), for reuse by the driver.
    pub fn take_spare(&mut self) -> Vec<BytesMut> {
        std::mem::take(&mut self.spare)
    }

    /// The blocks held at the end: the collective's result, read by the `*_result` functions.
    pub fn into_blocks(self) -> Blocks {
        self.blocks
    }

    /// A message the driver received for `(from, round, part)`, as asked by an [`Action::Recv`].
    pub fn deliver(&mut self, from: u32, round: u32, part: u32, data: Bytes) -> Result<(), CollError> {
        if data.len() > self.max_message {
            return Err(CollError::Malformed { from, why: "message larger than the collective allows" });
        }
        let Some(cur) = self.current_round() else { return Err(CollError::Unexpected { from, round }) };
        if cur.number != round {
            return self.keep_early(from, round, part, data);
        }
        // At most one message per peer and round: the step is found by its source.
        let slot = (cur.steps.iter())
            .position(|s| matches!(s, Step::Recv { from: f, .. } if *f == from))
            .ok_or(CollError::Unexpected { from, round })?;
        let bare = match &cur.steps[slot] {
            Step::Recv { form: Form::Bare(id), .. } => Some(*id),
            _ => None,
        };
        match &mut self.arrived[slot] {
            None if part == 0 && bare.is_some() => {
                let blocks = self.bare_blocks(from, bare.flatten(), data)?;
                self.arrived[slot] = Some(Arrival { blocks, detached: Vec::new(), waiting: 0, posted: 0 });
            }
            // The header: its detached blocks follow as messages of their own.
            None if part == 0 => {
                let a = Arrival::new(decode(from, data)?);
                if a.detached.iter().any(|d| d.2 > self.max_message) {
                    return Err(CollError::Malformed { from, why: "detached block larger than the collective allows" });
                }
                let a = self.arrived[slot].insert(a);
                a.post_parts(from, round, self.max_message, &mut self.actions);
            }
            Some(a) if part > 0 => {
                a.fill(part, data).ok_or(CollError::Unexpected { from, round })?;
                a.post_parts(from, round, self.max_message, &mut self.actions);
            }
            _ => return Err(CollError::Unexpected { from, round }),
        }
        if self.arrived[slot].as_ref().is_some_and(|a| a.waiting > 0) {
            return Ok(());
        }
        self.missing -= 1;
        if self.missing == 0 {
            self.apply_round()?;
            self.advance();
            self.take_early()?;
        }
        Ok(())
    }

    /// The blocks a bare message brings: block `id`, of the call's length for it, or nothing
    /// (a signal).
    fn bare_blocks(&self, from: u32, id: Option<u32>, data: Bytes) -> Result<Vec<(u32, Bytes)>, CollError> {
        match id {
            Some(id) => {
                if self.block_len.is_some_and(|l| l.of(id) != data.len()) {
                    return Err(CollError::Malformed { from, why: "block length differs from the call's" });
                }
                Ok(vec![(id, data)])
            }
            None if data.is_empty() => Ok(Vec::new()),
            None => Err(CollError::Malformed { from, why: "a signal with a payload" }),
        }
    }

    /// A message of a round after the current one: kept if that round's receives were posted
    /// ahead and it is the one expected from `from` there (checked as it would be in its round).
    fn keep_early(&mut self, from: u32, round: u32, part: u32, data: Bytes) -> Result<(), CollError> {
        let unexpected = CollError::Unexpected { from, round };
        let ahead = self.current.map_or(0, |c| c + 1)..self.posted_to;
        let Some(index) = ahead.clone().find(|&i| self.schedule.rounds[i].number == round) else {
            return Err(unexpected);
        };
        let id = match bare_recv(&self.schedule.rounds[index], from) {
            Some(id) if part == 0 => id,
            _ => return Err(unexpected),
        };
        if self.early.iter().any(|&(i, f, _)| i == index && f == from) {
            return Err(unexpected);
        }
        self.bare_blocks(from, id, data.clone())?;
        self.early.push((index, from, data));
        Ok(())
    }

    /// Applies the messages of the current round that came before it started, round after
    /// round while that completes them.
    fn take_early(&mut self) -> Result<(), CollError> {
        while let Some(index) = self.current {
            if !self.early.iter().any(|e| e.0 == index) {
                return Ok(());
            }
            let schedule = self.schedule.clone();
            let steps = &schedule.rounds[index].steps;
            let mut i = 0;
            while i < self.early.len() {
                if self.early[i].0 != index {
                    i += 1;
                    continue;
                }
                let (_, from, data) = self.early.swap_remove(i);
                let slot = (steps.iter())
                    .position(|s| matches!(s, Step::Recv { from: f, .. } if *f == from))
                    .expect("kept only for a receive of its round");
                let id = bare_recv(&schedule.rounds[index], from).expect("kept only for a bare receive");
                let blocks = self.bare_blocks(from, id, data)?;
                self.arrived[slot] = Some(Arrival { blocks, detached: Vec::new(), waiting: 0, posted: 0 });
                self.missing -= 1;
            }
            if self.missing > 0 {
                return Ok(());
            }
            self.apply_round()?;
            self.advance();
        }
        Ok(())
    }

    /// Asks for the receives of the rounds after the current one, up to the lookahead, as long
    /// as each is a bare block of a known length.
    fn post_ahead(&mut self) {
        let Some(lengths) = self.block_len.filter(|_| self.lookahead > 0) else { return };
        let schedule = &*self.schedule;
        let end = (self.next + self.lookahead).min(schedule.rounds.len());
        let mut at = self.posted_to.max(self.next);
        while at < end {
            let round = &schedule.rounds[at];
            let recvs = round.steps.iter().filter_map(|s| match s {
                Step::Recv { from, form: Form::Bare(id), .. } => Some(Some((*from, *id))),
                Step::Recv { .. } => Some(None),
                Step::Send { .. } => None,
            });
            if recvs.clone().any(|r| r.is_none()) {
                break;
            }
            for (from, id) in recvs.flatten() {
                let len = id.map_or(0, |id| lengths.of(id));
                self.actions.push_back(Action::Recv { from, round: round.number, part: 0, len: Some(len) });
            }
            at += 1;
        }
        self.posted_to = at;
    }

    fn apply_round(&mut self) -> Result<(), CollError> {
        let index = self.current.take().expect("a round is running");
        let schedule = self.schedule.clone();
        let mut arrived = std::mem::take(&mut self.arrived);
        for (step, data) in schedule.rounds[index].steps.iter().zip(arrived.drain(..)) {
            let &Step::Recv { from, ref apply, .. } = step else { continue };
            let incoming = data.expect("all arrived").blocks;
            match apply {
                Apply::Store => self.blocks.extend(incoming),
                &Apply::Reduce { incoming_first } => {
                    for (id, block) in incoming {
                        self.combine(from, id, block, incoming_first)?;
                    }
                }
                Apply::ReduceInto { into } => {
                    let [(_, block)]: [(u32, Bytes); 1] = incoming
                        .try_into()
                        .map_err(|_| CollError::Malformed { from, why: "expected exactly one block" })?;
                    for &id in into {
                        self.combine(from, id, block.clone(), true)?;
                    }
                }
            }
        }
        // The vector serves the next round.
        self.arrived = arrived;
        Ok(())
    }

    fn combine(&mut self, from: u32, id: u32, incoming: Bytes, incoming_first: bool) -> Result<(), CollError> {
        let Some(mine) = self.blocks.remove(&id) else {
            self.blocks.insert(id, incoming);
            return Ok(());
        };
        if mine.len() != incoming.len() {
            return Err(CollError::Malformed { from, why: "block length differs from ours" });
        }
        let reducer = self.reducer.as_ref().ok_or(CollError::Malformed { from, why: "no operator to reduce with" })?;
        if !incoming.len().is_multiple_of(reducer.element_size()) {
            return Err(CollError::Malformed { from, why: "block of a partial element" });
        }
        // Reduce into whichever buffer we own outright, to avoid a copy.
        let (left, right) = if incoming_first { (incoming, mine) } else { (mine, incoming) };
        let (out, other) = match left.try_into_mut() {
            Ok(mut acc) => {
                reducer.apply(&mut acc, &right, false);
                (acc, right)
            }
            Err(left) => {
                let mut acc = match right.try_into_mut() {
                    Ok(acc) => acc,
                    Err(right) => match &self.alloc {
                        Some(alloc) => {
                            let mut acc = alloc(right.len());
                            acc.copy_from_slice(&right);
                            acc
                        }
                        None => BytesMut::from(&right[..]),
                    },
                };
                reducer.apply(&mut acc, &left, true);
                (acc, left)
            }
        };
        // The operand no longer needed goes back to the driver for reuse, if nothing else holds it.
        if let Ok(buf) = other.try_into_mut() {
            self.spare.push(buf);
        }
        self.blocks.insert(id, out.freeze());
        Ok(())
    }

    /// Moves to the next round with receives, emitting the sends of every round on the way.
    fn advance(&mut self) {
        let schedule = &*self.schedule;
        while let Some(round) = schedule.rounds.get(self.next) {
            self.next += 1;
            for step in &round.steps {
                let Step::Send { to, blocks } = step else { continue };
                if let Select::Bare(id) = blocks {
                    // A block the schedule says is held; an empty message if not (the receiver
                    // then sees a block of the wrong length).
                    let data = id.and_then(|id| self.blocks.get(&id).cloned()).unwrap_or_default();
                    debug_assert!(id.is_none_or(|id| self.blocks.contains_key(&id)), "bare block {id:?} not held");
                    self.actions.push_back(Action::Send { to: *to, round: round.number, data });
                    continue;
                }
                let chosen: Vec<(u32, Bytes)> = match blocks {
                    Select::Ids(ids) => {
                        ids.iter().filter_map(|id| self.blocks.get(id).map(|b| (*id, b.clone()))).collect()
                    }
                    &Select::DistanceBit { me, n, bit } => {
                        let moving: Vec<u32> = (self.blocks.keys())
                            .copied()
                            .filter(|id| ((id % n + n - me) % n) >> bit & 1 == 1)
                            .collect();
                        moving.iter().map(|id| (*id, self.blocks.remove(id).expect("held"))).collect()
                    }
                    Select::Bare(_) => unreachable!("sent above"),
                };
                let (head, detached) = encode_detached(&chosen);
                self.actions.push_back(Action::Send { to: *to, round: round.number, data: head });
                for data in detached {
                    self.actions.push_back(Action::Send { to: *to, round: round.number, data });
                }
            }
            // Receives of a round posted ahead were asked for already.
            let posted = self.next <= self.posted_to;
            let mut recvs = 0;
            for step in &round.steps {
                let Step::Recv { from, form, .. } = step else { continue };
                let len = match form {
                    Form::Bare(Some(id)) => self.block_len.map(|l| l.of(*id)),
                    Form::Bare(None) => Some(0),
                    Form::Framed => None,
                };
                if !posted {
                    self.actions.push_back(Action::Recv { from: *from, round: round.number, part: 0, len });
                }
                recvs += 1;
            }
            if recvs == 0 {
                continue;
            }
            self.arrived.clear();
            self.arrived.resize_with(round.steps.len(), || None);
            self.missing = recvs;
            self.current = Some(self.next - 1);
            self.post_ahead();
            return;
        }
    }
}

/// The block of the bare receive from `from` in round `r` (`Some(None)`: a signal), if there is one.
fn bare_recv(r: &Round, from: u32) -> Option<Option<u32>> {
    r.steps.iter().find_map(|s| match s {
        Step::Recv { from: f, form: Form::Bare(id), .. } if *f == from => Some(*id),
        _ => None,
    })
}

/// The block the receive from `from` in round `r` carries, if it is a bare one.
fn bare_from(r: &Round, from: u32) -> Option<u32> {
    r.steps.iter().find_map(|s| match s {
        Step::Recv { from: f, form: Form::Bare(Some(id)), .. } if *f == from => Some(*id),
        _ => None,
    })
}

/// The lengths of a call's bare blocks, where every rank knows them.
#[derive(Clone, Copy, Debug)]
enum BlockLen {
    /// Every block is this long.
    Every(usize),
    /// Block `id` is piece `id` of `len` bytes cut into `segments` by [`crate::ops::split`].
    Pieces { len: usize, segments: u32, elem: usize },
}

impl BlockLen {
    fn of(self, id: u32) -> usize {
        match self {
            BlockLen::Every(len) => len,
            BlockLen::Pieces { len, segments, elem } => {
                let elems = len / elem;
                let (base, extra) = (elems / segments as usize, elems % segments as usize);
                (base + usize::from((id as usize) < extra)) * elem
            }
        }
    }
}

/// Blocks at least this long travel as messages of their own behind the header (no copy into a
/// combined message; on shared memory they go by single-copy rendezvous straight from the block).
pub const DETACH: usize = 32 << 10;

/// Set in a header entry's length when its block follows as its own message.
const DETACHED: u32 = 1 << 31;

/// A message being received: the header's blocks, some still to come as detached messages.
struct Arrival {
    blocks: Vec<(u32, Bytes)>,
    /// For part p (1..), the index in `blocks` it fills, whether it came, and its length.
    detached: Vec<(usize, bool, usize)>,
    waiting: usize,
    /// Parts whose receive has been asked for (parts 1..=posted).
    posted: usize,
}

impl Arrival {
    fn new(entries: Vec<Decoded>) -> Arrival {
        let detached: Vec<(usize, bool, usize)> =
            (entries.iter().enumerate()).filter_map(|(i, e)| e.1.as_ref().err().map(|&len| (i, false, len))).collect();
        Arrival {
            waiting: detached.len(),
            detached,
            blocks: entries.into_iter().map(|(id, b)| (id, b.unwrap_or_default())).collect(),
            posted: 0,
        }
    }

    /// Asks for the receives of the next parts, in order, as long as the parts asked for and
    /// not yet come add up to at most `budget` bytes (and always for one): the driver allocates
    /// each receive's buffer when it posts it, so a header cannot make this rank set aside more
    /// than one message's worth beyond what has come. A sender's parts are each at most one
    /// message, so they all come in the end.
    fn post_parts(&mut self, from: u32, round: u32, budget: usize, actions: &mut VecDeque<Action>) {
        let mut outstanding: usize = self.detached[..self.posted].iter().filter(|d| !d.1).map(|d| d.2).sum();
        while let Some(&(_, _, len)) = self.detached.get(self.posted) {
            if outstanding > 0 && outstanding.saturating_add(len) > budget {
                return;
            }
            outstanding += len;
            self.posted += 1;
            actions.push_back(Action::Recv { from, round, part: self.posted as u32, len: Some(len) });
        }
    }

    /// Fills detached part `part`; `None` if there is no such part, its receive was not asked
    /// for yet, or it came already.
    fn fill(&mut self, part: u32, data: Bytes) -> Option<()> {
        if part as usize > self.posted {
            return None;
        }
        let (i, came, len) = self.detached.get_mut(part as usize - 1)?;
        if *came || data.len() != *len {
            return None;
        }
        *came = true;
        self.blocks[*i].1 = data;
        self.waiting -= 1;
        Some(())
    }
}

/// The message for `blocks`: a header carrying the short blocks inline, plus the long ones
/// (at least [`DETACH`] bytes) as separate messages to send right after it, in order.
pub fn encode_detached(blocks: &[(u32, Bytes)]) -> (Bytes, Vec<Bytes>) {
    let detached: Vec<Bytes> = blocks.iter().filter(|(_, b)| b.len() >= DETACH).map(|(_, b)| b.clone()).collect();
    let head =
        encode_entries(
            blocks.iter().map(|(id, b)| {
                if b.len() >= DETACH { (*id, Entry::Detached(b.len())) } else { (*id, Entry::Inline(b)) }
            }),
        );
    (head, detached)
}

/// Encodes blocks inline (no detached ones).
pub fn encode<'a>(blocks: impl Iterator<Item = (u32, &'a Bytes)> + Clone) -> Bytes {
    encode_entries(blocks.map(|(id, b)| (id, Entry::Inline(b))))
}

#[derive(Clone, Copy)]
enum Entry<'a> {
    Inline(&'a Bytes),
    /// A block of this length that follows as a message of its own.
    Detached(usize),
}

/// Message layout: block count (u32), then (id u32, length u32) per block, all little-endian, then
/// the inline blocks' bytes, each starting on a 16-byte boundary of the message (padding between),
/// so a receiver can reduce typed data in place without realigning it. One block costs 16 bytes.
/// Bit 31 of a length marks a detached block (blocks are below 2 GiB: messages are at most 1 GiB).
fn encode_entries<'a>(blocks: impl Iterator<Item = (u32, Entry<'a>)> + Clone) -> Bytes {
    let padded = |e: Entry| if let Entry::Inline(b) = e { b.len().next_multiple_of(ALIGN) } else { 0 };
    let (count, total) = blocks.clone().fold((0usize, 0usize), |(c, t), (_, e)| (c + 1, t + padded(e)));
    let head = (4 + 8 * count).next_multiple_of(ALIGN);
    let mut out = BytesMut::with_capacity(head + total);
    out.put_u32_le(count as u32);
    for (id, e) in blocks.clone() {
        out.put_u32_le(id);
        let len = match e {
            Entry::Inline(b) => b.len(),
            Entry::Detached(len) => len,
        };
        assert!(len < DETACHED as usize, "a block of {len} bytes");
        out.put_u32_le(if matches!(e, Entry::Detached(_)) { DETACHED | len as u32 } else { len as u32 });
    }
    out.resize(head, 0);
    for (_, e) in blocks {
        if let Entry::Inline(b) = e {
            out.put_slice(b);
            out.resize(out.len().next_multiple_of(ALIGN), 0);
        }
    }
    out.freeze()
}

/// Alignment of every block within a message.
const ALIGN: usize = 16;

/// A decoded header entry: the block's id, and its bytes or (detached) its length.
pub type Decoded = (u32, Result<Bytes, usize>);

/// Splits a message into its blocks without copying them, checking every length. A block that
/// follows as a message of its own comes back as `Err(its length)`.
pub fn decode(from: u32, data: Bytes) -> Result<Vec<Decoded>, CollError> {
    let bad = |why| CollError::Malformed { from, why };
    let mut head = &data[..];
    if head.len() < 4 {
        return Err(bad("message shorter than its header"));
    }
    let count = head.get_u32_le() as usize;
    if count.saturating_mul(8) > head.len() {
        return Err(bad("block count exceeds the message"));
    }
    let mut at = (4 + 8 * count).next_multiple_of(ALIGN);
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let (id, len) = (head.get_u32_le(), head.get_u32_le());
        if len & DETACHED != 0 {
            out.push((id, Err((len & !DETACHED) as usize)));
            continue;
        }
        let len = len as usize;
        let end = at.checked_add(len).filter(|&e| e <= data.len()).ok_or(bad("block lengths exceed the message"))?;
        out.push((id, Ok(data.slice(at..end))));
        at = end.next_multiple_of(ALIGN);
    }
    if at != data.len() {
        return Err(bad("block lengths do not add up to the message"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip_and_reject_garbage() {
        let a = Bytes::from_static(b"hello");
        let b = Bytes::new();
        let msg = encode([(3, &a), (9, &b)].into_iter());
        assert_eq!(decode(0, msg.clone()).unwrap(), vec![(3, Ok(a)), (9, Ok(b))]);
        for cut in 0..msg.len() {
            assert!(decode(0, msg.slice(..cut)).is_err(), "truncated at {cut}");
        }
        let mut long = BytesMut::from(&msg[..]);
        long.put_u8(0);
        assert!(decode(0, long.freeze()).is_err());
        assert!(decode(0, Bytes::from_static(&[255, 255, 255, 255])).is_err());
    }

    proptest::proptest! {
        /// Any bytes from a peer decode to blocks or a typed error, never a panic; every block
        /// lies inside the message.
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let msg = Bytes::from(data);
            if let Ok(blocks) = decode(3, msg.clone()) {
                let inline: usize = blocks.iter().filter_map(|(_, b)| b.as_ref().ok().map(Bytes::len)).sum();
                proptest::prop_assert!(inline <= msg.len());
            }
        }
    }

    /// Long blocks travel behind the header as their own messages, and come back in order.
    #[test]
    fn detached_blocks_follow_the_header() {
        let big = Bytes::from(vec![7u8; DETACH + 5]);
        let small = Bytes::from_static(b"tiny");
        let mut send = Schedule::new();
        send.send(0, 1, [0, 1, 2]);
        let blocks = Blocks::from([(0, big.clone()), (1, small.clone()), (2, big.slice(1..))]);
        let mut tx = Machine::new(send, blocks, None);
        let mut recv = Schedule::new();
        recv.recv(0, 0, Apply::Store);
        let mut rx = Machine::new(recv, Blocks::new(), None);
        assert_eq!(rx.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 0, len: None }));
        let mut sent = Vec::new();
        while let Some(Action::Send { data, .. }) = tx.poll_action() {
            sent.push(data);
        }
        assert_eq!(sent.len(), 3, "header, then the two long blocks");
        assert!(sent[0].len() < 64);
        // Parts may complete out of order (the driver awaits them together); numbers keep them apart.
        let mut sent = sent.into_iter();
        let (head, one, two) = (sent.next().unwrap(), sent.next().unwrap(), sent.next().unwrap());
        rx.deliver(0, 0, 0, head).unwrap();
        assert_eq!(rx.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 1, len: Some(DETACH + 5) }));
        assert_eq!(rx.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 2, len: Some(DETACH + 4) }));
        rx.deliver(0, 0, 2, two).unwrap();
        assert!(!rx.is_done());
        assert!(rx.deliver(0, 0, 2, Bytes::new()).is_err(), "a part twice");
        assert!(rx.deliver(0, 0, 3, Bytes::new()).is_err(), "a part never announced");
        rx.deliver(0, 0, 1, one).unwrap();
        assert!(rx.is_done());
        assert_eq!(rx.blocks(), &Blocks::from([(0, big.clone()), (1, small), (2, big.slice(1..))]));
    }

    /// A bare block travels as its own bytes (no header, zero-copy), and a bare signal as an empty
    /// message; the receiver knows the id from its schedule and checks the call's block length.
    #[test]
    fn bare_blocks_and_signals() {
        let block = Bytes::from_static(b"12345678");
        let mut send = Schedule::new();
        send.send_bare(0, 1, Some(4)).send_bare(1, 1, None);
        let mut tx = Machine::new(send, Blocks::from([(4, block.clone())]), None);
        let Some(Action::Send { to: 1, round: 0, data }) = tx.poll_action() else { panic!("a send") };
        assert_eq!(data.as_ptr(), block.as_ptr(), "the block itself, not a copy");
        assert_eq!(tx.poll_action(), Some(Action::Send { to: 1, round: 1, data: Bytes::new() }));
        assert!(tx.is_done());

        let mut recv = Schedule::new();
        recv.recv_bare(0, 0, Some(4), Apply::Store).recv_bare(1, 0, None, Apply::Store);
        let mut rx = Machine::new(recv.clone(), Blocks::new(), None).with_block_len(8);
        assert_eq!(rx.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 0, len: Some(8) }));
        rx.deliver(0, 0, 0, block.clone()).unwrap();
        assert_eq!(rx.poll_action(), Some(Action::Recv { from: 0, round: 1, part: 0, len: Some(0) }));
        assert!(matches!(rx.deliver(0, 1, 0, block.clone()), Err(CollError::Malformed { .. })), "a signal with data");
        rx.deliver(0, 1, 0, Bytes::new()).unwrap();
        assert!(rx.is_done());
        assert_eq!(rx.blocks(), &Blocks::from([(4, block.clone())]));

        let mut short = Machine::new(recv.clone(), Blocks::new(), None).with_block_len(9);
        assert!(matches!(short.deliver(0, 0, 0, block.clone()), Err(CollError::Malformed { .. })));
        let mut unknown = Machine::new(recv, Blocks::new(), None);
        assert_eq!(unknown.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 0, len: None }));
        assert!(matches!(unknown.deliver(0, 0, 1, Bytes::new()), Err(CollError::Unexpected { .. })), "no parts");
        unknown.deliver(0, 0, 0, block).unwrap();
    }

    /// Found by the `coll_schedule` fuzz target: a 16-byte header announcing a detached block of
    /// 1.3 GB made the machine ask the driver for a receive of that length, which the driver
    /// allocates when it posts it. A part larger than a message is refused; parts within the
    /// limit are asked for only while those outstanding fit one message, and all come in the end.
    #[test]
    fn announced_parts_cannot_make_the_receiver_allocate_beyond_one_message() {
        let header = |lens: &[u32]| {
            let mut h = Vec::new();
            h.extend_from_slice(&(lens.len() as u32).to_le_bytes());
            for (id, &l) in lens.iter().enumerate() {
                h.extend_from_slice(&(id as u32).to_le_bytes());
                h.extend_from_slice(&(l | DETACHED).to_le_bytes());
            }
            h.resize(h.len().next_multiple_of(ALIGN), 0);
            Bytes::from(h)
        };
        let mut recv = Schedule::new();
        recv.recv(0, 0, Apply::Store);
        let mut m = Machine::new(recv.clone(), Blocks::new(), None).with_max_message(1000);
        assert_eq!(m.poll_action(), Some(Action::Recv { from: 0, round: 0, part: 0, len: None }));
        let r = m.deliver(0, 0, 0, header(&[1_342_137_902]));
        assert!(matches!(r, Err(CollError::Malformed { .. })), "{r:?}");
        assert_eq!(m.poll_action(), None, "no receive of 1.3 GB asked for");

        let mut m = Machine::new(recv, Blocks::new(), None).with_max_message(1000);
        m.poll_action();
        m.deliver(0, 0, 0, header(&[600, 300, 600, 1000])).unwrap();
        let asked = |m: &mut Machine| std::iter::from_fn(|| m.poll_action()).collect::<Vec<_>>();
        let part = |part, len| Action::Recv { from: 0, round: 0, part, len: Some(len) };
        assert_eq!(asked(&mut m), [part(1, 600), part(2, 300)]);
        assert!(m.deliver(0, 0, 3, Bytes::from(vec![3; 600])).is_err(), "a part not asked for yet");
        m.deliver(0, 0, 2, Bytes::from(vec![2; 300])).unwrap();
        assert_eq!(asked(&mut m), [], "600 + 600 outstanding would exceed 1000");
        m.deliver(0, 0, 1, Bytes::from(vec![1; 600])).unwrap();
        assert_eq!(asked(&mut m), [part(3, 600)]);
        m.deliver(0, 0, 3, Bytes::from(vec![3; 600])).unwrap();
        assert_eq!(asked(&mut m), [part(4, 1000)], "one part is always asked for");
        m.deliver(0, 0, 4, Bytes::from(vec![4; 1000])).unwrap();
        assert!(m.is_done());
        assert_eq!(m.blocks().values().map(Bytes::len).collect::<Vec<_>>(), [600, 300, 600, 1000]);
    }

    /// Found by the `coll_schedule` fuzz target: a reducing receive given two blocks of the same id
    /// whose length is not a whole number of elements (3 bytes of `i32`) reached the operator,
    /// which panicked copying its result back. Such a block is now refused.
    #[test]
    fn a_block_of_partial_elements_is_refused_before_reducing() {
        let mut recv = Schedule::new();
        recv.recv(0, 1, Apply::Reduce { incoming_first: false });
        let op = crate::ReduceOp::<i32>::custom(|acc, x| acc.iter_mut().zip(x).for_each(|(a, b)| *a -= b), false);
        let mut m = Machine::new(recv, Blocks::new(), Some(op.erase()));
        let odd = Bytes::from_static(&[9, 9, 9]);
        let r = m.deliver(1, 0, 0, encode([(7, &odd), (7, &odd)].into_iter()));
        assert!(matches!(r, Err(CollError::Malformed { from: 1, .. })), "{r:?}");
    }

    /// Receives posted ahead: every round's bare receive is asked for at once (up to the
    /// lookahead), a message of a later round is kept until its round starts and then applied,
    /// one that came twice, of a round not posted ahead, or of the wrong length is refused.
    #[test]
    fn receives_posted_ahead_keep_early_messages() {
        // Rank 1 of a chain 0 -> 1 -> 2: block r comes in round r and goes on in round r + 1.
        let mut recv = Schedule::new();
        for round in 0..5 {
            if round > 0 {
                recv.send_bare(round, 2, Some(round - 1));
            }
            if round < 4 {
                recv.recv_bare(round, 0, Some(round), Apply::Store);
            }
        }
        let lengths = |m: Machine| m.with_segment_lens(8, 4, 1);
        let asked = |m: &mut Machine| std::iter::from_fn(|| m.poll_action()).collect::<Vec<_>>();
        let recv_of = |round| Action::Recv { from: 0, round, part: 0, len: Some(2) };
        let block = |id: u8| Bytes::from(vec![id; 2]);

        let mut m = lengths(Machine::new(recv.clone(), Blocks::new(), None)).with_lookahead(2);
        assert_eq!(asked(&mut m), [recv_of(0), recv_of(1), recv_of(2)], "the current round and two ahead");
        m.deliver(0, 2, 0, block(2)).unwrap();
        assert!(m.deliver(0, 2, 0, block(2)).is_err(), "a message twice");
        assert!(m.deliver(0, 3, 0, block(3)).is_err(), "a round not posted ahead");
        assert!(matches!(m.deliver(0, 1, 0, block(1).slice(..1)), Err(CollError::Malformed { .. })));
        m.deliver(0, 1, 0, block(1)).unwrap();
        assert_eq!(asked(&mut m), [], "round 0 still waits: nothing sent");
        m.deliver(0, 0, 0, block(0)).unwrap();
        // Rounds 0, 1 and 2 complete at once: round 3's receive is asked for as round 1 starts
        // (two ahead), and the blocks go on in order.
        let send = |round, id| Action::Send { to: 2, round, data: block(id) };
        assert_eq!(asked(&mut m), [send(1, 0), recv_of(3), send(2, 1), send(3, 2)]);
        assert_eq!(m.round(), Some(3));
        m.deliver(0, 3, 0, block(3)).unwrap();
        assert_eq!(asked(&mut m), [send(4, 3)]);
        assert!(m.is_done());
        assert_eq!(m.blocks().len(), 4);

        // Without the lengths nothing is posted ahead (a framed or unknown block could not be
        // received into its own buffer).
        let mut m = Machine::new(recv, Blocks::new(), None).with_lookahead(8);
        assert_eq!(asked(&mut m), [Action::Recv { from: 0, round: 0, part: 0, len: None }]);
        assert!(m.deliver(0, 1, 0, block(1)).is_err());
    }

    #[test]
    fn unexpected_messages_are_typed_errors() {
        let mut s = Schedule::new();
        s.recv(2, 1, Apply::Store);
        let mut m = Machine::new(s, Blocks::new(), None);
        assert_eq!(m.poll_action(), Some(Action::Recv { from: 1, round: 2, part: 0, len: None }));
        assert!(matches!(m.deliver(0, 2, 0, encode(std::iter::empty())), Err(CollError::Unexpected { .. })));
        assert!(matches!(m.deliver(1, 1, 0, encode(std::iter::empty())), Err(CollError::Unexpected { .. })));
        m.deliver(1, 2, 0, encode(std::iter::empty())).unwrap();
        assert!(m.is_done());
        assert!(matches!(m.deliver(1, 2, 0, encode(std::iter::empty())), Err(CollError::Unexpected { .. })));
    }
}
