"""``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` -> the etcd connection (``EtcdOptions``).

Shared by everything that connects to a job's etcd: the launcher (``tm_launch.cli``), the operator
commands (``tm_launch.ctl``) and torchrun's ``etcd-v3`` backend (``rendezvous.torch_handler``).
It lives below all three, so none of them imports another to reach it, and imports no torch:
``tm-launch ctl`` must answer in well under a second.
"""

from __future__ import annotations

import os
import re

# A run id or node id: it becomes an etcd key segment (``--rdzv-id``, ``--node-id``, ``ctl drain NODE``).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2, no traceback."""


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
    from .kv import EtcdOptions  # imported here: the etcd client libraries load only when needed
    from .membership import run_prefix

    if not run_id or "/" in run_id:  # a '/' would nest this run's keys inside another run's
        raise UsageError(f"--rdzv-id {run_id!r}: give a run id without '/'")
    values = parse_rdzv_conf(conf)
    known = {
        "cacert",
        "cert",
        "key",
        "user",
        "password_file",
        "timeout",
        "read_timeout",
        "protocol",
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
    }
    for key in values:
        if key == "password":
            # A command line is readable by every user of the machine (/proc/PID/cmdline, ps).
            raise UsageError(
                "--rdzv-conf password=...: a password may not be given on the command line or in the "
                "config; use password_file=FILE or the TM_ETCD_PASSWORD environment variable"
            )
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
    for name in ("timeout", "join_timeout", "last_call_timeout"):
        if name in values:
            positive_seconds(name, values[name])
    timeout = positive_seconds("read_timeout", values.get("read_timeout", 5.0))
    return EtcdOptions(
        endpoints=endpoints,
        prefix=run_prefix(run_id),
        cacert=values.get("cacert"),
        cert=values.get("cert"),
        key=values.get("key"),
        user=values.get("user"),
        password=password,
        timeout=timeout,
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


def positive_seconds(name: str, raw) -> float:
    """A --rdzv-conf duration: a positive number of seconds, or a UsageError naming the key."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise UsageError(f"--rdzv-conf {name}={raw}: must be a positive number of seconds")
    return value
