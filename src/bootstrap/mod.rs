//! How N processes become one job: learn who we are ([`env`](mod@env)), exchange addresses through a small
//! key-value store ([`kv`]), then connect every pair of ranks with an authenticated handshake.
//! Both handshakes are the challenge-response of [`ferrocomm_transports::auth`]: the job token
//! never travels, and everything else derived from it (the multicast job id and datagram key,
//! the shared-memory file names) goes through that module's key derivation.
//!
//! Rank i connects to every lower rank and accepts every higher one. With
//! `FERROCOMM_TRANSPORTS=verbs` these TCP connections are made all the same and stay open as the
//! verbs transport's liveness channels, while the frames travel over RDMA. The listener keeps running for
//! the life of the rank: whatever else knocks (wrong token, random bytes, a second connection
//! claiming a rank) is refused with a log line, a metric and an entry in
//! [`World::refused_connections`](crate::World::refused_connections), and the rank keeps serving
//! its peers.

pub mod env;
pub mod kv;
pub(crate) mod notices;
pub(crate) mod pmi;
pub(crate) mod pmix;
pub(crate) mod rails;
pub(crate) mod rendezvous;
pub(crate) mod routes;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ferrocomm_reactor::ReactorThread;
use ferrocomm_transports::auth::JobSecret;
use ferrocomm_transports::rails::Bonded;
use ferrocomm_transports::relay::Relayed;
use ferrocomm_transports::route::Routed;
use ferrocomm_transports::tcp::{self, handshake_accept, handshake_connect};
use ferrocomm_transports::wire::{Limits, TOKEN_LEN};
use ferrocomm_transports::{Kind, Rank, Transport, TransportError, WireError};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::api::world::{Inner, Refused, World};
use crate::config::{RailList, Settings, TransportChoice};
use crate::error::{Error, Result};
use crate::p2p::driver::Driver;
use crate::p2p::engine::{self, Engine};
use ferrocomm_reactor::ProgressMode;
use kv::{KvClient, KvServer};

/// Refusals remembered per rank.
const REFUSED_KEPT: usize = 64;
/// Time a connecting peer gets to prove itself.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Joins the job described by the environment (`ferrorun`, `mpirun`, `mpiexec`, `srun`, torchrun's
/// variables, or `FERROCOMM_*` variables), with settings from the environment.
pub async fn init() -> Result<World> {
    init_with(Settings::from_env()?).await
}

/// Like [`init`], with explicit settings.
pub async fn init_with(settings: Settings) -> Result<World> {
    settings.validate()?;
    let job = env::detect()?;
    if job.launcher == env::Launcher::Ferrorun {
        // Its warnings are seen, unless the program has a log of its own.
        crate::observe::log::install();
    }
    let (store, kv, coordinator, host) = rendezvous::open(&job, settings.connect_timeout).await?;
    // The store sees every rank's end through its watch (and ferrorun every process's end).
    let reason =
        if job.launcher == env::Launcher::Ferrorun { TransportError::Launcher } else { TransportError::StoreClosed };
    let store = notices::Store { server: store, host };
    notices::join_watched(job.rank, job.size, kv, &coordinator, job.token, store, settings, reason).await
}

/// Joins as `rank` of `size` through the store at `coordinator`. `store` is the store itself when
/// this rank hosts it: it is kept alive until this rank's world shuts down.
pub async fn join(
    rank: Rank,
    size: u32,
    coordinator: &str,
    token: [u8; TOKEN_LEN],
    store: Option<KvServer>,
    settings: Settings,
) -> Result<World> {
    settings.validate()?;
    let kv = KvClient::connect(coordinator, &token, settings.connect_timeout)
        .await
        .map_err(Error::bootstrap("connecting to the key-value store"))?;
    join_via(rank, size, kv, coordinator, token, &mut { store }, settings).await
}

