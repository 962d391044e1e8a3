//! The point-to-point engine (`src/p2p/engine.rs`), driven by arbitrary sequences: two honest
//! engines exchanging their frames (delivered in any interleaving, whole or lent, rendezvous data
//! through `data_dest` as a transport does), sends, receives and probes posted and cancelled on
//! either, peers lost (crash or goodbye), and arbitrary frames injected from any rank, honest or
//! not, after the transport's own header checks.
//!
//! Checked after every step: no panic; no operation completes twice; the unexpected messages
//! held for a peer never exceed its credits (the memory bound); every frame an engine emits passes
//! the receiving transport's header checks; a peer that broke the protocol is reported.
#![no_main]

use std::collections::{HashSet, VecDeque};

use arbitrary::Arbitrary;
use bytes::{Bytes, BytesMut};
use ferrocomm::p2p::engine::{Config, Engine, RecvBuf};
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm::transports::wire::{Header, Kind, Limits};
use ferrocomm::transports::{Rank, TransportError};
use libfuzzer_sys::fuzz_target;

/// Honest engines: ranks 0 and 1. Ranks from 2 on exist only as senders of injected frames.
const HONEST: usize = 2;

#[derive(Arbitrary, Debug)]
enum Op {
    Send {
        rank: bool,
        dest: u8,
        context: u8,
        tag: u8,
        len: u16,
        now: bool,
    },
    Recv {
        rank: bool,
        context: u8,
        src: Option<u8>,
        tag: Option<u8>,
        buf: Option<u16>,
        now: bool,
    },
    Probe {
        rank: bool,
        context: u8,
        src: Option<u8>,
        tag: Option<u8>,
    },
    /// Cancels one of the rank's outstanding operations.
    Cancel {
        rank: bool,
        which: u8,
    },
    /// Delivers the next frame on the link toward `to` (lent, or whole).
    Deliver {
        to: bool,
        lend: bool,
    },
    Inject {
        to: bool,
        from: u8,
        header: Fields,
        payload: Vec<u8>,
    },
    Lose {
        rank: bool,
        peer: u8,
        crash: bool,
    },
    Goodbye {
        rank: bool,
    },
    Close {
        rank: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Fields {
    kind: u8,
    flags: u16,
    context: u8,
    tag: u8,
    seq: u8,
    len: u16,
    credit: u32,
    aux: u32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    size: u8,
    eager: u8,
    max_credit: u8,
    credit_sync: u8,
    chunk: u8,
    ops: Vec<Op>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pending {
    Send { dest: Rank },
    Recv { context: u32 },
    Probe { context: u32 },
}

struct Node {
    engine: Engine,
    next_op: usize,
    pending: Vec<(usize, Pending)>,
    done: HashSet<usize>,
}

struct World {
    nodes: Vec<Node>,
    /// Frames in flight toward rank 0 and toward rank 1 (from the other honest rank).
    links: [VecDeque<(Header, Bytes)>; HONEST],
    limits: Limits,
    max_credit: u32,
}

impl World {
    /// What the transport and the driver do with an engine's output.
    fn pump(&mut self) {
        for r in 0..HONEST {
            loop {
                let node = &mut self.nodes[r];
                if let Some((to, h, payload)) = node.engine.poll_transmit() {
                    assert_eq!(h.src, r as Rank);
                    assert_eq!(h.len as usize, payload.len());
                    let checked = Header::decode(&h.encode(), &self.limits);
                    assert_eq!(checked, Ok(h), "an engine emitted a frame its peer refuses");
                    if (to as usize) < HONEST && to as usize != r {
                        self.links[to as usize].push_back((h, payload));
                    }
                    continue;
                }
                if let Some((op, _)) = node.engine.poll_event() {
                    assert!(node.done.insert(op), "operation {op} completed twice");
                    node.pending.retain(|p| p.0 != op);
                    continue;
                }
                if let Some((peer, e)) = node.engine.poll_violation() {
                    // The driver disconnects: both ends learn of it.
                    self.lose(r, peer, TransportError::Wire(e));
                    continue;
                }
                break;
            }
            let e = &self.nodes[r].engine;
            for p in 0..self.limits.world_size {
                // The count includes the frame that broke the credit rule, when one did (it was
                // dropped, and the peer is lost).
                let limit = self.max_credit as usize + usize::from(e.lost(p).is_some());
                if p != r as Rank {
                    assert!(
                        e.unexpected_from(p) <= limit,
                        "rank {r} holds {} unexpected messages of {p} beyond its {} credits",
                        e.unexpected_from(p),
                        self.max_credit
                    );
                }
            }
        }
    }

    /// The connection between honest rank `r` and `peer` is gone.
    fn lose(&mut self, r: usize, peer: Rank, why: TransportError) {
        self.nodes[r].engine.peer_lost(peer, why);
        if (peer as usize) < HONEST && peer as usize != r {
            self.links[peer as usize].clear();
            self.links[r].clear();
            self.nodes[peer as usize].engine.peer_lost(r as Rank, TransportError::Closed);
        }
    }

    /// A frame arrives at `to` from `from`, as the transport hands it over.
    fn arrive(&mut self, to: usize, from: Rank, h: Header, payload: Bytes, lend: bool) {
        let e = &mut self.nodes[to].engine;
        if e.lost(from).is_some() {
            return; // The transport closed that connection.
        }
        if h.kind == Kind::Data {
            match e.data_dest(from, &h) {
                Ok(Some(dest)) => {
                    assert_eq!(dest.len(), h.len as usize);
                    let n = dest.len().min(payload.len());
                    dest[..n].copy_from_slice(&payload[..n]);
                }
                Ok(None) => {}
                Err(err) => return self.lose(to, from, TransportError::Wire(err)),
            }
            e.handle_frame(from, h, Bytes::new());
        } else if lend {
            e.handle_frame_ref(from, h, &payload);
        } else {
            e.handle_frame(from, h, payload);
        }
    }
}

fn source(s: Option<u8>, size: u32) -> Source {
    s.map_or(Source::Any, |s| Source::Rank(u32::from(s) % size))
}

fn tag(t: Option<u8>) -> TagMatch {
    t.map_or(TagMatch::Any, |t| TagMatch::Exact(u64::from(t % 4)))
}

fuzz_target!(|input: Input| {
    let size = u32::from(input.size % 3) + 2;
    let max_credit = u32::from(input.max_credit % 8) + 1;
    let cfg = Config {
        eager_limit: usize::from(input.eager % 128),
        max_credit,
        credit_sync: u32::from(input.credit_sync) % max_credit + 1,
        chunk: usize::from(input.chunk % 200) + 1,
        max_message: 4096,
    };
    let limits =
        Limits { world_size: size, eager_limit: cfg.eager_limit, chunk: cfg.chunk, max_message: cfg.max_message };
    let nodes = (0..HONEST as Rank)
        .map(|r| Node { engine: Engine::new(r, size, cfg), next_op: 0, pending: Vec::new(), done: HashSet::new() })
        .collect();
    let mut w = World { nodes, links: Default::default(), limits, max_credit };

    for op in input.ops.iter().take(1000) {
        match op {
            &Op::Send { rank, dest, context, tag, len, now } => {
                let n = &mut w.nodes[usize::from(rank)];
                let (dest, context, tag) = (u32::from(dest) % size, u32::from(context % 3), u64::from(tag % 4));
                let data = Bytes::from(vec![tag as u8; usize::from(len) % (cfg.max_message + 1)]);
                let data = if now {
                    match n.engine.send_now(dest, context, tag, data) {
                        Ok(_) => continue,
                        Err(data) => data,
                    }
                } else {
                    data
                };
                let key = n.next_op;
                n.next_op += 1;
                n.pending.push((key, Pending::Send { dest }));
                n.engine.post_send(key, dest, context, tag, data);
            }
            &Op::Recv { rank, context, src, tag: t, buf, now } => {
                let n = &mut w.nodes[usize::from(rank)];
                let context = u32::from(context % 3);
                let mut b = buf.map_or(RecvBuf::Alloc, |l| RecvBuf::User(BytesMut::zeroed(usize::from(l) % 5000)));
                if now {
                    match n.engine.recv_now(context, source(src, size), tag(t), b) {
                        Ok(_) => continue,
                        Err(back) => b = back,
                    }
                }
                let key = n.next_op;
                n.next_op += 1;
                n.pending.push((key, Pending::Recv { context }));
                n.engine.post_recv(key, context, source(src, size), tag(t), b);
            }
            &Op::Probe { rank, context, src, tag: t } => {
                let n = &mut w.nodes[usize::from(rank)];
                let context = u32::from(context % 3);
                let _ = n.engine.iprobe(context, source(src, size), tag(t));
                let key = n.next_op;
                n.next_op += 1;
                n.pending.push((key, Pending::Probe { context }));
                n.engine.post_probe(key, context, source(src, size), tag(t));
            }
            &Op::Cancel { rank, which } => {
                let n = &mut w.nodes[usize::from(rank)];
                if n.pending.is_empty() {
                    continue;
                }
                let (key, what) = n.pending.remove(usize::from(which) % n.pending.len());
                match what {
                    Pending::Send { dest } => n.engine.cancel_send(key, dest),
                    Pending::Recv { context } => n.engine.cancel_recv(key, context),
                    Pending::Probe { context } => n.engine.cancel_probe(key, context),
                }
                // A cancelled operation may still complete once (its completion is then dropped).
            }
            &Op::Deliver { to, lend } => {
                let to = usize::from(to);
                if let Some((h, p)) = w.links[to].pop_front() {
                    w.arrive(to, (1 - to) as Rank, h, p, lend);
                }
            }
            Op::Inject { to, from, header: f, payload } => {
                let to = usize::from(*to);
                let from = u32::from(*from) % size;
                if from as usize == to {
                    continue;
                }
                let kind = [Kind::Hello, Kind::Eager, Kind::Rts, Kind::Cts, Kind::Data, Kind::Credit, Kind::Bye]
                    [usize::from(f.kind % 7)];
                let h = Header {
                    kind,
                    flags: f.flags,
                    src: from,
                    context: u32::from(f.context % 3),
                    tag: u64::from(f.tag % 4),
                    seq: u64::from(f.seq % 8),
                    len: u32::from(f.len),
                    credit: f.credit,
                    aux: u64::from(f.aux),
                };
                // The transport's checks come first: a header they refuse closes the connection.
                if let Err(e) = Header::decode(&h.encode(), &w.limits) {
                    w.lose(to, from, TransportError::Wire(e));
                } else {
                    let mut p = payload.clone();
                    p.resize(h.len as usize, 0);
                    w.arrive(to, from, h, Bytes::from(p), f.flags & 1 == 0);
                }
            }
            &Op::Lose { rank, peer, crash } => {
                let r = usize::from(rank);
                let peer = u32::from(peer) % size;
                if peer as usize != r {
                    w.lose(r, peer, if crash { TransportError::Closed } else { TransportError::Left });
                }
            }
            &Op::Goodbye { rank } => w.nodes[usize::from(rank)].engine.say_goodbye(),
            &Op::Close { rank } => w.nodes[usize::from(rank)].engine.close(),
        }
        w.pump();
    }
    // Let every frame in flight arrive.
    for _ in 0..10_000 {
        let Some(to) = (0..HONEST).find(|&t| !w.links[t].is_empty()) else { break };
        let (h, p) = w.links[to].pop_front().unwrap();
        w.arrive(to, (1 - to) as Rank, h, p, false);
        w.pump();
    }
});
