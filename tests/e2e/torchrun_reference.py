"""The fault-free reference every exactness test compares with: the script under plain torchrun."""

import os
import subprocess
import sys

from tm_launch.local.localjob import REPO


def run_torchrun(script: str, args: list, nproc: int = 2, timeout: float = 300) -> None:
    """``torchrun --standalone --nproc-per-node N script args`` with one intra-op thread per
    worker (torchrun's own default for several workers), failing the test with its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
