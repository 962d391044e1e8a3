//! Combining slices into rows, and the table, summary and JSON made of them.
//!
//! A slice is one short measurement of a few sizes on one side; at every size the sides take
//! turns, slice after slice (ferrocomm, then each peer, then ferrocomm again ...), so that the
//! `k`-th value of each side at a size comes from slices run back to back. A ratio is therefore
//! taken slice by slice (ferrocomm's time over the peer's in the same round of slices), and the
//! report gives the median of those per-slice ratios with their spread (min-max): a phase of the
//! host that slows both sides alike leaves the ratio alone, where a ratio of medians taken minutes
//! apart would carry it.

use serde_json::{Value, json};

use crate::sweep::{PERCENTILE_NAMES, PERCENTILES, mb_per_s, median};

/// A throughput drop this large from one size to the next is called a dip.
const DIP: f64 = 0.15;

/// One message size: every slice's one-way time on each side.
///
/// Invariant: the `k`-th entries of `ferrocomm` and of each `peers[i]` come from the same round
/// of slices (a side measures a size in a round only if ferrocomm did), so that zipping them
/// pairs slices run back to back.
#[derive(Clone, Debug, Default)]
pub(crate) struct Row {
    pub bytes: usize,
    /// ferrocomm's one-way times, seconds, one per slice.
    pub ferrocomm: Vec<f64>,
    /// ferrocomm's median one-way times within each slice's batch, seconds, one per slice.
    pub ferrocomm_median: Vec<f64>,
    /// ferrocomm's one-way times by NetPIPE's method (each slice's best trial), seconds.
    pub ferrocomm_best_trial: Vec<f64>,
    /// ferrocomm's one-way [`PERCENTILES`] of each slice whose round trips were each timed,
    /// seconds.
    pub ferrocomm_percentiles: Vec<[f64; 3]>,
    /// Each peer's one-way times, seconds, one per slice (`peers[i]` is peer `i`).
    pub peers: Vec<Vec<f64>>,
}

