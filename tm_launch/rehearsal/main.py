"""``tm-launch rehearse [options] SCRIPT [ARGS]``: the command (see ``tm_launch.rehearsal``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile

from .compare import BETWEEN, SEVERAL, compare_files, compare_runs, differences, maybe_unseeded, unstable_keys
from .report import as_dict, passed, render, summary
from .runs import PHASES, SEVERAL_EFFECTS, Run, live, reference, several_effects, why

EXIT_FAILED, EXIT_USAGE = 1, 2
NOT_LIVE = (
    "{script} never called tm_launch.init(): under tm-launch it runs in restart mode (a failure restarts every worker "
    "from its own checkpoint), with no live recovery to rehearse; to make it live, call tm_launch.init(), "
    "job.register(...) its state and loop over job.steps() (README: The live API)"
)


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tm-launch rehearse",
        description=(
            "Run a training script on this machine once without a fault under plain torchrun and once per fault "
            "under tm-launch's live mode (a worker SIGKILLed at one phase of a step, a warm spare taking its rank), "
            "and compare every rank's whole state (everything registered with job.register, module buffers, the "
            "global RNG) with the fault-free run. Exit 0 when every fault ends bitwise equal on every rank."
        ),
    )
    p.add_argument("--nnodes", type=int, default=2, help="active nodes (tm-launch agents), one more is the spare (default 2)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1, help="workers per node (default 1)")
    p.add_argument(
        "--phases",
        default=None,
        help=(
            f"comma-separated phases to kill a worker at, one run each (default: all: {','.join(PHASES)}; "
            f"{','.join(SEVERAL_EFFECTS)} only where a step of the fault-free run took more than one optimizer step)"
        ),
    )
    p.add_argument("--kill-step", type=int, default=None, help="the step the faults happen at (default: half the fault-free run's steps)")
    p.add_argument("--kill-rank", type=int, default=None, help="the rank killed (default: the last rank, then rank 0, alternating)")
    p.add_argument("--no-control", action="store_true", help="skip the fault-free live run that shows the script reproduces itself")
    p.add_argument("--tm-launch-args", default="", help='extra tm-launch options for the agents, one string (e.g. "--snapshot-every 1")')
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    p.add_argument("--workdir", default=None, help="keep every run's logs, state and working directory here")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON here")
    p.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)  # torchrun's habit: always so here
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UsageError(message)


def parse(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    p.__class__ = _Parser
    args = p.parse_args(argv)
    if not args.script:
        raise UsageError("no training script given: tm-launch rehearse [options] SCRIPT [ARGS]")
    if not os.path.isfile(args.script):
        raise UsageError(f"{args.script}: no such file")
    args.script = os.path.abspath(args.script)
    if args.nnodes < 1 or args.nproc < 1:
        raise UsageError("--nnodes and --nproc-per-node must be at least 1")
    if args.nnodes * args.nproc < 2:
        raise UsageError("a rehearsal needs at least 2 ranks (--nnodes x --nproc-per-node)")
    if args.phases is not None:  # None: all that apply, decided once the fault-free run is known (default_phases)
        args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = [p for p in args.phases if p not in PHASES]
        if unknown or not args.phases:
            raise UsageError(f"--phases: unknown phase(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PHASES)}")
    world = args.nnodes * args.nproc
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        raise UsageError(f"--kill-rank {args.kill_rank}: the job has ranks 0..{world - 1}")
    try:
        args.launcher_args = shlex.split(args.tm_launch_args)
    except ValueError as e:
        raise UsageError(f"--tm-launch-args: {e}") from None
    return args


def victims(phases: list[str], world: int, fixed: int | None) -> list[int]:
    """The rank each fault kills: ``fixed``, else the last rank, then rank 0, alternating (both
    ends: rank 0 often has duties of its own, and its node hosts the first generation's store)."""
    if fixed is not None:
        return [fixed] * len(phases)
    return [world - 1 if i % 2 == 0 else 0 for i in range(len(phases))]


def default_phases(dumps: dict) -> list[str]:
    """Every phase, those between several effects of a step only where the fault-free run's step
    has them (``runs.several_effects``)."""
    return [p for p in PHASES if p not in SEVERAL_EFFECTS or several_effects(dumps)]


def kill_step(steps: int, given: int | None) -> int:
    """The step faults happen at: the given one, else the middle of the fault-free run (at
    least 1: a step with a committed step before it)."""
    if given is not None:
        return given
    return max(1, steps // 2)


def say(message: str) -> None:
    print(f"[rehearse] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"tm-launch rehearse: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    # A SIGTERM ends the rehearsal through its finally blocks: agents and etcd stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workdir = args.workdir or tempfile.mkdtemp(prefix="tm-rehearse-")
    os.makedirs(workdir, exist_ok=True)
    keep = args.workdir is not None or bool(os.environ.get("TM_REHEARSE_KEEP"))
    try:
        code = _rehearse(args, workdir)
        if code != 0:  # the logs of what failed stay for the user to read
            keep = True
            print(f"logs and every rank's state: {workdir}", flush=True)
        return code
    except UsageError as e:
        keep = True
        print(f"tm-launch rehearse: error: {e} (logs: {workdir})", file=sys.stderr, flush=True)
        return EXIT_USAGE
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _rehearse(args, workdir: str) -> int:
    from rendezvous.etcd_server import EtcdServer

    world = args.nnodes * args.nproc
    say(f"fault-free run under torchrun ({world} ranks)")
    ref = reference(workdir, args.script, args.args, world, args.timeout)
    if ref.error:
        raise UsageError(f"the script failed without any fault under torchrun ({ref.error}): {why(ref.tail)}")
    ref_how = f"torchrun --standalone --nproc-per-node {world}"
    with EtcdServer(data_dir=os.path.join(workdir, "etcd")) as etcd:

        def live_run(name, **fault) -> Run:
            return live(
                workdir, etcd.endpoint, name, args.script, args.args, args.nnodes, args.nproc, args.launcher_args, args.timeout, **fault
            )

        control = None
        if not ref.dumps or not any(d["meta"]["objects"] for d in ref.dumps.values()):
            # Nothing registered under torchrun (a framework integration registers only in live
            # mode): the live fault-free run is the reference.
            say("nothing was registered under torchrun: tm-launch live without a fault is the reference")
            ref = live_run("reference-live")
            ref_how = "tm-launch live, no fault (nothing is registered under torchrun)"
            if ref.error or not ref.dumps:
                raise UsageError(_no_state(ref, args.script))
        # Without a control run, generators the script may never have seeded cannot be judged.
        unstable, unstable_files = maybe_unseeded(ref.dumps), frozenset()
        if control is None and not args.no_control and ref.name == "reference":
            say("fault-free run under tm-launch live (the control)")
            run = live_run("control")
            # What differs there is the script's own nondeterminism: left out of every verdict;
            # the control fails only where something other than an unseeded generator differs.
            unstable = unstable_keys(ref.dumps, run.dumps)
            unstable_files = _unstable_files(ref, run)
            control = (
                run,
                [*compare_runs(ref.dumps, run.dumps, unstable & maybe_unseeded(ref.dumps)), compare_files(ref.files, run.files)],
            )
        steps = max((d["meta"]["steps"] for d in ref.dumps.values()), default=0)
        step = kill_step(steps, args.kill_step)
        phases = args.phases or default_phases(ref.dumps)
        faults = []
        for phase, victim in zip(phases, victims(phases, world, args.kill_rank)):
            say(f"fault: rank {victim} SIGKILLed {PHASES[phase][1]} at step >= {step}")
            run = live_run(f"fault {phase}", phase=phase, victim=victim, step=step)
            effects = BETWEEN if phase in SEVERAL_EFFECTS else SEVERAL if several_effects(ref.dumps) else None
            verdicts = compare_runs(ref.dumps, run.dumps, unstable, effects)
            faults.append((run, [*verdicts, compare_files(ref.files, run.files, unstable_files)]))
    header = {"script": args.script, "nnodes": args.nnodes, "nproc": args.nproc, "step": step, "reference_how": ref_how}
    if control is None and maybe_unseeded(ref.dumps):
        header["not_compared"] = (
            "the registered Python and numpy generators (seeded from the OS unless the script seeds them; the control run compares them where they reproduce)"
        )
    print(render(header, ref, control, faults))
    print(summary(control, faults), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_dict(header, ref, control, faults), f, indent=1)
    return 0 if passed(control, faults) else EXIT_FAILED


def _unstable_files(ref: Run, control: Run) -> frozenset:
    """Files (or values in them) that differ between two fault-free runs (a log with times in it):
    a fault cannot be blamed for them."""
    if ref.files is None or control.files is None:
        return frozenset()
    return frozenset(d.key for d in differences(ref.files, control.files))


def _no_state(run: Run, script: str) -> str:
    if run.error:
        return f"the script failed without any fault under tm-launch live ({run.error}): {why(run.tail)}"
    # Not even under tm-launch (a framework's integration calls it there only): restart mode.
    return NOT_LIVE.format(script=os.path.basename(script))
