"""The rehearsal's report: text for the user, a dict for ``--json``. Pure (runs and verdicts in,
lines out)."""

from __future__ import annotations

from .compare import CAUSES, RankVerdict
from .runs import PHASES, Run

MAX_TENSORS = 6  # tensors named per object; the rest counted


def run_line(run: Run) -> str:
    how = f"{run.seconds:5.1f}s"
    if run.error:
        how += f", {run.error}"
    codes = ", ".join(f"{k} {v}" for k, v in sorted(run.codes.items()))
    return f"{how}{'; exit codes: ' + codes if codes else ''}"


def fault_title(run: Run) -> str:
    return f"{run.phase:<10} rank {run.victim} SIGKILLed {PHASES[run.phase][1]}, step >= {run.step}"


def verdict_word(run: Run, verdicts: list[RankVerdict]) -> str:
    if run.fired is False:
        return "NOT EXERCISED"
    if all(v.equal for v in verdicts):
        return "EQUAL"
    return "DIFFERS"


def rank_lines(v: RankVerdict, indent: str = "      ") -> list[str]:
    if v.missing:
        return [f"{indent}{v.title}: {v.missing}"]
    if v.equal:
        return [f"{indent}{v.title}: bitwise equal"] + attempt_lines(v, indent)
    lines = [f"{indent}{v.title}: {len(v.differences)} tensor(s)/value(s)/file(s) differ"]
    by_obj: dict[str, list] = {}
    for d in v.differences:
        by_obj.setdefault(d.obj, []).append(d)
    for obj, diffs in by_obj.items():
        named = ", ".join(f"{d.tensor or d.key} ({d.detail})" for d in diffs[:MAX_TENSORS])
        more = f" and {len(diffs) - MAX_TENSORS} more" if len(diffs) > MAX_TENSORS else ""
        lines.append(f"{indent}  {obj}: {named}{more}")
    for cause in v.causes:
        title, suggestion = CAUSES[cause]
        lines.append(f"{indent}  likely cause: {title}")
        lines.append(f"{indent}    suggestion: {suggestion}")
    return lines + attempt_lines(v, indent)


def attempt_lines(v: RankVerdict, indent: str) -> list[str]:
    """What differs and fails nothing, named: attempt counts a re-run step raised
    (``compare.ATTEMPT_COUNTS``) and wall-clock measurements (``compare.WALL_CLOCK``)."""
    lines = []
    for diffs, what in ((v.attempts, "attempts counted (the re-run step; the completed counts are equal)"),
                        (v.timings, "wall-clock measurements (differ in any two runs)")):  # fmt: skip
        if diffs:
            named = ", ".join(f"{d.key} ({d.detail})" for d in diffs[:MAX_TENSORS])
            more = f" and {len(diffs) - MAX_TENSORS} more" if len(diffs) > MAX_TENSORS else ""
            lines.append(f"{indent}  {what}: {named}{more}")
    return lines


def render(header: dict, reference: Run, control: tuple[Run, list[RankVerdict]] | None, faults: list[tuple[Run, list[RankVerdict]]]) -> str:
    out = [
        f"tm-launch rehearse: {header['script']}",
        f"  layout      : {header['nnodes']} node(s) x {header['nproc']} worker(s) + 1 spare; faults at step >= {header['step']}",
        f"  reference   : {header['reference_how']}  {run_line(reference)}",
    ]
    if header.get("not_compared"):
        out.append(f"  not compared: {header['not_compared']}")
    if control is not None:
        run, verdicts = control
        word = "equal on every rank" if all(v.equal for v in verdicts) else "DIFFERS without a fault"
        out.append(f"  control     : tm-launch live, no fault: {word}  {run_line(run)}")
        if not all(v.equal for v in verdicts):
            for v in verdicts:
                out += rank_lines(v)
            out.append(
                "      (these differ without any fault: the script is not reproducible, or live mode changes it; they are left out below)"
            )
    for run, verdicts in faults:
        out.append(f"  fault {fault_title(run)}: {verdict_word(run, verdicts)}  {run_line(run)}")
        if run.fired is False:
            out.append("      the kill never happened: the script never reached that phase on that rank at or after that step")
            continue
        if not all(v.equal and not v.attempts and not v.timings for v in verdicts):
            out += rank_lines_all(verdicts)
        if run.error or any(v.missing for v in verdicts):
            out += [f"      | {line}" for line in run.tail.splitlines()[-8:]]
            out.append(f"      logs: {run.log_dir}")
    return "\n".join(out)


def rank_lines_all(verdicts: list[RankVerdict]) -> list[str]:
    lines = []
    for v in verdicts:
        lines += rank_lines(v)
    return lines


def passed(control: tuple[Run, list[RankVerdict]] | None, faults: list[tuple[Run, list[RankVerdict]]]) -> bool:
    """Every fault happened and ended bitwise equal on every rank, and the control did too."""
    if control is not None and not all(v.equal for v in control[1]):
        return False
    return bool(faults) and all(run.fired is not False and all(v.equal for v in vs) for run, vs in faults)


def summary(control, faults) -> str:
    equal = sum(1 for run, vs in faults if run.fired is not False and all(v.equal for v in vs))
    verdict = "PASS" if passed(control, faults) else "FAIL"
    return f"{verdict}: {equal} of {len(faults)} fault(s) ended bitwise equal to the fault-free run on every rank"


def as_dict(header: dict, reference: Run, control, faults) -> dict:
    def verdicts_dict(vs: list[RankVerdict]) -> list[dict]:
        return [
            {
                "rank": v.rank,
                "equal": v.equal,
                "missing": v.missing,
                "causes": v.causes,
                "differences": [{"object": d.obj, "key": d.key, "role": d.role, "detail": d.detail} for d in v.differences],
                "attempts": [{"object": d.obj, "key": d.key, "detail": d.detail} for d in v.attempts],
                "timings": [{"object": d.obj, "key": d.key, "detail": d.detail} for d in v.timings],
            }
            for v in vs
        ]

    def judged(vs: list[RankVerdict]) -> dict:
        """Every rank's verdict, and the working directory's files apart."""
        files = [v for v in vs if v.rank is None]
        return {"ranks": verdicts_dict([v for v in vs if v.rank is not None]), "files": verdicts_dict(files)[0] if files else None}

    def run_dict(run: Run) -> dict:
        return {
            "name": run.name,
            "phase": run.phase,
            "victim": run.victim,
            "step": run.step,
            "seconds": round(run.seconds, 2),
            "codes": run.codes,
            "fired": run.fired,
            "error": run.error,
            "log_dir": run.log_dir,
        }

    return {
        **header,
        "passed": passed(control, faults),
        "reference": run_dict(reference),
        "control": None if control is None else {**run_dict(control[0]), **judged(control[1])},
        "faults": [{**run_dict(run), **judged(vs)} for run, vs in faults],
    }