impl Row {
    pub(crate) fn ferrocomm_us(&self) -> Option<f64> {
        median(&self.ferrocomm).map(|s| s * 1e6)
    }
    pub(crate) fn ferrocomm_mbps(&self) -> Option<f64> {
        median(&self.ferrocomm).map(|s| mb_per_s(self.bytes, s))
    }
    /// ferrocomm's one-way percentile `k` of [`PERCENTILES`], µs: the median over runs.
    pub(crate) fn ferrocomm_percentile_us(&self, k: usize) -> Option<f64> {
        median(&self.ferrocomm_percentiles.iter().map(|p| p[k]).collect::<Vec<_>>()).map(|s| s * 1e6)
    }
    pub(crate) fn peer_us(&self, i: usize) -> Option<f64> {
        median(self.peers.get(i)?).map(|s| s * 1e6)
    }
    pub(crate) fn peer_mbps(&self, i: usize) -> Option<f64> {
        median(self.peers.get(i)?).map(|s| mb_per_s(self.bytes, s))
    }
    /// ferrocomm's one-way time over peer `i`'s, slice by slice (above 1: ferrocomm is slower).
    pub(crate) fn slice_ratios(&self, i: usize) -> Vec<f64> {
        paired(&self.ferrocomm, self.peers.get(i).map_or(&[][..], Vec::as_slice))
    }
    /// ferrocomm's one-way time over the fastest peer's of the same round of slices.
    pub(crate) fn best_slice_ratios(&self) -> Vec<f64> {
        let best: Vec<f64> = (0..self.ferrocomm.len())
            .map(|k| self.peers.iter().filter_map(|p| p.get(k)).copied().reduce(f64::min).unwrap_or(f64::NAN))
            .collect();
        paired(&self.ferrocomm, &best)
    }
    /// The peer with the lowest median time at this size.
    pub(crate) fn best_peer(&self) -> Option<usize> {
        (0..self.peers.len())
            .filter_map(|i| Some((i, self.peer_us(i)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|b| b.0)
    }
    /// The median of [`Row::slice_ratios`]: ferrocomm's latency over peer `i`'s.
    pub(crate) fn latency_ratio(&self, i: usize) -> Option<f64> {
        median(&self.slice_ratios(i))
    }
    /// [`Row::latency_ratio`]'s spread: the lowest and highest per-slice ratio.
    pub(crate) fn latency_range(&self, i: usize) -> Option<(f64, f64)> {
        range(&self.slice_ratios(i))
    }
    /// ferrocomm's one-way time by NetPIPE's method (median over slices of each slice's best trial).
    pub(crate) fn ferrocomm_best_trial_us(&self) -> Option<f64> {
        median(&self.ferrocomm_best_trial).map(|s| s * 1e6)
    }
    /// [`Row::latency_ratio`] by NetPIPE's method on both sides: like-for-like with a NetPIPE peer,
    /// which reports only its best trial.
    pub(crate) fn best_trial_ratio(&self, i: usize) -> Option<f64> {
        median(&paired(&self.ferrocomm_best_trial, self.peers.get(i)?))
    }
    /// ferrocomm's throughput over peer `i`'s (below 1: ferrocomm is slower): the median of the
    /// per-slice ratios.
    pub(crate) fn bandwidth_ratio(&self, i: usize) -> Option<f64> {
        median(&self.slice_ratios(i).iter().map(|r| 1.0 / r).collect::<Vec<_>>())
    }
}

/// `a[k] / b[k]` for each `k` both have, where both are positive.
fn paired(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).filter(|&(&x, &y)| x > 0.0 && y > 0.0).map(|(x, y)| x / y).collect()
}

/// The lowest and highest of `values`; `None` when empty.
pub(crate) fn range(values: &[f64]) -> Option<(f64, f64)> {
    let lo = values.iter().copied().reduce(f64::min)?;
    let hi = values.iter().copied().reduce(f64::max)?;
    Some((lo, hi))
}

/// A ratio's median and spread as `1.02 (0.97-1.10)`, or `-`.
pub(crate) fn ratio_text(values: &[f64]) -> String {
    match (median(values), range(values)) {
        (Some(m), Some((lo, hi))) => format!("{m:.2} ({lo:.2}-{hi:.2})"),
        _ => "-".into(),
    }
}

/// A ratio's median and spread for the JSON.
pub(crate) fn ratio_json(values: &[f64]) -> Value {
    let (lo, hi) = range(values).unzip();
    json!({"median": median(values), "min": lo, "max": hi, "slices": values})
}

/// What was measured, for the record.
pub(crate) struct Meta<'a> {
    /// `tcp` or `shm`.
    pub transport: &'a str,
    pub backend: &'a str,
    /// The transport the ranks reported, e.g. `tcp-uring`.
    pub transport_name: &'a str,
    pub progress: &'a str,
    /// How ferrocomm received: `recv` or `recv_into`.
    pub receive: &'a str,
    /// How ferrocomm sent: `send` or `send_from`.
    pub send: &'a str,
    /// The peers' names and the commands they ran.
    pub peers: &'a [(String, String)],
    /// Other work's share of the benchmark's CPUs during each sweep.
    pub interference: &'a [Value],
    /// Extra measurements (reference lines, idle-peer latency), as they are.
    pub extra: Value,
    /// Slices per side at each size.
    pub runs: usize,
    /// Consecutive sizes measured in one slice (0: the whole sweep).
    pub slice_sizes: usize,
    pub cpus: [usize; 2],
    pub max: usize,
}

fn num(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) if v >= 1000.0 => format!("{v:.0}"),
        Some(v) if v >= 100.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.decimals$}"),
        None => "-".into(),
    }
}

