//! The route planner: per message, the direct connection or a path staged through a proxy rank,
//! from per-hop costs. Sans-IO: costs come in (a calibration file, or measurements), choices go
//! out.
//!
//! A hop costs `latency + bytes / bandwidth`. A path through a proxy is a pipeline (as in
//! MVAPICH-PRISM): the message crosses in pieces of `piece` bytes, each forwarded from a staging
//! buffer as soon as it is whole, so the first piece pays both hops and the rest stream at the
//! slower hop's pace:
//!
//! ```text
//! direct(n) = l + n / b
//! staged(n) = l1 + l2 + o + p / b1 + p / b2 + (n - p) / min(b1, b2),   p = min(piece, n)
//! ```
//!
//! where `o` is the proxy's cost per message (a copy-free forward is cheap, but it is a hop
//! through another process's progress loop). The planner keeps, per peer, the candidates and,
//! for each, the sizes at which it is fastest: a small message goes direct (one latency), a large
//! one takes a staged path whose bottleneck is faster than the direct link.

use std::collections::HashMap;
use std::time::Duration;

use crate::wire::Rank;

/// What one hop costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hop {
    /// One-way latency, seconds.
    pub latency: f64,
    /// Bytes per second.
    pub bandwidth: f64,
}

impl Hop {
    fn time(&self, n: f64) -> f64 {
        self.latency + n / self.bandwidth
    }
}

/// How a message reaches its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// Over the direct connection.
    Direct,
    /// Staged through this rank.
    Via(Rank),
}

/// Per-hop costs between ranks, symmetric unless both directions are given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Costs {
    hops: HashMap<(Rank, Rank), Hop>,
    /// Assumed for a connected pair the costs do not name.
    pub default: Option<Hop>,
}

/// A calibration file that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("calibration line {line}: {reason}")]
pub struct CalibrationError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

impl Costs {
    /// Sets the cost of `from -> to` (and of `to -> from`, unless that is set already).
    pub fn set(&mut self, from: Rank, to: Rank, hop: Hop) {
        self.hops.insert((from, to), hop);
        self.hops.entry((to, from)).or_insert(hop);
    }

    /// The cost of `from -> to`.
    pub fn get(&self, from: Rank, to: Rank) -> Option<Hop> {
        self.hops.get(&(from, to)).copied().or(self.default)
    }

    /// Reads a calibration file: one hop per line, `FROM TO LATENCY_US BANDWIDTH_MBPS` (ranks,
    /// microseconds, 10^6 bytes per second), or `default LATENCY_US BANDWIDTH_MBPS`; `#` starts a
    /// comment. A line for one direction sets the other too, unless a line of its own sets it.
    pub fn parse(text: &str) -> Result<Costs, CalibrationError> {
        let mut c = Costs::default();
        let mut explicit = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: &str| CalibrationError { line: i + 1, reason: format!("{reason}: {raw:?}") };
            let f: Vec<&str> = line.split_whitespace().collect();
            let num = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
            let hop = |l: &str, b: &str| -> Result<Hop, CalibrationError> {
                let latency = num(l).ok_or_else(|| bad("latency is not a number of microseconds"))? * 1e-6;
                let mbps = num(b).filter(|&v| v > 0.0).ok_or_else(|| bad("bandwidth is not a positive MB/s"))?;
                Ok(Hop { latency, bandwidth: mbps * 1e6 })
            };
            match f[..] {
                ["default", l, b] => c.default = Some(hop(l, b)?),
                [from, to, l, b] => {
                    let rank = |s: &str| s.parse::<Rank>().map_err(|_| bad("not a rank"));
                    let (from, to) = (rank(from)?, rank(to)?);
                    let h = hop(l, b)?;
                    c.hops.insert((from, to), h);
                    explicit.push((from, to));
                    if !explicit.contains(&(to, from)) {
                        c.hops.insert((to, from), h);
                    }
                }
                _ => {
                    return Err(bad("expected FROM TO LATENCY_US BANDWIDTH_MBPS or default LATENCY_US BANDWIDTH_MBPS"));
                }
            }
        }
        Ok(c)
    }

    /// Every hop named (not the default), sorted.
    pub fn hops(&self) -> Vec<(Rank, Rank, Hop)> {
        let mut v: Vec<_> = self.hops.iter().map(|(&(a, b), &h)| (a, b, h)).collect();
        v.sort_by_key(|x| (x.0, x.1));
        v
    }

    /// Writes the costs in the form [`Costs::parse`] reads.
    pub fn to_text(&self) -> String {
        let mut keys: Vec<_> = self.hops.keys().copied().collect();
        keys.sort();
        let mut s = String::from("# from to latency_us bandwidth_MBps\n");
        if let Some(d) = self.default {
            s += &format!("default {:.3} {:.3}\n", d.latency * 1e6, d.bandwidth / 1e6);
        }
        for (a, b) in keys {
            let h = self.hops[&(a, b)];
            s += &format!("{a} {b} {:.3} {:.3}\n", h.latency * 1e6, h.bandwidth / 1e6);
        }
        s
    }
}

