//! Proxy route settings ([`RouteSettings`]): whether peers without a direct connection are
//! reached through a proxy, and where the per-hop costs come from. The routes themselves are
//! planned by the bootstrap (`bootstrap/routes.rs`).

use std::path::PathBuf;
use std::time::Duration;

use ferrocomm_transports::relay::Costs;

use super::parse;
use crate::error::{Error, Result};

/// The largest probe burst a rank sends or accepts.
pub(crate) const PROBE_MAX: usize = 64 << 20;

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
    /// `FERROCOMM_ROUTE_PROBE_BYTES`: without a calibration file, the bytes of the burst a
    /// start-up probe sends over each direct connection to measure its bandwidth (its latency
    /// from 16 round trips). 0 turns the probe off (peers with a direct connection then always
    /// use it). Default 1 MiB.
    pub probe_bytes: usize,
}

impl Default for RouteSettings {
    fn default() -> Self {
        RouteSettings {
            proxy: false,
            costs: None,
            direct_timeout: Duration::from_secs(3),
            piece: 128 * 1024,
            probe_bytes: 1 << 20,
        }
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
        if let Some(v) = parse::<usize>("FERROCOMM_ROUTE_PROBE_BYTES", get)? {
            if v > PROBE_MAX {
                return Err(Error::Config {
                    name: "FERROCOMM_ROUTE_PROBE_BYTES",
                    reason: format!("{v}: at most {PROBE_MAX}"),
                });
            }
            r.probe_bytes = v;
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

    /// Whether the costs come from a start-up probe.
    pub(crate) fn probes(&self) -> bool {
        self.proxy && self.costs.is_none() && self.probe_bytes > 0
    }
}