/// The per-size table: ferrocomm (with its latency percentiles where every round trip was
/// timed), then each peer with the ratio against it (ferrocomm's time over the peer's: the median
/// of the per-slice ratios, and their min-max), and, with more than one peer, the ratio against
/// the fastest peer of each round of slices.
pub(crate) fn table(rows: &[Row], peers: &[&str]) -> String {
    let percentiles = rows.iter().any(|r| !r.ferrocomm_percentiles.is_empty());
    let mut out = format!("{:>9} {:>13} {:>15}", "bytes", "ferrocomm_us", "ferrocomm_MBps");
    if percentiles {
        for name in PERCENTILE_NAMES {
            out += &format!(" {:>9}", format!("{name}_us"));
        }
    }
    for p in peers {
        out += &format!(" | {:>12} {:>14} {:>18}", format!("{p}_us"), format!("{p}_MBps"), "ratio (min-max)");
    }
    if peers.len() > 1 {
        out += &format!(" | {:>18}", "best (min-max)");
    }
    out += "\n";
    for r in rows {
        out += &format!("{:>9} {:>13} {:>15}", r.bytes, num(r.ferrocomm_us(), 2), num(r.ferrocomm_mbps(), 2));
        if percentiles {
            for k in 0..PERCENTILES.len() {
                out += &format!(" {:>9}", num(r.ferrocomm_percentile_us(k), 3));
            }
        }
        for i in 0..peers.len() {
            out += &format!(
                " | {:>12} {:>14} {:>18}",
                num(r.peer_us(i), 3),
                num(r.peer_mbps(i), 2),
                ratio_text(&r.slice_ratios(i))
            );
        }
        if peers.len() > 1 {
            out += &format!(" | {:>18}", ratio_text(&r.best_slice_ratios()));
        }
        out += "\n";
    }
    out
}

pub(crate) fn row(rows: &[Row], bytes: usize) -> Option<&Row> {
    rows.iter().find(|r| r.bytes == bytes)
}

/// Sizes whose ratios are headlines: latency at the first, bandwidth at the others.
pub(crate) const HEADLINE_LATENCY: usize = 8;
pub(crate) const HEADLINE_BANDWIDTH: [usize; 2] = [64 << 10, 4 << 20];

/// Headline ratios against peer `i`: 8 B latency, 64 KiB and 4 MiB bandwidth (when measured).
pub(crate) fn headline(rows: &[Row], i: usize) -> Value {
    let lat = row(rows, HEADLINE_LATENCY).and_then(|r| r.latency_ratio(i));
    let bw = |b| row(rows, b).and_then(|r| r.bandwidth_ratio(i));
    json!({"latency_ratio_8B": lat, "latency_range_8B": row(rows, HEADLINE_LATENCY).and_then(|r| r.latency_range(i)),
           "bandwidth_ratio_64KiB": bw(HEADLINE_BANDWIDTH[0]), "bandwidth_ratio_4MiB": bw(HEADLINE_BANDWIDTH[1])})
}