/// What a start-up probe of one hop measured: round trips of a few bytes, and one burst of
/// bytes sent one way, timed from its first byte's send to the receiver's one-byte answer.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeSample {
    /// Each round trip, seconds.
    pub round_trips: Vec<f64>,
    /// Bytes of the burst.
    pub bytes: usize,
    /// Seconds from the burst's start to its answer.
    pub secs: f64,
}

impl ProbeSample {
    /// The hop it measured: half the median round trip; the burst's bytes over its time less one
    /// round trip (the answer's way back and the first byte's way there). `None` if it measured
    /// nothing usable.
    pub fn hop(&self) -> Option<Hop> {
        let mut rtts: Vec<f64> = self.round_trips.iter().copied().filter(|t| t.is_finite() && *t >= 0.0).collect();
        if rtts.is_empty() || self.bytes == 0 || !self.secs.is_finite() || self.secs <= 0.0 {
            return None;
        }
        rtts.sort_by(f64::total_cmp);
        let rtt = rtts[rtts.len() / 2];
        // A burst that took no longer than a round trip says only that the hop is fast: count
        // it as taking at least a tenth of its time beyond the round trip.
        let transfer = (self.secs - rtt).max(self.secs / 10.0);
        Some(Hop { latency: rtt / 2.0, bandwidth: self.bytes as f64 / transfer })
    }
}

/// The time of `n` bytes over `direct`.
pub fn direct_time(direct: Hop, n: usize) -> f64 {
    direct.time(n as f64)
}

/// The time of `n` bytes staged through a proxy over `first` then `second`, in pieces of `piece`
/// bytes, with `overhead` seconds at the proxy.
pub fn staged_time(first: Hop, second: Hop, piece: usize, overhead: f64, n: usize) -> f64 {
    let n = n as f64;
    let p = (piece as f64).min(n);
    let slow = first.bandwidth.min(second.bandwidth);
    first.latency + second.latency + overhead + p / first.bandwidth + p / second.bandwidth + (n - p) / slow
}

/// A peer's routes: which to take for a message of a given size.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerPlan {
    /// `(from_bytes, route)`, ascending: messages of at least `from_bytes` take `route` (up to
    /// the next entry). The first entry starts at 0.
    pub steps: Vec<(usize, Route)>,
}

impl PeerPlan {
    /// The route of a message of `n` bytes.
    pub fn route(&self, n: usize) -> Route {
        self.steps.iter().rev().find(|(from, _)| n >= *from).map_or(Route::Direct, |s| s.1)
    }
}

/// The time a route takes for a message of a given size.
type TimeOf = Box<dyn Fn(usize) -> f64>;

/// Plans every peer of rank `me`.
#[derive(Clone, Debug)]
pub struct Planner {
    /// Pieces a staged message is cut into.
    pub piece: usize,
    /// The proxy's cost per message, seconds.
    pub overhead: f64,
}

impl Default for Planner {
    fn default() -> Self {
        Planner { piece: 128 * 1024, overhead: Duration::from_micros(30).as_secs_f64() }
    }
}

