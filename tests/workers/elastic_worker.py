"""A job for the elastic tests, one process per rank (launch.py or torchrun).

It trains a small FSDP2 model on a dataset whose samples are their own indices, through a
plain DataLoader with a ckpt.ElasticSampler, keeping the global batch constant whatever the
world size (gradient accumulation), and appends one JSON line per optimizer step and rank to
<log-dir>/samples.jsonl: the step, the world size, the run's pid and the sample indices this
rank consumed for it. A test reads that file to compare data order across restarts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

import ckpt
from tests.support.toy_model import build


def draws(prefix: str, when: str, rank: int) -> None:
    """Record the next draws of every RNG stream (training here uses no randomness, so taking
    them changes nothing the tests compare)."""
    if prefix:
        with open(f"{prefix}.{when}.rank{rank}.json", "w") as f:
            json.dump(
                {
                    "torch": torch.rand(3).tolist(),
                    "numpy": np.random.rand(3).tolist(),
                    "python": [random.random() for _ in range(3)],
                },
                f,
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--dataset", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--die-at", type=int, default=0, help="rank 1 kills itself before this step ends")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--final", default="", help="rank 0 writes the final full weights here")
    p.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--rng-out", default="", help="each rank writes RNG draws taken on entering and on leaving")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}/{world}] %(name)s %(message)s")
    torch.manual_seed(0)

    data = TensorDataset(torch.arange(args.dataset))
    sampler = ckpt.ElasticSampler(len(data), seed=5, global_batch=args.global_batch)
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        # forkserver, as the README advises: a worker forked from the rank while another of its
        # threads held a lock hung once in CI (in torch.set_num_threads, pytorch/pytorch#130610).
        context = "forkserver" if args.workers else None
        # The server imports torch once; each epoch's workers are forked from it with torch
        # loaded (otherwise every worker of every epoch imports torch anew: seconds of CPU).
        torch.multiprocessing.set_forkserver_preload(["torch", "torchdata.stateful_dataloader"])
        loader = StatefulDataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=args.workers, multiprocessing_context=context)
    else:
        loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=args.workers)
    accum = ckpt.accumulation_steps(args.global_batch, args.micro_batch, world)
    model = build("fsdp2", world, counter=False)  # forwards per step differ with the world size (accumulation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = open(os.path.join(args.log_dir, "samples.jsonl"), "a")

    with ckpt.Checkpointer(
        args.root, model=model, optimizer=opt, dataloader=loader, interval=ckpt.Every(steps=args.every), timeout_s=30
    ) as cp:
        draws(args.rng_out, "enter", rank)
        it = iter(loader)
        for step in range(cp.step + 1, args.steps + 1):
            seen = []
            for _ in range(accum):
                try:
                    (idx,) = next(it)
                except StopIteration:  # the epoch ended: the sampler moves to the next one
                    it = iter(loader)
                    (idx,) = next(it)
                seen += idx.tolist()
                x = torch.stack([torch.sin(idx.float() * (k + 1)) for k in range(16)], dim=1)
                (model(x).pow(2).mean() / accum).backward()
            if args.die_at and step == args.die_at and rank == 1:
                # The save in flight commits first (on a loaded machine it could still be
                # writing two steps on): the test counts on the last one before the death.
                cp.wait()
                os.kill(os.getpid(), 9)  # a lost GPU: no goodbye
            opt.step()
            opt.zero_grad()
            log.write(json.dumps({"step": step, "world": world, "rank": rank, "pid": os.getpid(), "idx": seen}) + "\n")
            log.flush()
            cp.step_done()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    draws(args.rng_out, "exit", rank)
    if args.final:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
