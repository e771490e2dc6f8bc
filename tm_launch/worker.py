"""``python -m tm_launch.worker SCRIPT ARGS`` (or ``-m MODULE ARGS``): how tm-launch starts a
Python worker in live mode. It runs the script exactly as ``python SCRIPT ARGS`` would (same
``sys.argv``, ``sys.path[0]``, ``__main__``), with one addition: a spare promoted to ranks it did
not warm up as (``tm_launch.runtime.RankChanged``) runs the script again from the top in the same
process, so everything the script derives from its rank (tensor-parallel shards, pipeline stage,
sampler, rank-0 duties) is built for the ranks it actually took, while imports, the CUDA context
and compilation caches stay warm.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tm_launch.worker SCRIPT [ARGS] | -m MODULE [ARGS]")
    from tm_launch.runtime import RankChanged

    as_module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if as_module else (argv[0], argv[1:])
    while True:
        if as_module:
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            return
        except RankChanged:
            gc.collect()  # the old ranks' model, optimizer and groups go before the new ones are built


if __name__ == "__main__":
    main(sys.argv[1:])
