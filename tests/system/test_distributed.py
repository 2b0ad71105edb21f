"""Distributed behaviour with real processes: 2 ranks over gloo on loopback, CPU only.

Each job is tests/workers/worker.py (one process per rank) and dumps what a user would compare:
full parameters, full optimizer state, scheduler state and draws from every RNG, per rank.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.storage.store import step_dir_name
from tests.support.compare import assert_bitwise_equal
from tests.support.jobs import (
    RANKS,
    WORKER,
    assert_same_training_state,
    committed_steps,
    dumps,
    job,
    rank_logs,
    train,
)
from tests.support.launch import WORKERS, kill_all, run, start, wait

pytestmark = pytest.mark.slow


def stop_at_10_then_resume(tmp_path: Path, mode: str, root: object) -> list[dict]:
    """Job 1 trains 10 steps and stops at its step-10 checkpoint (no extra save on exit);
    job 2, fresh processes, restores and trains to 20. Returns job 2's dumps."""
    common = ("--mode", mode, "--root", root, "--every", 5)
    train(tmp_path, *common, "--steps", 10, "--no-save-on-exit", "--out", tmp_path / "first")
    assert [d["step"] for d in dumps(tmp_path / "first")] == [10] * RANKS
    train(tmp_path, *common, "--steps", 20, "--out", tmp_path / "resumed")
    resumed = dumps(tmp_path / "resumed")
    # Without this, a job that silently started from scratch would match the reference too.
    assert [d["restored_step"] for d in resumed] == [10] * RANKS, rank_logs(tmp_path)
    return resumed


# -- 1. exact resume under every wrapping -------------------------------------------------------
@pytest.mark.parametrize("mode", ["plain", "ddp", "fsdp2", "fsdp1"])
def test_resume_after_restart_is_bitwise_identical(mode, tmp_path, straight_run):
    resumed = stop_at_10_then_resume(tmp_path, mode, tmp_path / "root")
    assert_same_training_state(resumed, straight_run(mode).dumps)
    # What a resumed run saves is named as a fresh run names it: the next restart finds every
    # key (a DDP model with buffers saved "model.module.*" after its first restore).
    keys = [set(dcp.FileSystemReader(str(tmp_path / "root" / step_dir_name(s))).read_metadata().state_dict_metadata) for s in (10, 20)]
    assert keys[0] == keys[1] and "model.5.calls" in keys[0], keys[0] ^ keys[1]


# -- 2. the files are plain DCP -----------------------------------------------------------------
def test_plain_dcp_load_reads_fsdp2_checkpoint_into_fresh_model(tmp_path, straight_run):
    saved = straight_run("fsdp2")  # its newest checkpoint holds the state it ended with
    assert committed_steps(saved.root) == [5, 10, 15, 20]

    job(tmp_path, WORKERS / "plain_dcp_load.py", "fsdp2", saved.root / "step-0000000020", tmp_path / "loaded")
    loaded = dumps(tmp_path / "loaded")
    for rank, want in enumerate(saved.dumps):
        assert not torch.equal(loaded[rank]["init"]["0.weight"], want["model"]["0.weight"])
        assert_bitwise_equal(loaded[rank]["model"], want["model"], f"rank{rank}.model")
        assert_bitwise_equal(loaded[rank]["optim"], want["optim"], f"rank{rank}.optim")


# -- 3. the same on an S3-protocol store --------------------------------------------------------
def test_fsdp2_resume_from_s3_after_restart_is_bitwise_identical(s3_root, s3_endpoint, tmp_path, straight_run):
    # The ranks reach the moto server through the inherited AWS_* environment alone.
    resumed = stop_at_10_then_resume(tmp_path, "fsdp2", s3_root)
    assert_same_training_state(resumed, straight_run("fsdp2").dumps)

    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    keys = {o["Key"] for o in listed.get("Contents", [])}
    assert {f"{prefix}/step-{s:010d}/manifest.json" for s in (5, 10, 15, 20)} <= keys


# -- 4. preemption ------------------------------------------------------------------------------
def stop_after_step_4(procs: list, root: Path, log_dir: Path, ask: Callable[[], object]) -> list[int]:
    """Once step 4 is committed, `ask` the job to stop; its ranks' exit codes."""
    try:
        deadline = time.monotonic() + 120
        while not (root / "step-0000000004" / "manifest.json").exists():
            assert all(p.poll() is None for p in procs), f"a rank exited early\n{rank_logs(log_dir)}"
            assert time.monotonic() < deadline, f"no checkpoint at step 4\n{rank_logs(log_dir)}"
            time.sleep(0.05)
        ask()
        return wait(procs, timeout=60)
    finally:
        kill_all(procs)


