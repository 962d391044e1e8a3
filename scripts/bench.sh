#!/usr/bin/env bash
# Benchmarks (not part of the tests): installs the peers, builds, runs, and writes results/.
#
#   bash scripts/bench.sh [shm] [tcp] [collectives] [multicast] [rma] [hosts] [rails] [sim] [verbs]
#
# Default: all but verbs (verbs boots a VM: ask for it by name; rails needs root for its network
# namespaces). Each benchmark
# writes results/NAME.json (every slice's figures), results/NAME.txt (the printed table and
# summary) and results/NAME.svg (latency, for ping-pong also throughput, against size).
# docs/benchmarks.md describes the method (interleaved slices, medians of per-slice ratios with
# their min-max) and the files. Run it on a quiet machine: the two benchmark CPUs (0 and 1) must
# not be shared.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
((${#parts[@]})) || parts=(shm tcp collectives multicast rma hosts rails sim)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
for p in "${parts[@]}"; do
    case "$p" in shm | tcp | collectives | multicast | rma | hosts | rails | sim | verbs) ;;
        *) echo "usage: $0 [shm] [tcp] [collectives] [multicast] [rma] [hosts] [rails] [sim] [verbs]" >&2; exit 2 ;;
    esac
done

need=()
command -v NPtcp >/dev/null || need+=(netpipe-tcp)
command -v NPopenmpi >/dev/null || need+=(netpipe-openmpi)
command -v mpirun.openmpi >/dev/null || need+=(openmpi-bin)
command -v NPmpich2 >/dev/null || need+=(netpipe-mpich2)
command -v mpirun.mpich >/dev/null || need+=(mpich)
command -v mpicc.openmpi >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || need+=(libopenmpi-dev)
command -v mpicc.mpich >/dev/null || need+=(libmpich-dev)
if ((${#need[@]})); then
    apt-get update -qq && apt-get install -y -o DPkg::Lock::Timeout=900 "${need[@]}"
fi
# The release profile plus the inline threshold (.cargo/config.toml's alias).
cargo build-tuned -p ferrocomm-bench
bench="${CARGO_TARGET_DIR:-target}/release/ferrocomm-bench"
mkdir -p results
start=$SECONDS
took() { echo "bench.sh: $1 done, $((SECONDS - start)) s since the build" >&2; }

if want shm; then
    # Shared memory against Open MPI and MPICH (NPopenmpi, NPmpich2), 1 B to 4 MiB, three
    # interleaved slices per side at every size, with the reference lines, the transport alone
    # and the latency to an idle peer.
    "$bench" pingpong --transport shm --progress busy --runs 3 --recv-into --max 4M \
        --json results/pingpong-shm.json --plot results/pingpong-shm.svg | tee results/pingpong-shm.txt
    # The user's build: the same 8 B / 64 KiB ping-pong built by a crate outside the workspace with
    # Cargo's default release profile (built from outside the repository, so that its
    # .cargo/config.toml does not apply) and as the bench's `userbuild-pingpong`, alternated.
    repo=$PWD tdir=$(realpath "${CARGO_TARGET_DIR:-target}")
    (cd / && cargo build --release --locked --manifest-path "$repo/benches/userbuild/Cargo.toml" \
        --target-dir "$tdir/userbuild")
    for run in 1 2 3; do
        "$tdir/release/userbuild-pingpong" "run $run, ferrocomm's build"
        "$tdir/userbuild/release/ferrocomm-userbuild" "run $run, user's build"
    done | tee results/userbuild.txt
    took shm
fi

if want tcp; then
    # TCP on loopback, each backend, against NPtcp and Open MPI's TCP BTL
    # (benches/mpi/mpi_pingpong.c), 1 B to 4 MiB, three interleaved slices per side.
    for backend in uring portable; do
        "$bench" pingpong --backend "$backend" --runs 3 --recv-into --max 4M \
            --json "results/pingpong-tcp-$backend.json" --plot "results/pingpong-tcp-$backend.svg" \
            | tee "results/pingpong-tcp-$backend.txt"
    done
    took tcp
fi

if want collectives; then
    # Every collective against Open MPI (benches/mpi/osu_coll.c, built under target/), 8 B to
    # 4 MiB, one operation per slice, three slices per side. Fewer iterations on 4 ranks, which
    # share the 2 CPUs.
    ops=barrier,bcast,reduce,allreduce,gather,scatter,allgather,alltoall,reduce_scatter,scan
    "$bench" collectives --ranks 2 --runs 3 --mpi openmpi --ops "$ops" --max 4M \
        --json results/collectives-2ranks.json --plot results/collectives-2ranks.svg | tee results/collectives-2ranks.txt
    "$bench" collectives --ranks 4 --runs 3 --mpi openmpi --iters 100 --warmup 20 --iters-large 20 --warmup-large 5 \
        --ops "$ops" --max 4M --json results/collectives-4ranks.json --plot results/collectives-4ranks.svg \
        | tee results/collectives-4ranks.txt
    took collectives
fi

if want multicast; then
    # Reliable multicast on loopback against a binomial tree, point-to-point over shared memory
    # and over TCP.
    ip link set lo multicast on 2>/dev/null || echo "note: cannot enable multicast on lo (not root?)"
    "$bench" multicast --json results/multicast-shm.json --plot results/multicast-shm.svg \
        | tee results/multicast-shm.txt
    "$bench" multicast --transports tcp | tee results/multicast-tcp.txt
    # The stream between namespace hosts (one per rank, on a bridge; needs root), appended.
    "$bench" multicast --stream-only --netns --datagram 8900 | tee -a results/multicast-tcp.txt \
        || echo "note: multicast between namespace hosts not measured (root needed)" | tee -a results/multicast-tcp.txt
    took multicast
fi

if want rma; then
    # One-sided put/get/fetch-add against ucx_perftest over shared memory (segments mapped by the
    # peer), and over TCP (served by the target's progress; no peer runs over TCP).
    "$bench" rma --json results/rma-shm.json | tee results/rma-shm.txt
    "$bench" rma --transports tcp --no-peer | tee results/rma-tcp.txt
    took rma
fi

if want hosts; then
    # TCP-only collectives (each rank its own host as far as ferrocomm knows) against Open MPI's
    # TCP BTL on the same CPUs.
    "$bench" hosts --runs 9 | tee results/hosts.txt
    took hosts
fi

if want rails; then
    # Striping over two rate-limited veth rails and routes through a proxy (network namespaces:
    # root only).
    if [ "$(id -u)" = 0 ]; then
        modprobe sch_tbf 2>/dev/null || true
        "$bench" rails | tee results/rails.txt
    else
        echo "note: rails needs root (network namespaces): skipped" >&2
    fi
    took rails
fi

if want sim; then
    # The simulated network: each collective's virtual time at 64 to 4,096 ranks beside its
    # algorithm's alpha-beta model, and where multicast overtakes a binomial tree.
    "$bench" sim-scale --json results/sim-scale.json --text results/sim-scale.txt
    took sim
fi

if want verbs; then
    # Verbs over Soft-RoCE in a VM against ib_send_lat / ib_write_bw: writes
    # results/pingpong-verbs-busy.{json,svg,txt}, rma-verbs.txt, multicast-verbs.{txt,json},
    # collectives-rdma.txt (RDMA all-gather/all-to-all vs the point-to-point algorithms), ud-vs-rc.txt.
    bash scripts/verbs-vm.sh bench
fi
