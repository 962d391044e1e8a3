//! The distributed hash table example (examples/dht.rs), run as separate processes under
//! `ferrorun` over shared memory (the clients work on mapped shards) and over TCP (the owners'
//! progress serves them): its report must show the operations done, a hit rate, and no wrong
//! value.
//!
//! The ranks are this test binary, re-run by `ferrorun` with `--exact dht_rank` and
//! `FERROCOMM_DHT_RUN` set; the example's code is compiled into it.

#[allow(dead_code)]
#[path = "../examples/dht.rs"]
mod dht;

use std::process::{Command, Stdio};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");

fn launch(n: u32, transports: &str) -> (Option<i32>, String) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(FERRORUN)
        .args(["-n", &n.to_string(), "--grace", "10", "--env", "FERROCOMM_DHT_RUN=1"])
        .args(["--env", &format!("FERROCOMM_TRANSPORTS={transports}")])
        .arg(exe)
        .args(["--exact", "dht_rank", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

/// The number after `label` in `line`.
fn number(line: &str, label: &str) -> f64 {
    let rest = line.split(label).nth(1).unwrap_or_else(|| panic!("no {label:?} in {line}"));
    let token: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    token.parse().unwrap_or_else(|_| panic!("no number after {label:?} in {line}"))
}

#[test]
fn dht_example_over_shm_and_tcp() {
    for (transports, n, mapped) in [("auto", 4, 4), ("tcp", 3, 1)] {
        let (code, text) = launch(n, transports);
        assert_eq!(code, Some(0), "{transports}:\n{text}");
        let line = text.lines().find(|l| l.contains("dht: ")).unwrap_or_else(|| panic!("no report:\n{text}"));
        println!("{transports}: {line}");
        assert!(line.contains(&format!("dht: {n} ranks ({mapped} of {n} shards mapped")), "{line}");
        let ops = dht::Options::default().ops * u64::from(n);
        assert!(line.contains(&format!("{ops} operations in")), "{line}");
        assert!(number(line, "s:") > 0.0, "{line}");
        let hit = number(line, "hit rate");
        assert!(hit > 10.0 && hit <= 100.0, "hit rate {hit}: {line}");
        assert!(number(line, "lookups") > 0.0 && number(line, "inserts") > 0.0, "{line}");
        assert_eq!(number(line, "wrong values"), 0.0, "{line}");
    }
}

/// One rank of the example, when run by `ferrorun`.
#[test]
fn dht_rank() {
    if std::env::var_os("FERROCOMM_DHT_RUN").is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let world = ferrocomm::init().await.unwrap();
        if let Some(report) = dht::run(&world, &dht::Options::default()).await.unwrap() {
            println!("{report}");
        }
        world.finalize().await.unwrap();
    });
}
