"""A job for tests/storage/test_lease.py: one process, whose job id is CKPT_JOB_ID.

It says what happens, one JSON object a line, in the file --events: "entered" (with the step
it restored), "committed" after each save, "paused", and last "done" or "error" (with the
error's type and message; exit status 3). With --pause-at K it stops after committing step K
until the file --resume exists. --bare only takes the lease (no torch, no Checkpointer): it
says "ready" once set up, takes the lease after the file --go appears, and says "took" or
"refused" (with the message and the time): for races, where the start-up time of torch would
spread the racers apart, and for a check timed against the lease's expiry.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def say(path: str, **event: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.002)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ttl", type=float, default=60.0)
    p.add_argument("--takeover", action="store_true")
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--resume", default="")
    p.add_argument("--keep", type=int, default=10)
    p.add_argument("--raise-at", type=int, default=-1, help="raise an error in the loop after committing this step")
    p.add_argument("--bare", action="store_true")
    p.add_argument("--go", default="")
    p.add_argument("--on-error", default="raise")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[{os.environ.get('CKPT_JOB_ID')}] %(name)s %(levelname)s %(message)s")
    logging.getLogger("ckpt.storage.lease").setLevel(logging.DEBUG)  # how each lease was taken

    import ckpt

    policy = ckpt.Lease(ttl_s=args.ttl, takeover=args.takeover)
    if args.bare:
        from ckpt.storage.lease import LEASE_NAME
        from ckpt.storage.lease_keeper import LeaseKeeper
        from ckpt.storage.store import Store

        store = Store(args.root)
        # The first requests set the client up (on S3: botocore's models, a connection): done
        # before "ready", so that after --go only the take itself runs.
        store.check_reachable()
        store.read_tagged(LEASE_NAME)
        say(args.events, event="ready")
        wait_for(args.go)
        try:
            keeper = LeaseKeeper.take(store, policy)
        except ckpt.LeaseHeld as e:
            say(args.events, event="refused", message=str(e), time=time.time())
            sys.exit(3)
        say(args.events, event="took")
        if args.resume:
            wait_for(args.resume)
        keeper.close(release=True)
        return

    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by launch.start: one file per rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
        args.events = f"{args.events}.rank{dist.get_rank()}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with ckpt.Checkpointer(
            args.root, model=model, optimizer=opt, interval=ckpt.Every(steps=1), keep=ckpt.Keep(last=args.keep),
            lease=policy, handle_sigterm=False, timeout_s=30, on_error=args.on_error,
        ) as cp:
            say(args.events, event="entered", restored=cp.restored_step, job=os.environ.get("CKPT_JOB_ID"))
            for _ in range(cp.step, args.steps):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
                cp.wait()
                say(args.events, event="committed", step=cp.last_commit.step if cp.last_commit else None)
                if cp.step == args.raise_at:
                    raise RuntimeError(f"the loop failed after step {cp.step}")
                if cp.step == args.pause_at:
                    say(args.events, event="paused", step=cp.step)
                    wait_for(args.resume)
    except Exception as e:  # reported to the test, which checks the type and message
        say(args.events, event="error", type=type(e).__name__, message=str(e))
        leave(3)
    say(args.events, event="done", step=cp.step)
    leave(0)


def leave(code: int) -> None:
    """Exit; with several ranks without gloo's teardown at interpreter exit (see launch.py)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
