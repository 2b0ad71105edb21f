"""Runs every case of the model zoo (tests/support/zoo.py) in one process per rank, one after the
other, each with its own root and Checkpointer (ckpt.Every(steps=3), otherwise the case's
options), so that a phase costs one start-up of torch, not one per model:

    zoo_worker.py --mode plain|fsdp2 --phase PHASE --dir DIR

- reference: 8 steps under DIR/ref/<case>; writes DIR/reference.rank<R>.pt: per case, the
  state after steps 3, 6 and 8 (`snapshot`) and, after step 8, draws from every RNG.
- killed: 7 steps under DIR/root/<case> (saves at 3 and 6, the last one waited for), its
  Checkpointer left open; after every case, SIGKILL: no `__exit__`, no final save.
- resumed: from DIR/root/<case> (step 6) to step 8; writes DIR/resumed.rank<R>.pt as the
  reference does, with the step each case restored.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import signal
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

import ckpt
from tests.support.launch import exit_without_teardown
from tests.support.zoo import KINDS, Specimen, cases

STEPS = {"reference": 8, "killed": 7, "resumed": 8}
SNAPSHOTS = (3, 6, 8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "fsdp2"], required=True)
    p.add_argument("--phase", choices=list(STEPS), required=True)
    p.add_argument("--dir", type=Path, required=True)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    roots = args.dir / ("ref" if args.phase == "reference" else "root")
    killed: list[ckpt.Checkpointer] = []  # entered, never left: the SIGKILL ends them
    results: dict[str, dict[str, Any]] = {}
    for case, (name, options) in cases().items():
        try:
            results[case] = run(args, name, options, str(roots / case), rank, killed)
        except Exception:  # a case that fails fails its own test, not the others'
            results[case] = {"error": traceback.format_exc()}
    for cp in killed:
        cp.wait()  # step 6 committed: the resumed run starts from it
    torch.save(results, args.dir / f"{args.phase}.rank{rank}.pt")
    if world > 1:
        dist.barrier()
    if args.phase == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    exit_without_teardown()


def run(args: argparse.Namespace, name: str, options: dict[str, Any], root: str, rank: int, killed: list[ckpt.Checkpointer]) -> dict[str, Any]:
    # The same weights and batches on every rank (see zoo.py); python and numpy differ.
    torch.manual_seed(1234)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    spec = KINDS[name].build(args.mode, args.phase == "resumed")
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    cp = ckpt.Checkpointer(root, model=spec.model, optimizer=opt, scheduler=sched, extra=spec.extra, interval=ckpt.Every(steps=3), **options)
    if args.phase == "killed":
        killed.append(cp.__enter__())
        train(cp, spec, opt, sched, STEPS["killed"], at=())  # nothing between its steps but ckpt
        return {}
    with cp:
        out = {"restored_step": cp.restored_step, **train(cp, spec, opt, sched, STEPS[args.phase], at=SNAPSHOTS)}
    out["rng"] = {"torch": torch.rand(4), "numpy": float(np.random.rand()), "python": random.random()}
    return out


def train(cp: ckpt.Checkpointer, spec: Specimen, opt: torch.optim.Optimizer, sched: Any, steps: int, at: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Train up to `steps`; the state after each step in `at`, by step."""
    snapshots = {}
    for _ in range(cp.step, steps):
        spec.loss(spec.model, spec.batch()).backward()
        opt.step()
        opt.zero_grad()
        spec.after_step()
        sched.step()
        cp.step_done()
        if cp.step in at:
            snapshots[cp.step] = snapshot(spec.model, opt, sched, spec.extra)
    return snapshots


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint taken now must hold it, keyed as ckpt's DCP state dict is
    (full tensors; a collective under FSDP2), and what no state dict shows: every buffer,
    persistent or not, and which parameters are one tensor."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    ties: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(n.removeprefix("_orig_mod."))
    return {
        "model": copy.deepcopy(msd),
        "optim": copy.deepcopy(osd),
        "scheduler": {"0": copy.deepcopy(sched.state_dict())},
        "extra": {k: full(v.state_dict()) for k, v in extra.items()},
        "buffers": {n.removeprefix("_orig_mod."): b.clone() for n, b in model.named_buffers()},
        "ties": sorted(sorted(names) for names in ties.values() if len(names) > 1),
        "rng": {"torch": torch.get_rng_state()},
    }


def full(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else copy.deepcopy(v) for k, v in state.items()}


if __name__ == "__main__":
    main()
