"""The main job: train, lose a rank, resume, finish, and prove nothing was lost.

    make demo        (or: python examples/demo.py)

1. A reference run trains the small transformer of train_transformer.py under torchrun on
   2 ranks (FSDP2, gloo, CPU) without interruption.
2. The same job again, checkpointing asynchronously to ./checkpoints/demo; once a few
   checkpoints have committed, one rank is killed with SIGKILL (a lost GPU). The job dies.
3. The same command again: it restores the last committed checkpoint and finishes.
4. A report: checkpoints taken, blocking time per save, steps lost, and whether the resumed
   run's final weights equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ckpt import catalog  # noqa: E402
from ckpt.storage import Store  # noqa: E402


def torchrun(root: Path, out: Path, steps: int, every: int, log: Path, sleep: float, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={port}",
        str(HERE / "train_transformer.py"), "--root", str(root), "--steps", str(steps),
        "--every", str(every), "--loss-log", str(log), "--final-state", str(out), "--step-sleep", str(sleep),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def finish(proc: subprocess.Popen, name: str, quiet_fail: bool = False) -> int:
    out, _ = proc.communicate(timeout=600)
    for line in out.splitlines():
        if line.startswith("[rank") or "Error" in line or (not quiet_fail and proc.returncode):
            print(f"  {name} | {line}")
    return proc.returncode


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="./checkpoints/demo", help="wiped and reused by every demo run")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-after-commit", type=int, default=60, help="kill a rank once this step committed")
    args = p.parse_args()

    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root, ref_root = work / "run", work / "reference"
    t0 = time.time()

    print(f"[1/3] reference: {args.steps} steps on 2 ranks, uninterrupted")
    ref = torchrun(ref_root, work / "reference.pt", args.steps, args.every, work / "reference.jsonl", 0.0, 29611)
    if finish(ref, "reference"):
        print("reference run failed")
        return 1

    print(f"[2/3] the same job, checkpointing to {root}; a rank is killed after step {args.kill_after_commit} commits")
    job = torchrun(root, work / "resumed.pt", args.steps, args.every, work / "run.jsonl", 0.02, 29612)
    store = Store(str(root))
    killed_pid = None
    while job.poll() is None:
        committed = [e.step for e in catalog.scan(store) if e.state == catalog.COMMITTED]
        if committed and max(committed) >= args.kill_after_commit:
            ranks = children(job.pid)
            if ranks:
                killed_pid = ranks[-1]
                time.sleep(0.15)  # land the kill in the middle of training, not on the commit
                os.kill(killed_pid, signal.SIGKILL)
                break
        time.sleep(0.05)
    rc = finish(job, "run", quiet_fail=True)
    steps_done = [json.loads(line)["step"] for line in (work / "run.jsonl").read_text().splitlines()]
    killed_at = max(steps_done)
    print(f"      rank process {killed_pid} killed with SIGKILL at step {killed_at}; torchrun exited with {rc}")
    if rc == 0:
        print("the job finished before the kill landed; rerun with a larger --steps")
        return 1

    print("[3/3] the same command again: restore and finish")
    job = torchrun(root, work / "resumed.pt", args.steps, args.every, work / "run.jsonl", 0.0, 29613)
    if finish(job, "resume"):
        print("resumed run failed")
        return 1

    entries = catalog.scan(store)
    manifests = [e.manifest for e in entries if e.manifest is not None]
    lines = [json.loads(line) for line in (work / "run.jsonl").read_text().splitlines()]
    resumed_at = lines[len(steps_done)]["step"] - 1  # the first step the restarted job ran
    ref_state, state = torch.load(work / "reference.pt"), torch.load(work / "resumed.pt")
    identical = ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    blocking = sorted(m.costs.blocking_s * 1e3 for m in manifests)

    print()
    print("report")
    print(f"  checkpoints committed and kept: {[m.step for m in manifests]} (Keep(last=3))")
    print(f"  blocking time per save (kept checkpoints): median {blocking[len(blocking) // 2]:.1f} ms, max {blocking[-1]:.1f} ms")
    print(f"  size per checkpoint: {manifests[-1].total_bytes / 1e6:.1f} MB; world size 2 -> 2")
    print(f"  killed at step {killed_at}, resumed from step {resumed_at}: {killed_at - resumed_at} steps redone")
    print(f"  final weights equal to the uninterrupted run, bit for bit: {identical}")
    print(f"  wall time {time.time() - t0:.0f} s; inspect with: ckpt ls {root}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