/// [`join`] through `kv`, a client of the store at `coordinator`.
async fn join_via(
    rank: Rank,
    size: u32,
    mut kv: KvClient,
    coordinator: &str,
    token: [u8; TOKEN_LEN],
    store: &mut Option<KvServer>,
    settings: Settings,
) -> Result<World> {
    if rank >= size {
        return Err(Error::UnknownRank { rank, size });
    }
    let limits = Limits {
        world_size: size,
        eager_limit: settings.eager_limit,
        chunk: settings.rndv_chunk,
        max_message: settings.max_message,
    };
    let thread =
        ReactorThread::spawn(&format!("ferrocomm-{rank}")).map_err(Error::bootstrap("starting the progress thread"))?;

    // Listen, and advertise the address this host uses toward the coordinator.
    let listener = {
        let _rt = thread.handle().enter();
        let std = std::net::TcpListener::bind((settings.bind, 0)).map_err(Error::bootstrap("listening for peers"))?;
        std.set_nonblocking(true).map_err(Error::bootstrap("listening for peers"))?;
        TcpListener::from_std(std).map_err(Error::bootstrap("listening for peers"))?
    };
    let port = listener.local_addr().map_err(Error::bootstrap("listening for peers"))?.port();
    let ip = if settings.bind.is_unspecified() { route_to(coordinator, settings.bind).await? } else { settings.bind };
    let listen_addr = SocketAddr::new(ip, port);
    kv.put(&format!("addr/{rank}"), listen_addr.to_string().as_bytes())
        .await
        .map_err(Error::bootstrap("publishing this rank's address"))?;

    // Which peers share this host: they are reached through shared memory (unless told otherwise,
    // or unless one side cannot run the shared-memory transport).
    let shm_here = settings.transports == TransportChoice::Auto && shm_usable(rank);
    let me = Announce {
        host: host_identity().into_bytes(),
        shm: shm_here,
        busy: settings.progress == ProgressMode::BusyPoll,
        single_copy: shm_here && single_copy_permitted(),
        shared: shared_fingerprint(&settings),
        machine: machine_identity(),
    };
    kv.put(&format!("host/{rank}"), &me.encode()).await.map_err(Error::bootstrap("publishing this rank's host"))?;
    // A rank's host, and its shared-memory domain: the host, or the rank alone if it cannot run
    // the shared-memory transport (every rank derives the same domains from what all announced).
    let mut hosts = Vec::with_capacity(size as usize);
    let mut domains = Vec::with_capacity(size as usize);
    let mut busy = Vec::with_capacity(size as usize);
    let mut single_copy = Vec::with_capacity(size as usize);
    let mut machines = Vec::with_capacity(size as usize);
    for r in 0..size {
        let a = Announce::decode(
            kv.get(&format!("host/{r}"), settings.connect_timeout)
                .await
                .map_err(Error::bootstrap(format!("reading rank {r}'s host")))?,
        );
        if a.shared != me.shared {
            // Ranks that differ here would wait for each other in vain: on connections the other
            // side does not make (verbs), or in the first collective where they pick different
            // algorithms.
            return Err(Error::bootstrap_failed(format!(
                "rank {r}'s settings differ from rank {rank}'s in what every rank must share \
                 (collective selection, point-to-point limits, multicast protocol, verbs or not and \
                 its slots and protocols: see the README's Settings); give every rank the same"
            )));
        }
        domains.push(if a.shm { Domain::Host(a.host.clone()) } else { Domain::Alone(r) });
        hosts.push(a.host);
        busy.push(a.busy);
        single_copy.push(a.single_copy);
        machines.push(a.machine);
    }
    // Node (host) index of every rank, for the node-leader collectives, and its shared-memory
    // domain's index, for the peers reached through shared memory and the board (both numbered
    // in order of their lowest rank).
    let nodes = number(&hosts);
    let domains = number(&domains);
    let local: Vec<bool> =
        (0..size).map(|r| shm_here && r != rank && domains[r as usize] == domains[rank as usize]).collect();
    // More ranks on this machine than CPUs to run them. The machine, not the host: ranks that
    // `FERROCOMM_HOST_ID` or network namespaces make hosts of their own still take turns on the
    // same CPUs, and a spinning rank that does not give way holds up the one it waits for (4 ranks
    // on 2 CPUs, each its own host over TCP: allreduce and broadcast 2-3x slower). Ranks that
    // take turns on a CPU also read each other's messages faster from the cache than from memory
    // (4 ranks on 2 CPUs: all-to-all of 16-64 KiB 1.2-1.4x slower with non-temporal copies), so
    // none then.
    let crowded = machines.iter().filter(|&&m| m == machines[rank as usize]).count() > host_cpus();
    let settings = if crowded { Settings { shm_nt_min: 0, ..settings } } else { settings };

    let refused = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let expect: Vec<bool> = (0..size).map(|r| r > rank && !local[r as usize]).collect();
    let mut to_accept = expect.iter().filter(|&&e| e).count();
    let awaited = Arc::new(Mutex::new(expect));
    thread.handle().spawn(accept_loop(listener, rank, token, limits, refused.clone(), tx, awaited.clone()));

    let mut conns: Vec<Option<std::net::TcpStream>> = (0..size).map(|_| None).collect();
    let deadline = tokio::time::Instant::now() + settings.connect_timeout;
    let proxy = settings.routes.proxy;
    for peer in (0..rank).filter(|&p| !local[p as usize]) {
        let addr = kv
            .get(&format!("addr/{peer}"), settings.connect_timeout)
            .await
            .map_err(Error::bootstrap(format!("reading rank {peer}'s address")))?;
        let addr = String::from_utf8_lossy(&addr).to_string();
        // With proxies on, a peer not reached soon has no direct path (routes.rs).
        let until =
            if proxy { deadline.min(tokio::time::Instant::now() + settings.routes.direct_timeout) } else { deadline };
        let direct = async {
            // A connect whose SYNs vanish (a host that does not forward) ends only at `until`.
            let mut s = tokio::time::timeout_at(until, connect_retry(&addr, until))
                .await
                .map_err(|_| Error::bootstrap_failed(format!("cannot connect to {addr}: timed out")))??;
            tokio::time::timeout_at(until, handshake_connect(&mut s, rank, peer, &token, &limits))
                .await
                .unwrap_or(Err(TransportError::Io(std::io::ErrorKind::TimedOut)))
                .map_err(Error::bootstrap(format!("handshake with rank {peer} at {addr}")))?;
            Ok::<_, Error>(s)
        };
        let s = match direct.await {
            Ok(s) => s,
            Err(e) if proxy => {
                tracing::info!(rank, peer, error = %e, "no direct path; a proxy will relay");
                continue;
            }
            Err(e) => return Err(e),
        };
        tcp::tune(&s, settings.peer_timeout).map_err(Error::bootstrap("tuning a connection"))?;
        conns[peer as usize] = Some(s.into_std().map_err(Error::bootstrap("tuning a connection"))?);
    }
    let reach = if proxy {
        let mine: Vec<Rank> = (0..rank).filter(|&p| conns[p as usize].is_some()).collect();
        let reach = routes::exchange(&mut kv, rank, size, &mine, settings.connect_timeout).await?;
        // Higher ranks that found no direct path to this one will not connect.
        let mut awaited = awaited.lock();
        for r in rank + 1..size {
            if awaited[r as usize] && !reach.connected(rank, r) {
                awaited[r as usize] = false;
                to_accept -= 1;
            }
        }
        Some(reach)
    } else {
        None
    };
    for _ in 0..to_accept {
        let (peer, s) = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .map_err(Error::bootstrap("waiting for higher ranks to connect"))?
            .ok_or_else(|| Error::bootstrap_failed("the listener stopped"))?;
        tcp::tune(&s, settings.peer_timeout).map_err(Error::bootstrap("tuning a connection"))?;
        conns[peer as usize] = Some(s.into_std().map_err(Error::bootstrap("tuning a connection"))?);
    }
    awaited.lock().fill(false);

    // Per-hop costs for the route planner: a calibration file, or a start-up probe of every
    // direct connection (routes.rs).
    let costs = match &reach {
        Some(_) if settings.routes.probes() && settings.transports != TransportChoice::Verbs => {
            let (bytes, timeout) = (settings.routes.probe_bytes, settings.connect_timeout);
            let (back, mine) = thread
                .handle()
                .spawn_blocking(move || {
                    let r = routes::probe(rank, &mut conns, bytes, timeout);
                    (conns, r)
                })
                .await
                .map_err(|e| Error::bootstrap_failed(format!("the route probe stopped: {e}")))?;
            conns = back;
            let mine = mine.map_err(Error::bootstrap("probing the direct connections"))?;
            let costs = routes::share_probes(&mut kv, rank, size, &mine, settings.connect_timeout).await?;
            tracing::debug!(rank, costs = %costs.to_text(), "probed route costs");
            costs
        }
        Some(_) => settings.routes.load_costs()?,
        None => Default::default(),
    };

    // More connections to the same peers over other interfaces, for striping (rails.rs).
    let remote_tcp: Vec<bool> = (0..size).map(|r| r != rank && !local[r as usize]).collect();
    let rails = if settings.rails.list == RailList::Off || settings.transports == TransportChoice::Verbs {
        None
    } else {
        let mine = rails::local_rails(&settings.rails.list, ip)?;
        let timeout = settings.connect_timeout;
        let (h, peer_timeout) = (thread.handle(), settings.peer_timeout);
        // Rails only where there is a direct path.
        let direct: Vec<bool> = conns.iter().map(Option::is_some).collect();
        Some(rails::connect(&mut kv, rank, &direct, mine, &token, &limits, timeout, peer_timeout, h).await?)
    };

    let verbs = settings.transports == TransportChoice::Verbs;
    let tcp = if verbs {
        // Every peer over verbs; the TCP connections stay open as its liveness channels.
        verbs_transport(&mut kv, rank, size, conns, &settings, limits, thread.handle()).await?
    } else {
        let _rt = thread.handle().enter();
        tcp::build(settings.tcp_backend, conns, limits, settings.eager_limit)
            .map_err(Error::bootstrap("starting the TCP transport"))?
    };
    // Peers without a direct connection, through a proxy; slow direct paths, with costs, too.
    let (tcp, ways) = match &reach {
        Some(reach) => {
            let ways = routes::ways(rank, &remote_tcp, reach, &costs, settings.routes.piece)?;
            tracing::debug!(rank, ?ways, "routes");
            let mut relayed = Relayed::new(rank, tcp, ways.clone(), settings.routes.piece, limits);
            relayed.serve(routes::served(rank, size, reach, &costs, settings.routes.piece));
            (Box::new(relayed) as Box<dyn Transport>, Some(ways))
        }
        None => (tcp, None),
    };
    // Pushed rendezvous needs a peer's data frames in order behind their RTS: striping across
    // rails and relaying through proxies do not keep that, so they keep the plain protocol.
    let pushable = rails.is_none() && !proxy;
    let (tcp, rail_stats) = match rails {
        Some(links) if links.conns.iter().flatten().any(|c| c.is_some()) => {
            let _rt = thread.handle().enter();
            let table = links.table(&remote_tcp);
            let mut parts = vec![tcp];
            for c in links.conns {
                parts.push(
                    tcp::build(settings.tcp_backend, c, limits, settings.eager_limit)
                        .map_err(Error::bootstrap("starting a rail's TCP transport"))?,
                );
            }
            let bonded = Bonded::new(rank, parts, &table, settings.rails.stripe(settings.rndv_chunk));
            let stats = bonded.shared_stats();
            (Box::new(bonded) as Box<dyn Transport>, Some(stats))
        }
        _ => (tcp, None),
    };
    let remote = (0..size).any(|r| r != rank && !local[r as usize]);
    let transport = if !local.contains(&true) {
        tcp
    } else {
        let shm = shared_memory(&mut kv, rank, &local, &token, &settings, limits, thread.handle()).await?;
        if remote {
            let route = local.iter().map(|&l| usize::from(l)).collect();
            Box::new(Routed::new(vec![tcp, shm], route)) as Box<dyn Transport>
        } else {
            shm
        }
    };

    // Every rank is connected to us. The store host keeps the store as long as its world: the
    // others' watches are there (see `notices`).
    kv.put(&format!("ready/{rank}"), b"1").await.map_err(Error::bootstrap("announcing that this rank is connected"))?;

    tracing::debug!(rank, size, transport = transport.name(), "joined");
    let cfg = engine::Config {
        eager_limit: settings.eager_limit,
        max_credit: settings.max_credit,
        credit_sync: settings.max_credit.div_ceil(2),
        chunk: settings.rndv_chunk,
        max_message: settings.max_message,
    };
    let mut engine = Engine::with_completions(rank, size, cfg);
    // Over a byte stream a CTS buys no zero-copy: rendezvous data follows its RTS at once.
    for peer in 0..size {
        engine.set_push(peer, pushable && transport.name_for(peer).starts_with("tcp"));
    }
    let rma = crate::rma::hook::Hook::new(&mut engine, rank);
    let driver = Driver { engine, transport, upper: Box::new(rma) };
    let changes = driver.engine.failures().changes();
    let reactor = thread.run(driver, settings.progress);
    // Spinning ranks must give way at once on a crowded host.
    reactor.set_oversubscribed(crowded);
    Ok(World::from_inner(Arc::new(Inner {
        rank,
        size,
        settings,
        reactor,
        refused,
        listen_addr,
        nodes,
        domains,
        busy,
        single_copy,
        job_id: JobSecret::new(token).job_id(),
        datagram_key: JobSecret::new(token).datagram_key(),
        shm_job: local.contains(&true).then(|| shm_job(&token)),
        closed: AtomicBool::new(false),
        rail_stats,
        ways,
        store_link: Mutex::new(Box::new(notices::StoreLink { store: store.take(), goodbye: None })),
        thread: Mutex::new(Some(thread)),
        changes,
        coll_meters: Default::default(),
    })))
}

