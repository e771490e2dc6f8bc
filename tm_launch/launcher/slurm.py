"""What Slurm already says about a job, as tm-launch's options: under ``srun``, no one has to
derive ``--rdzv-id`` and ``--node-id`` by hand.

Under an ``srun`` step (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set):

* the run id is ``slurm-<SLURM_ARRAY_JOB_ID>`` for a job array (its tasks are one run: a queued
  task is a cold spare that joins when Slurm starts it), else ``slurm-<SLURM_JOB_ID>``;
* the node id is the Slurm node name (``SLURMD_NODENAME``; ``task<SLURM_PROCID>`` without it).
  Where the run spans allocations (a job array, or a second ``sbatch`` given the first job's
  ``--rdzv-id``), ``-<SLURM_JOB_ID>`` is added: a replacement allocation may land on the very
  node name that failed, and one node id must never name two agents of a run;
* one agent per node is checked: ``srun`` starting several tasks on one node (a job script's
  ``--ntasks-per-node=8`` inherited by the step) would start several agents there, each taking
  the node's GPUs, which is refused with one line saying what to write instead.

``--nnodes`` keeps its meaning, the active nodes: the allocation's nodes beyond ``--nnodes``
MAX join as spares, so ``sbatch --nodes=N+S`` with ``--nnodes N`` keeps S spares. Options the
user gives (command line, ``PET_*``, YAML) always win. Pure: the environment is an argument.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.rdzv_conf import RUN_ID, UsageError

TORCHRUN_NO_RUN_ID = ("", "none")  # torchrun's --rdzv-id default is "none"


@dataclass(frozen=True)
class SlurmJob:
    """What tm-launch takes from the environment of one ``srun`` task."""

    run_id: str
    node_id: str
    nodes: int  # the step's nodes (active + spares in this allocation), 0 when Slurm does not say
    spans_allocations: bool = False  # a job array's task, or a run another allocation started


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise UsageError(f"SLURM_TASKS_PER_NODE={text!r}: not Slurm's form (e.g. 1(x4))")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _one_agent_per_node(env: Mapping[str, str]) -> None:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        raw = env.get(name)
        if raw:
            most = max(tasks_per_node(raw), default=1)
            if most > 1:
                raise UsageError(
                    f"srun started {most} tasks on one node ({name}={raw}): tm-launch is one agent per node that "
                    f"starts the node's workers itself; run it as srun --ntasks-per-node=1 --kill-on-bad-exit=0 tm-launch "
                    f"--nproc-per-node GPUS ..."
                )
            return  # the step's own count says it all; the job's may differ


def _safe(value: str, what: str) -> str:
    if not RUN_ID.match(value):
        raise UsageError(f"{what} {value!r} cannot name a tm-launch run or node; give --rdzv-id / --node-id yourself")
    return value


def slurm_job(env: Mapping[str, str], rdzv_id: str | None, node_id: str | None) -> SlurmJob | None:
    """The run id, node id and node count for an agent under ``srun``; None outside a step.
    ``rdzv_id`` / ``node_id``: what the user gave (None, or torchrun's "none", when not)."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None  # not Slurm, or the batch script itself (one process, not one per node)
    _one_agent_per_node(env)
    own_run = f"slurm-{env.get('SLURM_ARRAY_JOB_ID') or job}"
    given_run = rdzv_id not in (None, *TORCHRUN_NO_RUN_ID)
    run = str(rdzv_id) if given_run else own_run
    spans_allocations = bool(env.get("SLURM_ARRAY_JOB_ID")) or run != f"slurm-{job}"
    if node_id:
        node = node_id
    else:
        base = env.get("SLURMD_NODENAME") or f"task{env.get('SLURM_PROCID', '0')}"
        node = _safe(f"{base}-{job}" if spans_allocations else base, "the Slurm node name")
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "0"
    return SlurmJob(
        run_id=_safe(run, "the Slurm job id"),
        node_id=node,
        nodes=int(nodes) if nodes.isdigit() else 0,
        spans_allocations=spans_allocations,
    )


def spares_in_allocation(job: SlurmJob, max_nodes: int) -> int:
    """The allocation's nodes beyond ``--nnodes`` MAX: they join as spares."""
    return max(0, job.nodes - max_nodes)


def describe(job: SlurmJob, max_nodes: int) -> str:
    """The agent's first line under Slurm: what it took from Slurm, and where its spares come from."""
    head = f"Slurm: run {job.run_id}, node {job.node_id}"
    if job.spans_allocations:
        return f"{head}; {job.nodes} node(s) in this allocation, joining a run of several allocations (nodes beyond --nnodes {max_nodes} are spares)"
    return f"{head}; {job.nodes} node(s) in this step for --nnodes {max_nodes}: {spares_in_allocation(job, max_nodes)} spare(s)"


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,3],b`` -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise UsageError(f"node list {text!r}: brackets do not match (Slurm's form is node[01-04,07])")
    if depth != 0:
        raise UsageError(f"node list {text!r}: brackets do not match (Slurm's form is node[01-04,07])")
    return parts + [text[start:]]


def _range_values(spec: str, whole: str) -> list[str]:
    """``01-03,7`` -> ["01", "02", "03", "7"]: the width of a range's first bound is kept (Slurm's zero padding)."""
    values = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise UsageError(f"node list {whole!r}: {item!r} is not a number or a rising range (e.g. 01-04)")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return values


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed node list (``SLURM_JOB_NODELIST``), expanded in Slurm's order:
    ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1; ``r[1-2]-n[1-2]`` -> r1-n1 r1-n2
    r2-n1 r2-n2. What ``scontrol show hostnames`` prints, without needing Slurm's commands on the node."""
    names: list[str] = []
    for entry in filter(None, (p.strip() for p in _split_top_level(text.strip()))):
        expanded = [""]
        for literal, spec in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", entry):
            values = _range_values(spec, text) if spec else [""]
            expanded = [head + literal + v for head in expanded for v in values]
        names += expanded
    if len(set(names)) != len(names):
        raise UsageError(f"node list {text!r} names a node twice")
    return names
