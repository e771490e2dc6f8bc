"""The scripts a user copies (examples/) run as their docstrings say: 2 processes under plain
torchrun (``python -m torch.distributed.run --standalone --nproc-per-node 2``) and under
``tm-launch --standalone --nproc-per-node 2``, a few steps, exit 0, and the same training under
both: the same logged losses (and for examples/train.py the same weights, bitwise).

The instrumented scripts the other tests run (fault injection, step logs) are tests/scripts/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
EXAMPLES = os.path.join(REPO, "examples")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "tm-launch": [sys.executable, "-m", "tm_launch.cli", "--standalone", "--nproc-per-node", "2"],
}


def run(launcher: list[str], example: str, args: list[str], cwd, timeout: float = 300) -> str:
    """``launcher example args`` in ``cwd``; its whole output (exit 0 asserted)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    cwd.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [*launcher, os.path.join(EXAMPLES, example), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{launcher[2]} {example}: exit {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


def same_under_both(tmp_path, example: str, args: list[str], logged: str) -> dict:
    """Run ``example`` under torchrun and under tm-launch (each in a directory of its own, under
    tmp_path) and check both log the same lines matching ``logged`` (at least one)."""
    lines = {}
    for name, launcher in LAUNCHERS.items():
        lines[name] = re.findall(logged, run(launcher, example, args, tmp_path / name), re.M)
    assert lines["torchrun"] and lines["tm-launch"] == lines["torchrun"], lines
    return lines


@pytest.mark.slow  # the fast tier's kills compare tests/scripts/train.py's weights with torchrun's
def test_train_ends_with_the_same_weights_under_torchrun_and_tm_launch(tmp_path):
    same_under_both(tmp_path, "train.py", ["--steps", "30", "--out", "weights.pt"], r"^step \d+: loss \S+$")
    ours, theirs = (torch.load(tmp_path / name / "weights.pt") for name in ("tm-launch", "torchrun"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_train_resumes_from_its_checkpoint_in_restart_mode(tmp_path):
    """A checkpoint written under torchrun is where ``tm-launch --no-live`` starts again."""
    ckpt = str(tmp_path / "ckpt")
    run(LAUNCHERS["torchrun"], "train.py", ["--steps", "15", "--ckpt-dir", ckpt, "--ckpt-every", "10"], tmp_path / "first")
    assert sorted(os.listdir(ckpt)) == ["step-10"]
    tm_launch_no_live = LAUNCHERS["tm-launch"][:3] + ["--no-live"] + LAUNCHERS["tm-launch"][3:]
    out = run(tm_launch_no_live, "train.py", ["--steps", "25", "--ckpt-dir", ckpt, "--ckpt-every", "10"], tmp_path / "again")
    assert "resumed from the checkpoint of step 10" in out and "step 0:" not in out, out[-3000:]
    assert sorted(os.listdir(ckpt)) == ["step-10", "step-20"]


@pytest.mark.slow
def test_restart_mode(tmp_path):
    same_under_both(tmp_path, "restart_mode.py", ["--steps", "100", "--ckpt", "ckpt.pt"], r"^step \d+: loss \S+$")
    assert torch.load(tmp_path / "tm-launch" / "ckpt.pt")["step"] == 100


@pytest.mark.slow
def test_accelerate(tmp_path):
    same_under_both(tmp_path, "accelerate_train.py", ["--epochs", "2"], r"^epoch \d+: loss \S+$")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp-tp", "ddp-tp", "zero"])
def test_layouts(tmp_path, layout):
    same_under_both(tmp_path, "layouts.py", ["--layout", layout, "--steps", "25"], rf"^\[{layout}\] step \d+: loss \S+$")


@pytest.mark.slow
def test_lightning(tmp_path):
    same_under_both(tmp_path, "lightning_train.py", ["--epochs", "2"], r"^trained 2 epochs; last loss \S+$")


@pytest.mark.slow
def test_hugging_face_trainer(tmp_path):
    same_under_both(tmp_path, "hf_train.py", ["--output-dir", "out", "--epochs", "1"], r"^\{'loss': .*\}$")
    assert os.listdir(tmp_path / "tm-launch" / "out") == os.listdir(tmp_path / "torchrun" / "out") == ["checkpoint-16"]
