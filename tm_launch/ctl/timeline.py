"""`tm-launch ctl timeline`: the job's step times over wall time, with every generation change.

Why a picture: an on-call person asked "what happened to run R last night" should see at a glance
when training slowed or stopped, which fault caused each new generation and how long the job was
down, instead of reading four agents' logs. Everything drawn comes from the job's etcd keys, so it
works for a running job and for one that finished hours ago:

* ``log/history/<gen>``: every plan (created, cause, replaced, live, planned);
* ``state/reports/<gen>/<node>``: the failure reports that started a generation change (their
  ``time`` is the fault's detection time);
* ``log/events/``: ``entered`` events carry ``after_plan_s`` (plan -> live workers entered);
* ``log/steps/<node>``: a bounded per-node series of worker samples, appended by each agent
  with its once-a-second progress publish (``tm_launch.joblog.append_samples``);
* ``log/breakdown/<gen>/``: the agents' stamps of each change, turned into its downtime
  breakdown by ``tm_launch.joblog``.

The pure parts (``build``, ``by_generation``, ``label_rows``) are table-tested; ``render`` is the
only place that touches matplotlib, imported lazily so ``ctl status`` stays fast.
"""

from __future__ import annotations

import json

from ..joblog import SAMPLE_FIELDS, breakdown, cause_kind


def build(
    run_id: str,
    history: list[dict],
    reports: dict[int, dict],
    events: list[dict],
    steps: dict[str, list],
    stamps: dict[int, dict] | None = None,
) -> dict:
    """Everything the picture shows, as plain JSON (also what ``ctl timeline --json`` prints).

    ``history``: plans as dicts; ``reports``: generation -> {node: report}; ``events``: the job's
    event log; ``steps``: node -> sample rows. Times in the output are seconds since generation
    0's plan (the job's start); ``downtime_s`` runs from the fault (the first failure report, or
    the plan itself for a planned change) to the new generation's workers running again (their
    ``entered`` event in live mode; else the first sample that ran a step in that generation).
    ``stamps``: generation -> {"plan", "nodes"} records; each change gets its ``breakdown``
    (``tm_launch.joblog``, its ``origin`` made relative like the other times), None without."""
    stamps = stamps or {}
    plans = sorted(history, key=lambda p: p.get("generation", 0))
    rows = sorted(
        (r + [node] for node, rs in steps.items() for r in rs if isinstance(r, list) and len(r) == len(SAMPLE_FIELDS)), key=lambda r: r[0]
    )
    start = plans[0].get("created", 0.0) if plans else (rows[0][0] if rows else 0.0)
    entered: dict[int, float] = {}
    for e in events:
        if e.get("kind") == "entered" and isinstance(e.get("after_plan_s"), (int, float)):
            g = int(e.get("generation", -1))
            entered[g] = max(entered.get(g, 0.0), float(e["after_plan_s"]))
    generations = []
    for p in plans:
        g = p.get("generation", 0)
        created = float(p.get("created", 0.0))
        before = reports.get(g - 1, {})
        times = [float(r["time"]) for r in before.values() if isinstance(r.get("time"), (int, float))]
        fault = min(times) if times and g > 0 and not p.get("planned") else created
        back = None
        if g in entered:
            back = created + entered[g]
        else:
            first = next((r for r in rows if r[1] == g and r[5] == "running" and r[3] is not None), None)
            if first is not None:
                back = first[0]
        change = g > 0 and p.get("state") == "running"
        parts = breakdown(stamps[g].get("plan"), stamps[g].get("nodes", {})) if change and g in stamps else None
        if parts is not None:
            parts["origin"] = round(parts["origin"] - start, 3)
        generations.append(
            {
                "generation": g,
                "time": created - start,
                "fault_time": fault - start,
                "resumed_time": None if back is None else back - start,
                "downtime_s": round(back - fault, 3) if change and back is not None else None,
                "cause": p.get("cause", ""),
                "kind": cause_kind(p, before),
                "state": p.get("state", "running"),
                "live": bool(p.get("live")),
                "planned": bool(p.get("planned")),
                "replaced": p.get("replaced", {}),
                "nodes": list(p.get("nodes", ())),
                "breakdown": parts,
            }
        )
    series: dict[str, list] = {}
    for t, gen, rank, step, step_time, state, node in rows:
        if state not in ("running", "recovering", "finished", "left") or step is None:
            continue
        series.setdefault(str(rank), []).append(
            {"time": round(t - start, 3), "generation": gen, "step": step, "step_time": step_time, "node": node, "state": state}
        )
    return {
        "run_id": run_id,
        "start": start,
        "generations": generations,
        "series": dict(sorted(series.items(), key=lambda kv: int(kv[0]) if kv[0].lstrip("-").isdigit() else 0)),
    }


