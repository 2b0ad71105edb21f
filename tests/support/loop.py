"""A one-process training loop on a tiny model, for tests that watch a live Checkpointer."""

from __future__ import annotations

import time

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
