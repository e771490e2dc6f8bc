"""Entering a generation, its state part: every rank says what it holds, all compute the same
plan (``recovery.plan_recovery``), and the ranks behind receive their own state.

A rank taking over rank *r* receives *r*'s own state from a live rank holding the same shard
(``state.replicas``: read off DTensor placements and ``register(replicas=...)``), over the new
world (``state.transfer``: the wire format); what no live rank holds comes from *r*'s snapshot on
its holder (``snapshots``), or is rebuilt from its group's parity. A shard that no live rank and
no snapshot holds at the chosen step stops live mode with one clear line (``StateLost``), never
a silent restart from the script's start state.
"""

from __future__ import annotations

import threading
import time

import torch

from ..log import log
from ..snapshots import Snapshots
from ..state.replicas import fingerprints, most_surveyed, replica_set
from ..state.transfer import allgather_objects, human_size, recv_state, send_state
from .recovery import Holding, ObjectState, plan_recovery


class StateLost(RuntimeError):
    """No live rank holds some rank's state (or replicas disagree): continuing would train on
    wrong weights. Every rank computes the same transfer plan, so every rank raises it alike;
    the job then restarts every worker from the script's own checkpoint (restart mode)."""

    def __init__(self, message: str, step: int, ranks: list):
        super().__init__(message)
        self.step, self.ranks = step, list(ranks)


