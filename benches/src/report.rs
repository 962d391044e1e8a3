//! Combining runs into rows, and the table, summary and JSON made of them.

use serde_json::{Value, json};

use crate::sweep::{mb_per_s, median};

/// A throughput drop this large from one size to the next is called a dip.
const DIP: f64 = 0.15;

/// One message size: every run's one-way time on each side.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub bytes: usize,
    /// ferrocomm's one-way times, seconds, one per run.
    pub ferrocomm: Vec<f64>,
    /// The peer's one-way times, seconds, one per run.
    pub peer: Vec<f64>,
    /// ferrocomm's median one-way times within each run's batch, seconds, one per run.
    pub ferrocomm_median: Vec<f64>,
}

impl Row {
    pub fn ferrocomm_us(&self) -> Option<f64> {
        median(&self.ferrocomm).map(|s| s * 1e6)
    }
    pub fn peer_us(&self) -> Option<f64> {
        median(&self.peer).map(|s| s * 1e6)
    }
    pub fn ferrocomm_mbps(&self) -> Option<f64> {
        median(&self.ferrocomm).map(|s| mb_per_s(self.bytes, s))
    }
    pub fn peer_mbps(&self) -> Option<f64> {
        median(&self.peer).map(|s| mb_per_s(self.bytes, s))
    }
    /// ferrocomm's latency over the peer's: above 1 means ferrocomm is slower.
    pub fn latency_ratio(&self) -> Option<f64> {
        Some(self.ferrocomm_us()? / self.peer_us()?)
    }
    /// ferrocomm's throughput over the peer's: below 1 means ferrocomm is slower.
    pub fn bandwidth_ratio(&self) -> Option<f64> {
        Some(self.ferrocomm_mbps()? / self.peer_mbps()?)
    }
}

/// What was measured, for the record.
pub struct Meta<'a> {
    pub backend: &'a str,
    /// The transport the ranks reported, e.g. `tcp-uring`.
    pub transport_name: &'a str,
    pub progress: &'a str,
    /// How ferrocomm received: `recv` or `recv_into`.
    pub receive: &'a str,
    pub peer: Option<&'a str>,
    /// Other work's share of the benchmark's CPUs during each sweep.
    pub interference: &'a [Value],
    pub runs: usize,
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

/// The per-size table.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:>9} {:>13} {:>10} {:>9} {:>15} {:>10} {:>8}\n",
        "bytes", "ferrocomm_us", "peer_us", "lat_ratio", "ferrocomm_MBps", "peer_MBps", "bw_ratio"
    );
    for r in rows {
        out += &format!(
            "{:>9} {:>13} {:>10} {:>9} {:>15} {:>10} {:>8}\n",
            r.bytes,
            num(r.ferrocomm_us(), 2),
            num(r.peer_us(), 2),
            num(r.latency_ratio(), 2),
            num(r.ferrocomm_mbps(), 2),
            num(r.peer_mbps(), 2),
            num(r.bandwidth_ratio(), 2),
        );
    }
    out
}

fn row(rows: &[Row], bytes: usize) -> Option<&Row> {
    rows.iter().find(|r| r.bytes == bytes)
}

/// The 8 B latency ratio and the 4 MiB bandwidth ratio, when measured.
pub fn headline(rows: &[Row]) -> (Option<f64>, Option<f64>) {
    (row(rows, 8).and_then(Row::latency_ratio), row(rows, 4 << 20).and_then(Row::bandwidth_ratio))
}

/// One line: 8 B latency and 4 MiB bandwidth, with their ratios when there is a peer.
pub fn summary(rows: &[Row], peer: Option<&str>) -> String {
    let mut parts = Vec::new();
    match row(rows, 8) {
        Some(r) => {
            let mut s = format!("8 B latency: ferrocomm {} us", num(r.ferrocomm_us(), 2));
            if let Some(p) = peer {
                s += &format!(", {p} {} us, ratio {}", num(r.peer_us(), 2), num(r.latency_ratio(), 3));
            }
            parts.push(s);
        }
        None => parts.push("8 B latency: not measured".into()),
    }
    match row(rows, 4 << 20) {
        Some(r) => {
            let mut s = format!("4 MiB bandwidth: ferrocomm {} MB/s", num(r.ferrocomm_mbps(), 1));
            if let Some(p) = peer {
                s += &format!(", {p} {} MB/s, ratio {}", num(r.peer_mbps(), 1), num(r.bandwidth_ratio(), 3));
            }
            parts.push(s);
        }
        None => parts.push("4 MiB bandwidth: not measured (--max below 4 MiB)".into()),
    }
    format!("summary: {}", parts.join("; "))
}

