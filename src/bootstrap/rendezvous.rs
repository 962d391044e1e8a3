//! Reaching the job's key-value store from what [`env`](super::env) found: the store's host name
//! resolved, the store started by the rank that hosts it on the first free candidate port, and
//! the other ranks finding it among the candidates by the token it accepts.
//!
//! Candidate ports exist because derived ports can collide: two concurrent jobs (or Slurm steps)
//! can hash to the same port, and any program may hold it. The hosting rank moves on to the next
//! candidate; a connecting rank that meets another job's store is refused (the token differs) and
//! tries the next. Every error names the address and the variables it came from.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::time::Instant;

use super::env::{EnvError, JobEnv, StoreAddr};
use super::kv::{KvClient, KvError, KvServer};

/// How long one attempt at one of several candidate ports may take before the next is tried.
/// Connections refused (the store is not up yet) are retried within it.
const PROBE: Duration = Duration::from_millis(250);
/// Pause after a round of candidates that all answered at once (every one refused the token).
const ROUND_PAUSE: Duration = Duration::from_millis(50);

/// What [`open`] found: the store itself when this rank hosts it, a client connected to it, the
/// `host:port` connected to, and the rank that hosts the store if a rank does.
pub(crate) type Opened = (Option<KvServer>, KvClient, String, Option<u32>);

/// The store of `job` and a client connected to it: started here first when this rank hosts it
/// (the store is returned, to be kept as long as this rank's world).
pub(crate) async fn open(job: &JobEnv, timeout: Duration) -> Result<Opened, EnvError> {
    if job.host_store {
        if job.local_size.is_some_and(|local| local < job.size) {
            let ips = resolve(&job.store).await?;
            if ips.iter().all(IpAddr::is_loopback) {
                let resolved: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
                let (addr, var) = (job.store.to_string(), job.store.source);
                return Err(EnvError::LoopbackStore { addr, var, resolved: resolved.join(", ") });
            }
        }
        let (server, addr) = host(&job.store, job.token).await?;
        // Who hosts it: its end during the bootstrap is this rank's (see `notices`).
        server.put(super::notices::HOST_KEY, job.rank.to_string().as_bytes());
        let own =
            StoreAddr { host: job.store.host.clone(), ports: vec![server.addr().port()], source: job.store.source };
        let (client, _) = connect(&own, &job.token, timeout).await?;
        Ok((Some(server), client, addr, Some(job.rank)))
    } else {
        let (mut client, addr) = connect(&job.store, &job.token, timeout).await?;
        // Put before the store took its first connection, if a rank hosts it.
        let host = match client.get(super::notices::HOST_KEY, Duration::ZERO).await {
            Ok(v) => std::str::from_utf8(&v).ok().and_then(|r| r.parse().ok()).filter(|&r| r < job.size),
            Err(_) => None,
        };
        Ok((None, client, addr, host))
    }
}

/// The addresses `store.host` resolves to, each once, in the resolver's order.
pub(crate) async fn resolve(store: &StoreAddr) -> Result<Vec<IpAddr>, EnvError> {
    let port = store.ports.first().copied().unwrap_or(0);
    let unresolvable = |reason: String| EnvError::Unresolvable { addr: store.to_string(), var: store.source, reason };
    let found = tokio::net::lookup_host((store.host.as_str(), port)).await.map_err(|e| unresolvable(e.to_string()))?;
    let mut ips: Vec<IpAddr> = Vec::new();
    for a in found {
        if !ips.contains(&a.ip()) {
            ips.push(a.ip());
        }
    }
    if ips.is_empty() {
        return Err(unresolvable("the resolver returned no address".to_string()));
    }
    Ok(ips)
}

