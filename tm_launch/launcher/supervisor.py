"""This node's worker processes and the agent store they report through (the agent's side of
``tm_launch.protocol``).

Starts and stops workers, hands each generation to them (``direct``), reads what they report
(status, heartbeat, entry into a generation, the live API in use) and kills a worker whose
heartbeat stopped. Everything here is local to the node (processes and the agent's TCPStore):
it keeps working while etcd is down, which is what the fencing rule relies on.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from rendezvous.plan import Plan

from .. import collective_page, settings
from ..collective_page import page_path
from ..protocol import (
    LATEST,
    Directive,
    EnteredRecord,
    FirstStepRecord,
    RefusedRecord,
    ScriptErrorRecord,
    StateLostRecord,
    StoreAddress,
    WorkerEnv,
    WorkerKeys,
    WorkerState,
    WorkerStatus,
    directive_key,
    nccl_error_handling,
)
from . import store_server
from .config import AgentConfig
from .processes import OutputSpec, WorkerSet
from .progress_probe import ProgressProbe
from .wakeup import WakeSocket, Wakeup


class WorkerSupervisor:
    def __init__(self, cfg: AgentConfig, say: Callable[..., None], wakeup: Wakeup | None = None):
        self.cfg = cfg
        self.say = say
        self.store = store_server.serve(cfg.addr)  # local workers, and the generations it hosts
        wakeup = wakeup or Wakeup()  # nobody waits on it: parts tested without a loop
        self.wake_socket = WakeSocket(wakeup)  # workers poke it right after a report the agent acts on
        self.scratch = tempfile.mkdtemp(prefix="tm-launch-")  # error files when there is no --log-dir
        self.workers = WorkerSet(
            cfg.cmd, cfg.output or OutputSpec(role=cfg.role), cfg.run_id, self.scratch, on_exit=lambda: wakeup.set("worker exit")
        )
        self.live_seen = False  # a local worker said it uses the live API (tm_launch.init)
        self.step_seen: tuple[dict, float] = ({}, time.time())  # local workers' steps, when they last moved
        self._statuses_cache: dict | None = None
        self._parsed: dict[int, tuple[bytes, WorkerStatus]] = {}  # local rank -> (its status as read, parsed): parsed once
        self.directed_at: dict[int, float] = {}  # generation -> when it was first handed to the workers
        self.progress = ProgressProbe()  # the workers' CPU, I/O and main-thread movement (busy, stuck, frozen)
        self._silent_said: dict[int, tuple[int, int]] = {}  # local rank -> (generation, minute) of its last busy-while-silent report

    def close(self) -> None:
        self.workers.stop(grace=2)
        self.wake_socket.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    # -- what the workers report ----------------------------------------------------------------
    def new_iteration(self) -> None:
        """Forget the statuses read in the previous loop iteration."""
        self._statuses_cache = None

    def statuses(self) -> dict[int, WorkerStatus]:
        """This node's workers' last reports (read once per loop iteration)."""
        if self._statuses_cache is not None:
            return self._statuses_cache
        out = {}
        for lr in self.workers.workers:
            status = self.status_now(lr)
            if status is not None:
                out[lr] = status
        self._statuses_cache = out
        return out

    def status_now(self, local_rank: int) -> WorkerStatus | None:
        """One worker's last report, read now (not this iteration's copy, ``statuses``): e.g.
        what it said just before it began to exit. None without a readable one."""
        key = WorkerKeys(local_rank).status
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        parsed = self._parsed.get(local_rank)
        if parsed is not None and parsed[0] == raw:  # unchanged since the last read (most of them)
            return parsed[1]
        try:
            status = WorkerStatus.from_json(raw)
        except (ValueError, TypeError):
            return None
        self._parsed[local_rank] = (raw, status)
        return status

    def recovering(self) -> bool:
        """A local worker saw a collective fail (or could not enter its generation) and waits
        for a new generation."""
        return any(s.state == WorkerState.RECOVERING for s in self.statuses().values())

    def recovering_why(self) -> str:
        """What made a local worker wait for a new generation, in its own words ('' if none said)."""
        return next((s.why for s in self.statuses().values() if s.state == WorkerState.RECOVERING), "")

    def waiting_for_peers(self) -> bool:
        """A local worker's commit vote has waited long for its peers: one may be dead."""
        return any(s.waiting_for_peers for s in self.statuses().values())

    def local_progress(self) -> tuple[bool, float | None]:
        """(a local worker is recovering from a failed collective, seconds since a local worker
        last finished a step, None without running workers). Local store only: works without etcd."""
        if not self.workers:
            return False, None
        self._statuses_cache = None
        statuses = self.statuses()
        steps = {lr: s.step for lr, s in statuses.items()}
        now = time.time()
        if steps != self.step_seen[0]:
            self.step_seen = (steps, now)
        recovering = self.recovering()
        running = recovering or any(s.state == WorkerState.RUNNING for s in statuses.values())
        return recovering, (now - self.step_seen[1]) if running else None

    def note_live(self) -> bool:
        """True the first time a local worker says it uses the live API (never under --no-live)."""
        if self.live_seen or self.cfg.no_live:
            return False
        for lr in self.workers.workers:
            if self.store.check([WorkerKeys(lr).live]):
                self.live_seen = True
                return True
        return False

    def state_lost(self, local_rank: int) -> StateLostRecord | None:
        """What a worker said before it ended because no live rank holds some rank's state."""
        return self._last_word(WorkerKeys(local_rank).state_lost, StateLostRecord)

    def refused(self, local_rank: int) -> RefusedRecord | None:
        """Why a worker refused to run (the job cannot run as configured), if it said so."""
        return self._last_word(WorkerKeys(local_rank).refused, RefusedRecord)

    def script_error(self, local_rank: int) -> ScriptErrorRecord | None:
        """What a worker's script raised before it ended, if it said so (``worker.exit_notice.script_raised``)."""
        return self._last_word(WorkerKeys(local_rank).script_error, ScriptErrorRecord)

    def _last_word(self, key: str, record):
        """The record a worker left under ``key`` before it ended; None if none or unreadable."""
        if not self.store.check([key]):
            return None
        try:
            return record.from_json(self.store.get(key))
        except (ValueError, TypeError):
            return None

    def entered(self, generation: int) -> list[EnteredRecord] | None:
        """Every local worker's record of entering ``generation``; None until all have entered."""
        return self._from_every_worker(lambda keys: keys.entered(generation), EnteredRecord)

    def first_steps(self, generation: int) -> list[FirstStepRecord] | None:
        """Every local worker's first completed step in ``generation``; None until all have one."""
        return self._from_every_worker(lambda keys: keys.first_step(generation), FirstStepRecord)

    def _from_every_worker(self, key_of, record):
        records = []
        for lr in self.workers.workers:
            key = key_of(WorkerKeys(lr))
            if not self.store.check([key]):
                return None
            records.append(record.from_json(self.store.get(key)))
        return records or None

    def any_entered(self, generation: int) -> bool:
        return any(self.store.check([WorkerKeys(lr).entered(generation)]) for lr in self.workers.workers)

    def watch_hangs(self, plan: Plan) -> None:
        """Kill a worker that stopped beating (SIGSTOP, a wedged process): its peers then fail
        fast and the node is replaced (live) or every worker restarts (restart mode). A worker
        waiting in a collective keeps beating, so ranks blocked on a hung peer are never
        mistaken for the hung one. Only workers that run steps are watched (``WorkerState.watched``)."""
        cfg = self.cfg.health
        if cfg is None:
            return
        from health.hang import hang_timeout
        from health.progress import BUSY

        now = time.time()
        pids = self.workers.pids()
        for lr, status in self.statuses().items():
            if not status.state.watched or lr not in self.workers.workers:
                continue
            pid = pids.get(lr)
            page = collective_page.read(page_path(self.scratch, lr))
            page = page if page is not None and page.pid == pid else None
            if pid is not None:
                self.progress.look(pid, page.moves if page is not None else -1)  # every iteration: the evidence's history
            key = WorkerKeys(lr).beat
            if not self.store.check([key]):
                continue
            silent = now - float(self.store.get(key))
            recent = status.step_times or ([status.step_time] if status.step_time else [])
            saving = page is not None and page.saving_since > 0
            limit = hang_timeout(cfg, recent, status.steps_run or 0, saving)
            worker = self.workers.workers[lr]
            if silent > limit and pid is not None:
                kind, _, progress = self.progress.judge(pid, silent)
                if kind == BUSY:
                    # A silent heartbeat while its CPU time moves: a long call holding the
                    # interpreter (a big pickle). Torch would wait for it until its collective
                    # timeout: the one its groups run under (its page, or restart mode's status).
                    timeout = page.timeout if page is not None and page.timeout > 0 else status.collective_timeout
                    timeout = timeout or settings.collective_timeout(self.cfg.collective_timeout, "gloo")
                    self._say_silent_but_busy(plan, lr, silent, progress, page)
                    limit = max(limit, timeout)
            # Killed already, or dying: its exit notice wakes this loop while the kernel still
            # frees its memory (the process is not reaped yet); one kill, one hang event.
            if silent > limit and worker.poll() is None and not worker.killed and not worker.began_to_exit():
                self.say(
                    f"generation {plan.generation}: worker {lr} (pid {pid}) silent for {silent:.1f}s (hang limit {limit:.1f}s): killing it",
                    kind="hang",
                    generation=plan.generation,
                    local_rank=lr,
                )
                self.workers.kill(lr)
        self.progress.forget(set(pids.values()))

    def _say_silent_but_busy(self, plan: Plan, local_rank: int, silent: float, progress, page) -> None:
        """Once a minute: a worker's heartbeat is silent, but it makes progress (a ``busy`` event)."""
        minute = int(silent // 60)
        if self._silent_said.get(local_rank) == (plan.generation, minute):
            return
        self._silent_said[local_rank] = (plan.generation, minute)
        moved = list(progress.evidence) if progress is not None else []
        where = page.where if page is not None else ""
        self.say(
            f"generation {plan.generation}: worker {local_rank}'s heartbeat is silent for {silent:.0f}s, but it is busy "
            f"({', '.join(moved) or 'moving'}{', in ' + where if where else ''}): not killed before its collective timeout",
            kind="busy",
            generation=plan.generation,
            local_rank=local_rank,
            verdict="busy",
            evidence={"silent": round(silent, 3), "moved": moved, "where": where},
        )

    def root_cause(self, ranks: list[int]) -> str:
        """Print torchrun's root-cause block for the failed workers; its one-line summary.
        ``ranks``: the global rank of each local rank."""
        block, line = self.workers.failure_report(ranks)
        if block:
            print(block, file=sys.stderr, flush=True)
        return line

    # -- starting and directing ------------------------------------------------------------------
    def direct(self, plan: Plan) -> None:
        """Hand generation ``plan`` to this node's workers through the local store."""
        me = self.cfg.node_id
        self.directed_at.setdefault(plan.generation, time.time())  # before the write: workers act on it at once
        directive = Directive(
            generation=plan.generation,
            active=me in plan.nodes,
            ranks=tuple(plan.ranks(me)),
            group_rank=plan.group_rank(me),
            world_size=plan.world_size,
            store=StoreAddress.from_plan(plan.store),
            standby=StoreAddress.from_plan(plan.store.get("standby")),
            joiner_ranks=tuple(r for n in plan.joiners for r in plan.ranks(n)),
            all_fresh=set(plan.joiners) >= set(plan.nodes),
            planned=plan.planned,
            live=plan.live,
            stop=plan.finished,
            cause=plan.cause,
        )
        self.store.set(directive_key(plan.generation), directive.to_json())
        current = self.store.add(LATEST, 0)
        if plan.generation > current:
            self.store.add(LATEST, plan.generation - current)
            for lr in range(self.cfg.nproc):  # wakes each worker's watch thread (tm_launch.worker.agent_client)
                self.store.queue_push(WorkerKeys(lr).directives, str(plan.generation))

    def start(self, plan: Plan, sandbox: bool, master: tuple[str, int] | None) -> None:
        """Start this node's workers for ``plan`` (already directed): sandboxed warm spares, or
        fresh workers bootstrapping through the env:// store at ``master``."""
        envs = {lr: self.env(plan, lr, sandbox) for lr in range(self.cfg.nproc)}
        if master:
            for env in envs.values():
                env["MASTER_ADDR"], env["MASTER_PORT"] = master[0], str(master[1])
        for lr in range(self.cfg.nproc):
            # The previous process's last status and heartbeat must not be read as the new
            # one's: the hang watchdog would kill a worker that is still starting up.
            for key in WorkerKeys(lr).restarted():
                self.store.delete_key(key)
        self._statuses_cache = None
        self.workers.start(envs, plan.generation, "sandbox" if sandbox else "fresh")

    def stop(self, why: str) -> None:
        if self.workers:
            self.say(f"stopping {len(self.workers.workers)} worker(s): {why}")
            self.workers.stop()

    def env(self, plan: Plan, local_rank: int, sandbox: bool) -> dict[str, str]:
        me, cfg = self.cfg.node_id, self.cfg
        ranks = plan.ranks(me) or list(range(cfg.nproc))
        group_rank = plan.group_rank(me)
        env = dict(os.environ)
        env.update(
            {
                "LOCAL_RANK": str(local_rank),
                "RANK": str(ranks[local_rank]),
                "GROUP_RANK": str(group_rank if group_rank is not None else -1),
                "ROLE_RANK": str(ranks[local_rank]),
                "ROLE_NAME": cfg.role,
                "LOCAL_WORLD_SIZE": str(cfg.nproc),
                "WORLD_SIZE": str(plan.world_size),
                "GROUP_WORLD_SIZE": str(len(plan.nodes)),
                "ROLE_WORLD_SIZE": str(plan.world_size),
                "MASTER_ADDR": str(plan.store.get("addr", "")),
                "MASTER_PORT": str(plan.store.get("port", "")),
                "TORCHELASTIC_RESTART_COUNT": str(self.workers.restarts),  # this agent's, as torchrun
                "TORCHELASTIC_MAX_RESTARTS": str(cfg.limits.max_restarts),
                "TORCHELASTIC_RUN_ID": cfg.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                # torchrun's (a live worker sets its own when it starts live mode:
                # tm_launch.worker.comms.communicators.live_process_environment)
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": nccl_error_handling(False, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")),
                "TORCHELASTIC_ERROR_FILE": self.workers.error_file(local_rank),
            }
        )
        # Every worker reports to this agent; under --no-live TM_NO_LIVE keeps it in restart
        # mode (tm_launch.init() gives a PlainJob, which never goes live).
        env.pop("TM_NO_LIVE", None)
        env.update(
            WorkerEnv(
                agent_store=f"{cfg.addr}:{self.store.port}",
                wake=self.wake_socket.address,
                local_addr=cfg.addr,
                generation=plan.generation,
                sandbox=sandbox,
                straggler_window=cfg.health.straggler_window if cfg.health else 20,
                **settings.to_worker(cfg),  # every setting that reaches the workers (tm_launch.settings)
                telemetry=page_path(self.scratch, local_rank) if not cfg.no_live else "",
            ).tm_variables()
        )
        return env
