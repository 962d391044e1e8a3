#!/usr/bin/env bash
# The verbs transport on a real verbs stack: Soft-RoCE (rdma_rxe) in a VM booted with virtme-ng
# on this host's own file system (no RDMA device is needed on the host).
#
#   scripts/verbs-vm.sh          tests: the device tests (eager over rings and over a shared
#                                receive queue, credits, sleep, both rendezvous protocols, a
#                                freed buffer never read through a stale registration, peer
#                                loss) and the point-to-point suite with 2 and 4 ranks as
#                                processes (each eager path; rendezvous in all three orders, by
#                                RDMA write and by RDMA read) plus a rank killed mid-transfer;
#                                the one-sided suite over verbs (2 and 4 ranks as processes:
#                                RDMA write, read and atomics; a target killed); reliable
#                                multicast over a UD multicast group with 3 and 4 ranks as
#                                processes (loss injected in the UD receive path, a member
#                                killed mid-window); all-gather and all-to-all by RDMA writes
#                                (2 to 4 ranks as processes, against the sequential reference)
#   scripts/verbs-vm.sh bench    ferrocomm verbs ping-pong and streaming bandwidth vs
#                                ib_send_lat / ib_write_bw on rxe0, the transport alone, and
#                                one-sided put/get/fetch-add latency vs ib_write_lat,
#                                ib_read_lat, ib_atomic_lat (ratios; results/rma-verbs.*);
#                                JSON, SVG and the printed output (.txt) into results/. For
#                                shorter runs while tuning:
#                                VERBS_BENCH_MODES (default "busy"; also "blocking", "busy-srq": progress
#                                mode, -srq for eager slots through the shared receive queue) and
#                                VERBS_BENCH_ARGS (default "--runs 3 --max 4M --target-ms 300"),
#                                VERBS_RMA_RUNS (default 5: rma-verbs --runs).
#                                Also: reliable multicast over UD vs binomial broadcast over RC
#                                at 4 ranks, 8 B to 1 MiB, with the stream's NACKs at the
#                                default UD receive pool and at a 256-buffer one
#                                (results/multicast-verbs.{txt,json}); RDMA all-gather and
#                                all-to-all vs the point-to-point algorithms, 2 and 4 ranks
#                                (results/collectives-rdma.txt); the UD vs RC resources per rank
#                                (results/ud-vs-rc.txt)
#   VERBS_ONLY="step ..."        runs only these steps (names as reported), in either mode
#
# Installs what it needs (idempotent: apt, pip), builds on the host with `--features verbs`,
# boots the VM, brings up rxe0 on a dummy interface, runs, and reports pass/fail and timings.
# Exits non-zero on any failure. Skips (exit 0, with a message saying so) only when the VM cannot
# boot at all. Honors CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${1:-test}
case "$MODE" in test | bench) ;; *) echo "usage: $0 [test|bench]" >&2; exit 2 ;; esac
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
MEM=${FERROCOMM_VM_MEMORY:-3G}
t_start=$(date +%s)

skip() {
    echo "verbs-vm: SKIPPED: $*" >&2
    echo "verbs-vm: the verbs transport was NOT tested on this machine" >&2
    exit 0
}

