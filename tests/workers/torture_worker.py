"""One run of the kill sweep's job (tests/support/torture.py), as one process per rank (launch.py).

It trains the small FSDP2 MLP on 2 ranks from whatever the root's newest checkpoint holds,
saving every `--every` steps and keeping two, for `--steps` steps. Before each step can be
saved it records a hash of what this rank's state holds at that step (`<record>/step-N.rank-R`),
so that the sweep can check a later restore against what was there when it was saved, not
against what ckpt says it saved. Right after the restore it writes `<report>.rank<R>.json`: the
step restored, whether the state equals the hash recorded for that step, and the committed
steps the root holds at that moment. Faults come in through CKPT_FAULT (ckpt/_faults.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckpt
from ckpt.storage import catalog
from tests.support.toy_model import build, optimizer


def state_hash(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, step: int) -> str:
    """What this rank holds: its shards of the parameters and optimizer state, the schedule."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256(f"step {step} sched {sorted(sched.state_dict().items())}".encode())

    def add(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                add(f"{prefix}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                add(f"{prefix}.{i}", v)
        elif isinstance(value, torch.Tensor):
            t = value.to_local() if hasattr(value, "to_local") else value
            h.update(f"{prefix} {t.dtype} {tuple(t.shape)}".encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix} {value!r}".encode())

    add("model", msd)
    add("optim", osd)
    return h.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--record", required=True, help="directory of the per-step state hashes")
    p.add_argument("--report", required=True)
    p.add_argument("--steps", type=int, default=6, help="steps to train in this run")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', 0)}] %(name)s %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = Path(args.record)
    model = build("fsdp2", world)
    opt, sched = optimizer(model)
    with ckpt.Checkpointer(
        args.root,
        model=model,
        optimizer=opt,
        scheduler=sched,
        interval=ckpt.Every(steps=args.every),
        keep=ckpt.Keep(last=2),
        timeout_s=args.timeout,
        handle_sigterm=False,
    ) as cp:
        restored = cp.restored_step
        want = (record / f"step-{restored}.rank-{rank}").read_text() if restored is not None else None
        got = state_hash(model, opt, sched, cp.step) if restored is not None else None
        committed = [e.step for e in catalog.scan(cp.store) if e.state == catalog.COMMITTED]
        write_atomic(Path(f"{args.report}.rank{rank}.json"), json.dumps(
            {"restored_step": restored, "hash_ok": want == got, "committed": committed}))
        for _ in range(args.steps):
            g = torch.Generator().manual_seed(cp.step * 100 + rank)
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            # IMPORTANT: recorded before step_done can save this step's state
            write_atomic(record / f"step-{cp.step + 1}.rank-{rank}", state_hash(model, opt, sched, cp.step + 1))
            cp.step_done()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
