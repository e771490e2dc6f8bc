#!/usr/bin/env bash
# The checks only a GPU machine can run, in one pass (docs/gpus.md says what they showed).
#
#   bash bench/gpu_checks.sh OUT_DIR [SECONDS [CHECK...]]
#
# CHECK names which checks run (all by default): snapshot-unit snapshot-copy snapshot-e2e
# downtime-probe downtime-curve snapshot-overhead.
#
# Runs on a GPU image whose python3 holds a CUDA torch, from the repository root, with the etcd
# clients and etcd's binary carried in .gpu/ (see docs/gpus.md, "Running the GPU tests"). Each
# check has its own time limit, most important first, so a short lease still ends with the
# first ones; everything lands in OUT_DIR (log.txt and the benchmarks' tables).
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS [CHECK...]]}
budget=${2:-560}
shift $(($# < 2 ? $# : 2))
wanted=" ${*:-all} "
mkdir -p "$out"
export PYTHONPATH="$PWD/.gpu/site:$PWD" PATH="$PWD/.gpu/bin:$PATH" PYTHONUNBUFFERED=1
start=$(date +%s)
log="$out/log.txt"

left() { echo $((budget - ($(date +%s) - start))); }

check() {  # check NAME SECONDS COMMAND...: run it if the budget allows, time-limited
    local name=$1 limit=$2
    shift 2
    [[ $wanted == " all " || $wanted == *" $name "* ]] || return 0
    local room
    room=$(left)
    if ((room < 20)); then
        echo "=== $name: skipped, ${room} s left" | tee -a "$log"
        return
    fi
    ((limit > room)) && limit=$room
    echo "=== $name (limit ${limit} s, $(date +%T))" | tee -a "$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    echo "=== $name: exit $? after $(($(date +%s) - start)) s" | tee -a "$log"
}

{
    nvidia-smi -L
    nproc
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
    etcd --version | head -1
} >>"$log" 2>&1

# Issue 30: the snapshot's CUDA path (side stream into pinned host memory), then live recovery
# of layouts without a replica with their state on the GPU, every rank bitwise.
check snapshot-unit 60 python3 -m pytest -q -p no:cacheprovider tests/unit/worker/test_snapshot_parts.py
check snapshot-copy 120 python3 bench/snapshot_copy.py --device cuda --state-gib 0.25,1 --steps 12 --pairs 3 --out-dir /tmp/sc
cp /tmp/sc/snapshot-copy-*.md "$out/snapshot-copy.md" 2>/dev/null
cp /tmp/sc/snapshot-copy-*.json "$out/snapshot-copy.json" 2>/dev/null
check snapshot-e2e 240 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_live_cuda.py -k snapshot
# Issue 32: the recovery's curve with 16 cores, to 32 CPU ranks, against torchrun (a 2-rank probe
# first). The CPU benchmarks hide the GPU: with one visible their scripts take NCCL, which refuses
# several ranks on one GPU (why every run of these ended before its first step on 2026-11-26).
logs() { tail -n 25 "$1"/logs/*/*.log >>"$log" 2>&1; cp "$1"/downtime.md "$1"/downtime.json "$out/" 2>/dev/null; }
check downtime-probe 75 env CUDA_VISIBLE_DEVICES= python3 bench/downtime.py --cases worker-sigkill --launchers torchrun,tm-live \
    --sizes 2 --repeat 1 --steps 30 --pause-step 10 --out-dir /tmp/dp
logs /tmp/dp
check downtime-curve 300 env CUDA_VISIBLE_DEVICES= python3 bench/downtime.py --cases worker-sigkill --launchers torchrun,tm-live \
    --sizes 2,8,16,32 --repeat 1 --steps 40 --pause-step 15 --out-dir /tmp/dt
logs /tmp/dt
# Issue 30: per-step snapshots' steady-state cost in the job (pure FSDP2, 4 ranks) when the ranks
# have cores of their own, at 64 MiB of state per rank.
check snapshot-overhead 240 env CUDA_VISIBLE_DEVICES= python3 bench/snapshots.py --sizes 64 --repeat 2 --no-recovery
cp bench/results/snapshots-*.md "$out/" 2>/dev/null
echo "=== done after $(($(date +%s) - start)) s" | tee -a "$log"
