"""A 2-rank job for test_agreement: saves by the clock (`Every(seconds=)` or `Auto`), each
step taking about `step_s` on rank 0 and a random part of that on rank 1; writes per rank
how many times the ranks met and what the last schedule said."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ckpt


def main() -> None:
    root, out, how, steps, step_s = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    interval = ckpt.Every(seconds=0.3) if how == "seconds" else ckpt.Auto(node_mtbf_s=20.0, first_after_s=0.3)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = random.Random(rank)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=interval, keep=ckpt.Keep(last=1000),
                           save_on_exit=False, restore="none", agree_every_s=0.1) as cp:  # fmt: skip
        began = time.monotonic()
        for _ in range(steps):
            time.sleep(step_s if rank == 0 else rng.uniform(0, step_s))
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        wall_s = time.monotonic() - began
        cp.wait()
    out.joinpath(f"rank{rank}.json").write_text(json.dumps({"meetings": cp.meetings, "schedule": cp.schedule, "wall_s": wall_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
