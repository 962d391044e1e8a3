//! Routes through a proxy rank (`FERROCOMM_PROXY=on`): which pairs of ranks have a direct
//! connection, and for every peer, how this rank reaches it ([`ferrocomm_transports::relay`]).
//!
//! With proxies on, a rank that cannot connect to a lower rank within
//! [`RouteSettings::direct_timeout`] goes on without it; each rank then announces the lower ranks
//! it reached (`reached/<rank>`), so every rank knows every direct connection. A peer without one
//! is reached through the lowest rank connected to both (or, with per-hop costs, the fastest); a
//! peer with one is reached directly, except that with costs its large messages' data may take
//! a faster path through a proxy ([`Planner`]).
//!
//! The planner needs per-hop costs: a calibration file gives them, or else a short start-up probe
//! ([`probe`]) measures every direct connection before the transport starts (a few round trips
//! of 8 bytes, then one burst of [`RouteSettings::probe_bytes`] one way), and every rank reads
//! every rank's figures from the store, so all plan alike.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ferrocomm_transports::Rank;
use ferrocomm_transports::relay::{Costs, Planner, ProbeSample, Way};

use super::kv::KvClient;
use crate::config::PROBE_MAX;
use crate::error::{Error, Result};

/// Round trips of a probe's latency measurement.
const PROBE_ROUND_TRIPS: u64 = 16;

/// Measures every direct connection of this rank (`conns[peer]`, blocking I/O with `timeout`),
/// the lower rank of each pair sending. Pairs go in one global order (by lower rank, then higher),
/// each rank through its own pairs in that order, so every pair's ends meet without deadlock and
/// each hop is measured without its rank's other hops' traffic. Returns the hops this rank
/// measured (those to higher ranks). Leaves the streams with nothing unread.
pub(crate) fn probe(
    rank: Rank,
    conns: &mut [Option<std::net::TcpStream>],
    bytes: usize,
    timeout: Duration,
) -> std::io::Result<Vec<(Rank, Rank, ProbeSample)>> {
    let mut out = Vec::new();
    for peer in 0..conns.len() as Rank {
        let Some(s) = conns[peer as usize].as_mut() else { continue };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        if peer > rank {
            out.push((rank, peer, probe_send(s, bytes)?));
        } else {
            probe_answer(s)?;
        }
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
    }
    Ok(out)
}

/// The sending end of one pair's probe.
fn probe_send(s: &mut TcpStream, bytes: usize) -> std::io::Result<ProbeSample> {
    let mut round_trips = Vec::new();
    let mut buf = [0u8; 8];
    for i in 0..PROBE_ROUND_TRIPS {
        let t0 = Instant::now();
        s.write_all(&i.to_le_bytes())?;
        s.read_exact(&mut buf)?;
        if u64::from_le_bytes(buf) != i {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "probe echo does not match"));
        }
        round_trips.push(t0.elapsed().as_secs_f64());
    }
    let block = vec![0u8; bytes.min(256 << 10)];
    let t0 = Instant::now();
    s.write_all(&(bytes as u64).to_le_bytes())?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len());
        s.write_all(&block[..n])?;
        left -= n;
    }
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok)?;
    Ok(ProbeSample { round_trips, bytes, secs: t0.elapsed().as_secs_f64() })
}

/// The answering end of one pair's probe: echoes the round trips, reads the burst (at most
/// [`PROBE_MAX`] bytes, into a fixed buffer), answers one byte.
fn probe_answer(s: &mut TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; 8];
    for _ in 0..PROBE_ROUND_TRIPS {
        s.read_exact(&mut buf)?;
        s.write_all(&buf)?;
    }
    s.read_exact(&mut buf)?;
    let len = u64::from_le_bytes(buf);
    if len > PROBE_MAX as u64 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "probe burst too long"));
    }
    let mut left = len as usize;
    let mut sink = vec![0u8; left.min(256 << 10)];
    while left > 0 {
        let n = left.min(sink.len());
        s.read_exact(&mut sink[..n])?;
        left -= n;
    }
    s.write_all(&[1])
}

