//! MPICH Hydra's process manager, asked in the simple PMI-1 wire protocol: lines of
//! `key=value` pairs over the socket `PMI_FD` that Hydra hands each process.
//!
//! Hydra tells a process neither its job id nor where rank 0 runs. Both come from here:
//! - the job id is the KVS name (`kvs_<pid>_<n>_...`), the same for every rank of a job and
//!   different between jobs;
//! - for a job whose ranks span hosts, rank 0 puts its store host into the job's KVS under
//!   [`STORE_KEY`], every rank enters the barrier, and the others get it.
//!
//! A process that has sent `init` must `finalize` before it exits, or Hydra takes its exit for a
//! crash and kills the job: every conversation ends with `finalize`, after which Hydra hangs up.
//! The protocol logic ([`Request::encode`], [`parse_reply`]) is sans-IO; [`hydra`] drives it over
//! the socket.
//!
//! [`own_address`], the address rank 0 shares (here and through PMIx), is here too: which of its
//! host's addresses the other hosts are likeliest to reach.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use thiserror::Error;

/// Key under which rank 0 publishes its store host in the job's KVS.
pub(crate) const STORE_KEY: &str = "ferrocomm-store";

/// Longest reply line read.
const MAX_LINE: usize = 4096;
/// How long one reply other than the barrier's may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the barrier may take: every rank of the job must have started and reached it.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a PMI-1 exchange failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub(crate) enum PmiError {
    /// A reply line is not a list of `key=value` pairs with a `cmd`.
    #[error("malformed reply {line:?}: {why}")]
    Malformed {
        /// The line (shortened).
        line: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A reply to another command than the one sent.
    #[error("expected a {expected} reply, got {line:?}")]
    Unexpected {
        /// The reply command expected.
        expected: &'static str,
        /// The line (shortened).
        line: String,
    },
    /// The process manager answered with a failure code.
    #[error("the process manager refused {cmd} (rc={rc}{msg})")]
    Refused {
        /// The reply command.
        cmd: &'static str,
        /// Its return code.
        rc: String,
        /// Its message, if any, with a leading separator.
        msg: String,
    },
    /// A reply lacks a field it must carry, or carries an unusable one.
    #[error("the {cmd} reply {line:?} has no usable {field}")]
    Field {
        /// The reply command.
        cmd: &'static str,
        /// The field.
        field: &'static str,
        /// The line (shortened).
        line: String,
    },
    /// A value that the wire format cannot carry (empty, whitespace, `=`, too long).
    #[error("{what} {value:?} cannot be sent over PMI-1: {why}")]
    Unsendable {
        /// What the value is.
        what: &'static str,
        /// The value (shortened).
        value: String,
        /// Why not.
        why: String,
    },
    /// `PMI_FD` is not a usable descriptor.
    #[error("PMI_FD={value:?}: {why}")]
    Descriptor {
        /// The variable's value.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
    /// Reading or writing the socket failed (including a process manager that hangs up or does
    /// not answer in time).
    #[error("on PMI_FD={fd} during {cmd}: {reason}")]
    Io {
        /// The descriptor.
        fd: i32,
        /// The request under way.
        cmd: &'static str,
        /// The I/O error.
        reason: String,
    },
}

/// One request of the PMI-1 wire protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request<'a> {
    /// `cmd=init pmi_version=1 pmi_subversion=1`
    Init,
    /// `cmd=get_maxes`: the longest KVS name, key and value the manager takes.
    GetMaxes,
    /// `cmd=get_my_kvsname`
    GetMyKvsname,
    /// `cmd=put kvsname=.. key=.. value=..`
    Put {
        /// The job's KVS.
        kvsname: &'a str,
        /// The key.
        key: &'a str,
        /// The value.
        value: &'a str,
    },
    /// `cmd=barrier_in`: returns once every rank of the job has entered.
    BarrierIn,
    /// `cmd=get kvsname=.. key=..`
    Get {
        /// The job's KVS.
        kvsname: &'a str,
        /// The key.
        key: &'a str,
    },
    /// `cmd=finalize`
    Finalize,
}

