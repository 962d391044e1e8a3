//! Hosts made of network namespaces, for tests that need several machines on one.
//!
//! [`Hosts::new`] builds `count` hosts, each a network namespace with its own address
//! (`10.88.S.1`, `10.88.S.2`, ... on a /24 chosen from the test's process id), joined by veth
//! pairs to a Linux bridge that lives in a hub namespace of its own (so that the root namespace's
//! bridge netfilter and firewall never see the traffic). The root namespace, where the test and
//! the launchers run, reaches the bridge over one more veth pair at `10.88.S.254`: it plays the
//! part of a login node.
//!
//! What makes a namespace a *host* for ferrocomm is its host identity (host name and boot id):
//! every process is started through a wrapper that enters the namespace (`ip netns exec`) and a
//! UTS namespace of its own with the host's name (`unshare --uts`), so the two ranks of one
//! host share memory and ranks of different hosts talk TCP over the bridge, with nothing set by
//! hand. Two wrappers are written:
//!
//! * [`Hosts::place`]: `place.sh PROGRAM ARGS...` picks the host from the rank a launcher gave
//!   (`FERROCOMM_RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK` or `SLURM_PROCID`), `per_host` ranks a
//!   host: for launchers that start every process on this machine (ferrorun, srun);
//! * [`Hosts::agent`]: `agent.sh [OPTIONS] HOST COMMAND...`, a remote shell (the `rsh` an MPI
//!   launcher starts its daemons with) whose "remote" hosts are the namespaces, named by address.
//!
//! Each namespace sees its own `/etc/hosts` (`/etc/netns/NAME/hosts`, which `ip netns exec`
//! mounts over `/etc/hosts`): the host names `PREFIX-h0`, ... resolve to their addresses, and this
//! machine's own name resolves to host 0, which is where a launcher that names the first node as
//! the store's host (Slurm) puts rank 0.
//!
//! Everything is removed when the [`Hosts`] is dropped, also after a failed assertion.

// Each test that includes this module uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `args`; Err with its stderr when it fails.
pub(crate) fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether this process runs as root (namespaces need it).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// This machine's host name (the root namespace's).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string()
}

/// One host: its namespace, address and host name.
#[derive(Clone, Debug)]
pub(crate) struct Host {
    pub ns: String,
    pub addr: String,
    pub name: String,
}

