//! The shared-memory collective board (`collectives/src/shared.rs`): every rank's queue of calls
//! over one board in memory, interleaved in any order, while another process sharing the
//! segment (a buggy or hostile rank) writes arbitrary words anywhere: counters, lengths, inline
//! data, offers. Every call ends with a result or a typed error, or keeps waiting; nothing
//! panics and no read leaves the board. Records a rank lends for single copies
//! ([`Lent::decode`]) are checked the same way.
#![no_main]

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use arbitrary::Arbitrary;
use ferrocomm_collectives::ReduceOp;
use ferrocomm_collectives::shared::{Board, Kind, Lent, Queue, board_bytes};
use libfuzzer_sys::fuzz_target;

#[derive(Clone)]
struct Mem(Arc<[AtomicU64]>);

impl Deref for Mem {
    type Target = [AtomicU64];
    fn deref(&self) -> &[AtomicU64] {
        &self.0
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum CallKind {
    Barrier,
    Bcast,
    Allreduce,
    Allgather,
    Alltoall,
    Reduce,
    Fanin,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// Rank `rank` makes its next call of the job's list (`now`: through `call_now`/`root_now`).
    Call {
        rank: u8,
        now: bool,
        held: bool,
    },
    Advance {
        rank: u8,
    },
    /// Rank `rank` collects (or gives up on) its oldest outstanding call.
    Take {
        rank: u8,
        abandon: bool,
    },
    Release {
        rank: u8,
    },
    FinishNow {
        rank: u8,
    },
    /// Another process writes `value` at word `at` (mostly among the lines: `at` modulo them).
    Corrupt {
        at: u32,
        value: u64,
        anywhere: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    ranks: u8,
    /// The calls every rank makes, in order: kind, root, length.
    calls: Vec<(CallKind, u8, u16)>,
    steps: Vec<Step>,
    lent: ([u8; 24], u32, u32),
}

struct Rank {
    board: Board<Mem>,
    queue: Queue,
    /// Index in the job's list of this rank's next call.
    next: usize,
    /// Calls made and not collected, oldest first (with whether they are still held).
    open: Vec<(u64, bool)>,
}

fuzz_target!(|input: Input| {
    let (b, from, len) = input.lent;
    if let Ok(l) = Lent::decode(from, &b, len as usize) {
        assert!(l.pid != 0 && l.len == u64::from(len) && l.addr.checked_add(l.len).is_some());
    }

    let n = usize::from(input.ranks % 3) + 1;
    let mem = Mem((0..board_bytes(n) / 8).map(|_| AtomicU64::new(0)).collect());
    let mut ranks: Vec<Rank> = (0..n)
        .map(|me| Rank {
            board: Board::attach(mem.clone(), n, me).expect("a fresh board").0,
            queue: Queue::default(),
            next: 0,
            open: Vec::new(),
        })
        .collect();
    let cap = ranks[0].board.capacity();
    // The lines (header, `finished` lines, slot lines) come first; the data areas after them.
    let lines = (1 + n + 32 * n) * 8;
    let calls: Vec<(Kind, usize)> = input
        .calls
        .iter()
        .take(200)
        .map(|&(k, root, len)| {
            let root = u32::from(root) % n as u32;
            let len = usize::from(len) % (cap + 1);
            let sum = || ReduceOp::<u32>::Sum.erase();
            match k {
                CallKind::Barrier => (Kind::Barrier, 0),
                CallKind::Bcast => (Kind::Bcast { root }, len),
                CallKind::Allreduce => (Kind::Allreduce(sum()), len),
                CallKind::Allgather => (Kind::Allgather, len),
                CallKind::Alltoall => (Kind::Alltoall, len),
                CallKind::Reduce => (Kind::Reduce { root, op: sum() }, len),
                CallKind::Fanin => (Kind::Fanin { root }, 0),
            }
        })
        .collect();

    for step in input.steps.iter().take(2000) {
        match *step {
            Step::Call { rank, now, held } => {
                let me = usize::from(rank) % n;
                let r = &mut ranks[me];
                let Some((kind, len)) = calls.get(r.next).cloned() else { continue };
                r.next += 1;
                let input = match kind {
                    Kind::Bcast { root } if root as usize != me => Vec::new(),
                    _ => vec![me as u8 + 1; len],
                };
                if held && matches!(kind, Kind::Barrier | Kind::Fanin { .. }) {
                    let seq = r.queue.push_held(kind);
                    r.open.push((seq, true));
                } else if now
                    && matches!(kind, Kind::Bcast { root } if root as usize == me)
                    && r.queue.root_now(&r.board, &input)
                {
                    // Posted and finished at once: nothing to collect.
                } else if now {
                    match r.queue.call_now(&r.board, kind, len, &input) {
                        Ok((_, Some(_))) => {}
                        Ok((seq, None)) => r.open.push((seq, false)),
                        Err(_) => {}
                    }
                } else if let Ok(seq) = r.queue.push(&r.board, kind, len, input) {
                    r.open.push((seq, false));
                }
            }
            Step::Advance { rank } => {
                let r = &mut ranks[usize::from(rank) % n];
                r.queue.advance(&r.board);
            }
            Step::Take { rank, abandon } => {
                let r = &mut ranks[usize::from(rank) % n];
                let Some(&(seq, _)) = r.open.first() else { continue };
                if abandon {
                    r.queue.abandon(seq..seq + 1);
                    r.open.remove(0);
                } else {
                    let _ = r.queue.waiting(&r.board, seq);
                    if r.queue.take(seq).is_some() {
                        r.open.remove(0);
                    }
                }
            }
            Step::Release { rank } => {
                let r = &mut ranks[usize::from(rank) % n];
                if let Some(c) = r.open.iter_mut().find(|c| c.1) {
                    c.1 = false;
                    r.queue.release(c.0);
                }
            }
            Step::FinishNow { rank } => {
                let r = &mut ranks[usize::from(rank) % n];
                let Some(&(seq, _)) = r.open.first() else { continue };
                if let Some(Some(_)) = r.queue.finish_now(&r.board, seq) {
                    r.open.remove(0);
                }
            }
            Step::Corrupt { at, value, anywhere } => {
                let words = if anywhere { mem.len() } else { lines.min(mem.len()) };
                mem[at as usize % words].store(value, Relaxed);
            }
        }
    }
    for r in &ranks {
        assert!(r.queue.len() <= r.next, "more calls queued than made");
    }
});
