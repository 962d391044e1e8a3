//! The skew-tolerant token barrier of chapter 7, sans-IO.
//!
//! A combining tree (degree 8 by default, rank 0 at the top). Every rank, once it and its whole
//! subtree have arrived, sends `Arrive` to its parent, as in a plain combining tree. On top of
//! that one rank holds a token, which means "everyone outside my subtree has arrived"; it starts
//! at rank 0. The holder, once entered, watches its children: when all have arrived it releases
//! everyone at once by one reliable multicast; when exactly one is still missing it passes the
//! token down to that child, which becomes the top of the tree. So the last rank to arrive
//! usually already holds the token and releases everyone immediately: the synchronization delay
//! is one multicast, whatever the size, instead of the tree's height in hops.
//!
//! Race rule: a parent may pass the token while its last child's `Arrive` is on the way. The
//! parent then ignores that `Arrive` and waits only for the release; the child, having sent
//! `Arrive`, still listens for the token as well as for the release, and on getting the token
//! releases at once (its subtree is complete).
//!
//! The driver carries `Arrive` and `Token` over reliable point-to-point, tagged with the barrier's
//! epoch, and the release over reliable multicast.

use std::collections::VecDeque;

use crate::wire::Rank;

/// A point-to-point message of the barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierMsg {
    /// The sender and its whole subtree have arrived.
    Arrive,
    /// Everyone outside the receiver's subtree has arrived.
    Token,
}

/// One rank's part in one barrier.
#[derive(Debug)]
pub struct TokenBarrier {
    me: Rank,
    degree: u32,
    children: Vec<Rank>,
    arrived: Vec<bool>,
    entered: bool,
    token: bool,
    sent_arrive: bool,
    passed_token: bool,
    release: bool,
    done: bool,
    transmit: VecDeque<(Rank, BarrierMsg)>,
}

impl TokenBarrier {
    /// Rank `me` of `size`, tree of `degree` (at least 2).
    pub fn new(me: Rank, size: u32, degree: u32) -> TokenBarrier {
        let degree = degree.max(2);
        let first = u64::from(me) * u64::from(degree) + 1;
        let children: Vec<Rank> =
            (first..first + u64::from(degree)).filter(|&c| c < u64::from(size)).map(|c| c as Rank).collect();
        TokenBarrier {
            me,
            degree,
            arrived: vec![false; children.len()],
            children,
            entered: false,
            token: me == 0,
            sent_arrive: false,
            passed_token: false,
            release: false,
            done: false,
            transmit: VecDeque::new(),
        }
    }

    /// Parent of `r` in the tree (none for rank 0).
    pub fn parent(&self) -> Option<Rank> {
        (self.me > 0).then(|| (self.me - 1) / self.degree)
    }

    /// This rank has entered the barrier.
    pub fn enter(&mut self) {
        self.entered = true;
        self.step();
    }

    /// A barrier message from `from`. Messages that make no sense (an `Arrive` from a non-child,
    /// a `Token` from a non-parent) are ignored.
    pub fn handle(&mut self, from: Rank, msg: BarrierMsg) {
        match msg {
            BarrierMsg::Arrive => {
                // Race rule: after passing the token, a late Arrive from that child is ignored.
                if !self.passed_token
                    && let Some(i) = self.children.iter().position(|&c| c == from)
                {
                    self.arrived[i] = true;
                }
            }
            BarrierMsg::Token => {
                if Some(from) == self.parent() && !self.done {
                    self.token = true;
                }
            }
        }
        self.step();
    }

    /// The release arrived (by multicast): the barrier is over.
    pub fn released(&mut self) {
        self.done = true;
    }

