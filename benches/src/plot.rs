//! Hand-made SVG figures: panels of curves against message size (log x), each panel's y axis
//! linear or logarithmic. Ping-pong draws throughput and latency; collectives one latency panel
//! per operation and rank count; multicast the broadcast latency of both methods.

use std::fmt::Write;
use std::path::Path;

use crate::report::Row;

const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 400.0;
const HEADER: f64 = 56.0;
/// Plot area insets within a panel: left, right, top, bottom.
const INSET: (f64, f64, f64, f64) = (84.0, 30.0, 36.0, 54.0);
/// Curve colours in order: ferrocomm's first, then the peers' or the other algorithms'.
const COLORS: [&str; 8] = ["#1f63b4", "#e8710a", "#2ca02c", "#9467bd", "#d62728", "#8c564b", "#e377c2", "#7f7f7f"];

/// One curve: `(bytes, value)` points.
pub(crate) struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// How a panel's y axis maps values.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum YAxis {
    /// From 0 to a round top.
    Linear,
    /// From the decade below the lowest value to the decade above the highest.
    Log,
}

/// One panel: its title, y label and axis, and curves (coloured in order).
pub(crate) struct Panel {
    pub title: String,
    pub ylabel: String,
    pub y: YAxis,
    pub series: Vec<Series>,
}

/// An axis mapping values to `0..=1`.
#[derive(Clone, Copy)]
enum Scale {
    Linear { lo: f64, hi: f64 },
    Log { lo: f64, hi: f64 },
}

impl Scale {
    fn frac(self, v: f64) -> f64 {
        match self {
            Scale::Linear { lo, hi } => (v - lo) / (hi - lo),
            Scale::Log { lo, hi } => (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10()),
        }
    }
}

/// A panel's plot area in picture coordinates.
struct Area {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

impl Area {
    fn at(&self, xs: Scale, ys: Scale, (x, y): (f64, f64)) -> (f64, f64) {
        (self.x + xs.frac(x) * self.w, self.y + self.h - ys.frac(y) * self.h)
    }
}

/// The ping-pong picture for `rows`: throughput and latency; `peers` names the peers' curves.
pub(crate) fn svg(title: &str, subtitle: &str, rows: &[Row], peers: &[&str]) -> String {
    let curves = |pick: fn(&Row) -> Option<f64>, peer_pick: fn(&Row, usize) -> Option<f64>| {
        let mut s = vec![Series {
            name: "ferrocomm".into(),
            points: rows.iter().filter_map(|r| Some((r.bytes as f64, pick(r)?))).collect(),
        }];
        for (i, p) in peers.iter().enumerate() {
            s.push(Series {
                name: p.to_string(),
                points: rows.iter().filter_map(|r| Some((r.bytes as f64, peer_pick(r, i)?))).collect(),
            });
        }
        s
    };
    let panels = [
        Panel {
            title: "Throughput vs message size".into(),
            ylabel: "throughput (MB/s)".into(),
            y: YAxis::Linear,
            series: curves(Row::ferrocomm_mbps, Row::peer_mbps),
        },
        Panel {
            title: "Latency (one-way, round trip / 2) vs message size".into(),
            ylabel: "latency (µs)".into(),
            y: YAxis::Log,
            series: curves(Row::ferrocomm_us, Row::peer_us),
        },
    ];
    figure(title, subtitle, &panels)
}

/// A figure of `panels` stacked, all on one x axis (message size, log scale, from 1 byte or from
/// the smallest size to the largest).
pub(crate) fn figure(title: &str, subtitle: &str, panels: &[Panel]) -> String {
    let xs_all = || panels.iter().flat_map(|p| p.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let max_bytes = xs_all().fold(2.0, f64::max);
    let min_bytes = xs_all().filter(|&x| x >= 1.0).fold(max_bytes, f64::min);
    // The x axis starts at a power of 4 (where the ticks are) at or below the smallest size.
    let lo = 4f64.powf((min_bytes.log(4.0)).floor()).max(1.0);
    let xs = Scale::Log { lo, hi: max_bytes.max(lo * 4.0) };

    let height = HEADER + panels.len() as f64 * PANEL_HEIGHT;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="17" font-weight="bold">{}</text>"#,
        WIDTH / 2.0,
        esc(title)
    );
    let _ = writeln!(
        out,
        r##"<text x="{}" y="44" text-anchor="middle" fill="#444">{}</text>"##,
        WIDTH / 2.0,
        esc(subtitle)
    );
    for (k, p) in panels.iter().enumerate() {
        let values = || p.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
        let top = HEADER + k as f64 * PANEL_HEIGHT;
        match p.y {
            YAxis::Linear => {
                let (top_value, step) = nice_linear(values().fold(0.0, f64::max));
                let ys = Scale::Linear { lo: 0.0, hi: top_value };
                let yticks: Vec<(f64, String)> = (0..)
                    .map(|i| i as f64 * step)
                    .take_while(|&v| v <= top_value * 1.0001)
                    .map(|v| (v, linear_label(v, step)))
                    .collect();
                panel(&mut out, top, &p.title, &p.ylabel, xs, ys, &yticks, &p.series);
            }
            YAxis::Log => {
                let (lo, hi) =
                    values().filter(|&v| v > 0.0).fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
                let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (1.0, 10.0) };
                let lo = 10f64.powf(lo.log10().floor());
                let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
                let ys = Scale::Log { lo, hi };
                panel(&mut out, top, &p.title, &p.ylabel, xs, ys, &log_ticks(lo, hi), &p.series);
            }
        }
    }
    out += "</svg>\n";
    out
}

