//! What every subcommand's command line shares: value parsers for clap (byte counts with `K`,
//! `M`, `G` suffixes, CPU pairs, progress modes, backends) and the progress bar of
//! long sweeps.
//!
//! Each subcommand declares its options as a `clap` derive struct in its own module and parses
//! values with these functions, so that `64K` means the same everywhere.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte count: digits with an optional binary suffix, `K`, `M` or `G` (any case, optionally
/// followed by `B` or `iB`): `65536`, `64K`, `64KiB`, `8M`, `1G`. Between 1 byte and 1 GiB.
pub fn bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("{s:?}: not a byte count (e.g. 65536, 64K, 8M, 1G)")),
    };
    let n: usize = num.parse().map_err(|_| format!("{s:?}: not a byte count (e.g. 65536, 64K, 8M, 1G)"))?;
    match n.checked_mul(1 << shift) {
        Some(v) if (1..=1 << 30).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: must be between 1 byte and 1 GiB")),
    }
}

/// A total of bytes (a memory budget), with the suffixes of [`bytes()`] and no upper bound.
pub fn total_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let unit = bytes(&format!("1{suffix}")).map_err(|_| format!("{s:?}: not a byte count (e.g. 256M, 4G)"))?;
    let n: usize = num.parse().map_err(|_| format!("{s:?}: not a byte count (e.g. 256M, 4G)"))?;
    n.checked_mul(unit).filter(|&v| v > 0).ok_or_else(|| format!("{s:?}: must be at least 1 byte"))
}

/// A count of at least 1 (runs, iterations).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// [`at_least_one`] as a `u64`.
pub fn at_least_one_u64(s: &str) -> Result<u64, String> {
    at_least_one(s).map(|n| n as u64)
}

/// `A,B`: two CPU numbers.
pub fn cpu_pair(s: &str) -> Result<[usize; 2], String> {
    let cpus: Option<Vec<usize>> = s.split(',').map(|c| c.trim().parse().ok()).collect();
    match cpus.as_deref() {
        Some(&[a, b]) => Ok([a, b]),
        _ => Err(format!("{s:?}: expected two CPU numbers, A,B")),
    }
}

/// A ferrocomm progress mode (`busy`, `adaptive[:US]`, `blocking`), kept as written.
pub fn progress(s: &str) -> Result<String, String> {
    s.parse::<ferrocomm::ProgressMode>().map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

/// A ferrocomm TCP backend (`auto`, `uring`, `portable`), kept as written.
pub fn backend(s: &str) -> Result<String, String> {
    s.parse::<ferrocomm::TcpBackend>().map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

/// `KEY=VALUE`.
pub fn key_value(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some((k, _)) if !k.is_empty() => Ok(s.to_string()),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// The progress bar of a sweep of `total` steps (runs times sides, sizes, algorithms), on
/// standard error. Hidden when standard error is not a terminal (a log file, a pipe, CI): the
/// step messages are then printed as plain lines instead, as they would be without a bar.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(total: u64, what: &str) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta}) {msg}")
                .expect("a valid template");
        bar.set_style(style);
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress { bar }
    }

    /// Says what runs now.
    pub fn step(&self, what: impl Into<String>) {
        self.bar.set_message(what.into());
    }

    /// One step done.
    pub fn inc(&self) {
        self.bar.inc(1);
    }

    /// A line for the log (above the bar while it shows, on standard error in any case).
    pub fn note(&self, line: impl AsRef<str>) {
        self.bar.suspend(|| eprintln!("{}", line.as_ref()));
    }

    /// Runs `f` with the bar cleared, for output that would garble it.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts() {
        assert_eq!(bytes("8M").unwrap(), 8 << 20);
        assert_eq!(bytes("8MiB").unwrap(), 8 << 20);
        assert_eq!(bytes("64K").unwrap(), 65536);
        assert_eq!(bytes("4k").unwrap(), 4096);
        assert_eq!(bytes("1G").unwrap(), 1 << 30);
        assert_eq!(bytes("65536").unwrap(), 65536);
        for bad in ["0", "2G", "x", "", "8T", "-1", "1.5K"] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
        assert_eq!(total_bytes("256M").unwrap(), 256 << 20);
        assert_eq!(total_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(total_bytes("1000").unwrap(), 1000);
        assert!(total_bytes("0").is_err() && total_bytes("x").is_err() && total_bytes("").is_err());
    }

    #[test]
    fn cpus_and_values() {
        assert_eq!(cpu_pair("1,0").unwrap(), [1, 0]);
        assert!(cpu_pair("1").is_err() && cpu_pair("1,2,3").is_err() && cpu_pair("a,b").is_err());
        assert!(progress("adaptive:20").is_ok() && progress("sometimes").is_err());
        assert!(backend("uring").is_ok() && backend("rdma").is_err());
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(at_least_one("0").is_err() && at_least_one("x").is_err());
        assert!(key_value("A=b=c").is_ok() && key_value("A").is_err() && key_value("=b").is_err());
    }
}
