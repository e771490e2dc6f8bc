"""The in-worker runtime: ``tm_launch.init()``, ``job.register()``, ``job.steps()``.

Under tm-launch (live mode) each worker talks only to its own agent, through the agent's local
TCPStore: the agent writes one *directive* per generation (``node/plan/<gen>``, newest number in
``node/latest``) and the worker reports progress (``worker/<local rank>/status``). The worker never
talks to etcd.

Lifecycle of a worker process:

* **fresh start** (generation 0 or a full restart, ``TM_SANDBOX=0``): ``init`` joins the
  generation's communicator at once, like ``init_process_group``.
* **sandbox** (spares and any process that joins a running job, ``TM_SANDBOX=1``): ``init`` gives
  ``job.group`` a local backend, the script builds its model, DDP and optimizer and runs
  ``--sandbox-steps`` real steps without talking to anyone, then parks in ``steps()``.
* **enter** (at a step boundary, when the agent hands over a newer generation): build the new
  communicators (only those whose membership changed), agree on the newest completed step with
  one allgather, and the ranks behind receive model/optimizer/step from a peer that has it.

Under plain torchrun, or with ``tm-launch --no-live``, ``init`` is ``init_process_group`` and
``steps`` is ``range``.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import gc
import datetime
import json
import math
import os
import pickle
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .groups import LiveGroup, LocalBackend, StepPoison, new_gloo

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its agent dies: a dead node must not keep ranks."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def init(backend: str | None = None):
    """Start this worker's part of the job; returns a ``Job`` (see module docstring)."""
    if os.environ.get("TM_AGENT_STORE"):
        return LiveJob()
    return PlainJob(backend)


