"""A training job for the tests, run as one process per rank (see launch.py).

It trains a small MLP under one of the wrappings (plain, ddp, fsdp2, fsdp1; plain on several
ranks all-reduces its gradients by hand) with AdamW, a StepLR schedule and per-rank random
data, checkpointing with ckpt, and writes what a user would compare after the run to
<out>.rank<R>.pt: full parameters, full optimizer state, scheduler state, step, the step it
resumed from, whether it stopped for a SIGTERM, and draws from every RNG. A job stopped by
SIGTERM writes <out> too, after its checkpoint committed, then exits as ckpt says.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckpt
from tests.support.toy_model import build, optimizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="plain", choices=["plain", "ddp", "fsdp2", "fsdp1", "hsdp"])
    p.add_argument("--width", type=int, default=32, help="the toy model's hidden width")
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--restore", default="latest")
    p.add_argument("--no-save-on-exit", action="store_true")
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--on-error", default="raise", help="raise, log, or a number of failed saves in a row")
    p.add_argument("--transfer", default="{}", help="JSON: ckpt.Transfer's fields")
    p.add_argument("--timeout", type=float, default=60.0, help="the Checkpointer's timeout_s")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--frozen-seed", type=int, help="freeze the first layer, its weights drawn from this seed")
    p.add_argument("--frozen", default="save", help="the Checkpointer's frozen=")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level, format=f"[rank{os.environ.get('RANK', 0)}] %(name)s %(message)s")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    if os.environ.get("TEST_SPOOL_OF_RANK"):  # each rank on a "node" of its own
        os.environ["CKPT_SPOOL"] = os.environ["TEST_SPOOL_OF_RANK"].format(rank=rank)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)

    model = build(args.mode, world, frozen_seed=args.frozen_seed, width=args.width)
    opt, sched = optimizer(model)
    restore = int(args.restore) if args.restore.isdigit() else args.restore
    preempted: SystemExit | None = None
    try:
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
            timeout_s=args.timeout,
            on_error=int(args.on_error) if args.on_error.isdigit() else args.on_error,
            transfer=ckpt.Transfer(**json.loads(args.transfer)),
            frozen=args.frozen,
        ) as cp:
            for _ in range(cp.step, args.steps):
                # Per-rank data from every RNG stream, so a wrong RNG restore changes the result.
                x = torch.randn(8, 16) + float(np.random.rand()) + random.random()
                loss = model(x).pow(2).mean()
                loss.backward()
                if args.mode == "plain" and world > 1:
                    # Hand-rolled data parallelism keeps the replicas equal: unsharded state
                    # is saved once for all ranks (DCP keeps one copy of equal keys).
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                opt.step()
                opt.zero_grad()
                sched.step()
                cp.step_done()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
    except SystemExit as e:  # a SIGTERM checkpoint committed: record where we stopped, then exit
        preempted = e

    if args.out:
        dump(f"{args.out}.rank{rank}.pt", cp, model, opt, sched, preempted=preempted is not None)
    if world > 1:
        dist.destroy_process_group()
    if preempted is not None:
        raise preempted


def dump(path: str, cp: ckpt.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, *, preempted: bool = False) -> None:
    """What a user would compare after a run (a collective under FSDP: every rank calls it)."""
    reads = {  # what the restore read, beside (not compared with the state)
        "read_bytes": cp.metrics.registry.get_sample_value("ckpt_read_bytes_total") or 0.0,
        "received_bytes": cp.metrics.registry.get_sample_value("ckpt_received_bytes_total") or 0.0,
        "files": {n: (e.size, e.rank) for n, e in cp.last_commit.files.items()} if cp.last_commit else {},
    }
    Path(path).with_suffix(".reads.json").write_text(json.dumps(reads))
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    torch.save(
        {
            "step": cp.step,
            "restored_step": cp.restored_step,
            "preempted": preempted,
            "model": {k: v.clone() for k, v in msd.items()},
            "optim": osd,
            "sched": sched.state_dict(),
            "rng": {
                "torch": torch.rand(4),
                "numpy": float(np.random.rand()),
                "python": random.random(),
            },
        },
        path,
    )


if __name__ == "__main__":
    main()