impl Planner {
    /// The plan for `me -> peer`: `connected(a, b)` says which pairs have a direct connection;
    /// `proxies` are the ranks that may forward. `None` if `peer` cannot be reached at all.
    pub fn plan(
        &self,
        me: Rank,
        peer: Rank,
        costs: &Costs,
        connected: impl Fn(Rank, Rank) -> bool,
        proxies: impl Iterator<Item = Rank>,
    ) -> Option<PeerPlan> {
        let direct = connected(me, peer).then(|| costs.get(me, peer));
        let mut candidates: Vec<(Route, TimeOf)> = Vec::new();
        match direct {
            Some(Some(h)) => candidates.push((Route::Direct, Box::new(move |n| direct_time(h, n)))),
            // Connected, cost unknown: direct, and no proxy is compared with it.
            Some(None) => return Some(PeerPlan { steps: vec![(0, Route::Direct)] }),
            None => {}
        }
        let mut fallback = None;
        for p in proxies.filter(|&p| p != me && p != peer && connected(me, p) && connected(p, peer)) {
            fallback.get_or_insert(p);
            if let (Some(a), Some(b)) = (costs.get(me, p), costs.get(p, peer)) {
                let (piece, o) = (self.piece, self.overhead);
                candidates.push((Route::Via(p), Box::new(move |n| staged_time(a, b, piece, o, n))));
            }
        }
        if candidates.is_empty() {
            // No direct connection and no costs: the first proxy that reaches both.
            return fallback.map(|p| PeerPlan { steps: vec![(0, Route::Via(p))] });
        }
        // The fastest candidate at each size; the winners change at most a few times, so sample
        // sizes on a geometric grid and bisect each change to the byte.
        let best = |n: usize| {
            candidates
                .iter()
                .map(|(r, t)| (*r, t(n)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(r, _)| r)
                .expect("a candidate")
        };
        // (At 0 bytes, paths of equal latency tie: the 1-byte choice stands for it.)
        let mut steps = vec![(0, best(1))];
        let mut prev = 0usize;
        let mut n = 1usize;
        while n <= 1 << 40 {
            let r = best(n);
            if r != steps.last().expect("a step").1 {
                let (mut lo, mut hi) = (prev, n);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if best(mid) == r { hi = mid } else { lo = mid }
                }
                steps.push((hi, r));
            }
            prev = n;
            n *= 2;
        }
        Some(PeerPlan { steps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn hop(us: f64, mbps: f64) -> Hop {
        Hop { latency: us * 1e-6, bandwidth: mbps * MB }
    }

    /// Ranks 0 (A), 1 (B, the proxy), 2 (C).
    fn costs(direct: Option<Hop>, via: Hop) -> (Costs, impl Fn(Rank, Rank) -> bool) {
        let mut c = Costs::default();
        c.set(0, 1, via);
        c.set(1, 2, via);
        if let Some(d) = direct {
            c.set(0, 2, d);
        }
        let has_direct = direct.is_some();
        (c, move |a: Rank, b: Rank| has_direct || (a.min(b), a.max(b)) != (0, 2))
    }

    #[test]
    fn a_slow_direct_link_loses_large_messages_to_the_staged_path() {
        let (c, connected) = costs(Some(hop(50.0, 12.5)), hop(60.0, 100.0));
        let plan = Planner::default().plan(0, 2, &c, connected, 0..3).unwrap();
        assert_eq!(plan.route(8), Route::Direct);
        assert_eq!(plan.route(4 << 20), Route::Via(1));
        assert_eq!(plan.steps.len(), 2, "{plan:?}");
        // At the crossover the two cost the same, to within a byte's worth.
        let x = plan.steps[1].0;
        let (d, s) =
            (direct_time(hop(50.0, 12.5), x), staged_time(hop(60.0, 100.0), hop(60.0, 100.0), 128 << 10, 30e-6, x));
        assert!(s <= d && d - s < 1.0 / (12.5 * MB) * 2.0, "{x}: direct {d}, staged {s}");
        // The staged path at 4 MiB: about 8x the slow link's time.
        let n = 4 << 20;
        let ratio =
            direct_time(hop(50.0, 12.5), n) / staged_time(hop(60.0, 100.0), hop(60.0, 100.0), 128 << 10, 30e-6, n);
        assert!(ratio > 7.0, "{ratio}");
    }

    #[test]
    fn a_healthy_direct_link_is_always_chosen() {
        let (c, connected) = costs(Some(hop(20.0, 1000.0)), hop(20.0, 1000.0));
        let plan = Planner::default().plan(0, 2, &c, connected, 0..3).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Direct)]);
        for n in [0, 1, 64 << 10, 4 << 20, 1 << 30] {
            assert_eq!(plan.route(n), Route::Direct);
        }
    }

