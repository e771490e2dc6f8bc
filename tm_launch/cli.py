"""``tm-launch``: torchrun's command line, tm-launch's agent behind the etcd backends.

``--rdzv-backend c10d`` and ``static`` (torchrun's default) are handed to torchrun itself, so
they behave exactly as under torchrun. ``etcd-v3``, ``etcd`` and ``etcd-v2`` (and
``--standalone``, which starts a private etcd) run tm-launch's agent: spares, generations and
live substitution. ``tm-launch ctl ...`` is the operator interface (see ``tm_launch.ctl``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from urllib.parse import urlparse

from .options import LIVE_BACKENDS, UsageError, parse_args, parse_nnodes


def _fail(message: str, code: int = 2) -> int:
    print(f"tm-launch: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        from .ctl import main as ctl_main

        return ctl_main(argv[1:])
    logging.basicConfig(level=logging.WARNING, format="[tm-launch] %(levelname)s %(message)s")
    logging.getLogger("health").setLevel(logging.INFO)  # e.g. "GPU health monitor off: NVML unavailable"
    try:
        args = parse_args(argv)
    except UsageError as e:
        return _fail(str(e))
    if args.rdzv_backend not in LIVE_BACKENDS and not args.standalone:
        return _torchrun(args)
    try:
        return _launch(args)
    except UsageError as e:
        return _fail(str(e))


def _torchrun(args) -> int:
    """torchrun's own code path for its own backends: same behaviour, same exit codes."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


