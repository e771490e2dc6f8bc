"""tm-launch's lines for people: the standard library's ``logging``, one formatter, stderr.

Why: the agent, ``tm-launch ctl`` and the demo used to speak in three styles (``logging`` for
libraries, the agent's own ``print`` in ``EventLog.say``, and stray ``print`` calls). Now every
module logs through ``logging`` (``logger(__name__)``), each process names itself once at its
entry point (``logger(prog=...)``), and ``Formatter`` writes the lines tm-launch always wrote:

=====================================  =============================================
record                                 line
=====================================  =============================================
tm-launch's, with ``node`` (``say``)   ``[tm-launch NODE HH:MM:SS.mmm] message``
tm-launch's, error                     ``tm-launch: error: message``
tm-launch's, warning                   ``tm-launch: warning: message``
tm-launch's, info                      ``[tm-launch] message``
a library's (rendezvous, health, ...)  ``[tm-launch] WARNING message``
=====================================  =============================================

"tm-launch" is the process's ``prog`` ("tm-launch ctl", "demo", "tm-launch worker 3"). A
program's output (``ctl status`` tables, the demo's report, JSON) is not logging: it stays
``print`` to stdout. Stdlib only, and quiet on import: every process may import it, a training
process included, where ``logger`` touches only the ``tm_launch`` logger, never the script's own.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

ROOT = "tm_launch"  # every tm-launch module's logger is under it (``logger(__name__)``)


class Formatter(logging.Formatter):
    """tm-launch's lines (the table above). ``prog`` names the process: a name, or a function
    asked at each line (a worker's rank changes when a spare is promoted)."""

    def __init__(self, prog: str | Callable[[], str] = "tm-launch"):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        prog = self.prog() if callable(self.prog) else self.prog
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.name != ROOT and not record.name.startswith(ROOT + "."):
            return f"[{prog}] {record.levelname} {text}"
        node = getattr(record, "node", None)
        if node is not None:
            return f"[{prog} {node} {stamp(getattr(record, 'at', record.created))}] {text}"
        if record.levelno >= logging.ERROR:
            return f"{prog}: error: {text}"
        if record.levelno >= logging.WARNING:
            return f"{prog}: warning: {text}"
        return f"[{prog}] {text}"


def stamp(t: float) -> str:
    """``HH:MM:SS.mmm``, local time: the agent's lines are read beside the workers' own output."""
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


class _Stderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a line is written (a test or a
    benchmark may replace it after the handler was made), flushed line by line."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


_handler = _Stderr()
_handler.setFormatter(Formatter())


def logger(name: str = ROOT, *, prog: str | Callable[[], str] | None = None, libraries: int | None = None) -> logging.Logger:
    """``logging.getLogger(name)`` for a tm-launch module (``logger(__name__)``), its lines on
    stderr in tm-launch's format whether or not its process configured anything.

    A process's entry point also passes ``prog``, the name its lines carry ("tm-launch",
    "tm-launch ctl", "demo"; a function for a name that changes, as a worker's rank), and, where the process is tm-launch's own
    (the agent, ctl, the demo: not a training script), ``libraries``: the level from which the
    other libraries' records (rendezvous, health, torch) are written too, in the same format.
    """
    own = logging.getLogger(ROOT)
    if _handler not in own.handlers:
        own.addHandler(_handler)
        own.setLevel(logging.INFO)
        own.propagate = False  # written once, by this handler, whatever the root logger does
    if prog is not None:
        _handler.formatter.prog = prog
    if libraries is not None:
        root = logging.getLogger()
        if _handler not in root.handlers:
            root.addHandler(_handler)
        root.setLevel(libraries)
    return logging.getLogger(name)