class PlainJob:
    """The same API over a normal process group, for torchrun and tm-launch's restart mode."""

    in_sandbox = False

    def __init__(self, backend: str | None):
        if not dist.is_initialized():
            dist.init_process_group(backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"))
        self.group = dist.group.WORLD
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._objects: dict = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def register(self, **objects) -> None:
        self._objects.update(objects)

    def new_group(self, ranks):
        return dist.new_group(list(ranks))

    def steps(self, total: int, start: int = 0):
        yield from range(start, total)


def _log(msg: str) -> None:
    print(f"[tm-launch worker {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


class LiveJob:
    """A worker that survives its peers: substitution happens inside ``steps()``."""

    def __init__(self):
        env = os.environ
        die_with_parent()
        host, port = env["TM_AGENT_STORE"].rsplit(":", 1)
        self.node = env.get("TM_NODE_ID", "")
        self.local_rank = int(env["LOCAL_RANK"])
        self._addr = env.get("TM_LOCAL_ADDR") or None
        self._timeout = float(env.get("TM_COLLECTIVE_TIMEOUT", "120"))
        self._setup_timeout = float(env.get("TM_SETUP_TIMEOUT", "600"))  # joiners may start cold
        self._sandbox_steps = int(env.get("TM_SANDBOX_STEPS", "2"))
        self._agent = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self._agent.set(f"worker/{self.local_rank}/live", "1")
        self._closing = False
        beat_store = self._agent.clone()  # its own connection: a blocked main thread must not stop it
        self._beat = threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True)
        self._beat.start()
        self._stores: dict = {}
        self._objects: dict = {}
        self._subgroups: list[LiveGroup] = []
        self._poison = StepPoison()
        self._step: int | None = None  # completed steps (= next step to run); None: no state yet
        self._pending: dict | None = None  # a planned switch being prepared
        self._step_times: list[float] = []
        self._compute: list[float] = []
        self._window = max(1, int(env.get("TM_STRAGGLER_WINDOW", "20")))
        self._windows: dict[int, float] = {}
        self._last_report = 0.0
        self._latest_file = env.get("TM_LATEST_FILE")
        self._latest_size = -2  # forces the first check through the agent store
        self._state = "sandbox"
        world, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", self.local_rank))
        self.group = LiveGroup(None, rank, world, self._poison)
        self.group.swap(LocalBackend(rank, world), rank, world, -1)
        self._install_world()
        self.in_sandbox = True
        atexit.register(self._close)
        if env.get("TM_SANDBOX", "1") == "0":
            # Every rank of this generation starts here, like init_process_group: DDP's own
            # broadcast from rank 0 makes the state consistent, nothing to agree on.
            self._enter(self._wait_directive(int(env["TM_GENERATION"]) - 1), agree=False)
        self._report(force=True)

    def _heartbeat(self, store) -> None:
        """Tell the agent this process is alive, also while the main thread waits in a collective
        (gloo releases the GIL). A stopped or wedged process stops beating: the agent kills it."""
        key = f"worker/{self.local_rank}/beat"
        while not self._closing:
            try:
                store.set(key, f"{time.time():.3f}")
            except Exception:
                return
            time.sleep(0.5)

    def _close(self) -> None:
        """Release communicators and store clients before interpreter teardown: C++ threads
        (gloo, TCPStore) destroyed during teardown abort the process (SIGABRT)."""
        self._closing = True
        self._beat.join(timeout=2)
        pending = self._pending
        if pending and pending.get("thread") is not None:
            pending["thread"].join(timeout=5)
        self._pending = None
        for g in [*self._subgroups, self.group]:
            g.swap(None, g.rank(), g.size(), g.generation)
        self._stores.clear()
        gc.collect()

    # -- public API ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def generation(self) -> int:
        return self.group.generation

    def register(self, **objects) -> None:
        """Objects with state_dict()/load_state_dict() that a joining rank must receive.

        Optimizers' and LR schedulers' ``step`` is guarded: during a step whose collectives failed
        it does nothing, so the interrupted step leaves no trace and runs again.
        """
        for name, obj in objects.items():
            if isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
                _guard_step(obj, self._poison)
            self._objects[name] = obj

    def new_group(self, ranks) -> LiveGroup:
        """A subgroup (TP/PP/DP style) that is rebuilt only when one of its ranks is replaced."""
        ranks = tuple(sorted(int(r) for r in ranks))
        me = self.rank
        sub = LiveGroup(ranks, ranks.index(me) if me in ranks else -1, len(ranks), self._poison)
        if me in ranks:
            if self.in_sandbox:
                sub.swap(LocalBackend(sub.rank(), len(ranks)), sub.rank(), len(ranks), -1)
            else:
                sub.swap(self._build(ranks, me, self.group.generation), ranks.index(me), len(ranks), self.group.generation)
        self._subgroups.append(sub)
        _register_group(sub, ranks)
        return sub

    def steps(self, total: int, start: int = 0):
        """Yield the next step to run; membership changes take effect between steps."""
        if self.in_sandbox:
            self._state = "warmup"
            # The warm-up must leave no trace: if no live replica holds the state later, this
            # process has to hold exactly what a fresh one would. A CPU copy, only while warming.
            start_state = {name: _cpu_copy(obj.state_dict()) for name, obj in self._objects.items()}
            for i in range(self._sandbox_steps):
                self._report(force=True)
                yield start + i
            self._clear_step_effects()
            for name, state in start_state.items():
                self._objects[name].load_state_dict(state)
            del start_state
            self._park()
        if self._step is None:
            self._step = start
        self._state = "running"
        while True:
            self._boundary()
            if self._step >= total:
                break
            t0 = time.perf_counter()
            self.group.last_submit = 0.0
            self._poison.armed = True
            try:
                yield self._step
            finally:
                self._poison.armed = False
            if self._poison.active:
                continue
            self._record(time.perf_counter() - t0, t0)
            self._step += 1
            self._report()
        self._state = "finished"
        self._report(force=True)

    # -- agent channel ---------------------------------------------------------------------------
    def _report(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_report < 0.25:
            return
        self._last_report = now
        status = {
            "step": self._step, "generation": self.group.generation, "state": self._state,
            "rank": self.rank, "time": now, "pid": os.getpid(),
            "step_time": _median(self._step_times[-20:]), "step_times": self._step_times[-20:],
            "steps_run": len(self._step_times), "compute": self._compute[-20:],
            # completed straggler windows only: {window index: summed compute seconds}
            "windows": {str(w): c for w, c in self._windows.items() if self._step is not None and (w + 1) * self._window <= self._step},
        }
        self._agent.set(f"worker/{self.local_rank}/status", json.dumps(status))

    def _latest(self) -> int:
        return self._agent.add("node/latest", 0)

    def _newer_generation(self) -> bool:
        """Cheap per-step check: the agent appends a line to a file for every generation."""
        try:
            size = os.stat(self._latest_file).st_size if self._latest_file else -1
        except OSError:
            size = -1
        if size == self._latest_size and size >= 0:
            return False
        self._latest_size = size
        return self._latest() > self.group.generation

    def _directive(self, gen: int) -> dict:
        return json.loads(self._agent.get(f"node/plan/{gen}"))

    def _wait_directive(self, after: int, repeat: bool = True) -> dict:
        """Block until the agent hands over a generation newer than ``after``; say so every few
        seconds (once only with ``repeat=False``: a parked spare waits by design)."""
        from .waits import Every

        ticker, said = Every(), False
        while True:
            latest = self._latest()
            if latest > after:
                return self._directive(latest)
            if ticker.due() and (repeat or not said):
                _log(f"waiting for generation > {after} from the agent ({ticker.elapsed:.0f} s so far)")
                said = True
            time.sleep(0.005)

    # -- generations ------------------------------------------------------------------------------
    def _park(self) -> None:
        """A warmed-up spare waits here until a generation names its node."""
        self._state = "parked"
        self._report(force=True)
        after = self.group.generation
        while True:
            d = self._wait_directive(after, repeat=False)
            if d.get("stop"):
                sys.exit(0)
            if d["active"]:
                try:
                    self._enter(d)
                    return
                except _Superseded as newer:  # promoted, then replaced before it got in
                    d = newer.directive
                    self._state = "parked"
                    self._report(force=True)
            after = d["generation"]

    def _boundary(self) -> None:
        if self._poison.active:
            error = self._poison.error
            self._state = "recovering"
            self._report(force=True)
            _log(f"step {self._step} interrupted ({str(error).splitlines()[0][:160]}); waiting for the next generation")
            self._clear_step_effects()
            for g in [self.group, *self._subgroups]:
                g.release_if_broken()
            d = self._wait_directive(self.group.generation)
            self._poison.clear()
            self._follow(d, interrupted=True)
            self._state = "running"
            return
        if self._pending is not None or self._newer_generation():
            latest = self._latest()
            if latest > self.group.generation:
                self._follow(self._directive(latest), interrupted=False)

    def _follow(self, d: dict, interrupted: bool) -> None:
        if d.get("stop"):
            self._leave_job()
        if d.get("planned") and not interrupted and self._planned_switch(d):
            return
        if not d["active"]:
            self._leave_job()
        self._pending = None
        self._enter(d)

    def _leave_job(self) -> None:
        """This node left the job (drained or replaced): end the script without error."""
        self._state = "left"
        self._report(force=True)
        sys.exit(0)

    def _planned_switch(self, d: dict) -> bool:
        """Two-phase migration. Phase 1: agree on a switch step and build the new communicators in
        the background while training goes on in the current generation; phase 2, at that step
        boundary: leavers exit, everyone else swaps communicators and joiners receive state.
        Returns True while this rank should keep training in the current generation."""
        gen = d["generation"]
        if self._pending is None or self._pending["generation"] != gen:
            store = self._store(d["store"])
            margin = max(2, math.ceil(0.5 / max(_median(self._step_times[-20:]) or 0.01, 1e-3)))
            agreed = int(store.compare_set(f"tm/g{gen}/switch", "", str(self._step + margin)))
            built: dict = {}
            thread = None
            if d["active"]:
                rank = d["ranks"][self.local_rank]
                thread = threading.Thread(target=lambda: built.update(world=self._build(None, rank, gen, d)), daemon=True)
                thread.start()
            self._pending = {"generation": gen, "switch": agreed, "thread": thread, "built": built}
            _log(f"planned migration to generation {gen}: switching at step {agreed}")
        if self._step < self._pending["switch"]:
            return True
        pending, self._pending = self._pending, None
        if not d["active"]:
            self._leave_job()
        prebuilt = (pending["thread"], pending["built"]) if pending["thread"] is not None else None
        self._enter(d, prebuilt=prebuilt)
        return True

    def _store(self, where: dict) -> dist.Store:
        key = (where["addr"], int(where["port"]))
        if key not in self._stores:
            self._stores[key] = dist.TCPStore(key[0], key[1], is_master=False, timeout=datetime.timedelta(seconds=self._setup_timeout), wait_for_workers=False)
        return self._stores[key].clone()

    def _build(self, ranks, global_rank: int, gen: int, d: dict | None = None):
        """A communicator for ``ranks`` (None: the world) in generation ``gen``, via a fresh prefix."""
        d = d or self._current
        name = "world" if ranks is None else "sub-" + "-".join(map(str, ranks))
        store = dist.PrefixStore(f"tm/g{gen}/{name}/", self._store(d["store"]))
        if ranks is None:
            return new_gloo(store, global_rank, d["world_size"], self._timeout, self._addr, self._setup_timeout)
        return new_gloo(store, ranks.index(global_rank), len(ranks), self._timeout, self._addr, self._setup_timeout)

    def _enter(self, d: dict, prebuilt=None, agree: bool = True) -> None:
        """Enter generation ``d``; when a peer dies on the way in, enter the generation after it.

        A joiner can die while the others wait for it in the communicator setup (which may wait
        up to the join timeout: joiners can start cold) or fail the agreement/transfer. Either way
        the generation can never complete; the agents publish a newer one (the dead node's
        lease, or this node's report after a while), and this process follows it instead of
        waiting out the setup timeout or crashing with the training state that only it holds."""
        while True:
            try:
                self._enter_once(d, prebuilt, agree)
                return
            except _Superseded as newer:
                _log(f"generation {d['generation']} was superseded by {newer.directive['generation']} while entering it")
                d = newer.directive
            except RuntimeError as e:  # gloo/store errors: a peer died while entering
                self._state = "recovering"
                self._report(force=True)
                _log(f"entering generation {d['generation']} failed ({str(e).splitlines()[0][:160]}); waiting for the next generation")
                d = self._wait_directive(d["generation"])
            prebuilt, agree = None, True
            if d.get("stop"):
                self._leave_job()
            if not d["active"]:
                if self.in_sandbox:
                    raise _Superseded(d)  # a spare that is no longer promoted parks again
                self._leave_job()

    def _build_watching(self, ranks, global_rank: int, gen: int, d: dict, pending=None):
        """``_build`` in a thread while this one watches for a newer generation: the setup waits
        for every member, so a member that died would otherwise hold this process for the whole
        setup timeout. An abandoned build is left to fail at its own timeout (a daemon thread)."""
        box: dict = {}
        if pending is None:
            def work():
                try:
                    box["pg"] = self._build(ranks, global_rank, gen, d)
                except BaseException as e:  # noqa: BLE001 -- handed to the main thread
                    box["error"] = e
            pending = threading.Thread(target=work, daemon=True)
            pending.start()
        else:
            pending, box = pending
        while pending.is_alive():
            pending.join(0.01)
            if pending.is_alive() and self._latest() > gen:
                raise _Superseded(self._directive(self._latest()))
        if "error" in box:
            raise box["error"]
        return box.get("pg") or box.get("world")

    def _enter_once(self, d: dict, prebuilt=None, agree: bool = True) -> None:
        t0 = time.perf_counter()
        gen, rank, world = d["generation"], d["ranks"][self.local_rank], d["world_size"]
        self._current = d
        old_rank = self.rank
        if isinstance(prebuilt, tuple):  # a planned switch's background build: (thread, box)
            prebuilt = self._build_watching(None, rank, gen, d, pending=prebuilt)
        elif prebuilt is None and not self.in_sandbox:
            # Unplanned: a peer may still be blocked in a collective of the old world with this
            # rank (it moved on at a healthy boundary, e.g. a cordoned node's plan arrived
            # mid-step); closing it here makes that peer fail now instead of both sides waiting
            # for each other, the peer in the old collective and this rank in the new setup.
            self.group.release()
        inner = prebuilt or self._build_watching(None, rank, gen, d)
        self.group.swap(inner, rank, world, gen)
        _register_group(self.group, None)
        self._rebuild_subgroups(d, rank, old_rank)
        t_comm = time.perf_counter()
        received = self._agree_and_transfer(inner, rank, world) if agree else False
        self.in_sandbox = False
        t_done = time.perf_counter()
        self._agent.set(
            f"worker/{self.local_rank}/entered/{gen}",
            json.dumps({"communicator": t_comm - t0, "state": t_done - t_comm, "received": received, "step": self._step}),
        )
        self._report(force=True)

    def _rebuild_subgroups(self, d: dict, rank: int, old_rank: int) -> None:
        """Delta communicator setup: a subgroup is rebuilt only when one of its ranks is served by
        a new process (a joiner), when it failed, or when this process took a new rank; the
        others keep their communicator object and its connections."""
        joiners = set(d.get("joiner_ranks", []))
        for sub in sorted(self._subgroups, key=lambda g: g.member_ranks):
            ranks = sub.member_ranks
            if rank not in ranks:
                if sub.inner is not None:
                    sub.swap(None, -1, len(ranks), d["generation"])  # not a member (any more)
                continue
            fresh = (
                d.get("all_fresh") or rank != old_rank or sub.inner is None
                or isinstance(sub.inner, LocalBackend) or joiners.intersection(ranks)
            )
            if fresh:
                sub.swap(self._build_watching(ranks, rank, d["generation"], d), ranks.index(rank), len(ranks), d["generation"])

    def _agree_and_transfer(self, pg, rank: int, world: int) -> bool:
        """One allgather of completed steps; ranks behind receive state from the first rank ahead."""
        mine = torch.tensor([-1 if self._step is None else self._step], dtype=torch.int64)
        outs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        pg.allgather([outs], [mine]).wait()
        steps = [int(t.item()) for t in outs]
        best = max(steps)
        src = steps.index(best)
        if best < 0:
            _log("no live replica holds training state: every rank starts from the script's own state (step 'start')")
        receivers = [r for r, s in enumerate(steps) if s < best or best < 0 and r != src]
        what = "+".join(sorted(self._objects)) or "nothing registered"
        if rank == src:
            for r in receivers:
                t0 = time.perf_counter()
                sent = _send_state(pg, r, self._objects, self._step)
                _log(f"sent the training state of step {self._step} ({what}, {_size(sent)}) to rank {r} in {(time.perf_counter() - t0) * 1000:.0f} ms")
        elif rank in receivers:
            t0 = time.perf_counter()
            step, got = _recv_state(pg, src, self._objects)
            _log(f"received the training state of step {step} ({what}, {_size(got)}) from rank {src} in {(time.perf_counter() - t0) * 1000:.0f} ms")
            self._step = step
            return True
        return False

    def _clear_step_effects(self) -> None:
        """Discard what an interrupted (or sandbox) step left: gradients and DDP's reduction state."""
        for obj in self._objects.values():
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    p.grad = None
                reducer = getattr(obj, "reducer", None)
                if reducer is not None:
                    reducer._reset_state()
            elif isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)

    def _record(self, seconds: float, t0: float) -> None:
        """Step time, and compute time = step time minus the wait in the step's last collective:
        peers of a straggler wait for it there, the straggler does not (C4's observation)."""
        self._step_times.append(seconds)
        submit, complete = self.group.last_submit, self.group.last_complete
        waited = complete - submit if submit > t0 and complete > submit else 0.0
        compute = max(seconds - waited, 0.0)
        self._compute.append(compute)
        window = self._step // self._window
        self._windows[window] = self._windows.get(window, 0.0) + compute
        for old in [w for w in self._windows if w < window - 3]:
            del self._windows[old]
        if len(self._step_times) > 200:
            del self._step_times[:100], self._compute[:100]

    def _install_world(self) -> None:
        """Make ``job.group`` the default group, so dist.get_rank() and dist.all_reduce(t) work."""
        c10d._update_default_pg(self.group)
        c10d._world.pg_map[self.group] = ("gloo", None)
        c10d._world.pg_names[self.group] = "tm-world"
        c10d._world.pg_backend_config[self.group] = "cpu:gloo"
        _register_group(self.group, None)


class _Superseded(Exception):
    """A newer generation arrived while this process was entering an older one."""

    def __init__(self, directive: dict):
        super().__init__(f"generation {directive['generation']}")
        self.directive = directive


def _register_group(group: LiveGroup, ranks) -> None:
    members = range(group.size()) if ranks is None else ranks
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(members)}
    c10d._world.pg_map.setdefault(group, ("gloo", None))
    c10d._world.pg_names.setdefault(group, f"tm-sub-{'-'.join(map(str, members))}")
    c10d._world.pg_backend_config.setdefault(group, "cpu:gloo")


