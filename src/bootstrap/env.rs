//! Where a rank learns who it is, and where its job's key-value store is.
//!
//! A ferrocomm process does not choose its own rank: the launcher that started it does, and every
//! launcher says so through different environment variables. This module reads them into one
//! [`JobEnv`], trying the launchers in this order (the first whose variables are set wins):
//!
//! 1. `FERROCOMM_RANK`, `FERROCOMM_SIZE`, `FERROCOMM_COORD` (`host:port` of the store),
//!    `FERROCOMM_TOKEN` (64 hex digits): `ferrorun`, which also sets `FERROCOMM_LAUNCHER=ferrorun`
//!    and runs the store itself, or variables set by hand ([`Launcher::Explicit`]).
//! 2. torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!    `MASTER_PORT`.
//! 3. Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`.
//! 4. MPICH's Hydra `mpiexec`: `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
//! 5. Slurm's `srun`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (or `SLURM_NTASKS`), `SLURM_LOCALID`.
//!
//! torchrun comes before the MPIs and Slurm because they often start it (`srun torchrun ...`): its
//! workers then carry the outer launcher's variables too, numbered per agent. Hydra inside a Slurm
//! allocation starts its proxies with `srun`, so Hydra's variables win over Slurm's when
//! `MPI_LOCALRANKID` shows that Hydra started the process.
//!
//! **Who hosts the store.** Rank 0, except under `ferrorun` (which hosts it itself) and with
//! `FERROCOMM_HOST_STORE=0` (the store is run some other way, at `FERROCOMM_COORD`).
//!
//! **Where it is.** `FERROCOMM_COORD=host:port` when set, under every launcher, and then exactly
//! that port. Otherwise a host and [`STORE_PORTS`] candidate ports:
//! - torchrun: `MASTER_ADDR`, ports from `MASTER_PORT` up (from `MASTER_PORT + 1` when
//!   `TORCHELASTIC_USE_AGENT_STORE=True` says torchrun's own store holds `MASTER_PORT`);
//! - Slurm: the first host of the step's node list (where rank 0 runs under Slurm's block and
//!   cyclic distributions);
//! - Open MPI and Hydra: `127.0.0.1` for a job on one host (its local size equals its size). They
//!   do not tell a process where rank 0 runs, so for a job whose ranks span hosts rank 0 shares
//!   its address through the launcher's own key-value service: Hydra's PMI-1 over `PMI_FD`
//!   (`bootstrap/pmi.rs`: put, barrier, get), Open MPI's PMIx through `libpmix` opened at run
//!   time (`bootstrap/pmix.rs`: put, commit, fence, get). The address is `FERROCOMM_BIND` when
//!   that names one, else one of the host's own (the default route's interface first). Where
//!   `libpmix` cannot be loaded, such an Open MPI job must set `FERROCOMM_COORD`, and detection
//!   says so;
//! - under Slurm, Open MPI and Hydra the ports are derived from the job id (under Slurm the job
//!   and step ids) by a hash into `20000..32000`, below Linux's default ephemeral range, so that
//!   every rank computes the same list without talking to anyone.
//!
//! Rank 0 binds the first candidate that is free; the others try the candidates in turn and join
//! the store that accepts the job's token, so two jobs whose candidates overlap (or a port some
//! other program holds) do not stop a job.
//!
//! **The token.** `FERROCOMM_TOKEN`, or else derived from the job id: such a token only keeps jobs
//! apart, it is **no secret** (anyone who can read the job id can compute it). Set
//! `FERROCOMM_TOKEN` (for example from `openssl rand -hex 32`) where other users share the nodes.
//!
//! Host names are resolved when the job starts (`bootstrap/rendezvous.rs`), and errors name the
//! address and the variable it came from. [`detect_from`] takes the lookup as a closure so that
//! tests never touch the process environment.

use std::fmt;

pub use crate::error::job::EnvError;

/// Largest job this bootstrap accepts (`1 << 20` ranks).
pub const MAX_SIZE: u32 = 1 << 20;

/// Candidate ports of a store whose port is derived or taken from `MASTER_PORT`.
pub const STORE_PORTS: usize = 4;

/// Ports derived from a job id fall in `PORT_BASE..PORT_BASE + PORT_SPAN`: below Linux's default
/// ephemeral range (32768 and up), from which the kernel picks the ports of outgoing connections
/// and of listeners bound to port 0, such as every rank's own.
const PORT_BASE: u16 = 20000;
const PORT_SPAN: u16 = 12000;

