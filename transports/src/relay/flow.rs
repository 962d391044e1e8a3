//! Flow control of routes through a proxy: a window of bytes per route, so that a forwarding rank
//! never holds more than a bounded amount of staged envelopes for any pair of ranks, whatever its
//! peers send. Sans-IO: envelopes and credits come in, decisions go out.
//!
//! A route is (source, proxy, destination). The source keeps at most [`window`] bytes of
//! envelopes unacknowledged on it ([`Sender`]); envelopes beyond wait at the source, in order
//! (they are slices of the source's own messages, not a peer's). The destination returns a credit
//! for every envelope it takes in, to the proxy it came from; the proxy subtracts it from what it
//! holds for that route and passes it on to the source ([`Ledger`]). The proxy therefore holds, for
//! each route, at most a window of bytes (those it received and whose credit has not passed back
//! through it), and a source that sends beyond its window, or a destination that returns more
//! than it was sent, breaks the protocol.
//!
//! An envelope larger than the window (it cannot be: a window holds at least two data chunks) is
//! still let through when nothing is outstanding, by both sides alike, so no route can deadlock.
//!
//! A route's accounts are dropped when one of its ranks is lost; credit for such a route may
//! still be on its way (a destination returns credit for what it took before it heard of the
//! source's loss), so a credit naming a lost rank is ignored, not a breach of the protocol.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::wire::{HEADER_LEN, Limits, Rank, WireError};

/// The bytes of envelopes a route may have outstanding, the same on every rank of a job (the
/// limits are): at least 1 MiB, and at least two of the largest envelopes.
pub fn window(limits: &Limits) -> usize {
    (1usize << 20).max(2 * (limits.chunk + HEADER_LEN))
}

/// Whether `len` more bytes fit beside `outstanding` in a window of `window` bytes.
fn fits(outstanding: usize, len: usize, window: usize) -> bool {
    outstanding == 0 || outstanding + len <= window
}

/// One route as the source sees it.
struct Route<T> {
    outstanding: usize,
    waiting: VecDeque<(usize, T)>,
}

impl<T> Default for Route<T> {
    fn default() -> Self {
        Route { outstanding: 0, waiting: VecDeque::new() }
    }
}

/// The source's side: what may leave now on each route, and what waits for credit. `T` is
/// whatever the caller needs to send an envelope later.
pub struct Sender<T> {
    window: usize,
    routes: HashMap<(Rank, Rank), Route<T>>,
    ready: VecDeque<(Rank, Rank, T)>,
    /// Proxies and destinations lost: late credits naming them are ignored.
    lost: HashSet<Rank>,
}

impl<T> Sender<T> {
    /// A sender with windows of `window` bytes.
    pub fn new(window: usize) -> Sender<T> {
        Sender { window, routes: HashMap::new(), ready: VecDeque::new(), lost: HashSet::new() }
    }

    /// An envelope of `len` bytes for `dest` through `proxy`: it becomes ready at once if the
    /// window allows and nothing waits before it, else it waits.
    pub fn push(&mut self, proxy: Rank, dest: Rank, len: usize, item: T) {
        let r = self.routes.entry((proxy, dest)).or_default();
        if r.waiting.is_empty() && fits(r.outstanding, len, self.window) {
            r.outstanding += len;
            self.ready.push_back((proxy, dest, item));
        } else {
            r.waiting.push_back((len, item));
        }
    }

    /// `proxy` returned `bytes` of credit for the route to `dest`: releases what now fits.
    pub fn credit(&mut self, proxy: Rank, dest: Rank, bytes: usize) -> Result<(), WireError> {
        if self.lost.contains(&proxy) || self.lost.contains(&dest) {
            return Ok(());
        }
        let Some(r) = self.routes.get_mut(&(proxy, dest)) else {
            return Err(WireError::Link("relay credit for a route with nothing outstanding"));
        };
        if bytes > r.outstanding {
            return Err(WireError::Link("relay credit beyond the bytes sent"));
        }
        r.outstanding -= bytes;
        while let Some(&(len, _)) = r.waiting.front() {
            if !fits(r.outstanding, len, self.window) {
                break;
            }
            let (len, item) = r.waiting.pop_front().expect("a waiting envelope");
            r.outstanding += len;
            self.ready.push_back((proxy, dest, item));
        }
        Ok(())
    }

    /// The next envelope that may leave: (proxy, dest, item).
    pub fn poll(&mut self) -> Option<(Rank, Rank, T)> {
        self.ready.pop_front()
    }

    /// The proxy is gone: what waited on its routes, per destination, in order. Outstanding
    /// bytes are forgotten (the envelopes are lost with the proxy).
    pub fn proxy_lost(&mut self, proxy: Rank) -> Vec<(Rank, T)> {
        self.lost.insert(proxy);
        let mut keys: Vec<_> = self.routes.keys().copied().filter(|k| k.0 == proxy).collect();
        keys.sort();
        let mut out = Vec::new();
        for k in keys {
            let r = self.routes.remove(&k).expect("a route");
            out.extend(r.waiting.into_iter().map(|(_, item)| (k.1, item)));
        }
        out
    }

