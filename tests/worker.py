"""A training job for the tests, run as one process per rank (see launch.py).

It trains a small MLP under one of the wrappings (plain, ddp, fsdp2, fsdp1) with AdamW, a
StepLR schedule and per-rank random data, checkpointing with ckpt, and writes what a user
would compare after the run to <out>.rank<R>.pt: full parameters, full optimizer state,
scheduler state, step, and draws from every RNG.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckpt


def build(mode: str, world: int) -> torch.nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    )
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="plain", choices=["plain", "ddp", "fsdp2", "fsdp1"])
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--restore", default="latest")
    p.add_argument("--no-save-on-exit", action="store_true")
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', 0)}] %(name)s %(message)s")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)

    model = build(args.mode, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    restore = int(args.restore) if args.restore.isdigit() else args.restore
    with ckpt.Checkpointer(
        args.root,
        model=model,
        optimizer=opt,
        scheduler=sched,
        interval=ckpt.Every(steps=args.every),
        keep=ckpt.Keep(last=100),
        restore=restore,
        save_on_exit=not args.no_save_on_exit,
        storage_options=json.loads(args.storage_options),
        timeout_s=60,
    ) as cp:
        for _ in range(cp.step, args.steps):
            # Per-rank data from every RNG stream, so a wrong RNG restore changes the result.
            x = torch.randn(8, 16) + float(np.random.rand()) + random.random()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            cp.step_done()
            if args.step_sleep:
                import time

                time.sleep(args.step_sleep)
        final_step = cp.step

    if args.out:
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        torch.save(
            {
                "step": final_step,
                "model": {k: v.clone() for k, v in msd.items()},
                "optim": osd,
                "sched": sched.state_dict(),
                "rng": {
                    "torch": torch.rand(4),
                    "numpy": float(np.random.rand()),
                    "python": random.random(),
                },
            },
            f"{args.out}.rank{rank}.pt",
        )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
