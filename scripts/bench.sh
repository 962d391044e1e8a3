#!/usr/bin/env bash
# Benchmarks (not part of the tests): installs the peers, builds, runs, writes results/.
# Run it on a quiet machine: the two benchmark CPUs (0 and 1) must not be shared.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v NPtcp >/dev/null || need+=(netpipe-tcp)
command -v NPopenmpi >/dev/null || need+=(netpipe-openmpi)
command -v mpirun.openmpi >/dev/null || need+=(openmpi-bin)
command -v NPmpich2 >/dev/null || need+=(netpipe-mpich2)
command -v mpirun.mpich >/dev/null || need+=(mpich)
if ((${#need[@]})); then
    apt-get update -qq && apt-get install -y -o DPkg::Lock::Timeout=900 "${need[@]}"
fi
cargo build --release -p ferrocomm-bench
bench="${CARGO_TARGET_DIR:-target}/release/ferrocomm-bench"
mkdir -p results
# Shared memory against Open MPI and MPICH (plus reference lines, the transport alone, idle peer).
"$bench" pingpong --transport shm --runs 3 --recv-into \
    --json results/pingpong-shm.json --plot results/pingpong-shm.svg
for backend in uring portable; do
    "$bench" pingpong --backend "$backend" --runs 3 --recv-into \
        --json "results/pingpong-tcp-$backend.json" --plot "results/pingpong-tcp-$backend.svg"
done