    /// Forgets the routes to `dest` (it is gone).
    pub fn dest_lost(&mut self, dest: Rank) {
        self.lost.insert(dest);
        self.routes.retain(|k, _| k.1 != dest);
    }

    /// True while any envelope waits for credit.
    pub fn has_waiting(&self) -> bool {
        !self.ready.is_empty() || self.routes.values().any(|r| !r.waiting.is_empty())
    }

    /// Bytes outstanding on the route through `proxy` to `dest`.
    pub fn outstanding(&self, proxy: Rank, dest: Rank) -> usize {
        self.routes.get(&(proxy, dest)).map_or(0, |r| r.outstanding)
    }
}

/// The proxy's side: bytes held per (source, destination).
pub struct Ledger {
    window: usize,
    held: HashMap<(Rank, Rank), usize>,
    /// Ranks lost: late credits for their routes are ignored.
    lost: HashSet<Rank>,
}

impl Ledger {
    /// A ledger with windows of `window` bytes.
    pub fn new(window: usize) -> Ledger {
        Ledger { window, held: HashMap::new(), lost: HashSet::new() }
    }

    /// An envelope of `len` bytes from `src` to forward to `dest`: an error if `src` exceeds
    /// its window.
    pub fn take(&mut self, src: Rank, dest: Rank, len: usize) -> Result<(), WireError> {
        let h = self.held.entry((src, dest)).or_insert(0);
        if !fits(*h, len, self.window) {
            return Err(WireError::Link("relay window exceeded"));
        }
        *h += len;
        Ok(())
    }

    /// `dest` returned `bytes` of credit for envelopes from `src`: an error if more than held
    /// (ignored if either is lost).
    pub fn credit(&mut self, src: Rank, dest: Rank, bytes: usize) -> Result<(), WireError> {
        if self.lost.contains(&src) || self.lost.contains(&dest) {
            return Ok(());
        }
        match self.held.get_mut(&(src, dest)) {
            Some(h) if *h >= bytes => {
                *h -= bytes;
                Ok(())
            }
            _ => Err(WireError::Link("relay credit beyond the bytes forwarded")),
        }
    }

    /// Forgets every route from or to `rank` (it is gone).
    pub fn lost(&mut self, rank: Rank) {
        self.lost.insert(rank);
        self.held.retain(|k, _| k.0 != rank && k.1 != rank);
    }

    /// Bytes held for `src -> dest`.
    pub fn held(&self, src: Rank, dest: Rank) -> usize {
        self.held.get(&(src, dest)).copied().unwrap_or(0)
    }

    /// Bytes held for every route together.
    pub fn total(&self) -> usize {
        self.held.values().sum()
    }
}

/// The destination's side: credit owed per (proxy, source), returned in one frame each.
#[derive(Default)]
pub struct Owed {
    owed: HashMap<(Rank, Rank), usize>,
}

impl Owed {
    /// An envelope of `len` bytes from `src` came through `proxy`.
    pub fn took(&mut self, proxy: Rank, src: Rank, len: usize) {
        *self.owed.entry((proxy, src)).or_insert(0) += len;
    }

