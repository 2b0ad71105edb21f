"""A small transformer trained with FSDP2 on CPU (gloo), checkpointed by ckpt.

    torchrun --nproc_per_node=2 examples/train_transformer.py --root ./checkpoints

Kill it at any moment (Ctrl-C, kill -9 on a rank, SIGTERM) and run the same command again:
it resumes from the last committed checkpoint with the same weights, optimizer state, LR
schedule, RNG streams and data position, as if it had never stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ckpt

VOCAB, SEQ = 64, 32


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step: int, rank: int, world: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch of `rank` at `step`: a pure function of the position in the data, so a
    resumed run reads exactly the data the interrupted one would have read next. The "text"
    is a noisy arithmetic sequence, learnable by a small model."""
    g = torch.Generator().manual_seed(step * world + rank)
    start = torch.randint(0, VOCAB, (micro, 1), generator=g)
    stride = torch.randint(1, 4, (micro, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./checkpoints")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--loss-log", default="", help="append one JSON line per step here (rank 0)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="slow the loop down (demo)")
    p.add_argument("--final-state", default="", help="rank 0 writes the full final weights here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}] %(message)s")
    torch.manual_seed(0)  # same initial weights everywhere; FSDP2 shards them

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyGPT()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    log_file = open(args.loss_log, "a") if args.loss_log and rank == 0 else None

    with ckpt.Checkpointer(
        args.root,
        model=model,
        optimizer=opt,
        scheduler=sched,
        interval=ckpt.Every(steps=args.every),
        keep=ckpt.Keep(last=3),
        metadata={"example": "train_transformer"},
    ) as cp:
        if cp.restored_step is not None:
            logging.info("resumed at step %d", cp.step)
        for step in range(cp.step, args.steps):
            x, y = batch(step, rank, world, args.micro_batch)
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            cp.step_done()
            if log_file:
                log_file.write(json.dumps({"step": step + 1, "loss": loss.item(), "time": time.time(), "pid": os.getpid()}) + "\n")
                log_file.flush()
            if rank == 0 and (step + 1) % 50 == 0:
                logging.info("step %d loss %.3f", step + 1, loss.item())
            if args.step_sleep:
                time.sleep(args.step_sleep)
    if args.final_state:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.final_state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