/// Values longer than this are cut short when quoted in an error message.
const MAX_QUOTED: usize = 80;

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferrorun`, which runs the key-value store itself.
    Ferrorun,
    /// PyTorch's `torchrun`, or its variables set by another tool.
    Torchrun,
    /// Open MPI's `mpirun` / `mpiexec`.
    OpenMpi,
    /// MPICH's Hydra `mpiexec` (`mpiexec.hydra`, `mpiexec.mpich`).
    Hydra,
    /// Slurm's `srun`.
    Slurm,
    /// `FERROCOMM_*` variables set by hand or by some other tool.
    Explicit,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Ferrorun => "ferrorun",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Hydra => "MPICH Hydra",
            Launcher::Slurm => "Slurm",
            Launcher::Explicit => "explicit FERROCOMM_* variables",
        })
    }
}

/// Where the job's key-value store listens: a host and the ports to try there, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAddr {
    /// Host name or IP address (an IPv6 address without brackets).
    pub host: String,
    /// Ports to try, in this order; never empty. One when configured, [`STORE_PORTS`] when
    /// derived.
    pub ports: Vec<u16>,
    /// The variables the address came from, named in errors.
    pub source: &'static str,
}

impl StoreAddr {
    /// `host:port` (IPv6 hosts in brackets) of one of the ports.
    pub fn addr(&self, port: u16) -> String {
        format_host_port(&self.host, port)
    }
}

impl fmt::Display for StoreAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.ports[..] {
            [] => f.write_str(&self.host),
            [one] => f.write_str(&self.addr(*one)),
            [first, rest @ ..] => {
                let rest: Vec<String> = rest.iter().map(u16::to_string).collect();
                write!(f, "{} (or port {})", self.addr(*first), rest.join(", "))
            }
        }
    }
}

/// Everything a rank needs to join its job.
#[derive(Clone, PartialEq, Eq)]
pub struct JobEnv {
    /// This process's rank, `0..size`.
    pub rank: u32,
    /// Number of ranks in the job, `1..=MAX_SIZE`.
    pub size: u32,
    /// This process's rank among the job's ranks on its host, when the launcher says.
    pub local_rank: Option<u32>,
    /// Number of the job's ranks on this host, when the launcher says.
    pub local_size: Option<u32>,
    /// `host:port` of the key-value store: the first of [`JobEnv::store`]'s candidates.
    pub coordinator: String,
    /// The store's host, its candidate ports and where they came from.
    pub store: StoreAddr,
    /// Shared secret (or, when derived from a job id, job separator) that every connection to the
    /// store must present.
    pub token: [u8; 32],
    /// Who started the job.
    pub launcher: Launcher,
    /// True when this rank (rank 0) must itself run the store at [`JobEnv::store`].
    pub host_store: bool,
}

// The token stays out of debug output: it may be a real secret.
impl fmt::Debug for JobEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobEnv")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("store", &self.store)
            .field("token", &"<redacted>")
            .field("launcher", &self.launcher)
            .field("host_store", &self.host_store)
            .finish()
    }
}

/// Reads the job environment of this process. Under MPICH Hydra without `FERROCOMM_COORD` or
/// `FERROCOMM_TOKEN`, asks Hydra's process manager for the job id over `PMI_FD`; under Hydra and
/// Open MPI, when the job's ranks span hosts and `FERROCOMM_COORD` is not set, shares rank 0's
/// address through the launcher's key-value service (PMI-1 over `PMI_FD`, PMIx).
pub fn detect() -> Result<JobEnv, EnvError> {
    // The launchers answer once: their conversations end with a finalize, after which Hydra hangs
    // up. The answer is kept for later calls in this process, whose environment is the same.
    static TOLD: std::sync::OnceLock<Result<Told, AskError>> = std::sync::OnceLock::new();
    let get = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    detect_with(&get, &mut |ask| TOLD.get_or_init(|| ask_launcher(ask)).clone())
}

/// Reads the job environment through `get`, which returns a variable's value or `None` when it
/// is unset. Empty values count as unset. No launcher is asked anything: a Hydra job must set
/// `FERROCOMM_COORD` and `FERROCOMM_TOKEN` here, and a job across hosts under Hydra or Open MPI
/// `FERROCOMM_COORD`.
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<JobEnv, EnvError> {
    detect_with(&get, &mut |_| Err(AskError::Unavailable("detect_from does not ask the launcher".to_string())))
}

/// What detection asks a launcher's process manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ask {
    /// [`Launcher::Hydra`] or [`Launcher::OpenMpi`].
    launcher: Launcher,
    /// `PMI_FD`'s value, under Hydra.
    fd: Option<String>,
    /// What this rank does with the store's host.
    role: Role,
}

/// What a rank does with the store's host in the launcher's key-value service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    /// Nothing (Hydra: only the job id is asked).
    Nothing,
    /// Rank 0: publishes `FERROCOMM_BIND` when it names an address, else
    /// [`pmi::own_address`](super::pmi::own_address).
    Publish {
        /// `FERROCOMM_BIND`'s value.
        bind: Option<String>,
    },
    /// The other ranks: read what rank 0 published.
    Fetch,
}

/// What the launcher told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Told {
    /// The job id (Hydra's KVS name).
    job: Option<String>,
    /// The store's host, when shared (rank 0's own as published).
    store_host: Option<String>,
}

/// Why the launcher told nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AskError {
    /// Its service cannot be reached from here at all (no libpmix; [`detect_from`]).
    Unavailable(String),
    /// It was reached, and the exchange failed.
    Failed(String),
}

/// Asks the launcher, for real.
fn ask_launcher(ask: &Ask) -> Result<Told, AskError> {
    use super::{pmi, pmix};
    let published = match &ask.role {
        Role::Publish { bind } => Some(match bind.as_deref().map(str::trim) {
            // An address to listen on is the one to publish; 0.0.0.0 and :: say nothing.
            Some(b) if b.parse::<std::net::IpAddr>().map_or(true, |ip| !ip.is_unspecified()) => b.to_string(),
            _ => pmi::own_address().map_err(AskError::Failed)?.to_string(),
        }),
        _ => None,
    };
    match ask.launcher {
        Launcher::Hydra => {
            let fd = ask.fd.as_deref().unwrap_or_default();
            let share = match (&ask.role, &published) {
                (Role::Fetch, _) => pmi::Share::Fetch,
                (_, Some(host)) => pmi::Share::Publish(host.clone()),
                _ => pmi::Share::Nothing,
            };
            let told = pmi::hydra(fd, &share).map_err(|e| AskError::Failed(e.to_string()))?;
            Ok(Told { job: Some(told.kvsname), store_host: published.or(told.store_host) })
        }
        _ => match pmix::exchange(published.as_deref()) {
            Ok(host) => Ok(Told { job: None, store_host: Some(host) }),
            Err(pmix::PmixError::Unavailable(why)) => Err(AskError::Unavailable(why)),
            Err(pmix::PmixError::Failed(why)) => Err(AskError::Failed(why)),
        },
    }
}

/// [`detect`] with the environment and the launcher's answers given.
fn detect_with<F: Fn(&str) -> Option<String>>(
    get: &F,
    ask: &mut dyn FnMut(&Ask) -> Result<Told, AskError>,
) -> Result<JobEnv, EnvError> {
    let vars = Vars(get);
    let has = |name| vars.get(name).is_some();
    if has("FERROCOMM_RANK") || has("FERROCOMM_SIZE") {
        from_ferrocomm(&vars)
    } else if has("RANK") && has("WORLD_SIZE") {
        from_torchrun(&vars)
    } else if has("OMPI_COMM_WORLD_RANK") || has("OMPI_COMM_WORLD_SIZE") {
        from_open_mpi(&vars, ask)
    } else if has("PMI_RANK") && (has("MPI_LOCALRANKID") || !has("SLURM_PROCID")) {
        from_hydra(&vars, ask)
    } else if has("SLURM_PROCID") {
        from_slurm(&vars)
    } else if has("FERROCOMM_LAUNCHER") {
        // Marked as launched but the rank variables are gone: say which.
        Err(EnvError::Missing {
            var: "FERROCOMM_RANK",
            why: "FERROCOMM_LAUNCHER is set, so the launcher must also set the rank",
        })
    } else {
        Err(EnvError::NotLaunched)
    }
}

struct Vars<'a, F: Fn(&str) -> Option<String>>(&'a F);

impl<F: Fn(&str) -> Option<String>> Vars<'_, F> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }

    fn require(&self, var: &'static str, why: &'static str) -> Result<String, EnvError> {
        self.get(var).ok_or(EnvError::Missing { var, why })
    }

    /// The first of `names` that is set, with its name.
    fn first_of(&self, names: &[&'static str]) -> Option<(&'static str, String)> {
        names.iter().find_map(|&n| self.get(n).map(|v| (n, v)))
    }

    /// `FERROCOMM_COORD`, when set.
    fn configured_store(&self) -> Result<Option<StoreAddr>, EnvError> {
        let Some(value) = self.get("FERROCOMM_COORD") else { return Ok(None) };
        let (host, port) = parse_coordinator("FERROCOMM_COORD", &value)?;
        Ok(Some(StoreAddr { host, ports: vec![port], source: "FERROCOMM_COORD" }))
    }

    /// `FERROCOMM_TOKEN`, or the token derived from the job id.
    fn token_or(&self, job_id: impl FnOnce() -> Result<String, EnvError>) -> Result<[u8; 32], EnvError> {
        match self.get("FERROCOMM_TOKEN") {
            Some(t) => parse_token("FERROCOMM_TOKEN", &t),
            None => Ok(derived_token(&job_id()?)),
        }
    }

    /// Whether rank `rank` hosts the store (not under `ferrorun`).
    fn hosts_store(&self, rank: u32) -> Result<bool, EnvError> {
        const VAR: &str = "FERROCOMM_HOST_STORE";
        match self.get(VAR) {
            None => Ok(rank == 0),
            Some(v) => match v.trim() {
                "0" => Ok(false),
                "1" if rank == 0 => Ok(true),
                "1" => Err(invalid(VAR, &v, format!("only rank 0 hosts the store, and this is rank {rank}"))),
                _ => Err(invalid(VAR, &v, "expected 1 (rank 0 hosts the store; the default) or 0 (it runs elsewhere)")),
            },
        }
    }

    /// The local rank and size from `rank_var` and `size_var`, each optional.
    fn local(&self, rank_var: &'static str, size_var: &'static str) -> Result<(Option<u32>, Option<u32>), EnvError> {
        let rank = self.get(rank_var).map(|v| parse_u32(rank_var, &v)).transpose()?;
        let size = self.get(size_var).map(|v| parse_u32(size_var, &v)).transpose()?;
        check_local((rank_var, rank), (size_var, size))?;
        Ok((rank, size))
    }
}

fn check_local(
    (rank_var, rank): (&'static str, Option<u32>),
    (size_var, size): (&'static str, Option<u32>),
) -> Result<(), EnvError> {
    if let (Some(rank), Some(size)) = (rank, size)
        && rank >= size
    {
        return Err(EnvError::RankOutOfRange { rank, size, rank_var, size_var });
    }
    Ok(())
}

fn job(
    rank: u32,
    size: u32,
    (local_rank, local_size): (Option<u32>, Option<u32>),
    store: StoreAddr,
    token: [u8; 32],
    launcher: Launcher,
    host_store: bool,
) -> JobEnv {
    let coordinator = store.addr(store.ports[0]);
    JobEnv { rank, size, local_rank, local_size, coordinator, store, token, launcher, host_store }
}

fn from_ferrocomm<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    const WHY: &str = "the FERROCOMM_* variables are in use, so all of FERROCOMM_RANK, \
                       FERROCOMM_SIZE, FERROCOMM_COORD and FERROCOMM_TOKEN are needed";
    let rank_s = vars.require("FERROCOMM_RANK", WHY)?;
    let size_s = vars.require("FERROCOMM_SIZE", WHY)?;
    let (rank, size) = rank_and_size(("FERROCOMM_RANK", &rank_s), ("FERROCOMM_SIZE", &size_s))?;
    let coord =
        vars.require("FERROCOMM_COORD", "it must give host:port of the key-value store, e.g. 10.0.0.1:29500")?;
    let (host, port) = parse_coordinator("FERROCOMM_COORD", &coord)?;
    let store = StoreAddr { host, ports: vec![port], source: "FERROCOMM_COORD" };
    let token_s = vars.require(
        "FERROCOMM_TOKEN",
        "it must hold 64 hex digits shared by every rank, e.g. from `openssl rand -hex 32`",
    )?;
    let token = parse_token("FERROCOMM_TOKEN", &token_s)?;
    let (launcher, host_store, local) = match vars.get("FERROCOMM_LAUNCHER").as_deref().map(str::trim) {
        // ferrorun starts every rank on its own host and hosts the store itself.
        Some("ferrorun") => (Launcher::Ferrorun, false, (Some(rank), Some(size))),
        _ => (Launcher::Explicit, vars.hosts_store(rank)?, (None, None)),
    };
    Ok(job(rank, size, local, store, token, launcher, host_store))
}

fn from_torchrun<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    let (rank_s, size_s) = (vars.get("RANK").unwrap_or_default(), vars.get("WORLD_SIZE").unwrap_or_default());
    let (rank, size) = rank_and_size(("RANK", &rank_s), ("WORLD_SIZE", &size_s))?;
    let local = vars.local("LOCAL_RANK", "LOCAL_WORLD_SIZE")?;
    let store = match vars.configured_store()? {
        Some(s) => s,
        None => {
            const WHY: &str = "torchrun's RANK and WORLD_SIZE are set, so MASTER_ADDR and MASTER_PORT \
                               must name rank 0's host and a port for the store (or set \
                               FERROCOMM_COORD=host:port)";
            let addr = vars.require("MASTER_ADDR", WHY)?;
            let port_s = vars.require("MASTER_PORT", WHY)?;
            let host = parse_host("MASTER_ADDR", &addr)?;
            let port = parse_port("MASTER_PORT", &port_s)?;
            // torchrun's own store may hold MASTER_PORT: its workers are then told to use it.
            let agent = vars.get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| {
                let v = v.trim();
                v.eq_ignore_ascii_case("true") || v == "1"
            });
            let first = u32::from(port) + u32::from(agent);
            let ports: Vec<u16> = (first..first + STORE_PORTS as u32).filter_map(|p| u16::try_from(p).ok()).collect();
            if ports.is_empty() {
                return Err(invalid("MASTER_PORT", &port_s, "no port is left above it for ferrocomm's store"));
            }
            StoreAddr { host, ports, source: "MASTER_ADDR and MASTER_PORT" }
        }
    };
    let token = vars.token_or(|| {
        let run = vars.get("TORCHELASTIC_RUN_ID").unwrap_or_default();
        Ok(format!("torch:{}:{}:{}", run.trim(), store.addr(store.ports[0]), size))
    })?;
    Ok(job(rank, size, local, store, token, Launcher::Torchrun, vars.hosts_store(rank)?))
}

/// Where the store is under Open MPI and Hydra, which tell a process neither where rank 0 runs
/// nor the hosts of the job: `FERROCOMM_COORD` when set; else, for a job on one host,
/// `127.0.0.1`; else the host rank 0 shared through the launcher (`shared`). The ports are
/// derived from the job id.
fn launcher_store(
    configured: Option<StoreAddr>,
    shared: Option<String>,
    job_id: impl FnOnce() -> Result<String, EnvError>,
    (var, local_source, shared_source): (&'static str, &'static str, &'static str),
) -> Result<StoreAddr, EnvError> {
    if let Some(s) = configured {
        return Ok(s);
    }
    let (host, source) = match shared {
        Some(host) => (parse_host(var, &host)?, shared_source),
        None => ("127.0.0.1".to_string(), local_source),
    };
    Ok(StoreAddr { host, ports: derived_ports(&job_id()?).to_vec(), source })
}

/// What rank `rank` does with the store's host: share it when the job's ranks span hosts and
/// `FERROCOMM_COORD` does not say where the store is.
fn role<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>, rank: u32, size: u32, local_size: Option<u32>) -> Role {
    if vars.get("FERROCOMM_COORD").is_some() || local_size.is_none_or(|l| l >= size) {
        Role::Nothing
    } else if rank == 0 {
        Role::Publish { bind: vars.get("FERROCOMM_BIND") }
    } else {
        Role::Fetch
    }
}

fn from_open_mpi<F: Fn(&str) -> Option<String>>(
    vars: &Vars<'_, F>,
    ask: &mut dyn FnMut(&Ask) -> Result<Told, AskError>,
) -> Result<JobEnv, EnvError> {
    const WHY: &str = "Open MPI sets both OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE";
    let rank_s = vars.require("OMPI_COMM_WORLD_RANK", WHY)?;
    let size_s = vars.require("OMPI_COMM_WORLD_SIZE", WHY)?;
    let (rank, size) = rank_and_size(("OMPI_COMM_WORLD_RANK", &rank_s), ("OMPI_COMM_WORLD_SIZE", &size_s))?;
    let local = vars.local("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")?;
    let job_id = || {
        vars.first_of(&["OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"]).map(|(_, j)| format!("ompi:{}", j.trim())).ok_or(
            EnvError::Missing {
                var: "OMPI_MCA_ess_base_jobid",
                why: "neither it nor PMIX_NAMESPACE gives the Open MPI job id, which is needed \
                      to derive the store's address and the token when FERROCOMM_COORD and \
                      FERROCOMM_TOKEN are not set",
            },
        )
    };
    let configured = vars.configured_store()?;
    let role = role(vars, rank, size, local.1);
    let shared = if role == Role::Nothing {
        None
    } else {
        // The job id first: without it no port is derived, whatever PMIx says.
        job_id()?;
        let told = ask(&Ask { launcher: Launcher::OpenMpi, fd: None, role }).map_err(|e| match e {
            AskError::Unavailable(_) => EnvError::Missing {
                var: "FERROCOMM_COORD",
                why: "the job's ranks span hosts (OMPI_COMM_WORLD_LOCAL_SIZE < OMPI_COMM_WORLD_SIZE), \
                      Open MPI does not say where rank 0 runs, and its PMIx library (libpmix.so.2) \
                      cannot be loaded to ask: pass `-x FERROCOMM_COORD=<rank 0's host>:<port>` to mpirun",
            },
            AskError::Failed(reason) => EnvError::Pmix { reason },
        })?;
        Some(told.store_host.ok_or_else(|| EnvError::Pmix { reason: "no host was shared".into() })?)
    };
    let store = launcher_store(
        configured,
        shared,
        job_id,
        (
            "PMIx key ferrocomm.store",
            "127.0.0.1 and the Open MPI job id",
            "rank 0's address (shared through PMIx) and the Open MPI job id",
        ),
    )?;
    let token = vars.token_or(job_id)?;
    Ok(job(rank, size, local, store, token, Launcher::OpenMpi, vars.hosts_store(rank)?))
}

