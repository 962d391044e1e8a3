//! Why the job environment (the launcher's variables, the store) cannot be used; here so that
//! [`Error`](super::Error) can hold it without depending on bootstrap, which re-exports it.

use std::time::Duration;

use thiserror::Error;

/// Said by every error about reaching the store: what decides who hosts it.
const HOSTING: &str = "rank 0 hosts the store unless FERROCOMM_HOST_STORE=0 (under ferrorun, ferrorun \
                       hosts it)";

/// Why the job environment could not be read, or its store not hosted or reached.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvError {
    /// No launcher variables at all.
    #[error(
        "this process was not started by a launcher: run it under `ferrorun -n N`, `mpirun -n N`, \
         `mpiexec -n N`, `srun -n N` or torchrun, or set FERROCOMM_RANK, FERROCOMM_SIZE, \
         FERROCOMM_COORD and FERROCOMM_TOKEN"
    )]
    NotLaunched,
    /// A variable the detected launcher must provide is missing.
    #[error("{var} is not set ({why})")]
    Missing {
        /// The missing variable.
        var: &'static str,
        /// Why it is needed.
        why: &'static str,
    },
    /// A variable is set but its value cannot be used.
    #[error("{var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The offending variable.
        var: &'static str,
        /// Its value (shortened; never the token).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The rank does not fit the job size.
    #[error("rank {rank} (from {rank_var}) is out of range for a job of {size} ranks (from {size_var})")]
    RankOutOfRange {
        /// The rank given.
        rank: u32,
        /// The job size given.
        size: u32,
        /// The variable that gave the rank.
        rank_var: &'static str,
        /// The variable that gave the size.
        size_var: &'static str,
    },
    /// Hydra's process manager did not tell the job id, from which the store's ports and the
    /// token are derived, or (for a job across hosts) rank 0's address.
    #[error(
        "cannot ask MPICH Hydra's process manager (PMI_FD) for the job id or rank 0's address: \
         {reason}; set FERROCOMM_COORD and FERROCOMM_TOKEN instead"
    )]
    Pmi {
        /// Why.
        reason: String,
    },
    /// Open MPI's PMIx service, loaded, did not share rank 0's address for a job across hosts.
    #[error(
        "cannot share rank 0's address through Open MPI's PMIx: {reason}; pass \
         `-x FERROCOMM_COORD=<rank 0's host>:<port>` to mpirun instead"
    )]
    Pmix {
        /// Why.
        reason: String,
    },
    /// The store's host name does not resolve.
    #[error("cannot resolve the key-value store's address {addr} (from {var}): {reason}")]
    Unresolvable {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// Why.
        reason: String,
    },
    /// This rank must host the store, but the store's address is not one of this host's.
    #[error(
        "this rank must host the key-value store at {addr} (from {var}), which resolves to {resolved}, \
         none of them an address of this host: run rank 0 on that host, or name rank 0's host in \
         {var}, or set FERROCOMM_HOST_STORE=0 if the store runs elsewhere"
    )]
    NotLocal {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// What the address resolved to.
        resolved: String,
    },
    /// The job spans hosts, and the store's address is a loopback address at the hosting rank.
    #[error(
        "the job's ranks span hosts, but the key-value store's address {addr} (from {var}) resolves \
         to {resolved} on this host, which the other hosts cannot reach (Debian's /etc/hosts maps \
         a machine's own name to 127.0.1.1); set FERROCOMM_COORD to an address of this host that \
         the others reach"
    )]
    LoopbackStore {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// What the address resolved to.
        resolved: String,
    },
    /// This rank must host the store, but every candidate port is taken.
    #[error(
        "this rank must host the key-value store at {addr} (from {var}), but every port is in use \
         (another job, or another program); set FERROCOMM_COORD=host:port to a free port on rank \
         0's host, or FERROCOMM_HOST_STORE=0 if this job's store is already running there"
    )]
    PortsTaken {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
    },
    /// This rank must host the store, and binding its address failed otherwise.
    #[error("this rank must host the key-value store at {addr} (from {var}), and cannot: {reason}")]
    CannotHost {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// Why.
        reason: String,
    },
    /// No store of this job answered in time.
    #[error(
        "no key-value store of this job answered at {addr} (from {var}) within {waited:?} (last \
         error: {last}); {HOSTING}: is rank 0 running, on the host this address names, reachable \
         from here, and started with the same variables?"
    )]
    StoreUnreachable {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// How long this rank tried.
        waited: Duration,
        /// The last attempt's error.
        last: String,
    },
    /// What answers at the configured address is not this job's store: another job's, another
    /// program, or the ranks' tokens differ.
    #[error(
        "what answers at {addr} (from {var}) is not this job's key-value store ({reason}): another \
         job's store or another program holds the port, or FERROCOMM_TOKEN differs between the ranks"
    )]
    StoreRefused {
        /// The store's address as given.
        addr: String,
        /// The variable that gave the address.
        var: &'static str,
        /// Why.
        reason: String,
    },
}
