//! Observability: the metrics this crate records (their names, labels and units, given to the
//! recorder by [`describe`]), the meters and span of every collective call, the per-peer snapshot
//! of [`crate::World::stats`], and the log of a rank started by `ferrorun` ([`log`]).
//!
//! Metrics go through the `metrics` facade to whatever recorder the program installs (a
//! Prometheus exporter, for one); with none installed they cost a branch each. Handles are
//! registered once (per engine, per peer, per collective operation and algorithm) and kept:
//! a registration is a look-up in the recorder's registry, which on the message path would cost
//! as much as the message. `docs/observability.md` is the users' account.

pub(crate) mod coll;
pub mod log;

use ferrocomm_transports::{Rank, TransportError};
use metrics::Unit;

/// Counter `{peer, protocol}`: messages sent, by destination world rank and by protocol
/// (`eager` or `rendezvous`).
pub const MESSAGES_SENT: &str = "ferrocomm_messages_sent";
/// Counter `{peer, protocol}`, bytes: payload bytes sent.
pub const BYTES_SENT: &str = "ferrocomm_bytes_sent";
/// Counter `{peer, protocol}`: messages received (a rendezvous message once all its data is in).
pub const MESSAGES_RECEIVED: &str = "ferrocomm_messages_received";
/// Counter `{peer, protocol}`, bytes: payload bytes received.
pub const BYTES_RECEIVED: &str = "ferrocomm_bytes_received";
/// Histogram, bytes: the size of every message sent.
pub const MESSAGE_BYTES: &str = "ferrocomm_message_bytes";
/// Counter: sends that waited for credit (the receiver had not matched earlier messages yet).
pub const CREDIT_STALLS: &str = "ferrocomm_credit_stalls";
/// Counter: messages that arrived before a matching receive was posted.
pub const UNEXPECTED_MESSAGES: &str = "ferrocomm_unexpected_messages";
/// Counter: peers this rank learnt lost.
pub const PEERS_LOST: &str = "ferrocomm_peers_lost";
/// Counter `{operation, algorithm}`: collective calls made.
pub const COLLECTIVE_CALLS: &str = "ferrocomm_collective_calls";
/// Counter `{operation, algorithm}`, bytes: this rank's bytes of the collective calls made (the
/// size of its buffer, as the choice of algorithm sees it).
pub const COLLECTIVE_BYTES: &str = "ferrocomm_collective_bytes";
/// Histogram `{operation, algorithm}`, seconds: from a collective call to its completion at this
/// rank (timed when a recorder was installed before the world was made, or the call's span is
/// enabled).
pub const COLLECTIVE_SECONDS: &str = "ferrocomm_collective_seconds";

/// Every metric of the crate: name, unit, description.
const DESCRIPTIONS: &[(&str, Kind, Unit, &str)] = &[
    (MESSAGES_SENT, Kind::Counter, Unit::Count, "Point-to-point messages sent, by peer (world rank) and protocol"),
    (BYTES_SENT, Kind::Counter, Unit::Bytes, "Point-to-point payload bytes sent, by peer and protocol"),
    (MESSAGES_RECEIVED, Kind::Counter, Unit::Count, "Point-to-point messages received, by peer and protocol"),
    (BYTES_RECEIVED, Kind::Counter, Unit::Bytes, "Point-to-point payload bytes received, by peer and protocol"),
    (MESSAGE_BYTES, Kind::Histogram, Unit::Bytes, "Size of each point-to-point message sent"),
    (CREDIT_STALLS, Kind::Counter, Unit::Count, "Sends that waited for credit from their receiver"),
    (UNEXPECTED_MESSAGES, Kind::Counter, Unit::Count, "Messages that arrived before a matching receive"),
    (PEERS_LOST, Kind::Counter, Unit::Count, "Peers this rank learnt lost"),
    (COLLECTIVE_CALLS, Kind::Counter, Unit::Count, "Collective calls, by operation and algorithm"),
    (COLLECTIVE_BYTES, Kind::Counter, Unit::Bytes, "This rank's bytes of its collective calls"),
    (COLLECTIVE_SECONDS, Kind::Histogram, Unit::Seconds, "Collective call latency at this rank"),
    (
        "ferrocomm_connections_refused",
        Kind::Counter,
        Unit::Count,
        "Connection attempts refused (bad token, bad frames)",
    ),
    ("ferrocomm_shm_unavailable", Kind::Counter, Unit::Count, "Peers on this host reached without shared memory"),
    ("ferrocomm_shm_cma_fallback", Kind::Counter, Unit::Count, "Shared-memory peers without single-copy reads"),
    (
        "ferrocomm_mcast_groups_degraded",
        Kind::Counter,
        Unit::Count,
        "Multicast groups that fell back to point-to-point",
    ),
    ("ferrocomm_mcast_datagrams_sent", Kind::Counter, Unit::Count, "Multicast datagrams sent"),
    ("ferrocomm_mcast_copies_sent", Kind::Counter, Unit::Count, "Reliable copies of multicast messages sent"),
    ("ferrocomm_mcast_acks_at_root", Kind::Counter, Unit::Count, "Multicast ACKs and co-root reports at a root"),
    ("ferrocomm_mcast_acks_at_coroot", Kind::Counter, Unit::Count, "Multicast ACKs received as a co-root"),
    ("ferrocomm_mcast_nacks_sent", Kind::Counter, Unit::Count, "Multicast NACKs sent"),
    ("ferrocomm_mcast_nacks_received", Kind::Counter, Unit::Count, "Multicast NACKs received"),
    ("ferrocomm_mcast_retransmissions", Kind::Counter, Unit::Count, "Multicast retransmissions sent"),
    ("ferrocomm_mcast_false_retransmissions", Kind::Counter, Unit::Count, "Multicast retransmissions not needed"),
    ("ferrocomm_mcast_window_stalls", Kind::Counter, Unit::Count, "Multicast sends that found the window full"),
    ("ferrocomm_mcast_duplicates", Kind::Counter, Unit::Count, "Multicast messages received again"),
    ("ferrocomm_mcast_malformed", Kind::Counter, Unit::Count, "Multicast datagrams or control messages refused"),
    ("ferrocomm_mcast_datagrams_unauthenticated", Kind::Counter, Unit::Count, "Multicast datagrams of another job"),
];

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Histogram,
}

