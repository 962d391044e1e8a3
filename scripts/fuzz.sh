#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of every decoder and sans-IO core: see
# docs/fuzzing.md. Builds every target, then runs each (or only those named) for FUZZ_SECONDS
# (default 10: the CI smoke), and fails on the first crash, leaving the input that caused it in
# fuzz/artifacts/<target>/. Longer runs on demand: `FUZZ_SECONDS=600 scripts/fuzz.sh [target...]`.
# What a run learns is kept in fuzz/corpus/<target>/ (not committed) and feeds the next run.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-10}
# cargo-fuzz needs a nightly compiler (sanitizers, libFuzzer's instrumentation).
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "installing the nightly toolchain for cargo-fuzz"
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz"
    # A debug build: it only drives cargo, and builds in about half the CPU time (73 s against 127 s).
    cargo install cargo-fuzz --locked --debug
fi

if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
echo "fuzz: building ${#targets[@]} target(s)"
if [ $# -gt 0 ]; then
    for t in "${targets[@]}"; do cargo +nightly fuzz build "$t"; done
else
    cargo +nightly fuzz build
fi
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    echo "fuzz: $t for ${seconds}s"
    log=$(mktemp)
    # -timeout: one input running this long is a hang; -rss_limit_mb: memory a peer must not make us use.
    if ! cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log"
        rm -f "$log"
        echo "fuzz: $t FAILED; the input is in fuzz/artifacts/$t/ (replay: cargo +nightly fuzz run $t <file>)" >&2
        exit 1
    fi
    grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" | tr '\n' ' '
    echo
    rm -f "$log"
done
echo "fuzz: ${#targets[@]} target(s) ran ${seconds}s each without a crash"