class StateExchange:
    def __init__(self, state, snapshots: Snapshots):
        self.state = state  # the worker's TrainingState
        self.snapshots = snapshots

    def object_states(self, rank: int, world: int) -> dict:
        """name -> ``ObjectState`` of every registered object: who replicates it, its fingerprints."""
        state = self.state
        out = {}
        for name, obj in state.objects.items():
            sd = obj.state_dict()
            sd = state.per_rank.without_buffers(name, sd)  # differ across ranks by design: not a replica's to agree on
            structure, values = fingerprints({name: sd}, {name} if isinstance(obj, torch.nn.Module) else set())
            out[name] = ObjectState(self._replicas(name, obj, sd, rank, world), structure, values)
        return out

    def unreplicated(self, rank: int, world: int) -> frozenset:
        """The registered objects no other live rank holds a copy of (what snapshots send)."""
        return frozenset(
            name for name, obj in self.state.objects.items() if self._replicas(name, obj, obj.state_dict(), rank, world) == {rank}
        )

    def _replicas(self, name: str, obj, sd: dict, rank: int, world: int) -> frozenset:
        """The ranks holding an identical copy of ``obj``. An optimizer's state is laid out like
        its parameters (and may not exist yet, before its first step): its parameters count too
        (a ZeRO partition's: the partition's). Without ``replicas=``, its plain tensors are
        replicated only across the ranks the survey found holding the same bytes
        (``replica_survey``); before the survey's first round (a fault in the first step after a
        fresh start) the world is the bound, and replicas that differ there are a conflict: loud."""
        tensors = [sd]
        if isinstance(getattr(obj, "param_groups", None), list):
            tensors.append([p for group in obj.param_groups for p in group["params"]])
        bound = replica_set({name: tensors}, self.state.declared, rank, world, self.state.pipeline_groups)
        if self.state.declared.get(name) is None:  # nothing declared: only the ranks found to hold the same
            bound &= self.state.found_replicas.of(name, rank, world) | {rank}
        return bound

    def choose_snapshots_again(self, rank: int, world: int) -> None:
        """What this rank holds alone may have changed since its snapshots were chosen in this
        generation (its pipeline stages' groups became known in its first pipeline step): its next
        snapshot carries it."""
        state, snapshots = self.state, self.snapshots
        if not state.in_sandbox and snapshots.remote_generation == state.generation:
            snapshots.set_remote(self.unreplicated(rank, world), state.generation)

    def gather_holdings(self, pg, rank: int, world: int, rebuild: frozenset) -> list:
        """Every rank says what it holds (``recovery.Holding``) and which subgroups it cannot
        keep, in one all-gather over the new world."""
        state, snapshots = self.state, self.snapshots
        snapshots.wait_idle()
        objects = self.object_states(rank, world)
        snapshots.set_remote((name for name, o in objects.items() if o.replicas == {rank}), state.generation)
        mine = Holding(
            rank,
            -1 if state.step is None else state.step,
            objects,
            per_rank=bool(state.per_rank),
            local=snapshots.local_digests(),
            held=snapshots.server.held(),
            stripes=snapshots.server.stripes_held(),
            rebuild=rebuild,
            found=state.found_replicas if state.step is not None else None,
        )
        return allgather_objects(pg, world, mine)

    def recover(self, pg, rank: int, holdings: list) -> bool:
        """Every rank computes the same ``recovery.plan_recovery`` from the holdings. Ranks that
        can return to the chosen step from their own snapshot do; the others receive each
        object from a live replica or from their snapshot's holder, and their per-rank state
        with it."""
        state, snapshots = self.state, self.snapshots
        plan = plan_recovery(holdings)
        self._adopt_survey(holdings, rank, len(holdings))
        if plan.tried:
            log.info(f"steps the job cannot continue from: {'; '.join(f'{s}: {why}' for s, why in plan.tried.items())}")
        if plan.conflicts:
            a, b = plan.conflicts[0]
            raise StateLost(
                f"ranks {a} and {b} should hold the same state (the registered objects were found or declared "
                f"replicated across them) but it differs at step {plan.step}: declare which ranks replicate it, e.g. "
                f"job.register(model=m, replicas=dp_group)",
                plan.step,
                [a, b],
            )
        if plan.step < 0:
            raise StateLost(
                "no live rank holds any training state (every process of this generation is new)", -1, list(range(len(holdings)))
            )
        if plan.missing:
            raise StateLost(
                f"no live rank and no snapshot holds the state of rank(s) {plan.missing} at step {plan.step} (every replica "
                f"and both copies of its snapshot are gone: two neighbouring nodes lost at once, or snapshots are off; "
                f"{plan.lacking()})",
                plan.step,
                plan.missing,
            )
        if plan.step < plan.newest:
            log.info(
                f"continuing from step {plan.step}, {plan.newest - plan.step} step(s) run again (the newest step a rank "
                f"held was {plan.newest}; see the steps above for why not that one)"
            )
        if rank in plan.restore:
            t0 = time.perf_counter()
            snapshots.restore(plan.step, state.objects, state.per_rank)
            state.step = plan.step
            log.info(f"returned to step {plan.step} from this rank's own snapshot in {(time.perf_counter() - t0) * 1000:.0f} ms")
        sends = [(dst, names) for dst, sources in sorted(plan.live.items()) for src, names in sorted(sources.items()) if src == rank]
        sender = _Background(lambda: self._send_live(pg, sends))
        received = False
        try:
            if rank in plan.receivers:
                self._receive(pg, rank, plan)
                received = True
        finally:
            sender.join()
        snapshots.settle(plan.step)  # every rank: nothing of a later step may ever be returned to
        if snapshots.needs_resend(plan.step, holdings):
            snapshots.resend(plan.step, state.objects, state.per_rank.states_now())
        holder = next((h.rank for h in holdings if rank in h.held), None)
        ours = holdings[holder].held.get(rank, {}) if holder is not None else {}
        if state.per_rank and not (ours.get("mirrors") or {}).get(plan.step):
            tag, exact, record = state.per_rank.record_now(plan.step)
            snapshots.publish_mirror(tag, exact, record)
        return received

    def _adopt_survey(self, holdings: list, rank: int, world: int) -> None:
        """Every rank continues with the most complete replica survey any rank brought (a
        joiner has none; a rank whose last round's all-gather failed has one round fewer), so
        that all run the same rounds from here; what this rank snapshots follows it."""
        state = self.state
        found = most_surveyed(h.found for h in holdings)
        if found is None or found == state.found_replicas:
            return  # a survivor (every rank of an ordinary job): nothing to do on the recovery's path
        state.found_replicas = found
        narrowed = [n for n in state.objects if state.declared.get(n) is None and len(found.of(n, rank, world)) < world]
        if narrowed:  # only what the survey found held by fewer than the world can have become this rank's own
            self.snapshots.set_remote(self.unreplicated(rank, world), state.generation)

    def _send_live(self, pg, sends: list) -> None:
        """This rank's part of the plan's live transfers: the named objects to each receiver."""
        state = self.state
        for dst, names in sends:
            t0 = time.perf_counter()
            sent = send_state(pg, dst, {n: state.objects[n] for n in names}, state.step)
            log.info(
                f"sent the training state of step {state.step} ({'+'.join(names)}, {human_size(sent)}) to rank {dst} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )

    def _receive(self, pg, rank: int, plan) -> None:
        """Assemble this rank's state at ``plan.step``: objects from live replicas, from its
        snapshot's holder, and its per-rank state. Received in place: until it is complete this
        rank holds no step at all, so a transfer cut short never makes it a source of half-written
        state."""
        state, snapshots = self.state, self.snapshots
        state.step = None
        for src, names in sorted(plan.live.get(rank, {}).items()):
            t0 = time.perf_counter()
            step, got = recv_state(pg, src, {n: state.objects[n] for n in names})
            log.info(
                f"received the training state of step {step} ({'+'.join(names)}, {human_size(got)}) from rank {src} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        per_rank_done = False
        if rank in plan.images:
            holder, names = plan.images[rank]
            t0 = time.perf_counter()
            image = snapshots.fetch(holder, rank, plan.step, names)
            per_rank_done = self._load_snapshot(image, names)
            log.info(
                f"received this rank's snapshot of step {plan.step} ({'+'.join(names)}, {human_size(image.nbytes)}) "
                f"from rank {holder} in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        if rank in plan.parity:
            group, holders, members, names = plan.parity[rank]
            t0 = time.perf_counter()
            image, moved = snapshots.rebuild(holders, group, rank, plan.step, members)
            per_rank_done = self._load_snapshot(image, names)
            log.info(
                f"rebuilt this rank's snapshot of step {plan.step} ({'+'.join(names) or 'per-rank state'}, {human_size(image.nbytes)}; "
                f"{human_size(moved)} received) from its group's parity on rank(s) {holders} and the snapshots of rank(s) {sorted(members)} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        if rank in plan.mirrors and not per_rank_done:
            holder = plan.mirrors[rank]
            lost = state.per_rank.load_mirror(snapshots.fetch_mirror(holder, rank, plan.step), rank, plan.step)
            if lost:
                raise StateLost(f"{lost}: its RNG or data position exists nowhere else", plan.step, [rank])
        state.step = plan.step

    def _load_snapshot(self, image, names) -> bool:
        """Load ``names`` of a received snapshot and the per-rank state it carries; True if it
        carried per-rank state this rank registered."""
        state = self.state
        if names:
            image.load_into(state.objects, names)
        if image.per_rank is not None and state.per_rank:
            state.per_rank.load(image.per_rank)
            return True
        return False


class _Background:
    """``fn`` on a thread of its own; ``join`` re-raises what it raised."""

    def __init__(self, fn):
        self._error: BaseException | None = None

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 -- re-raised by join()
                self._error = e

        self._thread = threading.Thread(target=run, name="tm-state-send", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