impl Request<'_> {
    /// The command named in the request line.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Request::Init => "init",
            Request::GetMaxes => "get_maxes",
            Request::GetMyKvsname => "get_my_kvsname",
            Request::Put { .. } => "put",
            Request::BarrierIn => "barrier_in",
            Request::Get { .. } => "get",
            Request::Finalize => "finalize",
        }
    }

    /// The command the reply carries.
    pub(crate) fn reply(&self) -> &'static str {
        match self {
            Request::Init => "response_to_init",
            Request::GetMaxes => "maxes",
            Request::GetMyKvsname => "my_kvsname",
            Request::Put { .. } => "put_result",
            Request::BarrierIn => "barrier_out",
            Request::Get { .. } => "get_result",
            Request::Finalize => "finalize_ack",
        }
    }

    /// The request line, newline included. Names and values must be non-empty tokens without
    /// whitespace or `=`, which the line format cannot carry.
    pub(crate) fn encode(&self) -> Result<String, PmiError> {
        Ok(match *self {
            Request::Init => "cmd=init pmi_version=1 pmi_subversion=1\n".to_string(),
            Request::GetMaxes => "cmd=get_maxes\n".to_string(),
            Request::GetMyKvsname => "cmd=get_my_kvsname\n".to_string(),
            Request::Put { kvsname, key, value } => format!(
                "cmd=put kvsname={} key={} value={}\n",
                token("KVS name", kvsname)?,
                token("key", key)?,
                token("value", value)?
            ),
            Request::BarrierIn => "cmd=barrier_in\n".to_string(),
            Request::Get { kvsname, key } => {
                format!("cmd=get kvsname={} key={}\n", token("KVS name", kvsname)?, token("key", key)?)
            }
            Request::Finalize => "cmd=finalize\n".to_string(),
        })
    }
}

fn token<'a>(what: &'static str, value: &'a str) -> Result<&'a str, PmiError> {
    let why = if value.is_empty() {
        "it is empty"
    } else if value.chars().any(|c| c.is_whitespace() || c == '=') {
        "it contains whitespace or '='"
    } else if value.len() > MAX_LINE / 4 {
        "it is too long"
    } else {
        return Ok(value);
    };
    Err(PmiError::Unsendable { what, value: shorten(value), why: why.to_string() })
}

fn shorten(line: &str) -> String {
    const MAX: usize = 120;
    let mut s: String = line.chars().take(MAX).collect();
    if s.len() < line.len() {
        s.push('…');
    }
    s
}

/// A reply line: its command and its other `key=value` pairs, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply<'a> {
    line: &'a str,
    cmd: &'static str,
    fields: Vec<(&'a str, &'a str)>,
}

impl<'a> Reply<'a> {
    /// The value of `key`, if the reply carries it.
    pub(crate) fn get(&self, key: &str) -> Option<&'a str> {
        self.fields.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    /// The value of `key`, which must be present and non-empty.
    pub(crate) fn require(&self, key: &'static str) -> Result<&'a str, PmiError> {
        self.get(key).filter(|v| !v.is_empty()).ok_or_else(|| self.field_error(key))
    }

    fn field_error(&self, field: &'static str) -> PmiError {
        PmiError::Field { cmd: self.cmd, field, line: shorten(self.line) }
    }
}

/// Parses `line` (without its newline) as the reply to `request`: it must be `cmd=<reply>` with
/// `key=value` pairs, and report no failure (`rc` other than 0).
pub(crate) fn parse_reply<'a>(line: &'a str, request: &Request<'_>) -> Result<Reply<'a>, PmiError> {
    let expected = request.reply();
    let malformed = |why| PmiError::Malformed { line: shorten(line), why };
    let mut cmd = None;
    let mut fields = Vec::new();
    for pair in line.split_whitespace() {
        let (k, v) = pair.split_once('=').ok_or_else(|| malformed("a word is not key=value"))?;
        if k.is_empty() {
            return Err(malformed("a key is empty"));
        }
        if k == "cmd" {
            if cmd.is_some() {
                return Err(malformed("two cmd fields"));
            }
            cmd = Some(v);
        } else {
            fields.push((k, v));
        }
    }
    match cmd {
        None => return Err(malformed("no cmd field")),
        Some(c) if c != expected => return Err(PmiError::Unexpected { expected, line: shorten(line) }),
        Some(_) => {}
    }
    let reply = Reply { line, cmd: expected, fields };
    if let Some(rc) = reply.get("rc")
        && rc != "0"
    {
        let msg = reply.get("msg").map(|m| format!(", {m}")).unwrap_or_default();
        return Err(PmiError::Refused { cmd: expected, rc: rc.to_string(), msg });
    }
    if let Request::Init = request
        && reply.get("pmi_version").is_some_and(|v| v != "1")
    {
        return Err(reply.field_error("pmi_version"));
    }
    Ok(reply)
}

/// The lengths a `maxes` reply allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Maxes {
    /// Longest key.
    pub(crate) key: usize,
    /// Longest value.
    pub(crate) value: usize,
}

