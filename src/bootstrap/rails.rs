//! Rails: more TCP connections per peer, over other interfaces, for striping large messages
//! ([`ferrocomm_transports::rails`]).
//!
//! Each rank advertises its rail addresses in the store (`rails/<rank>`: address, prefix length
//! and port of a listener on each). Two ranks pair their rails by network: each rail of the
//! higher rank, in order, takes the first free rail of the lower rank in the same subnet, so both
//! sides compute the same pairs from the two lists, and the higher rank connects each pair from
//! its own rail address. A rail pairs with nothing on a peer that has no address in its subnet;
//! a peer with no pair is reached over the bootstrap connection alone. The bootstrap connection
//! is rail 0, so a rank's own bootstrap address is never a rail of its own.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ferrocomm_transports::Rank;
use ferrocomm_transports::TransportError;
use ferrocomm_transports::tcp::{handshake_accept, handshake_connect};
use ferrocomm_transports::wire::{Limits, TOKEN_LEN};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use super::kv::KvClient;
use crate::config::RailList;
use crate::error::{Error, Result};

/// A rail as advertised: an address, its network's prefix length, a listening port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RailAddr {
    pub ip: IpAddr,
    pub prefix: u8,
    pub port: u16,
}

pub(crate) fn encode(rails: &[RailAddr]) -> Vec<u8> {
    rails.iter().map(|r| format!("{}/{}/{}", r.ip, r.prefix, r.port)).collect::<Vec<_>>().join(" ").into_bytes()
}

pub(crate) fn decode(b: &[u8]) -> std::result::Result<Vec<RailAddr>, String> {
    let s = std::str::from_utf8(b).map_err(|_| "not UTF-8".to_string())?;
    s.split_whitespace()
        .map(|w| {
            let f: Vec<&str> = w.split('/').collect();
            let [ip, prefix, port] = f[..] else { return Err(format!("{w:?}: not address/prefix/port")) };
            let ip: IpAddr = ip.parse().map_err(|e| format!("{w:?}: {e}"))?;
            let prefix: u8 = prefix.parse().map_err(|e| format!("{w:?}: {e}"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            if prefix > max {
                return Err(format!("{w:?}: prefix longer than the address"));
            }
            Ok(RailAddr { ip, prefix, port: port.parse().map_err(|e| format!("{w:?}: {e}"))? })
        })
        .collect()
}

/// Whether `a` and `b` are in one network of `prefix` bits.
fn same_subnet(a: IpAddr, b: IpAddr, prefix: u8) -> bool {
    let bits = |ip: IpAddr| match ip {
        IpAddr::V4(v) => (u128::from(u32::from(v)) << 96, 32),
        IpAddr::V6(v) => (u128::from(v), 128),
    };
    let ((a, la), (b, lb)) = (bits(a), bits(b));
    if la != lb {
        return false;
    }
    let prefix = u32::from(prefix).min(la);
    let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
    a & mask == b & mask
}

/// The rail pairs of two ranks: `(lower's rail, higher's rail)`. Each of the higher rank's rails,
/// in order, takes the first free rail of the lower rank in its subnet (the shorter of the two
/// prefixes).
pub(crate) fn pair(lower: &[RailAddr], higher: &[RailAddr]) -> Vec<(usize, usize)> {
    let mut used = vec![false; lower.len()];
    let mut pairs = Vec::new();
    for (h, hr) in higher.iter().enumerate() {
        let found =
            lower.iter().enumerate().find(|(l, lr)| !used[*l] && same_subnet(lr.ip, hr.ip, lr.prefix.min(hr.prefix)));
        if let Some((l, _)) = found {
            used[l] = true;
            pairs.push((l, h));
        }
    }
    pairs
}

/// This host's interface addresses that are up: (address, prefix length, loopback).
#[cfg(unix)]
pub(crate) fn interfaces() -> Vec<(IpAddr, u8, bool)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        let loopback = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        if !up || ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points to a sockaddr whose family says its real type;
        // ifa_netmask has the same family.
        let (addr, mask) = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in);
                    (
                        IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes()),
                        u32::from_be(m.sin_addr.s_addr).count_ones() as u8,
                    )
                }
                libc::AF_INET6 => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in6);
                    let ones: u32 = m.sin6_addr.s6_addr.iter().map(|b| b.count_ones()).sum();
                    (IpAddr::from(a.sin6_addr.s6_addr), ones as u8)
                }
                _ => continue,
            }
        };
        out.push((addr, mask, loopback));
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(not(unix))]
pub(crate) fn interfaces() -> Vec<(IpAddr, u8, bool)> {
    Vec::new()
}