/// Starts the store at the first candidate port that is free on an address of this host that
/// `store.host` resolves to. Returns it and the `host:port` it listens at.
pub(crate) async fn host(store: &StoreAddr, token: [u8; 32]) -> Result<(KvServer, String), EnvError> {
    let ips = resolve(store).await?;
    let mut local = false;
    for &port in &store.ports {
        for &ip in &ips {
            match KvServer::start(SocketAddr::new(ip, port), token).await {
                Ok(server) => return Ok((server, store.addr(port))),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => local = true,
                // Not an address of this host (or of this network namespace).
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {}
                Err(e) => {
                    let addr = format!("{} ({})", store.addr(port), SocketAddr::new(ip, port));
                    return Err(EnvError::CannotHost { addr, var: store.source, reason: e.to_string() });
                }
            }
        }
        if !local {
            // No address is this host's; no other port changes that.
            let resolved: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
            return Err(EnvError::NotLocal {
                addr: store.to_string(),
                var: store.source,
                resolved: resolved.join(", "),
            });
        }
    }
    Err(EnvError::PortsTaken { addr: store.to_string(), var: store.source })
}

/// Connects to the job's store within `timeout`. With one port, that port; with several, the
/// candidates in turn, round after round, until one accepts the token. Returns the client and
/// the `host:port` it is connected to.
pub(crate) async fn connect(
    store: &StoreAddr,
    token: &[u8; 32],
    timeout: Duration,
) -> Result<(KvClient, String), EnvError> {
    // A name that does not resolve is said as such, not as a store that never answered.
    resolve(store).await?;
    let deadline = Instant::now() + timeout;
    let mut last: Vec<Option<String>> = vec![None; store.ports.len()];
    loop {
        let round = Instant::now();
        for (i, &port) in store.ports.iter().enumerate() {
            let addr = store.addr(port);
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = if store.ports.len() == 1 { left } else { left.min(PROBE) };
            if slice.is_zero() {
                break;
            }
            match KvClient::connect(&addr, token, slice).await {
                Ok(client) => return Ok((client, addr)),
                // Not this job's store: at a single configured port, waiting does not change that.
                // Among candidates, the next may be this job's.
                Err(e @ (KvError::Rejected { .. } | KvError::Handshake { .. })) if store.ports.len() == 1 => {
                    return Err(EnvError::StoreRefused { addr, var: store.source, reason: e.to_string() });
                }
                Err(KvError::ConnectTimeout { last: why, .. }) => last[i] = Some(why),
                Err(e) => last[i] = Some(e.to_string()),
            }
        }
        let now = Instant::now();
        if now >= deadline {
            let last: Vec<String> = store
                .ports
                .iter()
                .zip(&last)
                .filter_map(|(p, l)| l.as_ref().map(|l| format!("port {p}: {l}")))
                .collect();
            let last = if last.is_empty() { "none".to_string() } else { last.join("; ") };
            return Err(EnvError::StoreUnreachable {
                addr: store.to_string(),
                var: store.source,
                waited: timeout,
                last,
            });
        }
        if now - round < ROUND_PAUSE {
            tokio::time::sleep(ROUND_PAUSE.min(deadline - now)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: [u8; 32] = [3; 32];
    const T: Duration = Duration::from_secs(10);

    fn store(host: &str, ports: &[u16]) -> StoreAddr {
        StoreAddr { host: host.to_string(), ports: ports.to_vec(), source: "TEST_VAR" }
    }

    /// A port nothing listens on: bound, read, released.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[tokio::test]
    async fn host_names_resolve_and_serve() {
        let s = store("localhost", &[free_port()]);
        let (server, addr) = host(&s, TOKEN).await.unwrap();
        assert!(addr.starts_with("localhost:"), "{addr}");
        let (mut c, at) = connect(&s, &TOKEN, T).await.unwrap();
        assert_eq!(at, addr);
        c.put("k", b"v").await.unwrap();
        assert_eq!(c.get("k", T).await.unwrap(), b"v");
        drop(server);
    }

    #[tokio::test]
    async fn a_taken_port_moves_the_store_to_the_next_candidate_and_clients_find_it() {
        // Another job's store holds the first candidate.
        let stranger = KvServer::start("127.0.0.1:0".parse().unwrap(), [9; 32]).await.unwrap();
        let taken = stranger.addr().port();
        let s = store("127.0.0.1", &[taken, free_port(), free_port()]);
        let (server, addr) = host(&s, TOKEN).await.unwrap();
        assert_eq!(server.addr().port(), s.ports[1]);
        assert_eq!(addr, format!("127.0.0.1:{}", s.ports[1]));
        let (mut c, at) = connect(&s, &TOKEN, T).await.unwrap();
        assert_eq!(at, addr, "joined this job's store, not the stranger's");
        c.put("k", b"1").await.unwrap();
    }

    #[tokio::test]
    async fn clients_wait_for_a_store_that_starts_late() {
        let s = store("127.0.0.1", &[free_port(), free_port()]);
        let s2 = s.clone();
        let client = tokio::spawn(async move { connect(&s2, &TOKEN, T).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (_server, addr) = host(&s, TOKEN).await.unwrap();
        let (_c, at) = client.await.unwrap().unwrap();
        assert_eq!(at, addr);
    }

    #[tokio::test]
    async fn every_port_taken_is_a_typed_error() {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = store("127.0.0.1", &[a.local_addr().unwrap().port(), b.local_addr().unwrap().port()]);
        let e = host(&s, TOKEN).await.err().unwrap();
        assert!(matches!(e, EnvError::PortsTaken { var: "TEST_VAR", .. }), "{e}");
        assert!(e.to_string().contains("FERROCOMM_COORD"), "{e}");
    }

    #[tokio::test]
    async fn a_loopback_store_for_a_job_across_hosts_is_refused() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("FERROCOMM_COORD", "localhost:29999"),
            ("PMIX_NAMESPACE", "1"),
        ];
        let job = super::super::env::detect_from(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())).unwrap();
        let e = open(&job, T).await.err().unwrap();
        assert!(matches!(e, EnvError::LoopbackStore { var: "FERROCOMM_COORD", .. }), "{e}");
        assert!(e.to_string().contains("127.0.1.1"), "{e}");
    }

    #[tokio::test]
    async fn an_address_of_another_host_cannot_be_hosted() {
        // TEST-NET-3: no host here has it; binding it fails without sending anything.
        let s = store("203.0.113.7", &[29999]);
        let e = host(&s, TOKEN).await.err().unwrap();
        match &e {
            EnvError::NotLocal { addr, var, resolved } => {
                assert_eq!((addr.as_str(), *var, resolved.as_str()), ("203.0.113.7:29999", "TEST_VAR", "203.0.113.7"));
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("FERROCOMM_HOST_STORE=0"), "{e}");
    }

    #[tokio::test]
    async fn an_unreachable_store_names_the_address_the_variable_and_the_host_store_setting() {
        let s = store("localhost", &[free_port()]);
        let e = connect(&s, &TOKEN, Duration::from_millis(300)).await.err().unwrap();
        assert!(matches!(e, EnvError::StoreUnreachable { var: "TEST_VAR", .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&format!("localhost:{}", s.ports[0])) && msg.contains("TEST_VAR"), "{msg}");
        assert!(msg.contains("FERROCOMM_HOST_STORE"), "{msg}");
    }

    #[tokio::test]
    async fn a_wrong_token_at_a_configured_port_is_refused_at_once() {
        let stranger = KvServer::start("127.0.0.1:0".parse().unwrap(), [9; 32]).await.unwrap();
        let s = store("127.0.0.1", &[stranger.addr().port()]);
        let e = connect(&s, &TOKEN, T).await.err().unwrap();
        assert!(matches!(e, EnvError::StoreRefused { var: "TEST_VAR", .. }), "{e}");
    }

    #[tokio::test]
    async fn an_unresolvable_name_is_a_typed_error() {
        // A NUL byte fails before any resolver is asked (tests send nothing off this machine).
        let s = store("bad\0host", &[1]);
        let e = connect(&s, &TOKEN, T).await.err().unwrap();
        assert!(matches!(e, EnvError::Unresolvable { var: "TEST_VAR", .. }), "{e}");
        assert!(e.to_string().contains("host:1 (from TEST_VAR)"), "{e}");
    }
}