/// The name of the job's shared-memory files (segments, boards): derived from the token, as the
/// names are visible to every user of the host.
fn shm_job(token: &[u8; TOKEN_LEN]) -> String {
    JobSecret::new(*token).shm_name()
}

/// Connects the shared-memory transport to the ranks on this host (`local[r]`).
#[cfg(target_os = "linux")]
async fn shared_memory(
    kv: &mut KvClient,
    rank: Rank,
    local: &[bool],
    token: &[u8; TOKEN_LEN],
    settings: &Settings,
    limits: Limits,
    rt: &tokio::runtime::Handle,
) -> Result<Box<dyn Transport>> {
    use ferrocomm_transports::shm::{ShmConfig, ShmEndpoint};
    let job = shm_job(token);
    let peers: Vec<Rank> = (0..local.len() as Rank).filter(|&r| local[r as usize]).collect();
    let cfg = ShmConfig { eager_limit: settings.eager_limit, nt_copy_min: settings.shm_nt_min, ..ShmConfig::default() };
    let (endpoint, descriptor) = ShmEndpoint::create(&job, rank, &peers, cfg)
        .map_err(Error::bootstrap("creating the shared-memory endpoint"))?;
    kv.put(&format!("shm/{rank}"), &descriptor)
        .await
        .map_err(Error::bootstrap("publishing the shared-memory endpoint"))?;
    let mut theirs = Vec::new();
    for &p in &peers {
        theirs.push((
            p,
            kv.get(&format!("shm/{p}"), settings.connect_timeout)
                .await
                .map_err(Error::bootstrap(format!("reading rank {p}'s shared-memory endpoint")))?,
        ));
    }
    let _rt = rt.enter();
    Ok(Box::new(endpoint.connect(theirs, limits).map_err(Error::bootstrap("connecting over shared memory"))?))
}

