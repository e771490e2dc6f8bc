"""``tm-launch``: torchrun's command line, tm-launch's agent behind the etcd backends.

``--rdzv-backend c10d`` and ``static`` (torchrun's default) are handed to torchrun itself, so
they behave exactly as under torchrun. ``etcd-v3``, ``etcd`` and ``etcd-v2`` (and
``--standalone``, which starts a private etcd) run tm-launch's agent: spares, generations and
live substitution. ``tm-launch ctl ...`` is the operator interface (see ``tm_launch.ctl``);
``tm-launch rehearse SCRIPT`` rehearses a script's live recovery (see ``tm_launch.rehearsal``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from urllib.parse import urlparse

from rendezvous.rdzv_conf import etcd_options, parse_rdzv_conf, positive_seconds

from . import settings
from .launcher.options import LIVE_BACKENDS, UsageError, parse_args, parse_nnodes
from .logs import logger

log = logger("tm_launch.cli")  # not __name__: `python -m tm_launch.cli` runs it as __main__


def _fail(message: str, code: int = 2) -> int:
    """The command's one ``tm-launch: error:`` line, and its exit code."""
    log.error("%s", message)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        from .ctl.commands import main as ctl_main

        return ctl_main(argv[1:])
    if argv[:1] == ["--version"]:
        print(version())
        return 0
    if argv[:1] == ["rehearse"]:
        from .rehearsal.main import main as rehearse_main

        return rehearse_main(argv[1:])
    logger(prog="tm-launch", libraries=logging.WARNING)  # tm-launch's lines, and libraries' warnings
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


def entry() -> None:
    """The ``tm-launch`` command: ``main()``, then the process ends without the interpreter's
    teardown. By then an agent has closed what it opened (workers stopped, lease revoked, its
    scratch directory and a --standalone etcd removed); the teardown would only free torch's
    module graph, 0.3-0.6 s of a core here, which the agent of a node replaced after a failure
    spends exactly while the survivors and the spare recover, and every agent after the job.
    A ``SystemExit`` ends the process as ``sys.exit`` would; any other exception as usual."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _torchrun(args) -> int:
    """torchrun's own code path for its own backends: same behaviour, same exit codes."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as e:
        print(str(e), file=sys.stderr)
        return 1
    except ValueError as e:  # torchrun's own checks of its options (--nproc-per-node two, ...): the workers run elsewhere
        return _fail(str(e).strip())
    return 0


def version() -> str:
    """``tm-launch --version``: the installed package's version and the torch beside it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        own = installed("tm-launch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        own = "unknown (not installed)"
    try:
        torch_version = installed("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"tm-launch {own} (torch {torch_version})"


def _join_timeout(args) -> float:
    """--join-timeout, or torchrun's ``--rdzv-conf timeout=`` / ``join_timeout=`` (same meaning)."""
    conf = parse_rdzv_conf(args.rdzv_conf)
    raw = conf.get("join_timeout", conf.get("timeout"))
    return args.join_timeout if raw is None else positive_seconds("timeout", raw)


def _snapshot_memory_limit(args) -> int:
    """--snapshot-memory-limit, else half of this node's memory (the other half: the training
    processes themselves, their data loaders, the page cache)."""
    if args.snapshot_memory_limit is not None:
        return args.snapshot_memory_limit
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 0


def _last_call(args) -> float:
    """--last-call, or torchrun's ``--rdzv-conf last_call_timeout=`` (same meaning)."""
    raw = parse_rdzv_conf(args.rdzv_conf).get("last_call_timeout")
    return args.last_call if raw is None else positive_seconds("last_call_timeout", raw)


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
            f"--rdzv-id JOB --nnodes {args.nnodes} (an etcd all nodes reach)"
        )


def _embedded_etcd(args):
    """The job's own etcd (``launcher.embedded_etcd``) where the user names none under an
    allocation, or asks for it (--rdzv-backend embedded-etcd); None when an etcd is named."""
    from .launcher.embedded_etcd import service

    nodes = service.node_list_text(args.etcd_nodes, getattr(args, "slurm", None) is not None, os.environ)
    if args.standalone or not service.wanted(args.rdzv_backend, args.rdzv_endpoint, nodes):
        return None
    layout = service.layout_of(nodes, args.etcd_port, args.etcd_loopback)
    run_id = str(args.rdzv_id)
    names = [os.environ.get("SLURMD_NODENAME", ""), args.node_id or ""]
    return service.EmbeddedEtcd(layout, names, run_id, ttl=args.lease_ttl, timeout=_join_timeout(args))


