//! The store's reports of ranks whose process ended before they said goodbye.
//!
//! The job's key-value store lives for the whole job: in `ferrorun`, or in the rank that hosts it
//! (rank 0 under `mpirun`, `srun` or by hand) until that rank leaves. Every rank holds a *watch*
//! there ([`super::kv::KvClient::watch`]), a connection it closes only after a goodbye (at
//! finalize, or when its world is dropped). A rank's death reaches the store in two ways, and the
//! first makes the report [`FAILED_KEY`] = `"<rank>\n<how>"`:
//! * its watch closes without a goodbye (its kernel closed it when the process died), whoever
//!   hosts the store;
//! * `ferrorun` sees its process end abnormally (a signal, a nonzero exit).
//!
//! The store sends the report down every watch. During the bootstrap a report fails the bootstrap
//! at once, naming the rank (the others would otherwise wait for its address or its connection
//! until the connect timeout; and the bootstrap ends only once every rank is connected, so it fails
//! at every rank or at none); afterwards it reaches the engine as a loss
//! ([`crate::p2p::engine::Engine::report_lost`]), which spreads it like any other. The transports
//! notice a killed rank on their own as well; the report covers what they cannot see (a rank that
//! dies during the bootstrap) and bounds the time every survivor takes to learn of a death.
//!
//! The store host's own death ends every watch. During the bootstrap that is the report: a rank
//! that hosts the store says so under [`HOST_KEY`], and a watch that ends before the bootstrap is
//! over reports that rank. Afterwards the watches just end (the host may have left in order; if
//! it died, every rank, connected to it, sees that directly). So a host that leaves because of a
//! loss (its world failed, and its program ended) first makes the store report the loss it knows
//! (unless the store has a report already) and waits, for at most [`REPORT_GRACE`], until every
//! watch was sent the report: a rank still in its bootstrap reads the report before the store's
//! end, and names the rank that was lost, not the host that left because of it. And a bootstrap
//! that fails because the store went away takes the watch's word before the transports': it
//! waits until the watch has read what the store sent, or ended, before it names a loss its
//! transports saw (the host's departure may reach them before the report is read).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferrocomm_transports::{Rank, TransportError, wire::TOKEN_LEN};
use tokio::sync::watch;

use super::kv::{KvClient, KvError, KvServer, KvWatch};
use crate::api::world::{Inner, StoreLeave, World};
use crate::config::Settings;
use crate::error::{Error, Result};

/// The key under which the launcher reports the first rank that ended abnormally.
pub(crate) const FAILED_KEY: &str = "ferrorun/failed";

/// The key under which a rank that hosts the store gives its rank.
pub(crate) const HOST_KEY: &str = "store/host";

/// How long a failed bootstrap waits for the launcher to report a dead rank that explains it.
const REPORT_GRACE: Duration = Duration::from_secs(1);

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

/// A rank's ties to the job's store, kept by its world: the store itself where this rank hosts it,
/// and the handle its watch says goodbye through.
#[derive(Default)]
pub(crate) struct StoreLink {
    pub(crate) store: Option<KvServer>,
    pub(crate) goodbye: Option<std::net::TcpStream>,
}