#[cfg(not(target_os = "linux"))]
async fn shared_memory(
    _: &mut KvClient,
    _: Rank,
    _: &[bool],
    _: &[u8; TOKEN_LEN],
    _: &Settings,
    _: Limits,
    _: &tokio::runtime::Handle,
) -> Result<Box<dyn Transport>> {
    Err(Error::bootstrap_failed("shared memory needs Linux"))
}

/// Connects the verbs transport to every peer: queue pair addresses and ring keys through the
/// store, then a barrier (a QP must be connected before anything is written to it).
#[cfg(feature = "verbs")]
async fn verbs_transport(
    kv: &mut KvClient,
    rank: Rank,
    size: u32,
    liveness: Vec<Option<std::net::TcpStream>>,
    settings: &Settings,
    limits: Limits,
    rt: &tokio::runtime::Handle,
) -> Result<Box<dyn Transport>> {
    use ferrocomm_transports::verbs::{VerbsConfig, VerbsEndpoint};
    let v = &settings.verbs;
    let cfg = VerbsConfig {
        device: v.device.clone(),
        gid_index: v.gid_index,
        slots: v.slots,
        eager: v.eager,
        srq_buffers: v.srq_buffers,
        rendezvous: v.rendezvous,
        ..VerbsConfig::default()
    };
    let (endpoint, descriptor) =
        VerbsEndpoint::create(rank, limits, cfg).map_err(Error::bootstrap("creating the verbs endpoint"))?;
    kv.put(&format!("verbs/{rank}"), &descriptor).await.map_err(Error::bootstrap("publishing the verbs endpoint"))?;
    let mut theirs = Vec::new();
    for p in (0..size).filter(|&p| p != rank) {
        theirs.push((
            p,
            kv.get(&format!("verbs/{p}"), settings.connect_timeout)
                .await
                .map_err(Error::bootstrap(format!("reading rank {p}'s verbs endpoint")))?,
        ));
    }
    let transport = {
        let _rt = rt.enter();
        endpoint.connect(theirs, liveness, limits).map_err(Error::bootstrap("connecting over verbs"))?
    };
    kv.put(&format!("verbs-up/{rank}"), b"1").await.map_err(Error::bootstrap("announcing that verbs is up"))?;
    for p in 0..size {
        kv.get(&format!("verbs-up/{p}"), settings.connect_timeout)
            .await
            .map_err(Error::bootstrap(format!("waiting for rank {p}'s verbs")))?;
    }
    tracing::debug!(rank, device = transport.device(), "verbs connected");
    Ok(Box::new(transport))
}

