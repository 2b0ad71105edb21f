"""A Hugging Face Accelerate loop checkpointed by ckpt: run it, stop it (Ctrl-C, or kill it),
run it again, and it goes on from its last checkpoint.

    pip install -e '.[accelerate]'
    python examples/accelerate_loop.py --root ./accelerate-run --steps 300
    accelerate launch --num_processes 2 examples/accelerate_loop.py   # on two processes
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import ckpt
from ckpt.integrations.accelerate import checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./accelerate-run")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True))
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randn(4096, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, DataLoader(data, batch_size=32, shuffle=True))
    with checkpointer(accelerator, args.root, dataloader=loader, interval=ckpt.Every(steps=100), keep=ckpt.Keep(last=2)) as cp:
        while cp.step < args.steps:
            for x, y in loader:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
                cp.step_done()
                if cp.step >= args.steps:
                    break


if __name__ == "__main__":
    main()
