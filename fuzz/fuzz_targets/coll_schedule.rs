//! The collective schedules' delivery (`collectives/src/schedule.rs`, the algorithms of
//! `collectives/src/algorithms.rs` as `collectives/src/ops.rs` plans them): one rank's machine of
//! any operation and algorithm, fed arbitrary messages, from the peers and rounds it waits for or
//! from anywhere, framed block lists or raw bytes. Every delivery is taken or refused with a typed
//! error; nothing panics, and a peer's header cannot make the machine ask for more memory than
//! the largest message it accepts (receives of announced parts outstanding per peer).
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use ferrocomm_collectives::schedule::{self, Action, Machine};
use ferrocomm_collectives::{Algorithm, ReduceOp, ops};
use libfuzzer_sys::fuzz_target;

/// Largest message the machines accept here.
const MAX: usize = 1 << 17;

#[derive(Arbitrary, Debug)]
enum Body {
    /// Exactly what the receive asked for, when it said a length: this many bytes of `fill`.
    Fitting {
        fill: u8,
    },
    /// A framed list of blocks: (id, length, fill); long ones detached behind the header.
    Blocks(Vec<(u32, u16, u8)>),
    /// A framed header naming blocks that follow detached: (id, announced length).
    Detached(Vec<(u32, u32)>),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Delivery {
    /// Which posted receive it answers (modulo their number) ...
    pick: u16,
    /// ... or, if set, where it claims to come from: (from, round, part).
    stray: Option<(u8, u8, u8)>,
    body: Body,
}

#[derive(Arbitrary, Debug)]
struct Input {
    op: u8,
    alg: u8,
    n: u8,
    r: u8,
    root: u8,
    /// Elements (4 bytes each) of this rank's data.
    elems: u16,
    commutative: bool,
    block_len: bool,
    deliveries: Vec<Delivery>,
}

fn plan(i: &Input) -> Option<Machine> {
    let n = u32::from(i.n % 9) + 1;
    let (r, root) = (u32::from(i.r) % n, u32::from(i.root) % n);
    let alg = Algorithm::ALL[usize::from(i.alg) % Algorithm::ALL.len()];
    let len = usize::from(i.elems % 4096) * 4;
    let data = Bytes::from(vec![1u8; len]);
    let op = if i.commutative {
        ReduceOp::<i32>::Sum.erase()
    } else {
        ReduceOp::<i32>::custom(|acc, x| acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.wrapping_sub(*b)), false)
            .erase()
    };
    let m = match i.op % 10 {
        0 => ops::barrier(r, n, alg),
        1 => ops::bcast(r, n, root, alg, (r == root).then_some(data), 4),
        2 => ops::reduce(r, n, root, alg, data, op),
        3 => ops::allreduce(r, n, alg, data, op),
        4 => ops::gather(r, n, root, alg, data),
        5 => ops::scatter(r, n, root, alg, (r == root).then(|| vec![data; n as usize])),
        6 => ops::allgather(r, n, alg, data),
        7 => ops::alltoall(r, n, alg, vec![data; n as usize]),
        8 => ops::reduce_scatter(r, n, alg, vec![data; n as usize], op),
        _ => Ok(ops::scan(r, n, data, op, i.commutative)),
    };
    let m = m.ok()?.with_max_message(MAX);
    Some(if i.block_len { m.with_block_len(len) } else { m })
}

fuzz_target!(|input: Input| {
    let Some(mut m) = plan(&input) else { return };
    // Receives asked for and not yet answered: (from, round, part, len).
    let mut posted: Vec<(u32, u32, u32, Option<usize>)> = Vec::new();
    for d in input.deliveries.iter().take(512) {
        while let Some(a) = m.poll_action() {
            if let Action::Recv { from, round, part, len } = a {
                assert!(len.is_none_or(|l| l <= MAX), "a receive of {len:?} bytes asked for");
                posted.push((from, round, part, len));
            }
        }
        for &(from, ..) in &posted {
            let announced: usize = posted.iter().filter(|p| p.0 == from && p.2 > 0).filter_map(|p| p.3).sum();
            assert!(announced <= MAX, "receives of {announced} bytes announced by {from}'s header posted at once");
        }
        if m.is_done() {
            break;
        }
        let (from, round, part, len) = match d.stray {
            Some((f, r, p)) => (u32::from(f), u32::from(r), u32::from(p), None),
            None if posted.is_empty() => return,
            None => posted.remove(usize::from(d.pick) % posted.len()),
        };
        let data = match &d.body {
            Body::Fitting { fill } => Bytes::from(vec![*fill; len.unwrap_or(0)]),
            Body::Blocks(blocks) => {
                let blocks: Vec<(u32, Bytes)> =
                    blocks.iter().map(|&(id, l, f)| (id, Bytes::from(vec![f; usize::from(l)]))).collect();
                schedule::encode_detached(&blocks).0
            }
            Body::Detached(entries) => {
                let mut h = Vec::new();
                h.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for &(id, l) in entries {
                    h.extend_from_slice(&id.to_le_bytes());
                    h.extend_from_slice(&(l | 1 << 31).to_le_bytes());
                }
                h.resize(h.len().next_multiple_of(16), 0);
                Bytes::from(h)
            }
            Body::Raw(b) => Bytes::from(b.clone()),
        };
        if m.deliver(from, round, part, data).is_err() {
            return;
        }
        m.take_spare();
    }
});
