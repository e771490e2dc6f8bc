#!/usr/bin/env python3
"""torch 2.14's in-place communicator reconfigure against tm-launch's own rebuild, on gloo.

    .venv-torch2.14.1/bin/python bench/reconfigure.py                 # 2, 4 and 8 ranks, 5 rounds each
    .venv-torch2.14.1/bin/python bench/reconfigure.py --ranks 2,4 --rounds 10

The communicator phase of a recovery, alone: a group of N ranks in which the last rank changes
(a lost worker replaced by a spare). N + 1 rank processes are started once: N - 1 survivors and
two joiners, A and B, that take the last rank in turn (A in even rounds, B in odd ones), so that
every round changes the group's membership. A round starts when the bench's store says so
(every process waiting on it, torch imported, the previous group in place) and ends on a rank
when its new group has answered a first all-reduce correctly; reported is the slowest rank.

- ``rebuild``: what live mode does (``tm_launch.worker.comms.communicators.build``): a new
  gloo communicator on a fresh ``PrefixStore`` of the round (the generation's store), every
  pair connected, its connections found for a later give-up (the old group was given up
  before the round starts, as live mode gives it up when the plan arrives).
- ``gloo``: torch's own ``ProcessGroupGloo`` constructor on a fresh prefix, nothing else: what
  of ``rebuild`` is gloo's bootstrap and what is live mode's bookkeeping around it (its
  connections found in ``/proc`` for a later give-up, the listeners' key, the composite group).
- ``reconfigure``: torch's ``Backend.reconfigure`` (``dist._reconfigure`` on a group): each
  process built one ``ProcessGroupGloo(..., enable_reconfigure=True)`` before the rounds (a
  spare's warm-up) and published its handle (``get_reconfigure_handle``); a round passes the
  round's handles in rank order and a fresh uuid to every member's same backend object. A
  handle names the last uuid its backend took (``gloo:<id>:<uuid>:<rank>:<store address>``), so
  every member publishes a new one after each reconfigure; that exchange happens between the
  rounds, so a round holds the reconfigure alone (in a job it would ride on the plan).

The store is a TCPStore in the bench's own process (as a generation's store lives on a
surviving node). Numbers on a loaded machine are indicative: print the load average with them.
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

TIMEOUT = datetime.timedelta(seconds=60)


def member_of(index: int, ranks: int, round_no: int) -> int | None:
    """The group rank process ``index`` holds in round ``round_no`` (None: it sits this round
    out). Processes 0 .. N-2 are survivors; N-1 (A) and N (B) take rank N-1 in turn."""
    if index < ranks - 1:
        return index
    joiner = ranks - 1 + round_no % 2
    return ranks - 1 if index == joiner else None


def worker(index: int, ranks: int, rounds: int, port: int, method: str) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    backend = None
    if method == "reconfigure":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        backend = ProcessGroupGloo(dist.PrefixStore("rc/", store), index, ranks + 1, TIMEOUT, True)
        store.set(f"handle/0/{index}", backend.get_reconfigure_handle())
    group = None
    store.add("ready", 1)
    for round_no in range(rounds):
        store.wait([f"go/{round_no}"])
        rank = member_of(index, ranks, round_no)
        if rank is not None:
            if method == "rebuild" and group is not None:  # given up when the plan arrives, before the build
                from tm_launch.worker.comms import communicators

                communicators.release(group)
            group = None
            start = time.perf_counter()
            if method == "rebuild":
                from tm_launch.worker.comms import communicators

                group = communicators.build(
                    dist.PrefixStore(f"rb/{round_no}/", store),
                    rank,
                    ranks,
                    devices=("cpu",),
                    timeout_s=60,
                    setup_timeout_s=60,
                    hostname="127.0.0.1",
                )
                total = torch.ones(4)
                group.allreduce([total]).wait()
            elif method == "gloo":
                from torch.distributed.distributed_c10d import ProcessGroupGloo

                opts = ProcessGroupGloo._Options()
                opts._timeout = TIMEOUT
                opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                group = ProcessGroupGloo(dist.PrefixStore(f"pg/{round_no}/", store), rank, ranks, opts)
                total = torch.ones(4)
                group.allreduce([total]).wait()
            else:
                from torch._C._distributed_c10d import ReconfigureOptions

                opts = ReconfigureOptions()
                opts.uuid = round_no + 1
                opts.handles = [
                    store.get(f"handle/{round_no}/{i}").decode() for i in range(ranks + 1) if member_of(i, ranks, round_no) is not None
                ]
                backend.reconfigure(opts).wait()
                total = torch.ones(4)
                backend.allreduce([total]).wait()
            took = time.perf_counter() - start
            if not torch.equal(total, torch.full((4,), float(ranks))):
                raise SystemExit(f"round {round_no}: rank {rank} summed {total.tolist()}, not {ranks}")
            store.set(f"took/{round_no}/{rank}", repr(took))
        if backend is not None:  # a handle names the last uuid its backend took: new after each reconfigure
            store.set(f"handle/{round_no + 1}/{index}", backend.get_reconfigure_handle())
        store.add(f"done/{round_no}", 1)
        store.wait([f"end/{round_no}"])
    if group is not None:
        from tm_launch.worker.comms import communicators

        communicators.release(group)


def run(ranks: int, rounds: int, method: str) -> list[float]:
    """The slowest rank's seconds, per round."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.start_processes(worker, args=(ranks, rounds, store.port, method), nprocs=ranks + 1, start_method="spawn", join=False)
    while int(store.add("ready", 0)) < ranks + 1:
        time.sleep(0.05)
    slowest = []
    for round_no in range(rounds):
        store.set(f"go/{round_no}", "1")
        while int(store.add(f"done/{round_no}", 0)) < ranks + 1:
            if any(not p.is_alive() and p.exitcode != 0 for p in ctx.processes):
                ctx.join()  # raises with the failed process's traceback
            time.sleep(0.005)
        slowest.append(max(float(store.get(f"took/{round_no}/{r}").decode()) for r in range(ranks)))
        store.set(f"end/{round_no}", "1")
    ctx.join()
    return slowest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4,8", help="group sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="membership changes per size and method")
    parser.add_argument("--methods", default="rebuild,gloo,reconfigure")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not hasattr(dist, "_reconfigure"):
        print(f"tm-launch: error: torch {torch.__version__} has no communicator reconfigure (torch >= 2.14)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, gloo on loopback, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| ranks | method | slowest rank, median (ms) | min | max | rounds |")
    print("|---|---|---|---|---|---|")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for method in args.methods.split(","):
            times = [t * 1000 for t in run(ranks, args.rounds, method)]
            print(
                f"| {ranks} | {method} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} | {len(times)} |", flush=True
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