impl Maxes {
    /// From a `maxes` reply.
    pub(crate) fn from_reply(reply: &Reply<'_>) -> Result<Maxes, PmiError> {
        let num = |f: &'static str| {
            reply.require(f)?.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| reply.field_error(f))
        };
        Ok(Maxes { key: num("keylen_max")?, value: num("vallen_max")? })
    }

    /// Checks that `key` and `value` fit.
    pub(crate) fn check(&self, key: &str, value: &str) -> Result<(), PmiError> {
        // The C library counts the terminating NUL in the maximum.
        for (what, s, max) in [("key", key, self.key), ("value", value, self.value)] {
            if s.len() >= max {
                let why = format!("the process manager takes at most {} bytes", max.saturating_sub(1));
                return Err(PmiError::Unsendable { what, value: shorten(s), why });
            }
        }
        Ok(())
    }
}

/// What rank does what with the store's host in a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Share {
    /// Nothing: only the job id is asked.
    Nothing,
    /// Rank 0: puts this host, then enters the barrier.
    Publish(String),
    /// The other ranks: enter the barrier, then get rank 0's host.
    Fetch,
}

/// What a conversation learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    /// The job's KVS name: its id.
    pub(crate) kvsname: String,
    /// The store's host, when shared.
    pub(crate) store_host: Option<String>,
}

/// The requests of a conversation, in order, given the KVS name once it is known.
pub(crate) fn plan<'a>(share: &'a Share, kvsname: &'a str) -> Vec<Request<'a>> {
    match share {
        Share::Nothing => vec![],
        Share::Publish(host) => vec![Request::Put { kvsname, key: STORE_KEY, value: host }, Request::BarrierIn],
        Share::Fetch => vec![Request::BarrierIn, Request::Get { kvsname, key: STORE_KEY }],
    }
}

/// Runs a conversation over the socket numbered `fd_value`: `init`, `get_maxes`, `get_my_kvsname`,
/// the steps of [`plan`], and `finalize` (also after a failure, once `init` succeeded).
pub(crate) fn hydra(fd_value: &str, share: &Share) -> Result<Answer, PmiError> {
    let mut conversation = Conversation::open(fd_value)?;
    conversation.call(&Request::Init)?;
    let result = conversation.exchange(share);
    let finalized = conversation.call(&Request::Finalize);
    let answer = result?;
    finalized?;
    Ok(answer)
}

/// A duplicate of the launcher's descriptor, so that the launcher's stays as it was.
struct Conversation {
    fd: i32,
    sock: UnixStream,
}

