#!/usr/bin/env python3
"""State transfer to joiners: bytes and seconds per joiner, with 1, 2 and 4 joiners at once.

    .venv/bin/python bench/transfer.py                      # 64 MiB per rank, 1/2/4 joiners
    .venv/bin/python bench/transfer.py --mib 16,256 --joiners 1,2,4 --repeat 3

Each run starts 2 x J processes on one gloo group (loopback): J holders and J joiners. Every
joiner holds a different shard (as in a DP x TP job where a whole TP group is replaced), so the
runtime's recovery plan (``recovery.plan_recovery``) gives each joiner its own source and the
J transfers run at the same time, through the runtime's own wire format
(``transfer.send_state`` / ``recv_state``: a pickled header, then every tensor point-to-point).
The state is a model's parameters plus AdamW's two moments (3 x the parameter bytes) and its
step counters, the shape of real optimizer state: ``--params N`` splits it as a transformer's is
split, every third parameter a matrix holding the bytes and the others norm weights and biases
of 256 values (1 KiB), 4 tensors per parameter. Reported: the slowest joiner's time from the
first byte to the last, and the aggregate throughput.

    .venv/bin/python bench/transfer.py --mib 4,64 --joiners 1 --params 1,300   # the cost of many small tensors
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)


class Shard:
    """A registered object: ``params`` parameters with AdamW's moments and step, ``mib`` MiB in all."""

    SMALL = 256  # values in a norm weight or bias

    def __init__(self, mib: float, fill: float, params: int = 1):
        import torch

        matrices = -(-params // 3)
        n = max(1, int((mib * 2**20 / 4 / 3 - (params - matrices) * self.SMALL) / matrices))
        self.tensors = {}
        for i in range(params):
            size = n if i % 3 == 0 else self.SMALL
            for k in ("param", "exp_avg", "exp_avg_sq"):
                self.tensors[f"{i}.{k}"] = torch.full((size,), fill)
            self.tensors[f"{i}.step"] = torch.tensor(fill)

    def holds(self, fill: float) -> bool:
        return all(bool((t == fill).all()) for t in self.tensors.values())

    def state_dict(self):
        return dict(self.tensors)

    def load_state_dict(self, state):
        for k, v in state.items():
            self.tensors[k].copy_(v)


def worker(rank: int, world: int, port: int, mib: float, params: int, out) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor  # noqa: F401  (a live worker has it loaded: tm_launch.worker.job.live)

    from tm_launch.worker.comms import communicators
    from tm_launch.worker.generation.recovery import Holding, ObjectState, plan_recovery
    from tm_launch.worker.state.transfer import recv_state, send_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    pg = communicators.build(dist.PrefixStore("bench/", store), rank, world, devices=["cpu"], timeout_s=300, setup_timeout_s=120)
    joiners = world // 2
    holder = rank < joiners
    shard = rank % joiners  # rank r and r + J hold the same shard
    objects = {"state": Shard(mib, float(shard) if holder else -1.0, params)}
    holdings = [
        Holding(r, 10 if r < joiners else -1, {"state": ObjectState(frozenset({r % joiners, r % joiners + joiners}), "s", "v")})
        for r in range(world)
    ]
    plan = plan_recovery(holdings)
    sources = {dst: next(iter(srcs)) for dst, srcs in plan.live.items()}
    barrier = torch.zeros(1)
    pg.allreduce([barrier]).wait()
    t0 = time.perf_counter()
    if holder:
        sent = sum(send_state(pg, dst, objects, 10) for dst, src in sources.items() if src == rank)
        out.put((rank, "sent", sent, time.perf_counter() - t0))
    else:
        step, got = recv_state(pg, sources[rank], objects)
        ok = objects["state"].holds(float(shard))
        out.put((rank, "received", got, time.perf_counter() - t0, ok))
    pg.allreduce([barrier]).wait()


def run(joiners: int, mib: float, params: int = 1) -> dict:
    import torch.multiprocessing as mp

    from rendezvous.etcd_server import free_ports

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=worker, args=(r, 2 * joiners, port, mib, params, out)) for r in range(2 * joiners)]
    for p in procs:
        p.start()
    import queue

    results, deadline = [], time.time() + 600
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            if time.time() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a transfer process failed or timed out (see its traceback above)") from None
    for p in procs:
        p.join(60)
    received = [r for r in results if r[1] == "received"]
    if not all(r[4] for r in received):
        raise SystemExit("a joiner received another shard's values")
    slowest = max(r[3] for r in received)
    total = sum(r[2] for r in received)
    return {
        "joiners": joiners,
        "mib": mib,
        "params": params,
        "bytes_per_joiner": received[0][2],
        "slowest_s": slowest,
        "per_joiner_s": sorted(r[3] for r in received),
        "aggregate_mib_s": total / 2**20 / slowest,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", default="64", help="state per rank in MiB (comma list)")
    p.add_argument("--joiners", default="1,2,4", help="joiners receiving at once (comma list)")
    p.add_argument("--params", default="1", help="parameters the state is split into (comma list; 4 tensors each)")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the table shows medians")
    args = p.parse_args()
    rows = []
    fewest = min(int(x) for x in args.joiners.split(","))
    for params in [int(n) for n in args.params.split(",")]:
        for mib in [float(m) for m in args.mib.split(",")]:
            for j in [int(x) for x in args.joiners.split(",")]:
                runs = [run(j, mib, params) for _ in range(args.repeat)]
                slow = statistics.median(r["slowest_s"] for r in runs)
                agg = statistics.median(r["aggregate_mib_s"] for r in runs)
                rows.append((params, mib, j, runs[0]["bytes_per_joiner"], slow, agg))
                print(
                    f"[bench] {mib:g} MiB in {4 * params} tensors x {j} joiner(s): slowest {slow * 1000:.0f} ms, aggregate {agg:.0f} MiB/s",
                    file=sys.stderr,
                    flush=True,
                )
    base = {(params, mib): slow for params, mib, j, _, slow, _ in rows if j == fewest}
    print("| state per joiner | tensors | joiners at once | bytes per joiner | slowest joiner s | vs 1 joiner | aggregate MiB/s |")
    print("|---|---|---|---|---|---|---|")
    for params, mib, j, nbytes, slow, agg in rows:
        print(
            f"| {mib:g} MiB | {4 * params} | {j} | {nbytes / 2**20:.1f} MiB | {slow:.3f} | {slow / base[(params, mib)]:.2f}x | {agg:.0f} |"
        )
    print(
        f"\n{os.cpu_count()} CPU cores, gloo over loopback, median of {args.repeat} run(s). "
        f"Command: `.venv/bin/python bench/transfer.py {' '.join(sys.argv[1:])}`".rstrip()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