def _guard_step(optimizer, poison: StepPoison) -> None:
    original = optimizer.step

    def step(*args, **kwargs):
        if poison.active:
            return None
        return original(*args, **kwargs)

    optimizer.step = step


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


# -- state transfer ------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _transfer_progress(verb: str, peer: str, total: int):
    """A callback that says every few seconds how far a long state transfer is (a big model over
    a slow link must not look like a hang); silent for transfers shorter than that."""
    from .waits import Every

    ticker = Every()
    done = [0]

    def step(nbytes: int) -> None:
        done[0] += nbytes
        if ticker.due():
            _log(f"{verb} training state {peer}: {_size(done[0])} of {_size(total)} after {ticker.elapsed:.0f} s")

    return step


def _flatten(obj, tensors: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return ("__tensor__", len(tensors) - 1, tuple(obj.shape), str(obj.dtype).replace("torch.", ""))
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj, tensors: list):
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__tensor__":
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unflatten(v, tensors) for v in obj)
    return obj


def _send_state(pg, dst: int, objects: dict, step: int | None) -> int:
    """Send ``objects``' state dicts to rank ``dst``; returns the bytes sent."""
    tensors: list = []
    skeleton = {name: _flatten(obj.state_dict(), tensors) for name, obj in sorted(objects.items())}
    header = pickle.dumps({"step": step, "skeleton": skeleton, "count": len(tensors)})
    buf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    total = buf.numel() + sum(t.numel() * t.element_size() for t in tensors)
    progress = _transfer_progress("sending", f"to rank {dst}", total)
    pg.send([torch.tensor([buf.numel()], dtype=torch.int64)], dst, 0).wait()
    pg.send([buf], dst, 0).wait()
    for t in tensors:
        pg.send([t], dst, 0).wait()
        progress(t.numel() * t.element_size())
    return total


def _recv_state(pg, src: int, objects: dict) -> tuple[int | None, int]:
    """Receive state dicts from rank ``src`` into ``objects``; returns (step, bytes received)."""
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, 0).wait()
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.recv([buf], src, 0).wait()
    header = pickle.loads(buf.numpy().tobytes())
    metas: list = []

    def collect(obj):
        if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__tensor__":
            metas.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                collect(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                collect(v)

    collect(header["skeleton"])
    tensors = [None] * header["count"]
    ordered = sorted(metas, key=lambda m: m[1])
    empty = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, _, shape, dtype in ordered]
    total = buf.numel() + sum(t.numel() * t.element_size() for t in empty)
    progress = _transfer_progress("receiving", f"from rank {src}", total)
    for (_, index, _, _), t in zip(ordered, empty):
        pg.recv([t], src, 0).wait()
        tensors[index] = t
        progress(t.numel() * t.element_size())
    for name, skeleton in header["skeleton"].items():
        if name in objects:
            objects[name].load_state_dict(_unflatten(skeleton, tensors))
    return header["step"], total