fn from_hydra<F: Fn(&str) -> Option<String>>(
    vars: &Vars<'_, F>,
    ask: &mut dyn FnMut(&Ask) -> Result<Told, AskError>,
) -> Result<JobEnv, EnvError> {
    let rank_s = vars.get("PMI_RANK").unwrap_or_default();
    let size_s = vars.require("PMI_SIZE", "MPICH's Hydra sets both PMI_RANK and PMI_SIZE")?;
    let (rank, size) = rank_and_size(("PMI_RANK", &rank_s), ("PMI_SIZE", &size_s))?;
    let local = vars.local("MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
    let configured = vars.configured_store()?;
    // The process manager is asked once, and only if something is derived or shared.
    let role = role(vars, rank, size, local.1);
    let derives = vars.get("FERROCOMM_COORD").is_none() || vars.get("FERROCOMM_TOKEN").is_none();
    let told = if derives || role != Role::Nothing {
        let fd = vars.require(
            "PMI_FD",
            "Hydra's process manager is asked through it for the job id (to derive the store's \
             port and the token when FERROCOMM_COORD and FERROCOMM_TOKEN are not set) and, for a \
             job across hosts, for rank 0's address",
        )?;
        let sharing = role != Role::Nothing;
        let told = ask(&Ask { launcher: Launcher::Hydra, fd: Some(fd), role })
            .map_err(|(AskError::Unavailable(reason) | AskError::Failed(reason))| EnvError::Pmi { reason })?;
        if sharing && told.store_host.is_none() {
            return Err(EnvError::Pmi { reason: "no host was shared".into() });
        }
        Some(told)
    } else {
        None
    };
    let (job, shared) = match told {
        Some(t) => (t.job.map(|j| format!("hydra:{j}")), t.store_host),
        None => (None, None),
    };
    // Asked above whenever a value is derived.
    let job_id = || job.clone().ok_or_else(|| EnvError::Pmi { reason: "the process manager gave no job id".into() });
    let store = launcher_store(
        configured,
        shared,
        job_id,
        (
            "PMI key ferrocomm-store",
            "127.0.0.1 and the Hydra job id",
            "rank 0's address (shared through Hydra's PMI) and the Hydra job id",
        ),
    )?;
    let token = vars.token_or(job_id)?;
    Ok(self::job(rank, size, local, store, token, Launcher::Hydra, vars.hosts_store(rank)?))
}

fn from_slurm<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    let rank_s = vars.require("SLURM_PROCID", "Slurm sets it for every task")?;
    let Some((size_var, size_s)) = vars.first_of(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"]) else {
        return Err(EnvError::Missing {
            var: "SLURM_NTASKS",
            why: "SLURM_PROCID is set, but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS and \
                  SLURM_NPROCS gives the task count",
        });
    };
    let (rank, size) = rank_and_size(("SLURM_PROCID", &rank_s), (size_var, &size_s))?;
    let step = vars.first_of(&["SLURM_STEP_ID", "SLURM_STEPID"]).map(|(_, s)| s);
    if step.is_none() && size > 1 {
        // The batch script (or an salloc shell) has SLURM_PROCID=0 and the job's task count.
        return Err(EnvError::Missing {
            var: "SLURM_STEP_ID",
            why: "SLURM_PROCID is set without a step id, so this process is a batch script or an \
                  salloc shell, not a task that srun started: start the ranks with `srun ./program`",
        });
    }
    let local_rank = vars.get("SLURM_LOCALID").map(|v| parse_u32("SLURM_LOCALID", &v)).transpose()?;
    let local_size = local_tasks(vars)?;
    check_local(("SLURM_LOCALID", local_rank), ("SLURM_STEP_TASKS_PER_NODE", local_size))?;
    let job_id = || {
        let (_, job) = vars.first_of(&["SLURM_JOB_ID", "SLURM_JOBID"]).ok_or(EnvError::Missing {
            var: "SLURM_JOB_ID",
            why: "the Slurm job id is needed to derive the store's port and the token when \
                  FERROCOMM_COORD and FERROCOMM_TOKEN are not set",
        })?;
        let step = step.clone().unwrap_or_else(|| "batch".to_string());
        Ok::<_, EnvError>(format!("slurm:{}.{}", job.trim(), step.trim()))
    };
    let store = match vars.configured_store()? {
        Some(s) => s,
        None => {
            let Some((var, list)) = vars.first_of(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])
            else {
                return Err(EnvError::Missing {
                    var: "SLURM_JOB_NODELIST",
                    why: "neither it nor SLURM_STEP_NODELIST names rank 0's host; set \
                          FERROCOMM_COORD=host:port instead",
                });
            };
            let host = first_host(&list).map_err(|reason| invalid(var, &list, reason))?;
            let source = match var {
                "SLURM_STEP_NODELIST" => "SLURM_STEP_NODELIST and the Slurm job and step ids",
                "SLURM_JOB_NODELIST" => "SLURM_JOB_NODELIST and the Slurm job and step ids",
                _ => "SLURM_NODELIST and the Slurm job and step ids",
            };
            StoreAddr { host, ports: derived_ports(&job_id()?).to_vec(), source }
        }
    };
    let token = vars.token_or(job_id)?;
    Ok(job(rank, size, (local_rank, local_size), store, token, Launcher::Slurm, vars.hosts_store(rank)?))
}