impl Conversation {
    fn open(fd_value: &str) -> Result<Conversation, PmiError> {
        let bad = |why: String| PmiError::Descriptor { value: fd_value.to_string(), why };
        let fd: i32 =
            fd_value.trim().parse().ok().filter(|&fd| fd >= 0).ok_or_else(|| bad("not a descriptor number".into()))?;
        // SAFETY: fstat only writes the stat buffer it is given, which lives for the call.
        let is_socket = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK
        };
        if !is_socket {
            return Err(bad("not an open socket".into()));
        }
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) has no memory-safety preconditions.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(bad(format!("cannot duplicate it: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: `dup` is a fresh descriptor that nothing else owns.
        let sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(dup) });
        sock.set_write_timeout(Some(REPLY_TIMEOUT)).map_err(|e| bad(e.to_string()))?;
        Ok(Conversation { fd, sock })
    }

    fn exchange(&mut self, share: &Share) -> Result<Answer, PmiError> {
        let line = self.call(&Request::GetMaxes)?;
        let maxes = Maxes::from_reply(&line.as_reply(&Request::GetMaxes)?)?;
        let kvsname = self.call(&Request::GetMyKvsname)?.field(&Request::GetMyKvsname, "kvsname")?;
        if let Share::Publish(host) = share {
            maxes.check(STORE_KEY, host)?;
        }
        let mut store_host = None;
        for request in plan(share, &kvsname) {
            let line = self.call(&request)?;
            if let Request::Get { .. } = request {
                store_host = Some(line.field(&request, "value")?);
            }
        }
        Ok(Answer { kvsname, store_host })
    }

    /// Sends `request` and returns its reply line, checked by [`parse_reply`].
    fn call(&mut self, request: &Request<'_>) -> Result<Line, PmiError> {
        let io = |e: std::io::Error| PmiError::Io { fd: self.fd, cmd: request.name(), reason: e.to_string() };
        let text = request.encode()?;
        let timeout = if let Request::BarrierIn = request { BARRIER_TIMEOUT } else { REPLY_TIMEOUT };
        self.sock.set_read_timeout(Some(timeout)).map_err(io)?;
        self.sock.write_all(text.as_bytes()).map_err(io)?;
        let line = Line(read_line(&mut self.sock).map_err(io)?);
        line.as_reply(request)?;
        Ok(line)
    }
}

/// A reply line, owned.
struct Line(String);

impl Line {
    fn as_reply<'a>(&'a self, request: &Request<'_>) -> Result<Reply<'a>, PmiError> {
        parse_reply(&self.0, request)
    }

    fn field(&self, request: &Request<'_>, key: &'static str) -> Result<String, PmiError> {
        Ok(self.as_reply(request)?.require(key)?.to_string())
    }
}

/// One line, without its newline, of at most [`MAX_LINE`] bytes.
fn read_line(sock: &mut UnixStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        if sock.read(&mut byte)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the process manager hung up"));
        }
        match byte[0] {
            b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ if line.len() == MAX_LINE => {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "reply line too long"));
            }
            b => line.push(b),
        }
    }
}

/// The address rank 0 publishes as the store's host when its launcher does not say where it
/// runs: an address of this host that the others can reach. Launchers give no hint of which
/// network the other hosts share, so the choice is the one most hosts route by: an IPv4 address
/// of the interface of the default route, else the first IPv4 address of any interface that is up
/// (in the kernel's order), else such an IPv6 address; never a loopback or link-local one.
/// `FERROCOMM_BIND`, or `FERROCOMM_COORD` for the store alone, chooses otherwise.
pub(crate) fn own_address() -> Result<std::net::IpAddr, String> {
    let route = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    let addrs = interface_addresses()?;
    choose_address(default_route_interface(&route).as_deref(), &addrs)
        .ok_or_else(|| "this host has no address other than loopback and link-local ones".to_string())
}

/// The interface of the IPv4 default route in `/proc/net/route`'s text.
pub(crate) fn default_route_interface(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        (cols.len() > 7 && cols[1] == "00000000" && cols[7] == "00000000").then(|| cols[0].to_string())
    })
}

/// The preferred address among `addrs` (interface name, address), as [`own_address`] says.
pub(crate) fn choose_address(
    default_if: Option<&str>,
    addrs: &[(String, std::net::IpAddr)],
) -> Option<std::net::IpAddr> {
    use std::net::IpAddr;
    let usable = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => !(v4.is_loopback() || v4.is_link_local() || v4.is_unspecified()),
        IpAddr::V6(v6) => !(v6.is_loopback() || v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80),
    };
    let pick = |v4: bool, on_default: bool| {
        addrs
            .iter()
            .find(|(name, ip)| usable(ip) && ip.is_ipv4() == v4 && (!on_default || Some(name.as_str()) == default_if))
    };
    pick(true, true)
        .or_else(|| pick(true, false))
        .or_else(|| pick(false, true))
        .or_else(|| pick(false, false))
        .map(|(_, ip)| *ip)
}

