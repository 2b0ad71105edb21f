"""One-process training loops on tiny models, for tests that watch a live Checkpointer or what
its saves leave in a root."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import ckpt


def train(cp: ckpt.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, until: int, sleep_s: float = 0.0) -> None:
    while cp.step < until:
        time.sleep(sleep_s)
        model(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        cp.step_done()


def job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run(root: Path, steps: int, keep: ckpt.Keep) -> None:
    """Train to `steps` from what `root` holds, a checkpoint every 5 steps kept under `keep`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=5), keep=keep) as cp:
        for _ in range(cp.step, steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()


def step_dirs(root: Path) -> list[str]:
    """The step directories under `root`, committed or not, by name."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