/// The step's tasks on this node: entry `SLURM_NODEID` of `SLURM_STEP_TASKS_PER_NODE`, whose form
/// is `2(x3),1` (2 tasks on each of 3 nodes, then 1).
fn local_tasks<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<Option<u32>, EnvError> {
    const VAR: &str = "SLURM_STEP_TASKS_PER_NODE";
    let (Some(list), Some(node)) = (vars.get(VAR), vars.get("SLURM_NODEID")) else { return Ok(None) };
    let node = parse_u32("SLURM_NODEID", &node)?;
    let mut first = 0u32;
    for entry in list.trim().split(',') {
        let (tasks, repeat) = match entry.split_once("(x") {
            Some((t, r)) => match r.strip_suffix(')') {
                Some(r) => (t, r.parse::<u32>().map_err(|_| invalid(VAR, &list, "cannot read a repeat count"))?),
                None => return Err(invalid(VAR, &list, "a repeat count lacks its ')'")),
            },
            None => (entry, 1),
        };
        let tasks = tasks.trim().parse::<u32>().map_err(|_| invalid(VAR, &list, "cannot read a task count"))?;
        if node < first.saturating_add(repeat) {
            return Ok(Some(tasks));
        }
        first = first.saturating_add(repeat);
    }
    Err(invalid(VAR, &list, format!("it lists {first} nodes, and SLURM_NODEID is {node}")))
}

fn invalid(var: &'static str, value: &str, reason: impl Into<String>) -> EnvError {
    let mut shown: String = value.chars().take(MAX_QUOTED).collect();
    if shown.len() < value.len() {
        shown.push('…');
    }
    EnvError::Invalid { var, value: shown, reason: reason.into() }
}

fn parse_u32(var: &'static str, value: &str) -> Result<u32, EnvError> {
    value.trim().parse::<u32>().map_err(|e| invalid(var, value, format!("expected a non-negative integer ({e})")))
}