/// Writes `svg` to `path` and says so.
pub(crate) fn write(path: &Path, svg: &str) -> crate::Result<()> {
    std::fs::write(path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn panel(
    out: &mut String,
    top: f64,
    title: &str,
    ylabel: &str,
    xs: Scale,
    ys: Scale,
    yticks: &[(f64, String)],
    series: &[Series],
) {
    let (l, r, t, b) = INSET;
    let a = Area { x: l, y: top + t, w: WIDTH - l - r, h: PANEL_HEIGHT - t - b };
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="14" font-weight="bold">{}</text>"#,
        a.x + a.w / 2.0,
        top + t - 12.0,
        esc(title)
    );
    // Grid and ticks.
    let _ = writeln!(out, r##"<g stroke="#e3e3e3" stroke-width="1">"##);
    let Scale::Log { lo: min_bytes, hi: max_bytes } = xs else { unreachable!("sizes are on a log scale") };
    let xticks: Vec<f64> =
        (0..).map(|k| 4f64.powi(k)).skip_while(|&v| v < min_bytes).take_while(|&v| v <= max_bytes).collect();
    for &x in &xticks {
        let (px, _) = a.at(xs, ys, (x, 1.0));
        let _ = writeln!(out, r#"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}"/>"#, a.y, a.y + a.h);
    }
    for (y, _) in yticks {
        let py = a.y + a.h - ys.frac(*y) * a.h;
        let _ = writeln!(out, r#"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}"/>"#, a.x, a.x + a.w);
    }
    let _ = writeln!(out, "</g>");
    let _ = writeln!(
        out,
        r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#333"/>"##,
        a.x, a.y, a.w, a.h
    );
    for &x in &xticks {
        let (px, _) = a.at(xs, ys, (x, 1.0));
        let _ = writeln!(
            out,
            r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            a.y + a.h + 16.0,
            size_label(x)
        );
    }
    for (y, label) in yticks {
        let py = a.y + a.h - ys.frac(*y) * a.h;
        let _ =
            writeln!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, a.x - 6.0, py + 4.0, esc(label));
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (bytes, log scale)</text>"#,
        a.x + a.w / 2.0,
        a.y + a.h + 36.0
    );
    let (cx, cy) = (a.x - 62.0, a.y + a.h / 2.0);
    let _ = writeln!(
        out,
        r#"<text x="{cx:.1}" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 {cx:.1} {cy:.1})">{}</text>"#,
        esc(ylabel)
    );
    // Curves.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&p| {
                let (x, y) = a.at(xs, ys, p);
                format!("{x:.1},{y:.1}")
            })
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.8" stroke-linejoin="round" points="{}"/>"#,
            pts.join(" ")
        );
        let _ = writeln!(out, r#"<g fill="{color}">"#);
        for p in &pts {
            let (x, y) = p.split_once(',').expect("x,y");
            let _ = writeln!(out, r#"<circle cx="{x}" cy="{y}" r="2.4"/>"#);
        }
        let _ = writeln!(out, "</g>");
    }
    // Legend, top left.
    let (lx, ly) = (a.x + 14.0, a.y + 12.0);
    let longest = series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0);
    let _ = writeln!(
        out,
        r##"<rect x="{lx:.1}" y="{ly:.1}" width="{:.1}" height="{:.1}" fill="white" fill-opacity="0.9" stroke="#999"/>"##,
        (50.0 + 7.0 * longest as f64).max(130.0),
        10.0 + 18.0 * series.len() as f64
    );
    for (i, s) in series.iter().enumerate() {
        let y = ly + 16.0 + 18.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="2.5"/>"#,
            lx + 8.0,
            lx + 32.0,
            COLORS[i % COLORS.len()]
        );
        let _ = writeln!(out, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, lx + 40.0, y + 4.0, esc(&s.name));
    }
}

