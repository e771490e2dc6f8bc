"""C4's culprit rule (pure): from every rank's latest collective records, is a collective stuck,
and which rank (or node) is to blame? (arXiv 2406.04594; the agent's adapter is
``tm_launch/launcher/collective_watch.py``.)

C4's premise: collectives are periodic and homogeneous. Every member of a group issues the same
collectives in the same order, and a collective usually takes about as long as the group's
recent ones. So when members of a group have waited in collective *k* far longer than the
group's collectives take, something stopped, and the records say what:

1. **Not entered.** A member whose last entered collective is before *k* keeps the others
   waiting. If it is itself waiting in a collective of another group, it is blocked, not the
   cause: the rule follows the chain (a DP x TP rank stuck behind its TP peer). If it is
   *frozen* (its process stopped, or its heartbeat thread silent: a wedged driver call holding
   the interpreter), it is the culprit at once. If it is alive (busy in Python, saving a
   checkpoint, waiting on its data loader), it is blamed only once its silence also passes the
   *alive* threshold, and what decides it is whether the rank makes progress (``health.progress``:
   its CPU time, storage I/O, main thread's position, GPU activity). A **stuck** rank (nothing
   moved) is blamed once nothing has moved for ``still_floor`` (or a multiple of its median
   step): a sleep, a blocked read, a deadlock. A **busy** rank (an evaluation on rank 0 alone,
   a ``torch.save`` then a barrier) is what torch would let run until its peers' collective
   timeout, so it is blamed only a margin before that timeout (the one its own groups use, on
   its page), never earlier. While it says it saves a checkpoint (``job.checkpointing()``),
   neither happens before the checkpoint limit. A rank of which no evidence is known (an older
   record) gets the old rule: a multiple of its median recent step with a floor of seconds. A
   slow rank that completes never reaches any of these (the straggler statistic is its path, a
   drain, not a kill).
2. **Entered, data never came.** Every member entered *k* and waits: a frozen member among them
   is the one whose data never arrives (a SIGSTOP in the middle of the backward's all-reduce).
3. **Cut off.** Members whose agents cannot be reached (no records: the network between the
   nodes is cut) while every reachable member waits: the unreachable side is blamed, only when
   the side that decides holds a strict majority of the job's nodes, or exactly half and the
   other half has stopped writing to etcd too (a 2-node job has no majority side). A minority
   side blames nobody (fencing stops it), and a report of the cut side goes through etcd, which
   a side that cannot reach it cannot write.

Everything else is ambiguous and waits for more evidence (the agent looks again on its next
iteration) while the step-progress watchdog stays armed: two alive candidates on different
nodes, a member in another generation, a member that completed *k* while others wait on it (the
counters disagree), a group whose members are unknown, every member entered and none frozen.
Never blame a rank that is waiting in the stuck collective and alive.

"Stuck" is adaptive: waited > max(``floor``, ``multiplier`` x the group's typical collective
duration). The wait counts from the collective's entry or from the group's last completion,
whichever is later, so a long compute phase *between* collectives never counts: a rank computing
has nothing pending.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from health.progress import BUSY, STUCK, UNKNOWN

NONE, WAIT, KILL, CUT = "none", "wait", "kill", "cut"


@dataclass(frozen=True)
class GroupRecord:
    """One rank's latest record of one group."""

    generation: int
    entered: int  # sequence number of the last collective entered (0: none yet in this generation)
    done: int  # highest sequence number completed
    waiting: float  # seconds a collective has been pending without progress (0: none pending)
    typical: float  # the group's recent collective duration seen by this rank, seconds
    members: tuple[int, ...] | None = None  # global ranks; None: the world; (): unknown


@dataclass(frozen=True)
class RankRecord:
    rank: int
    node: str
    frozen: bool  # its process is stopped, or its heartbeat thread has been silent for seconds
    idle: float  # seconds since it last entered or completed any collective (its compute phase so far)
    step_time: float  # its median recent step time (0: none known)
    groups: Mapping[str, GroupRecord] = field(default_factory=dict)
    saving: float = 0.0  # seconds it has been saving a checkpoint (``job.checkpointing()``; 0: it is not)
    progress: str = UNKNOWN  # health.progress's verdict on it: BUSY, STUCK or UNKNOWN (frozen is ``frozen``)
    still: float = 0.0  # seconds nothing of it has moved (CPU, I/O, its main thread, its GPU)
    timeout: float = 0.0  # its groups' collective timeout, seconds (0: not known: Limits.busy)
    where: str = ""  # its main thread's place in the script ("evaluate() at train.py:88"; "": not known)
    evidence: tuple[str, ...] = ()  # what moved in its last window that moved