def parse_rdzv_conf(conf: str | dict | None) -> dict:
    """torchrun's ``--rdzv-conf k1=v1,k2=v2`` (torch's own parser, without importing torch:
    ``tm-launch ctl`` must answer in well under a second)."""
    if isinstance(conf, dict):
        return dict(conf)
    values = {}
    for item in (conf or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        # Name the one bad item, never echo the whole string: it may hold a secret by mistake.
        if not key.strip():
            raise UsageError(f"--rdzv-conf {item.strip()}: '{item.strip()}' has no key (write key=value)")
        if not sep or not value.strip():
            raise UsageError(f"--rdzv-conf {key.strip()}: '{key.strip()}' must have a value (write {key.strip()}=VALUE)")
        values[key.strip()] = value.strip()
    return values


def etcd_options(endpoint: str | None, run_id: str, conf: str | dict | None):
    """EtcdOptions from --rdzv-endpoint and --rdzv-conf (cacert, cert, key, user, password_file,
    read_timeout). ``timeout``/``join_timeout`` keep torchrun's meaning (the rendezvous timeout)."""
    from rendezvous.kv import EtcdOptions
    from rendezvous.membership import run_prefix

    if not run_id or "/" in run_id:  # a '/' would nest this run's keys inside another run's
        raise UsageError(f"--rdzv-id {run_id!r}: give a run id without '/'")
    values = parse_rdzv_conf(conf)
    known = {"cacert", "cert", "key", "user", "password_file", "timeout", "read_timeout", "protocol", "join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "keep_alive_max_attempt"}
    for key in values:
        if key == "password":
            # A command line is readable by every user of the machine (/proc/PID/cmdline, ps).
            raise UsageError("--rdzv-conf password=...: a password may not be given on the command line or in the "
                             "config; use password_file=FILE or the TM_ETCD_PASSWORD environment variable")
        if key not in known:
            raise UsageError(f"--rdzv-conf: unknown key '{key}' (known: cacert, cert, key, user, password_file, timeout)")
    password = None
    if values.get("password_file"):
        try:
            with open(values["password_file"]) as f:
                password = f.read().strip()
        except OSError as e:
            raise UsageError(f"--rdzv-conf password_file: cannot read {values['password_file']}: {e.strerror}") from None
    elif os.environ.get("TM_ETCD_PASSWORD"):
        password = os.environ["TM_ETCD_PASSWORD"]
    _check_tls_files(values)
    endpoints = tuple(e.strip() for e in (endpoint or "localhost:2379").split(",") if e.strip())
    if values.get("cacert") or values.get("protocol") == "https":
        endpoints = tuple(e if "://" in e else f"https://{e}" for e in endpoints)
    for name in ("timeout", "join_timeout"):
        if name in values:
            _seconds(name, values[name])
    timeout = _seconds("read_timeout", values.get("read_timeout", 5.0))
    return EtcdOptions(
        endpoints=endpoints, prefix=run_prefix(run_id), cacert=values.get("cacert"), cert=values.get("cert"),
        key=values.get("key"), user=values.get("user"), password=password, timeout=timeout,
    )


def _check_tls_files(values: dict) -> None:
    """TLS mistakes caught before any connection, where the TLS library's errors are cryptic."""
    # cert= alone may be one PEM file holding both certificate and key; a key alone is a mistake.
    if values.get("key") and not values.get("cert"):
        raise UsageError("--rdzv-conf: key= needs cert= too (the client certificate that goes with the private key)")
    for name in ("cacert", "cert", "key"):
        path = values.get(name)
        if path and not os.access(path, os.R_OK):
            why = "no such file" if not os.path.exists(path) else "not readable"
            raise UsageError(f"--rdzv-conf {name}={path}: {why}")


def _seconds(name: str, raw) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise UsageError(f"--rdzv-conf {name}={raw}: must be a positive number of seconds")
    return value


def _join_timeout(args) -> float:
    """--join-timeout, or torchrun's ``--rdzv-conf timeout=`` / ``join_timeout=`` (same meaning)."""
    conf = parse_rdzv_conf(args.rdzv_conf)
    raw = conf.get("join_timeout", conf.get("timeout"))
    return args.join_timeout if raw is None else _seconds("timeout", raw)


def _is_loopback(endpoint: str) -> bool:
    host = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}").hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _local_addr(local_addr: str | None, endpoints) -> str:
    """This node's address: workers get it as MASTER_ADDR. torchrun's choice, ``--local-addr`` or
    the FQDN; only on a single machine (loopback etcd) whose name does not resolve, 127.0.0.1."""
    if local_addr:
        return local_addr
    name = socket.getfqdn()
    if all(_is_loopback(e) for e in endpoints):
        try:
            socket.getaddrinfo(name, None)
        except OSError:
            return "127.0.0.1"
    return name


def _check_standalone(args) -> None:
    """--standalone's etcd is private to this agent: no other node can ever join it."""
    min_nodes, _ = parse_nnodes(args.nnodes)
    if min_nodes > 1:
        raise UsageError(
            f"--standalone --nnodes {args.nnodes}: --standalone starts a private etcd on this machine's loopback, so no "
            f"other node can ever join; run every node with --rdzv-backend etcd-v3 --rdzv-endpoint HOST:2379 "
            f"--rdzv-id JOB --nnodes {args.nnodes} (an etcd all nodes reach)")


def _launch(args) -> int:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map
    from torch.distributed.run import config_from_args

    from rendezvous.kv import AccessDenied, KVError, connect

    from .agent import Agent, AgentConfig
    from .planner import Limits
    from .workers import OutputSpec

    server = None
    if args.standalone:
        _check_standalone(args)
        from rendezvous.etcd_server import EtcdServer

        server = EtcdServer().start()
        args.rdzv_backend = "etcd-v3"
        args.rdzv_endpoint = server.endpoint
        if args.rdzv_id in (None, "", "none"):
            args.rdzv_id = f"standalone-{uuid.uuid4().hex[:8]}"
        print(f"[tm-launch] --standalone: private etcd at {server.endpoint}", file=sys.stderr, flush=True)
    try:
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
        run_id = str(args.rdzv_id)
        options = etcd_options(args.rdzv_endpoint, run_id, args.rdzv_conf)
        try:
            config, cmd, cmd_args = config_from_args(args)
        except ValueError as e:  # torchrun's own checks: --nproc-per-node abc, gpu without CUDA, ...
            raise UsageError(str(e).strip()) from None
        if config.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
        # Read once: workers (and anything else this agent starts) never see the etcd password.
        os.environ.pop("TM_ETCD_PASSWORD", None)
        api = "v3" if args.rdzv_backend == "etcd-v3" else "v2"
        try:
            kv = connect(api, options)
        except AccessDenied as e:
            return _fail(f"permission denied for run {run_id}: {e}", code=1)
        except KVError as e:
            return _fail(str(e), code=1)
        except ValueError as e:  # a malformed --rdzv-endpoint
            raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint}: {e}") from None
        nproc = config.nproc_per_node
        addr = _local_addr(args.local_addr, options.endpoints)
        # torchrun's agent sets this for its workers (launcher/api.py); they inherit it.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = args.signals_to_handle
        output = OutputSpec(
            log_dir=args.log_dir,
            redirects={k: int(v) for k, v in to_map(Std.from_str(args.redirects), nproc).items()},
            tee={k: int(v) for k, v in to_map(Std.from_str(args.tee), nproc).items()},
            shown=set(map(int, args.local_ranks_filter.split(","))) if args.local_ranks_filter else None,
            role=args.role,
        )
        entry = [cmd] if isinstance(cmd, str) else [sys.executable, "-u"]
        cfg = AgentConfig(
            node_id=args.node_id or f"{socket.gethostname()}-{os.getpid()}",
            addr=addr, nproc=nproc,
            limits=Limits(min_nodes=min_nodes, max_nodes=max_nodes, nproc=nproc, max_restarts=args.max_restarts),
            cmd=entry + list(cmd_args), run_id=run_id, role=args.role, lease_ttl=args.lease_ttl,
            monitor_interval=args.monitor_interval, join_timeout=_join_timeout(args), last_call=args.last_call,
            spares_wanted=args.spares, live_enabled=not args.no_live, collective_timeout=args.collective_timeout,
            sandbox_steps=args.sandbox_steps, output=output, health=args.health, event_log=args.event_log,
            metrics_port=args.metrics_port,
        )
        try:
            return Agent(cfg, kv).run()
        except KVError as e:  # before the loop (first read, registration): e.g. an unreadable plan
            return _fail(str(e), code=1)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
