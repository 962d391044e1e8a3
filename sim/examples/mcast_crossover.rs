//! Where a broadcast by reliable multicast overtakes a binomial one on the simulated network (the
//! default network of `ferrocomm-bench sim-scale`): for each size, the time of each at 2, 4, ...
//! ranks. Deterministic.
//!
//! `cargo run --release -p ferrocomm-sim --example mcast_crossover -- [max ranks] [sizes,...]`

use ferrocomm::Algorithm;
use ferrocomm_sim::model::Op;
use ferrocomm_sim::scale::measure;
use ferrocomm_sim::{Link, NetConfig};

fn main() {
    let max: u32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let sizes: Vec<usize> = std::env::args()
        .nth(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![8, 1024, 8192, 65536, 1 << 20]);
    let cfg = NetConfig { link: Link::new(2_000, 10.0), ..NetConfig::default() };
    for &n in &sizes {
        let mut p = 2;
        while p <= max {
            let b = measure(Op::Bcast(Algorithm::Binomial), p, n, &cfg).expect("binomial");
            let m = measure(Op::McastBcast, p, n, &cfg).expect("multicast");
            println!(
                "{n:>8} B {p:>5} ranks: binomial {:>10.2} us, multicast {:>10.2} us  {}",
                b.sim_ns as f64 / 1e3,
                m.sim_ns as f64 / 1e3,
                if m.sim_ns < b.sim_ns { "multicast" } else { "binomial" }
            );
            p *= 2;
        }
    }
}
