//! Where a rank learns who it is.
//!
//! A ferrocomm process does not choose its own rank: the launcher that
//! started it does, and every launcher says so through a different set of
//! environment variables. This module reads them, in a fixed order, into
//! one [`JobEnv`]:
//!
//! 1. `ferrorun` or explicit configuration: `FERROCOMM_RANK`,
//!    `FERROCOMM_SIZE`, `FERROCOMM_COORD` (`host:port` of the key-value
//!    store), `FERROCOMM_TOKEN` (64 hex digits). `FERROCOMM_LAUNCHER=ferrorun`
//!    marks a job started by `ferrorun`, which runs the store itself; without
//!    it the configuration is [`Launcher::Explicit`] and rank 0 hosts the
//!    store only when `FERROCOMM_HOST_STORE=1`.
//! 2. Open MPI (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`.
//! 3. Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS` (or `SLURM_NPROCS`).
//!
//! Under Open MPI and Slurm rank 0 hosts the store. Unless `FERROCOMM_COORD`
//! says otherwise, its port is derived from the job id (a stable FNV-1a hash
//! into `20000..60000`) so that every rank computes the same address without
//! talking to anyone. Unless `FERROCOMM_TOKEN` is set, the token is derived
//! from the job id too: such a token only keeps two jobs that happen to pick
//! the same port apart, it is **no secret** (anyone who can read the job id
//! can compute it). Set `FERROCOMM_TOKEN` (for example from
//! `openssl rand -hex 32`) where other users share the nodes.
//! `FERROCOMM_HOST_STORE=0` stops rank 0 from hosting the store under Open
//! MPI or Slurm, for a store that is run some other way.
//!
//! The default coordinator under Open MPI is `127.0.0.1`, which is right for
//! a single-node job only: a multi-node `mpirun` job must set
//! `FERROCOMM_COORD` to rank 0's host. Under Slurm the default host is the
//! first host of the step's node list, where rank 0 runs with Slurm's
//! default (block) distribution.
//!
//! [`detect_from`] takes the lookup as a closure so that tests never touch
//! the process environment.

use std::fmt;

use thiserror::Error;

/// Largest job this bootstrap accepts (`1 << 20` ranks).
pub const MAX_SIZE: u32 = 1 << 20;

/// Ports derived from a job id fall in `PORT_BASE..PORT_BASE + PORT_SPAN`.
const PORT_BASE: u16 = 20000;
const PORT_SPAN: u16 = 40000;

