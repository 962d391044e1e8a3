//! The point-to-point engine, unchanged, on the simulated network: a scripted workload of mixed
//! sizes (eager and rendezvous), exact and wildcard receives posted before and after the messages
//! come, on 1,024 ranks, under frame loss and jitter; and a rank that dies mid-run.

use ferrocomm::Error;
use ferrocomm::p2p::engine::Completion;
use ferrocomm::p2p::{Source, TagMatch};
use ferrocomm_sim::p2p::{P2pRank, script};
use ferrocomm_sim::{Link, NetConfig, Node, Process, SimNet, Time, run};

const LIMIT: Time = 600_000_000_000;

/// Empty, small, at the eager limit, just above it (rendezvous), and larger.
const LENS: [usize; 5] = [0, 8, 1000, 64 << 10, (64 << 10) + 1];

fn workload(n: u32, per_rank: u32, lens: &[usize], cfg: NetConfig) -> ferrocomm_sim::Report {
    let msgs = script(n, per_rank, lens, 3, cfg.seed);
    let net = SimNet::new(n, cfg);
    // Half the ranks post their receives at once, half 50 us later (the messages wait as
    // unexpected, and senders beyond their credit queue).
    let mut ranks: Vec<P2pRank> = (0..n)
        .map(|r| P2pRank::new(Node::with_defaults(&net, r), &msgs, if r % 2 == 0 { 0 } else { 50_000 }))
        .collect();
    let report = run(&net, &mut ranks, LIMIT, |_, _| {}).expect("the run finishes");
    for r in &ranks {
        r.check().unwrap();
    }
    report
}

#[test]
fn mixed_workload_on_1024_ranks() {
    let lens = [&LENS[..], &[200 << 10]].concat();
    let report = workload(1024, 12, &lens, NetConfig::default());
    assert!(report.stats.frames > 1024 * 12, "{:?}", report.stats);
}

#[test]
fn mixed_workload_under_frame_loss_and_jitter() {
    let link = Link::default().with_loss(0.05).with_jitter(30_000);
    // One size above the rendezvous chunk (512 KiB): its data goes in two frames.
    let lens = [&LENS[..], &[600 << 10]].concat();
    let report = workload(256, 18, &lens, NetConfig { seed: 12, link, ..NetConfig::default() });
    assert!(report.stats.retransmissions > 100, "{:?}", report.stats);
}

/// A rank of the workload, watched: the most unexpected messages it ever held from rank 1.
struct Watched {
    inner: P2pRank,
    most: usize,
}

impl Process for Watched {
    fn step(&mut self, now: Time) {
        self.inner.step(now);
        self.most = self.most.max(self.inner.node().engine.unexpected_from(1));
    }
    fn timer(&self) -> Option<Time> {
        self.inner.timer()
    }
    fn is_done(&self) -> bool {
        self.inner.is_done()
    }
}

#[test]
fn credits_bound_what_a_late_receiver_holds() {
    // 400 eager messages from rank 1 to rank 0, whose receives come 1 ms later: at most
    // `max_credit` (32) of them are ever unexpected at rank 0; the rest wait at the sender.
    let n = 2;
    let msgs: Vec<_> = script(n, 400, &[100], 0, 1).into_iter().filter(|m| m.src == 1).collect();
    assert_eq!(msgs.len(), 400);
    let net = SimNet::new(n, NetConfig::default());
    let mut ranks: Vec<Watched> = (0..n)
        .map(|r| {
            let post_at = if r == 0 { 1_000_000 } else { 0 };
            Watched { inner: P2pRank::new(Node::with_defaults(&net, r), &msgs, post_at), most: 0 }
        })
        .collect();
    run(&net, &mut ranks, LIMIT, |_, _| {}).unwrap();
    for r in &ranks {
        r.inner.check().unwrap();
    }
    assert_eq!(ranks[0].most, 32, "the credit limit, reached and not passed");
}

/// Rank 0 waits for a message from rank 1 that never comes: rank 1 dies.
struct Waiter {
    node: Node,
    op: Option<usize>,
    outcome: Option<Result<(), String>>,
    at: Time,
}

impl Process for Waiter {
    fn step(&mut self, now: Time) {
        if self.node.rank != 0 {
            return;
        }
        self.node.pump();
        if self.op.is_none() && self.outcome.is_none() {
            self.op = Some(self.node.recv(1, Source::Rank(1), TagMatch::Exact(5)));
        }
        while let Some((_, c)) = self.node.completion() {
            self.outcome = Some(match c {
                Completion::Recv(Err(Error::PeerLost { rank: 1, .. })) => Ok(()),
                other => Err(format!("{other:?}")),
            });
            self.at = now;
        }
        self.node.flush();
    }
    fn is_done(&self) -> bool {
        self.node.rank != 0 || self.outcome.is_some()
    }
}

#[test]
fn a_rank_that_dies_fails_the_receive_waiting_for_it() {
    let cfg = NetConfig::default();
    let detect = cfg.detect;
    let net = SimNet::new(3, cfg);
    let mut ranks: Vec<Waiter> =
        (0..3).map(|r| Waiter { node: Node::with_defaults(&net, r), op: None, outcome: None, at: 0 }).collect();
    run(&net, &mut ranks, LIMIT, |now, net| {
        if now == 0 {
            net.kill(1);
        }
    })
    .unwrap();
    assert_eq!(ranks[0].outcome, Some(Ok(())));
    assert_eq!(ranks[0].at, detect, "failed when the network reported the death");
}