    /// Everything owed: (proxy, src, bytes), once.
    pub fn drain(&mut self) -> Vec<(Rank, Rank, usize)> {
        let mut v: Vec<_> = self.owed.drain().map(|((p, s), b)| (p, s, b)).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: usize = 1000;

    #[test]
    fn a_source_keeps_at_most_a_window_outstanding_and_keeps_order() {
        let mut s = Sender::new(W);
        for i in 0..5 {
            s.push(1, 2, 400, i);
        }
        // Two fit (800); the third would make 1200.
        assert_eq!(s.poll(), Some((1, 2, 0)));
        assert_eq!(s.poll(), Some((1, 2, 1)));
        assert_eq!(s.poll(), None);
        assert_eq!(s.outstanding(1, 2), 800);
        assert!(s.has_waiting());
        // Another route is independent.
        s.push(1, 3, 900, 10);
        assert_eq!(s.poll(), Some((1, 3, 10)));
        // A credit of 400 releases one; one of 800 the last two.
        s.credit(1, 2, 400).unwrap();
        assert_eq!(s.poll(), Some((1, 2, 2)));
        assert_eq!(s.poll(), None);
        s.credit(1, 2, 800).unwrap();
        assert_eq!((s.poll(), s.poll(), s.poll()), (Some((1, 2, 3)), Some((1, 2, 4)), None));
        assert!(!s.has_waiting());
        // A small envelope does not overtake a waiting large one.
        s.push(1, 3, 200, 11);
        s.push(1, 3, 10, 12);
        assert_eq!(s.poll(), None);
        s.credit(1, 3, 900).unwrap();
        assert_eq!((s.poll(), s.poll()), (Some((1, 3, 11)), Some((1, 3, 12))));
    }

    #[test]
    fn bad_credits_are_errors() {
        let mut s = Sender::<()>::new(W);
        assert!(s.credit(1, 2, 1).is_err());
        s.push(1, 2, 100, ());
        assert!(s.credit(1, 2, 101).is_err());
        s.credit(1, 2, 100).unwrap();
        let mut l = Ledger::new(W);
        assert!(l.credit(0, 2, 1).is_err());
        l.take(0, 2, 10).unwrap();
        assert!(l.credit(0, 2, 11).is_err());
        assert!(l.credit(2, 0, 10).is_err(), "credits are per direction");
        l.credit(0, 2, 10).unwrap();
    }

    #[test]
    fn an_oversize_envelope_passes_alone() {
        let mut s = Sender::new(W);
        s.push(1, 2, 5000, 0);
        s.push(1, 2, 1, 1);
        assert_eq!((s.poll(), s.poll()), (Some((1, 2, 0)), None));
        let mut l = Ledger::new(W);
        l.take(0, 2, 5000).unwrap();
        assert!(l.take(0, 2, 1).is_err());
        s.credit(1, 2, 5000).unwrap();
        l.credit(0, 2, 5000).unwrap();
        assert_eq!(s.poll(), Some((1, 2, 1)));
        l.take(0, 2, 1).unwrap();
    }

    /// A source, a proxy and a destination that takes envelopes in only when told: whatever the
    /// source pushes, the proxy never holds more than a window per route, and every envelope
    /// arrives, in order.
    #[test]
    fn the_proxy_holds_at_most_a_window_per_route() {
        let (src, proxy, dest) = (0, 1, 2);
        let mut s = Sender::new(W);
        let mut l = Ledger::new(W);
        let mut o = Owed::default();
        let mut at_proxy = VecDeque::new();
        let mut arrived = Vec::new();
        let sizes: Vec<usize> = (0..200).map(|i| 1 + (i * 37) % 600).collect();
        for (i, &len) in sizes.iter().enumerate() {
            s.push(proxy, dest, len, (i, len));
        }
        let mut max_held = 0;
        for step in 0.. {
            while let Some((p, d, (i, len))) = s.poll() {
                assert_eq!((p, d), (proxy, dest));
                l.take(src, dest, len).expect("the source keeps to its window");
                at_proxy.push_back((i, len));
            }
            max_held = max_held.max(l.held(src, dest));
            // The destination takes one envelope every other step (a slow last hop).
            if step % 2 == 0
                && let Some((i, len)) = at_proxy.pop_front()
            {
                arrived.push(i);
                o.took(proxy, src, len);
            }
            for (p, from, bytes) in o.drain() {
                assert_eq!((p, from), (proxy, src));
                l.credit(src, dest, bytes).unwrap();
                s.credit(proxy, dest, bytes).unwrap();
            }
            if arrived.len() == sizes.len() {
                break;
            }
        }
        assert!(max_held <= W, "{max_held}");
        assert_eq!(arrived, (0..sizes.len()).collect::<Vec<_>>());
        assert_eq!((l.total(), s.outstanding(proxy, dest)), (0, 0));
    }

    #[test]
    fn a_source_beyond_its_window_is_refused_and_losses_clear() {
        let mut l = Ledger::new(W);
        l.take(0, 2, 600).unwrap();
        l.take(0, 2, 400).unwrap();
        assert_eq!(l.take(0, 2, 1), Err(WireError::Link("relay window exceeded")));
        l.take(3, 2, 1000).unwrap();
        l.lost(2);
        assert_eq!(l.total(), 0);
        // Credit still on its way for a lost rank's routes is not a breach.
        l.credit(3, 2, 1000).unwrap();
        l.credit(2, 3, 5).unwrap();
        assert!(l.credit(3, 4, 1).is_err(), "other routes keep their accounts");
        let mut s = Sender::new(W);
        s.push(1, 2, 900, 'a');
        s.push(1, 2, 900, 'b');
        s.push(1, 3, 900, 'c');
        s.push(1, 3, 900, 'd');
        s.push(4, 3, 900, 'e');
        while s.poll().is_some() {}
        assert_eq!(s.proxy_lost(1), vec![(2, 'b'), (3, 'd')]);
        assert_eq!(s.outstanding(4, 3), 900);
        s.dest_lost(3);
        assert_eq!(s.outstanding(4, 3), 0);
        s.credit(4, 3, 900).unwrap();
        s.credit(1, 2, 900).unwrap();
        assert!(s.credit(4, 2, 1).is_err(), "other routes keep their accounts");
    }

    #[test]
    fn the_window_holds_two_chunks() {
        let limits = Limits { world_size: 4, eager_limit: 1 << 12, chunk: 4 << 20, max_message: 1 << 30 };
        assert_eq!(window(&limits), 2 * (4 << 20) + 2 * HEADER_LEN);
        assert_eq!(window(&Limits { chunk: 1 << 16, ..limits }), 1 << 20);
    }
}
