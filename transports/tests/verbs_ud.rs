//! The UD multicast group on a real RDMA device (Soft-RoCE in scripts/verbs-vm.sh): members in
//! one process, each with its own device context and UD queue pair, as separate ranks would have.
//! Without a device the tests say so and pass, unless `FERROCOMM_REQUIRE_VERBS` is set.
#![cfg(feature = "verbs")]

use std::net::Ipv4Addr;
use std::time::Duration;

use ferrocomm_transports::verbs::{UdConfig, UdMulticast, device_names};

fn device(test: &str) -> bool {
    let present = !device_names().is_empty();
    if !present {
        assert!(std::env::var_os("FERROCOMM_REQUIRE_VERBS").is_none(), "{test}: no RDMA device");
        eprintln!("{test}: skipped, no RDMA device here (scripts/verbs-vm.sh runs it over Soft-RoCE)");
    }
    present
}

async fn recv(m: &UdMulticast) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 8192];
    let n = tokio::time::timeout(Duration::from_secs(5), std::future::poll_fn(|cx| m.poll_recv(cx, &mut buf)))
        .await
        .ok()?
        .unwrap();
    Some(buf[..n].to_vec())
}

async fn send(m: &UdMulticast, d: &[u8]) {
    loop {
        if m.try_send(d).unwrap() {
            return;
        }
        std::future::poll_fn(|cx| m.poll_send_ready(cx)).await.unwrap();
    }
}

/// One send reaches every other member, in order, byte for byte (the device loops it back to the
/// sender too, which skips it: counted as its own); a burst larger than the send slots and the
/// receive pool goes through as the pool is reposted.
#[tokio::test]
async fn every_member_gets_each_datagram() {
    if !device("every_member_gets_each_datagram") {
        return;
    }
    let group = Ipv4Addr::new(239, 255, 91, 1);
    let cfg = UdConfig { recv_buffers: 16, send_buffers: 4, ..UdConfig::new(group) };
    let members: Vec<UdMulticast> = (0..3).map(|_| UdMulticast::join(&cfg).unwrap()).collect();
    let max = members[0].max_datagram();
    assert!(max >= 256 && max == members[0].mtu(), "datagram {max}");
    // Several rounds of one datagram each: every member sees each before the next is sent, so
    // the small pool never overflows, and the pool is reused many times over.
    for round in 0..64u32 {
        let len = [0, 1, 100, max][round as usize % 4];
        let d: Vec<u8> = (0..len).map(|i| (i as u32 ^ round) as u8).collect();
        send(&members[round as usize % 3], &d).await;
        for (k, m) in members.iter().enumerate().filter(|&(k, _)| k != round as usize % 3) {
            let got = recv(m).await.unwrap_or_else(|| panic!("member {k}: datagram {round} never came"));
            assert_eq!(got, d, "member {k}, datagram {round}");
        }
    }
    for (k, m) in members.iter().enumerate() {
        let s = m.stats();
        // Member k sent the rounds k, k + 3, ...: 22 of 64 for member 0, 21 for the others.
        let mine = (0..64).filter(|r| r % 3 == k).count() as u64;
        assert_eq!((s.received, s.errors, s.dropped), (64 - mine, 0, 0), "member {k}: {s:?}");
        // Its own come back only as fast as the device loops them; none is handed out.
        assert!(s.own <= mine, "member {k}: {s:?}");
    }
    println!("UD group: 64 datagrams of up to {max} bytes, each to 3 members");
}

/// A datagram over the group's MTU is refused with a typed error, nothing sent; other groups'
/// datagrams do not arrive; the test drop loses what it is told to, in the receive path.
#[tokio::test]
async fn oversize_other_groups_and_test_drop() {
    if !device("oversize_other_groups_and_test_drop") {
        return;
    }
    let a = UdMulticast::join(&UdConfig::new(Ipv4Addr::new(239, 255, 91, 2))).unwrap();
    let b = UdMulticast::join(&UdConfig::new(Ipv4Addr::new(239, 255, 91, 3))).unwrap();
    let lossy =
        UdMulticast::join(&UdConfig { test_drop: 1.0, ..UdConfig::new(Ipv4Addr::new(239, 255, 91, 2)) }).unwrap();
    let big = vec![0u8; a.max_datagram() + 1];
    assert_eq!(a.try_send(&big).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(a.stats().sent, 0);
    // `a2` on the same group gets it; `a`, the sender, skips its own.
    let a2 = UdMulticast::join(&UdConfig::new(Ipv4Addr::new(239, 255, 91, 2))).unwrap();
    send(&a, b"to group 2").await;
    assert_eq!(recv(&a2).await.as_deref(), Some(&b"to group 2"[..]));
    // `b` is on another group, `lossy` drops everything.
    for m in [&a, &b, &lossy] {
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_millis(500), std::future::poll_fn(|cx| m.poll_recv(cx, &mut buf)))
            .await;
        assert!(r.is_err(), "nothing should arrive: {r:?}");
    }
    assert_eq!(lossy.stats().dropped, 1, "{:?}", lossy.stats());
    assert_eq!(b.stats().received, 0);
    let not_multicast = UdMulticast::join(&UdConfig::new(Ipv4Addr::new(10, 0, 0, 1)));
    assert_eq!(not_multicast.err().map(|e| e.kind()), Some(std::io::ErrorKind::InvalidInput));
}

