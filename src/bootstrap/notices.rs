//! The launcher's reports of ranks whose process ended before they said goodbye.
//!
//! `ferrorun` keeps the job's key-value store for the whole job and sees every rank's process end.
//! When one ends abnormally (a signal, a nonzero exit) it puts [`FAILED_KEY`] = `"<rank>\n<how>"`
//! in the store. Every rank keeps a second store connection waiting for that key: during the
//! bootstrap a report fails the bootstrap at once, naming the rank (the others would otherwise wait
//! for its address or its connection until the connect timeout; and the bootstrap ends only once
//! every rank is connected, so it fails at every rank or at none); afterwards it reaches the engine
//! as a loss ([`crate::p2p::engine::Engine::report_lost`]), which spreads it like any other. The
//! transports notice a killed rank on their own as well; the report covers what they cannot see
//! (a rank that dies during the bootstrap) and is the launcher's word in the error.

use std::sync::Arc;
use std::time::Duration;

use ferrocomm_transports::{Rank, TransportError, wire::TOKEN_LEN};
use tokio::sync::watch;

use super::kv::{KvClient, KvError};
use crate::api::world::{Inner, World};
use crate::config::Settings;
use crate::error::{Error, Result};

/// The key under which the launcher reports the first rank that ended abnormally.
pub(crate) const FAILED_KEY: &str = "ferrorun/failed";

/// How long a failed bootstrap waits for the launcher to report a dead rank that explains it.
const REPORT_GRACE: Duration = Duration::from_secs(1);
/// How long one wait for the report lasts before it is asked again.
const WAIT: Duration = Duration::from_secs(600);

/// A report: the rank, and how its process ended (the launcher's words).
type Report = Option<(Rank, String)>;

/// The report's value, as the launcher writes it.
pub(crate) fn encode(rank: Rank, how: &str) -> Vec<u8> {
    format!("{rank}\n{how}").into_bytes()
}

/// A report's value read back; `None` if it is not one.
fn decode(v: &[u8]) -> Option<(Rank, String)> {
    let s = std::str::from_utf8(v).ok()?;
    let (rank, how) = s.split_once('\n')?;
    Some((rank.parse().ok()?, how.to_string()))
}

/// [`super::join`] (through `kv`, connected to the store at `coordinator`) under a launcher that
/// reports dead ranks: a report during the bootstrap fails it with [`Error::PeerLost`] naming the
/// rank ([`TransportError::Launcher`]); a later one reaches the engine.
pub(super) async fn join_watched(
    rank: Rank,
    size: u32,
    kv: KvClient,
    coordinator: &str,
    token: [u8; TOKEN_LEN],
    store: Option<super::kv::KvServer>,
    settings: Settings,
) -> Result<World> {
    let (tx, mut rx) = watch::channel(None);
    let timeout = settings.connect_timeout;
    tokio::spawn(watch_store(coordinator.to_string(), token, timeout, tx));
    let joined = super::join_via(rank, size, kv, coordinator, token, store, settings);
    let reported = |r: &Report| r.as_ref().is_some_and(|(r, _)| *r != rank && *r < size);
    let dead = |report: &Report| {
        let (dead, how) = report.clone().expect("waited for");
        tracing::warn!(rank, dead, "the launcher reports that rank {dead} {how}");
        Error::PeerLost { rank: dead, reason: TransportError::Launcher }
    };
    let joined = tokio::select! {
        w = joined => Some(w),
        Ok(_) = rx.wait_for(reported) => None,
    };
    let world = match joined {
        Some(Ok(w)) => {
            // Every rank connected to every other: wait until every rank got that far, so that
            // the job starts everywhere or nowhere. A rank dying meanwhile fails every bootstrap
            // alike, with the launcher's report (a rank that gave up because of it would otherwise
            // be the first loss some others see, and their errors would name it).
            let all_ready = async {
                let mut kv = KvClient::connect(coordinator, &token, timeout).await?;
                for r in 0..size {
                    kv.get(&format!("ready/{r}"), timeout).await?;
                }
                Ok::<_, KvError>(())
            };
            let report = tokio::select! {
                r = all_ready => Err(r),
                Ok(report) = rx.wait_for(reported) => Ok(report.clone()),
            };
            match report {
                Ok(report) => return Err(dead(&report)),
                Err(ready) => ready.map_err(Error::bootstrap("waiting for every rank to connect"))?,
            }
            w
        }
        // A rank that died mid-handshake may fail the bootstrap before the launcher's report
        // arrives: the report, if it comes soon, is the better explanation.
        Some(Err(e)) => {
            return match tokio::time::timeout(REPORT_GRACE, rx.wait_for(reported)).await {
                Ok(Ok(report)) => Err(dead(&report)),
                _ => Err(e),
            };
        }
        None => return Err(dead(&rx.borrow())),
    };
    let inner = world.inner().clone();
    if let Some(t) = inner.thread.lock().as_ref() {
        t.handle().spawn(feed(rx, Arc::downgrade(&inner)));
    }
    Ok(world)
}

/// Waits in the store for the launcher's report and passes it on; stops when nobody listens any
/// more (the rank's world shut down) or the store is gone.
async fn watch_store(coordinator: String, token: [u8; TOKEN_LEN], timeout: Duration, tx: watch::Sender<Report>) {
    let Ok(mut kv) = KvClient::connect(&coordinator, &token, timeout).await else { return };
    loop {
        tokio::select! {
            _ = tx.closed() => return,
            got = kv.get(FAILED_KEY, WAIT) => match got {
                Ok(v) => {
                    match decode(&v) {
                        Some(report) => _ = tx.send(Some(report)),
                        None => tracing::warn!("the launcher's report of a dead rank is unreadable: {v:?}"),
                    }
                    return;
                }
                Err(KvError::Timeout { .. }) => {}
                Err(_) => return,
            },
        }
    }
}

/// Hands the launcher's report to the engine of a running rank, as a loss.
async fn feed(mut rx: watch::Receiver<Report>, inner: std::sync::Weak<Inner>) {
    let Ok(report) = rx.wait_for(Option::is_some).await else { return };
    let Some((dead, how)) = report.clone() else { return };
    let Some(inner) = inner.upgrade() else { return };
    if dead == inner.rank || dead >= inner.size {
        return;
    }
    tracing::info!(rank = inner.rank, dead, "the launcher reports that rank {dead} {how}");
    inner.reactor.with(|d| {
        d.engine.report_lost(dead, TransportError::Launcher);
        d.flush();
    });
    inner.reactor.kick();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_garbage_is_none() {
        assert_eq!(
            decode(&encode(3, "exited with signal 9 (SIGKILL)")),
            Some((3, "exited with signal 9 (SIGKILL)".into()))
        );
        assert_eq!(decode(b"x\nhow"), None);
        assert_eq!(decode(b"3"), None);
        assert_eq!(decode(b"\xff\n"), None);
    }
}