/// Values longer than this are cut short when quoted in an error message.
const MAX_QUOTED: usize = 80;

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferrorun`, which runs the key-value store itself.
    Ferrorun,
    /// Open MPI's `mpirun` / `mpiexec`.
    OpenMpi,
    /// Slurm's `srun`.
    Slurm,
    /// `FERROCOMM_*` variables set by hand or by some other tool.
    Explicit,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Ferrorun => "ferrorun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
            Launcher::Explicit => "explicit FERROCOMM_* variables",
        })
    }
}

/// Everything a rank needs to join its job.
#[derive(Clone, PartialEq, Eq)]
pub struct JobEnv {
    /// This process's rank, `0..size`.
    pub rank: u32,
    /// Number of ranks in the job, `1..=MAX_SIZE`.
    pub size: u32,
    /// `host:port` of the key-value store used for address exchange.
    pub coordinator: String,
    /// Shared secret (or, when derived from a job id, job separator) that
    /// every connection to the store must present.
    pub token: [u8; 32],
    /// Who started the job.
    pub launcher: Launcher,
    /// True when this rank (rank 0) must itself run the store at
    /// `coordinator`.
    pub host_store: bool,
}

// The token stays out of debug output: it may be a real secret.
impl fmt::Debug for JobEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobEnv")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("coordinator", &self.coordinator)
            .field("token", &"<redacted>")
            .field("launcher", &self.launcher)
            .field("host_store", &self.host_store)
            .finish()
    }
}

/// Why the job environment could not be read.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EnvError {
    /// No launcher variables at all.
    #[error(
        "this process was not started by a launcher: run it under `ferrorun -n N`, \
         `mpirun -n N` or `srun -n N`, or set FERROCOMM_RANK, FERROCOMM_SIZE, \
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
    RankOutOfRange { rank: u32, size: u32, rank_var: &'static str, size_var: &'static str },
}

/// Reads the job environment of this process.
pub fn detect() -> Result<JobEnv, EnvError> {
    detect_from(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
}

/// Reads the job environment through `get`, which returns a variable's value
/// or `None` when it is unset. Empty values count as unset.
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<JobEnv, EnvError> {
    let vars = Vars(&get);
    if vars.get("FERROCOMM_RANK").is_some() || vars.get("FERROCOMM_SIZE").is_some() {
        from_ferrocomm(&vars)
    } else if vars.get("OMPI_COMM_WORLD_RANK").is_some() || vars.get("OMPI_COMM_WORLD_SIZE").is_some() {
        from_open_mpi(&vars)
    } else if vars.get("SLURM_PROCID").is_some() {
        from_slurm(&vars)
    } else if vars.get("FERROCOMM_LAUNCHER").is_some() {
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
}

fn from_ferrocomm<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    const WHY: &str = "the FERROCOMM_* variables are in use, so all of FERROCOMM_RANK, \
                       FERROCOMM_SIZE, FERROCOMM_COORD and FERROCOMM_TOKEN are needed";
    let rank_s = vars.require("FERROCOMM_RANK", WHY)?;
    let size_s = vars.require("FERROCOMM_SIZE", WHY)?;
    let (rank, size) = rank_and_size(("FERROCOMM_RANK", &rank_s), ("FERROCOMM_SIZE", &size_s))?;
    let coord =
        vars.require("FERROCOMM_COORD", "it must give host:port of the key-value store, e.g. 10.0.0.1:29500")?;
    let coordinator = parse_coordinator("FERROCOMM_COORD", &coord)?;
    let token_s = vars.require(
        "FERROCOMM_TOKEN",
        "it must hold 64 hex digits shared by every rank, e.g. from `openssl rand -hex 32`",
    )?;
    let token = parse_token("FERROCOMM_TOKEN", &token_s)?;
    let launcher = match vars.get("FERROCOMM_LAUNCHER").as_deref().map(str::trim) {
        Some("ferrorun") => Launcher::Ferrorun,
        _ => Launcher::Explicit,
    };
    let host_store = match launcher {
        Launcher::Ferrorun => false,
        _ => rank == 0 && vars.get("FERROCOMM_HOST_STORE").as_deref().map(str::trim) == Some("1"),
    };
    Ok(JobEnv { rank, size, coordinator, token, launcher, host_store })
}

fn from_open_mpi<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    const WHY: &str = "Open MPI sets both OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE";
    let rank_s = vars.require("OMPI_COMM_WORLD_RANK", WHY)?;
    let size_s = vars.require("OMPI_COMM_WORLD_SIZE", WHY)?;
    let (rank, size) = rank_and_size(("OMPI_COMM_WORLD_RANK", &rank_s), ("OMPI_COMM_WORLD_SIZE", &size_s))?;
    let job_id = || {
        vars.get("OMPI_MCA_ess_base_jobid")
            .or_else(|| vars.get("PMIX_NAMESPACE"))
            .map(|j| format!("ompi:{}", j.trim()))
            .ok_or(EnvError::Missing {
                var: "OMPI_MCA_ess_base_jobid",
                why: "neither it nor PMIX_NAMESPACE gives the Open MPI job id, which is needed \
                      to derive FERROCOMM_COORD and FERROCOMM_TOKEN when they are not set",
            })
    };
    let coordinator = match vars.get("FERROCOMM_COORD") {
        Some(c) => parse_coordinator("FERROCOMM_COORD", &c)?,
        None => format!("127.0.0.1:{}", derived_port(&job_id()?)),
    };
    let token = match vars.get("FERROCOMM_TOKEN") {
        Some(t) => parse_token("FERROCOMM_TOKEN", &t)?,
        None => derived_token(&job_id()?),
    };
    Ok(JobEnv {
        rank,
        size,
        coordinator,
        token,
        launcher: Launcher::OpenMpi,
        host_store: rank == 0 && !store_hosting_disabled(vars),
    })
}

fn from_slurm<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> Result<JobEnv, EnvError> {
    let rank_s = vars.require("SLURM_PROCID", "Slurm sets it for every task")?;
    let (size_var, size_s) = match vars.get("SLURM_NTASKS") {
        Some(s) => ("SLURM_NTASKS", s),
        None => match vars.get("SLURM_NPROCS") {
            Some(s) => ("SLURM_NPROCS", s),
            None => {
                return Err(EnvError::Missing {
                    var: "SLURM_NTASKS",
                    why: "SLURM_PROCID is set, but neither SLURM_NTASKS nor SLURM_NPROCS gives \
                          the task count",
                });
            }
        },
    };
    let (rank, size) = rank_and_size(("SLURM_PROCID", &rank_s), (size_var, &size_s))?;
    let job_id = || {
        let job = vars.require(
            "SLURM_JOB_ID",
            "the Slurm job id is needed to derive FERROCOMM_COORD and FERROCOMM_TOKEN when \
             they are not set",
        )?;
        let step = vars.get("SLURM_STEP_ID").unwrap_or_default();
        Ok::<_, EnvError>(format!("slurm:{}.{}", job.trim(), step.trim()))
    };
    let coordinator = match vars.get("FERROCOMM_COORD") {
        Some(c) => parse_coordinator("FERROCOMM_COORD", &c)?,
        None => {
            let (var, list) = match vars.get("SLURM_STEP_NODELIST") {
                Some(l) => ("SLURM_STEP_NODELIST", l),
                None => (
                    "SLURM_JOB_NODELIST",
                    vars.require(
                        "SLURM_JOB_NODELIST",
                        "neither it nor SLURM_STEP_NODELIST names rank 0's host; set \
                         FERROCOMM_COORD=host:port instead",
                    )?,
                ),
            };
            let host = first_host(&list).map_err(|reason| invalid(var, &list, reason))?;
            format_host_port(&host, derived_port(&job_id()?))
        }
    };
    let token = match vars.get("FERROCOMM_TOKEN") {
        Some(t) => parse_token("FERROCOMM_TOKEN", &t)?,
        None => derived_token(&job_id()?),
    };
    Ok(JobEnv {
        rank,
        size,
        coordinator,
        token,
        launcher: Launcher::Slurm,
        host_store: rank == 0 && !store_hosting_disabled(vars),
    })
}

fn store_hosting_disabled<F: Fn(&str) -> Option<String>>(vars: &Vars<'_, F>) -> bool {
    vars.get("FERROCOMM_HOST_STORE").as_deref().map(str::trim) == Some("0")
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

/// Checks `host:port` (IPv6 hosts in brackets) and returns it trimmed.
fn parse_coordinator(var: &'static str, value: &str) -> Result<String, EnvError> {
    let v = value.trim();
    let Some((host, port)) = v.rsplit_once(':') else {
        return Err(invalid(var, value, "expected host:port, e.g. 10.0.0.1:29500"));
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
    match port.parse::<u16>() {
        Ok(0) => Err(invalid(var, value, "port 0 cannot be connected to")),
        Ok(_) => Ok(v.to_string()),
        Err(_) => Err(invalid(var, value, "the port is not a number in 1..=65535")),
    }
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

/// Port in `20000..60000` that every rank of a job derives alike.
fn derived_port(job_id: &str) -> u16 {
    let h = fnv1a64(&[b"ferrocomm-port\0", job_id.as_bytes()]);
    // PORT_SPAN fits in u16, so the remainder does too.
    PORT_BASE + (h % u64::from(PORT_SPAN)) as u16
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

    #[test]
    fn nothing_set_is_not_launched() {
        let err = env(&[("PATH", "/bin")]).unwrap_err();
        assert_eq!(err, EnvError::NotLaunched);
        let msg = err.to_string();
        assert!(msg.contains("ferrorun -n N"), "{msg}");
        assert!(msg.contains("mpirun"), "{msg}");
        assert!(msg.contains("srun"), "{msg}");
        assert!(msg.contains("FERROCOMM_RANK"), "{msg}");
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
        assert_eq!(j.coordinator, "127.0.0.1:4000");
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
    fn explicit_variables_and_host_store() {
        let base = [
            ("FERROCOMM_RANK", "0"),
            ("FERROCOMM_SIZE", "2"),
            ("FERROCOMM_COORD", "[::1]:29500"),
            ("FERROCOMM_TOKEN", TOKEN_HEX),
        ];
        let j = env(&base).unwrap();
        assert_eq!(j.launcher, Launcher::Explicit);
        assert_eq!(j.coordinator, "[::1]:29500");
        assert!(!j.host_store);

        let mut with = base.to_vec();
        with.push(("FERROCOMM_HOST_STORE", "1"));
        assert!(env(&with).unwrap().host_store);

        let mut rank1 = with.clone();
        rank1[0] = ("FERROCOMM_RANK", "1");
        assert!(!env(&rank1).unwrap().host_store, "only rank 0 hosts");

        let mut other = base.to_vec();
        other.push(("FERROCOMM_LAUNCHER", "something-else"));
        assert_eq!(env(&other).unwrap().launcher, Launcher::Explicit);
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
        for bad in ["host", "host:", ":5000", "host:0", "host:70000", "::1:5000", "ho st:1"] {
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
    fn open_mpi_defaults() {
        let pairs =
            [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_MCA_ess_base_jobid", "1234567")];
        let j = env(&pairs).unwrap();
        assert_eq!(j.launcher, Launcher::OpenMpi);
        assert_eq!((j.rank, j.size), (0, 8));
        assert!(j.host_store);
        let port: u16 = j.coordinator.strip_prefix("127.0.0.1:").unwrap().parse().unwrap();
        assert!((20000..60000).contains(&port));

        let mut r3 = pairs.to_vec();
        r3[0] = ("OMPI_COMM_WORLD_RANK", "3");
        let j3 = env(&r3).unwrap();
        assert!(!j3.host_store);
        assert_eq!(j3.coordinator, j.coordinator, "ranks agree on the address");
        assert_eq!(j3.token, j.token, "ranks agree on the token");

        let mut other_job = pairs.to_vec();
        other_job[2] = ("OMPI_MCA_ess_base_jobid", "1234568");
        let jo = env(&other_job).unwrap();
        assert_ne!(jo.token, j.token);

        // PMIX_NAMESPACE stands in for the job id.
        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-host-1234@1"),
        ])
        .unwrap();
        assert!(j.coordinator.starts_with("127.0.0.1:"));
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
        ];
        let j = env(&pairs).unwrap();
        assert_eq!(j.launcher, Launcher::Slurm);
        assert_eq!((j.rank, j.size), (0, 16));
        assert!(j.host_store);
        let port: u16 = j.coordinator.strip_prefix("node03:").unwrap().parse().unwrap();
        assert!((20000..60000).contains(&port));

        let mut step1 = pairs.to_vec();
        step1[3] = ("SLURM_STEP_ID", "1");
        let j1 = env(&step1).unwrap();
        assert_ne!(j1.token, j.token, "steps of one job are separate jobs");

        // Job node list and SLURM_NPROCS as fallbacks.
        let j = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NPROCS", "6"),
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_NODELIST", "cn1,cn2"),
        ])
        .unwrap();
        assert!(j.coordinator.starts_with("cn1:"));
        assert_eq!(j.size, 6);
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
    fn slurm_malformed() {
        let base = |procid: &'static str, ntasks: &'static str, list: &'static str| {
            env(&[
                ("SLURM_PROCID", procid),
                ("SLURM_NTASKS", ntasks),
                ("SLURM_JOB_ID", "9"),
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
        let r = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "9")]);
        assert_eq!(missing_var(r), "SLURM_JOB_NODELIST");
        let r = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "n1")]);
        assert_eq!(missing_var(r), "SLURM_JOB_ID");
    }

    #[test]
    fn order_of_sources() {
        // mpirun inside a Slurm allocation: Open MPI's variables win.
        let j = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "x"),
        ])
        .unwrap();
        assert_eq!(j.launcher, Launcher::OpenMpi);
        // ferrorun's variables win over both.
        let j = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
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
        assert!(first_host("").is_err());
    }

    #[test]
    fn hex_round_trip() {
        let t = parse_token("T", TOKEN_HEX).unwrap();
        assert_eq!(to_hex(&t), TOKEN_HEX.to_lowercase());
    }

    #[test]
    fn derived_values_are_stable() {
        // Every rank, on every machine, must compute the same values.
        assert_eq!(derived_port("slurm:1.0"), derived_port("slurm:1.0"));
        assert_eq!(fnv1a64(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(&[b""]), 0xcbf2_9ce4_8422_2325);
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