/// A burst of 1000 datagrams sent back to back while nobody reads, into receive pools large
/// enough to hold them all: what the device and the kernel deliver without any reader falling
/// behind. UD is unreliable, so this measures (prints) rather than demands: every datagram that
/// arrives is intact and in order, and most arrive.
#[tokio::test]
async fn burst_into_idle_members() {
    if !device("burst_into_idle_members") {
        return;
    }
    const N: u32 = 1000;
    let cfg = UdConfig { recv_buffers: 2048, ..UdConfig::new(Ipv4Addr::new(239, 255, 91, 4)) };
    let members: Vec<UdMulticast> = (0..3).map(|_| UdMulticast::join(&cfg).unwrap()).collect();
    let len = members[0].max_datagram();
    for i in 0..N {
        let mut d = vec![i as u8; len];
        d[..4].copy_from_slice(&i.to_le_bytes());
        send(&members[0], &d).await;
    }
    let mut got = Vec::new();
    // The sender's own datagrams come back from the device and are skipped, not handed out.
    let mut buf = vec![0u8; 8192];
    let own =
        tokio::time::timeout(Duration::from_secs(2), std::future::poll_fn(|cx| members[0].poll_recv(cx, &mut buf)))
            .await;
    assert!(own.is_err(), "the sender got a datagram: {own:?}");
    assert!(members[0].stats().received == 0 && members[0].stats().own > 0, "{:?}", members[0].stats());
    for m in &members[1..] {
        let mut last = None;
        let mut n = 0u32;
        let mut buf = vec![0u8; 8192];
        while let Ok(r) =
            tokio::time::timeout(Duration::from_secs(2), std::future::poll_fn(|cx| m.poll_recv(cx, &mut buf))).await
        {
            let k = r.unwrap();
            let i = u32::from_le_bytes(buf[..4].try_into().unwrap());
            assert_eq!(k, len);
            assert!(buf[4..k].iter().all(|&b| b == i as u8), "datagram {i} altered");
            assert!(last.is_none_or(|l| i > l), "datagram {i} after {last:?}");
            last = Some(i);
            n += 1;
        }
        got.push(n);
    }
    println!("UD group burst: {N} datagrams of {len} bytes sent back to back, received {got:?} by 2 idle members");
    assert!(got.iter().all(|&n| n > N / 2), "{got:?}");
}

/// A pool sized in bytes holds that many bytes of datagrams at the port's MTU (not of the
/// configured datagram size): 4 MiB is about 4,000 buffers of a 1 KiB MTU, and the bounds hold.
#[tokio::test]
async fn pool_sized_in_bytes_at_the_mtu() {
    if !device("pool_sized_in_bytes_at_the_mtu") {
        return;
    }
    use ferrocomm_transports::verbs::MAX_RECV_BUFFERS;
    for (bytes, k) in [(4usize << 20, 5u8), (1 << 10, 6), (1 << 30, 7)] {
        let cfg = UdConfig { recv_bytes: bytes, datagram: 60_000, ..UdConfig::new(Ipv4Addr::new(239, 255, 91, k)) };
        let m = UdMulticast::join(&cfg).unwrap();
        let want = (bytes / (m.mtu() + 40)).clamp(256, MAX_RECV_BUFFERS as usize) as u32;
        assert_eq!(m.recv_buffers(), want, "{bytes} bytes at MTU {}", m.mtu());
        println!("UD group pool: {bytes} bytes at MTU {} = {} buffers", m.mtu(), m.recv_buffers());
    }
}
