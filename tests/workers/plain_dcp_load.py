"""Read a ckpt checkpoint with nothing but `torch.distributed.checkpoint`, one process per rank.

    plain_dcp_load.py <mode> <step dir> <out>

Builds a fresh model (other initial weights than the worker's) and optimizer, loads the
model and optimizer state of <step dir> with `dcp.load` and DCP's own filesystem reader,
and writes the full state, before and after, to <out>.rank<R>.pt. ckpt is never imported: the files must be
plain DCP.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tests.support.launch import exit_without_teardown
from tests.support.toy_model import build, optimizer


def main() -> None:
    mode, step_dir, out = sys.argv[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model = build(mode, world, seed=999)
    opt, _ = optimizer(model)
    full = StateDictOptions(full_state_dict=True)
    init = {k: v.clone() for k, v in get_state_dict(model, opt, options=full)[0].items()}
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=step_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert "ckpt" not in sys.modules, "the plain DCP reader imported ckpt"
    msd, osd = get_state_dict(model, opt, options=full)
    torch.save(
        {"init": init, "model": {k: v.clone() for k, v in msd.items()}, "optim": osd},
        f"{out}.rank{rank}.pt",
    )
    if world > 1:
        # No rank tears gloo down while another still waits on dcp.load's last message:
        # torch 2.13's gloo aborts the process ("terminate called ...") in that race, and
        # it still did now and then at destroy_process_group after a barrier (once in a CI
        # run of 263 tests). This script uses nothing but torch; its output is written, so
        # it leaves without tearing gloo down at all.
        dist.barrier()
        exit_without_teardown()


if __name__ == "__main__":
    main()
