"""A Hugging Face ``Trainer`` with tm-launch's live failover: ``tm_launch.init()`` first, and
``LiveTrainer`` where the script had ``Trainer``.

    torchrun --standalone --nproc-per-node 2 examples/hf_train.py --output-dir run1
    tm-launch --standalone --nproc-per-node 2 examples/hf_train.py --output-dir run1
    tm-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/hf_train.py --output-dir run1

Under tm-launch each optimizer step is a live step: a rank that fails is replaced by a spare,
which receives the ``Trainer``'s state (weights, optimizer, scheduler, ``TrainerState``) from a
survivor and resumes through ``train(resume_from_checkpoint=...)``. Under torchrun
``LiveTrainer`` is a ``Trainer``. The checkpoints in ``--output-dir`` are what a restart (restart
mode, torchrun) resumes from. A plain ``Trainer`` runs in restart mode; give it
``callbacks=[tm_launch.huggingface.ReportSteps()]`` so that the agents see its steps.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import tm_launch
from tm_launch.huggingface import LiveTrainer


class Regressor(torch.nn.Module):
    """Any module the ``Trainer`` accepts: it returns the loss when given labels."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 1024):
        self.x = torch.randn(n, 20, generator=torch.Generator().manual_seed(1))
        self.y = self.x[:, :4].sum(dim=1, keepdim=True).sin()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--epochs", type=float, default=3)
    args = parser.parse_args()

    tm_launch.init()  # first: TrainingArguments would start a process group of its own
    torch.manual_seed(0)
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=32,
        learning_rate=0.01,
        save_steps=20,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = LiveTrainer(model=Regressor(), args=training, train_dataset=Points())
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)  # None: from the start


if __name__ == "__main__":
    main()