/// Every address of every interface that is up, with its interface's name, in the kernel's order.
fn interface_addresses() -> Result<Vec<(String, std::net::IpAddr)>, String> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs stores a list it allocated into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(format!("cannot list this host's addresses: {}", std::io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed. Its name is a
        // NUL-terminated string; its address, when not null, is a sockaddr of the family it
        // names, so the casts below read a sockaddr_in or sockaddr_in6 that is there.
        unsafe {
            let ifa = &*cur;
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            if up && !ifa.ifa_addr.is_null() {
                let name = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                        out.push((name, IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                        out.push((name, IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))));
                    }
                    _ => {}
                }
            }
            cur = ifa.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once, after its last use.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::fd::AsRawFd;

    #[test]
    fn requests_encode_as_the_wire_lines() {
        let lines: Vec<String> = [
            Request::Init,
            Request::GetMaxes,
            Request::GetMyKvsname,
            Request::Put { kvsname: "kvs_1_0", key: STORE_KEY, value: "10.0.0.1" },
            Request::BarrierIn,
            Request::Get { kvsname: "kvs_1_0", key: STORE_KEY },
            Request::Finalize,
        ]
        .iter()
        .map(|r| r.encode().unwrap())
        .collect();
        assert_eq!(
            lines,
            [
                "cmd=init pmi_version=1 pmi_subversion=1\n",
                "cmd=get_maxes\n",
                "cmd=get_my_kvsname\n",
                "cmd=put kvsname=kvs_1_0 key=ferrocomm-store value=10.0.0.1\n",
                "cmd=barrier_in\n",
                "cmd=get kvsname=kvs_1_0 key=ferrocomm-store\n",
                "cmd=finalize\n",
            ]
        );
        for bad in ["", "a b", "a=b", "a\nb"] {
            let r = Request::Put { kvsname: "k", key: "x", value: bad }.encode();
            assert!(matches!(r, Err(PmiError::Unsendable { what: "value", .. })), "{bad:?}: {r:?}");
        }
        let long = "x".repeat(MAX_LINE);
        assert!(matches!(Request::Get { kvsname: "k", key: &long }.encode(), Err(PmiError::Unsendable { .. })));
    }

    #[test]
    fn replies_parse_with_their_fields() {
        let r = parse_reply("cmd=my_kvsname kvsname=kvs_1_0", &Request::GetMyKvsname).unwrap();
        assert_eq!(r.require("kvsname"), Ok("kvs_1_0"));
        let get = Request::Get { kvsname: "k", key: "x" };
        let r = parse_reply("cmd=get_result rc=0 msg=success value=10.0.0.1", &get).unwrap();
        assert_eq!(r.require("value"), Ok("10.0.0.1"));
        // A value may contain '=': only the first one splits.
        let r = parse_reply("cmd=get_result rc=0 value=a=b", &get).unwrap();
        assert_eq!(r.get("value"), Some("a=b"));
        assert!(parse_reply("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0", &Request::Init).is_ok());
        assert!(parse_reply("cmd=barrier_out", &Request::BarrierIn).is_ok());
        assert!(
            parse_reply("cmd=put_result rc=0 msg=success", &Request::Put { kvsname: "k", key: "k", value: "v" })
                .is_ok()
        );
        assert!(parse_reply("cmd=finalize_ack", &Request::Finalize).is_ok());
        let m = Maxes::from_reply(
            &parse_reply("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024", &Request::GetMaxes).unwrap(),
        )
        .unwrap();
        assert_eq!(m, Maxes { key: 64, value: 1024 });
        assert!(m.check(STORE_KEY, "10.0.0.1").is_ok());
        assert!(matches!(m.check(&"k".repeat(64), "v"), Err(PmiError::Unsendable { what: "key", .. })));
    }

    #[test]
    fn malformed_replies_are_typed_errors() {
        let malformed =
            |line: &str, req: &Request<'_>| matches!(parse_reply(line, req), Err(PmiError::Malformed { .. }));
        assert!(malformed("", &Request::Init));
        assert!(malformed("garbage", &Request::Init));
        assert!(malformed("cmd=barrier_out oops", &Request::BarrierIn));
        assert!(malformed("=x cmd=barrier_out", &Request::BarrierIn));
        assert!(malformed("rc=0", &Request::BarrierIn));
        assert!(malformed("cmd=barrier_out cmd=barrier_out", &Request::BarrierIn));
        assert!(matches!(
            parse_reply("cmd=my_kvsname kvsname=k", &Request::BarrierIn),
            Err(PmiError::Unexpected { expected: "barrier_out", .. })
        ));
        let get = Request::Get { kvsname: "k", key: "x" };
        let e = parse_reply("cmd=get_result rc=-1 msg=key_x_not_found value=unknown", &get).unwrap_err();
        assert_eq!(e, PmiError::Refused { cmd: "get_result", rc: "-1".into(), msg: ", key_x_not_found".into() });
        assert!(e.to_string().contains("key_x_not_found"), "{e}");
        // A reply without the field it must carry, or with an empty one.
        let r = parse_reply("cmd=get_result rc=0", &get).unwrap();
        assert!(matches!(r.require("value"), Err(PmiError::Field { field: "value", .. })));
        let r = parse_reply("cmd=my_kvsname kvsname=", &Request::GetMyKvsname).unwrap();
        assert!(r.require("kvsname").is_err());
        // Another protocol version, and unusable maxes.
        assert!(matches!(
            parse_reply("cmd=response_to_init pmi_version=2 rc=0", &Request::Init),
            Err(PmiError::Field { field: "pmi_version", .. })
        ));
        for bad in
            ["cmd=maxes keylen_max=x vallen_max=1", "cmd=maxes vallen_max=1", "cmd=maxes keylen_max=0 vallen_max=1"]
        {
            let r = parse_reply(bad, &Request::GetMaxes).unwrap();
            assert!(Maxes::from_reply(&r).is_err(), "{bad}");
        }
        // Long lines are shortened in errors.
        let long = "x".repeat(1000);
        assert!(parse_reply(&long, &Request::Init).unwrap_err().to_string().len() < 300);
    }

    /// Plays Hydra's process manager on `manager`, answering each request with `replies` in turn;
    /// returns the lines received.
    fn serve(manager: UnixStream, replies: Vec<&'static str>) -> std::thread::JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let mut lines = BufReader::new(manager.try_clone().unwrap());
            let mut out = manager;
            let mut seen = Vec::new();
            for reply in replies {
                let mut line = String::new();
                if lines.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                seen.push(line);
                out.write_all(reply.as_bytes()).unwrap();
            }
            seen
        })
    }

    const INIT: &str = "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n";
    const MAXES: &str = "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024\n";
    const KVS: &str = "cmd=my_kvsname kvsname=kvs_42_0_7_host\n";
    const FIN: &str = "cmd=finalize_ack\n";

    #[test]
    fn conversations_over_a_socket_pair() {
        // Only the job id.
        let (ours, manager) = UnixStream::pair().unwrap();
        let served = serve(manager, vec![INIT, MAXES, KVS, FIN]);
        let a = hydra(&ours.as_raw_fd().to_string(), &Share::Nothing).unwrap();
        assert_eq!(a, Answer { kvsname: "kvs_42_0_7_host".into(), store_host: None });
        let seen = served.join().unwrap();
        assert_eq!(
            seen,
            ["cmd=init pmi_version=1 pmi_subversion=1\n", "cmd=get_maxes\n", "cmd=get_my_kvsname\n", "cmd=finalize\n"]
        );
        // Our descriptor is left open (a duplicate was used).
        assert!(ours.peer_addr().is_ok());

        // Rank 0 publishes.
        let (ours, manager) = UnixStream::pair().unwrap();
        let served =
            serve(manager, vec![INIT, MAXES, KVS, "cmd=put_result rc=0 msg=success\n", "cmd=barrier_out\n", FIN]);
        let a = hydra(&ours.as_raw_fd().to_string(), &Share::Publish("10.88.1.2".into())).unwrap();
        assert_eq!(a.store_host, None);
        let seen = served.join().unwrap();
        assert_eq!(seen[3], "cmd=put kvsname=kvs_42_0_7_host key=ferrocomm-store value=10.88.1.2\n");
        assert_eq!(seen[4], "cmd=barrier_in\n");

        // Another rank fetches.
        let (ours, manager) = UnixStream::pair().unwrap();
        let get = "cmd=get_result rc=0 msg=success value=10.88.1.2\n";
        let served = serve(manager, vec![INIT, MAXES, KVS, "cmd=barrier_out\n", get, FIN]);
        let a = hydra(&ours.as_raw_fd().to_string(), &Share::Fetch).unwrap();
        assert_eq!(a.store_host.as_deref(), Some("10.88.1.2"));
        let seen = served.join().unwrap();
        assert_eq!(seen[5], "cmd=finalize\n");
    }

    #[test]
    fn failed_conversations_still_finalize_and_say_why() {
        // The key is missing: a typed error, and finalize is still sent.
        let (ours, manager) = UnixStream::pair().unwrap();
        let get = "cmd=get_result rc=-1 msg=key_ferrocomm-store_not_found value=unknown\n";
        let served = serve(manager, vec![INIT, MAXES, KVS, "cmd=barrier_out\n", get, FIN]);
        let e = hydra(&ours.as_raw_fd().to_string(), &Share::Fetch).unwrap_err();
        assert!(matches!(e, PmiError::Refused { cmd: "get_result", .. }), "{e}");
        assert_eq!(served.join().unwrap().last().unwrap(), "cmd=finalize\n");

        // A garbled reply.
        let (ours, manager) = UnixStream::pair().unwrap();
        let served = serve(manager, vec![INIT, "nonsense\n", FIN]);
        let e = hydra(&ours.as_raw_fd().to_string(), &Share::Nothing).unwrap_err();
        assert!(matches!(e, PmiError::Malformed { .. }), "{e}");
        served.join().unwrap();

        // A manager that hangs up, and descriptors that are not sockets.
        let (ours, manager) = UnixStream::pair().unwrap();
        drop(manager);
        assert!(matches!(hydra(&ours.as_raw_fd().to_string(), &Share::Nothing), Err(PmiError::Io { cmd: "init", .. })));
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let e = hydra(&file.as_raw_fd().to_string(), &Share::Nothing).unwrap_err();
        assert!(e.to_string().contains("not an open socket"), "{e}");
        assert!(matches!(hydra("x", &Share::Nothing), Err(PmiError::Descriptor { .. })));
        assert!(matches!(hydra("-1", &Share::Nothing), Err(PmiError::Descriptor { .. })));
    }

    #[test]
    fn the_published_address_prefers_the_default_route() {
        use std::net::IpAddr;
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eth1\t0058A80A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_interface(table).as_deref(), Some("eth0"));
        assert_eq!(default_route_interface("Iface\tDestination\n"), None);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let addrs = vec![
            ("lo".to_string(), ip("127.0.0.1")),
            ("docker0".to_string(), ip("169.254.3.1")),
            ("eth1".to_string(), ip("10.88.0.2")),
            ("eth0".to_string(), ip("fe80::1")),
            ("eth0".to_string(), ip("192.168.0.5")),
            ("eth1".to_string(), ip("fd00::2")),
        ];
        assert_eq!(choose_address(Some("eth0"), &addrs), Some(ip("192.168.0.5")));
        assert_eq!(choose_address(None, &addrs), Some(ip("10.88.0.2")));
        let v6 = vec![
            ("lo".to_string(), ip("::1")),
            ("eth0".to_string(), ip("fe80::1")),
            ("eth0".to_string(), ip("fd00::2")),
        ];
        assert_eq!(choose_address(None, &v6), Some(ip("fd00::2")));
        assert_eq!(choose_address(None, &addrs[..2]), None);
    }
}
