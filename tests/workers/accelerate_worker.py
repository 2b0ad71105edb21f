"""A Hugging Face Accelerate training loop with ckpt, one process per rank (tests/integrations/test_accelerate.py).

    accelerate_worker.py --root ROOT --out OUT --steps N [--every K] [--die-at STEP]

A small MLP with dropout, AdamW and a per-step LR schedule, prepared by Accelerate (DDP over gloo
on CPU when WORLD_SIZE > 1, processes started by the test) with a stateful, shuffled loader of
48 samples in batches of 4 (6 batches an epoch per rank on 2 ranks) whose order is a function
of the epoch (use_seedable_sampler). With --die-at, the
process SIGKILLs itself after that step, once its last save committed. Writes OUT.rank<R>.pt:
the model's weights, the optimizer's state, the step it resumed from, and a draw of its RNG.
"""

from __future__ import annotations

import os
import signal

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import ckpt
from ckpt.integrations.accelerate import checkpointer
from tests.integrations.resume import worker_arguments


def main() -> None:
    p = worker_arguments()
    args = p.parse_args()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True))
    set_seed(1234)
    torch.manual_seed(7)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    torch.manual_seed(100 + accelerator.process_index)  # each rank its own dropout
    with checkpointer(accelerator, args.root, dataloader=loader, interval=ckpt.Every(steps=args.every), keep=ckpt.Keep(last=100), lease=None) as cp:
        restored = cp.restored_step
        while cp.step < args.steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                cp.step_done()
                if cp.step == args.die_at:
                    cp.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                if cp.step >= args.steps:
                    break
    torch.save(
        {"model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, "optim": opt.optimizer.state_dict(),
         "step": cp.step, "restored_step": restored, "rng": torch.rand(3)},
        f"{args.out}.rank{accelerator.process_index}.pt",
    )  # fmt: skip


if __name__ == "__main__":
    main()
