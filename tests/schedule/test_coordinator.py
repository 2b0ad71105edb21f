"""Rank 0's coordinator under `interval="auto"` (ckpt.schedule.coordinator): which runs count as
failures and how many ranks make a node, then live jobs that save when it pays, record why in
each manifest, and learn a shorter MTBF from the job's failed runs."""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt


def test_user_exits_are_not_failures_but_kills_and_crashes_are():
    from ckpt.schedule.coordinator import failed

    assert failed(None) and failed("error: RuntimeError: CUDA error: an illegal memory access")
    assert not failed("completed") and not failed("preempted (SIGTERM)")
    assert not failed("error: KeyboardInterrupt: ") and not failed("error: SystemExit: 0")


def test_the_node_count_comes_from_the_launchers_local_size(monkeypatch):
    from ckpt.schedule.coordinator import ranks_per_node

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_per_node() == 1
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x4)")
    assert ranks_per_node() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", " 4 ")  # as a shell may leave it
    assert ranks_per_node() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "\u00b2")  # a digit to str.isdigit(), not to int(): the next variable's
    assert ranks_per_node() == 8


@pytest.mark.parametrize(("local", "cores", "each"), [(None, 1, True), ("1", 1, True), ("2", 2, True), ("3", 2, False), ("8", 64, True), ("16(x2)", 8, False)])
def test_a_rank_has_a_core_of_its_own_until_its_nodes_ranks_outnumber_the_cores_it_may_run_on(monkeypatch, local, cores, each):
    from ckpt.collectives import a_core_each

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    if local is not None:
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", local)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))  # the process's CPU mask, as a launcher pins it
    assert a_core_each() is each


def _train_auto(root, auto, steps: int, sleep_s: float = 0.02, enough=None):
    """Train up to `steps` steps under the interval policy `auto`; stop sooner once
    `enough()` says so."""
    import time

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=auto, keep=ckpt.Keep(last=1000), handle_sigterm=False, save_on_exit=False) as cp:
        for _ in range(steps):
            if enough is not None and enough():
                break
            time.sleep(sleep_s)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        cp.wait()
    return cp


def test_auto_interval_saves_when_it_pays_and_records_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    # A node failing every 20 s: saves are cheap, so the optimum is about every step. One
    # save that a busy machine slows to 0.2 s puts the next 3 s away (sqrt(2 * 0.2 * 20)):
    # train until three were committed, for up to 40 s.
    def three() -> bool:
        return len(list(tmp_path.glob("step-*/manifest.json"))) >= 3

    cp = _train_auto(tmp_path, ckpt.Auto(node_mtbf_s=20.0, first_after_s=0.1), steps=2000, enough=three)
    manifests = [ckpt.Manifest.from_json(p.read_bytes()) for p in sorted(tmp_path.glob("step-*/manifest.json"))]
    assert len(manifests) >= 3
    assert manifests[0].schedule == {"policy": "auto", "seconds": 0.1}  # before any measurement
    later = manifests[-1].schedule
    assert later["policy"] == "auto" and later["mtbf_s"] == pytest.approx(20.0, rel=0.01)
    # the interval came from the unrounded costs; the manifest keeps them to 0.1 and 1 ms
    def interval(blocking: float, persist: float) -> float:
        return max((2 * max(blocking, 1e-3) * 20.0) ** 0.5, 1.1 * persist)  # a floor of 1 ms on blocking

    # priced at the whole cost: blocking plus the slowdown of the steps beside the save
    assert later["cost_s"] == pytest.approx(later["blocking_s"] + (later["slowdown_s"] or 0.0), abs=2e-4)
    lo = interval(later["cost_s"] - 5e-5, later["persist_s"] - 5e-4)
    hi = interval(later["cost_s"] + 5e-5, later["persist_s"] + 5e-4)
    assert lo - 5e-4 <= later["seconds"] <= hi + 5e-4, later
    assert "interval: every" in caplog.text and cp.schedule["policy"] == "auto"


def test_auto_interval_learns_a_shorter_mtbf_from_the_jobs_failed_runs(tmp_path):
    import time

    from ckpt.events import RunRecord, write_run
    from ckpt.storage.store import Store

    store = Store(tmp_path)
    now = time.time()
    for i in range(6):  # six earlier runs, each killed after 100 s
        write_run(store, RunRecord(f"old-{i}", 1, now - 1000 + i * 100, now - 900 + i * 100, 0, 10))
    cp = _train_auto(tmp_path, ckpt.Auto(node_mtbf_s=1e6, first_after_s=0.05), steps=10)
    assert cp.schedule["failures_seen"] == 6
    # prior: 1 failure in 1e6 s; seen: 6 more in 600 s -> 7 / (1e6 + 600) per second
    assert cp.schedule["mtbf_s"] == pytest.approx((1e6 + 600) / 7, rel=0.01)
