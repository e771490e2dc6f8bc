"""``tm-launch ctl``: what an operator asks of a running job.

    tm-launch ctl --rdzv-endpoint E --rdzv-id ID status [--json]
    tm-launch ctl --rdzv-endpoint E --rdzv-id ID events [--follow]
    tm-launch ctl --rdzv-endpoint E --rdzv-id ID drain NODE
    tm-launch ctl --rdzv-endpoint E --rdzv-id ID cordon NODE | uncordon NODE
    tm-launch ctl --rdzv-endpoint E --rdzv-id ID timeline --out FILE.png [--json]
    tm-launch ctl --rdzv-endpoint E --rdzv-id ID result     # exit 0: the job succeeded

Connection options mean what they mean for the launcher (and may come from ``--config``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import yaml

from ..logs import logger


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tm-launch ctl", description="Inspect and steer a running tm-launch job.")
    p.add_argument("--config", help="the job's YAML config (rdzv_endpoint, rdzv_id, rdzv_backend, rdzv_conf)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None, choices=["etcd-v3", "etcd", "etcd-v2"])
    p.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=None)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="membership, generation, alarms")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    e = sub.add_parser("events", help="the job's event log")
    e.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    e.add_argument("--json", action="store_true", help="one JSON object per line")
    t = sub.add_parser("timeline", help="picture of step times over the run with every generation change, its cause and downtime")
    t.add_argument("--out", metavar="FILE.png", help="write the picture here (PNG; .svg/.pdf by suffix)")
    t.add_argument("--json", action="store_true", help="print the data the picture shows as JSON")
    sub.add_parser(
        "result",
        help="print the job's outcome; exit 0 when it succeeded, 1 when it failed, 3 while it runs (for job scripts: "
        "srun's own exit code counts the node that was lost and replaced)",
    )
    for name, text in (
        ("drain", "move NODE's ranks to a spare (planned, two-phase)"),
        ("cordon", "mark NODE failed: it is replaced and never chosen again"),
        ("uncordon", "return a cordoned or drained NODE to the spare pool"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("node")
    return p


RESULT_CODES = {"succeeded": 0, "failed": 1}  # ``ctl result``: anything else (running, forming) is 3


def _connect(args):
    from rendezvous.kv import connect
    from rendezvous.membership import Membership
    from rendezvous.rdzv_conf import RUN_ID, UsageError, etcd_options

    conf = {}
    if args.config:
        try:
            with open(args.config) as f:
                conf = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise UsageError(f"--config {args.config}: not valid YAML: {' '.join(str(e).split())[:160]}") from None
        if not isinstance(conf, dict):
            raise UsageError(f"--config {args.config}: the top level must be a mapping of option: value")
    node = getattr(args, "node", None)
    if node is not None and not RUN_ID.match(node):
        raise UsageError(f"node id {node!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    endpoint = args.rdzv_endpoint or conf.get("rdzv_endpoint")
    run_id = args.rdzv_id or conf.get("rdzv_id")
    backend = args.rdzv_backend or conf.get("rdzv_backend") or "etcd-v3"
    if not endpoint or not run_id:
        raise ValueError("give --rdzv-endpoint and --rdzv-id (or --config with rdzv_endpoint and rdzv_id)")
    args.rdzv_id = str(run_id)  # for error messages
    options = etcd_options(endpoint, str(run_id), args.rdzv_conf or conf.get("rdzv_conf"))
    return Membership(connect("v3" if backend == "etcd-v3" else "v2", options)), str(run_id), options


def status(members, run_id: str) -> dict:
    from rendezvous.plan import FAILED, SUCCEEDED
    from rendezvous.planner import NOT_LIVE_YET, spares

    snap = members.snapshot(strict=False)  # an operator still sees the nodes when the plan is junk
    if snap.plan_error:
        logger(__name__).warning("%s", snap.plan_error)
    view, plan = snap.view, snap.view.plan
    progress = members.operator_log.all_progress()
    departed = departures(members.operator_log.history())
    ids = set(view.alive) | set(view.failed) | set(plan.nodes if plan else ()) | set(progress) | set(departed)
    nodes = []
    for node in sorted(ids, key=lambda n: (plan.group_rank(n) if plan and plan.group_rank(n) is not None else 10**9, n)):
        active = bool(plan and node in plan.nodes)
        if node in view.failed:
            role = "failed"
        elif active and plan.finished:  # its agent has exited (or is about to): not lost
            # the failed plan's removed nodes are the ones blamed (a worker failed or the node was lost)
            role = "finished" if plan.state == SUCCEEDED else "failed" if node in plan.removed else "stopped"
        elif active and node in view.drains:
            role = "draining"
        elif active:
            role = "active" if node in view.alive else "lost"
        elif node in view.alive:
            role = "spare"
        elif node in departed:
            role = departed[node][0]
        else:
            role = "gone"
        nodes.append(
            {
                "id": node,
                "role": role,
                "ranks": plan.ranks(node) if plan else [],
                "alive": node in view.alive,
                "warm": role == "spare" and node in view.warm,  # its workers parked: promoted before cold spares
                "reason": view.failed.get(node)
                or view.drains.get(node)
                or (departed[node][1] if role in ("replaced", "removed") else None),
                "progress": progress.get(node, {}).get("workers", {}),
                "snapshot_bytes": _snapshot_bytes(progress.get(node, {}).get("workers", {})),
            }
        )
    return {
        "run_id": run_id,
        "generation": plan.last_run if plan else None,  # a finished plan is the marker after the last one
        "state": plan.state if plan else ("plan unreadable" if snap.plan_error else "forming"),
        "world_size": plan.world_size if plan else 0,
        "live": view.live,
        # what a job not repaired in place needs, or why its last change restarted every worker
        "not_live": (plan.restart_why if plan and not plan.live and plan.generation > 0 else "") or ("" if view.live else NOT_LIVE_YET),
        # restarts done: a failed plan also counts the failure that found none left
        "restarts": (plan.restarts - (plan.state == FAILED and plan.restarts > 0)) if plan else 0,
        "cause": plan.cause if plan else "",
        "spares_left": len(spares(view)),  # not the removed node that has yet to exit, nor a draining one
        "nodes": nodes,
        "alarms": members.operator_log.alarms(),
    }


def departures(history) -> dict[str, tuple[str, str]]:
    """Nodes that left the job, from its plans (oldest first): node -> (role, reason), the role
    ``replaced`` (a spare took its ranks) or ``removed`` (the job went on without it). Their
    agents have exited and their leases are gone, so only the history still knows them."""
    left: dict[str, tuple[str, str]] = {}
    for plan in sorted(history, key=lambda p: p.generation):
        successors = {old: new for new, old in plan.replaced.items()}
        for node in plan.removed:
            if node in successors:
                left[node] = ("replaced", f"by {successors[node]} in generation {plan.generation}")
            else:
                left[node] = ("removed", f"in generation {plan.generation}")
        for node in plan.nodes:
            left.pop(node, None)  # back in the job
    return left


def _snapshot_bytes(workers: dict) -> int:
    """Host memory a node's snapshots take, from its workers' progress (etcd content: junk is 0)."""
    total = 0
    for w in workers.values():
        value = w.get("snapshot_bytes") if isinstance(w, dict) else None
        total += value if isinstance(value, int) and value > 0 else 0
    return total


def _size(n) -> str:
    if not n:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _clean(value, limit: int = 300) -> str:
    """Text from etcd for a terminal: one line, no control characters or escapes, bounded."""
    text = " ".join(str(value).split())
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _print_status(s: dict) -> None:
    print(
        f"run {s['run_id']}: generation {s['generation']}, {s['state']}, world size {s['world_size']}, "
        f"{'live' if s['live'] else 'restart'} mode, {s['restarts']} restart(s), {s['spares_left']} spare(s) left"
    )
    if s.get("not_live"):
        print(f"not live: {_clean(s['not_live'])}")
    if s["cause"]:
        print(f"last change: {_clean(s['cause'])}")
    print(f"{'NODE':<24} {'ROLE':<9} {'RANKS':<16} {'SNAPSHOTS':>10}  STEP")
    for n in s["nodes"]:
        steps = sorted({_clean(w.get("step"), 20) for w in n["progress"].values()}) or ["-"]
        ranks = ",".join(map(str, n["ranks"])) or "-"
        extra = f"  ({_clean(n['reason'])})" if n["reason"] else "  (warm)" if n.get("warm") else ""
        memory = _size(n.get("snapshot_bytes"))
        print(f"{_clean(n['id'], 128):<24} {n['role']:<9} {ranks:<16} {memory:>10}  {'/'.join(steps)}{extra}")
    _print_etcd(s.get("etcd", []))
    for a in s["alarms"]:
        print(
            _clean(
                f"alarm {a.get('severity')}: node {a.get('node')} gpu {a.get('gpu')} {a.get('signal')}={a.get('value')}: {a.get('message')}",
                600,
            )
        )


def _print_etcd(rows: list[dict]) -> None:
    """The control plane: one line, and each member when one does not answer."""
    from .etcd_health import summary

    if not rows:
        return
    print(summary(rows))
    if not all(r["answers"] for r in rows):
        for r in rows:
            state = ("leader" if r["leader"] else "answers") if r["answers"] else f"DOWN: {_clean(r['error'], 120)}"
            print(f"  {_clean(r['name'] or '-', 40):<16} {_clean(r['endpoint'], 80):<32} {state}")


def _format_event(e: dict) -> str:
    """One line per event; fields are etcd content, so anything odd is shown, never fatal."""
    try:
        when = time.strftime("%H:%M:%S", time.localtime(float(e.get("time", 0))))
    except (TypeError, ValueError, OverflowError, OSError):
        when = "??:??:??"
    node, kind, message = (_clean(e.get(k, d), 500) for k, d in (("node", "?"), ("kind", ""), ("message", "")))
    return f"{when} {node:<20} {kind:<14} {message}"


def _timeline(members, run_id: str, args) -> None:
    from . import timeline

    if not args.out and not args.json:
        raise ValueError("timeline: give --out FILE.png (a picture), --json (the data), or both")
    data = timeline.read(members, run_id)
    if not data["generations"] and not data["series"]:
        raise ValueError(f"run '{run_id}' has no plans and no step samples in etcd yet; check --rdzv-id and --rdzv-endpoint")
    if args.out:
        timeline.render(data, args.out)
        changes = [g for g in data["generations"] if g["generation"] > 0]
        print(
            f"wrote {args.out}: {len(changes)} generation change(s), {len(data['series'])} rank(s)",
            file=sys.stderr if args.json else sys.stdout,
        )
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # Keys skipped as unreadable are reported once each on stderr (stdout stays parseable).
    log = logger(__name__, prog="tm-launch ctl", libraries=logging.WARNING)
    from rendezvous.kv import AccessDenied, KVError
    from rendezvous.rdzv_conf import UsageError

    try:
        members, run_id, options = _connect(args)
        if args.command == "status":
            from .etcd_health import etcd_members

            s = status(members, run_id) | {"etcd": etcd_members(options)}
            print(json.dumps(s, indent=2, sort_keys=True)) if args.json else _print_status(s)
        elif args.command == "events":
            seen = 0
            while True:
                events = members.operator_log.events()
                for e in events[seen:]:
                    print(json.dumps(e, sort_keys=True) if args.json else _format_event(e), flush=True)
                seen = len(events)
                if not args.follow:
                    break
                time.sleep(0.5)
        elif args.command == "timeline":
            _timeline(members, run_id, args)
        elif args.command == "result":
            state = status(members, run_id)["state"]
            print(f"run {run_id}: {state}")
            return RESULT_CODES.get(state, 3)
        elif args.command == "drain":
            members.request_drain(args.node, "operator: tm-launch ctl drain")
            members.operator_log.event("operator", "drain_requested", message=f"tm-launch ctl drain {args.node}", target=args.node)
            print(f"drain requested for {args.node}: its ranks move to a spare at a step boundary")
        elif args.command == "cordon":
            members.cordon(args.node, "operator: tm-launch ctl cordon")
            members.operator_log.event("operator", "cordoned", message=f"tm-launch ctl cordon {args.node}", target=args.node)
            print(f"{args.node} cordoned: it is replaced if active and never chosen as a spare")
        elif args.command == "uncordon":
            existed = members.uncordon(args.node)
            members.operator_log.event("operator", "uncordoned", message=f"tm-launch ctl uncordon {args.node}", target=args.node)
            print(f"{args.node} uncordoned" if existed else f"{args.node} was not cordoned")
    except AccessDenied as e:
        log.error("permission denied for run %s: %s", args.rdzv_id, e)
        return 1
    except (KVError, ValueError, OSError, UsageError) as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
