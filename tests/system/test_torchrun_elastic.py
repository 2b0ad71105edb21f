"""Under torchrun's own elastic engine: two single-process "nodes" on loopback; one node dies;
torchrun restarts the survivor at world size 1 and ckpt resumes it, reshards and finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.support.elastic import WORKER, global_batches, job
from tests.support.launch import REPO, free_port

sys.path.insert(0, str(REPO / "examples"))
from demo import wait_listening  # noqa: E402  (the demo launches its nodes the same way)


def torchrun_node(port: int, root, logs, out) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ckpt-elastic-test",
        "--rdzv-conf=join_timeout=60,last_call_timeout=5,close_timeout=5",
        str(WORKER), "--root", str(root), "--log-dir", str(logs), "--steps", "18", "--every", "3",
        "--step-sleep", "0.25",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # Each node in its own session: killing one kills its agent and its worker, as losing it would.
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _committed_on_two_nodes(step_dir) -> bool:
    try:
        return json.loads((step_dir / "manifest.json").read_text())["world_size"] == 2
    except (OSError, ValueError):
        return False


def descendants(pid: int) -> list[int]:
    try:
        kids = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in descendants(k)]


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node's agent and every process under it (torchrun starts its workers in
    sessions of their own, so the agent's process group alone would miss them)."""
    for pid in [node.pid, *descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_torchrun_elastic_node_loss_resumes_on_the_survivor_with_the_same_data_order(tmp_path):
    assert job(2, tmp_path / "ref-root", tmp_path / "ref", "--steps", "18") == [0, 0]
    reference = global_batches(tmp_path / "ref")

    root, logs = tmp_path / "root", tmp_path / "elastic"
    logs.mkdir()
    port = free_port()
    a_out, b_out = open(tmp_path / "node-a.log", "wb"), open(tmp_path / "node-b.log", "wb")
    node_a = torchrun_node(port, root, logs, a_out)
    # IMPORTANT: node A hosts the rendezvous store, or losing B takes the store with it: B
    # starts once A's store listens (a fixed 0.3 s was a race on a busy machine).
    assert wait_listening(port, node_a), (tmp_path / "node-a.log").read_text()
    node_b = torchrun_node(port, root, logs, b_out)
    try:
        deadline = time.monotonic() + 120
        while not _committed_on_two_nodes(root / "step-0000000006"):
            assert node_a.poll() is None and node_b.poll() is None, (tmp_path / "node-a.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "node-a.log").read_text()
            time.sleep(0.05)
        kill_node(node_b)  # node B is gone: its agent and its worker
        node_b.wait(timeout=30)
        rc = node_a.wait(timeout=240)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                kill_node(node)
    log_a = (tmp_path / "node-a.log").read_text()
    assert rc == 0, log_a[-5000:]

    rows = [line for line in (logs / "samples.jsonl").read_text().splitlines()]
    worlds = [int(r.split('"world": ')[1].split(",")[0]) for r in rows]
    assert 2 in worlds and worlds[-1] == 1  # it ran on two nodes, and finished on one
    assert "resuming step" in log_a and "(saved on 2)" in log_a

    # Every global batch the job completed is the uninterrupted run's, sample for sample; a
    # step the lost node was inside is redone on the survivor.
    seen = global_batches(logs)  # unions over both runs: a redone step must add nothing new
    assert sorted(seen) == list(range(1, 19))
    for step in range(1, 19):
        assert seen[step] == reference[step], f"step {step}: {sorted(seen[step])} != {sorted(reference[step])}"