/// The headline lines: ferrocomm's 8 B latency and 64 KiB / 4 MiB bandwidth, with each peer's
/// figures and the ratios. The NetPIPE peers (`NP...`) report only the best of their trials, so
/// the 8 B latency is also given by that method on both sides.
pub(crate) fn summary(rows: &[Row], peers: &[&str]) -> String {
    let mut out = String::new();
    match row(rows, HEADLINE_LATENCY) {
        Some(r) => {
            out += &format!("summary: 8 B latency: ferrocomm {} us", num(r.ferrocomm_us(), 3));
            for (i, p) in peers.iter().enumerate() {
                out += &format!(
                    "; {p} {} us, ratio {} ({})",
                    num(r.peer_us(i), 3),
                    num(r.latency_ratio(i), 3),
                    range_text(r.latency_range(i))
                );
            }
            if peers.len() > 1 {
                out += &format!("; best peer: ratio {}", ratio_text(&r.best_slice_ratios()));
            }
            if !r.ferrocomm_percentiles.is_empty() {
                out += &format!(
                    "\nsummary: 8 B latency percentiles (every round trip timed): ferrocomm p50 {} us, p99 {} us, p99.9 {} us",
                    num(r.ferrocomm_percentile_us(0), 3),
                    num(r.ferrocomm_percentile_us(1), 3),
                    num(r.ferrocomm_percentile_us(2), 3)
                );
            }
            let netpipe: Vec<(usize, &&str)> = peers.iter().enumerate().filter(|(_, p)| p.starts_with("NP")).collect();
            if !netpipe.is_empty() {
                out += &format!(
                    "\nsummary: 8 B latency by NetPIPE's method (each slice's best trial, as NetPIPE reports): ferrocomm {} us",
                    num(r.ferrocomm_best_trial_us(), 3)
                );
                for (i, p) in netpipe {
                    out += &format!("; {p} {} us, ratio {}", num(r.peer_us(i), 3), num(r.best_trial_ratio(i), 3));
                }
            }
        }
        None => out += "summary: 8 B latency: not measured",
    }
    for b in HEADLINE_BANDWIDTH {
        let label = if b >= 1 << 20 { format!("{} MiB", b >> 20) } else { format!("{} KiB", b >> 10) };
        match row(rows, b) {
            Some(r) => {
                out += &format!("\nsummary: {label} bandwidth: ferrocomm {} MB/s", num(r.ferrocomm_mbps(), 1));
                for (i, p) in peers.iter().enumerate() {
                    out += &format!("; {p} {} MB/s, ratio {}", num(r.peer_mbps(i), 1), num(r.bandwidth_ratio(i), 3));
                }
                if peers.len() > 1 {
                    let best: Vec<f64> = r.best_slice_ratios().iter().map(|x| 1.0 / x).collect();
                    out += &format!("; best peer: ratio {}", ratio_text(&best));
                }
            }
            None => out += &format!("\nsummary: {label} bandwidth: not measured (--max below {label})"),
        }
    }
    out
}

/// `lo-hi`, or `-`.
fn range_text(r: Option<(f64, f64)>) -> String {
    r.map_or("-".into(), |(lo, hi)| format!("{lo:.3}-{hi:.3}"))
}

/// The verbs comparison: ferrocomm's 8 B one-way latency over `ib_send_lat`'s, median against
/// median (`t_typical`; the headline) and mean against mean (`t_avg`), and its 1 MiB bandwidth
/// over `ib_write_bw`'s (goals: at most 1.5, at least 0.8), twice: streaming (`stream_mbps`, the
/// median of each run's window measurement; the like-for-like figure) and ping-pong throughput.
/// perftest is peer `i`; `perf_median` holds `ib_send_lat`'s median of each run, seconds.
/// A line of text and the JSON.
pub(crate) fn verbs_summary(rows: &[Row], i: usize, perf_median: &[f64], stream_mbps: &[f64]) -> (String, Value) {
    let (lat, bw) = (row(rows, 8), row(rows, 1 << 20));
    let f_median = lat.and_then(|r| median(&r.ferrocomm_median)).map(|s| s * 1e6);
    let p_median = median(perf_median).map(|s| s * 1e6);
    let median_ratio = f_median.zip(p_median).map(|(f, p)| f / p);
    // Each run's pair, measured back to back: the machine's slow phases tend to span both.
    let run_ratios: Vec<f64> =
        lat.map_or(vec![], |r| r.ferrocomm_median.iter().zip(perf_median).map(|(f, p)| f / p).collect());
    let paired = median(&run_ratios);
    let mean_ratio = lat.and_then(|r| r.latency_ratio(i));
    let bw_ratio = bw.and_then(|r| r.bandwidth_ratio(i));
    let perf_bw = bw.and_then(|r| r.peer_mbps(i));
    let stream = median(stream_mbps);
    let stream_ratio = stream.zip(perf_bw).map(|(f, p)| f / p);
    let line = format!(
        "verbs vs perftest: 8 B latency, medians: ferrocomm {} us / ib_send_lat {} us = {} (goal <= 1.5); \
         median of the runs' own ratios {}; means: {} us / {} us = {}; 1 MiB bandwidth, streaming (window {}): ferrocomm {} MB/s / ib_write_bw {} MB/s \
         = {} (goal >= 0.8); ping-pong: {} MB/s / {} MB/s = {}",
        num(f_median, 2),
        num(p_median, 2),
        num(median_ratio, 3),
        num(paired, 3),
        num(lat.and_then(Row::ferrocomm_us), 2),
        num(lat.and_then(|r| r.peer_us(i)), 2),
        num(mean_ratio, 3),
        crate::perftest::WINDOW,
        num(stream, 1),
        num(perf_bw, 1),
        num(stream_ratio, 3),
        num(bw.and_then(Row::ferrocomm_mbps), 1),
        num(perf_bw, 1),
        num(bw_ratio, 3),
    );
    let v = json!({
        "latency_8B": {
            "ferrocomm_median_us": f_median,
            "ib_send_lat_median_us": p_median,
            "ratio": median_ratio,
            "run_ratios": run_ratios,
            "median_run_ratio": paired,
            "ferrocomm_mean_us": lat.and_then(Row::ferrocomm_us),
            "ib_send_lat_mean_us": lat.and_then(|r| r.peer_us(i)),
            "mean_ratio": mean_ratio,
            "goal": "<= 1.5",
        },
        "bandwidth_1MiB": {
            "ferrocomm_MBps": bw.and_then(Row::ferrocomm_mbps),
            "ib_write_bw_MBps": perf_bw,
            "ratio": bw_ratio,
            "goal": ">= 0.8",
        },
        "stream_bandwidth_1MiB": {
            "window": crate::perftest::WINDOW,
            "ferrocomm_MBps": stream,
            "ferrocomm_runs_MBps": stream_mbps,
            "ib_write_bw_MBps": perf_bw,
            "ratio": stream_ratio,
            "goal": ">= 0.8",
        },
    });
    (line, v)
}

