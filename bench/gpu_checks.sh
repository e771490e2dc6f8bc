#!/usr/bin/env bash
# The checks only a GPU machine can run, in one pass (docs/gpus.md says what they showed).
#
#   bash bench/gpu_checks.sh OUT_DIR [SECONDS]
#
# Runs on a GPU image whose python3 holds a CUDA torch, from the repository root, with the etcd
# clients and etcd's binary carried in .gpu/ (see docs/gpus.md, "Running the GPU tests"). Each
# check has its own time limit, most important first, so a short lease still ends with the
# first ones; everything lands in OUT_DIR (log.txt and the benchmarks' tables).
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS]}
budget=${2:-560}
mkdir -p "$out"
export PYTHONPATH="$PWD/.gpu/site:$PWD" PATH="$PWD/.gpu/bin:$PATH" PYTHONUNBUFFERED=1
start=$(date +%s)
log="$out/log.txt"

left() { echo $((budget - ($(date +%s) - start))); }

check() {  # check NAME SECONDS COMMAND...: run it if the budget allows, time-limited
    local name=$1 limit=$2
    shift 2
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
# Issue 32: the recovery's curve with 16 cores, to 32 CPU ranks, against torchrun.
check downtime-curve 220 python3 bench/downtime.py --cases worker-sigkill --launchers torchrun,tm-live \
    --sizes 2,16,32 --repeat 1 --steps 40 --pause-step 15 --out-dir /tmp/dt
cp /tmp/dt/downtime.md /tmp/dt/downtime.json "$out/" 2>/dev/null
tail -n 20 /tmp/dt/logs/*/*.log >>"$log" 2>&1  # on 2026-11-26 every run there ended before its first steps: why
echo "=== done after $(($(date +%s) - start)) s" | tee -a "$log"