@dataclass(frozen=True)
class Limits:
    floor: float = 1.0  # a collective is never stuck before this many seconds
    multiplier: float = 10.0  # ... nor before this multiple of the group's typical duration
    alive_floor: float = 10.0  # an alive rank that has not entered is blamed only after this many seconds
    alive_multiplier: float = 10.0  # ... and this multiple of its median recent step
    checkpoint: float = 900.0  # ... and, while it says it saves a checkpoint, this many seconds
    still_floor: float = 6.0  # a rank of which nothing moved for this many seconds is stuck
    busy: float = 1800.0  # a busy rank's limit when its collective timeout is not known (gloo's default)
    busy_margin: float = 5.0  # a busy rank is blamed this many seconds before its peers' collectives time out

    def stuck_after(self, typical: float) -> float:
        return max(self.floor, self.multiplier * typical)

    def alive_after(self, step_time: float, saving: bool = False) -> float:
        limit = max(self.alive_floor, self.alive_multiplier * step_time)
        return max(limit, self.checkpoint) if saving else limit

    def still_after(self, step_time: float, saving: bool = False) -> float:
        limit = max(self.still_floor, self.alive_multiplier * step_time)
        return max(limit, self.checkpoint) if saving else limit

    def busy_after(self, timeout: float, saving: bool = False) -> float:
        """Before the peers' collectives time out (they are still waiting in the collective
        that names the rank), never before the alive floor."""
        limit = max(self.alive_floor, (timeout or self.busy) - self.busy_margin)
        return max(limit, self.checkpoint) if saving else limit


@dataclass(frozen=True)
class Verdict:
    action: str  # NONE: nothing stuck; WAIT: stuck, nobody to blame yet; KILL: ``ranks``; CUT: ``nodes``
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    group: str = ""
    seq: int = 0
    why: str = ""
    evidence: dict = field(default_factory=dict)


@dataclass
class _Stuck:
    group: str
    seq: int
    generation: int
    members: tuple[int, ...]
    waiters: dict[int, float]  # rank -> seconds waited
    limit: float


def stuck_groups(records: Mapping[int, RankRecord], world: Sequence[int], limits: Limits) -> tuple[list[_Stuck], list[str]]:
    """The groups in which reachable members have waited past the group's limit, and why others
    that look stuck cannot be judged."""
    names = sorted({g for r in records.values() for g in r.groups})
    stuck, unclear = [], []
    for name in names:
        held = {rank: r.groups[name] for rank, r in records.items() if name in r.groups}
        declared = {g.members for g in held.values()}
        if len(declared) != 1 or () in declared:
            unclear.append(f"{name}: members unknown or disagreeing")
            continue
        members = tuple(world) if None in declared else next(iter(declared))
        limit = limits.stuck_after(max(g.typical for g in held.values()))
        waiters = {rank: g.waiting for rank, g in held.items() if rank in members and g.entered > g.done and g.waiting > limit}
        if not waiters:
            continue
        generations = {held[r].generation for r in waiters}
        if len(generations) != 1:
            unclear.append(f"{name}: waiters in generations {sorted(generations)}")
            continue
        seq = min(held[r].done + 1 for r in waiters)
        stuck.append(_Stuck(name, seq, generations.pop(), members, waiters, limit))
    return stuck, unclear


