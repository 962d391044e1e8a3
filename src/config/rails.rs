//! Multi-rail settings ([`RailSettings`]): which addresses are a rank's rails and how messages
//! are striped over them. The rails themselves are set up by the bootstrap (`bootstrap/rails.rs`).

use std::net::IpAddr;
use std::time::Duration;

use ferrocomm_transports::rails::StripeConfig;

use super::parse;
use crate::error::{Error, Result};

/// Which addresses are a rank's rails.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum RailList {
    /// No rails: one connection per peer.
    #[default]
    Off,
    /// Every address of an interface that is up, except loopback and the bootstrap address.
    Auto,
    /// These addresses (each must belong to an interface of this host).
    List(Vec<IpAddr>),
}

impl std::str::FromStr for RailList {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "" | "off" | "none" => Ok(RailList::Off),
            "auto" => Ok(RailList::Auto),
            list => list
                .split(',')
                .map(|a| a.trim().parse::<IpAddr>().map_err(|e| format!("rail address {a:?}: {e}")))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(RailList::List),
        }
    }
}

/// Multi-rail settings; each field has a `FERROCOMM_RAIL*` variable.
#[derive(Clone, Debug, PartialEq)]
pub struct RailSettings {
    /// `FERROCOMM_RAILS`: `off` (default), `auto` (every non-loopback address of an interface
    /// that is up), or a comma-separated list of this rank's rail addresses. Every rank of a job
    /// must have rails on or every rank off; the addresses differ from rank to rank.
    pub list: RailList,
    /// `FERROCOMM_RAIL_THRESHOLD`: messages of at least this many bytes are striped; smaller ones
    /// travel whole, each on one rail. Default 256 KiB (at most the rendezvous chunk).
    pub threshold: usize,
    /// `FERROCOMM_RAIL_PART`: size of the parts a message is cut into. Default 128 KiB.
    pub part: usize,
    /// `FERROCOMM_RAIL_WINDOW`: bytes a rail may carry unacknowledged. Default 1 MiB.
    pub window: usize,
    /// `FERROCOMM_RAIL_STALL_MS`: a rail that waits this long for an acknowledgement while the
    /// peer acknowledges on another rail is dropped and its share moves to the others (never for
    /// a peer that acknowledges nothing at all, nor the last rail up). Default 2000.
    pub stall: Duration,
    /// `FERROCOMM_RAIL_REPROBE_MS`: a rail that took no bandwidth sample for this long while the
    /// peer's other rails did is re-probed: it takes parts as if it were as fast as the fastest,
    /// until its next sample. Default 100.
    pub reprobe: Duration,
    /// `FERROCOMM_RAIL_REPROBE_MESSAGES`: ... or after this many striped messages without a
    /// sample. Default 16.
    pub reprobe_messages: u32,
}

impl Default for RailSettings {
    fn default() -> Self {
        let s = StripeConfig::default();
        RailSettings {
            list: RailList::Off,
            threshold: s.threshold,
            part: s.part,
            window: s.window,
            stall: s.stall,
            reprobe: s.reprobe,
            reprobe_messages: s.reprobe_messages,
        }
    }
}

impl RailSettings {
    pub(crate) fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<RailSettings> {
        let mut r = RailSettings::default();
        if let Some(v) = parse("FERROCOMM_RAILS", get)? {
            r.list = v;
        }
        if let Some(v) = parse("FERROCOMM_RAIL_THRESHOLD", get)? {
            r.threshold = v;
        }
        if let Some(v) = parse("FERROCOMM_RAIL_PART", get)? {
            r.part = v;
        }
        if let Some(v) = parse("FERROCOMM_RAIL_WINDOW", get)? {
            r.window = v;
        }
        if let Some(v) = parse::<u64>("FERROCOMM_RAIL_STALL_MS", get)? {
            r.stall = Duration::from_millis(v);
        }
        if let Some(v) = parse::<u64>("FERROCOMM_RAIL_REPROBE_MS", get)? {
            r.reprobe = Duration::from_millis(v);
        }
        if let Some(v) = parse("FERROCOMM_RAIL_REPROBE_MESSAGES", get)? {
            r.reprobe_messages = v;
        }
        if r.part == 0 || r.window == 0 {
            return Err(Error::Config {
                name: "FERROCOMM_RAIL_PART",
                reason: "part and window must be positive".into(),
            });
        }
        Ok(r)
    }

    /// The striping core's parameters (parts no larger than a data frame may be).
    pub(crate) fn stripe(&self, chunk: usize) -> StripeConfig {
        StripeConfig {
            threshold: self.threshold.min(chunk),
            part: self.part.min(chunk),
            window: self.window,
            stall: self.stall,
            reprobe: self.reprobe,
            reprobe_messages: self.reprobe_messages,
            ..StripeConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reprobe_settings_parse_and_reach_the_core() {
        let get = |k: &str| match k {
            "FERROCOMM_RAIL_REPROBE_MS" => Some("250".to_string()),
            "FERROCOMM_RAIL_REPROBE_MESSAGES" => Some("3".to_string()),
            _ => None,
        };
        let s = RailSettings::from_vars(&get).unwrap();
        assert_eq!((s.reprobe, s.reprobe_messages), (Duration::from_millis(250), 3));
        let c = s.stripe(1 << 20);
        assert_eq!((c.reprobe, c.reprobe_messages), (Duration::from_millis(250), 3));
        let bad = |k: &str| (k == "FERROCOMM_RAIL_REPROBE_MESSAGES").then(|| "many".to_string());
        assert!(RailSettings::from_vars(&bad).is_err());
    }
}
