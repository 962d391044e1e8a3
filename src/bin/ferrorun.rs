//! `ferrorun`: start N ranks of a ferrocomm program on this machine.
//!
//! A thin command line over [`ferrocomm::launch::run_local`], for running
//! and testing jobs without an MPI installation or a Slurm allocation.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ferrocomm::launch::{LaunchOptions, run_local};

const USAGE: &str = "\
usage: ferrorun -n N [--grace SECS] [--env K=V]... [--store-addr IP] PROGRAM [ARGS...]

Starts N ranks of PROGRAM on this machine, each with FERROCOMM_RANK,
FERROCOMM_SIZE, FERROCOMM_COORD, FERROCOMM_TOKEN and FERROCOMM_LAUNCHER set,
and prefixes every line of their output with [RANK].

  -n, -np N       number of ranks (1..=1048576)
  --grace SECS    after one rank fails, how long the others may take to exit
                  before they are killed (default 3)
  --env K=V       set K=V for every rank (repeatable)
  --store-addr IP the address the job's store listens on (default 127.0.0.1);
                  an address the ranks reach when a wrapper (PROGRAM) places
                  them on other hosts, such as network namespaces
  -h, --help      show this help

Exits with 0 when every rank succeeds, else with the first failed rank's
exit code (128 + N for a rank killed by signal N).";

#[derive(Debug)]
struct Cli {
    n: u32,
    program: PathBuf,
    args: Vec<OsString>,
    opts: LaunchOptions,
}

enum Parsed {
    Run(Cli),
    Help,
}

fn parse(mut argv: impl Iterator<Item = OsString>) -> Result<Parsed, String> {
    let mut n: Option<u32> = None;
    let mut opts = LaunchOptions::default();
    let program = loop {
        let Some(arg) = argv.next() else {
            return Err("no PROGRAM given".to_string());
        };
        let Some(s) = arg.to_str() else {
            // Not an option (options are ASCII): the program itself.
            break arg;
        };
        let mut value =
            |name: &str| argv.next().and_then(|v| v.into_string().ok()).ok_or_else(|| format!("{name} needs a value"));
        match s {
            "-h" | "--help" => return Ok(Parsed::Help),
            "-n" | "-np" => {
                let v = value(s)?;
                n = Some(parse_ranks(&v)?);
            }
            "--grace" => {
                let v = value(s)?;
                let secs: f64 = v.parse().map_err(|_| format!("--grace {v:?} is not a number of seconds"))?;
                opts.grace = Duration::try_from_secs_f64(secs)
                    .map_err(|_| format!("--grace {v:?} is not a usable number of seconds"))?;
            }
            "--env" => {
                let v = value(s)?;
                match v.split_once('=') {
                    Some((k, val)) if !k.is_empty() => opts.env.push((k.to_string(), val.to_string())),
                    _ => return Err(format!("--env {v:?} is not of the form K=V")),
                }
            }
            "--store-addr" => {
                let v = value(s)?;
                opts.store_addr = v.parse().map_err(|_| format!("--store-addr {v:?} is not an IP address"))?;
            }
            "--" => match argv.next() {
                Some(p) => break p,
                None => return Err("no PROGRAM given after --".to_string()),
            },
            _ if s.starts_with("-n") && s.len() > 2 && s[2..].bytes().all(|b| b.is_ascii_digit()) => {
                n = Some(parse_ranks(&s[2..])?);
            }
            _ if s.starts_with('-') => return Err(format!("unknown option {s:?}")),
            _ => break arg,
        }
    };
    let n = n.ok_or("the number of ranks is missing: give -n N")?;
    Ok(Parsed::Run(Cli { n, program: PathBuf::from(program), args: argv.collect(), opts }))
}

fn parse_ranks(v: &str) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => Err(format!("-n {v:?}: the number of ranks must be in 1..=1048576")),
    }
}

fn main() -> ExitCode {
    let cli = match parse(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(cli)) => cli,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("ferrorun: {msg}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run_local(cli.n, &cli.program, &cli.args, &cli.opts) {
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

    fn args(s: &[&str]) -> impl Iterator<Item = OsString> {
        s.iter().map(OsString::from).collect::<Vec<_>>().into_iter()
    }

    fn run(s: &[&str]) -> Cli {
        match parse(args(s)) {
            Ok(Parsed::Run(c)) => c,
            Ok(Parsed::Help) => panic!("help"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn full_command_line() {
        let c = run(&["-n", "4", "--grace", "0.5", "--env", "A=b=c", "prog", "-n", "x"]);
        assert_eq!(c.n, 4);
        assert_eq!(c.opts.grace, Duration::from_millis(500));
        assert_eq!(c.opts.env, vec![("A".to_string(), "b=c".to_string())]);
        assert_eq!(c.program, PathBuf::from("prog"));
        assert_eq!(c.args, vec![OsString::from("-n"), OsString::from("x")]);
        assert_eq!(run(&["-n2", "--", "-weird"]).program, PathBuf::from("-weird"));
        assert_eq!(run(&["-np", "3", "p"]).n, 3);
        assert_eq!(run(&["-n", "2", "--store-addr", "10.0.0.9", "p"]).opts.store_addr.to_string(), "10.0.0.9");
        assert!(parse(args(&["-n", "2", "--store-addr", "node01", "p"])).is_err());
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
        ] {
            assert!(parse(args(bad)).is_err(), "{bad:?}");
        }
        assert!(matches!(parse(args(&["--help"])), Ok(Parsed::Help)));
    }
}