/// Hosts on a bridge, removed on drop.
pub(crate) struct Hosts {
    pub hosts: Vec<Host>,
    /// The root namespace's address on the bridge (the launchers' side).
    pub gateway: String,
    /// The /24 of the hosts, as `10.88.S.0/24`.
    pub subnet: String,
    prefix: String,
    namespaces: Vec<String>,
    root_link: Option<String>,
    dir: PathBuf,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Some(l) = &self.root_link {
            let _ = sh(&["ip", "link", "del", l]);
        }
        for n in self.namespaces.iter().rev() {
            let _ = sh(&["ip", "netns", "del", n]);
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(n));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Hosts {
    /// `count` hosts on a bridge; `tag` (one letter) keeps the names of several sets of one test
    /// process apart.
    pub(crate) fn new(tag: char, count: usize) -> Result<Hosts, String> {
        let pid = std::process::id();
        let prefix = format!("mh{}{tag}", pid % 100_000);
        let s = (pid + u32::from(tag as u8)) % 250 + 1;
        let dir = std::env::temp_dir().join(format!("ferrocomm-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let mut h = Hosts {
            hosts: Vec::new(),
            gateway: format!("10.88.{s}.254"),
            subnet: format!("10.88.{s}.0/24"),
            prefix: prefix.clone(),
            namespaces: Vec::new(),
            root_link: None,
            dir,
        };
        let hub = h.add_ns(format!("{prefix}b"))?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..count {
            let ns = h.add_ns(format!("{prefix}n{i}"))?;
            let port = format!("v{i}");
            sh(&["ip", "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            sh(&["ip", "-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            let addr = format!("10.88.{s}.{}", i + 1);
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            // Multicast leaves by the bridge, not by a default route (there is none).
            sh(&["ip", "-n", &ns, "route", "add", "224.0.0.0/4", "dev", "eth0"])?;
            h.hosts.push(Host { ns, addr, name: format!("{prefix}-h{i}") });
        }
        // The root namespace's leg: a veth whose far end is a port of the bridge.
        let root = format!("{prefix}r");
        let _ = sh(&["ip", "link", "del", &root]);
        sh(&["ip", "link", "add", &root, "type", "veth", "peer", "name", "up0", "netns", &hub])?;
        h.root_link = Some(root.clone());
        sh(&["ip", "-n", &hub, "link", "set", "up0", "master", "br0", "up"])?;
        sh(&["ip", "addr", "add", &format!("{}/24", h.gateway), "dev", &root])?;
        sh(&["ip", "link", "set", &root, "up"])?;
        // Every host's /etc/hosts: the hosts by name, this machine's name as host 0.
        let mut table = String::from("127.0.0.1 localhost\n");
        for (i, host) in h.hosts.iter().enumerate() {
            let alias = if i == 0 { format!(" {}", hostname()) } else { String::new() };
            table += &format!("{} {}{alias}\n", host.addr, host.name);
        }
        table += &format!("{} {prefix}-gateway\n", h.gateway);
        for host in &h.hosts {
            let d = Path::new("/etc/netns").join(&host.ns);
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            std::fs::write(d.join("hosts"), &table).map_err(|e| e.to_string())?;
        }
        Ok(h)
    }

    fn add_ns(&mut self, name: String) -> Result<String, String> {
        let _ = sh(&["ip", "netns", "del", &name]);
        sh(&["ip", "netns", "add", &name])?;
        self.namespaces.push(name.clone());
        sh(&["ip", "-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// The host that runs `rank` when `per_host` consecutive ranks share a host.
    pub(crate) fn of_rank(&self, rank: u32, per_host: u32) -> &Host {
        &self.hosts[(rank / per_host) as usize]
    }

    /// `place.sh`: runs `PROGRAM ARGS...` on the host of its rank (`per_host` ranks a host), as
    /// that host (its namespace, its host name). The rank is the first of `FERROCOMM_RANK`,
    /// `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID` that is set.
    pub(crate) fn place(&self, per_host: u32) -> Result<PathBuf, String> {
        let mut cases = String::new();
        for (i, h) in self.hosts.iter().enumerate() {
            cases += &format!("  {i}) ns={} name={} ;;\n", h.ns, h.name);
        }
        let script = format!(
            "#!/bin/sh\n\
             # Runs \"$@\" on the host of this process's rank: its network namespace, its host name.\n\
             r=${{FERROCOMM_RANK:-${{OMPI_COMM_WORLD_RANK:-${{PMI_RANK:-${{SLURM_PROCID:?no rank in the environment}}}}}}}}\n\
             case $((r / {per_host})) in\n{cases}  *) echo \"place.sh: no host for rank $r\" >&2; exit 2 ;;\nesac\n\
             exec ip netns exec \"$ns\" unshare --uts sh -c 'hostname \"$0\" && exec \"$@\"' \"$name\" \"$@\"\n"
        );
        self.write_script("place.sh", &script)
    }

    /// `agent.sh`: a remote shell for MPI launchers (`agent.sh [-OPTIONS] HOST COMMAND...`): runs
    /// COMMAND with `sh -c` on HOST, a host's address or name, as that host.
    pub(crate) fn agent(&self) -> Result<PathBuf, String> {
        let mut cases = String::new();
        for h in &self.hosts {
            cases += &format!("  {}|{}) ns={} name={} ;;\n", h.addr, h.name, h.ns, h.name);
        }
        let script = format!(
            "#!/bin/sh\n\
             # A remote shell whose hosts are network namespaces: agent.sh [-OPTIONS] HOST COMMAND...\n\
             while [ \"${{1#-}}\" != \"$1\" ]; do shift; done\n\
             host=$1; shift\n\
             case $host in\n{cases}  *) echo \"agent.sh: unknown host $host\" >&2; exit 255 ;;\nesac\n\
             exec ip netns exec \"$ns\" unshare --uts sh -c 'hostname \"$0\" && eval \"$1\"' \"$name\" \"$*\"\n"
        );
        self.write_script("agent.sh", &script)
    }

    fn write_script(&self, name: &str, text: &str) -> Result<PathBuf, String> {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(name);
        std::fs::write(&path, text).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
        Ok(path)
    }

    /// Sets host `i`'s link to the bridge down (the cable pulled).
    pub(crate) fn cut(&self, i: usize) -> Result<(), String> {
        sh(&["ip", "-n", &format!("{}b", self.prefix), "link", "set", &format!("v{i}"), "down"])
    }
}