def read(members, run_id: str) -> dict:
    """Collect the keys ``build`` needs from etcd (a handful of range reads)."""
    from dataclasses import asdict

    oplog = members.operator_log
    history = [asdict(p) for p in oplog.history()]
    reports: dict[int, dict] = {}
    for e in members.kv.get_prefix("state/reports/"):
        parts = e.key.split("/")
        if len(parts) != 4 or not parts[2].isdigit():
            continue
        try:
            value = json.loads(e.value)
        except ValueError:
            continue
        if isinstance(value, dict):
            reports.setdefault(int(parts[2]), {})[parts[3]] = value
    return build(run_id, history, reports, oplog.events(), oplog.all_steps(), oplog.all_downtime_stamps())


def by_generation(samples: list[dict]) -> list[list[dict]]:
    """A rank's samples cut into runs of one generation each: the picture draws no line across
    a generation change (the band is the downtime; in restart mode no worker ran there, and
    the step count starts again from the script's checkpoint)."""
    runs: list[list[dict]] = []
    for s in samples:
        if not runs or runs[-1][-1]["generation"] != s["generation"]:
            runs.append([])
        runs[-1].append(s)
    return runs


def label_rows(xs: list[float], min_gap: float) -> list[int]:
    """Row (0 = top) for each label at position ``xs`` so that labels in one row are at least
    ``min_gap`` apart: close events stack downwards instead of printing over each other."""
    last: list[float] = []
    out = []
    for x in xs:
        for row, prev in enumerate(last):
            if x - prev >= min_gap:
                last[row] = x
                out.append(row)
                break
        else:
            last.append(x)
            out.append(len(last) - 1)
    return out


