#!/usr/bin/env bash
# The test command: everything a fresh machine needs, then formatting, lints and the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
    echo "cargo is required (rustup: https://rustup.rs)" >&2
    exit 1
fi
# Nothing beyond the Rust toolchain is needed by the tests: TCP on loopback, io_uring in the
# kernel (the io_uring tests need io_uring_disabled=0, as on Linux by default).
rustup component add rustfmt clippy >/dev/null 2>&1 || true

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --all-targets --locked
cargo test --workspace --doc --locked