/// Gives every metric of the crate its unit and description, to the recorder in force (a world
/// does so when it is made; a program that installs its recorder later calls this itself).
pub fn describe() {
    for &(name, kind, unit, text) in DESCRIPTIONS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, unit, text),
            Kind::Histogram => metrics::describe_histogram!(name, unit, text),
        }
    }
}

/// Every metric name of the crate, for tests and for programs that filter them.
pub fn metric_names() -> impl Iterator<Item = &'static str> {
    DESCRIPTIONS.iter().map(|d| d.0)
}

/// What this rank knows of a peer ([`PeerStats::state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerState {
    /// Believed alive.
    Alive,
    /// It said goodbye (finalized, or dropped its world).
    Departed,
    /// It is gone, for this reason: its connection failed, it stayed silent, the launcher saw its
    /// process end, or another rank reported it lost.
    Lost(TransportError),
}

/// A snapshot of this rank's traffic with one peer ([`crate::World::stats`]). The counts are
/// point-to-point messages, collective traffic included (collectives travel as messages, except
/// over the shared-memory board and multicast).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStats {
    /// The peer's world rank (this rank's own entry counts the messages it sent itself).
    pub rank: Rank,
    /// The transport that reaches it (`shm`, `tcp-uring`, `tcp-portable`, `verbs`, ...).
    pub transport: &'static str,
    /// Alive, departed or lost.
    pub state: PeerState,
    /// Messages sent to it.
    pub messages_sent: u64,
    /// Payload bytes sent to it.
    pub bytes_sent: u64,
    /// Of the messages sent, those that went by rendezvous (larger than the eager limit).
    pub rendezvous_sent: u64,
    /// Messages received from it.
    pub messages_received: u64,
    /// Payload bytes received from it.
    pub bytes_received: u64,
    /// Of the messages received, those that came by rendezvous.
    pub rendezvous_received: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString};
    use parking_lot::Mutex;

    /// A recorder that keeps what it was told: `(name, "counter" or "histogram", unit)`.
    #[derive(Default)]
    struct Descriptions(Mutex<Vec<(String, &'static str, Option<Unit>)>>);

    impl metrics::Recorder for Descriptions {
        fn describe_counter(&self, name: KeyName, unit: Option<Unit>, _: SharedString) {
            self.0.lock().push((name.as_str().to_string(), "counter", unit));
        }
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, name: KeyName, unit: Option<Unit>, _: SharedString) {
            self.0.lock().push((name.as_str().to_string(), "histogram", unit));
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn every_metric_is_described_with_its_unit() {
        let r = Descriptions::default();
        metrics::with_local_recorder(&r, describe);
        let got = r.0.lock().clone();
        assert_eq!(got.len(), metric_names().count());
        let find = |n: &str| got.iter().find(|d| d.0 == n).cloned().unwrap_or_else(|| panic!("{n} not described"));
        assert_eq!(find(BYTES_SENT), (BYTES_SENT.into(), "counter", Some(Unit::Bytes)));
        assert_eq!(find(MESSAGES_RECEIVED), (MESSAGES_RECEIVED.into(), "counter", Some(Unit::Count)));
        assert_eq!(find(COLLECTIVE_SECONDS), (COLLECTIVE_SECONDS.into(), "histogram", Some(Unit::Seconds)));
        assert_eq!(find(MESSAGE_BYTES), (MESSAGE_BYTES.into(), "histogram", Some(Unit::Bytes)));
        assert!(got.iter().all(|d| d.0.starts_with("ferrocomm_") && d.2.is_some()));
    }
}