/// This rank's rail addresses with their prefix lengths: those the settings name, less the
/// bootstrap address `primary`.
pub(crate) fn local_rails(list: &RailList, primary: IpAddr) -> Result<Vec<(IpAddr, u8)>> {
    let ifs = interfaces();
    let rails = match list {
        RailList::Off => Vec::new(),
        RailList::Auto => ifs
            .iter()
            .filter(|(ip, _, lo)| {
                !lo && *ip != primary && !matches!(ip, IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80)
            })
            .map(|&(ip, p, _)| (ip, p))
            .collect(),
        RailList::List(addrs) => addrs
            .iter()
            .filter(|&&a| a != primary)
            .map(|&a| {
                // Every 127.x.y.z reaches this host over loopback, listed as an address or not.
                let lo = (a.is_loopback() && a.is_ipv4()).then_some((a, 8));
                ifs.iter().find(|(ip, _, _)| *ip == a).map(|&(ip, p, _)| (ip, p)).or(lo).ok_or_else(|| Error::Config {
                    name: "FERROCOMM_RAILS",
                    reason: format!("{a} is not the address of an interface of this host that is up"),
                })
            })
            .collect::<Result<_>>()?,
    };
    Ok(rails)
}

/// The extra connections of one rank: `conns[rail - 1][peer]`.
pub(crate) struct Links {
    pub conns: Vec<Vec<Option<std::net::TcpStream>>>,
}

impl Links {
    /// `[peer][rail]`, rail 0 being the bootstrap connection (to every peer in `remote`).
    pub(crate) fn table(&self, remote: &[bool]) -> Vec<Vec<bool>> {
        (0..remote.len())
            .map(|p| std::iter::once(remote[p]).chain(self.conns.iter().map(|c| c[p].is_some())).collect())
            .collect()
    }
}

/// Sets up this rank's rails to every peer in `remote`: listeners, the store entry, connections
/// (higher rank connects), each authenticated like the bootstrap connections.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn connect(
    kv: &mut KvClient,
    rank: Rank,
    remote: &[bool],
    mine: Vec<(IpAddr, u8)>,
    token: &[u8; TOKEN_LEN],
    limits: &Limits,
    timeout: Duration,
    peer_timeout: Duration,
    rt: &tokio::runtime::Handle,
) -> Result<Links> {
    let size = remote.len();
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for &(ip, prefix) in &mine {
        let l = {
            let _rt = rt.enter();
            let std = std::net::TcpListener::bind((ip, 0))
                .map_err(Error::bootstrap(format!("cannot listen on rail address {ip}")))?;
            std.set_nonblocking(true).map_err(Error::bootstrap("listening on a rail address"))?;
            TcpListener::from_std(std).map_err(Error::bootstrap("listening on a rail address"))?
        };
        addrs.push(RailAddr {
            ip,
            prefix,
            port: l.local_addr().map_err(Error::bootstrap("listening on a rail address"))?.port(),
        });
        listeners.push(l);
    }
    kv.put(&format!("rails/{rank}"), &encode(&addrs))
        .await
        .map_err(Error::bootstrap("announcing the rail addresses"))?;

    let mut conns: Vec<Vec<Option<std::net::TcpStream>>> =
        (0..mine.len()).map(|_| (0..size).map(|_| None).collect()).collect();
    // (my rail, peer) pairs the higher ranks will connect.
    let mut expected = Vec::new();
    let mut theirs = vec![Vec::new(); size];
    for p in (0..size).filter(|&p| remote[p] && p != rank as usize) {
        let raw = kv
            .get(&format!("rails/{p}"), timeout)
            .await
            .map_err(Error::bootstrap("reading a peer's rail addresses"))?;
        theirs[p] = decode(&raw).map_err(|e| Error::bootstrap_failed(format!("rank {p}'s rail addresses: {e}")))?;
        if p > rank as usize {
            expected.extend(pair(&addrs, &theirs[p]).into_iter().map(|(l, _)| (l, p as Rank)));
        }
    }

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(j, l)| {
            let (tx, token, limits) = (tx.clone(), *token, *limits);
            rt.spawn(async move {
                loop {
                    let Ok((mut s, from)) = l.accept().await else { continue };
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let r = tokio::time::timeout(timeout, handshake_accept(&mut s, rank, &token, &limits)).await;
                        match r.unwrap_or(Err(TransportError::Io(std::io::ErrorKind::TimedOut))) {
                            Ok(peer) => {
                                let _ = tx.send((j, peer, s));
                            }
                            Err(error) => tracing::warn!(rank, %from, %error, rail = j + 1, "refused rail connection"),
                        }
                    });
                }
            })
        })
        .collect();

    let deadline = tokio::time::Instant::now() + timeout;
    for p in (0..rank as usize).filter(|&p| remote[p]) {
        for (l, h) in pair(&theirs[p], &addrs) {
            let to = SocketAddr::new(theirs[p][l].ip, theirs[p][l].port);
            let from = addrs[h].ip;
            let mut s = connect_from(from, to, deadline).await?;
            tokio::time::timeout_at(deadline, handshake_connect(&mut s, rank, p as Rank, token, limits))
                .await
                .unwrap_or(Err(TransportError::Io(std::io::ErrorKind::TimedOut)))
                .map_err(Error::bootstrap(format!("rail handshake with rank {p} at {to}")))?;
            ferrocomm_transports::tcp::tune(&s, peer_timeout).map_err(Error::bootstrap("tuning a rail connection"))?;
            conns[h][p] = Some(s.into_std().map_err(Error::bootstrap("tuning a rail connection"))?);
        }
    }
    while !expected.is_empty() {
        let (j, peer, s) = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .map_err(|_| Error::bootstrap_failed(format!("timed out waiting for rail connections {expected:?}")))?
            .ok_or_else(|| Error::bootstrap_failed("rail listener stopped"))?;
        let Some(i) = expected.iter().position(|&e| e == (j, peer)) else {
            tracing::warn!(rank, peer, rail = j + 1, "refused an unexpected rail connection");
            continue;
        };
        expected.swap_remove(i);
        ferrocomm_transports::tcp::tune(&s, peer_timeout).map_err(Error::bootstrap("tuning a rail connection"))?;
        conns[j][peer as usize] = Some(s.into_std().map_err(Error::bootstrap("tuning a rail connection"))?);
    }
    for t in tasks {
        t.abort();
    }
    Ok(Links { conns })
}