#[cfg(not(feature = "verbs"))]
async fn verbs_transport(
    _: &mut KvClient,
    _: Rank,
    _: u32,
    _: Vec<Option<std::net::TcpStream>>,
    _: &Settings,
    _: Limits,
    _: &tokio::runtime::Handle,
) -> Result<Box<dyn Transport>> {
    Err(Error::bootstrap_failed("the verbs transport needs the `verbs` cargo feature"))
}

/// What each rank announces about itself in the store, for choices every rank must make alike:
/// its host, whether it can run the shared-memory transport, whether it busy-polls (the default
/// table puts collectives on the shared-memory board only if every member does), whether it may
/// read its neighbours' memory (single-copy collectives need every member to), and a fingerprint
/// of the settings every rank must share ([`shared_fingerprint`]).
#[derive(Debug, PartialEq, Eq)]
struct Announce {
    host: Vec<u8>,
    shm: bool,
    busy: bool,
    single_copy: bool,
    shared: u64,
    /// [`machine_identity`]: ranks with the same one share CPUs, whatever their host.
    machine: u64,
}

impl Announce {
    /// The host identity, then a line `shm busy single_copy shared machine` (the identity may
    /// hold anything).
    fn encode(&self) -> Vec<u8> {
        let flag = |b: bool| u8::from(b);
        let (shm, busy, single_copy) = (flag(self.shm), flag(self.busy), flag(self.single_copy));
        let line = format!("\n{shm} {busy} {single_copy} {:x} {:x}", self.shared, self.machine);
        [&self.host[..], line.as_bytes()].concat()
    }

