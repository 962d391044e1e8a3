//! The multicast stream of `ferrocomm-bench multicast --stream` on the simulated network: 8 ranks,
//! messages of 1 B to 60 KiB, at 0% and at 20% datagram loss on the odd ranks; prints the time,
//! the root's window stalls and the receivers' NACKs. Deterministic (seeded).
//!
//! `cargo run --release -p ferrocomm-sim --example mcast_stream -- [messages] [window] [ack_every] [ack_delay_us]`

use std::time::Duration;

use ferrocomm_sim::mcast::config;
use ferrocomm_sim::scale::multicast_stream;
use ferrocomm_sim::{Link, NetConfig};

fn main() {
    let arg = |i: usize, d: u64| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (count, window, every, delay) = (arg(1, 2000) as usize, arg(2, 64), arg(3, 8), arg(4, 200));
    let lens: Vec<usize> = (0..count)
        .map(|i| {
            let x = ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64;
            (61_440f64.powf(x) as usize).clamp(1, 61_440)
        })
        .collect();
    let bytes: usize = lens.iter().sum();
    let net = NetConfig { link: Link::new(2_000, 10.0), ..NetConfig::default() };
    let mut mcfg = config(8, net.max_datagram);
    mcfg.window = window as usize;
    mcfg.ack_every = every as u32;
    mcfg.ack_delay = Duration::from_micros(delay);
    if let Some(ms) = std::env::var("RTO_INITIAL_US").ok().and_then(|s| s.parse().ok()) {
        mcfg.rto_initial = Duration::from_micros(ms);
    }
    if let Some(ms) = std::env::var("RTO_MAX_US").ok().and_then(|s| s.parse().ok()) {
        mcfg.rto_max = Duration::from_micros(ms);
    }
    let mut zero = 0.0;
    for drop in [0.0, 0.2] {
        let r = multicast_stream(8, &lens, drop, &mcfg, &net).expect("the stream completes");
        let us = r.time as f64 / 1e3;
        if drop == 0.0 {
            zero = us;
        }
        let nacks: Vec<u64> = r.stats[1..].iter().map(|s| s.nacks_sent).collect();
        let retx: u64 = r.stats.iter().map(|s| s.retransmissions).sum();
        println!(
            "drop {:>3.0}% on odd ranks: {us:>10.1} us ({:.1} MB/s, {:.2}x the 0% time), window stalls {}, NACKs {nacks:?}, retransmissions {retx}",
            drop * 100.0,
            bytes as f64 / us,
            us / zero,
            r.stats[0].window_stalls,
        );
        if std::env::var_os("VERBOSE").is_some() {
            for (i, s) in r.stats.iter().enumerate() {
                println!("  rank {i}: {s:?}");
            }
        }
    }
}
