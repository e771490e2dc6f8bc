"""``python -m tm_launch.worker SCRIPT ARGS`` (or ``-m MODULE ARGS``): how tm-launch starts a
Python worker in live mode. It runs the script exactly as ``python SCRIPT ARGS`` would (same
``sys.argv``, ``sys.path[0]``, ``__main__``), with one addition: a spare promoted to ranks it did
not warm up as (``tm_launch.worker.spare.sandbox.RankChanged``) runs the script again from the top in the same
process, so everything the script derives from its rank (tensor-parallel shards, pipeline stage,
sampler, rank-0 duties) is built for the ranks it actually took, while imports, the CUDA context
and compilation caches stay warm.

The script sees and shows what ``python SCRIPT`` gives: ``sys.argv`` as given, an absolute
``__file__`` (and frame file names), and an uncaught exception's traceback without this
wrapper's frames (and runpy's, beyond those ``python -m MODULE`` shows too).
"""

from __future__ import annotations

import gc
import io
import os
import runpy
import sys
import types
import zipfile


def _run_script(path: str) -> None:
    """``runpy.run_path`` as ``python PATH`` runs it: the code named by its absolute path, but
    ``sys.argv[0]`` left as given (run_path would set it to the path it was handed)."""
    path = os.path.abspath(path)
    if os.path.isdir(path) or zipfile.is_zipfile(path):  # a directory or zip with __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _as_python_shows_it(kind, value, tb) -> None:
    """``sys.excepthook``: the traceback without this wrapper's frames, as Python prints it."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    names = [f.tb_frame.f_code.co_filename for f in frames]
    if __file__ in names:
        start = end = names.index(__file__)  # before it: the interpreter's runpy frames, as under `python -m M`
        while end < len(names) and names[end] in (__file__, runpy.__file__, "<frozen runpy>"):
            end += 1
        if end < len(frames):  # else the error is the wrapper's own: show it all
            frames = (frames[:start] if _AS_MODULE else []) + frames[end:]
    for f in reversed(frames):
        tb = types.TracebackType(tb, f.tb_frame, f.tb_lasti, f.tb_lineno)
    sys.__excepthook__(kind, value.with_traceback(tb), tb)  # Python prints the exception's own traceback


_AS_MODULE = False
WRAPPER = ["-m", "tm_launch.worker"]


def title_without_wrapper(orig_argv: list[str]) -> str | None:
    """The command line ``ps`` shows for this worker: the interpreter's own (``sys.orig_argv``)
    without ``-m tm_launch.worker``, i.e. ``python -u SCRIPT ARGS`` as torchrun starts it (None
    when the wrapper is not found there: nothing to change)."""
    for i in range(len(orig_argv) - 1):
        if orig_argv[i : i + 2] == WRAPPER:
            return " ".join(orig_argv[:i] + orig_argv[i + 2 :])
    return None


def _show_as_python_does() -> None:
    """``ps``, ``top`` and ``pkill -f`` see ``python -u SCRIPT ARGS``, as under torchrun. The
    title is shorter than the command line it replaces, so it fits where the command line was
    (``SPT_NOENV``: the process's environment is left as it is; the variable is gone again
    before the script runs, which sees torchrun's environment)."""
    title = title_without_wrapper(getattr(sys, "orig_argv", []))
    if title is None:
        return
    users = os.environ.get("SPT_NOENV")
    try:
        os.environ["SPT_NOENV"] = "1"
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the package is a dependency; without it the title stays as it was
        pass
    finally:
        if users is None:
            del os.environ["SPT_NOENV"]
        else:
            os.environ["SPT_NOENV"] = users


def main(argv: list[str]) -> None:
    global _AS_MODULE
    if not argv:
        raise SystemExit("usage: python -m tm_launch.worker SCRIPT [ARGS] | -m MODULE [ARGS]")
    from tm_launch.worker import exit_notice
    from tm_launch.worker.job import optimizer_steps
    from tm_launch.worker.job.entry import live_job, report_counted_step
    from tm_launch.worker.spare.sandbox import RankChanged

    _show_as_python_does()
    exit_notice.arm()  # the agent learns of this process's death as it begins
    optimizer_steps.install(report_counted_step)  # steps of a script that never reports them
    as_module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if as_module else (argv[0], argv[1:])
    _AS_MODULE = as_module
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _as_python_shows_it
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
                _run_script(target)
            _free_what_the_script_left()
            return
        except RankChanged as changed:
            old_globals = _script_globals(changed.__traceback__)
        except Exception as error:
            exit_notice.script_raised(error, live_job())  # a live job's: traceback, report, exit now (no teardown waiting on peers)
            raise
        # Out of the except block: the traceback, and with it the script's frames and their
        # locals, are gone. What the script kept in its globals goes now, so the old ranks' model,
        # optimizer and groups are freed before the new ones are built (on a GPU, before they
        # would need the memory twice).
        _forget(old_globals)


def _free_what_the_script_left() -> None:
    """The script returned: collect the cycles its run left (a DDP's reducer holds its process
    group), while the interpreter is still whole. Left to the interpreter's teardown, a gloo
    group freed there has its worker thread reach for the GIL after finalization began, which
    Python 3.11 ends with a forced unwind that C++ turns into SIGABRT ("terminate called without
    an active exception", docs/development.md), even when the script destroyed its default
    group first (``examples/restart_mode.py``: DDP still held it). The script's globals and
    its ``atexit`` handlers are left as Python leaves them."""
    gc.collect()


def _script_globals(tb) -> list[dict]:
    """The global namespaces of the script's run, from the frames of a traceback through it."""
    seen: list[dict] = []
    while tb is not None:
        g = tb.tb_frame.f_globals
        if g.get("__name__") == "__main__" and g is not globals() and not any(g is s for s in seen):
            seen.append(g)
        tb = tb.tb_next
    return seen


def _forget(namespaces: list[dict]) -> None:
    """Drop a finished run of the script, as the interpreter does at exit: its globals are
    cleared (a module's functions refer back to its namespace, a cycle that reference counting
    alone never frees), then the cycles left are collected. The collection scans only what was
    created after ``tm_launch.init()`` froze everything older (``spare.sandbox.freeze_what_exists``): 2 ms
    for the benchmark's model, where a full collection of a process with torch loaded takes
    0.1-0.3 s."""
    for namespace in namespaces:
        namespace.clear()
    namespaces.clear()
    gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:])