    /// Anything else than [`Announce::encode`]'s form reads as a host of that name that shares
    /// nothing, sleeps, and shares no settings (a peer that speaks it fails that check).
    fn decode(mut b: Vec<u8>) -> Announce {
        let none = |host| Announce { host, shm: false, busy: false, single_copy: false, shared: 0, machine: 0 };
        let Some(i) = b.iter().rposition(|&c| c == b'\n') else { return none(b) };
        let line = b.split_off(i);
        let fields: Vec<&str> = std::str::from_utf8(&line[1..]).unwrap_or("").split(' ').collect();
        match fields[..] {
            [shm, busy, single_copy, shared, machine] => {
                match (u64::from_str_radix(shared, 16), u64::from_str_radix(machine, 16)) {
                    (Ok(shared), Ok(machine)) => {
                        let (shm, busy, single_copy) = (shm == "1", busy == "1", single_copy == "1");
                        Announce { host: b, shm, busy, single_copy, shared, machine }
                    }
                    _ => none(b),
                }
            }
            _ => none(b),
        }
    }
}

/// FNV-1a of the settings every rank must share: the collective selection table, whether the job
/// runs over verbs (every rank or none), the point-to-point protocol's limits (a receiver checks
/// frames against its own: a larger eager limit or credit at the sender reads as a broken
/// protocol, and the peer is cut off), reliable multicast's protocol parameters (window,
/// sub-groups, datagram and message sizes, the token barrier's degree, on or off), and over verbs
/// the eager slots, eager path and rendezvous protocol. Other settings may differ between ranks.
fn shared_fingerprint(settings: &Settings) -> u64 {
    let verbs = settings.transports == TransportChoice::Verbs;
    let s = settings;
    let limits = (s.eager_limit, s.max_credit, s.rndv_chunk, s.max_message);
    let m = &s.multicast;
    let mcast = (m.enabled, m.network, m.window, m.subgroups, m.datagram, m.max_message, m.barrier_degree);
    // Over verbs, the slot rings and the rendezvous protocol too (device and GID are per host).
    let v = &s.verbs;
    let verbs = verbs.then(|| (v.slots, format!("{:?} {:?}", v.eager, v.rendezvous)));
    let (rails, proxy) = (s.rails.list != RailList::Off, s.routes.proxy);
    // The probe is a conversation on every direct connection: every rank probes, or none.
    let probe = s.routes.probes().then_some(s.routes.probe_bytes);
    let routes = format!("rails={rails} proxy={proxy} probe={probe:?}");
    env::fnv1a64(
        &[format!("{:?} verbs={verbs:?} limits={limits:?} mcast={mcast:?} {routes}", s.collectives).as_bytes()],
    )
}

/// Where a rank shares memory: with the other ranks of its host, or (if it cannot run the
/// shared-memory transport) with nobody.
#[derive(PartialEq)]
enum Domain {
    Host(Vec<u8>),
    Alone(Rank),
}

