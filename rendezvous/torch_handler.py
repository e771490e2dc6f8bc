"""tm-launch's etcd-v3 rendezvous as a torchrun backend: ``torchrun --rdzv-backend etcd-v3``.

Registered through the ``torchrun.handlers`` entry point (``handler_factory``). Same state as
tm-launch's own agent: every node registers a leased ``NodeInfo`` with ``Membership``, and the
pure planner decides each generation, published by compare-and-swap. torchrun's agent stays in
charge of worker processes and restarts; this handler only answers "who is in the next round".

Semantics, after torch's ``DynamicRendezvousHandler``:

* Every ``next_rendezvous()`` is a new round = a new generation. A node whose round is still the
  current plan asks for a new one by reporting to the planner; a node that finds a newer plan
  naming it joins that one. A round completes once every node of the plan has acknowledged it in
  the generation's store (a barrier); while waiting, the planner keeps running, so a node that
  dies mid-round is dropped or replaced by a spare once its lease expires.
* Nodes beyond ``--nnodes MAX`` are spares: they wait in ``next_rendezvous()`` without timeout
  (torch's redundancy list) until a plan names them, and exit 0 when the job finishes
  (``SystemExit(0)``: torch's ``RendezvousGracefulExitError`` crashes torchrun 2.13's launcher).
  ``num_nodes_waiting()`` counts what warrants a new round (a newer plan, a lost, cordoned or
  draining node, room to scale up); a spare at MAX does not count, as in torch, or every agent
  would restart its workers forever. ``num_spares()`` counts spares.
* torchrun's agent never says whose fault a worker failure was, so a restart request never evicts
  a live node: spares replace nodes whose lease expired, that are cordoned or draining
  (``tm-launch ctl``). ``--max-restarts`` stays torchrun's (per agent); the planner's job-wide
  budget is unused. ``Plan.nproc`` is 0: torchrun's agent assigns worker ranks itself.
* Store: every handler hosts a TCPStore (its ``NodeInfo.store_port``); the plan names which one
  serves a generation, under a fresh prefix ``/torchelastic/gen<N>/``. ``use_agent_store`` is
  False: with it, torch 2.13 workers use the agent's TCPStore with no prefix, so a second round
  would read the first one's keys; instead the rank-0 worker hosts its own (new MASTER_PORT).
* ``shutdown()`` closes the rendezvous (publishes a finished plan) only if this node is active.

``--rdzv-conf``: cacert, cert, key, user, password_file, protocol, read_timeout (etcd request
timeout, s), join_timeout / timeout (round timeout, default 600), last_call_timeout (default 30),
lease_ttl (default 5).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from .kv import KVError, connect
from .membership import Membership
from .plan import SUCCEEDED, NodeInfo, Plan
from .planner import Limits, View, next_plan, spares
from .rdzv_conf import etcd_options

log = logging.getLogger(__name__)
_ETCD_KEYS = ("cacert", "cert", "key", "user", "password_file", "protocol")
_OWN_KEYS = ("read_timeout", "join_timeout", "timeout", "last_call_timeout", "lease_ttl")


def _is_loopback(endpoint: str) -> bool:
    host = endpoint.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class EtcdV3RendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters):
        conf = params.config
        unknown = sorted(set(conf) - set(_ETCD_KEYS) - set(_OWN_KEYS))
        if unknown:
            log.warning("etcd-v3 rendezvous ignores --rdzv-conf keys %s", unknown)
        etcd_conf = {k: conf[k] for k in _ETCD_KEYS if k in conf}
        if "read_timeout" in conf:  # torchrun's "timeout" is the round timeout, not a request's
            etcd_conf["timeout"] = conf["read_timeout"]
        self._options = etcd_options(params.endpoint, params.run_id, etcd_conf)
        self._run_id = params.run_id
        self._join_timeout = float(conf.get("join_timeout", conf.get("timeout", 600)))
        self._last_call = float(conf.get("last_call_timeout", 30))
        self._ttl = float(conf.get("lease_ttl", 5))
        self._limits = Limits(min_nodes=params.min_nodes, max_nodes=params.max_nodes, nproc=0, max_restarts=1 << 30)
        try:
            self._kv = connect("v3", self._options)
        except KVError as e:
            raise RendezvousConnectionError(str(e)) from e
        self._m = Membership(self._kv)
        loopback = all(map(_is_loopback, self._options.endpoints))
        self.addr = params.local_addr or ("127.0.0.1" if loopback else socket.getfqdn())
        self._server = dist.TCPStore(self.addr, 0, is_master=True, wait_for_workers=False)
        self.node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        # nproc is unknown here (torchrun's agent assigns worker ranks itself): recorded as 0.
        self._info = NodeInfo(
            id=self.node,
            host=socket.gethostname(),
            addr=self.addr,
            store_port=self._server.port,
            nproc=0,
            pid=os.getpid(),
            joined=time.time(),
        )
        self._lease_m = Membership(connect("v3", self._options))  # the lease thread's own HTTP session
        self._lease = self._lease_m.register(self._info, self._ttl)
        self._gen: int | None = None  # generation this node last joined
        self._min_since: float | None = None  # when MIN nodes were first seen (last call)
        self._waiting = (0.0, 0)  # num_nodes_waiting() cache: (time, value)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="tm-rdzv-lease", daemon=True)
        self._thread.start()

    # -- lease --------------------------------------------------------------------------------
    def _keepalive(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                if not self._lease.refresh() and not self._stop.is_set():
                    log.warning("etcd lease of node %s expired; registering again", self.node)
                    self._lease = self._lease_m.register(self._info, self._ttl)
            except (KVError, ValueError) as e:
                log.warning("etcd lease refresh failed: %s", e)

    # -- planning -----------------------------------------------------------------------------
    def _view(self, view: View) -> View:
        """The planner's input under this backend's policy (see the module docstring)."""
        plan = view.plan
        if plan is None:
            ready = len(spares(view)) >= self._limits.min_nodes
            self._min_since = (self._min_since or time.monotonic()) if ready else None
            passed = ready and time.monotonic() - self._min_since >= self._last_call
            return dataclasses.replace(view, last_call_passed=passed)
        if any(n not in view.alive or n in view.failed for n in plan.nodes):
            return dataclasses.replace(view, reports={})  # a real loss: spares replace only it
        if view.reports:  # restart requests only: everyone restarts in place, nobody is evicted
            return dataclasses.replace(view, alive={n: i for n, i in view.alive.items() if n in plan.nodes})
        return view

    def _advance(self, snap) -> bool:
        """Run the planner; True if it wanted a new plan (published by us or by a faster node)."""
        new = next_plan(self._view(snap.view), self._limits)
        if new is None:
            return False
        if self._m.publish(new, snap.plan_entry, snap.view.alive):
            log.info("etcd-v3 rendezvous: published generation %d %s (%s)", new.generation, new.nodes, new.cause)
            self._m.operator_log.event(self.node, "rdzv-plan", generation=new.generation, nodes=list(new.nodes), cause=new.cause)
        return True

    # -- RendezvousHandler --------------------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except KVError as e:
            raise RendezvousConnectionError(str(e)) from e

    def _next_rendezvous(self) -> RendezvousInfo:
        prev, requested = self._gen, False
        deadline = time.monotonic() + self._join_timeout
        while True:
            snap = self._m.snapshot()
            plan = snap.view.plan
            if plan is not None and plan.finished:
                if self.node in plan.nodes or plan.state != SUCCEEDED:
                    raise RendezvousClosedError(f"rendezvous '{self._run_id}' is closed: {plan.reason or plan.cause}")
                # A spare that was not needed: exit 0 (torch's RendezvousGracefulExitError makes
                # torchrun 2.13 crash with "'NoneType' object has no attribute 'is_failed'").
                log.warning("etcd-v3 rendezvous '%s' finished while node %s was a spare: exiting", self._run_id, self.node)
                raise SystemExit(0)
            mine = plan is not None and self.node in plan.nodes
            if mine and (prev is None or plan.generation > prev):
                store = self._barrier(plan, deadline)
                if store is not None:
                    return self._joined(plan, store)
                continue
            if mine and plan.generation == prev and not requested:
                requested = True
                if next_plan(self._view(snap.view), self._limits) is None:
                    # kind "signal": a failure of this node's workers, not of the node (a node
                    # reported "lost" is never restarted in place: its agent is presumed dead)
                    self._m.report_failure(prev, self.node, "torchrun agent restarts its workers (new round)", kind="signal")
                    continue
            if self._advance(snap):
                continue
            spare = plan is not None and not mine
            if not spare and time.monotonic() > deadline:  # spares never time out
                raise RendezvousTimeoutError(f"rendezvous '{self._run_id}' did not complete within {self._join_timeout:.0f} s")
            self._m.wait(snap.revision, 1.0)

    def _barrier(self, plan, deadline: float):
        """Acknowledge generation N in its store and wait for all its nodes; None if the plan moved on."""
        try:
            client = dist.TCPStore(plan.store["addr"], int(plan.store["port"]), is_master=False, timeout=timedelta(seconds=self._ttl + 5))
            client.set_timeout(timedelta(seconds=60))
            store = dist.PrefixStore(f"/torchelastic/gen{plan.generation}/", client)
            if store.add("rdzv/joined", 1) == len(plan.nodes):
                store.set("rdzv/complete", "1")
        except RuntimeError as e:  # the store's host is gone: its lease will expire, then re-plan
            log.warning("generation %d store at %s unreachable: %s", plan.generation, plan.store, e)
            store = None
        while True:
            if store is not None:
                try:
                    if store.check(["rdzv/complete"]):
                        return store
                except RuntimeError:
                    store = None
            snap = self._m.snapshot()
            now = snap.view.plan
            if now is None or now.generation != plan.generation or self._advance(snap):
                return None
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"generation {plan.generation} of '{self._run_id}' did not complete: "
                    f"not every node of {list(plan.nodes)} joined in time"
                )
            self._m.wait(snap.revision, 0.25 if store is not None else 1.0)

    def _joined(self, plan, store) -> RendezvousInfo:
        rank = plan.group_rank(self.node)
        self._gen, self._waiting = plan.generation, (0.0, 0)  # a cached answer was about the old round
        info = RendezvousStoreInfo.build(rank, store, local_addr=self.addr)
        log.info("etcd-v3 rendezvous: node %s is group rank %d of %d in generation %d", self.node, rank, len(plan.nodes), plan.generation)
        self._m.operator_log.event(self.node, "rdzv-join", generation=plan.generation, rank=rank)
        return RendezvousInfo(store, rank, len(plan.nodes), info)

    def num_nodes_waiting(self) -> int:
        """> 0 when this node's agent should start a new round (cached for 1 s: agents poll often)."""
        if time.monotonic() - self._waiting[0] < 1.0:
            return self._waiting[1]
        try:
            view = self._m.snapshot().view
        except KVError as e:  # an etcd blip must not stop healthy workers
            log.warning("etcd-v3 rendezvous: cannot read the job's state: %s", e)
            return 0
        plan, n = view.plan, 0
        if plan is not None and not plan.finished and self._gen is not None:
            if plan.generation > self._gen:
                n = 1
            else:
                new = next_plan(self._view(view), self._limits)
                n = 0 if new is None else max(1, len(set(new.nodes) - set(plan.nodes)))
        self._waiting = (time.monotonic(), n)
        return n

    def num_spares(self) -> int:
        """Alive nodes outside the current plan (tm-launch's spares; torch's redundancy list)."""
        return self._m.snapshot().spares_alive

    def is_closed(self) -> bool:
        plan = self._m.snapshot().view.plan
        return plan is not None and plan.finished

    def set_closed(self) -> None:
        while True:
            snap = self._m.snapshot()
            plan = snap.view.plan
            if plan is not None and plan.finished:
                return
            why = dict(state=SUCCEEDED, cause="rendezvous closed", reason=f"closed by node {self.node}")
            closed = plan.next(**why) if plan else Plan(generation=0, nodes=(), nproc=0, created=time.time(), **why)
            if self._m.publish(closed, snap.plan_entry):
                return

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        try:
            plan = self._m.snapshot().view.plan
            if plan is not None and self.node in plan.nodes:
                self.set_closed()
            return True
        except Exception:
            log.warning("etcd-v3 rendezvous shutdown failed", exc_info=True)
            return False
        finally:
            self._stop.set()
            self._thread.join(5)
            try:
                self._lease.revoke()
                self._lease_m.kv.close()
            except KVError:
                pass


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return EtcdV3RendezvousHandler(params)


def handler_factory():
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments."""
    return create_handler
