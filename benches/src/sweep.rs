//! The NetPIPE schedule: which sizes, how many repetitions, how round trips are timed, and how
//! runs are combined.

use std::time::{Duration, Instant};

/// Bytes below and above each power of two that are probed too.
pub(crate) const PERTURBATION: usize = 3;
/// How long the warm-up batch of a size should last.
pub(crate) const WARMUP: Duration = Duration::from_millis(5);
/// How long the timed batch of a size should last.
pub(crate) const TARGET: Duration = Duration::from_millis(30);
/// Fewest timed iterations per size, however slow one is.
pub(crate) const MIN_ITERATIONS: u64 = 10;
/// Fewest warm-up iterations per size.
pub(crate) const MIN_WARMUP: u64 = 2;
/// Most iterations in one batch, however fast one is: enough for a batch of 8-byte shared-memory
/// round trips (about 0.4 us) to last the 300 ms asked of it, as NetPIPE's trials do.
pub(crate) const MAX_ITERATIONS: u64 = 2_000_000;
/// The sweep stops after a size whose one-way time exceeds this.
pub(crate) const STOP_AFTER: Duration = Duration::from_secs(1);

/// The message sizes of a sweep up to `max`, ascending and distinct: 1 byte, then each power of
/// two up to `max` together with it plus and minus [`PERTURBATION`] bytes (where positive). The
/// perturbed sizes of the largest power may exceed `max` by [`PERTURBATION`], as in NetPIPE.
pub(crate) fn sizes(max: usize) -> Vec<usize> {
    let mut out = vec![1];
    let mut p: usize = 1;
    while p <= max {
        if p > PERTURBATION {
            out.push(p - PERTURBATION);
        }
        out.push(p);
        out.push(p + PERTURBATION);
        match p.checked_mul(2) {
            Some(next) => p = next,
            None => break,
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The largest size [`sizes`] can return for `max`.
pub(crate) fn largest(max: usize) -> usize {
    sizes(max).last().copied().unwrap_or(1)
}

/// Iterations for a batch lasting about `target` when one round trip takes `round_trip` seconds,
/// within `min..=MAX_ITERATIONS`.
pub(crate) fn iterations(round_trip: f64, target: Duration, min: u64) -> u64 {
    let per = round_trip.max(1e-9);
    let n = (target.as_secs_f64() / per).round();
    (n.min(MAX_ITERATIONS as f64) as u64).clamp(min, MAX_ITERATIONS)
}

/// A cheap stamp for timing each round trip: the CPU's cycle counter where there is one (under
/// software emulation the clock is a system call reading an emulated device, microseconds a
/// read), else the clock in nanoseconds. Only differences taken on one CPU are used (rank 0 is
/// pinned), scaled by the batch's length on the clock.
pub(crate) fn stamp() -> u64 {
    ferrocomm_reactor::cycles().unwrap_or_else(|| {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
    })
}

/// The times between consecutive [`stamp`]s, in seconds: the stamps' units scaled so that
/// the whole span lasts `seconds` (the clock's measure of it).
pub(crate) fn trips(stamps: &[u64], seconds: f64) -> Vec<f64> {
    let span = stamps.last().zip(stamps.first()).map_or(1, |(l, f)| l.wrapping_sub(*f).max(1));
    let per_unit = seconds / span as f64;
    stamps.windows(2).map(|w| w[1].wrapping_sub(w[0]) as f64 * per_unit).collect()
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The latency percentiles reported where every iteration is timed, and their names.
pub(crate) const PERCENTILES: [f64; 3] = [50.0, 99.0, 99.9];
pub(crate) const PERCENTILE_NAMES: [&str; 3] = ["p50", "p99", "p99.9"];

/// The quantiles `qs` (each in 0..=1) of `seconds`, from an HDR histogram of nanoseconds with 3
/// significant digits (1 ns resolution up to 1 µs, 0.1% above); `None` when empty.
pub(crate) fn quantiles(seconds: &[f64], qs: &[f64]) -> Option<Vec<f64>> {
    let mut h = hdrhistogram::Histogram::<u64>::new(3).expect("3 significant digits is valid");
    for &s in seconds {
        // The histogram resizes itself for large values; a negative or NaN time is a bug upstream.
        h.record((s * 1e9).round().max(0.0) as u64).ok()?;
    }
    if h.is_empty() {
        return None;
    }
    Some(qs.iter().map(|&q| h.value_at_quantile(q) as f64 * 1e-9).collect())
}

/// [`PERCENTILES`] of `seconds` (see [`quantiles`]).
pub(crate) fn percentiles(seconds: &[f64]) -> Option<[f64; 3]> {
    let v = quantiles(seconds, &PERCENTILES.map(|p| p / 100.0))?;
    Some([v[0], v[1], v[2]])
}

/// Throughput in MB/s (10^6 bytes per second) of `bytes` moved one way in `seconds`.
pub(crate) fn mb_per_s(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_become_seconds_scaled_by_the_whole_span() {
        // 100 units in all for 1 ms: 10 us a unit.
        let t = trips(&[1000, 1010, 1050, 1100], 1e-3);
        let want = [1e-4, 4e-4, 5e-4];
        assert!(t.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{t:?}");
        assert!(trips(&[7], 1.0).is_empty());
    }

    #[test]
    fn sizes_are_powers_of_two_with_perturbations() {
        assert_eq!(sizes(1), vec![1, 4]);
        assert_eq!(sizes(16), vec![1, 2, 4, 5, 7, 8, 11, 13, 16, 19]);
        let big = sizes(8 << 20);
        assert_eq!(big.last(), Some(&((8 << 20) + 3)));
        assert!(big.contains(&8) && big.contains(&(4 << 20)) && big.contains(&((4 << 20) - 3)));
        assert!(big.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(largest(8 << 20), (8 << 20) + 3);
    }

    #[test]
    fn iterations_are_bounded() {
        assert_eq!(iterations(1e-3, TARGET, MIN_ITERATIONS), 30);
        assert_eq!(iterations(0.1, TARGET, MIN_ITERATIONS), MIN_ITERATIONS);
        assert_eq!(iterations(0.0, TARGET, MIN_ITERATIONS), MAX_ITERATIONS);
    }

    #[test]
    fn percentiles_from_the_histogram() {
        // 1000 one-way times of 100 ns, 10 of 10 µs, one of 1 ms.
        let mut v = vec![100e-9; 1000];
        v.extend([10e-6; 10]);
        v.push(1e-3);
        let [p50, p99, p999] = percentiles(&v).unwrap();
        assert!((p50 - 100e-9).abs() < 1e-10, "{p50}");
        assert!((p99 - 10e-6).abs() < 1e-8, "{p99}");
        assert!((p999 - 10e-6).abs() < 1e-8, "{p999}");
        assert!((quantiles(&v, &[1.0]).unwrap()[0] - 1e-3).abs() < 1e-6);
        assert_eq!(percentiles(&[]), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }
}