impl StoreLeave for StoreLink {
    fn as_any(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn leave(&mut self, aborting: bool, lost: Option<(Rank, String)>) {
        if let Some(handle) = self.goodbye.take()
            && !aborting
        {
            KvWatch::goodbye(&handle);
        }
        if let Some(store) = self.store.take() {
            store.tell_before_leaving(FAILED_KEY, lost.map(|(rank, how)| encode(rank, &how)), REPORT_GRACE);
        }
    }
}

/// The job's store as [`join_watched`] needs it: the store itself where this rank hosts it, and
/// the rank that hosts it if a rank does.
pub(super) struct Store {
    pub(super) server: Option<KvServer>,
    pub(super) host: Option<Rank>,
}

/// [`super::join`] (through `kv`, connected to the store at `coordinator`), watched by the store:
/// a report during the bootstrap fails it with [`Error::PeerLost`] naming the rank (`reason`:
/// [`TransportError::Launcher`] under `ferrorun`, [`TransportError::StoreClosed`] otherwise); a
/// later one reaches the engine.
#[allow(clippy::too_many_arguments)]
pub(super) async fn join_watched(
    rank: Rank,
    size: u32,
    kv: KvClient,
    coordinator: &str,
    token: [u8; TOKEN_LEN],
    store: Store,
    settings: Settings,
    reason: TransportError,
) -> Result<World> {
    let Store { server: store, host } = store;
    let (tx, mut rx) = watch::channel(None);
    let timeout = settings.connect_timeout;
    // The watch is made before anything else, so that this rank's death is seen from now on.
    let watched = async { KvClient::connect(coordinator, &token, timeout).await?.watch(rank).await };
    let joining = Arc::new(AtomicBool::new(true));
    let host = host.filter(|&h| h != rank);
    let goodbye = match watched.await {
        Ok(w) => {
            let handle = w.goodbye_handle().map_err(Error::bootstrap("watching the key-value store"))?;
            let host = host.filter(|&h| h != rank).map(|h| (h, joining.clone()));
            tokio::spawn(watch_store(w, tx, host));
            Some(handle)
        }
        Err(e) => {
            match host {
                // The store answered a moment ago: its host is gone.
                Some(host) => _ = tx.send(Some((host, format!("hosted the job's store, which is gone ({e})")))),
                // The bootstrap finds the store unreachable and says so.
                None => tracing::debug!(rank, "no watch in the store: {e}"),
            }
            // No watch: nothing more will come (see `explain`).
            drop(tx);
            None
        }
    };
    let mut store = store;
    let joined = super::join_via(rank, size, kv, coordinator, token, &mut store, settings);
    let reported = |r: &Report| r.as_ref().is_some_and(|(r, _)| *r != rank && *r < size);
    let dead = |report: &Report| {
        let (dead, how) = report.clone().expect("waited for");
        tracing::warn!(rank, dead, "the store reports that rank {dead} {how}");
        Error::PeerLost { rank: dead, reason: reason.clone() }
    };
    let joined = tokio::select! {
        w = joined => Some(w),
        Ok(_) = rx.wait_for(reported) => None,
    };
    let world = match joined {
        Some(Ok(w)) => {
            // Every rank connected to every other: wait until every rank got that far, so that
            // the job starts everywhere or nowhere. Until then the store's host counts as joining:
            // its store vanishing now (a connect to it would be refused until the timeout) is its
            // loss, reported through the watch at once. A rank dying meanwhile fails every bootstrap
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
            let failed = match report {
                Ok(report) => Some(dead(&report)),
                Err(Ok(())) => {
                    joining.store(false, Ordering::Release);
                    None
                }
                // The store went away or failed (its host left after its own bootstrap, or
                // died): the store's report or a loss the transports saw explains it.
                Err(Err(e)) => Some(
                    explain(&w, &mut rx, reported, &dead)
                        .await
                        .unwrap_or_else(|| Error::bootstrap("waiting for every rank to connect")(e)),
                ),
            };
            if let Some(failed) = failed {
                let store =
                    w.inner().store_link.lock().as_any().downcast_mut::<StoreLink>().and_then(|l| l.store.take());
                settle(store, size, timeout).await;
                return Err(failed);
            }
            w
        }
        // A rank that died mid-handshake may fail the bootstrap before the launcher's report
        // arrives: the report, if it comes soon, is the better explanation.
        Some(Err(e)) => {
            let report = tokio::time::timeout(REPORT_GRACE, rx.wait_for(reported)).await.map(|r| r.map(|r| r.clone()));
            settle(store, size, timeout).await;
            return match report {
                Ok(Ok(report)) => Err(dead(&report)),
                _ => Err(e),
            };
        }
        None => {
            let report = rx.borrow().clone();
            settle(store, size, timeout).await;
            return Err(dead(&report));
        }
    };
    let inner = world.inner().clone();
    if let Some(link) = inner.store_link.lock().as_any().downcast_mut::<StoreLink>() {
        link.goodbye = goodbye;
    }
    if let Some(t) = inner.thread.lock().as_ref() {
        t.handle().spawn(feed(rx, Arc::downgrade(&inner), reason));
    }
    Ok(world)
}

/// Why the store failed a bootstrap whose connections were all made: the store's report of a
/// dead rank, or the first loss `w`'s transports saw, if one comes within [`REPORT_GRACE`]. The
/// report comes first: a loss the transports saw is taken only once the watch has ended without
/// one (a host that leaves because of a loss has the store report it before it goes, but its
/// departure may reach the transports before the watch is read).
async fn explain(
    w: &World,
    rx: &mut watch::Receiver<Report>,
    reported: impl Fn(&Report) -> bool,
    dead: &impl Fn(&Report) -> Error,
) -> Option<Error> {
    let deadline = tokio::time::Instant::now() + REPORT_GRACE;
    loop {
        let report = rx.borrow().clone();
        if reported(&report) {
            return Some(dead(&report));
        }
        let lost = w.inner().reactor.with(|d| {
            let f = d.engine.failures();
            f.lost().first().and_then(|&r| f.error(r))
        });
        // The watch's sender is dropped once the watch has ended (having sent whatever it read).
        let watch_over = rx.has_changed().is_err();
        if (lost.is_some() && watch_over) || tokio::time::Instant::now() >= deadline {
            return lost;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A bootstrap that fails at the rank that hosts the store: the store stays until every rank
/// made its watch and was told of the death that failed the bootstrap (for at most `limit`, the
/// connect timeout), so that the others fail naming that rank, not this one's store going away.
async fn settle(store: Option<KvServer>, size: u32, limit: Duration) {
    if let Some(store) = store {
        store.settle(FAILED_KEY, size, limit).await;
    }
}

/// Waits on the watch for the store's report and passes it on; stops when nobody listens any
/// more (the rank's world shut down) or the store is gone: while `host.1` says the bootstrap is
/// under way, that is the report of the rank `host.0` that hosted it. The connection stays open
/// as long as the world's goodbye handle does.
async fn watch_store(mut w: KvWatch, tx: watch::Sender<Report>, host: Option<(Rank, Arc<AtomicBool>)>) {
    tokio::select! {
        _ = tx.closed() => {}
        got = w.report() => match got {
            Ok(v) => match decode(&v) {
                Some(report) => _ = tx.send(Some(report)),
                None => tracing::warn!("the store's report of a dead rank is unreadable: {v:?}"),
            },
            Err(e) => match host {
                Some((host, joining)) if joining.load(Ordering::Acquire) => {
                    _ = tx.send(Some((host, format!("hosted the job's store, which is gone ({e})"))));
                }
                // Its host left, or died (which the transports see).
                _ => tracing::debug!("the store's watch ended: {e}"),
            },
        },
    }
}

/// Hands the store's report to the engine of a running rank, as a loss.
async fn feed(mut rx: watch::Receiver<Report>, inner: std::sync::Weak<Inner>, reason: TransportError) {
    let Ok(report) = rx.wait_for(Option::is_some).await else { return };
    let Some((dead, how)) = report.clone() else { return };
    let Some(inner) = inner.upgrade() else { return };
    if dead == inner.rank || dead >= inner.size {
        return;
    }
    tracing::info!(rank = inner.rank, dead, "the store reports that rank {dead} {how}");
    inner.reactor.with(|d| {
        d.engine.report_lost(dead, reason);
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