    fn step(&mut self) {
        if !self.entered || self.done {
            return;
        }
        let missing: Vec<usize> = (0..self.children.len()).filter(|&i| !self.arrived[i]).collect();
        if self.token {
            match missing.as_slice() {
                [] => {
                    self.release = true;
                    self.done = true;
                }
                [one] => {
                    self.token = false;
                    self.passed_token = true;
                    self.transmit.push_back((self.children[*one], BarrierMsg::Token));
                }
                _ => {}
            }
        } else if missing.is_empty()
            && !self.sent_arrive
            && let Some(p) = self.parent()
        {
            self.sent_arrive = true;
            self.transmit.push_back((p, BarrierMsg::Arrive));
        }
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<(Rank, BarrierMsg)> {
        self.transmit.pop_front()
    }

    /// True once: this rank must multicast the release now (and is then done).
    pub fn take_release(&mut self) -> bool {
        std::mem::take(&mut self.release)
    }

    /// The barrier is over for this rank.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a barrier of `size` ranks where rank `r` enters at `enter[r]` (arbitrary time units),
    /// messages take `hop` and a release takes `hop` to reach everyone. Returns (who released,
    /// time the last rank left).
    fn run(size: u32, enter: &[u64], hop: u64) -> (Rank, u64) {
        let mut b: Vec<TokenBarrier> = (0..size).map(|r| TokenBarrier::new(r, size, 8)).collect();
        let mut msgs: Vec<(u64, Rank, Rank, BarrierMsg)> = Vec::new();
        let mut release: Option<(u64, Rank)> = None;
        let mut t = 0;
        loop {
            for r in 0..size {
                if enter[r as usize] == t {
                    b[r as usize].enter();
                }
            }
            let due: Vec<_> = msgs.iter().filter(|m| m.0 == t).cloned().collect();
            msgs.retain(|m| m.0 != t);
            for (_, from, to, m) in due {
                b[to as usize].handle(from, m);
            }
            for r in 0..size {
                while let Some((to, m)) = b[r as usize].poll_transmit() {
                    msgs.push((t + hop, r, to, m));
                }
                if b[r as usize].take_release() {
                    assert!(release.is_none(), "two releases");
                    release = Some((t, r));
                }
            }
            if let Some((at, who)) = release
                && t >= at + hop
            {
                for x in &mut b {
                    x.released();
                }
                assert!(b.iter().all(|x| x.is_done()));
                return (who, at + hop);
            }
            t += 1;
            assert!(t < 100_000, "barrier hung");
        }
    }

    #[test]
    fn last_arriving_rank_releases_when_the_skew_is_large() {
        for size in [2, 9, 16, 73] {
            let last = size - 1;
            let mut enter = vec![0; size as usize];
            enter[last as usize] = 1000;
            let (who, left) = run(size, &enter, 10);
            assert_eq!(who, last, "size {size}");
            assert_eq!(left, 1000 + 10, "one multicast after the last arrival, size {size}");
        }
    }

    #[test]
    fn nobody_leaves_before_the_last_arrival_whatever_the_order() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for size in [1, 2, 3, 8, 9, 10, 17, 64, 65] {
            for _ in 0..30 {
                let enter: Vec<u64> = (0..size)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        seed % 50
                    })
                    .collect();
                let last = *enter.iter().max().unwrap();
                let (_, left) = run(size, &enter, 3);
                assert!(left > last, "size {size}: left at {left}, last entered {last}");
            }
        }
    }

    #[test]
    fn race_rule_token_and_arrive_cross() {
        // Rank 0 and its only child arrive together: rank 0 passes the token while rank 1's
        // Arrive is in flight. Rank 0 must ignore the Arrive; rank 1 must release on the token.
        let mut p = TokenBarrier::new(0, 2, 8);
        let mut c = TokenBarrier::new(1, 2, 8);
        p.enter();
        c.enter();
        assert_eq!(p.poll_transmit(), Some((1, BarrierMsg::Token)));
        assert_eq!(c.poll_transmit(), Some((0, BarrierMsg::Arrive)));
        p.handle(1, BarrierMsg::Arrive);
        assert!(!p.take_release() && !p.is_done(), "the parent waits for the release only");
        c.handle(0, BarrierMsg::Token);
        assert!(c.take_release(), "the child releases on the token");
        assert!(c.is_done());
        p.released();
        assert!(p.is_done());
    }

    #[test]
    fn stray_messages_are_ignored() {
        let mut b = TokenBarrier::new(1, 20, 8);
        b.handle(5, BarrierMsg::Token); // not the parent
        b.handle(3, BarrierMsg::Arrive); // not a child
        b.enter();
        assert_eq!(b.poll_transmit(), None, "children 9..=16 have not arrived");
    }
}
