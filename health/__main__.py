"""``python -m health``: watch this machine's GPUs, or measure what one NVML poll costs.

    python -m health --bench 200              # CPU and wall time per batched poll, start-up (JSON)
    python -m health --watch 60               # print alarms (JSON lines) for 60 s, then a summary
    TM_FAKE_NVML=timeline.yaml python -m health --watch 10 --nproc 2

GPUs: the ones local ranks 0..nproc-1 would use under CUDA_VISIBLE_DEVICES (default: every
GPU NVML sees).  Exit status 2 when the monitor cannot start (NVML unavailable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time

from .config import HealthConfig
from .nvml_monitor import NvmlMonitor, gpus_for_local_ranks, load_nvml


def measure_poll_cost(monitor: NvmlMonitor, polls: int, interval: float | None = None) -> dict:
    """Run ``polls`` batched polls in this thread; CPU and wall milliseconds per poll, and
    the share of one core that polling every ``interval`` seconds (default: the config's)
    costs."""
    interval = interval or monitor.cfg.poll_interval
    monitor.poll_once()  # warm-up
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(polls):
        monitor.poll_once()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    cpu_ms = 1000 * cpu / polls
    return {
        "gpus": len(monitor.gpus),
        "polls": polls,
        "cpu_ms_per_poll": round(cpu_ms, 4),
        "wall_ms_per_poll": round(1000 * wall / polls, 4),
        "poll_interval": interval,
        "cpu_share_of_one_core": round(cpu_ms / 1000 / interval, 6),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m health", description=__doc__.split("\n")[0])
    p.add_argument("--bench", type=int, metavar="POLLS", help="measure POLLS polls and exit")
    p.add_argument("--watch", type=float, metavar="SECONDS", default=None, help="run the monitor for SECONDS, printing alarms")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default: all GPUs)")
    p.add_argument("--poll-interval", type=float, default=None)
    p.add_argument("--node", default=socket.gethostname())
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    cfg = HealthConfig()
    if args.poll_interval:
        cfg.poll_interval = args.poll_interval
    interval = cfg.poll_interval
    if args.bench:
        cfg.poll_interval = 3600.0  # the benchmark polls itself, not the background thread
    nvml, why = load_nvml()
    if nvml is None:
        logging.info("NVML unavailable: %s", why)
        return 2
    nproc = args.nproc
    if nproc is None:
        try:
            nvml.nvmlInit()
            nproc = nvml.nvmlDeviceGetCount()
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            logging.info("NVML unavailable: %s", e)
            return 2
    gpus = gpus_for_local_ranks(nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))

    alarms = []

    def show(alarm):
        alarms.append(alarm)
        print(json.dumps(alarm.to_json()), flush=True)

    monitor = NvmlMonitor(args.node, gpus, cfg, show, nvml=nvml)
    t0 = time.perf_counter()
    if not monitor.start():
        return 2
    started = {"start_ms": round(1000 * (time.perf_counter() - t0), 2), "unsupported": monitor.unsupported()}
    try:
        if args.bench:
            print(json.dumps({**measure_poll_cost(monitor, args.bench, interval), **started}))
        else:
            watch = args.watch if args.watch is not None else 10.0
            time.sleep(watch)
            print(json.dumps({"watched_s": watch, "alarms": len(alarms), **started}), flush=True)
    finally:
        monitor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