fn rank_and_size(
    (rank_var, rank_s): (&'static str, &str),
    (size_var, size_s): (&'static str, &str),
) -> Result<(u32, u32), EnvError> {
    let rank = parse_u32(rank_var, rank_s)?;
    let size = parse_u32(size_var, size_s)?;
    if size == 0 {
        return Err(invalid(size_var, size_s, "a job has at least one rank"));
    }
    if size > MAX_SIZE {
        return Err(invalid(size_var, size_s, format!("at most {MAX_SIZE} ranks are supported")));
    }
    if rank >= size {
        return Err(EnvError::RankOutOfRange { rank, size, rank_var, size_var });
    }
    Ok((rank, size))
}

/// A host name or IP address, an IPv6 address with or without brackets; returned without them.
fn parse_host(var: &'static str, value: &str) -> Result<String, EnvError> {
    let v = value.trim();
    let host = v.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(v);
    if host.is_empty() {
        return Err(invalid(var, value, "the host is empty"));
    }
    if host.chars().any(|c| c.is_whitespace() || c == '[' || c == ']' || c == '/') {
        return Err(invalid(var, value, "not a host name or IP address"));
    }
    Ok(host.to_string())
}

fn parse_port(var: &'static str, value: &str) -> Result<u16, EnvError> {
    match value.trim().parse::<u16>() {
        Ok(0) => Err(invalid(var, value, "port 0 cannot be connected to")),
        Ok(p) => Ok(p),
        Err(_) => Err(invalid(var, value, "the port is not a number in 1..=65535")),
    }
}

/// `host:port` (IPv6 hosts in brackets), as host (without brackets) and port.
fn parse_coordinator(var: &'static str, value: &str) -> Result<(String, u16), EnvError> {
    let v = value.trim();
    let Some((host, port)) = v.rsplit_once(':') else {
        return Err(invalid(var, value, "expected host:port, e.g. 10.0.0.1:29500 or node01:29500"));
    };
    if host.is_empty() {
        return Err(invalid(var, value, "the host is empty"));
    }
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    if host.contains(':') && !bracketed {
        return Err(invalid(var, value, "an IPv6 host must be in brackets, e.g. [::1]:29500"));
    }
    if host.chars().any(char::is_whitespace) {
        return Err(invalid(var, value, "the host contains whitespace"));
    }
    let port = match port.parse::<u16>() {
        Ok(0) => return Err(invalid(var, value, "port 0 cannot be connected to")),
        Ok(p) => p,
        Err(_) => return Err(invalid(var, value, "the port is not a number in 1..=65535")),
    };
    Ok((parse_host(var, host)?, port))
}

fn parse_token(var: &'static str, value: &str) -> Result<[u8; 32], EnvError> {
    // The value may be a real secret: never quote it back.
    let redacted =
        |reason: &str| EnvError::Invalid { var, value: "<redacted>".to_string(), reason: reason.to_string() };
    let v = value.trim().as_bytes();
    if v.len() != 64 {
        return Err(redacted(&format!("expected 64 hex digits (32 bytes), found {} characters", v.len())));
    }
    let mut out = [0u8; 32];
    for (i, pair) in v.chunks_exact(2).enumerate() {
        match (hex_digit(pair[0]), hex_digit(pair[1])) {
            (Some(hi), Some(lo)) => out[i] = hi << 4 | lo,
            _ => return Err(redacted("contains a character that is not a hex digit")),
        }
    }
    Ok(out)
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Lower-case hex of `bytes`, the form `FERROCOMM_TOKEN` takes.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// FNV-1a over `parts` in turn: the job's derived ports, tokens, ids and fingerprints.
pub(crate) fn fnv1a64(parts: &[&[u8]]) -> u64 {
    fnv1a64_bytes(parts.iter().flat_map(|p| p.iter().copied()))
}

/// FNV-1a over `bytes`.
pub(crate) fn fnv1a64_bytes(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The [`STORE_PORTS`] distinct ports in `PORT_BASE..PORT_BASE + PORT_SPAN` that every rank of a
/// job derives alike, in the order they are tried.
fn derived_ports(job_id: &str) -> [u16; STORE_PORTS] {
    let mut ports = [0u16; STORE_PORTS];
    for i in 0..STORE_PORTS {
        let h = fnv1a64(&[b"ferrocomm-port\0", &[i as u8], job_id.as_bytes()]);
        // PORT_SPAN fits in u16, so the remainder does too.
        let mut offset = (h % u64::from(PORT_SPAN)) as u16;
        while ports[..i].contains(&(PORT_BASE + offset)) {
            offset = (offset + 1) % PORT_SPAN;
        }
        ports[i] = PORT_BASE + offset;
    }
    ports
}

/// Token that every rank of a job derives alike. It separates jobs; it is
/// not a secret.
fn derived_token(job_id: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
        let h = fnv1a64(&[b"ferrocomm-token\0", &[i as u8], job_id.as_bytes()]);
        chunk.copy_from_slice(&h.to_le_bytes());
    }
    out
}

fn format_host_port(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// First host of a Slurm host list such as `node[03-05,7],other`
/// (which gives `node03`). Several bracket groups (`r[1-2]n[01-04]`) are
/// expanded too; zero padding is kept as written.
fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    let mut host = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let mut group = String::new();
                let mut closed = false;
                for g in chars.by_ref() {
                    if g == ']' {
                        closed = true;
                        break;
                    }
                    if g == '[' {
                        return Err("nested '[' in the host list".to_string());
                    }
                    group.push(g);
                }
                if !closed {
                    return Err("'[' without a closing ']' in the host list".to_string());
                }
                let first = group.split(',').next().unwrap_or("").trim();
                let low = first.split('-').next().unwrap_or("").trim();
                if low.is_empty() || !low.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!("cannot read the range [{group}] in the host list"));
                }
                host.push_str(low);
            }
            ']' => return Err("']' without an opening '[' in the host list".to_string()),
            c if c.is_whitespace() => return Err("whitespace inside a host name".to_string()),
            c => host.push(c),
        }
    }
    if host.is_empty() {
        return Err("the host list names no host".to_string());
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const TOKEN_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";

    fn env(pairs: &[(&str, &str)]) -> Result<JobEnv, EnvError> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect_from(move |k| map.get(k).cloned())
    }

    /// Like [`env`], with Hydra's process manager answering `kvsname` (and counting the questions);
    /// a shared host is `10.1.0.1`.
    fn env_hydra(pairs: &[(&str, &str)], kvsname: &str, asked: &mut u32) -> Result<JobEnv, EnvError> {
        env_ask(pairs, &mut |ask| {
            assert_eq!((ask.launcher, ask.fd.as_deref()), (Launcher::Hydra, Some("6")));
            *asked += 1;
            let store_host = (ask.role != Role::Nothing).then(|| "10.1.0.1".to_string());
            Ok(Told { job: Some(kvsname.to_string()), store_host })
        })
    }

    /// Like [`env`], with the launcher answering through `ask`.
    fn env_ask(
        pairs: &[(&str, &str)],
        ask: &mut dyn FnMut(&Ask) -> Result<Told, AskError>,
    ) -> Result<JobEnv, EnvError> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let get = move |k: &str| map.get(k).cloned();
        detect_with(&get, ask)
    }

    fn invalid_var(r: Result<JobEnv, EnvError>) -> &'static str {
        match r {
            Err(EnvError::Invalid { var, .. }) => var,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    fn missing_var(r: Result<JobEnv, EnvError>) -> &'static str {
        match r {
            Err(EnvError::Missing { var, .. }) => var,
            other => panic!("expected Missing, got {other:?}"),
        }
    }

    /// The derived candidates: STORE_PORTS distinct ports below the ephemeral range.
    fn assert_derived(store: &StoreAddr) {
        assert_eq!(store.ports.len(), STORE_PORTS, "{store}");
        for (i, p) in store.ports.iter().enumerate() {
            assert!((20000..32000).contains(p), "{store}");
            assert!(!store.ports[..i].contains(p), "{store}");
        }
    }

    #[test]
    fn nothing_set_is_not_launched() {
        let err = env(&[("PATH", "/bin")]).unwrap_err();
        assert_eq!(err, EnvError::NotLaunched);
        let msg = err.to_string();
        for launcher in ["ferrorun -n N", "mpirun", "mpiexec", "srun", "torchrun", "FERROCOMM_RANK"] {
            assert!(msg.contains(launcher), "{msg}");
        }
    }

    #[test]
    fn ferrorun_variables() {
        let j = env(&[
            ("FERROCOMM_RANK", "2"),
            ("FERROCOMM_SIZE", "4"),
            ("FERROCOMM_COORD", "127.0.0.1:4000"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
            ("FERROCOMM_LAUNCHER", "ferrorun"),
        ])
        .unwrap();
        assert_eq!((j.rank, j.size), (2, 4));
        assert_eq!((j.local_rank, j.local_size), (Some(2), Some(4)), "ferrorun runs every rank here");
        assert_eq!(j.coordinator, "127.0.0.1:4000");
        assert_eq!(j.store, StoreAddr { host: "127.0.0.1".into(), ports: vec![4000], source: "FERROCOMM_COORD" });
        assert_eq!(j.token[0..4], [0x00, 0x11, 0x22, 0x33]);
        assert_eq!(j.token[31], 0xff);
        assert_eq!(j.launcher, Launcher::Ferrorun);
        assert!(!j.host_store);
        assert!(!format!("{j:?}").contains("0011"), "token leaked in Debug");
    }

    #[test]
    fn ferrorun_rank0_does_not_host() {
        let j = env(&[
            ("FERROCOMM_RANK", "0"),
            ("FERROCOMM_SIZE", "1"),
            ("FERROCOMM_COORD", "127.0.0.1:4000"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
            ("FERROCOMM_LAUNCHER", "ferrorun"),
            ("FERROCOMM_HOST_STORE", "1"),
        ])
        .unwrap();
        assert!(!j.host_store);
    }

    #[test]
    fn by_hand_rank_0_hosts_the_store_unless_told_otherwise() {
        let base = [
            ("FERROCOMM_RANK", "0"),
            ("FERROCOMM_SIZE", "2"),
            ("FERROCOMM_COORD", "[::1]:29500"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
        ];
        let j = env(&base).unwrap();
        assert_eq!(j.launcher, Launcher::Explicit);
        assert_eq!(j.coordinator, "[::1]:29500");
        assert_eq!(j.store.host, "::1");
        assert!(j.host_store, "rank 0 hosts by default");
        assert_eq!((j.local_rank, j.local_size), (None, None));

        let with = |extra: (&'static str, &'static str), rank: &'static str| {
            let mut v = base.to_vec();
            v[0].1 = rank;
            v.push(extra);
            env(&v)
        };
        assert!(with(("FERROCOMM_HOST_STORE", "1"), "0").unwrap().host_store);
        assert!(!with(("FERROCOMM_HOST_STORE", "0"), "0").unwrap().host_store, "the store runs elsewhere");
        assert!(!with(("FERROCOMM_HOST_STORE", "0"), "1").unwrap().host_store);
        assert!(!with(("PATH", "/bin"), "1").unwrap().host_store, "only rank 0 hosts");
        assert_eq!(invalid_var(with(("FERROCOMM_HOST_STORE", "1"), "1")), "FERROCOMM_HOST_STORE");
        assert_eq!(invalid_var(with(("FERROCOMM_HOST_STORE", "yes"), "0")), "FERROCOMM_HOST_STORE");
        assert_eq!(with(("FERROCOMM_LAUNCHER", "something-else"), "0").unwrap().launcher, Launcher::Explicit);
        // Host names are taken as they are (resolved when the job starts).
        let mut named = base.to_vec();
        named[2].1 = "node-17.cluster:29500";
        assert_eq!(env(&named).unwrap().store.host, "node-17.cluster");
    }

    #[test]
    fn explicit_requires_coord_and_token() {
        let r = env(&[("FERROCOMM_RANK", "0"), ("FERROCOMM_SIZE", "2"), ("FERROCOMM_TOKEN", TOKEN_HEX)]);
        assert_eq!(missing_var(r.clone()), "FERROCOMM_COORD");
        assert!(r.unwrap_err().to_string().contains("host:port"));

        let r = env(&[("FERROCOMM_RANK", "0"), ("FERROCOMM_SIZE", "2"), ("FERROCOMM_COORD", "h:1")]);
        assert_eq!(missing_var(r), "FERROCOMM_TOKEN");

        let r = env(&[("FERROCOMM_SIZE", "2")]);
        assert_eq!(missing_var(r), "FERROCOMM_RANK");
        let r = env(&[("FERROCOMM_RANK", "1")]);
        assert_eq!(missing_var(r), "FERROCOMM_SIZE");
        let r = env(&[("FERROCOMM_LAUNCHER", "ferrorun")]);
        assert_eq!(missing_var(r), "FERROCOMM_RANK");
    }

    #[test]
    fn malformed_ferrocomm_values() {
        let good = |k: &str, v: &'static str| {
            let mut pairs = vec![
                ("FERROCOMM_RANK", "1"),
                ("FERROCOMM_SIZE", "4"),
                ("FERROCOMM_COORD", "host:5000"),
                ("FERROCOMM_TOKEN", TOKEN_HEX),
            ];
            for p in &mut pairs {
                if p.0 == k {
                    p.1 = v;
                }
            }
            env(&pairs)
        };
        assert_eq!(invalid_var(good("FERROCOMM_RANK", "one")), "FERROCOMM_RANK");
        assert_eq!(invalid_var(good("FERROCOMM_RANK", "-1")), "FERROCOMM_RANK");
        assert_eq!(invalid_var(good("FERROCOMM_SIZE", "99999999999")), "FERROCOMM_SIZE");
        assert_eq!(invalid_var(good("FERROCOMM_SIZE", "0")), "FERROCOMM_SIZE");
        assert_eq!(invalid_var(good("FERROCOMM_SIZE", "1048577")), "FERROCOMM_SIZE");
        assert!(good("FERROCOMM_SIZE", "1048576").is_ok());
        assert_eq!(
            good("FERROCOMM_SIZE", "1").unwrap_err(),
            EnvError::RankOutOfRange { rank: 1, size: 1, rank_var: "FERROCOMM_RANK", size_var: "FERROCOMM_SIZE" }
        );
        for bad in ["host", "host:", ":5000", "host:0", "host:70000", "::1:5000", "ho st:1", "[]:1", "a/b:1"] {
            assert_eq!(invalid_var(good("FERROCOMM_COORD", bad)), "FERROCOMM_COORD", "{bad}");
        }
        for bad in ["abc", &TOKEN_HEX[..62], "zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"] {
            let bad: &'static str = Box::leak(bad.to_string().into_boxed_str());
            let err = good("FERROCOMM_TOKEN", bad).unwrap_err();
            assert!(matches!(err, EnvError::Invalid { var: "FERROCOMM_TOKEN", .. }));
            assert!(!err.to_string().contains("8899"), "token quoted: {err}");
        }
        // Whitespace around numbers is tolerated.
        assert_eq!(good("FERROCOMM_RANK", " 3 ").unwrap().rank, 3);
    }

    #[test]
    fn torchrun_variables() {
        let pairs = [
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "trainer-0.example"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "job-7"),
        ];
        let j = env(&pairs).unwrap();
        assert_eq!(j.launcher, Launcher::Torchrun);
        assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (5, 8, Some(1), Some(4)));
        assert_eq!(j.store.host, "trainer-0.example");
        assert_eq!(j.store.ports, [29500, 29501, 29502, 29503]);
        assert_eq!(j.store.source, "MASTER_ADDR and MASTER_PORT");
        assert_eq!(j.coordinator, "trainer-0.example:29500");
        assert!(!j.host_store);

        let mut r0 = pairs.to_vec();
        r0[0].1 = "0";
        let j0 = env(&r0).unwrap();
        assert!(j0.host_store);
        assert_eq!(j0.token, j.token, "ranks agree on the token");
        let mut other_run = pairs.to_vec();
        other_run[6].1 = "job-8";
        assert_ne!(env(&other_run).unwrap().token, j.token);

        // torchrun's own store holds MASTER_PORT: ferrocomm's starts above it.
        let mut agent = pairs.to_vec();
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert_eq!(env(&agent).unwrap().store.ports, [29501, 29502, 29503, 29504]);
        // The candidates stop at the last port.
        let mut top = pairs.to_vec();
        top[5].1 = "65534";
        assert_eq!(env(&top).unwrap().store.ports, [65534, 65535]);
        top.push(("TORCHELASTIC_USE_AGENT_STORE", "1"));
        top[5].1 = "65535";
        assert_eq!(invalid_var(env(&top)), "MASTER_PORT");

        // IPv6 MASTER_ADDR, bracketed or not; FERROCOMM_* override.
        let mut v6 = pairs.to_vec();
        v6[4].1 = "fd00::1";
        assert_eq!(env(&v6).unwrap().coordinator, "[fd00::1]:29500");
        v6[4].1 = "[fd00::1]";
        assert_eq!(env(&v6).unwrap().store.host, "fd00::1");
        let mut set = pairs.to_vec();
        set.extend([("FERROCOMM_COORD", "head:7000"), ("FERROCOMM_TOKEN", TOKEN_HEX)]);
        let j = env(&set).unwrap();
        assert_eq!((j.store.ports.as_slice(), j.store.source, j.token[1]), (&[7000][..], "FERROCOMM_COORD", 0x11));
    }

    #[test]
    fn torchrun_malformed() {
        let r = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]);
        assert_eq!(missing_var(r), "MASTER_ADDR");
        let r = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert_eq!(missing_var(r), "MASTER_PORT");
        let base = |k: &'static str, v: &'static str| {
            let mut p = vec![("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")];
            p.push((k, v));
            p.retain(|&(pk, pv)| pk != k || pv == v);
            env(&p)
        };
        assert_eq!(invalid_var(base("MASTER_PORT", "0")), "MASTER_PORT");
        assert_eq!(invalid_var(base("MASTER_PORT", "http")), "MASTER_PORT");
        assert_eq!(invalid_var(base("MASTER_ADDR", "a b")), "MASTER_ADDR");
        assert_eq!(invalid_var(base("LOCAL_RANK", "x")), "LOCAL_RANK");
        assert!(matches!(base("RANK", "2"), Err(EnvError::RankOutOfRange { rank_var: "RANK", .. })));
        let r = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(matches!(r, Err(EnvError::RankOutOfRange { rank_var: "LOCAL_RANK", .. })));
        // RANK alone is not torchrun's (a common name).
        assert_eq!(env(&[("RANK", "0")]).unwrap_err(), EnvError::NotLaunched);
    }

    #[test]
    fn open_mpi_defaults() {
        let pairs = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
            ("OMPI_MCA_ess_base_jobid", "1234567"),
        ];
        let j = env(&pairs).unwrap();
        assert_eq!(j.launcher, Launcher::OpenMpi);
        assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (0, 8, Some(0), Some(8)));
        assert!(j.host_store);
        assert_eq!(j.store.host, "127.0.0.1");
        assert_derived(&j.store);
        assert_eq!(j.coordinator, format!("127.0.0.1:{}", j.store.ports[0]));

        let mut r3 = pairs.to_vec();
        r3[0] = ("OMPI_COMM_WORLD_RANK", "3");
        r3[2] = ("OMPI_COMM_WORLD_LOCAL_RANK", "3");
        let j3 = env(&r3).unwrap();
        assert!(!j3.host_store);
        assert_eq!(j3.store, j.store, "ranks agree on the address");
        assert_eq!(j3.token, j.token, "ranks agree on the token");

        let mut other_job = pairs.to_vec();
        other_job[4] = ("OMPI_MCA_ess_base_jobid", "1234568");
        let jo = env(&other_job).unwrap();
        assert_ne!(jo.token, j.token);
        assert_ne!(jo.store.ports, j.store.ports);

        // PMIX_NAMESPACE stands in for the job id; the local variables are optional.
        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-host-1234@1"),
        ])
        .unwrap();
        assert!(j.coordinator.starts_with("127.0.0.1:"));
        assert_eq!(j.local_rank, None);
    }

    #[test]
    fn open_mpi_across_hosts_shares_rank_0s_address_through_pmix() {
        let pairs = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_MCA_ess_base_jobid", "1"),
        ];
        // Rank 0 publishes (FERROCOMM_BIND, when set, is what it publishes), the others fetch.
        let mut asks = Vec::new();
        let mut pmix = |ask: &Ask| {
            asks.push(ask.clone());
            Ok(Told { job: None, store_host: Some("10.1.0.1".into()) })
        };
        let j0 = env_ask(&pairs, &mut pmix).unwrap();
        let mut r5 = pairs.to_vec();
        r5[0].1 = "5";
        r5.push(("FERROCOMM_BIND", "10.9.9.9"));
        let j5 = env_ask(&r5, &mut pmix).unwrap();
        assert_eq!(asks[0], Ask { launcher: Launcher::OpenMpi, fd: None, role: Role::Publish { bind: None } });
        assert_eq!(asks[1].role, Role::Fetch);
        assert_eq!((j0.store.host.as_str(), j0.host_store, j5.host_store), ("10.1.0.1", true, false));
        assert_eq!(j0.store, j5.store, "ranks agree");
        assert_eq!(j0.store.source, "rank 0's address (shared through PMIx) and the Open MPI job id");
        assert_derived(&j0.store);
        let mut bound = pairs.to_vec();
        bound.push(("FERROCOMM_BIND", "10.9.9.9"));
        env_ask(&bound, &mut |ask| {
            assert_eq!(ask.role, Role::Publish { bind: Some("10.9.9.9".into()) });
            Ok(Told { job: None, store_host: Some("10.9.9.9".into()) })
        })
        .unwrap();

        // No libpmix: the job must name the store, as the error says.
        let e = env(&pairs).unwrap_err();
        assert_eq!(missing_var(Err(e.clone())), "FERROCOMM_COORD");
        assert!(e.to_string().contains("-x FERROCOMM_COORD") && e.to_string().contains("libpmix"), "{e}");
        // PMIx loaded but failing: a typed error; a shared value that is no host: invalid.
        let e = env_ask(&pairs, &mut |_| Err(AskError::Failed("PMIx_Fence returned status -1".into()))).unwrap_err();
        assert!(matches!(&e, EnvError::Pmix { reason } if reason.contains("PMIx_Fence")), "{e}");
        let e = env_ask(&pairs, &mut |_| Ok(Told { job: None, store_host: Some("a b".into()) })).unwrap_err();
        assert_eq!(invalid_var(Err(e)), "PMIx key ferrocomm.store");
        // FERROCOMM_COORD overrides: PMIx is not asked.
        let mut set = pairs.to_vec();
        set.push(("FERROCOMM_COORD", "head-node:29400"));
        let j = env_ask(&set, &mut |_| panic!("asked")).unwrap();
        assert_eq!((j.coordinator.as_str(), j.host_store), ("head-node:29400", true));
        // A job on one host is not asked either.
        let mut one = pairs.to_vec();
        one[2].1 = "8";
        let j = env_ask(&one, &mut |_| panic!("asked")).unwrap();
        assert_eq!(j.store.host, "127.0.0.1");
    }

    #[test]
    fn open_mpi_overrides() {
        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("FERROCOMM_COORD", "head:7000"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
        ])
        .unwrap();
        assert_eq!(j.coordinator, "head:7000");
        assert_eq!(j.store.ports, [7000]);
        assert_eq!(j.token[1], 0x11);
        assert!(j.host_store);

        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "7"),
            ("FERROCOMM_HOST_STORE", "0"),
        ])
        .unwrap();
        assert!(!j.host_store);
    }

    #[test]
    fn open_mpi_malformed() {
        let r = env(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2"), ("PMIX_NAMESPACE", "a")]);
        assert_eq!(invalid_var(r), "OMPI_COMM_WORLD_RANK");
        let r = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("PMIX_NAMESPACE", "a")]);
        assert_eq!(missing_var(r), "OMPI_COMM_WORLD_SIZE");
        let r = env(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "2"), ("PMIX_NAMESPACE", "a")]);
        assert!(matches!(r, Err(EnvError::RankOutOfRange { rank_var: "OMPI_COMM_WORLD_RANK", .. })));
        let r = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert_eq!(missing_var(r), "OMPI_MCA_ess_base_jobid");
        let r = env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "a"),
            ("FERROCOMM_COORD", "nope"),
        ]);
        assert_eq!(invalid_var(r), "FERROCOMM_COORD");
        let r = env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "a"),
        ]);
        assert!(matches!(r, Err(EnvError::RankOutOfRange { rank_var: "OMPI_COMM_WORLD_LOCAL_RANK", .. })));
    }

    #[test]
    fn hydra_variables() {
        // As `mpiexec.mpich -n 4` on one host sets them.
        let pairs =
            [("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("PMI_FD", "6"), ("MPI_LOCALRANKID", "2"), ("MPI_LOCALNRANKS", "4")];
        let mut asked = 0;
        let j = env_hydra(&pairs, "kvs_17246_0_1756458249_vm", &mut asked).unwrap();
        assert_eq!(asked, 1, "the process manager is asked once");
        assert_eq!(j.launcher, Launcher::Hydra);
        assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (2, 4, Some(2), Some(4)));
        assert!(!j.host_store);
        assert_eq!(j.store.host, "127.0.0.1");
        assert_eq!(j.store.source, "127.0.0.1 and the Hydra job id");
        assert_derived(&j.store);

        let mut r0 = pairs.to_vec();
        r0[0].1 = "0";
        r0[3].1 = "0";
        let j0 = env_hydra(&r0, "kvs_17246_0_1756458249_vm", &mut asked).unwrap();
        assert!(j0.host_store);
        assert_eq!((j0.store.clone(), j0.token), (j.store.clone(), j.token), "ranks agree");
        let other = env_hydra(&pairs, "kvs_17247_0_99_vm", &mut asked).unwrap();
        assert_ne!(other.token, j.token);
        assert_ne!(other.store.ports, j.store.ports);

        // Both set: nothing is derived, nothing asked.
        let mut set = pairs.to_vec();
        set.extend([("FERROCOMM_COORD", "localhost:29400"), ("FERROCOMM_TOKEN", TOKEN_HEX)]);
        let mut asked = 0;
        let j = env_hydra(&set, "unused", &mut asked).unwrap();
        assert_eq!((asked, j.coordinator.as_str()), (0, "localhost:29400"));
    }

    #[test]
    fn hydra_malformed_and_across_hosts() {
        let mut asked = 0;
        let r = env_hydra(&[("PMI_RANK", "0"), ("PMI_FD", "6")], "k", &mut asked);
        assert_eq!(missing_var(r), "PMI_SIZE");
        let r = env_hydra(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")], "k", &mut asked);
        assert_eq!(missing_var(r), "PMI_FD");
        let r = env_hydra(&[("PMI_RANK", "0"), ("PMI_SIZE", "2x"), ("PMI_FD", "6")], "k", &mut asked);
        assert_eq!(invalid_var(r), "PMI_SIZE");
        // Across hosts: rank 0 publishes its address, the others fetch it, one conversation each.
        let spanning = [("PMI_RANK", "0"), ("PMI_SIZE", "4"), ("PMI_FD", "6"), ("MPI_LOCALNRANKS", "2")];
        let mut roles = Vec::new();
        let mut hydra = |ask: &Ask| {
            roles.push(ask.role.clone());
            Ok(Told { job: Some("kvs_9".into()), store_host: Some("10.1.0.1".into()) })
        };
        let j0 = env_ask(&spanning, &mut hydra).unwrap();
        let mut r3 = spanning.to_vec();
        r3[0].1 = "3";
        let j3 = env_ask(&r3, &mut hydra).unwrap();
        assert_eq!(roles, [Role::Publish { bind: None }, Role::Fetch]);
        assert_eq!((j0.store.clone(), j0.token), (j3.store.clone(), j3.token), "ranks agree");
        assert_eq!((j0.store.host.as_str(), j0.host_store, j3.host_store), ("10.1.0.1", true, false));
        assert_eq!(j0.store.source, "rank 0's address (shared through Hydra's PMI) and the Hydra job id");
        assert_derived(&j0.store);
        // A conversation that shares nothing where sharing was asked is an error, not 127.0.0.1.
        let e = env_ask(&spanning, &mut |_| Ok(Told { job: Some("k".into()), store_host: None })).unwrap_err();
        assert!(matches!(e, EnvError::Pmi { .. }), "{e}");
        // FERROCOMM_COORD overrides; only the job id is asked (for the token).
        let mut set = spanning.to_vec();
        set.push(("FERROCOMM_COORD", "10.2.0.1:29400"));
        let j = env_ask(&set, &mut |ask| {
            assert_eq!(ask.role, Role::Nothing);
            Ok(Told { job: Some("k".into()), store_host: None })
        })
        .unwrap();
        assert_eq!(j.coordinator, "10.2.0.1:29400");
        // The process manager failing is a typed error that says what to set instead.
        let map: HashMap<&str, &str> = [("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("PMI_FD", "6")].into();
        let get = |k: &str| map.get(k).map(|v| v.to_string());
        let e = detect_with(&get, &mut |_| Err(AskError::Failed("connection reset".into()))).unwrap_err();
        assert_eq!(e, EnvError::Pmi { reason: "connection reset".into() });
        assert!(e.to_string().contains("FERROCOMM_COORD and FERROCOMM_TOKEN"), "{e}");
        // detect_from does not ask.
        assert!(matches!(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("PMI_FD", "6")]), Err(EnvError::Pmi { .. })));
    }

    #[test]
    fn slurm_defaults() {
        let pairs = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NODELIST", "node[03-05,7],other"),
            ("SLURM_JOB_NODELIST", "ignored[1-9]"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x3),2,2"),
        ];
        let j = env(&pairs).unwrap();
        assert_eq!(j.launcher, Launcher::Slurm);
        assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (0, 16, Some(0), Some(4)));
        assert!(j.host_store);
        assert_eq!(j.store.host, "node03");
        assert_eq!(j.store.source, "SLURM_STEP_NODELIST and the Slurm job and step ids");
        assert_derived(&j.store);
        assert!(j.coordinator.starts_with("node03:"));

        // Concurrent steps of one job are separate jobs, on their own ports.
        let mut step1 = pairs.to_vec();
        step1[3] = ("SLURM_STEP_ID", "1");
        let j1 = env(&step1).unwrap();
        assert_ne!(j1.token, j.token);
        assert_ne!(j1.store.ports, j.store.ports);

        // The step's task count wins over the job's; the local size is this node's entry.
        let mut step = pairs.to_vec();
        step.extend([("SLURM_STEP_NUM_TASKS", "10")]);
        step[7] = ("SLURM_NODEID", "3");
        let js = env(&step).unwrap();
        assert_eq!((js.size, js.local_size), (10, Some(2)));
        step[7] = ("SLURM_NODEID", "5");
        assert_eq!(invalid_var(env(&step)), "SLURM_STEP_TASKS_PER_NODE");

        // Older names and fallbacks: SLURM_JOBID, SLURM_STEPID, SLURM_NPROCS, the job's node list.
        let j = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NPROCS", "6"),
            ("SLURM_JOBID", "1"),
            ("SLURM_STEPID", "0"),
            ("SLURM_JOB_NODELIST", "cn1,cn2"),
        ])
        .unwrap();
        assert!(j.coordinator.starts_with("cn1:"));
        assert_eq!(j.store.source, "SLURM_JOB_NODELIST and the Slurm job and step ids");
        assert_eq!((j.size, j.local_rank, j.local_size), (6, None, None));
        assert!(!j.host_store);

        let j = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("FERROCOMM_COORD", "login:9000"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
        ])
        .unwrap();
        assert_eq!(j.coordinator, "login:9000");
    }

    #[test]
    fn slurm_batch_script_is_not_a_task() {
        // sbatch's script itself: the job's task count, rank 0, no step.
        let batch = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "vm")];
        let e = env(&batch).unwrap_err();
        assert_eq!(missing_var(Err(e.clone())), "SLURM_STEP_ID");
        assert!(e.to_string().contains("srun ./program"), "{e}");
        // A one-task job may run there.
        let mut one = batch.to_vec();
        one[1].1 = "1";
        assert!(env(&one).unwrap().host_store);
    }

    #[test]
    fn slurm_malformed() {
        let base = |procid: &'static str, ntasks: &'static str, list: &'static str| {
            env(&[
                ("SLURM_PROCID", procid),
                ("SLURM_NTASKS", ntasks),
                ("SLURM_JOB_ID", "9"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_STEP_NODELIST", list),
            ])
        };
        assert_eq!(invalid_var(base("a", "2", "n1")), "SLURM_PROCID");
        assert_eq!(invalid_var(base("0", "2x", "n1")), "SLURM_NTASKS");
        assert!(matches!(base("4", "4", "n1"), Err(EnvError::RankOutOfRange { .. })));
        for bad in ["node[03-05", "node]1", "node[a-b]", "node[]", ",n1", "n[1[2]]"] {
            assert_eq!(invalid_var(base("0", "2", bad)), "SLURM_STEP_NODELIST", "{bad}");
        }
        let r = env(&[("SLURM_PROCID", "0"), ("SLURM_JOB_ID", "9"), ("SLURM_JOB_NODELIST", "n1")]);
        assert_eq!(missing_var(r), "SLURM_NTASKS");
        let r = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_STEP_ID", "0"), ("SLURM_JOB_ID", "9")]);
        assert_eq!(missing_var(r), "SLURM_JOB_NODELIST");
        let r =
            env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_STEP_ID", "0"), ("SLURM_JOB_NODELIST", "n1")]);
        assert_eq!(missing_var(r), "SLURM_JOB_ID");
        for bad in ["4(x", "4(x2", "x", "4(xa)"] {
            let bad: &'static str = bad;
            let r = env(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_JOB_ID", "9"),
                ("SLURM_JOB_NODELIST", "n1"),
                ("SLURM_NODEID", "0"),
                ("SLURM_STEP_TASKS_PER_NODE", bad),
            ]);
            assert_eq!(invalid_var(r), "SLURM_STEP_TASKS_PER_NODE", "{bad}");
        }
    }

    #[test]
    fn order_of_sources() {
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_ID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "n1"),
        ];
        // mpirun inside a Slurm allocation: Open MPI's variables win.
        let mut v = slurm.to_vec();
        v.extend([("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("PMIX_NAMESPACE", "x")]);
        assert_eq!(env(&v).unwrap().launcher, Launcher::OpenMpi);
        // srun torchrun: torchrun's numbering wins over Slurm's.
        let mut v = slurm.to_vec();
        v.extend([("RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "n1"), ("MASTER_PORT", "29500")]);
        let j = env(&v).unwrap();
        assert_eq!((j.launcher, j.rank), (Launcher::Torchrun, 3));
        // Hydra inside a Slurm allocation (its proxies started by srun): Hydra's numbering wins.
        let mut v = slurm.to_vec();
        v.extend([("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "0"), ("PMI_FD", "6")]);
        let mut asked = 0;
        let j = env_hydra(&v, "kvs", &mut asked).unwrap();
        assert_eq!((j.launcher, j.rank), (Launcher::Hydra, 2));
        // srun --mpi=pmi2 sets PMI_RANK too, without Hydra's MPI_LOCALRANKID: Slurm's.
        let mut v = slurm.to_vec();
        v.extend([("PMI_RANK", "0"), ("PMI_SIZE", "1")]);
        assert_eq!(env(&v).unwrap().launcher, Launcher::Slurm);
        // ferrorun's variables win over all.
        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("FERROCOMM_RANK", "0"),
            ("FERROCOMM_SIZE", "3"),
            ("FERROCOMM_COORD", "h:1"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
            ("FERROCOMM_LAUNCHER", "ferrorun"),
        ])
        .unwrap();
        assert_eq!((j.launcher, j.size), (Launcher::Ferrorun, 3));
        // Empty values count as unset.
        assert_eq!(env(&[("FERROCOMM_RANK", ""), ("SLURM_PROCID", " ")]).unwrap_err(), EnvError::NotLaunched);
    }

    #[test]
    fn first_host_forms() {
        assert_eq!(first_host("node[03-05,7],other").unwrap(), "node03");
        assert_eq!(first_host("node7").unwrap(), "node7");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert_eq!(first_host("r[2-3]n[010-011]").unwrap(), "r2n010");
        assert_eq!(first_host("n[5]-ib").unwrap(), "n5-ib");
        assert_eq!(first_host("node[01-03,07]").unwrap(), "node01");
        assert!(first_host("").is_err());
    }

    #[test]
    fn store_addresses_display_every_candidate() {
        let s = StoreAddr { host: "fd00::1".into(), ports: vec![20001, 20002], source: "X" };
        assert_eq!(s.to_string(), "[fd00::1]:20001 (or port 20002)");
        let s = StoreAddr { host: "n1".into(), ports: vec![5], source: "X" };
        assert_eq!(s.to_string(), "n1:5");
    }

    #[test]
    fn hex_round_trip() {
        let t = parse_token("T", TOKEN_HEX).unwrap();
        assert_eq!(to_hex(&t), TOKEN_HEX.to_lowercase());
    }

    #[test]
    fn derived_values_are_stable() {
        // Every rank, on every machine, must compute the same values.
        assert_eq!(derived_ports("slurm:1.0"), derived_ports("slurm:1.0"));
        assert_eq!(derived_ports("slurm:1.0"), [27521, 24404, 23923, 25694]);
        assert_eq!(fnv1a64(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(&[b""]), 0xcbf2_9ce4_8422_2325);
        // Candidates stay distinct whatever the hashes give.
        for job in 0..2000 {
            let ports = derived_ports(&format!("slurm:{job}.0"));
            let mut sorted = ports.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), STORE_PORTS);
        }
    }

    #[test]
    fn long_values_are_shortened_in_errors() {
        let long = "9".repeat(500);
        let long: &'static str = Box::leak(long.into_boxed_str());
        let r = env(&[
            ("FERROCOMM_RANK", long),
            ("FERROCOMM_SIZE", "2"),
            ("FERROCOMM_COORD", "h:1"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
        ]);
        let msg = r.unwrap_err().to_string();
        assert!(msg.len() < 300, "{msg}");
    }
}