/// Numbers distinct values in order of first appearance: the index of each value's number.
fn number<T: PartialEq>(values: &[T]) -> Vec<u32> {
    let mut seen: Vec<&T> = Vec::new();
    values
        .iter()
        .map(|v| match seen.iter().position(|x| *x == v) {
            Some(i) => i as u32,
            None => {
                seen.push(v);
                seen.len() as u32 - 1
            }
        })
        .collect()
}

/// Whether this rank can run the shared-memory transport; says why not, once, if it cannot.
#[cfg(target_os = "linux")]
fn shm_usable(rank: Rank) -> bool {
    let Some(e) = ferrocomm_transports::shm::unavailable() else { return true };
    tracing::warn!(rank, error = %e, "shared memory unavailable (pidfd_open refused); peers on this host use TCP");
    metrics::counter!("ferrocomm_shm_unavailable").increment(1);
    false
}

#[cfg(not(target_os = "linux"))]
fn shm_usable(_: Rank) -> bool {
    false
}

/// What identifies this host: ranks with the same identity share memory. The boot id tells apart
/// machines (or containers of different machines) that happen to share a host name.
/// `FERROCOMM_HOST_ID` overrides it (ranks with different values then talk over TCP even on one
/// machine, which is how tests exercise multi-host code paths such as hierarchical collectives).
fn host_identity() -> String {
    if let Ok(id) = std::env::var("FERROCOMM_HOST_ID") {
        return id;
    }
    let name =
        std::fs::read_to_string("/proc/sys/kernel/hostname").or_else(|_| std::env::var("HOSTNAME")).unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", name.trim(), boot.trim())
}

/// What identifies the CPUs this rank runs on: the running kernel's boot id (shared by the
/// network namespaces and containers of one machine, different on another machine or VM), not
/// overridden by `FERROCOMM_HOST_ID`. Where there is none, the host identity stands in.
fn machine_identity() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let boot = boot.trim();
    let id = if boot.is_empty() { host_identity() } else { boot.to_string() };
    env::fnv1a64(&[id.as_bytes()])
}

/// The local address the kernel would use to reach `coordinator` (no packet is sent), for a rank
/// listening on the unspecified address `bind`: a host name may resolve to IPv4 and IPv6
/// addresses, and the advertised one must be of a family the listener accepts (an IPv6 listener
/// accepts IPv4 too, where the host allows dual-stack sockets).
async fn route_to(coordinator: &str, bind: IpAddr) -> Result<IpAddr> {
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host(coordinator)
        .await
        .map_err(Error::bootstrap(format!("resolving {coordinator}")))?
        .collect();
    let same = resolved.iter().find(|a| a.is_ipv4() == bind.is_ipv4());
    let target = same.or(if bind.is_ipv6() { resolved.first() } else { None }).ok_or_else(|| {
        Error::bootstrap_failed(format!(
            "{coordinator} resolves to no IPv4 address, and this rank listens on {bind} \
             (FERROCOMM_BIND): set FERROCOMM_BIND=:: or an IPv6 address"
        ))
    })?;
    let any = if target.is_ipv4() { IpAddr::from([0, 0, 0, 0]) } else { IpAddr::from([0u16; 8]) };
    let probe =
        std::net::UdpSocket::bind((any, 0)).map_err(Error::bootstrap("finding the route to the key-value store"))?;
    probe.connect(target).map_err(Error::bootstrap("finding the route to the key-value store"))?;
    Ok(probe.local_addr().map_err(Error::bootstrap("finding the route to the key-value store"))?.ip())
}

async fn connect_retry(addr: &str, deadline: tokio::time::Instant) -> Result<TcpStream> {
    loop {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(Error::bootstrap(format!("connecting to {addr}"))(e));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    me: Rank,
    token: [u8; TOKEN_LEN],
    limits: Limits,
    refused: Arc<Mutex<Vec<Refused>>>,
    tx: mpsc::UnboundedSender<(Rank, TcpStream)>,
    awaited: Arc<Mutex<Vec<bool>>>,
) {
    loop {
        let Ok((mut s, from)) = listener.accept().await else { continue };
        let (refused, tx, awaited) = (refused.clone(), tx.clone(), awaited.clone());
        tokio::spawn(async move {
            let r = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake_accept(&mut s, me, &token, &limits)).await;
            let r = r.unwrap_or(Err(TransportError::Io(std::io::ErrorKind::TimedOut))).and_then(|peer| {
                // Each awaited rank once; anything else (a lower rank, a second claim, a rank on
                // this host, or any connection after start-up) is refused.
                match awaited.lock().get_mut(peer as usize) {
                    Some(waiting @ true) => {
                        *waiting = false;
                        Ok(peer)
                    }
                    _ => Err(TransportError::Wire(WireError::Unexpected(Kind::Hello))),
                }
            });
            match r {
                Ok(peer) => {
                    let _ = tx.send((peer, s));
                }
                Err(error) => {
                    tracing::warn!(rank = me, %from, %error, "refused connection");
                    metrics::counter!("ferrocomm_connections_refused").increment(1);
                    let mut list = refused.lock();
                    if list.len() == REFUSED_KEPT {
                        list.remove(0);
                    }
                    list.push(Refused { from, error });
                }
            }
        });
    }
}

