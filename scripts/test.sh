#!/usr/bin/env bash
# The test command: everything a fresh machine needs, then formatting, lints and the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
    echo "cargo is required (rustup: https://rustup.rs)" >&2
    exit 1
fi
# Beyond the Rust toolchain: TCP on loopback, io_uring in the kernel (the io_uring tests need
# io_uring_disabled=0, as on Linux by default), and for the multicast tests ip (iproute2) and
# iptables, multicast on the loopback interface, and root (network namespaces, iptables). Without
# root those tests say loudly that they were skipped. The verbs tests below install their own
# (apt, pip) and run in a VM.
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# timed NAME COMMAND...: runs a step and prints how long it took (CI has 45 minutes for all).
t_all=$(date +%s)
timed() {
    local name=$1 t rc=0
    t=$(date +%s)
    shift
    "$@" || rc=$?
    echo "test.sh: $name took $(($(date +%s) - t)) s ($(($(date +%s) - t_all)) s since the start)"
    return $rc
}
if [ "$(id -u)" = 0 ] && [ "$(uname -s)" = Linux ]; then
    missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v iptables >/dev/null || missing+=(iptables)
    if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
        echo "installing ${missing[*]} for the multicast tests"
        apt-get update -o DPkg::Lock::Timeout=900 >/dev/null || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=900 "${missing[@]}" >/dev/null
    fi
    ip link set lo multicast on || echo "warning: cannot enable multicast on lo; the loopback multicast tests use the point-to-point fallback"
else
    echo "NOTE: not root: the multi-process multicast tests (network namespaces, iptables) will be SKIPPED"
fi

# Real launchers (tests/real_launchers.rs): Open MPI's mpirun, MPICH's Hydra mpiexec and a
# one-node Slurm (munged, slurmctld, slurmd), installed and started idempotently; prints how long
# the bring-up took. It exits 77 without root or apt-get, and those tests then say they SKIPPED;
# any other failure fails those tests (they run the script again), not the rest of the suite.
timed launchers bash scripts/slurm-local.sh || echo "scripts/slurm-local.sh exited with $?: see tests/real_launchers.rs"

# Rails and proxy routes (tests/rails.rs, docs/routes.md): two and three network namespaces joined
# by veth pairs, rate-limited with tc tbf (tc comes with iproute2, installed above); root only, like
# the multicast tests (they skip loudly otherwise); about a minute once built. The tbf qdisc must be
# in the kernel. `cargo test --workspace` below runs them with the rest.
if [ "$(id -u)" = 0 ] && [ "$(uname -s)" = Linux ]; then
    modprobe sch_tbf 2>/dev/null || true
fi

# Several hosts (tests/multihost.rs): 3 network namespaces on a bridge, each a host with its own
# address and host name (ip netns + unshare --uts), 2 ranks each, the same job under ferrorun,
# mpirun, mpiexec and srun (the launchers come from slurm-local.sh above); then the link cut
# between such hosts (tests/faults.rs). Root only (the tests skip loudly otherwise); about a
# minute once built. `cargo test --workspace` below runs them with the rest.
if [ "$(id -u)" = 0 ] && [ "$(uname -s)" = Linux ]; then
    if ! command -v unshare >/dev/null || ! command -v ip >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=900 util-linux iproute2 >/dev/null
    fi
fi

# The facade's top-level modules import one another without a circle (docs/architecture.md).
python3 scripts/import-circles.py >/dev/null
cargo fmt --all -- --check
timed clippy cargo clippy --workspace --all-targets --locked -- -D warnings
timed suite cargo test --workspace --all-targets --locked
cargo test --workspace --doc --locked
# The API documentation builds without a broken or private link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

# The user's-build crate (benches/userbuild, outside the workspace; bench.sh builds it with
# --locked) keeps a lock file that matches the workspace's dependencies.
cargo metadata --locked --format-version 1 --manifest-path benches/userbuild/Cargo.toml >/dev/null

# The library crates package as for publishing (versioned path dependencies, metadata), and each
# one builds alone from its package, with only the tokio features it names (a few minutes). The
# bench and the simulator are not published (publish = false). Cargo takes a package of a given
# version as never changing (its unpacked copy, its build), so each run starts from nothing: a
# target directory of its own, and no copy left by an earlier run.
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/ferrocomm-* target/package-check
CARGO_TARGET_DIR=target/package-check \
    timed package cargo package --workspace --exclude ferrocomm-bench --exclude ferrocomm-sim --locked --allow-dirty
rm -rf target/package-check

# Coverage-guided fuzzing, the CI smoke (docs/fuzzing.md): every fuzz target builds and runs
# FUZZ_SECONDS (default 10) without a crash. Installs the nightly toolchain and cargo-fuzz if
# missing. About 4 minutes on 2 cores: the sanitizer build, then 10 targets x 10 s.
timed fuzz bash scripts/fuzz.sh

# The verbs transport (cargo feature `verbs`, off by default): its tests need an RDMA device, so
# they run over Soft-RoCE inside a VM (installs what it needs; skips with a message only if no VM
# can boot here). Then the lints with the feature, whose system libraries the VM script installed,
# and the transport's unit tests that need no device (descriptor parsing).
timed verbs-vm bash scripts/verbs-vm.sh
cargo clippy --workspace --all-targets --locked --features verbs -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --features verbs
# (The packages and features of the VM's build above, so that its crates are reused.)
cargo test --locked -p ferrocomm-transports -p ferrorun --features ferrocomm-transports/verbs,ferrorun/verbs --lib

# The portable (laptop) build must keep compiling off Linux: check it for macOS when the target
# can be installed here.
if timeout 180 rustup target add x86_64-apple-darwin >/dev/null 2>&1; then
    cargo check --locked --target x86_64-apple-darwin -p ferrocomm --lib --examples
else
    echo "note: x86_64-apple-darwin target not installable here; skipped the macOS compile check"
fi
echo "test.sh: all passed in $(($(date +%s) - t_all)) s"
