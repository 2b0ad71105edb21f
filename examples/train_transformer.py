"""A small transformer trained with FSDP2 on CPU (gloo), checkpointed by ckpt.

    torchrun --nproc_per_node=2 examples/train_transformer.py --root ./checkpoints

Kill it at any moment (Ctrl-C, kill -9 on a rank, SIGTERM, a lost node under
`torchrun --nnodes=MIN:MAX`) and start it again, on as many ranks as are left: it resumes from
the last committed checkpoint with the same weights, optimizer state, LR schedule, RNG streams
and data position. The global batch stays the same on any world size that divides it
(gradient accumulation makes up the difference), and so does the sequence of global batches.
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
from torch.utils.data import DataLoader, Dataset

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


class ArithmeticText(Dataset):
    """Sample i: a noisy arithmetic token sequence generated from i alone (learnable by a
    small model, and the same sample wherever and whenever it is read)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        start, stride = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        noise = torch.rand(seq.shape, generator=g) < 0.05
        seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
        return seq[:-1], seq[1:], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./checkpoints")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--samples", type=int, default=2048, help="dataset size")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--loss-log", default="", help="rank 0 appends one JSON line per step here")
    p.add_argument("--samples-log", default="", help="every rank appends the sample indices it read per step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="slow the loop down (demo)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}/{world}] %(message)s")
    if rank == 0:  # every commit (ckpt says one every 10 minutes at INFO): the demo's report counts them
        logging.getLogger("ckpt.checkpointer").setLevel(logging.DEBUG)
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
    data = ArithmeticText(args.samples)
    sampler = ckpt.ElasticSampler(len(data), seed=0, global_batch=args.global_batch)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler)
    accum = ckpt.accumulation_steps(args.global_batch, args.micro_batch, world)
    loss_log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None
    samples_log = open(args.samples_log, "a") if args.samples_log else None

    with ckpt.Checkpointer(
        args.root,
        model=model,
        optimizer=opt,
        scheduler=sched,
        dataloader=loader,
        interval=ckpt.Every(steps=args.every),
        keep=ckpt.Keep(last=3),
        metadata={"example": "train_transformer"},
    ) as cp:
        if cp.restored_step is not None:
            logging.info("resumed at step %d on %d ranks", cp.step, world)
        it = iter(loader)
        for step in range(cp.step + 1, args.steps + 1):
            total, seen = torch.zeros(1), []
            for _ in range(accum):
                try:
                    x, y, idx = next(it)
                except StopIteration:  # the epoch ended; the sampler turns to the next one
                    it = iter(loader)
                    x, y, idx = next(it)
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
                (loss / accum).backward()
                total += loss.detach() / accum
                seen += idx.tolist()
            opt.step()
            opt.zero_grad()
            sched.step()
            dist.all_reduce(total)  # the global batch's loss, for the log
            if samples_log:
                samples_log.write(json.dumps({"step": step, "world": world, "rank": rank, "idx": seen}) + "\n")
                samples_log.flush()
            if loss_log:
                row = {"step": step, "loss": total.item() / world, "world": world, "time": time.time(), "pid": os.getpid()}
                loss_log.write(json.dumps(row) + "\n")
                loss_log.flush()
            if rank == 0 and step % 50 == 0:
                logging.info("step %d loss %.3f", step, total.item() / world)
            cp.step_done()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