/// A round top at or above `max` and a tick step dividing it (1, 2 or 5 times a power of ten).
fn nice_linear(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|&s| s >= raw).unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// Ticks for a log axis from `lo` to `hi` (both powers of ten): 1, 2 and 5 per decade when there
/// are few decades, else decades only.
fn log_ticks(lo: f64, hi: f64) -> Vec<(f64, String)> {
    let decades = (hi / lo).log10().round() as i32;
    let mults: &[f64] = if decades <= 3 { &[1.0, 2.0, 5.0] } else { &[1.0] };
    let mut out = Vec::new();
    for d in 0..=decades {
        let base = lo * 10f64.powi(d);
        for &m in mults {
            let v = base * m;
            if v <= hi * 1.0001 {
                out.push((v, trim_float(v)));
            }
        }
    }
    out
}

/// `v` with as many decimals as `step` needs.
fn linear_label(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

fn trim_float(v: f64) -> String {
    if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
}

/// `1`, `4`, ..., `1K`, `4K`, ..., `1M` for powers of two.
fn size_label(bytes: f64) -> String {
    let b = bytes as u64;
    match b {
        _ if b >= 1 << 30 && b.is_multiple_of(1 << 30) => format!("{}G", b >> 30),
        _ if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{}M", b >> 20),
        _ if b >= 1 << 10 && b.is_multiple_of(1 << 10) => format!("{}K", b >> 10),
        _ => b.to_string(),
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes() {
        assert_eq!(nice_linear(3870.0), (4000.0, 1000.0));
        assert_eq!(nice_linear(0.0), (1.0, 0.2));
        assert_eq!(
            (linear_label(0.6000000000000001, 0.2), linear_label(3000.0, 1000.0)),
            ("0.6".into(), "3000".into())
        );
        let t: Vec<String> = log_ticks(10.0, 1000.0).into_iter().map(|t| t.1).collect();
        assert_eq!(t, ["10", "20", "50", "100", "200", "500", "1000"]);
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(8.0 * 1048576.0), "8M");
    }

    #[test]
    fn picture_is_well_formed() {
        let rows: Vec<Row> = [1usize, 8, 1024, 4 << 20]
            .iter()
            .map(|&b| Row {
                bytes: b,
                ferrocomm: vec![1e-5 + b as f64 * 1e-9],
                peers: vec![vec![2e-5 + b as f64 * 5e-10]],
                ..Row::default()
            })
            .collect();
        let s = svg("t <1>", "s", &rows, &["NPtcp"]);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<polyline").count(), 4);
        assert!(s.contains("t &lt;1&gt;") && s.contains(">NPtcp<"));
    }

    #[test]
    fn figures_of_any_panels() {
        let curve = |name: &str, k: f64| Series {
            name: name.into(),
            points: [8.0, 64.0, 4096.0, 1048576.0].iter().map(|&b| (b, 10.0 * k + b * 1e-3)).collect(),
        };
        let panels: Vec<Panel> = (0..3)
            .map(|i| Panel {
                title: format!("panel {i}"),
                ylabel: "latency (µs)".into(),
                y: YAxis::Log,
                series: vec![curve("ferrocomm", 1.0), curve("openmpi", 2.0), curve("recursive-doubling", 3.0)],
            })
            .collect();
        let s = figure("f", "s", &panels);
        assert_eq!(s.matches("<polyline").count(), 9);
        assert!(s.contains(r#"height="1256""#), "three panels tall");
        // The x axis starts at the power of 4 below 8 bytes, not at 1 byte.
        assert!(s.contains(">4<") && !s.contains(">1<"));
        assert!(s.contains(">recursive-doubling<"));
        // No points: still a well-formed picture.
        let empty =
            figure("e", "s", &[Panel { title: "p".into(), ylabel: "y".into(), y: YAxis::Linear, series: vec![] }]);
        assert!(empty.trim_end().ends_with("</svg>"));
    }
}
