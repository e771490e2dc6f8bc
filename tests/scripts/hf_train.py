"""A Hugging Face ``Trainer`` job under tm-launch.

    tm-launch --nnodes 2 --nproc-per-node 1 --rdzv-backend etcd-v3 ... tests/scripts/hf_train.py --live --output-dir ckpt
    torchrun --standalone --nproc-per-node 2 tests/scripts/hf_train.py --output-dir ckpt     # the same job

``--live``: ``tm_launch.init()`` first, then ``LiveTrainer`` instead of ``Trainer``: a spare takes
a failed rank's place in the running job (``tm_launch.huggingface``). Without it: restart mode,
every worker restarts and the ``Trainer`` resumes from its newest checkpoint in ``--output-dir``
(``save_steps``) as after a torchrun restart; ``ReportSteps`` lets the agent see the steps
(``ctl status``, ``ctl timeline``, the hang watchdog).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import kill_once  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402
from tm_launch.huggingface import LiveTrainer, ReportSteps  # noqa: E402


class Regression(torch.nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        norm = [torch.nn.BatchNorm1d(32)] if bn else []
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), *norm, torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class KillOnce(TrainerCallback):
    """SIGKILL this worker once per job when it holds --kill-rank at --kill-step (before its
    forward); --pause-step/--pause-file hold every rank; --step-log records each step;
    --step-sleep stands in for compute at each step's start."""

    def __init__(self, args):
        self.args = args

    def on_step_end(self, args, state, control, **kwargs):
        if self.args.step_log:
            with open(self.args.step_log, "a") as f:
                f.write(f"{time.time():.6f} {os.environ.get('RANK', 0)} {state.global_step - 1} 0 {os.getpid()}\n")

    def on_step_begin(self, args, state, control, **kwargs):
        if dist.is_initialized():  # after a promotion to other ranks too: every view of the rank agrees
            identity = (args.process_index, dist.get_rank(), int(os.environ["RANK"]))
            assert len(set(identity)) == 1, f"the Trainer's rank {identity[0]}, dist's {identity[1]}, RANK {identity[2]}"
        a = self.args
        if state.global_step == a.pause_step and a.pause_file:
            while not os.path.exists(a.pause_file):
                time.sleep(0.02)
        if int(os.environ.get("RANK", 0)) == a.kill_rank and state.global_step == a.kill_step:
            kill_once(a.kill_marker, a.kill_rank, f"step {state.global_step}")
        if a.step_sleep:
            time.sleep(a.step_sleep)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--live", action="store_true", help="LiveTrainer (tm_launch.init() first)")
    p.add_argument("--step-log", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pause-step", type=int, default=-1)
    p.add_argument("--pause-file", default=None)
    p.add_argument(
        "--bn",
        action="store_true",
        help="a BatchNorm after the first layer: per-rank buffers (running statistics) the script never registers",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out-dir", default=None, help="every rank saves its final parameters here (rank<R>.pt)")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-marker", default="killed")
    args = p.parse_args()

    if args.live:
        tm_launch.init()  # before TrainingArguments, which starts a process group otherwise
    torch.manual_seed(0)
    model = Regression(bn=args.bn)
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=8,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="linear",
        save_steps=10,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    trainer = (LiveTrainer if args.live else Trainer)(
        model=model, args=training, train_dataset=Data(256), callbacks=[ReportSteps(), KillOnce(args)]
    )
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        rank = int(os.environ.get("RANK", 0))
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out_dir, f"rank{rank}.pt"))
    # End here, while the Trainer still holds its DDP model: freeing that model (at main's return,
    # or in the interpreter's teardown) joins gloo's worker thread while holding the GIL, and that
    # thread, destroying the Trainer's last all-gather, waits for the GIL: a deadlock seen under
    # plain torchrun about 1 run in 10. The results are saved; tm-launch's own processes end so too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