async fn connect_from(from: IpAddr, to: SocketAddr, deadline: tokio::time::Instant) -> Result<TcpStream> {
    loop {
        let attempt = async {
            let s = if from.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
            s.bind(SocketAddr::new(from, 0))?;
            s.connect(to).await
        };
        match attempt.await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(Error::bootstrap(format!("cannot connect rail {from} -> {to}"))(e));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RailSettings;

    fn r(ip: &str, prefix: u8, port: u16) -> RailAddr {
        RailAddr { ip: ip.parse().unwrap(), prefix, port }
    }

    #[test]
    fn rails_pair_by_subnet_and_round_trip() {
        let a = [r("10.0.1.1", 24, 1), r("10.0.2.1", 24, 2), r("10.0.9.1", 24, 3)];
        let b = [r("10.0.2.2", 24, 4), r("10.0.1.2", 24, 5), r("192.168.0.2", 24, 6)];
        assert_eq!(pair(&a, &b), vec![(1, 0), (0, 1)]);
        assert_eq!(decode(&encode(&a)).unwrap(), a);
        assert_eq!(decode(b"").unwrap(), vec![]);
        // Two rails in one network pair in order; a peer with one such rail gets one pair.
        let lo = [r("127.0.0.2", 8, 1), r("127.0.0.3", 8, 2)];
        assert_eq!(pair(&lo, &lo), vec![(0, 0), (1, 1)]);
        assert_eq!(pair(&lo[..1], &lo), vec![(0, 0)]);
        assert!(pair(&a, &[r("fd00::1", 64, 1)]).is_empty());
        for bad in ["10.0.0.1/24", "10.0.0.1/40/1", "x/24/1", "10.0.0.1/24/99999"] {
            assert!(decode(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn rail_settings_parse() {
        let get = |k: &str| match k {
            "FERROCOMM_RAILS" => Some("10.0.1.1, 10.0.2.1".to_string()),
            "FERROCOMM_RAIL_STALL_MS" => Some("300".to_string()),
            _ => None,
        };
        let s = RailSettings::from_vars(&get).unwrap();
        assert_eq!(s.list, RailList::List(vec!["10.0.1.1".parse().unwrap(), "10.0.2.1".parse().unwrap()]));
        assert_eq!(s.stall, Duration::from_millis(300));
        assert_eq!("auto".parse::<RailList>(), Ok(RailList::Auto));
        assert_eq!("off".parse::<RailList>(), Ok(RailList::Off));
        assert!("10.0.0.300".parse::<RailList>().is_err());
        let lo = local_rails(&RailList::List(vec!["127.0.0.1".parse().unwrap()]), "10.9.9.9".parse().unwrap()).unwrap();
        assert_eq!(lo, vec![("127.0.0.1".parse().unwrap(), 8)]);
        assert!(
            local_rails(&RailList::List(vec!["192.0.2.77".parse().unwrap()]), "10.9.9.9".parse().unwrap()).is_err()
        );
    }
}
