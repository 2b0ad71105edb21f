"""The main job: train on two nodes, lose one, carry on with one, and prove nothing was lost.

    make demo        (or: python examples/demo.py)

1. A reference run: the small transformer of train_transformer.py, FSDP2 on 2 ranks under
   torchrun, uninterrupted.
2. The same job under torchrun's elastic engine as two single-process "nodes" on loopback
   (`--nnodes=1:2`, c10d rendezvous), checkpointing asynchronously to ./checkpoints/demo/run.
   Once step 60 has committed, one node is lost: its agent and its rank die with SIGKILL.
   torchrun restarts the survivor at world size 1; ckpt restores the last commit, reshards
   model and optimizer from 2 ranks to 1, keeps the global batch with gradient accumulation,
   and the data position from the global cursor; the job finishes.
3. A report (checkpoints, blocking time per save, steps lost, world sizes), a check against
   the reference (every global batch holds the same samples; the loss curve agrees within
   the stated tolerance, as the summation order differs on another world size), and a
   picture of the loss against step with the failure and the restore marked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_transformer.py"
LOSS_TOLERANCE = 1e-3  # relative: the same batches summed in another order (measured: ~1e-7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, node: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    """Wait until something listens on loopback `port` (node A's rendezvous store); False if
    `node` exited first or the time ran out. Read from /proc, so the store sees no stray
    connection."""
    hex_port = f":{port:04X} "
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and node.poll() is None:
        for table in ("/proc/net/tcp6", "/proc/net/tcp"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            if any(hex_port in ln.split(None, 2)[1] + " " and ln.split()[3] == "0A" for ln in lines):
                return True
        time.sleep(0.05)
    return False


def torchrun(launcher: list[str], root: Path, logs: Path, steps: int, every: int, sleep: float, out) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *launcher, str(TRAIN), "--root", str(root),
        "--steps", str(steps), "--every", str(every), "--step-sleep", str(sleep),
        "--loss-log", str(logs / "loss.jsonl"), "--samples-log", str(logs / "samples.jsonl"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_node(pid: int) -> None:
    """SIGKILL a node's agent and everything under it, as if the machine vanished."""
    def tree(p: int) -> list[int]:
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            return []
        return kids + [d for k in kids for d in tree(k)]

    for p in [pid, *tree(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def global_batches(logs: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = defaultdict(set)
    for row in read_jsonl(logs / "samples.jsonl"):
        out[row["step"]] |= set(row["idx"])
    return out


def committed_world(root: Path, step: int) -> int | None:
    try:
        return json.loads((root / f"step-{step:010d}" / "manifest.json").read_text())["world_size"]
    except (OSError, ValueError):
        return None


def plot(path: Path, ref: list[dict], run: list[dict], killed_at: int, resumed_from: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    ax.plot([r["step"] for r in ref], [r["loss"] for r in ref], color="0.6", lw=3, label="uninterrupted, 2 ranks")
    first = [r for r in run if r["world"] == 2]
    second = [r for r in run if r["world"] == 1]
    ax.plot([r["step"] for r in first], [r["loss"] for r in first], color="tab:blue", lw=1.3, label="elastic run, 2 ranks")
    ax.plot([r["step"] for r in second], [r["loss"] for r in second], color="tab:orange", lw=1.3, label="after the restart, 1 rank")
    ax.axvline(killed_at, color="tab:red", ls="--", lw=1)
    ax.axvline(resumed_from, color="tab:green", ls=":", lw=1.5)
    top = max(r["loss"] for r in ref)
    ax.annotate(f"node lost\n(step {killed_at})", (killed_at, top), xytext=(6, -10), textcoords="offset points",
                color="tab:red", va="top", fontsize=9)  # fmt: skip
    ax.annotate(f"restored step {resumed_from}\non 1 rank", (resumed_from, top * 0.75), xytext=(-6, 0),
                textcoords="offset points", color="tab:green", ha="right", fontsize=9)  # fmt: skip
    ax.set_xlabel("optimizer step (global batch of 32 sequences)")
    ax.set_ylabel("training loss")
    ax.set_title("ckpt: a node lost mid-run, resumed on the survivor")
    ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="./checkpoints/demo", help="wiped and reused by every demo run")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=60, help="lose a node once this step committed")
    p.add_argument("--picture", default="", help="also copy the PNG here")
    args = p.parse_args()

    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()

    print(f"[1/3] reference: {args.steps} steps on 2 ranks, uninterrupted")
    ref_logs = work / "reference-logs"
    ref_logs.mkdir()
    with open(work / "reference.log", "wb") as out:
        ref = torchrun(["--standalone", "--nproc_per_node=2"], work / "reference", ref_logs, args.steps, args.every, 0.0, out)
        if ref.wait(timeout=600):
            print((work / "reference.log").read_text()[-3000:])
            return 1

    root, logs = work / "run", work / "run-logs"
    logs.mkdir()
    print(f"[2/3] the same job on two elastic nodes; one is lost once step {args.kill_after} has committed")
    port = free_port()
    elastic = [
        "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3", "--monitor-interval=0.2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ckpt-demo",
        "--rdzv-conf=join_timeout=60,last_call_timeout=5,close_timeout=5",
    ]  # fmt: skip
    out_a, out_b = open(work / "node-a.log", "wb"), open(work / "node-b.log", "wb")
    node_a = torchrun(elastic, root, logs, args.steps, args.every, 0.02, out_a)
    # IMPORTANT: node A must host the rendezvous store (the first agent to bind its port does),
    # or losing node B takes the store with it. Starting B 0.3 s after A was a race on a busy
    # machine, where importing torch alone takes longer.
    if not wait_listening(port, node_a):
        print("node A's rendezvous store did not start; see", work)
        kill_node(node_a.pid)
        return 1
    node_b = torchrun(elastic, root, logs, args.steps, args.every, 0.02, out_b)
    try:
        while committed_world(root, args.kill_after) != 2:
            if node_a.poll() is not None or node_b.poll() is not None:
                print("a node exited early; see", work)
                return 1
            time.sleep(0.05)
        time.sleep(0.15)  # lose the node in the middle of training, not on a commit
        kill_node(node_b.pid)
        node_b.wait(timeout=30)
        print("      node B lost (SIGKILL to its torchrun agent and its rank)")
        rc = node_a.wait(timeout=600)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                kill_node(node.pid)
    if rc:
        print((work / "node-a.log").read_text()[-3000:])
        return 1

    # -- what happened -------------------------------------------------------------------------
    ref_loss = {r["step"]: r for r in read_jsonl(ref_logs / "loss.jsonl")}
    run = read_jsonl(logs / "loss.jsonl")
    killed_at = max(r["step"] for r in run if r["world"] == 2)
    resumed_from = min(r["step"] for r in run if r["world"] == 1) - 1
    node_logs = (work / "node-a.log").read_text() + (work / "node-b.log").read_text()
    commits = re.findall(r"committed \S+/step-(\d+) \(([\d.]+) MB, blocked ([\d.]+) ms", node_logs)
    blocked = sorted(float(b) for _, _, b in commits)
    restarts = json.loads(subprocess.run(
        [sys.executable, "-m", "ckpt.cli.main", "events", str(root), "--json"], capture_output=True, text=True,
        cwd=HERE.parent, check=True,
    ).stdout)["events"]  # fmt: skip

    ref_batches, run_batches = global_batches(ref_logs), global_batches(logs)
    partial = {s for s in run_batches if s > resumed_from and s <= killed_at}  # redone after the loss
    same_data = sorted(run_batches) == sorted(ref_batches) and all(
        run_batches[s] == ref_batches[s] for s in run_batches
    )
    final = {r["step"]: r for r in run}  # the resumed run's value where a step was redone
    drift = max(abs(final[s]["loss"] - ref_loss[s]["loss"]) / ref_loss[s]["loss"] for s in final)
    png = work / "loss.png"
    plot(png, list(ref_loss.values()), run, killed_at, resumed_from)
    if args.picture:
        shutil.copy(png, args.picture)

    print()
    print("report")
    kept = sorted(int(d.name.removeprefix("step-")) for d in root.glob("step-*"))
    print(f"  checkpoints committed: {len(commits)} ({commits[0][1]} MB each), kept {kept} (Keep(last=3))")
    print(f"  blocking time per save: median {blocked[len(blocked) // 2]:.1f} ms, max {blocked[-1]:.1f} ms (the first save allocates its buffers)")
    for ev in restarts:
        if ev["kind"] == "restart":
            print(f"  restart: world size {ev['world_size_before']} -> {ev['world_size']}, resumed at step {ev['step']} "
                  f"from {ev['restored_from']}, cause: {ev['cause'][:70]}")  # fmt: skip
    print(f"  node lost at step {killed_at}, resumed from step {resumed_from}: {killed_at - resumed_from} steps redone ({sorted(partial)})")
    print(f"  data order: every global batch holds the reference's samples: {same_data}")
    print(f"  loss vs the uninterrupted run: max relative difference {drift:.2e} (tolerance {LOSS_TOLERANCE:.0e}): {drift <= LOSS_TOLERANCE}")
    print(f"  picture: {png}")
    print(f"  wall time {time.time() - t0:.0f} s; inspect with: ckpt ls {root}   ckpt events {root}")
    return 0 if same_data and drift <= LOSS_TOLERANCE and restarts else 1


if __name__ == "__main__":
    sys.exit(main())
