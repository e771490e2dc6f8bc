"""The embedded etcd with real agents: nobody starts an etcd, the agents run it themselves.

Five "nodes" on loopback (``--rdzv-backend embedded-etcd --etcd-nodes a,b,c,d,e --etcd-loopback``,
each node its own member ports), three active and two spares: the members start on a, b and c.
The agent of a member node is SIGKILLed with its worker and its member while the job trains: the
job goes on live, a spare takes the rank, and the first node that holds no member (d) takes the
member's place (etcd's member list shows three members that answer again, ``ctl status`` too); a
second such loss later is survived as well, e taking that member's place. Every rank ends bitwise equal to torchrun's fault-free run.
"""

import os
import subprocess
import uuid
from dataclasses import dataclass

import pytest
from test_exactness import ORDINARY, differences, load
from torchrun_reference import run_torchrun

from tm_launch.launcher.embedded_etcd.cluster_api import ClusterAPI
from tm_launch.launcher.embedded_etcd.layout import Layout
from tm_launch.local.localjob import REPO, LocalJob, launcher
from tm_launch.local.ports import free_port_block

NODES = ("a", "b", "c", "d", "e")
STEPS = 80  # long enough after the second loss for its member to be replaced while the job runs
PAUSE = 6  # every rank holds here until the first loss is repaired (member list whole again)
CASE = ["--width", "8", "--step-sleep", "0.5"]


@dataclass
class EmbeddedJob(LocalJob):
    """A LocalJob whose agents run the etcd: started with no endpoint, asked (ctl) on the layout's."""

    clients: str = ""

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        cmd = launcher() + ["ctl", "--rdzv-endpoint", self.clients, "--rdzv-id", self.run_id, "--rdzv-backend", "etcd-v3", *args]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def serving(api: ClusterAPI) -> set[str]:
    """The members that are listed with a name and answer on their client URL."""
    return {m.name for m in api.members() or [] if m.name and m.answering}


def members_are(job: EmbeddedJob, api: ClusterAPI, expected: set[str], timeout: float) -> None:
    """etcd's member list holds exactly ``expected``, all answering, and ``ctl status`` agrees."""
    job.wait_for(lambda s: len(api.members() or []) == 3 and serving(api) == expected, timeout, f"members {sorted(expected)}")
    rows = job.wait_for(lambda s: s["etcd"] if {r["name"] for r in s["etcd"] if r["answers"]} == expected else None, 60, "ctl status")
    assert len(rows) == 3 and sum(r["leader"] for r in rows) == 1 and all(r["answers"] for r in rows), rows


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_members_lost_with_their_agents_are_replaced_by_spares_and_training_stays_exact(tmp_path):
    ref = str(tmp_path / "ref")
    run_torchrun(ORDINARY, ["--steps", str(STEPS), "--out", ref, *CASE], nproc=3)
    base = free_port_block(3 * len(NODES))
    layout = Layout(NODES, port=base, loopback=True)
    job = EmbeddedJob(
        endpoint="",
        backend="embedded-etcd",
        run_id=f"embedded-{uuid.uuid4().hex[:8]}",
        workdir=str(tmp_path / "job"),
        nnodes="3",
        nproc=1,
        script=ORDINARY,
        launcher_args=[
            "--etcd-nodes",
            ",".join(NODES),
            "--etcd-port",
            str(base),
            "--etcd-loopback",
            "--collective-timeout",
            "600",
            "--max-restarts",
            "3",
        ],
        clients=",".join(layout.client_urls),
    )
    job.env = {"OMP_NUM_THREADS": "1"}
    out, go = os.path.join(job.workdir, "out"), os.path.join(job.workdir, "go")
    job.script_args = ["--steps", str(STEPS), "--out", out, *CASE, "--pause-step", str(PAUSE), "--pause-file", go]
    api = ClusterAPI(layout.client_urls)
    try:
        job.start_all(list(NODES))
        job.wait_for(lambda s: s["generation"] == 0, 300, "generation 0")
        members_are(job, api, {"a", "b", "c"}, 120)
        for spare in [n["id"] for n in job.status()["nodes"] if n["role"] == "spare"]:
            job.wait_parked(spare, timeout=400)
        job.wait_for(lambda s: newest_step(s) >= PAUSE - 1, 300, f"step {PAUSE - 1}")

        members = {"a", "b", "c"}
        for generation, taker in ((1, "d"), (2, "e")):
            status = job.status()
            victim = next(n for n in active(status) if n in members)  # an active node holding a member
            survivors = {n: job.worker_pids(n) for n in active(status) if n != victim}
            job.kill_agent(victim)  # its agent, its worker (PDEATHSIG) and its member with it
            job.wait_for(
                lambda s: s["generation"] == generation and victim not in active(s) and len(active(s)) == 3, 300, "a spare to take the rank"
            )
            members = members - {victim} | {taker}  # the first node that lives and holds no member
            members_are(job, api, members, 180)
            still = {n: job.worker_pids(n) for n in survivors}
            assert all(set(pids) <= set(still[n]) for n, pids in survivors.items()), "the survivors' workers must keep their processes"
            if generation == 1:
                open(go, "w").close()
                job.wait_for(lambda s: newest_step(s) >= PAUSE + 4, 300, f"step {PAUSE + 4}")  # the second loss while training runs

        codes = job.wait(timeout=600)
        assert all(codes[n] == 0 for n in NODES if job.nodes[n].proc.returncode != -9), (codes, job.logs_tail())
        plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
        assert sorted({p["generation"] for p in plans}) == [1, 2] and all(p["live"] for p in plans), job.logs_tail()
        got, want = load(out), load(ref)
        assert sorted(got) == sorted(want) == ["rank0", "rank1", "rank2"], job.logs_tail()
        assert differences(got, want) == {}, job.logs_tail()
    finally:
        job.stop()


def active(status: dict) -> list[str]:
    return [n["id"] for n in status["nodes"] if n["role"] == "active"]


def newest_step(status: dict) -> int:
    """The furthest step an active rank reports (ordinary.py keeps no step log)."""
    steps = [p.get("step") for n in status["nodes"] if n["role"] == "active" for p in n["progress"].values()]
    return max((s for s in steps if s is not None), default=-1)


def test_the_embedded_etcd_without_a_node_list_is_one_error_line(tmp_path):
    """The whole command's path (the other wrong inputs: the unit tables of ``service``)."""
    cmd = launcher() + ["--rdzv-backend", "embedded-etcd", "--nnodes", "2", "--rdzv-id", "x", ORDINARY, "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "tm-launch: error: --rdzv-backend embedded-etcd: give the job's nodes with --etcd-nodes (under srun, Slurm's allocation is used)"
    ], done.stderr
