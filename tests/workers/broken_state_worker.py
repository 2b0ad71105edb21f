"""A job of real ranks whose restore fails on one rank only, with an error that is not one of
ckpt's (a user's object that raises AttributeError): every rank must learn it and raise
ckpt.RestoreFailed naming it, none left waiting in a collective for its timeout.

Saves step 1 with a `thing` in `extra`, then for each phase named on the command line
(`state_dict`: the restore's template; `load_state_dict`: applying what was read) restores it
in a fresh Checkpointer whose `thing` raises in that phase on rank 1. Each rank writes what
its enter raised to <out>.<phase>.rank<R>.json ({"type", "message", "s"}).

Usage: broken_state_worker.py ROOT OUT PHASE...
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ckpt
from tests.support.launch import exit_without_teardown


class Thing:
    """A user's object with state; on rank `bad` it raises in the method named `broken`."""

    def __init__(self, broken: str | None = None, bad: int = 1) -> None:
        self.value = torch.zeros(4)
        self.broken = broken if dist.get_rank() == bad else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.broken == "state_dict":
            raise AttributeError("'Thing' object has no attribute 'cursor' (a user's bug)")
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if self.broken == "load_state_dict":
            raise AttributeError("'Thing' object has no attribute 'cursor' (a user's bug)")
        self.value.copy_(sd["value"])


def main() -> None:
    root, out, phases = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    # timeout_s: the collectives' own; a rank left waiting for another would raise after it
    kw = {"model": model, "interval": None, "save_on_exit": False, "timeout_s": 60}
    with ckpt.Checkpointer(root, extra={"thing": Thing()}, restore="none", **kw) as cp:
        cp.step_done()
        cp.save(blocking=True)
    for phase in phases:
        t0 = time.monotonic()
        try:
            with ckpt.Checkpointer(root, extra={"thing": Thing(phase)}, **kw):
                got = {"type": None, "message": ""}
        except Exception as e:
            got = {"type": type(e).__name__, "message": str(e)}
        with open(f"{out}.{phase}.rank{rank}.json", "w") as f:
            json.dump({**got, "s": time.monotonic() - t0}, f)
        dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
