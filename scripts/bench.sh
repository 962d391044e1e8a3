#!/usr/bin/env bash
# Benchmarks (not part of the tests): installs the peers, builds, runs, writes results/.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v NPtcp >/dev/null; then
    apt-get update -qq && apt-get install -y -o DPkg::Lock::Timeout=900 netpipe-tcp
fi
cargo build --release -p ferrocomm-bench
mkdir -p results
for backend in uring portable; do
    target/release/ferrocomm-bench pingpong --backend "$backend" --runs 3 --recv-into \
        --json "results/pingpong-tcp-$backend.json" --plot "results/pingpong-tcp-$backend.svg"
done
