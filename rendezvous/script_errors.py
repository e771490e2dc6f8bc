"""A bug or a transient? What the planner does with script errors (pure).

A worker whose script raised reports a *script error* (``protocol.ScriptErrorRecord``: the
exception, its message, the step; the node's report text is ``SCRIPT_PREFIX`` + its signature).
No hardware change fixes a bug, so spares and restarts spent on one are lost, and the job should
end in seconds with the error named. But a raise may be a transient too (a flaky read, a
filesystem hiccup) or the symptom of a fault (a GPU that fell off raises in CUDA calls): those
deserve what any failure gets. One attempt tells them apart:

* **every active node's workers raised** in the same generation (every rank hit the same bug):
  the job fails now, no spare used;
* **the same error comes back** in a generation that was made for it (the replacement raised at
  the same step, with the same exception and message): the job fails now;
* otherwise it is replaced like any failure, once (a node that raised alone first gets its
  ``GRACE`` seconds: the others may be raising too, the reports arrive a few ms apart).

A node cordoned by a health alarm (an XID, a lost GPU) is a fault whatever its workers raised:
it is not counted here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SCRIPT_PREFIX = "script error: "
GRACE = 2.0  # s a lone script error waits for the other nodes' reports before it counts as a fault

FAIL, WAIT, FAULT = "fail", "wait", "fault"


def decide(
    nodes: Sequence[str],
    reports: Mapping[str, str],
    report_times: Mapping[str, float],
    cordoned: set[str] | frozenset[str],
    cause: str,
    now: float,
    ranks_of: Mapping[str, Sequence[int]] | None = None,
) -> tuple[str, str]:
    """(FAIL, the job's last line) / (WAIT, "") / (FAULT, "") over the script-error reports of
    the generation's active ``nodes`` (``reports``: node -> report text, script errors only;
    ``cause``: why the current generation was made; ``ranks_of``: each node's ranks, for the line)."""
    raised = {n: reports[n] for n in nodes if n in reports and n not in cordoned}
    if not raised:
        return FAULT, ""
    errors = sorted(set(raised.values()))

    def where(error: str) -> str:
        who = [n for n in nodes if raised.get(n) == error]
        ranks = sorted(r for n in who for r in (ranks_of or {}).get(n, ()))
        return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))} on {', '.join(who)}" if ranks else ", ".join(who)

    back = [e for e in errors if e in cause]
    if back:
        return FAIL, f"{_plain(back[0])} ({where(back[0])}), raised again after a replacement: a bug in the script"
    if len(raised) == len(nodes) and len(errors) == 1:
        return FAIL, f"{_plain(errors[0])} ({where(errors[0])}), raised on every node: a bug in the script"
    if len(raised) == len(nodes):
        return FAIL, f"every node's script raised: {'; '.join(f'{_plain(e)} ({where(e)})' for e in errors)}"
    if max(now - report_times.get(n, 0.0) for n in raised) < GRACE:
        return WAIT, ""  # the first report is recent: the other nodes may be raising too
    return FAULT, ""


def _plain(report: str) -> str:
    return report[len(SCRIPT_PREFIX) :] if report.startswith(SCRIPT_PREFIX) else report
