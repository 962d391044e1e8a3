#!/usr/bin/env bash
# Benchmarks (not part of the tests): installs the peers, builds, runs, and writes results/.
#
#   bash scripts/bench.sh [shm] [tcp] [collectives] [multicast] [verbs]    (default: all five)
#
# Each benchmark writes results/NAME.json (every run's figures), results/NAME.txt (the printed
# table and summary) and results/NAME.svg (latency, for ping-pong also throughput, against size).
# docs/benchmarks.md describes the method and the files. Run it on a quiet machine: the two
# benchmark CPUs (0 and 1) must not be shared.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
((${#parts[@]})) || parts=(shm tcp collectives multicast verbs)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
for p in "${parts[@]}"; do
    case "$p" in shm | tcp | collectives | multicast | verbs) ;;
        *) echo "usage: $0 [shm] [tcp] [collectives] [multicast] [verbs]" >&2; exit 2 ;;
    esac
done

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

if want shm; then
    # Shared memory against Open MPI and MPICH (NPopenmpi, NPmpich2), 1 B to 4 MiB, with the
    # reference lines, the transport alone and the latency to an idle peer.
    "$bench" pingpong --transport shm --progress busy --runs 3 --recv-into --max 4M \
        --json results/pingpong-shm.json --plot results/pingpong-shm.svg | tee results/pingpong-shm.txt
    # 8 B only, ten alternations of 100 ms batches: the per-run figures let each run be compared
    # with the peers' runs in the same phase of the host (docs/benchmarks.md).
    "$bench" pingpong --transport shm --progress busy --runs 10 --recv-into --send-from --max 8 \
        --target-ms 100 --idle-gap 0 --json results/pingpong-shm-8B.json | tee results/pingpong-shm-8B.txt
fi

if want tcp; then
    # TCP on loopback against NPtcp, each backend.
    for backend in uring portable; do
        "$bench" pingpong --backend "$backend" --runs 3 --recv-into \
            --json "results/pingpong-tcp-$backend.json" --plot "results/pingpong-tcp-$backend.svg" \
            | tee "results/pingpong-tcp-$backend.txt"
    done
fi

if want collectives; then
    # Collectives against Open MPI and MPICH (benches/mpi/osu_coll.c, built under target/). MPICH
    # on 4 ranks over 2 CPUs takes milliseconds per call, hence fewer iterations there.
    ops=barrier,bcast,reduce,allreduce,allgather,alltoall,sendrecv
    "$bench" collectives --ranks 2 --runs 5 --ops "$ops" \
        --json results/collectives-2ranks.json --plot results/collectives-2ranks.svg | tee results/collectives-2ranks.txt
    "$bench" collectives --ranks 4 --runs 3 --iters 100 --warmup 20 --iters-large 20 --warmup-large 5 \
        --ops "$ops" --json results/collectives-4ranks.json --plot results/collectives-4ranks.svg \
        | tee results/collectives-4ranks.txt
fi

if want multicast; then
    # Reliable multicast on loopback against a binomial tree, point-to-point over shared memory
    # and over TCP.
    ip link set lo multicast on 2>/dev/null || echo "note: cannot enable multicast on lo (not root?)"
    "$bench" multicast --json results/multicast-shm.json --plot results/multicast-shm.svg \
        | tee results/multicast-shm.txt
    "$bench" multicast --transports tcp --json results/multicast-tcp.json --plot results/multicast-tcp.svg \
        | tee results/multicast-tcp.txt
fi

if want verbs; then
    # Verbs over Soft-RoCE in a VM against ib_send_lat / ib_write_bw: writes
    # results/pingpong-verbs-{busy,blocking,busy-srq}.{json,svg,txt} and verbs-transport.{json,txt}.
    bash scripts/verbs-vm.sh bench
fi