def _short(text: str, limit: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


KIND_COLOURS = {
    "signal": "#d62728",
    "lost": "#9467bd",
    "exit": "#ff7f0e",
    "alarm": "#8c564b",
    "drain": "#1f77b4",
    "scale_up": "#2ca02c",
    "failed": "#000000",
    "finished": "#2ca02c",
    "failure": "#d62728",
}


def render(data: dict, out: str) -> None:
    """Draw ``data`` (from ``build``) into ``out`` (PNG, or any format matplotlib knows by suffix).

    Two panels share the time axis: steps completed (a flat stretch is downtime) and step time.
    Each generation change is a shaded band from the fault to the workers running again with a
    short tag ("g1") on top; the full cause and downtime of every tag is listed under the plot,
    so 20 events never print over each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    changes = [g for g in data["generations"] if g["generation"] > 0]
    end = max([s["time"] for ss in data["series"].values() for s in ss] + [g["time"] for g in data["generations"]] + [1.0])
    rows = label_rows([g["fault_time"] for g in changes], min_gap=end * 0.06)
    # Layout in inches, so that neither the tags above the plot nor the notes below it can run
    # into the title or off the page however many events there are.
    title_in, tags_in, plot_in, axis_in, note_in = 0.8, 0.2 * (max(rows, default=-1) + 1) + 0.1, 5.0, 0.65, 0.21
    height = title_in + tags_in + plot_in + axis_in + note_in * len(changes) + 0.25
    fig = plt.figure(figsize=(13, height))
    top = 1 - (title_in + tags_in) / height
    bottom = 1 - (title_in + tags_in + plot_in) / height
    grid = fig.add_gridspec(2, 1, height_ratios=[1, 1.6], hspace=0.08, top=top, bottom=bottom, left=0.07, right=0.83)
    ax_step = fig.add_subplot(grid[0])
    ax_time = fig.add_subplot(grid[1], sharex=ax_step)
    cmap = plt.get_cmap("tab10")
    for i, (rank, samples) in enumerate(data["series"].items()):
        colour = cmap(i % 10)
        for j, run in enumerate(by_generation(samples)):
            label = f"rank {rank}" if j == 0 else None
            ax_step.plot([s["time"] for s in run], [s["step"] for s in run], color=colour, lw=1.4, label=label)
            timed = [s for s in run if s["step_time"] is not None]
            ax_time.plot(
                [s["time"] for s in timed],
                [s["step_time"] * 1000 for s in timed],
                color=colour,
                lw=1.4,
                marker="." if len(samples) < 60 else None,
                label=label,
            )
    for g, row in zip(changes, rows):
        colour = KIND_COLOURS.get(g["kind"], "#7f7f7f")
        x0 = g["fault_time"]
        x1 = g["resumed_time"] if g["resumed_time"] is not None and g["resumed_time"] > x0 else x0
        finished = g["kind"] == "finished"
        for ax in (ax_step, ax_time):
            if x1 > x0:
                ax.axvspan(x0, x1, color=colour, alpha=0.18, lw=0)
            ax.axvline(x0, color=colour, lw=1.0 if finished else 1.2, ls=":" if finished else "--")
        tag = "end" if finished else f"g{g['generation']}"
        if g["downtime_s"] is not None:
            tag += f" {g['downtime_s']:.1f}s"
        ax_step.annotate(
            tag,
            xy=(x0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2 + 13 * row),
            textcoords="offset points",
            fontsize=8.5,
            color=colour,
            fontweight="bold",
            va="bottom",
            ha="left",
            annotation_clip=False,
        )
    ax_step.set_ylabel("steps completed")
    ax_time.set_ylabel("step time (ms, median of last 20)")
    ax_time.set_xlabel("wall time since the job started (s)")
    ax_step.tick_params(labelbottom=False)
    ax_time.set_xlim(0, end * 1.02)
    ax_time.set_ylim(bottom=0)
    for ax in (ax_step, ax_time):
        ax.grid(alpha=0.3)
    handles, labels = ax_time.get_legend_handles_labels()
    kinds = sorted({g["kind"] for g in changes if g["kind"] != "finished"})
    from matplotlib.patches import Patch

    handles += [Patch(color=KIND_COLOURS.get(k, "#7f7f7f"), alpha=0.5, label=f"change: {k}") for k in kinds]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.84, top), fontsize=9, frameon=False)
    downs = [g["downtime_s"] for g in changes if g["downtime_s"] is not None]
    faults = [g for g in changes if g["kind"] != "finished"]
    ending = data["generations"][-1]["state"] if data["generations"] else "running"
    summary = f"{ending if ending != 'running' else 'still running'}; {len(faults)} generation change(s)" + (
        f", downtime total {sum(downs):.1f}s, worst {max(downs):.1f}s" if downs else ""
    )
    fig.suptitle(f"tm-launch run {data['run_id']}: step times and generation changes\n{summary}", fontsize=12, y=1 - 0.1 / height, va="top")
    y = bottom - axis_in / height
    line_h = note_in / height
    for g in changes:
        colour = KIND_COLOURS.get(g["kind"], "#7f7f7f")
        down = (
            f"{g['downtime_s']:.2f}s down" if g["downtime_s"] is not None else "no downtime" if g["kind"] == "finished" else "downtime n/a"
        )
        moves = ", ".join(f"{new} replaces {old}" for new, old in g["replaced"].items())
        mode = "" if g["kind"] == "finished" else ", live" if g["live"] else ", restart"
        head = f"g{g['generation']:<3} at {g['fault_time']:7.1f}s  [{g['kind']}{mode}{'; ' + moves if moves else ''}]  {down}:  "
        text = head + _short(g["cause"], max(30, 150 - len(head)))
        fig.text(0.07, y, text, fontsize=8.5, color=colour, family="monospace", va="top")
        y -= line_h
    fig.savefig(out, dpi=110)
    plt.close(fig)