    #[test]
    fn no_direct_path_goes_through_a_proxy_with_or_without_costs() {
        let (c, connected) = costs(None, hop(60.0, 100.0));
        let plan = Planner::default().plan(0, 2, &c, &connected, 0..3).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Via(1))]);
        let plan = Planner::default().plan(0, 2, &Costs::default(), &connected, 0..3).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Via(1))]);
        // Nobody reaches both.
        assert_eq!(Planner::default().plan(0, 2, &c, |a, b| a.min(b) == 0 && a.max(b) == 1, 0..3), None);
        // Direct, costs unknown: direct.
        let plan = Planner::default().plan(0, 1, &Costs::default(), &connected, 0..3).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Direct)]);
    }

    #[test]
    fn the_faster_of_two_proxies_wins() {
        let mut c = Costs::default();
        c.set(0, 1, hop(10.0, 50.0));
        c.set(1, 3, hop(10.0, 50.0));
        c.set(0, 2, hop(10.0, 500.0));
        c.set(2, 3, hop(10.0, 400.0));
        let connected = |a: Rank, b: Rank| (a.min(b), a.max(b)) != (0, 3);
        let plan = Planner::default().plan(0, 3, &c, connected, 0..4).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Via(2))]);
    }

    #[test]
    fn probe_samples_become_hops() {
        let s = ProbeSample { round_trips: vec![0.0002, 0.0001, 0.009, 0.0001, 0.0001], bytes: 1 << 20, secs: 0.0801 };
        let h = s.hop().unwrap();
        assert!((h.latency - 50e-6).abs() < 1e-9, "{h:?}");
        assert!((h.bandwidth - (1 << 20) as f64 / 0.08).abs() < 1.0, "{h:?}");
        // A burst faster than a round trip still gives a finite, large bandwidth.
        let fast = ProbeSample { round_trips: vec![0.001], bytes: 1 << 20, secs: 0.0005 }.hop().unwrap();
        assert!(fast.bandwidth.is_finite() && fast.bandwidth > 1e9, "{fast:?}");
        assert_eq!(ProbeSample { round_trips: vec![], bytes: 1, secs: 1.0 }.hop(), None);
        assert_eq!(ProbeSample { round_trips: vec![0.001], bytes: 0, secs: 1.0 }.hop(), None);
        assert_eq!(ProbeSample { round_trips: vec![0.001], bytes: 1, secs: f64::NAN }.hop(), None);
    }

    /// The bench's three hosts as a start-up probe sees them: A (1) and C (2) joined by a slow
    /// direct link, both joined to B (0) by fast ones. From the probed costs, rank 1 stages its
    /// large messages to 2 through 0, and keeps small ones direct; with a healthy direct link it
    /// keeps everything direct.
    #[test]
    fn probed_costs_choose_the_route_per_message() {
        let probe = |rtt: f64, mbps: f64| {
            let bytes = 1 << 20;
            ProbeSample { round_trips: vec![rtt; 5], bytes, secs: rtt + bytes as f64 / (mbps * MB) }.hop().unwrap()
        };
        let mut c = Costs::default();
        c.set(0, 1, probe(100e-6, 90.0));
        c.set(0, 2, probe(170e-6, 95.0));
        c.set(1, 2, probe(180e-6, 12.0));
        let all = |a: Rank, b: Rank| a != b;
        let plan = Planner::default().plan(1, 2, &c, all, 0..3).unwrap();
        assert_eq!(plan.route(8), Route::Direct);
        assert_eq!(plan.route(1 << 10), Route::Direct);
        assert_eq!(plan.route(4 << 20), Route::Via(0));
        c.set(1, 2, probe(160e-6, 1300.0));
        c.set(2, 1, probe(160e-6, 1300.0));
        let plan = Planner::default().plan(1, 2, &c, all, 0..3).unwrap();
        assert_eq!(plan.steps, vec![(0, Route::Direct)]);
    }

    #[test]
    fn calibration_files_round_trip_and_bad_lines_are_named() {
        let text = "# measured\n0 1 12.5 980.0\n1 0 13 950 # the other way\ndefault 50 100\n2 1 20 500\n";
        let c = Costs::parse(text).unwrap();
        assert_eq!(c.get(0, 1), Some(hop(12.5, 980.0)));
        assert_eq!(c.get(1, 0), Some(hop(13.0, 950.0)));
        assert_eq!(c.get(1, 2), Some(hop(20.0, 500.0)));
        assert_eq!(c.get(5, 6), Some(hop(50.0, 100.0)));
        let again = Costs::parse(&c.to_text()).unwrap();
        for (a, b) in [(0, 1), (1, 0), (1, 2), (2, 1), (7, 8)] {
            let (x, y) = (c.get(a, b).unwrap(), again.get(a, b).unwrap());
            assert!((x.latency - y.latency).abs() < 1e-9 && (x.bandwidth - y.bandwidth).abs() < 1.0);
        }
        for (bad, line) in [("0 1 x 5", 1), ("\n0 1 5 0", 2), ("0 1 5", 1), ("a 1 5 5", 1), ("0 1 -3 5", 1)] {
            assert_eq!(Costs::parse(bad).unwrap_err().line, line, "{bad:?}");
        }
    }
}