/// Sizes whose throughput (per `mbps`) is over [`DIP`] below the previous size's, as text.
pub(crate) fn dips(rows: &[Row], mbps: impl Fn(&Row) -> Option<f64>) -> Vec<String> {
    let points: Vec<(usize, f64)> = rows.iter().filter_map(|r| Some((r.bytes, mbps(r)?))).collect();
    points
        .windows(2)
        .filter(|w| w[1].1 < w[0].1 * (1.0 - DIP))
        .map(|w| format!("{} B {:.1} MB/s ({:+.0}% vs {} B)", w[1].0, w[1].1, (w[1].1 / w[0].1 - 1.0) * 100.0, w[0].0))
        .collect()
}

/// The `--json` document.
pub(crate) fn to_json(meta: &Meta, rows: &[Row]) -> Value {
    let names: Vec<&str> = meta.peers.iter().map(|(n, _)| n.as_str()).collect();
    let json_rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let peers: serde_json::Map<String, Value> = names
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let v = json!({
                        "us": r.peer_us(i),
                        "MBps": r.peer_mbps(i),
                        "latency_ratio": r.latency_ratio(i),
                        "bandwidth_ratio": r.bandwidth_ratio(i),
                        "ratio": ratio_json(&r.slice_ratios(i)),
                        "slices_us": r.peers.get(i).map(|v| v.iter().map(|s| s * 1e6).collect::<Vec<_>>()),
                    });
                    (n.to_string(), v)
                })
                .collect();
            json!({
                "bytes": r.bytes,
                "ferrocomm_us": r.ferrocomm_us(),
                "ferrocomm_MBps": r.ferrocomm_mbps(),
                "ferrocomm_slices_us": r.ferrocomm.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
                "ferrocomm_median_slices_us": r.ferrocomm_median.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
                "ferrocomm_best_trial_us": r.ferrocomm_best_trial_us(),
                "ferrocomm_best_trial_slices_us": r.ferrocomm_best_trial.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
                "ferrocomm_p50_us": r.ferrocomm_percentile_us(0),
                "ferrocomm_p99_us": r.ferrocomm_percentile_us(1),
                "ferrocomm_p99_9_us": r.ferrocomm_percentile_us(2),
                "ferrocomm_percentiles_slices_us": r.ferrocomm_percentiles.iter().map(|p| p.map(|s| s * 1e6)).collect::<Vec<_>>(),
                "peers": peers,
                "best_peer": {
                    "name": r.best_peer().and_then(|i| names.get(i)),
                    "ratio": ratio_json(&r.best_slice_ratios()),
                },
            })
        })
        .collect::<Vec<_>>();
    let mut headlines: serde_json::Map<String, Value> =
        names.iter().enumerate().map(|(i, n)| (n.to_string(), headline(rows, i))).collect();
    if names.len() > 1 {
        let best = |b| row(rows, b).map(|r| ratio_json(&r.best_slice_ratios()));
        headlines.insert(
            "best_peer".into(),
            json!({"latency_ratio_8B": best(HEADLINE_LATENCY), "time_ratio_64KiB": best(HEADLINE_BANDWIDTH[0]),
                   "time_ratio_4MiB": best(HEADLINE_BANDWIDTH[1])}),
        );
    }
    json!({
        "bench": "pingpong",
        "transport": meta.transport,
        "backend": meta.backend,
        "transport_name": meta.transport_name,
        "progress": meta.progress,
        "receive": meta.receive,
        "send": meta.send,
        "peers": meta.peers.iter().map(|(n, c)| json!({"name": n, "command": c})).collect::<Vec<_>>(),
        "slices": meta.runs,
        "sizes_per_slice": meta.slice_sizes,
        "interference": meta.interference,
        "statistic": "per size, each side: the median of its slices' one-way times; ratio: ferrocomm's time over the peer's in each round of slices (run back to back), median and min-max over the rounds; best_peer: against the fastest peer of each round",
        "percentiles": "with every round trip timed (--time-each): one-way p50, p99, p99.9 of each run from an HDR histogram (ns, 3 significant digits); median over runs",
        "cpus": meta.cpus,
        "max": meta.max,
        "headline_ratios": headlines,
        "extra": meta.extra,
        "rows": json_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(bytes: usize, f: f64, p: f64) -> Row {
        Row { bytes, ferrocomm: vec![f, f * 2.0, f / 2.0], peers: vec![vec![p], vec![p * 2.0]], ..Row::default() }
    }

    #[test]
    fn ratios_and_headline() {
        let rows = vec![r(8, 20e-6, 10e-6), r(64 << 10, 1e-5, 1e-5), r(4 << 20, 2e-3, 1e-3)];
        assert_eq!(rows[0].latency_ratio(0), Some(2.0));
        assert_eq!(rows[0].latency_ratio(1), Some(1.0));
        assert_eq!(rows[2].bandwidth_ratio(0), Some(0.5));
        assert_eq!(rows[2].bandwidth_ratio(1), Some(1.0));
        let h = headline(&rows, 0);
        assert_eq!(
            (h["latency_ratio_8B"].as_f64(), h["bandwidth_ratio_64KiB"].as_f64(), h["bandwidth_ratio_4MiB"].as_f64()),
            (Some(2.0), Some(1.0), Some(0.5))
        );
        let s = summary(&rows, &["A", "B"]);
        assert!(s.contains("A 10.000 us, ratio 2.000") && s.contains("B 20.000 us, ratio 1.000"), "{s}");
        assert_eq!(s.lines().count(), 3, "{s}");
        assert_eq!(table(&rows, &["A", "B"]).lines().count(), 4);
        assert!(!table(&rows, &["A"]).contains("p99_us"));
    }

    #[test]
    fn percentiles_in_table_and_json() {
        let mut rows = vec![r(8, 20e-6, 10e-6), r(64, 30e-6, 10e-6)];
        rows[0].ferrocomm_percentiles = vec![[1e-6, 2e-6, 3e-6], [1.5e-6, 4e-6, 9e-6], [1.2e-6, 3e-6, 5e-6]];
        assert_eq!(rows[0].ferrocomm_percentile_us(1), Some(3.0));
        let t = table(&rows, &["A"]);
        assert!(t.lines().next().unwrap().contains("p99.9_us"), "{t}");
        assert!(t.lines().nth(1).unwrap().contains("1.200") && t.lines().nth(2).unwrap().contains(" - "), "{t}");
        let meta = Meta {
            transport: "shm",
            backend: "shm",
            transport_name: "shm",
            progress: "busy",
            receive: "recv",
            send: "send",
            peers: &[],
            interference: &[],
            extra: Value::Null,
            runs: 3,
            slice_sizes: 3,
            cpus: [0, 1],
            max: 64,
        };
        let v = to_json(&meta, &rows);
        assert_eq!(v["rows"][0]["ferrocomm_p99_9_us"].as_f64(), Some(5.0));
        assert!(summary(&rows, &["A"]).contains("ferrocomm p50 1.200 us, p99 3.000 us, p99.9 5.000 us"));
        assert!(v["rows"][1]["ferrocomm_p50_us"].is_null());
    }

    #[test]
    fn netpipe_peers_are_also_compared_by_their_method() {
        let mut rows = vec![r(8, 20e-6, 10e-6)];
        rows[0].peers[0] = vec![10e-6; 3];
        rows[0].ferrocomm_best_trial = vec![8e-6, 9e-6, 30e-6];
        assert!((rows[0].best_trial_ratio(0).unwrap() - 0.9).abs() < 1e-12);
        let s = summary(&rows, &["NPopenmpi", "ib_send_lat"]);
        let line = s.lines().find(|l| l.contains("NetPIPE's method")).expect(&s);
        assert!(line.contains("ferrocomm 9.000 us; NPopenmpi 10.000 us, ratio 0.900"), "{line}");
        assert!(!line.contains("ib_send_lat"), "{line}");
        // No NetPIPE peer, no such line.
        assert!(!summary(&rows, &["ib_send_lat"]).contains("NetPIPE's method"));
    }

    /// Ratios are taken slice by slice: a phase that slows both sides of a round alike cancels.
    #[test]
    fn ratios_are_medians_of_per_slice_ratios() {
        // Round 2 is a slow phase for everyone: 5x on both sides.
        let row = Row {
            bytes: 8,
            ferrocomm: vec![1.0e-6, 5.0e-6, 1.1e-6],
            peers: vec![vec![1.0e-6, 5.0e-6, 1.0e-6], vec![0.5e-6, 4.0e-6, 2.0e-6]],
            ..Row::default()
        };
        let close = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
        assert!(close(&row.slice_ratios(0), &[1.0, 1.0, 1.1]), "{:?}", row.slice_ratios(0));
        assert_eq!(row.latency_ratio(0), Some(1.0));
        let (lo, hi) = row.latency_range(0).unwrap();
        assert!(close(&[lo, hi], &[1.0, 1.1]));
        // Against the fastest peer of each round: 0.5, 4.0, 1.0 us.
        assert!(close(&row.best_slice_ratios(), &[2.0, 1.25, 1.1]), "{:?}", row.best_slice_ratios());
        assert_eq!(row.best_peer(), Some(0));
        assert_eq!(ratio_text(&row.best_slice_ratios()), "1.25 (1.10-2.00)");
        assert!((row.bandwidth_ratio(1).unwrap() - 0.8).abs() < 1e-12);
        let t = table(std::slice::from_ref(&row), &["A", "B"]);
        assert!(t.contains("best (min-max)") && t.contains("1.25 (1.10-2.00)"), "{t}");
        assert!(summary(&[row], &["A", "B"]).contains("best peer: ratio 1.25 (1.10-2.00)"));
        // A peer missing a round (ferrocomm stopped early there) pairs only the rounds both have.
        let short = Row { bytes: 1, ferrocomm: vec![2.0, 4.0], peers: vec![vec![1.0]], ..Row::default() };
        assert_eq!(short.slice_ratios(0), vec![2.0]);
        assert_eq!(Row::default().latency_ratio(0), None);
    }

    #[test]
    fn dips_are_found() {
        let rows = vec![r(1000, 1e-5, 1e-5), r(1003, 2e-5, 1e-5), r(2000, 2e-5, 1e-5)];
        let d = dips(&rows, Row::ferrocomm_mbps);
        assert_eq!(d.len(), 1);
        assert!(d[0].starts_with("1003 B"), "{d:?}");
        assert!(dips(&rows, |r| r.peer_mbps(0)).is_empty());
    }
}
