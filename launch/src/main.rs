//! `ferrorun`: start N ranks of a ferrocomm program on this machine.
//!
//! A thin command line over [`ferrorun::run_local`], for running and testing jobs without an MPI
//! installation or a Slurm allocation.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ferrorun::{LaunchOptions, run_local};

/// Starts N ranks of PROGRAM on this machine, each with FERROCOMM_RANK, FERROCOMM_SIZE,
/// FERROCOMM_COORD, FERROCOMM_TOKEN and FERROCOMM_LAUNCHER set, and prefixes every line of their
/// output with [RANK].
#[derive(Debug, Parser)]
#[command(
    name = "ferrorun",
    version,
    override_usage = "ferrorun [OPTIONS] -n <N> <PROGRAM> [ARGS]...",
    after_help = "Exits with 0 when every rank succeeds, else with the first failed rank's exit code \
                  (128 + N for a rank killed by signal N)."
)]
struct Cli {
    /// Number of ranks (1..=1048576; `-np N` works too)
    #[arg(short = 'n', value_name = "N", value_parser = parse_ranks)]
    n: u32,
    /// After one rank fails, how long the others may take to exit before they are killed
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = parse_grace)]
    grace: Duration,
    /// Set K=V for every rank (repeatable)
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// The address the job's store listens on (default 127.0.0.1): an address the ranks reach
    /// when a wrapper (PROGRAM) places them on other hosts, such as network namespaces
    #[arg(long, value_name = "IP")]
    store_addr: Option<std::net::IpAddr>,
    /// The ranks' log filter, as RUST_LOG (for example `info`, `debug` or `ferrocomm=trace,warn`):
    /// ferrocomm logs through `tracing`, which a program's subscriber filters by RUST_LOG
    #[arg(long, value_name = "LEVEL")]
    log: Option<String>,
    /// The program each rank runs, then its arguments (everything after PROGRAM is its own)
    #[arg(value_name = "PROGRAM", required = true)]
    program: PathBuf,
    /// PROGRAM's arguments: split off before clap sees the command line (see `parse`).
    #[arg(skip)]
    args: Vec<OsString>,
}

fn parse_ranks(v: &str) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => Err(format!("{v:?}: the number of ranks must be in 1..=1048576")),
    }
}

fn parse_grace(v: &str) -> Result<Duration, String> {
    let secs: f64 = v.parse().map_err(|_| format!("{v:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{v:?} is not a usable number of seconds"))
}

fn parse_env(v: &str) -> Result<(String, String), String> {
    match v.split_once('=') {
        Some((k, val)) if !k.is_empty() => Ok((k.to_string(), val.to_string())),
        _ => Err(format!("{v:?} is not of the form K=V")),
    }
}

/// Options that take the next argument as their value.
const WITH_VALUE: &[&str] = &["-n", "-np", "--grace", "--env", "--log", "--store-addr"];

/// The command line: ferrorun's own part, up to PROGRAM, goes to clap (with MPI's `-np N` spelled
/// `-n N`: clap's short options are one letter); what follows PROGRAM is PROGRAM's, whatever it
/// looks like.
fn parse(argv: impl IntoIterator<Item = OsString>) -> Result<Cli, clap::Error> {
    let mut own: Vec<OsString> = Vec::new();
    let mut argv = argv.into_iter();
    own.extend(argv.next());
    while let Some(a) = argv.next() {
        let program = match a.to_str() {
            Some("--") => {
                own.push(a);
                argv.next()
            }
            Some(s) if s.starts_with('-') && s.len() > 1 => {
                let takes_value = WITH_VALUE.contains(&s);
                own.push(if s == "-np" { OsString::from("-n") } else { a });
                if takes_value {
                    own.extend(argv.next());
                }
                continue;
            }
            _ => Some(a),
        };
        own.extend(program);
        break;
    }
    let rest: Vec<OsString> = argv.collect();
    let mut cli = Cli::try_parse_from(own)?;
    cli.args = rest;
    Ok(cli)
}

impl Cli {
    fn options(&self) -> LaunchOptions {
        let mut env = self.env.clone();
        if let Some(level) = &self.log {
            env.push(("RUST_LOG".to_string(), level.clone()));
        }
        let mut opts = LaunchOptions { grace: self.grace, env, ..LaunchOptions::default() };
        if let Some(addr) = self.store_addr {
            opts.store_addr = addr;
        }
        opts
    }
}

fn main() -> ExitCode {
    let cli = match parse(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with success; usage errors to stderr with 2, always
            // with the usage line (clap leaves it out of some, a refused value's say).
            let _ = e.print();
            if !e.use_stderr() {
                return ExitCode::SUCCESS;
            }
            if !e.render().to_string().contains("Usage:") {
                use clap::CommandFactory;
                eprintln!("\n{}", Cli::command().render_usage());
            }
            return ExitCode::from(2);
        }
    };
    match run_local(cli.n, &cli.program, &cli.args, &cli.options()) {
        // Exit codes are one byte; anything else still means failure.
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("ferrorun: {e}");
            ExitCode::from(match e.kind() {
                std::io::ErrorKind::NotFound => 127,
                std::io::ErrorKind::PermissionDenied => 126,
                _ => 1,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(s: &[&str]) -> Cli {
        let argv = std::iter::once("ferrorun").chain(s.iter().copied()).map(OsString::from);
        parse(argv).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn full_command_line() {
        let c = run(&["-n", "4", "--grace", "0.5", "--env", "A=b=c", "--log", "debug", "prog", "-n", "x"]);
        assert_eq!(c.n, 4);
        assert_eq!(c.grace, Duration::from_millis(500));
        let opts = c.options();
        assert_eq!(opts.grace, Duration::from_millis(500));
        assert_eq!(opts.env, vec![("A".into(), "b=c".into()), ("RUST_LOG".into(), "debug".into())]);
        assert_eq!(c.program, PathBuf::from("prog"));
        assert_eq!(c.args, vec![OsString::from("-n"), OsString::from("x")]);
        assert_eq!(run(&["-n2", "--", "-weird"]).program, PathBuf::from("-weird"));
        assert_eq!(run(&["-np", "3", "p"]).n, 3);
        assert_eq!(run(&["-n", "3", "p", "-np", "9"]).args, vec![OsString::from("-np"), OsString::from("9")]);
        assert_eq!(run(&["-n", "1", "p"]).grace, Duration::from_secs(3));
        assert_eq!(run(&["-n", "2", "--store-addr", "10.0.0.9", "p"]).options().store_addr.to_string(), "10.0.0.9");
        assert_eq!(run(&["-n", "2", "p"]).options().store_addr.to_string(), "127.0.0.1");
    }

    #[test]
    fn bad_command_lines() {
        for bad in [
            &[][..],
            &["prog"],
            &["-n"],
            &["-n", "0", "p"],
            &["-n", "abc", "p"],
            &["-n", "2000000", "p"],
            &["-n", "2", "--grace", "-1", "p"],
            &["-n", "2", "--grace", "soon", "p"],
            &["-n", "2", "--env", "novalue", "p"],
            &["-n", "2", "--env", "=v", "p"],
            &["-n", "2", "--bogus", "p"],
            &["-n", "2"],
            &["-n", "2", "--log"],
            &["-n", "2", "--store-addr", "node01", "p"],
        ] {
            let argv = std::iter::once("ferrorun").chain(bad.iter().copied()).map(OsString::from);
            assert!(parse(argv).is_err(), "{bad:?}");
        }
        let help = parse(["ferrorun", "--help"].map(OsString::from)).unwrap_err();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