/// Publishes the hops this rank probed and reads every rank's: the job's costs, the same on every
/// rank. A hop a probe could not turn into figures is left out (its pair then counts as of unknown
/// cost: direct, if connected).
pub(crate) async fn share_probes(
    kv: &mut KvClient,
    rank: Rank,
    size: u32,
    mine: &[(Rank, Rank, ProbeSample)],
    timeout: Duration,
) -> Result<Costs> {
    let mut c = Costs::default();
    for (a, b, sample) in mine {
        if let Some(h) = sample.hop() {
            c.set(*a, *b, h);
        }
    }
    kv.put(&format!("hops/{rank}"), c.to_text().as_bytes())
        .await
        .map_err(Error::bootstrap("announcing the probed hops"))?;
    let mut all = Costs::default();
    for r in 0..size {
        let raw = kv.get(&format!("hops/{r}"), timeout).await.map_err(Error::bootstrap("reading the probed hops"))?;
        let theirs = Costs::parse(&String::from_utf8_lossy(&raw))
            .map_err(|e| Error::bootstrap_failed(format!("rank {r}'s probed hops: {e}")))?;
        for (a, b, h) in theirs.hops() {
            // Each rank announces only the hops it measured itself, to higher ranks (a line sets
            // both directions).
            if a.min(b) != r || a == b || a.max(b) >= size {
                return Err(Error::bootstrap_failed(format!("rank {r} announced a hop {a} -> {b} it did not probe")));
            }
            all.set(a, b, h);
        }
    }
    Ok(all)
}

/// Which pairs of ranks are connected directly over TCP.
pub(crate) struct Reach {
    size: usize,
    /// `reached[b]`: the lower ranks `b` connected to.
    reached: Vec<Vec<Rank>>,
}

impl Reach {
    pub(crate) fn connected(&self, a: Rank, b: Rank) -> bool {
        let (lo, hi) = (a.min(b), a.max(b));
        lo != hi && (hi as usize) < self.size && self.reached[hi as usize].contains(&lo)
    }
}

/// Announces the lower ranks this rank reached and learns everybody's.
pub(crate) async fn exchange(
    kv: &mut KvClient,
    rank: Rank,
    size: u32,
    mine: &[Rank],
    timeout: Duration,
) -> Result<Reach> {
    let line = mine.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",");
    kv.put(&format!("reached/{rank}"), line.as_bytes())
        .await
        .map_err(Error::bootstrap("announcing the direct connections"))?;
    let mut reached = Vec::with_capacity(size as usize);
    for r in 0..size {
        let raw = kv
            .get(&format!("reached/{r}"), timeout)
            .await
            .map_err(Error::bootstrap("reading the direct connections"))?;
        let text = String::from_utf8_lossy(&raw);
        let list: std::result::Result<Vec<Rank>, _> =
            text.split(',').filter(|s| !s.is_empty()).map(|s| s.parse::<Rank>()).collect();
        let list = list.map_err(|_| Error::bootstrap_failed(format!("rank {r}'s reached list is malformed")))?;
        if list.iter().any(|&l| l >= r) {
            return Err(Error::bootstrap_failed(format!("rank {r} claims to have connected to a rank not below it")));
        }
        reached.push(list);
    }
    Ok(Reach { size: size as usize, reached })
}

/// How `me` reaches every peer over TCP (`tcp[peer]`), given the direct connections and costs.
pub(crate) fn ways(me: Rank, tcp: &[bool], reach: &Reach, costs: &Costs, piece: usize) -> Result<Vec<Way>> {
    let planner = Planner { piece, ..Planner::default() };
    let size = tcp.len() as Rank;
    (0..size)
        .map(|peer| {
            if !tcp[peer as usize] {
                return Ok(Way::None);
            }
            let plan = planner.plan(me, peer, costs, |a, b| reach.connected(a, b), 0..size).ok_or_else(|| {
                Error::bootstrap_failed(format!("rank {peer} is reachable neither directly nor through a proxy"))
            })?;
            Ok(match plan.steps[..] {
                [(_, ferrocomm_transports::relay::Route::Direct)] => Way::Direct,
                [(_, ferrocomm_transports::relay::Route::Via(p))] if !reach.connected(me, peer) => Way::Via(p),
                _ => Way::Split(plan),
            })
        })
        .collect()
}