def judge(
    records: Mapping[int, RankRecord],
    world: Sequence[int],
    node_of: Mapping[int, str],
    unreachable: set[str] | frozenset[str] = frozenset(),
    limits: Limits = Limits(),
    silent: set[str] | frozenset[str] = frozenset(),
) -> Verdict:
    """The verdict over ``records`` (every reachable rank's latest record), the job's ranks
    ``world``, each rank's node, the nodes whose agents could not be reached, and the nodes whose
    records in etcd stopped too (``silent``: they reach neither their peers nor etcd; this
    breaks the tie of a job split in halves, where no side holds a majority)."""
    stuck, unclear = stuck_groups(records, world, limits)
    if not stuck:
        return Verdict(NONE, why="; ".join(unclear))
    blocked = {rank for s in stuck for rank in s.waiters}
    frozen: dict[int, str] = {}  # rank -> why
    alive: dict[int, str] = {}
    cut: set[str] = set()
    doubts = list(unclear)
    for s in stuck:
        for m in s.members:
            node = node_of.get(m)
            if node in unreachable:
                cut.add(node)
                continue
            r = records.get(m)
            if r is None:
                doubts.append(f"{s.group}: no record of rank {m}")
                continue
            if m in s.waiters:
                if r.frozen:
                    frozen[m] = f"entered {s.group}#{s.seq} and froze: its peers wait for its data"
                continue
            g = r.groups.get(s.group)
            entered = 0 if g is None or g.generation < s.generation else g.entered
            done = 0 if g is None or g.generation < s.generation else g.done
            if g is not None and g.generation > s.generation:
                doubts.append(f"{s.group}: rank {m} is in generation {g.generation}, its peers wait in {s.generation}")
            elif entered < s.seq:
                if m in blocked:
                    continue  # waiting in another stuck group: blocked behind the culprit, not it
                what = f"has not entered {s.group}#{s.seq} (last entered #{entered})"
                if r.frozen:
                    frozen[m] = f"{what} and is frozen"
                elif r.progress != UNKNOWN:
                    _judge_by_progress(m, r, what, limits, alive, doubts)
                elif r.idle > limits.alive_after(r.step_time, r.saving > 0):
                    alive[m] = f"{what}, busy outside any collective for {r.idle:.1f}s" + (
                        f" (saving a checkpoint for {r.saving:.1f}s)" if r.saving else ""
                    )
                elif r.saving:
                    doubts.append(f"rank {m} {what}: saving a checkpoint for {r.saving:.1f}s (blamed after {limits.checkpoint:.0f}s)")
                else:
                    doubts.append(f"rank {m} {what}, busy for {r.idle:.1f}s: slow or stuck, not known yet")
            elif done >= s.seq:
                doubts.append(f"{s.group}: rank {m} completed #{s.seq} while its peers wait in it")
            elif r.frozen:
                frozen[m] = f"entered {s.group}#{s.seq} and froze: its peers wait for its data"
    first = max(stuck, key=lambda s: max(s.waiters.values()))
    evidence = {
        "stuck": [
            {"group": s.group, "seq": s.seq, "generation": s.generation, "waiting": {str(r): round(w, 3) for r, w in s.waiters.items()}}
            for s in stuck
        ],
        "limit_s": round(first.limit, 3),
        "unreachable": sorted(unreachable),
        "doubts": doubts,
    }
    reached = {node_of[r] for r in records if r in node_of}
    nodes = set(node_of.values())
    if frozen and len(frozen) < len(world):
        ranks = tuple(sorted(frozen))
        evidence["culprits"] = {str(r): frozen[r] for r in ranks}
        return Verdict(KILL, ranks, tuple(sorted({node_of.get(r, "?") for r in ranks})), first.group, first.seq, "frozen", evidence)
    if cut:
        if not frozen and (2 * len(reached) > len(nodes) or (2 * len(reached) == len(nodes) and cut <= set(silent))):
            return Verdict(CUT, (), tuple(sorted(cut)), first.group, first.seq, "unreachable while its peers wait", evidence)
        return Verdict(WAIT, (), tuple(sorted(cut)), first.group, first.seq, "unreachable nodes, but this side is no majority", evidence)
    if alive:
        culprit_nodes = {node_of.get(r, "?") for r in alive}
        if len(culprit_nodes) == 1 and not doubts:
            ranks = tuple(sorted(alive))
            evidence["culprits"] = {str(r): alive[r] for r in ranks}
            evidence["progress"] = {str(r): _progress_evidence(records[r]) for r in ranks}
            kinds = {records[r].progress for r in ranks}
            why = "stuck" if kinds == {STUCK} else "busy past the collective timeout" if kinds == {BUSY} else "never entered"
            return Verdict(KILL, ranks, tuple(culprit_nodes), first.group, first.seq, why, evidence)
        return Verdict(WAIT, (), (), first.group, first.seq, "several candidates or doubts", evidence)
    return Verdict(WAIT, (), (), first.group, first.seq, "; ".join(doubts) or "every member entered and none is frozen", evidence)


def _judge_by_progress(m: int, r: RankRecord, what: str, limits: Limits, alive: dict, doubts: list) -> None:
    """An alive rank that has not entered, judged by its progress (``health.progress``)."""
    saving = r.saving > 0
    at = f" in {r.where}" if r.where else ""
    mark = f" (saving a checkpoint for {r.saving:.1f}s)" if saving else ""
    if r.progress == STUCK and r.still > limits.still_after(r.step_time, saving):
        alive[m] = f"{what}, no progress of any kind for {r.still:.1f}s{at}{mark}"
    elif r.progress == BUSY and r.idle > limits.busy_after(r.timeout, saving):
        alive[m] = f"{what}, busy outside any collective for {r.idle:.1f}s{at}, past its collective timeout{mark}"
    elif r.progress == BUSY:
        limit = limits.busy_after(r.timeout, saving)
        doubts.append(f"rank {m} {what}: busy outside collectives for {r.idle:.1f}s{at}{mark} (blamed after {limit:.0f}s)")
    else:
        doubts.append(f"rank {m} {what}: no progress for {r.still:.1f}s{at}{mark}: stuck or about to move, not known yet")


def _progress_evidence(r: RankRecord) -> dict:
    return {
        "verdict": "frozen" if r.frozen else r.progress,
        "idle_s": round(r.idle, 3),
        "still_s": round(r.still, 3),
        "where": r.where,
        "moved": list(r.evidence),
        "saving_s": round(r.saving, 3),
        "timeout_s": r.timeout,  # the collective timeout its groups run under (0: not known)
    }