# --- what the host needs -------------------------------------------------------------------
missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
command -v ibv_devices >/dev/null || missing+=(ibverbs-utils)
command -v ib_send_lat >/dev/null || missing+=(perftest)
command -v cmake >/dev/null || missing+=(cmake)
command -v busybox >/dev/null || missing+=(busybox-static)
command -v jq >/dev/null || missing+=(jq)
[ -e /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)
ls /usr/lib/*/libibverbs/librxe-rdmav*.so >/dev/null 2>&1 || missing+=(rdma-core)
# bindgen loads libclang itself (libclang-dev's libclang.so; libclang-cpp, which other packages
# bring, is not it).
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || missing+=(libclang-dev)
ls /boot/vmlinuz-* >/dev/null 2>&1 || missing+=(linux-image-amd64)
if [ ${#missing[@]} -gt 0 ]; then
    echo "verbs-vm: installing ${missing[*]}"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=900 "${missing[@]}" >/dev/null; }; then
        # Without these the test binaries cannot even be built: that is a failure, unless it is
        # the VM side (kernel, qemu) that is missing, which means no VM can boot here.
        for p in "${missing[@]}"; do
            case $p in qemu-system-x86 | linux-image-amd64 | busybox-static) skip "cannot install $p (needed to boot the VM)" ;; esac
        done
        echo "verbs-vm: FAILED to install ${missing[*]}" >&2
        exit 1
    fi
fi
if ! command -v vng >/dev/null; then
    echo "verbs-vm: installing virtme-ng"
    pip install -q virtme-ng 2>/dev/null || pip install -q --break-system-packages virtme-ng || skip "cannot install virtme-ng"
fi
KERNEL=$(ls /boot/vmlinuz-* | sort -V | tail -1)

# --- build on the host -----------------------------------------------------------------------
echo "verbs-vm: building with --features verbs (target dir $TARGET)"
t0=$(date +%s)
if [ "$MODE" = test ]; then
    # wants STEP...: whether VERBS_ONLY selects one of these steps (all of them without it).
    wants() { [ -z "${VERBS_ONLY:-}" ] && return 0; for w in "$@"; do case " $VERBS_ONLY " in *" $w "*) return 0 ;; esac; done; return 1; }
    # The test executables the chosen steps run, built by one cargo invocation (one per
    # executable would build the crates once per feature set): variable, then test target.
    need=()
    ! wants device-tests || need+=(DEVICE_TESTS verbs)
    ! wants p2p-suite-2-and-4-ranks killed-rank || need+=(SUITE multiprocess)
    ! wants fault-matrix || need+=(FAULTS faults)
    ! wants one-sided-suite rdma-collectives || need+=(RMA_SUITE rma_multiprocess)
    # Reliable multicast over a UD multicast group (processes under ferrorun, injected loss).
    ! wants multicast-ud-loss multicast-ud-kill || need+=(MCAST_UD multicast_ud)
    ! wants ud-group || need+=(UD_GROUP verbs_ud)
    if [ ${#need[@]} -gt 0 ]; then
        build=(cargo test --locked -p ferrocomm-transports -p ferrorun
            --features ferrocomm-transports/verbs,ferrorun/verbs --no-run)
        for ((i = 1; i < ${#need[@]}; i += 2)); do build+=(--test "${need[i]}"); done
        "${build[@]}"
        artifacts=$("${build[@]}" --message-format=json 2>/dev/null)
        for ((i = 0; i < ${#need[@]}; i += 2)); do
            exe=$(jq -r --arg t "${need[i + 1]}" \
                'select(.reason == "compiler-artifact" and .profile.test and .target.name == $t) | .executable' <<<"$artifacts" | tail -1)
            [ -x "$exe" ] || { echo "verbs-vm: FAILED: test executable ${need[i + 1]} not found" >&2; exit 1; }
            printf -v "${need[i]}" '%s' "$exe"
        done
    fi
else
    cargo build-tuned --locked -p ferrocomm-bench --features verbs
    BENCH=$TARGET/release/ferrocomm-bench
fi
echo "verbs-vm: build $(($(date +%s) - t0)) s"

# --- the run inside the VM -------------------------------------------------------------------
OUT=$(mktemp -d "${TMPDIR:-/tmp}/ferrocomm-verbs-vm.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
cat >"$OUT/inner.sh" <<EOF
#!/bin/bash
# Runs inside the VM; results go to $OUT (shared read-write with the host).
echo booted >"$OUT/booted"
cd "$ROOT"
step() { # name command... : runs, logs, records "name rc seconds"
    local name=\$1; shift
    case " ${VERBS_ONLY:-\$name} soft-roce " in *" \$name "*) ;; *) return 0 ;; esac
    local t0=\$(date +%s%N)
    "\$@" >"$OUT/\$name.log" 2>&1
    local rc=\$?
    echo "\$name \$rc \$(( (\$(date +%s%N) - t0) / 1000000 ))" >>"$OUT/steps"
}
setup() {
    modprobe rdma_rxe &&
    ip link set lo up &&
    ip link add dummy0 type dummy && ip addr add 192.168.77.1/24 dev dummy0 && ip link set dummy0 up &&
    rdma link add rxe0 type rxe netdev dummy0 &&
    ibv_devices && ibv_devinfo -d rxe0
}
step soft-roce setup
if grep -q '^soft-roce 0 ' "$OUT/steps"; then
    export FERROCOMM_REQUIRE_VERBS=1 RUST_BACKTRACE=1
    if [ "$MODE" = test ]; then
        step device-tests timeout 600 "${DEVICE_TESTS:-}" --test-threads=1 --nocapture
        step p2p-suite-2-and-4-ranks timeout 1200 "${SUITE:-}" --exact suite_over_verbs --test-threads=1 --nocapture
        step killed-rank timeout 600 "${SUITE:-}" --exact killed_rank_over_verbs --test-threads=1 --nocapture
        # The fault matrix's kill cases over verbs (tests/faults.rs kill_matrix_verbs).
        step fault-matrix timeout 1200 "${FAULTS:-}" --exact kill_matrix_verbs --test-threads=1 --nocapture
        step one-sided-suite timeout 1200 "${RMA_SUITE:-}" --exact rma_suite_over_verbs --test-threads=1 --nocapture
        step ud-group timeout 300 "${UD_GROUP:-}" --test-threads=1 --nocapture
        step multicast-ud-loss timeout 1800 "${MCAST_UD:-}" --exact exactly_once_in_order_over_ud_with_loss --nocapture
        step multicast-ud-kill timeout 900 "${MCAST_UD:-}" --exact member_killed_mid_window_over_ud --nocapture
        step rdma-collectives timeout 1200 "${RMA_SUITE:-}" --exact rdma_collectives_over_verbs --test-threads=1 --nocapture
    else
        # How busy the VM is before the bench (anything left spinning skews every figure).
        { uptime; top -bn1 | head -15; } >"$OUT/vm-load.txt" 2>&1
        # The transport alone, each eager path: what the layers above it cost, by difference.
        step verbs-transport timeout 600 "${BENCH:-}" verbs-transport --json "$OUT/verbs-transport.json"
        # One-sided latency against perftest's RDMA write, read and atomic latency.
        step rma-verbs timeout 1200 "${BENCH:-}" rma-verbs --runs ${VERBS_RMA_RUNS:-5} --json "$OUT/rma-verbs.json"
        for p in ${VERBS_BENCH_MODES:-busy}; do
            # MODE[-srq]: progress mode, eager slots through the shared receive queue with -srq.
            progress=\${p%-srq}; eager=ring; [ "\$progress" = "\$p" ] || eager=srq
            step pingpong-\$p env FERROCOMM_VERBS_EAGER=\$eager timeout 1800 "${BENCH:-}" pingpong --transport verbs \\
                --progress \$progress --recv-into ${VERBS_BENCH_ARGS:---runs 3 --max 4M --target-ms 300} \\
                --json "$OUT/pingpong-verbs-\$p.json" --plot "$OUT/pingpong-verbs-\$p.svg"
        done
        # Reliable multicast over UD vs binomial broadcast over RC, 4 ranks; the stream's NACKs.
        # The group test takes longer than its 2 s default in an emulated VM (as in multicast_ud).
        step multicast-verbs env FERROCOMM_MCAST_CONFIRM_MS=30000 timeout 1800 "${BENCH:-}" multicast --ranks 4 --transports verbs --max 1M \
            --stream ${VERBS_MCAST_STREAM:-4000} --stream-runs 1 --json "$OUT/multicast-verbs.json"
        # The same stream with the UD receive pool at 256 buffers (the pool a 60 KB datagram
        # setting bought when it was counted in configured datagrams), and the kernel's and
        # the device's drop counters around it.
        step multicast-verbs-pool256 sh -c 'cat /proc/net/softnet_stat; rdma statistic show || true; \
            FERROCOMM_MCAST_CONFIRM_MS=30000 FERROCOMM_MCAST_BUFFER=\$((256 * (1024 + 40))) timeout 1800 "${BENCH:-}" multicast --ranks 4 --transports verbs \
            --stream ${VERBS_MCAST_STREAM:-4000} --stream-runs 1 --stream-only; rc=\$?; cat /proc/net/softnet_stat; rdma statistic show; exit \$rc'
        # RDMA all-gather and all-to-all against the point-to-point algorithms, each pinned.
        step collectives-rdma timeout 2400 "${BENCH:-}" collectives --sweep --no-mpi --ranks 2,4 --ops allgather,alltoall \
            --max 1M --step 8 --runs 1 --iters 100 --warmup 10 --iters-large 10 --warmup-large 2 --progress blocking --env FERROCOMM_TRANSPORTS=verbs \
            --json "$OUT/collectives-rdma.json" --plot "$OUT/collectives-rdma.svg"
        # UD vs RC: queue pairs and registered memory per rank, measured and modelled.
        step ud-vs-rc env FERROCOMM_MCAST_CONFIRM_MS=30000 timeout 600 "${BENCH:-}" ud-vs-rc --ranks 2,3,4
    fi
fi
echo done >"$OUT/done"
EOF
chmod +x "$OUT/inner.sh"

accel=(--disable-kvm)
if [ -w /dev/kvm ] && timeout 60 vng --run "$KERNEL" --user root --memory 512M --exec true >/dev/null 2>&1; then
    accel=()
fi
echo "verbs-vm: booting $KERNEL (${accel[*]:-KVM}), $MEM, 2 CPUs"
t0=$(date +%s)
timeout 3600 vng --run "$KERNEL" "${accel[@]}" --user root --memory "$MEM" --cpus 2 --rwdir "$OUT" \
    --exec "$OUT/inner.sh" >"$OUT/console.log" 2>&1 || true
vm_time=$(($(date +%s) - t0))
[ -e "$OUT/booted" ] || { tail -20 "$OUT/console.log" >&2; skip "the VM did not boot (see the console output above)"; }

# --- report ----------------------------------------------------------------------------------
status=0
echo "verbs-vm: VM $vm_time s in all"
while read -r name rc ms; do
    secs=$(printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)))
    if [ "$rc" = 0 ]; then
        printf 'verbs-vm:   PASS %-28s %6s s\n' "$name" "$secs"
    else
        printf 'verbs-vm:   FAIL %-28s %6s s (exit %s)\n' "$name" "$secs" "$rc"
        # The panics first (a backtrace alone can fill the tail), then the end of the log.
        grep -m 8 -A 4 'panicked at' "$OUT/$name.log" | sed 's/^/    /' >&2 || true
        tail -60 "$OUT/$name.log" | sed 's/^/    /' >&2
        status=1
    fi
    grep -hoE '(FAULT-MATRIX|one-sided|ratios ferrocomm|verbs suite|verbs kill|multicast over UD|UD group|RDMA collectives|NACK|loss reported|new buffer|frames through|verbs vs perftest|verbs transport alone|summary).*' "$OUT/$name.log" | sed 's/^/      /' || true
done <"$OUT/steps"
[ -e "$OUT/done" ] || { echo "verbs-vm: FAILED: the run inside the VM did not finish" >&2; tail -20 "$OUT/console.log" >&2; status=1; }
if [ "$MODE" = test ]; then
    expected=10
else
    set -- ${VERBS_BENCH_MODES:-busy}
    expected=$((7 + $#))
    mkdir -p results
    cp "$OUT"/pingpong-verbs-*.json "$OUT"/pingpong-verbs-*.svg results/ 2>/dev/null || true
    for p in "$@"; do cp "$OUT/pingpong-$p.log" "results/pingpong-verbs-$p.txt" 2>/dev/null || true; done
    cp "$OUT/rma-verbs.log" results/rma-verbs.txt 2>/dev/null || true
    # One text file per step where its printed table holds every figure (results/ stays at 35
    # files): multicast-verbs.txt also gets the 256-buffer pool's stream, collectives-rdma.txt
    # is the RDMA collectives sweep (its JSON and plot stay in the run's directory).
    cp "$OUT"/multicast-verbs.json results/ 2>/dev/null || true
    for f in multicast-verbs collectives-rdma ud-vs-rc; do
        cp "$OUT/$f.log" "results/$f.txt" 2>/dev/null || true
    done
    if [ -e "$OUT/multicast-verbs-pool256.log" ] && [ -e "$OUT/multicast-verbs.log" ]; then
        { echo; echo "--- the stream with the UD receive pool at 256 buffers (step multicast-verbs-pool256) ---"
          cat "$OUT/multicast-verbs-pool256.log"; } >>results/multicast-verbs.txt
    fi
    rm -f results/multicast-verbs.svg results/multicast-verbs-pool256.txt results/collectives-rdma.json \
        results/collectives-rdma.svg
    echo "verbs-vm: VM load before the bench:" && sed 's/^/    /' "$OUT/vm-load.txt" 2>/dev/null || true
    echo "verbs-vm: results in results/pingpong-verbs-{$(echo "$@" | tr ' ' ,)}.{json,svg,txt}"
fi
[ -z "${VERBS_ONLY:-}" ] || expected=$((1 + $(echo $VERBS_ONLY | wc -w)))
[ "$(wc -l <"$OUT/steps" 2>/dev/null || echo 0)" -ge "$expected" ] || { echo "verbs-vm: FAILED: steps missing" >&2; status=1; }
echo "verbs-vm: $([ $status = 0 ] && echo PASSED || echo FAILED) in $(($(date +%s) - t_start)) s"
exit $status