/// The ranks `me` is a proxy for: the ends of every pair whose route (as the ends plan it, with
/// the same costs) goes through `me`.
pub(crate) fn served(me: Rank, size: u32, reach: &Reach, costs: &Costs, piece: usize) -> Vec<Rank> {
    let mut out = Vec::new();
    for a in (0..size).filter(|&a| a != me && reach.connected(a, me)) {
        let tcp: Vec<bool> = (0..size).map(|p| p != a).collect();
        let Ok(w) = ways(a, &tcp, reach, costs, piece) else { continue };
        if w.iter().any(|w| w.proxy_for_data() == Some(me)) {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouteSettings;
    use ferrocomm_transports::relay::{Hop, Route};

    #[test]
    fn ways_follow_the_direct_connections_and_the_costs() {
        // 0 - 1 - 2, no 0 - 2; 3 is on this host (shared memory).
        let reach = Reach { size: 4, reached: vec![vec![], vec![0], vec![1], vec![0, 1, 2]] };
        let tcp = [false, true, true, false];
        let w = ways(0, &tcp, &reach, &Costs::default(), 1 << 17).unwrap();
        assert_eq!(w, vec![Way::None, Way::Direct, Way::Via(1), Way::None]);
        // With a slow direct 1 - 2 and fast hops through 0 (and 3), rank 1 splits its traffic to 2.
        let reach = Reach { size: 3, reached: vec![vec![], vec![0], vec![0, 1]] };
        let mut costs = Costs::default();
        costs.default = Some(Hop { latency: 50e-6, bandwidth: 1e9 });
        costs.set(1, 2, Hop { latency: 50e-6, bandwidth: 10e6 });
        let w = ways(1, &[true, false, true], &reach, &costs, 1 << 17).unwrap();
        let Way::Split(plan) = &w[2] else { panic!("{w:?}") };
        assert_eq!((plan.route(100), plan.route(4 << 20)), (Route::Direct, Route::Via(0)));
        // Nobody in between.
        let reach = Reach { size: 2, reached: vec![vec![], vec![]] };
        assert!(ways(0, &[false, true], &reach, &Costs::default(), 1 << 17).is_err());
    }

    /// The bench's three hosts with the figures a calibration measured there: rank 1 stages its
    /// 4 MiB messages to rank 2 through rank 0.
    #[test]
    fn the_bench_triangle_stages_through_the_middle_host() {
        let reach = Reach { size: 3, reached: vec![vec![], vec![0], vec![0, 1]] };
        let costs = Costs::parse("0 1 50.8 87.2\n0 2 86.4 96.7\n1 2 88.2 12.1\n").unwrap();
        let w = ways(1, &[true, false, true], &reach, &costs, 1 << 17).unwrap();
        let Way::Split(plan) = &w[2] else { panic!("{w:?}") };
        assert_eq!((plan.route(100), plan.route(4 << 20)), (Route::Direct, Route::Via(0)));
        assert_eq!(served(0, 3, &reach, &costs, 1 << 17), vec![1, 2]);
    }

    /// Two ranks probe the loopback connection between them: the lower one gets a hop, and both
    /// streams are left with nothing unread.
    #[test]
    fn the_probe_measures_a_connection_and_leaves_it_clean() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let t = Duration::from_secs(30);
        let other = std::thread::spawn(move || {
            let mut conns = vec![Some(b), None];
            let got = probe(1, &mut conns, 300_000, t).unwrap();
            let s = conns[0].as_mut().unwrap();
            s.write_all(b"after").unwrap();
            let mut buf = [0u8; 6];
            s.read_exact(&mut buf).unwrap();
            (got, buf)
        });
        let mut conns = vec![None, Some(a)];
        let got = probe(0, &mut conns, 300_000, t).unwrap();
        let s = conns[1].as_mut().unwrap();
        s.write_all(b"after!").unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"after");
        let (theirs, their_buf) = other.join().unwrap();
        assert_eq!(&their_buf, b"after!");
        assert!(theirs.is_empty());
        let [(0, 1, sample)] = &got[..] else { panic!("{got:?}") };
        assert_eq!((sample.round_trips.len(), sample.bytes), (PROBE_ROUND_TRIPS as usize, 300_000));
        let hop = sample.hop().unwrap();
        assert!(hop.latency > 0.0 && hop.bandwidth > 0.0, "{hop:?}");
    }

    #[test]
    fn route_settings_parse() {
        let get = |k: &str| match k {
            "FERROCOMM_PROXY" => Some("on".to_string()),
            "FERROCOMM_ROUTE_COSTS" => Some("/nonexistent/costs".to_string()),
            "FERROCOMM_DIRECT_TIMEOUT_MS" => Some("500".to_string()),
            _ => None,
        };
        let r = RouteSettings::from_vars(&get).unwrap();
        assert!(r.proxy);
        assert_eq!(r.direct_timeout, Duration::from_millis(500));
        assert!(matches!(r.load_costs(), Err(Error::Config { name: "FERROCOMM_ROUTE_COSTS", .. })));
        assert!(RouteSettings::from_vars(&|k: &str| (k == "FERROCOMM_PROXY").then(|| "maybe".to_string())).is_err());
        // The probe runs with proxies on and no calibration file, unless its burst is 0.
        assert!(!r.probes());
        let probing = RouteSettings::from_vars(&|k: &str| (k == "FERROCOMM_PROXY").then(|| "on".to_string())).unwrap();
        assert!(probing.probes() && probing.probe_bytes == 1 << 20);
        let off = |v: &'static str| {
            move |k: &str| match k {
                "FERROCOMM_PROXY" => Some("on".to_string()),
                "FERROCOMM_ROUTE_PROBE_BYTES" => Some(v.to_string()),
                _ => None,
            }
        };
        assert!(!RouteSettings::from_vars(&off("0")).unwrap().probes());
        assert!(RouteSettings::from_vars(&off("999999999999")).is_err());
    }
}