def _output(args, config, nproc: int):
    """Where worker output goes, as torchrun's DefaultLogsSpecs decides it (its layout under
    ``--log-dir``; see tm_launch.launcher.processes)."""
    from torch.distributed.elastic.multiprocessing.api import Std, to_map

    from .launcher.processes import OutputSpec

    redirects = {k: int(v) for k, v in to_map(Std.from_str(args.redirects), nproc).items()}
    tee = {k: int(v) for k, v in to_map(Std.from_str(args.tee), nproc).items()}
    log_dir = args.log_dir
    if log_dir == os.devnull:  # torchrun's "no log files": output stays on the console
        log_dir, redirects, tee = None, {}, {}
    elif not log_dir:  # torchrun's DefaultLogsSpecs (made by config_from_args) made a temporary one
        made = config.logs_specs.root_log_dir
        if any(redirects.values()) or any(tee.values()):  # output files go there and are kept, as torchrun
            log_dir = made
            log.info("worker output (--redirects/--tee) goes to files under %s", log_dir)
        elif os.path.isdir(made) and not os.listdir(made):
            os.rmdir(made)  # unused: error files go to the agent's own scratch directory
    return OutputSpec(
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        shown=set(map(int, args.local_ranks_filter.split(","))) if args.local_ranks_filter else None,
        role=args.role,
    )


def _launch(args) -> int:
    from torch.distributed.run import config_from_args

    from rendezvous.kv import AccessDenied, KVError, connect
    from rendezvous.planner import Limits

    from .launcher.agent import Agent, AgentConfig

    server = None
    if args.standalone:
        _check_standalone(args)
        from rendezvous.etcd_server import EtcdServer

        server = EtcdServer().start()
        args.rdzv_backend = "etcd-v3"
        args.rdzv_endpoint = server.endpoint
        if args.rdzv_id in (None, "", "none"):
            args.rdzv_id = f"standalone-{uuid.uuid4().hex[:8]}"
        log.info("--standalone: private etcd at %s", server.endpoint)
    embedded = _embedded_etcd(args)
    try:
        if embedded is not None:
            try:
                embedded.start()
            except RuntimeError as e:
                return _fail(str(e), code=1)
            args.rdzv_backend, args.rdzv_endpoint = "etcd-v3", embedded.endpoint
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
        if embedded is not None:
            try:
                embedded.keep(connect(api, options))  # a connection of its own, beside the agent's
            except KVError as e:
                return _fail(str(e), code=1)
        nproc = config.nproc_per_node
        if getattr(args, "slurm", None) is not None:
            from .launcher.slurm import describe

            log.info("%s", describe(args.slurm, max_nodes))
        addr = _local_addr(args.local_addr, options.endpoints)
        # torchrun's agent sets this for its workers (launcher/api.py); they inherit it.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = args.signals_to_handle
        output = _output(args, config, nproc)
        # Live mode runs Python workers through tm_launch.worker: exactly `python SCRIPT`, plus
        # running the script again when a promoted spare takes other ranks than it warmed up as.
        # torchrun's cmd_args for a Python worker are ["-u", ("-m",) SCRIPT, ...]; --no-python
        # runs the program itself, which has no script to run again.
        cmd_args = list(cmd_args)
        if not args.no_live and not args.no_python and cmd_args[:1] == ["-u"]:
            cmd_args[1:1] = ["-m", "tm_launch.worker"]
        entry = [cmd] if isinstance(cmd, str) else [sys.executable, "-u"]
        chosen = settings.values(args) | {  # what only this node and torchrun's --rdzv-conf decide
            "node_id": args.node_id or f"{socket.gethostname()}-{os.getpid()}",
            "join_timeout": _join_timeout(args),
            "last_call": _last_call(args),
            "snapshot_memory_limit": _snapshot_memory_limit(args),
        }
        cfg = AgentConfig(
            **chosen,
            addr=addr,
            nproc=nproc,
            limits=Limits(min_nodes=min_nodes, max_nodes=max_nodes, nproc=nproc, max_restarts=args.max_restarts),
            cmd=entry + list(cmd_args),
            run_id=run_id,
            role=args.role,
            monitor_interval=args.monitor_interval,
            output=output,
            health=args.health,
        )
        try:
            return Agent(cfg, kv).run()
        except KVError as e:  # before the loop (first read, registration): e.g. an unreadable plan
            return _fail(str(e), code=1)
    finally:
        if server is not None:
            server.stop()
        if embedded is not None:
            embedded.stop(linger=max(30.0, 3 * args.lease_ttl))


if __name__ == "__main__":
    entry()
