#!/usr/bin/env bash
# Builds the bench binary with profile-guided optimisation (PGO) and prints the 8 B shared-memory
# ping-pong of the plain release build and of the PGO build, alternated, so that the two can be
# compared in the same host phase. An experiment of session 22 (docs/performance-history.md), not
# part of the test or bench runs: it shows what an application built with PGO would get.
#
#   bash scripts/pgo-bench.sh [ROUNDS]
#
# Needs the `llvm-tools` rustup component (installed here if missing) for `llvm-profdata`.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-6}
work=target/pgo
rm -rf "$work/profiles"
mkdir -p "$work/profiles"
rustup component add llvm-tools >/dev/null 2>&1 || true
profdata=$(find "$(rustc --print sysroot)" -name llvm-profdata -type f | head -1)
[ -x "$profdata" ] || { echo "llvm-profdata not found (rustup component add llvm-tools)"; exit 1; }
cargo build --release --locked -p ferrocomm-bench
# `RUSTFLAGS` replaces the workspace's .cargo/config.toml flags: repeat them.
base=$(sed -n 's/^rustflags = \["\(.*\)"\]$/\1/p' .cargo/config.toml)
RUSTFLAGS="$base -Cprofile-generate=$PWD/$work/profiles" CARGO_TARGET_DIR=$work/gen \
    cargo build --release --locked -p ferrocomm-bench
# The training run: the ping-pong the comparison measures.
"$work/gen/release/ferrocomm-bench" pingpong --transport shm --progress busy --runs 1 --recv-into \
    --send-from --max 8 --no-peer --idle-gap 0 --target-ms 300 >/dev/null 2>&1
"$profdata" merge -o "$work/merged.profdata" "$work"/profiles/*.profraw
RUSTFLAGS="$base -Cprofile-use=$PWD/$work/merged.profdata" CARGO_TARGET_DIR=$work/use \
    cargo build --release --locked -p ferrocomm-bench
OUT=$work/alternate.last bash scripts/shm-8B-alternate.sh "$rounds" \
    target/release/ferrocomm-bench "$work/use/release/ferrocomm-bench"
