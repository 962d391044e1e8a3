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
if ! command -v mpicc.openmpi >/dev/null || ! command -v mpicc.mpich >/dev/null \
    || ! [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ]; then
    apt-get update -qq && apt-get install -y -o DPkg::Lock::Timeout=900 openmpi-bin libopenmpi-dev mpich libmpich-dev
fi
cargo build --release -p ferrocomm-bench
bench="${CARGO_TARGET_DIR:-target}/release/ferrocomm-bench"
mkdir -p results
# Shared memory against Open MPI and MPICH (plus reference lines, the transport alone, idle peer).
"$bench" pingpong --transport shm --runs 3 --recv-into \
    --json results/pingpong-shm.json --plot results/pingpong-shm.svg
# 8 B over shared memory, ten alternations with the peers, compared within each phase of the host.
"$bench" pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 \
    --idle-gap 0 --json results/pingpong-shm-8B.json
python3 scripts/shm-8B-phases.py results/pingpong-shm-8B.json
for backend in uring portable; do
    "$bench" pingpong --backend "$backend" --runs 3 --recv-into \
        --json "results/pingpong-tcp-$backend.json" --plot "results/pingpong-tcp-$backend.svg"
done
# Collectives against Open MPI and MPICH (benches/mpi/osu_coll.c, built under target/). MPICH on 4
# ranks over 2 CPUs takes milliseconds per call, hence fewer iterations there.
ops=barrier,bcast,allreduce,allgather,alltoall,sendrecv
target/release/ferrocomm-bench collectives --ranks 2 --runs 9 --ops "$ops" --json results/collectives-2ranks.json
target/release/ferrocomm-bench collectives --ranks 4 --runs 3 --iters 100 --warmup 20 --iters-large 20 \
    --warmup-large 5 --ops "$ops" --json results/collectives-4ranks.json
