"""Restore each of several roots in turn in one job of real ranks (see launch.py), saving
nothing, and write what each restore left to <out>.<case>.rank<R>.pt (tests/workers/worker.py's
dump).

One job for many roots: each rank imports torch and joins the gloo group once, not once per
root. Every root starts from a model initialised with other weights and other RNG streams
than the ones saved, so only a real restore makes the dump equal to a saved step. A restore
that raises ckpt.RestoreFailed (on every rank together) is recorded in <out>.<case>.failed
and the job goes on to the next root. With CKPT_TEST_PREPARE=1 each restore is begun by
`ckpt.prepare` before its model is built (rank 0 surveys the root meanwhile), and the
worker waits for that survey, as a job's set-up would take longer than it.

Usage: restore_worker.py OUT CASES_JSON (a list of [case, root]) [STORAGE_OPTIONS_JSON]
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys

import numpy as np
import torch.distributed as dist

import ckpt
from ckpt import early
from tests.support.launch import exit_without_teardown
from tests.support.toy_model import build, optimizer
from tests.workers.worker import dump

log = logging.getLogger("restore_worker")


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', 0)}] %(name)s %(message)s")
    if os.environ.get("CKPT_TEST_PREPARE") == "1":
        logging.getLogger("ckpt.early").setLevel(logging.DEBUG)  # whether its survey stands
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (case, root) in enumerate(cases):
        log.info("=== case %s", case)
        if os.environ.get("CKPT_TEST_PREPARE") == "1":
            ckpt.prepare(root, storage_options=options, timeout_s=30)
            assert early._pending is not None and early._pending.done.wait(60)
        random.seed(9000 + i)
        np.random.seed(9000 + i)
        model = build("fsdp2", world, seed=4321 + i)
        opt, sched = optimizer(model)
        try:
            with ckpt.Checkpointer(root, model=model, optimizer=opt, scheduler=sched, interval=None,
                                   save_on_exit=False, storage_options=options, timeout_s=30) as cp:
                pass
        except ckpt.RestoreFailed as e:
            if rank == 0:
                with open(f"{out}.{case}.failed", "w") as f:
                    f.write(str(e))
            continue
        dump(f"{out}.{case}.rank{rank}.pt", cp, model, opt, sched)
    log.info("=== done")
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    main()