# How a job is asked to stop, and the exit status each rank then gives: 143 ("terminated by
# SIGTERM") and 130 ("interrupted"), so torchrun and schedulers know the job is not done.
STOPS = {
    # rank 1 only: rank 0 must learn of it
    "sigterm_to_one_rank": (lambda procs: procs[1].send_signal(signal.SIGTERM), 143),
    # a Ctrl-C under torchrun: every rank has it from the terminal and again from torchrun
    "ctrl_c_to_every_rank_twice": (lambda procs: [p.send_signal(signal.SIGINT) for _ in range(2) for p in procs], 130),
}


@pytest.mark.parametrize("how", STOPS)
def test_a_stop_signal_checkpoints_all_ranks_at_the_same_step_and_exits_not_done(tmp_path, straight_run, how):
    ask, status = STOPS[how]
    root = tmp_path / "root"
    common = ("--mode", "fsdp2", "--root", str(root), "--steps", "20", "--every", "4")
    procs = start(RANKS, WORKER, *common, "--step-sleep", "0.3", "--out", str(tmp_path / "stopped"), log_dir=tmp_path)
    codes = stop_after_step_4(procs, root, tmp_path, lambda: ask(procs))
    assert codes == [status] * RANKS, f"exit codes {codes}\n{rank_logs(tmp_path)}"

    stopped = dumps(tmp_path / "stopped")
    assert all(d["preempted"] for d in stopped), rank_logs(tmp_path)
    stop = stopped[0]["step"]
    assert [d["step"] for d in stopped] == [stop] * RANKS
    assert 4 < stop < 20
    newest = sorted(root.glob("step-*"))[-1]  # nothing newer, not even a half-written directory
    assert json.loads((newest / "manifest.json").read_text())["step"] == stop
    assert committed_steps(root)[-1] == stop

    # The rerun resumes there, and finishes as if it had never been interrupted.
    train(tmp_path, *common, "--out", tmp_path / "rerun")
    rerun = dumps(tmp_path / "rerun")
    assert [d["restored_step"] for d in rerun] == [stop] * RANKS
    assert_same_training_state(rerun, straight_run("fsdp2").dumps)


# -- 5. failed background saves (one process: nothing distributed is claimed) ------------------
def test_a_preemption_notice_file_checkpoints_all_ranks_and_a_stale_one_is_ignored(tmp_path, monkeypatch):
    """`CKPT_PREEMPT_FILE`: creating the file does what a SIGTERM does, on every rank at the
    same step; the restarted job, which finds the same file there, runs to the end."""
    root, notice = tmp_path / "root", tmp_path / "preempt-notice"
    common = ("--mode", "plain", "--root", str(root), "--steps", "20", "--every", "4")
    env = {"CKPT_PREEMPT_FILE": str(notice)}
    procs = start(RANKS, WORKER, *common, "--step-sleep", "0.2", "--out", str(tmp_path / "stopped"), env=env, log_dir=tmp_path)
    codes = stop_after_step_4(procs, root, tmp_path, notice.touch)
    assert codes == [143] * RANKS, f"exit codes {codes}\n{rank_logs(tmp_path)}"
    stopped = dumps(tmp_path / "stopped")
    stop = stopped[0]["step"]
    assert [d["step"] for d in stopped] == [stop] * RANKS and 4 < stop < 20
    assert committed_steps(root)[-1] == stop
    assert f"preempted (notice file {notice})" in rank_logs(tmp_path)

    monkeypatch.setenv("CKPT_PREEMPT_FILE", str(notice))  # the notice is still there
    train(tmp_path, *common, "--out", tmp_path / "rerun")
    rerun = dumps(tmp_path / "rerun")
    assert [d["restored_step"] for d in rerun] == [stop] * RANKS
    assert [d["step"] for d in rerun] == [20] * RANKS and not any(d["preempted"] for d in rerun)


def break_root(root: Path) -> None:
    """Put a regular file where the root directory was: no step directory can be made under
    it (works as root too, which ignores permission bits)."""
    os.rename(root, root.with_name("root.aside"))
    root.write_text("not a directory")


def mend_root(root: Path) -> None:
    root.unlink()
    os.rename(root.with_name("root.aside"), root)


