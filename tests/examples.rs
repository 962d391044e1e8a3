//! The examples from the users' world, each run as separate processes under `ferrorun`, its
//! report checked: data-parallel training (examples/training.rs: loss down, trained weights
//! equal to single-process training within the stated tolerance), a parameter server
//! (examples/param_server.rs: every pull and push counted, near the optimum) and publish/subscribe
//! over reliable multicast (examples/pubsub.rs: every subscriber got every message of its topics,
//! in order, none wrong, nothing outside a topic).
//!
//! The ranks are this test binary, re-run by `ferrorun` with `--exact example_rank` and
//! `FERROCOMM_EXAMPLE` naming the example; the examples' code is compiled into it.

mod common;
#[allow(dead_code)]
#[path = "../examples/param_server.rs"]
mod param_server;
#[allow(dead_code)]
#[path = "../examples/pubsub.rs"]
mod pubsub;
#[allow(dead_code)]
#[path = "../examples/training.rs"]
mod training;

use common::Job;

const JOB: Job = Job {
    ferrorun: env!("CARGO_BIN_EXE_ferrorun"),
    rank_test: "example_rank",
    scenario_var: "FERROCOMM_EXAMPLE",
    grace_s: 10,
};

/// The number after `label` in `line`.
fn number(line: &str, label: &str) -> f64 {
    let rest = line.split(label).nth(1).unwrap_or_else(|| panic!("no {label:?} in {line}"));
    let token: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || ".-e".contains(*c)).collect();
    token.parse().unwrap_or_else(|_| panic!("no number after {label:?} in {line}"))
}

/// Runs `example` on `n` ranks over `transport`; its report's lines (rank 0's output from the
/// first line that holds `prefix` on, without the launcher's `[rank]` and the test harness's
/// words before the report).
fn report(example: &str, n: u32, transport: &str, prefix: &str) -> Vec<String> {
    let (code, text, _) = JOB.run(n, example, transport, &[]);
    assert_eq!(code, Some(0), "{example} over {transport}:\n{text}");
    let lines: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("[0] "))
        .skip_while(|l| !l.contains(prefix))
        .map(|l| l[l.find(prefix).unwrap_or(0)..].to_string())
        .collect();
    assert!(!lines.is_empty(), "{example} over {transport}: no report:\n{text}");
    println!("{example} over {transport}:\n{}", lines.join("\n"));
    lines
}

#[test]
fn training_matches_single_process_training() {
    for (n, transport) in [(3, "shm"), (4, "portable")] {
        let line = &report("training", n, transport, "training: ")[0];
        let o = training::Options::default();
        assert!(line.contains(&format!("training: {n} ranks, {} steps of {} samples", o.steps, o.batch)), "{line}");
        let (first, last) = (number(line, "loss"), number(line, "->"));
        assert!(last < first / 4.0, "the loss went from {first} to {last}: {line}");
        let diff = number(line, "max |w - w_single|");
        assert!(diff <= f64::from(training::TOLERANCE), "{diff} > {}: {line}", training::TOLERANCE);
        assert!(line.contains("within tolerance"), "{line}");
    }
}

#[test]
fn parameter_server_serves_every_worker() {
    for (n, transport) in [(4, "shm"), (3, "portable")] {
        let line = &report("param_server", n, transport, "param-server: ")[0];
        let (workers, k) = (u64::from(n) - 1, param_server::Options::default().iterations);
        assert!(line.contains(&format!("1 server, {workers} workers")), "{line}");
        assert_eq!(number(line, "workers,") as u64, workers * k, "pulls: {line}");
        assert_eq!(number(line, "pulls,") as u64, workers * k, "pushes: {line}");
        assert_eq!(number(line, "pushes,") as u64, workers * k, "versions: {line}");
        assert!(line.contains("0 workers with a count other than"), "{line}");
        let distance = number(line, "distance to the optimum");
        assert!(distance <= param_server::TOLERANCE, "{distance}: {line}");
    }
}

#[test]
fn publish_subscribe_over_reliable_multicast() {
    for (n, transport) in [(4, "shm"), (5, "portable")] {
        pubsub_report(n, transport);
    }
}

fn pubsub_report(n: u32, transport: &str) {
    let lines = report("pubsub", n, transport, "pubsub: ");
    let messages = pubsub::Options::default().messages;
    assert!(lines[0].contains(&format!("pubsub: {n} ranks, 3 topics, {messages} messages per topic")), "{lines:?}");
    let topics: Vec<&String> = lines.iter().filter(|l| l.starts_with("topic ")).collect();
    assert_eq!(topics.len(), 3, "{lines:?}");
    for line in topics {
        assert_eq!(number(line, "published") as u32, messages, "{line}");
        let subscribers = number(line, ", ") as u32;
        assert!(subscribers >= 1, "{line}");
        let want = subscribers * messages;
        assert!(line.contains(&format!("received {want} of {want} (0 wrong, 0 outside the topic)")), "{line}");
    }
}

/// One rank of an example, when run by `ferrorun`.
#[test]
fn example_rank() {
    let Ok(example) = std::env::var("FERROCOMM_EXAMPLE") else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let world = ferrocomm::init().await.unwrap();
        let report = match example.as_str() {
            "training" => training::run(&world, &Default::default()).await,
            "param_server" => param_server::run(&world, &Default::default()).await.map_err(|e| panic!("{e}")),
            "pubsub" => pubsub::run(&world, &Default::default()).await,
            other => panic!("no example {other}"),
        };
        if let Some(report) = report.unwrap() {
            println!("{report}");
        }
        world.finalize().await.unwrap();
    });
}
