#!/usr/bin/env python3
"""What one rank's per-step snapshot costs its step, on one device, without a job around it.

    python3 bench/snapshot_copy.py --device cuda --state-gib 0.25,1 --steps 30   # a GPU, ~1 minute
    .venv/bin/python bench/snapshot_copy.py --device cpu --state-gib 0.01         # this machine

``bench/snapshots.py`` measures snapshots inside a live job (agents, gloo, 4 ranks sharing the
machine's cores); this one isolates the snapshot's own path: the real ``Snapshots`` service of
one rank (``tm_launch.worker.snapshots``) and its holder's real ``SnapshotServer`` on loopback,
driven the way the live step drives them (``boundary`` at the step's start, ``ready_to_commit``
before the optimizer step), around a step of real compute (``--layers`` linear layers of
``--width``, ``--tokens`` rows, AdamW). Every state tensor is one no live rank replicates (an
FSDP shard, say), so all of it is copied and sent.

For each state size, runs alternate between modes (median step time of each):

* ``off``: no snapshots (the baseline);
* ``local``: the copy alone (no holder: a one-rank job), on CUDA a side stream into pinned host
  memory overlapping the forward and backward;
* ``sent``: the copy and the send to the holder over loopback TCP, which the step's own commit
  waits for (``--snapshot-send commit``, the default);
* ``overlap``: the same send overlapping the next step, whose commit waits for it
  (``--snapshot-send overlap``).

Also reported: the peak GPU memory of each mode (the design says the snapshot adds none), and
the copy's and the send's throughput. Results: bench/results/snapshot-copy-<time>.md/.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

import torch  # noqa: E402

from tm_launch.worker.snapshots.link import SnapshotServer  # noqa: E402
from tm_launch.worker.snapshots.service import Snapshots  # noqa: E402

MODES = ("off", "local", "sent", "overlap")


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build(gib: float, width: int, device: torch.device):
    """Linear layers of ``width`` until parameters and AdamW's two moments hold ``gib`` GiB."""
    per_layer = width * width + width
    layers = max(1, round(gib * 2**30 / (3 * 4 * per_layer)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(mode: str, model, opt, x, steps: int, warmup: int, holder: SnapshotServer, idle: float = 0.0) -> dict:
    device = x.device
    snaps = None
    if mode != "off":
        snaps = Snapshots("127.0.0.1", every=1, memory_limit=0, local_world=1, overlap_send=mode == "overlap")
        snaps.set_remote(["model", "optimizer"], generation=0)
        world = 1 if mode == "local" else 2
        snaps.enter(0, world, lambda r: holder.address)
    objects = {"model": model, "optimizer": opt}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, waits = [], []
    try:
        for step in range(steps + warmup):
            sync(device)
            t0 = time.perf_counter()
            if snaps is not None:
                snaps.boundary(step, objects, None)
            model(x).square().mean().backward()
            time.sleep(idle)  # a GPU's forward and backward, as the CPU sees them (``--idle-ms``)
            t1 = time.perf_counter()
            if snaps is not None:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # the step's compute, not the side stream's copy
                t1 = time.perf_counter()
                assert snaps.ready_to_commit(step, give_up=lambda: False), "snapshot not ready"
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            sync(device)
            time.sleep(idle)  # the rest of a step: loading the next batch, logging
            if step >= warmup:
                times.append(time.perf_counter() - t0)
                waits.append(t2 - t1)
        sent = snaps.bytes_sent if snaps else 0
    finally:
        if snaps is not None:
            snaps.close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"step_s": statistics.median(times), "commit_wait_s": statistics.median(waits), "peak_gpu_bytes": peak, "sent_bytes": sent}


def slow_link(gbps: float) -> None:
    """Make the holder take each image at ``gbps`` at most: after receiving it, it sleeps for
    the time the bytes would still take at that rate (the sender waits for its acknowledgement)."""
    from tm_launch.worker.snapshots import link

    receive = link._recv_image

    def at_rate(sock, header, reuse=None):
        t0 = time.perf_counter()
        image = receive(sock, header, reuse)
        time.sleep(max(0.0, header["nbytes"] * 8 / (gbps * 1e9) - (time.perf_counter() - t0)))
        return image

    link._recv_image = at_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--state-gib", default="0.25,1", help="GiB of state (parameters + AdamW moments), comma list")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192, help="rows per step (the step's compute)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="runs of each mode, alternating")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        help="the holder takes each image no faster than this many Gbit/s (it sleeps for the rest: a network slower "
        "than loopback, without its CPU cost; 0: loopback as it is)",
    )
    p.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="the step also sleeps this long after the backward and again after the optimizer step: on a CPU, a step "
        "whose compute leaves the cores free (a GPU's), so that what overlaps what shows without the GPU",
    )
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.link_gbps > 0:
        slow_link(args.link_gbps)
    holder = SnapshotServer("127.0.0.1")
    holder.keep_only([0])
    rows = []
    try:
        for gib in [float(s) for s in args.state_gib.split(",")]:
            model, opt = build(gib, args.width, device)
            state = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
            x = torch.randn(args.tokens, args.width, device=device)
            results = {m: [] for m in MODES}
            for i in range(args.pairs):
                for mode in MODES if i % 2 == 0 else reversed(MODES):
                    results[mode].append(run(mode, model, opt, x, args.steps, args.warmup, holder, args.idle_ms / 1e3))
                    say(f"{gib} GiB {mode}: {results[mode][-1]}")
            row = {"state_bytes": state, "layers": len(model)}
            for mode in MODES:
                row[mode] = {k: statistics.median(r[k] for r in results[mode]) for k in results[mode][0]}
            base = row["off"]["step_s"]
            for mode in MODES[1:]:
                row[mode]["overhead"] = row[mode]["step_s"] / base - 1
            rows.append(row)
            del model, opt, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        holder.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [
        f"# snapshot copy, {name}, torch {torch.__version__}, {os.cpu_count()} cores",
        "",
        f"`{' '.join(['python3', *sys.argv])}` (median of {args.pairs} runs of {args.steps} steps per mode)",
        "",
        "| state | step, off | local copy | + sent, before the commit | + sent, overlapping the next step "
        "| commit wait: local / sent / overlap | peak GPU memory: off / local / sent / overlap |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gpu = " / ".join(f"{r[m]['peak_gpu_bytes'] / 2**20:.0f}" for m in MODES) + " MiB"
        waits = " / ".join(f"{r[m]['commit_wait_s'] * 1e3:.1f}" for m in MODES[1:])
        lines.append(
            f"| {r['state_bytes'] / 2**30:.2f} GiB | {r['off']['step_s'] * 1e3:.1f} ms "
            f"| {r['local']['step_s'] * 1e3:.1f} ms ({r['local']['overhead']:+.1%}) "
            f"| {r['sent']['step_s'] * 1e3:.1f} ms ({r['sent']['overhead']:+.1%}) "
            f"| {r['overlap']['step_s'] * 1e3:.1f} ms ({r['overlap']['overhead']:+.1%}) "
            f"| {waits} ms | {gpu} |"
        )
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out_dir, f"snapshot-copy-{stamp}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out_dir, f"snapshot-copy-{stamp}.json"), "w") as f:
        json.dump({"argv": sys.argv, "device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