/// The verbs comparison: ferrocomm's 8 B one-way latency over `ib_send_lat`'s, median against
/// median (`t_typical`; the headline) and mean against mean (`t_avg`), and its 1 MiB ping-pong
/// throughput over `ib_write_bw`'s streaming bandwidth (goals: at most 1.5, at least 0.8).
/// `perf_median` holds `ib_send_lat`'s median of each run, seconds. A line of text and the JSON.
pub fn verbs_summary(rows: &[Row], perf_median: &[f64]) -> (String, Value) {
    let (lat, bw) = (row(rows, 8), row(rows, 1 << 20));
    let f_median = lat.and_then(|r| median(&r.ferrocomm_median)).map(|s| s * 1e6);
    let p_median = median(perf_median).map(|s| s * 1e6);
    let median_ratio = f_median.zip(p_median).map(|(f, p)| f / p);
    let mean_ratio = lat.and_then(Row::latency_ratio);
    let bw_ratio = bw.and_then(Row::bandwidth_ratio);
    let line = format!(
        "verbs vs perftest: 8 B latency, medians: ferrocomm {} us / ib_send_lat {} us = {} (goal <= 1.5); \
         means: {} us / {} us = {}; 1 MiB bandwidth ferrocomm {} MB/s / ib_write_bw {} MB/s = {} (goal >= 0.8)",
        num(f_median, 2),
        num(p_median, 2),
        num(median_ratio, 3),
        num(lat.and_then(Row::ferrocomm_us), 2),
        num(lat.and_then(Row::peer_us), 2),
        num(mean_ratio, 3),
        num(bw.and_then(Row::ferrocomm_mbps), 1),
        num(bw.and_then(Row::peer_mbps), 1),
        num(bw_ratio, 3),
    );
    let v = json!({
        "latency_8B": {
            "ferrocomm_median_us": f_median,
            "ib_send_lat_median_us": p_median,
            "ratio": median_ratio,
            "ferrocomm_mean_us": lat.and_then(Row::ferrocomm_us),
            "ib_send_lat_mean_us": lat.and_then(Row::peer_us),
            "mean_ratio": mean_ratio,
            "goal": "<= 1.5",
        },
        "bandwidth_1MiB": {
            "ferrocomm_MBps": bw.and_then(Row::ferrocomm_mbps),
            "ib_write_bw_MBps": bw.and_then(Row::peer_mbps),
            "ratio": bw_ratio,
            "goal": ">= 0.8",
        },
    });
    (line, v)
}

/// Sizes whose throughput (per `mbps`) is over [`DIP`] below the previous size's, as text.
pub fn dips(rows: &[Row], mbps: impl Fn(&Row) -> Option<f64>) -> Vec<String> {
    let points: Vec<(usize, f64)> = rows.iter().filter_map(|r| Some((r.bytes, mbps(r)?))).collect();
    points
        .windows(2)
        .filter(|w| w[1].1 < w[0].1 * (1.0 - DIP))
        .map(|w| format!("{} B {:.1} MB/s ({:+.0}% vs {} B)", w[1].0, w[1].1, (w[1].1 / w[0].1 - 1.0) * 100.0, w[0].0))
        .collect()
}

/// The `--json` document.
pub fn to_json(meta: &Meta, rows: &[Row]) -> Value {
    let (lat, bw) = headline(rows);
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "bytes": r.bytes,
                "ferrocomm_us": r.ferrocomm_us(),
                "peer_us": r.peer_us(),
                "ferrocomm_MBps": r.ferrocomm_mbps(),
                "peer_MBps": r.peer_mbps(),
                "latency_ratio": r.latency_ratio(),
                "bandwidth_ratio": r.bandwidth_ratio(),
                "ferrocomm_runs_us": r.ferrocomm.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
                "ferrocomm_median_runs_us": r.ferrocomm_median.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
                "peer_runs_us": r.peer.iter().map(|s| s * 1e6).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "bench": "pingpong",
        "transport": "tcp",
        "backend": meta.backend,
        "transport_name": meta.transport_name,
        "progress": meta.progress,
        "receive": meta.receive,
        "peer": meta.peer,
        "runs": meta.runs,
        "interference": meta.interference,
        "statistic": "median over runs",
        "cpus": meta.cpus,
        "max": meta.max,
        "latency_ratio_8B": lat,
        "bandwidth_ratio_4MiB": bw,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(bytes: usize, f: f64, p: f64) -> Row {
        Row { bytes, ferrocomm: vec![f, f * 2.0, f / 2.0], peer: vec![p], ..Row::default() }
    }

    #[test]
    fn ratios_and_headline() {
        let rows = vec![r(8, 20e-6, 10e-6), r(4 << 20, 2e-3, 1e-3)];
        assert_eq!(rows[0].latency_ratio(), Some(2.0));
        assert_eq!(rows[1].bandwidth_ratio(), Some(0.5));
        assert_eq!(headline(&rows), (Some(2.0), Some(0.5)));
        let s = summary(&rows, Some("NPtcp"));
        assert!(s.contains("ratio 2.000") && s.contains("ratio 0.500"), "{s}");
        assert!(table(&rows).lines().count() == 3);
    }

    #[test]
    fn dips_are_found() {
        let rows = vec![r(1000, 1e-5, 1e-5), r(1003, 2e-5, 1e-5), r(2000, 2e-5, 1e-5)];
        let d = dips(&rows, Row::ferrocomm_mbps);
        assert_eq!(d.len(), 1);
        assert!(d[0].starts_with("1003 B"), "{d:?}");
        assert!(dips(&rows, Row::peer_mbps).is_empty());
    }
}
