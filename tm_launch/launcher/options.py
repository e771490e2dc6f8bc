"""Command line and YAML: torchrun's parser, plus tm-launch's own options, plus ``--config``.

One source of truth: torchrun's ``get_args_parser()`` defines every torchrun option (and its
``PET_*`` variable); tm-launch adds its options, each declared once in ``tm_launch.settings``,
to the same parser, and the YAML file may set any of them by its destination name
(``nproc_per_node: 2``, ``rdzv_backend: etcd-v3``, ``spares: 1``, ``health: {hang_timeout: 60}``). Precedence: command line > ``PET_*`` variable >
YAML > built-in default. Mistakes raise ``UsageError`` with one line saying what to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shutil
from typing import Any

import yaml

from health.config import HealthConfig
from rendezvous.rdzv_conf import RUN_ID, UsageError  # one user-mistake type for every option, --rdzv-conf included

from ..settings import SETTINGS, problems
from .slurm import slurm_job

LIVE_BACKENDS = ("etcd-v3", "etcd", "etcd-v2", "embedded-etcd")  # embedded-etcd: the agents run it (launcher.embedded_etcd)
# Options a config file may not set: they name the script, not the job.
NOT_IN_YAML = {"help", "config", "training_script", "training_script_args"}


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: ``nnodes: 1:2`` is the text "1:2", not 62."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"(?!.*:)" + rx.pattern, rx.flags) if tag.endswith((":int", ":float")) else rx) for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _health_flag(name: str) -> str:
    return "--health-" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tm-launch"
    parser.description = (
        "tm-launch: a drop-in for torchrun with spare nodes, health alarms and live in-place "
        "rank substitution. Every torchrun option keeps its meaning. `tm-launch ctl --help` "
        "lists the operator commands."
    )
    for action in parser._actions:
        if action.dest == "standalone":
            action.help = (
                "Single machine, nothing to install: tm-launch starts a private etcd on loopback (a temporary "
                "data dir, stopped on exit) and uses its etcd-v3 rendezvous; --rdzv-id is generated if not given."
            )
    own = parser.add_argument_group("tm-launch")
    own.add_argument(
        "--config", metavar="FILE.yaml", help="YAML file setting any option below or above by its name (e.g. nproc_per_node: 2, spares: 1)."
    )
    from torch.distributed.argparse_util import env  # torchrun's action: PET_<NAME> sets the option

    for setting in SETTINGS:
        kwargs = setting.argparse_kwargs()
        if setting.pet:
            kwargs["action"] = env
        own.add_argument(*(setting.flags or (setting.option,)), **kwargs)
    health = parser.add_argument_group("health monitor (YAML section `health:`)")
    for f in dataclasses.fields(HealthConfig):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        health.add_argument(
            _health_flag(f.name), dest=f"health__{f.name}", default=None, metavar=kind.upper(), help=f.metadata.get("help", "")
        )
    return parser


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    """Check a YAML value against what the command line would accept for the same option."""
    if action.nargs == 0:  # store_true flags and torchrun's env flags
        if not isinstance(value, bool):
            raise UsageError(f"{where}: '{key}' must be true or false, not {value!r}")
        return value
    if key == "rdzv_conf" and isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (dict, list)):
        raise UsageError(f"{where}: '{key}' must be a single value, not {type(value).__name__}")
    if isinstance(value, bool) or (action.type is int and isinstance(value, float) and not value.is_integer()):
        raise UsageError(f"{where}: '{key}' has the wrong type: {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value) if action.type is not int or isinstance(value, str) else int(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"{where}: '{key}' has the wrong type: {value!r}") from None
    elif value is not None:
        value = str(value)
    if action.choices and value not in action.choices:
        raise UsageError(f"{where}: '{key}' must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return value


def load_config(path: str, parser: argparse.ArgumentParser) -> tuple[dict, dict]:
    """Read a YAML file into (option defaults, health section), validated against the parser."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"--config {path}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: the top level must be a mapping of option: value")
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_IN_YAML and not a.dest.startswith("health__")}
    options, health = {}, {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key == "health":
            if not isinstance(value, dict):
                raise UsageError(f"{path}: 'health' must be a mapping")
            health = value
            continue
        if key not in actions:
            raise UsageError(f"{path}: unknown key '{key}'{_suggest(key, list(actions) + ['health'])}")
        options[key] = _convert(actions[key], key, value, path)
    return options, health


def _env_set(action: argparse.Action) -> bool:
    """True when torchrun's PET_<NAME> variable already sets this option (it beats YAML)."""
    return any(os.environ.get("PET_" + s.lstrip("-").upper().replace("-", "_")) for s in action.option_strings)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    # The full parser finds tm-launch's own --config: a `--config` after the script is the script's.
    known = parser.parse_args(argv)
    health_yaml: dict = {}
    if known.config:
        options, health_yaml = load_config(known.config, parser)
        by_dest = {a.dest: a for a in parser._actions}
        parser.set_defaults(**{k: v for k, v in options.items() if not _env_set(by_dest[k])})
    args = parser.parse_args(argv)
    health_cli = {k[len("health__") :]: v for k, v in vars(args).items() if k.startswith("health__") and v is not None}
    for k in list(vars(args)):
        if k.startswith("health__"):
            delattr(args, k)
    args.health = _health_config({**health_yaml, **_typed_health(health_cli)}, known.config)
    args.slurm = _from_slurm(args)
    validate(args)
    return args


def _from_slurm(args: argparse.Namespace):
    """Under ``srun``, the run and node ids Slurm gives (``tm_launch.launcher.slurm``), where the
    user gave none; torchrun's own backends stay exactly torchrun's."""
    if args.rdzv_backend not in LIVE_BACKENDS or args.standalone:
        return None
    job = slurm_job(os.environ, args.rdzv_id, args.node_id)
    if job is not None:
        args.rdzv_id, args.node_id = job.run_id, job.node_id
    return job


def _typed_health(flags: dict) -> dict:
    """Command-line health values are strings; parse them as YAML scalars/lists (60, true, [79, 48])."""
    out = {}
    for k, v in flags.items():
        try:
            out[k] = yaml.load(v, Loader=_Loader)
        except yaml.YAMLError:
            out[k] = v
        if isinstance(out[k], str) and "," in out[k]:
            out[k] = [yaml.load(x, Loader=_Loader) for x in out[k].split(",")]
    return out


def _health_config(values: dict, path: str | None) -> HealthConfig:
    try:
        return HealthConfig.from_dict(values)
    except ValueError as e:
        raise UsageError(f"{path + ': ' if path else ''}{e}") from None


def parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--nnodes {text}: expected N or MIN:MAX with whole numbers") from None
    if lo < 1:
        raise UsageError(f"--nnodes {text}: the minimum must be at least 1")
    if lo > hi:
        raise UsageError(f"--nnodes {text}: MIN ({lo}) is larger than MAX ({hi}); write MIN:MAX")
    return lo, hi


def validate(args: argparse.Namespace) -> None:
    """Checks across options and torchrun's; each tm-launch setting's own check is in its
    declaration (``tm_launch.settings``)."""
    parse_nnodes(args.nnodes)
    wrong = problems(args)
    if wrong:
        raise UsageError(wrong[0])
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if args.rdzv_backend in LIVE_BACKENDS or args.standalone:
        if args.rdzv_id and not RUN_ID.match(str(args.rdzv_id)):
            raise UsageError(f"--rdzv-id {args.rdzv_id!r}: use letters, digits, '.', '_' or '-' (at most 128)")
        if args.node_id is not None and not RUN_ID.match(str(args.node_id)):  # it becomes an etcd key segment
            raise UsageError(f"--node-id {args.node_id!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    script = args.training_script
    if not args.module and not args.no_python and not os.path.isfile(script):
        raise UsageError(f"training script '{script}' not found (give a path to a .py file, or -m MODULE)")
    if args.no_python and not (os.path.isfile(script) or shutil.which(script)):
        raise UsageError(f"--no-python: program '{script}' not found")