/// The CPUs online on this host. Not `available_parallelism`, which counts this thread's affinity
/// mask: a rank pinned to one CPU (as benchmarks and `--bind-to core` launchers do) would count
/// one CPU and, with a second rank on the host, take itself for oversubscribed and yield its CPU
/// all the time.
fn host_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as usize } else { std::thread::available_parallelism().map_or(1, |c| c.get()) }
}

/// Whether the kernel lets this rank read its sibling ranks' memory (see
/// `shm::single_copy_permitted`); asked once.
fn single_copy_permitted() -> bool {
    static PERMITTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    #[cfg(target_os = "linux")]
    let ask = ferrocomm_transports::shm::single_copy_permitted;
    #[cfg(not(target_os = "linux"))]
    let ask = || false;
    *PERMITTED.get_or_init(ask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::VerbsSettings;

    #[test]
    fn announcements_round_trip_and_odd_ones_share_nothing() {
        let host = b"node-7/1234\nwith a newline".to_vec();
        for (shm, busy, single_copy) in [(true, false, true), (false, true, false)] {
            let a = Announce { host: host.clone(), shm, busy, single_copy, shared: 0xdead_beef, machine: u64::MAX };
            assert_eq!(Announce::decode(a.encode()), a);
        }
        let nothing = |host: &[u8]| Announce {
            host: host.to_vec(),
            shm: false,
            busy: false,
            single_copy: false,
            shared: 0,
            machine: 0,
        };
        assert_eq!(Announce::decode(b"impostor-host".to_vec()), nothing(b"impostor-host"));
        assert_eq!(Announce::decode(b"h\n1 1 1 not-hex 2".to_vec()), nothing(b"h"));
        assert_eq!(Announce::decode(b"h\n1 1 1 2 not-hex".to_vec()), nothing(b"h"));
        assert_eq!(Announce::decode(b"h\n1 1 1 2".to_vec()), nothing(b"h"));
        assert_eq!(Announce::decode(b"h\n\xff 1 1 2".to_vec()), nothing(b"h"));
    }

    #[test]
    fn fingerprints_tell_shared_settings_apart() {
        let plain = Settings::default();
        let pinned = Settings {
            collectives: plain.collectives.clone().with_overrides("allreduce=ring").unwrap(),
            ..plain.clone()
        };
        let verbs = Settings { transports: TransportChoice::Verbs, ..plain.clone() };
        let tcp = Settings { transports: TransportChoice::Tcp, progress: ProgressMode::BusyPoll, ..plain.clone() };
        let eager = Settings { eager_limit: plain.eager_limit / 2, ..plain.clone() };
        assert_ne!(shared_fingerprint(&plain), shared_fingerprint(&eager));
        let slots = Settings { verbs: VerbsSettings { slots: 8, ..plain.verbs.clone() }, ..verbs.clone() };
        assert_ne!(shared_fingerprint(&verbs), shared_fingerprint(&slots));
        let device =
            Settings { verbs: VerbsSettings { device: Some("mlx5_1".into()), ..plain.verbs.clone() }, ..verbs.clone() };
        assert_eq!(shared_fingerprint(&verbs), shared_fingerprint(&device), "devices are per host");
        let mut window = plain.clone();
        window.multicast.window += 1;
        assert_ne!(shared_fingerprint(&plain), shared_fingerprint(&window));
        assert_eq!(shared_fingerprint(&plain), shared_fingerprint(&plain.clone()));
        assert_ne!(shared_fingerprint(&plain), shared_fingerprint(&pinned));
        assert_ne!(shared_fingerprint(&plain), shared_fingerprint(&verbs));
        assert_eq!(shared_fingerprint(&plain), shared_fingerprint(&tcp), "TCP or not, and progress, may differ");
    }
}
