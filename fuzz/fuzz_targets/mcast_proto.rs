//! The reliable multicast roles (`multicast/src/proto.rs`): a group of cores, each root of its
//! own stream and co-root or leaf of the others', over a simulated network that loses,
//! duplicates and reorders datagrams (point-to-point stays reliable and ordered, as it is), with
//! ranks dying, the clock jumping and timeouts firing, and arbitrary datagrams and control
//! messages injected from anyone.
//!
//! Checked: no panic; no rank holds more of a stream than the window (the memory bound), nor has
//! more of its own messages in flight; and while nothing was injected, every message a rank takes
//! is the next one its root sent, in order.
#![no_main]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use bytes::Bytes;
use ferrocomm_multicast::wire::{self, Control};
use ferrocomm_multicast::{Config, McastCore, Transmit};
use libfuzzer_sys::fuzz_target;

const JOB: u64 = 7;

#[derive(Arbitrary, Debug)]
enum Step {
    Send {
        rank: u8,
        len: u16,
    },
    Pop {
        rank: u8,
        root: u8,
    },
    /// Delivers datagram `pick` of those in flight (`keep`: it stays for a duplicate).
    Datagram {
        pick: u16,
        keep: bool,
    },
    DropDatagram {
        pick: u16,
    },
    /// Delivers the next point-to-point message from `from` to `to`.
    Unicast {
        from: u8,
        to: u8,
    },
    Tick {
        micros: u32,
    },
    Kill {
        rank: u8,
    },
    InjectDatagram {
        to: u8,
        root: u8,
        seq: u32,
        len: u16,
        frag: u8,
        raw: Option<Vec<u8>>,
    },
    InjectControl {
        to: u8,
        from: u8,
        kind: u8,
        root: u8,
        a: u32,
        b: u32,
        data: Vec<u8>,
        raw: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    size: u8,
    window: u8,
    ack_every: u8,
    subgroups: Option<u8>,
    datagram: u8,
    first_seq: u8,
    multicast: bool,
    steps: Vec<Step>,
}

struct Rank {
    core: McastCore,
    alive: bool,
    /// Messages sent by this rank, in order.
    sent: Vec<Bytes>,
    /// How many messages of each root this rank has taken.
    taken: Vec<usize>,
}

fuzz_target!(|input: Input| {
    let size = u32::from(input.size % 5) + 2;
    let t0 = Instant::now();
    let mut now = t0;
    let window = usize::from(input.window % 8) + 1;
    let mk = |me| {
        let mut c = Config::new(me, size);
        c.job = JOB;
        c.window = window;
        c.ack_every = u32::from(input.ack_every % 4) + 1;
        c.subgroups = input.subgroups.map(|g| usize::from(g % 4) + 1);
        c.datagram = wire::HEADER + 1 + usize::from(input.datagram);
        c.max_message = 1024;
        c.first_seq = u32::MAX - u32::from(input.first_seq % 16);
        c.multicast = input.multicast;
        c
    };
    let cfg0 = mk(0);
    let mut ranks: Vec<Rank> = (0..size)
        .map(|me| Rank {
            core: McastCore::new(mk(me), now),
            alive: true,
            sent: Vec::new(),
            taken: vec![0; size as usize],
        })
        .collect();
    // Datagrams in flight (to every live rank but the sender), and point-to-point links.
    let mut datagrams: Vec<(u32, Bytes)> = Vec::new();
    let mut links: Vec<VecDeque<Bytes>> = vec![VecDeque::new(); (size * size) as usize];
    let mut injected = false;
    let link = |from: u32, to: u32| (from * size + to) as usize;

    for step in input.steps.iter().take(1500) {
        match step {
            &Step::Send { rank, len } => {
                let me = u32::from(rank) % size;
                let r = &mut ranks[me as usize];
                if !r.alive {
                    continue;
                }
                // The message names its root and index, so a receiver can check what it takes.
                let mut m = vec![me as u8; usize::from(len) % 1025];
                let k = r.sent.len() as u32;
                if m.len() >= 5 {
                    m[1..5].copy_from_slice(&k.to_le_bytes());
                }
                let m = Bytes::from(m);
                if r.core.send(now, m.clone()).is_ok() {
                    r.sent.push(m);
                }
            }
            &Step::Pop { rank, root } => {
                let (me, root) = (u32::from(rank) % size, u32::from(root) % size);
                if !ranks[me as usize].alive || me == root {
                    continue;
                }
                if let Ok(Some(m)) = ranks[me as usize].core.pop(root, now) {
                    let k = ranks[me as usize].taken[root as usize];
                    if !injected {
                        assert_eq!(
                            Some(&m),
                            ranks[root as usize].sent.get(k),
                            "rank {me} took a wrong message of {root}"
                        );
                    }
                    ranks[me as usize].taken[root as usize] += 1;
                }
            }
            &Step::Datagram { pick, keep } => {
                if datagrams.is_empty() {
                    continue;
                }
                let i = usize::from(pick) % datagrams.len();
                let (from, d) = if keep { datagrams[i].clone() } else { datagrams.swap_remove(i) };
                for (to, r) in ranks.iter_mut().enumerate() {
                    if r.alive && to as u32 != from {
                        let _ = r.core.handle_datagram(now, d.clone());
                    }
                }
            }
            &Step::DropDatagram { pick } => {
                if !datagrams.is_empty() {
                    datagrams.swap_remove(usize::from(pick) % datagrams.len());
                }
            }
            &Step::Unicast { from, to } => {
                let (from, to) = (u32::from(from) % size, u32::from(to) % size);
                if let Some(m) = links[link(from, to)].pop_front() {
                    let _ = ranks[to as usize].core.handle_control(now, from, m);
                }
            }
            &Step::Tick { micros } => {
                now += Duration::from_micros(u64::from(micros % 2_000_000));
                for r in ranks.iter_mut().filter(|r| r.alive) {
                    if r.core.poll_timeout().is_some_and(|t| t <= now) {
                        r.core.handle_timeout(now);
                    }
                }
            }
            &Step::Kill { rank } => {
                let dead = u32::from(rank) % size;
                if !ranks[dead as usize].alive || ranks.iter().filter(|r| r.alive).count() <= 1 {
                    continue;
                }
                ranks[dead as usize].alive = false;
                for r in 0..size {
                    links[link(dead, r)].clear();
                    links[link(r, dead)].clear();
                }
                for r in ranks.iter_mut().filter(|r| r.alive) {
                    r.core.peer_lost(now, dead);
                }
            }
            Step::InjectDatagram { to, root, seq, len, frag, raw } => {
                injected = true;
                let to = u32::from(*to) % size;
                let d = match raw {
                    Some(b) => Bytes::from(b.clone()),
                    None => {
                        let data = vec![0xEE; usize::from(*len) % 1100];
                        let all = wire::encode_data(JOB, 0, u32::from(*root) % (size + 1), *seq, &data, cfg0.datagram);
                        all[usize::from(*frag) % all.len()].clone()
                    }
                };
                if ranks[to as usize].alive {
                    let _ = ranks[to as usize].core.handle_datagram(now, d);
                }
            }
            Step::InjectControl { to, from, kind, root, a, b, data, raw } => {
                injected = true;
                let (to, from) = (u32::from(*to) % size, u32::from(*from) % size);
                if to == from || !ranks[to as usize].alive {
                    continue;
                }
                let root = u32::from(*root) % (size + 1);
                let m = if *raw {
                    Bytes::from(data.clone())
                } else {
                    match kind % 5 {
                        0 => Control::Ack { root, upto: *a },
                        1 => Control::Report { root, upto: *a },
                        2 => Control::Nack { root, from: *a, to: *b },
                        3 => Control::Data { root, seq: *a, copy: *b & 1 == 1, data: Bytes::from(data.clone()) },
                        _ => Control::PingAck { root, nonce: *a },
                    }
                    .encode()
                };
                let _ = ranks[to as usize].core.handle_control(now, from, m);
            }
        }
        // Collect what every live rank wants sent, and check the bounds.
        for me in 0..size {
            let r = &mut ranks[me as usize];
            if !r.alive {
                continue;
            }
            while let Some(t) = r.core.poll_transmit() {
                match t {
                    Transmit::Multicast(d) => datagrams.push((me, d)),
                    Transmit::Unicast { to, msg } => {
                        assert!(to < size && to != me, "rank {me} sends to {to}");
                        links[link(me, to)].push_back(msg);
                    }
                }
            }
            while r.core.poll_event().is_some() {}
            assert!(r.core.in_flight() <= window, "more messages in flight than the window");
            for root in 0..size {
                assert!(r.core.buffered(root) <= window, "rank {me} holds more of {root}'s stream than the window");
            }
        }
        // The network's own bound: a datagram not delivered soon is as good as lost.
        if datagrams.len() > 256 {
            datagrams.drain(..128);
        }
    }
});
