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

# The portable (laptop) build must keep compiling off Linux: check it for macOS when the target
# can be installed here.
if timeout 180 rustup target add x86_64-apple-darwin >/dev/null 2>&1; then
    cargo check --locked --target x86_64-apple-darwin -p ferrocomm --lib --examples
else
    echo "note: x86_64-apple-darwin target not installable here; skipped the macOS compile check"
fi
