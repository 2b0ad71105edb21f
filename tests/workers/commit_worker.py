"""One rank of a job that saves step 1 once, blocking, to an S3 root (run by
tests/system/test_flaky_store.py, whose proxy throttles the commit). Short timeouts: the
Checkpointer's (--timeout), the lease's ttl (--ttl: renewed every ttl/3). It writes what the
rank learnt of its save to <out>.rank<R>.json: the failed saves in a row and the step of
`cp.last_commit` (None: no commit it knows of).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist

import ckpt
from tests.support.launch import exit_without_teardown


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--transfer", default="{}", help="JSON: ckpt.Transfer's fields")
    p.add_argument("--timeout", type=float, required=True, help="the Checkpointer's timeout_s")
    p.add_argument("--ttl", type=float, required=True, help="the lease's ttl_s")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ['RANK']}] %(asctime)s %(name)s %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with ckpt.Checkpointer(
        args.root,
        model=torch.nn.Linear(4, 4),
        storage_options=json.loads(args.storage_options),
        transfer=ckpt.Transfer(**json.loads(args.transfer)),
        timeout_s=args.timeout,
        lease=ckpt.Lease(ttl_s=args.ttl),
        interval=None,
        save_on_exit=False,
        restore="none",
        on_error="log",
        handle_sigterm=False,
    ) as cp:
        cp.step_done()
        cp.save(blocking=True)
        learnt = {"failures_in_row": cp.failures_in_row, "last_commit": cp.last_commit.step if cp.last_commit is not None else None}
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(learnt, f)
        # Out at once: after a failed commit the ranks may not agree on leaving together.
        exit_without_teardown()


if __name__ == "__main__":
    main()
