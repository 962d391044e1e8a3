//! Routes through a proxy rank (`FERROCOMM_PROXY=on`): which pairs of ranks have a direct
//! connection, and for every peer, how this rank reaches it ([`ferrocomm_transports::relay`]).
//!
//! With proxies on, a rank that cannot connect to a lower rank within
//! [`RouteSettings::direct_timeout`] goes on without it; each rank then announces the lower ranks
//! it reached (`reached/<rank>`), so every rank knows every direct connection. A peer without one
//! is reached through the lowest rank connected to both (or, with per-hop costs, the fastest); a
//! peer with one is reached directly, except that with costs its large messages' data may take
//! a faster path through a proxy ([`Planner`]).

use std::path::PathBuf;
use std::time::Duration;

use ferrocomm_transports::Rank;
use ferrocomm_transports::relay::{Costs, Planner, Way};

use super::kv::KvClient;
use crate::config::parse;
use crate::error::{Error, Result};

/// Proxy route settings; each field has a `FERROCOMM_*` variable.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteSettings {
    /// `FERROCOMM_PROXY`: `on` to reach peers without a direct connection through a proxy rank
    /// (and to let this rank forward for others), `off` (default). Every rank of a job must
    /// agree.
    pub proxy: bool,
    /// `FERROCOMM_ROUTE_COSTS`: a calibration file of per-hop costs (`FROM TO LATENCY_US
    /// BANDWIDTH_MBPS` per line; `ferrocomm-bench rails` writes one). With it, a peer with a
    /// slow direct connection gets its large messages staged through a faster proxy path.
    pub costs: Option<PathBuf>,
    /// `FERROCOMM_DIRECT_TIMEOUT_MS`: how long a rank tries to connect directly to a lower rank
    /// before it takes that pair as having no direct path (proxies on only). Default 3000.
    pub direct_timeout: Duration,
    /// `FERROCOMM_PROXY_PIECE`: pieces a staged message crosses the proxy in. Default 128 KiB.
    pub piece: usize,
}

impl Default for RouteSettings {
    fn default() -> Self {
        RouteSettings { proxy: false, costs: None, direct_timeout: Duration::from_secs(3), piece: 128 * 1024 }
    }
}

impl RouteSettings {
    pub(crate) fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<RouteSettings> {
        let mut r = RouteSettings::default();
        if let Some(v) = get("FERROCOMM_PROXY") {
            r.proxy = match v.trim() {
                "on" | "1" | "auto" => true,
                "off" | "0" | "" => false,
                other => {
                    return Err(Error::Config { name: "FERROCOMM_PROXY", reason: format!("{other:?}: on or off") });
                }
            };
        }
        if let Some(v) = get("FERROCOMM_ROUTE_COSTS").filter(|v| !v.trim().is_empty()) {
            r.costs = Some(PathBuf::from(v.trim()));
        }
        if let Some(v) = parse::<u64>("FERROCOMM_DIRECT_TIMEOUT_MS", get)? {
            r.direct_timeout = Duration::from_millis(v);
        }
        if let Some(v) = parse("FERROCOMM_PROXY_PIECE", get)? {
            r.piece = v;
        }
        if r.piece == 0 {
            return Err(Error::Config { name: "FERROCOMM_PROXY_PIECE", reason: "must be positive".into() });
        }
        Ok(r)
    }

    /// The calibration file's costs (none without one).
    pub(crate) fn load_costs(&self) -> Result<Costs> {
        let Some(path) = &self.costs else { return Ok(Costs::default()) };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config { name: "FERROCOMM_ROUTE_COSTS", reason: format!("{}: {e}", path.display()) })?;
        Costs::parse(&text)
            .map_err(|e| Error::Config { name: "FERROCOMM_ROUTE_COSTS", reason: format!("{}: {e}", path.display()) })
    }
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
    }
}