def tiny_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_until(cp: ckpt.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for _ in range(cp.step, step):
        model(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        cp.step_done()


def test_failed_background_save_raises_save_failed_at_next_step_done(tmp_path):
    root = tmp_path / "root"
    model, opt = tiny_job()
    # A save every step: the next step_done either finds the failed save done or waits for
    # it before saving again, so the failure surfaces there whatever the thread timing.
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=1), on_error="raise") as cp:
        train_until(cp, model, opt, 2)
        cp.wait()  # step 2 committed
        break_root(root)
        train_until(cp, model, opt, 3)  # the save of step 3 fails in the background
        with pytest.raises(ckpt.SaveFailed, match="step 3"):
            train_until(cp, model, opt, 4)
        assert cp.step == 4
        mend_root(root)  # storage is back: the save on leaving commits step 4
    assert committed_steps(root) == [1, 2, 4]
    assert not (root / "step-0000000003").exists()


def test_failed_background_save_is_logged_and_training_continues_with_on_error_log(tmp_path, caplog):
    root = tmp_path / "root"
    model, opt = tiny_job()
    caplog.set_level(logging.ERROR, logger="ckpt")
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=2), on_error="log") as cp:
        train_until(cp, model, opt, 2)
        cp.wait()  # step 2 committed
        break_root(root)
        train_until(cp, model, opt, 10)  # every save from step 4 on fails
    assert cp.step == 10
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("ckpt")]
    for step in (4, 6, 8, 10):
        assert any(f"save of step {step} " in m for m in failed), failed

    mend_root(root)
    assert committed_steps(root) == [2]  # the last good checkpoint is untouched
    model2, opt2 = tiny_job()
    with ckpt.Checkpointer(root, model=model2, optimizer=opt2, save_on_exit=False) as cp2:
        assert cp2.step == 2


PER_RANK_EXTRA = """
import sys, torch, torch.distributed as dist, ckpt
dist.init_process_group("gloo")
rank = dist.get_rank()

class Stream:  # a per-rank data stream, keyed by rank as the README says to save one
    pos = 0
    def state_dict(self):
        return {f"rank_{rank}": {"pos": torch.tensor(self.pos)}}
    def load_state_dict(self, sd):
        self.pos = int(sd[f"rank_{rank}"]["pos"])

stream = Stream()
with ckpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2), extra={"stream": stream}, interval=None, handle_sigterm=False) as cp:
    if cp.restored_step is None:
        stream.pos = 10 + rank
        cp.save(blocking=True)
    print("POS", cp.restored_step, stream.pos, flush=True)
dist.destroy_process_group()
"""


def test_per_rank_extras_restore_on_every_rank_and_no_rank_calls_them_unrestored(tmp_path):
    """Each rank loads its own `rank_<r>` keys: the other ranks' are not 'left unrestored'."""
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK_EXTRA)
    for run_ in ("first", "again"):
        logs = tmp_path / run_
        logs.mkdir()
        assert run(2, script, str(tmp_path / "root"), log_dir=logs) == [0, 0]
    for rank in range(2):
        text = (tmp_path / "again" / f"rank{rank}.log").read_text()
        assert f"POS 0 {10 + rank}" in text, text
        assert "left unrestored" not in text, text


@pytest.mark.parametrize("phase", ["state_dict", "load_state_dict"])
def test_a_restore_that_fails_on_one_rank_with_a_users_error_fails_on_every_rank_at_once(phase, tmp_path):
    """A user's object that raises on one rank only (an AttributeError, not one of ckpt's) in
    the restore's template or as what was read is applied: before, that rank left the restore
    while the others waited in a collective until its timeout and then raised something else."""
    out = tmp_path / "out"
    codes = run(2, WORKERS / "broken_state_worker.py", str(tmp_path / "root"), str(out), phase, log_dir=tmp_path, timeout=240)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    for rank in range(2):
        got = json.loads(Path(f"{out}.{phase}.rank{rank}.json").read_text())
        assert got["type"] == "RestoreFailed", (rank, got)
        assert "AttributeError" in got["message"] and "'cursor'" in got["message"], (rank, got)
        assert got["s"] < 30, (rank, got)  # long before the collectives' timeout (60 s)
    # rank 0 says which rank failed, and why
    assert "rank 1: AttributeError" in json.loads(Path(f"{out}.{phase}.rank0.json").read_text())["message"]
