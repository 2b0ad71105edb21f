"""Training against a flaky object store: the moto S3 server behind a fault-injecting proxy
(tests/support/s3proxy.py) that answers 500 and 503 SlowDown, delays, drops connections, truncates
bodies and hangs, at set rates. A save either commits correctly or fails cleanly and a later
one commits; training goes on (unless told to stop after K failed saves in a row); a store
that hangs fails a save within the configured timeout, never hangs the job."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time

import pytest
import torch

import ckpt
from ckpt.storage.store import Store
from tests.support.cli import ckpt_cli
from tests.support.compare import assert_bitwise_equal
from tests.support.jobs import RANKS, WORKER, assert_same_training_state, dumps, rank_logs
from tests.support.launch import WORKERS, run
from tests.support.toy_model import build, optimizer

FLAKY = {"500": 0.04, "503": 0.06, "reset": 0.03, "delay": 0.08, "truncate": 0.03}
QUICK = {"attempts": 6, "backoff_s": 0.01, "max_backoff_s": 0.2, "timeout_s": 5.0}


def verify_deep(root: str, options: dict) -> subprocess.CompletedProcess:
    flags = [f"--storage-option={k}={v}" for k, v in options.items()]
    return ckpt_cli("verify", root, "--deep", *flags)


@pytest.mark.slow
def test_a_job_on_a_flaky_store_ends_exactly_where_a_healthy_run_ends(tmp_path, proxy, s3_root, s3_options, straight_run):
    """2 ranks, FSDP2, a save every 5 steps through a store that fails one request in four;
    the run and a restart from what it committed both end bit for bit where a run on a
    healthy store ends."""
    proxy.flaky(seed=11, rates=FLAKY)
    flaky = {**s3_options, "endpoint_url": proxy.url}
    args = ("--mode", "fsdp2", "--root", s3_root, "--steps", 20, "--every", 5, "--on-error", "log",
            "--storage-options", json.dumps(flaky), "--transfer", json.dumps(QUICK))
    codes = run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "out"), log_dir=tmp_path)
    assert codes == [0] * RANKS, rank_logs(tmp_path)
    assert_same_training_state(dumps(tmp_path / "out"), straight_run("fsdp2").dumps)
    print(f"\nflaky store: {sum(proxy.seen.values())} requests, faults injected {dict(proxy.injected)}")

    # Every checkpoint the flaky run committed is whole, read through a healthy endpoint.
    check = verify_deep(s3_root, s3_options)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "step-0000000020  ok" in check.stdout, check.stdout
    # A restart through the same flaky store restores step 20 exactly.
    codes = run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "again"), log_dir=tmp_path)
    assert codes == [0] * RANKS, rank_logs(tmp_path)
    again = dumps(tmp_path / "again")
    assert [d["restored_step"] for d in again] == [20] * RANKS
    assert_same_training_state(again, straight_run("fsdp2").dumps)
    # both runs met every kind of fault (which request draws which depends on the ranks' timing)
    assert all(proxy.injected[f] for f in FLAKY), f"some faults never hit: {proxy.injected}"


def one_rank(root: str, options: dict, **kw) -> tuple[ckpt.Checkpointer, torch.nn.Module, torch.optim.Optimizer]:
    model = build("plain", 1)
    opt, _ = optimizer(model)
    # No lease: its check (a read before each save) would be the request that fails first.
    cp = ckpt.Checkpointer(root, model=model, optimizer=opt, storage_options=options, interval=ckpt.Every(steps=1),
                           handle_sigterm=False, transfer=ckpt.Transfer(**{**QUICK, "attempts": 2, "timeout_s": 3.0}),
                           lease=None, **kw)
    return cp, model, opt


def train_step(cp: ckpt.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    cp.step_done()


def test_while_the_store_is_down_saves_fail_cleanly_training_goes_on_and_the_next_save_commits(proxy, s3_root, s3_options, caplog):
    options = {**s3_options, "endpoint_url": proxy.url}
    cp, model, opt = one_rank(s3_root, options, on_error="log")
    with cp:
        train_step(cp, model, opt)
        cp.wait()
        assert cp.last_commit.step == 1
        proxy.flaky(seed=1, rates={"500": 0.5, "reset": 0.5})  # down: every request fails
        with caplog.at_level(logging.ERROR, logger="ckpt"):
            for _ in range(2):
                train_step(cp, model, opt)
                cp.wait()
        assert cp.failures_in_row == 2 and cp.last_commit.step == 1
        assert "2 failed save(s) in a row" in caplog.text
        proxy.flaky(seed=2)  # back
        train_step(cp, model, opt)
        cp.wait()
        assert cp.failures_in_row == 0 and cp.last_commit.step == 4
        want = {k: v.clone() for k, v in model.state_dict().items()}
    check = verify_deep(s3_root, s3_options)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "step-0000000002  ok" not in check.stdout and "step-0000000003  ok" not in check.stdout, check.stdout
    cp, model, opt = one_rank(s3_root, s3_options, save_on_exit=False)
    with cp:
        assert cp.restored_step == 4
        assert_bitwise_equal(dict(model.state_dict()), want, "model")


def test_ckpt_cp_from_a_store_that_throttles_retries_as_a_save_does(tmp_path, proxy, s3_root, s3_options):
    """A copy of a whole checkpoint must not fail on one burst of SlowDown: `ckpt cp` reads
    with a save's retries (8 attempts), not the 3 of a quick admin command such as `ls`."""
    cp, model, opt = one_rank(s3_root, s3_options, save_on_exit=False)
    with cp:
        train_step(cp, model, opt)
        cp.wait()
    proxy.fail("range", *["503"] * 4)  # the first ranged GETs: more than 3 in a row
    done = ckpt_cli("cp", s3_root, tmp_path / "copy", f"--storage-option=endpoint_url={proxy.url}", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert proxy.failed["range"] == 4
    assert (tmp_path / "copy" / "step-0000000001" / "manifest.json").exists()


def test_told_to_stop_after_k_failed_saves_in_a_row_the_kth_raises(proxy, s3_root, s3_options):
    cp, model, opt = one_rank(s3_root, {**s3_options, "endpoint_url": proxy.url}, on_error=3, save_on_exit=False)
    with cp:
        train_step(cp, model, opt)
        cp.wait()
        proxy.flaky(seed=3, rates={"500": 1.0})  # a store that fails; one that throttles is waited for (test_pacing.py)
        for _ in range(2):
            train_step(cp, model, opt)
            cp.wait()  # logged: 1, then 2 in a row
        train_step(cp, model, opt)
        with pytest.raises(ckpt.SaveFailed, match="injected"):  # the proxy's 500, however the client words it
            cp.wait()
        proxy.flaky(seed=4)
    assert cp.failures_in_row == 3


def test_a_store_that_hangs_fails_the_save_within_the_timeout_and_never_the_job(proxy, s3_root, s3_options):
    """Requests that never get an answer: each gives up after Transfer.timeout_s (3 s here,
    2 tries), so the save fails in seconds, the loop goes on, and the next save commits."""
    proxy.stall_s = 120.0
    cp, model, opt = one_rank(s3_root, {**s3_options, "endpoint_url": proxy.url}, on_error="log", save_on_exit=False)
    with cp:
        proxy.flaky(seed=5, rates={"stall": 1.0})
        began = time.monotonic()
        train_step(cp, model, opt)
        cp.wait()
        took = time.monotonic() - began
        assert cp.failures_in_row == 1
        assert took < 30, f"a hung store held the save for {took:.0f} s"
        proxy.flaky(seed=6)
        train_step(cp, model, opt)
        cp.wait()
        assert cp.failures_in_row == 0 and cp.last_commit.step == 2


def test_a_commit_throttled_for_longer_than_the_ranks_wait_fails_on_every_rank_and_never_lands_later(tmp_path, proxy, s3_root, s3_options):
    """Rank 0's manifest PUT is answered SlowDown for 6 s, then taken, while its lease is
    renewed every 0.5 s (ttl 1.5 s) into the root: the other rank waits 4 s (`timeout_s`) for
    the commit. The PUT gives up well before (its step directory answers nothing else, and no
    request is tried for longer than half of `timeout_s`): both ranks learn the save failed,
    and no manifest lands after they gave up. Before, the lease's renewals (another key)
    counted as the store answering, the PUT was sent again for as long as it was throttled,
    the other rank timed out, and the manifest landed after both said the save failed: a
    commit nobody knew of (outside review of issue 40)."""
    window_s = 6.0
    manifest = f"/{s3_root.removeprefix('s3://')}/step-0000000001/manifest.json"
    proxy.limit(0.0, under=manifest)
    lifted = threading.Event()

    def lift() -> None:  # the store takes the manifest once it has throttled it for window_s
        while not proxy.throttled_at and not lifted.wait(0.05):
            pass
        if proxy.throttled_at and not lifted.wait(proxy.throttled_at[0][1] + window_s - time.monotonic()):
            proxy.limit(None)

    threading.Thread(target=lift, daemon=True).start()
    transfer = {"attempts": 2, "backoff_s": 0.05, "max_backoff_s": 0.2, "throttled_s": 1.0}
    try:
        codes = run(RANKS, WORKERS / "commit_worker.py", "--root", s3_root, "--out", str(tmp_path / "out"),
                    "--storage-options", json.dumps({**s3_options, "endpoint_url": proxy.url}),
                    "--transfer", json.dumps(transfer), "--timeout", "4", "--ttl", "1.5", log_dir=tmp_path, timeout=120)
    finally:
        lifted.set()
    proxy.limit(None)

    assert codes == [0] * RANKS, rank_logs(tmp_path)
    learnt = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(RANKS)]
    assert [(r["failures_in_row"], r["last_commit"]) for r in learnt] == [(1, None)] * RANKS, (learnt, rank_logs(tmp_path))
    assert proxy.throttled_at
    assert not Store(s3_root, s3_options).exists("step-0000000001/manifest.json"), "a commit nobody knows of"
    for r in range(RANKS):  # rank 0's reason, on every rank: not a collective's timeout
        log = (tmp_path / f"rank{r}.log").read_text()
        assert "commit of step-0000000001 failed: StorageError" in log and "SlowDown" in log, rank_logs(tmp_path)


def test_a_slow_store_that_keeps_taking_bytes_is_never_taken_for_a_hung_one(proxy, s3_root, s3_options):
    """Every request answered 0.6 s late: a 42 MB file in 5 MiB parts, one at a time, takes
    the writer process several times the Checkpointer's timeout_s (2 s), with no write call
    returning meanwhile. Its heartbeat says what is under way, and the save commits."""
    model = torch.nn.Linear(2048, 5120)  # 42 MB of parameters
    transfer = ckpt.Transfer(**{**QUICK, "part_size": 5 << 20, "concurrency": 1})
    with ckpt.Checkpointer(s3_root, model=model, storage_options={**s3_options, "endpoint_url": proxy.url}, interval=None,
                           timeout_s=2, transfer=transfer, handle_sigterm=False, lease=None, save_on_exit=False) as cp:
        cp.step_done()
        cp.save(blocking=True)  # the writer process starts, on a healthy store
        assert type(cp._slot.sinks.get(cp.store.url)).__name__ == "ProcessSink"
        proxy.delay_s = (0.6, 0.6)
        proxy.flaky(seed=7, rates={"delay": 1.0})
        began = time.monotonic()
        cp.step_done()
        cp.save(blocking=True)
        took = time.monotonic() - began
    assert cp.last_commit.step == 2 and proxy.injected["delay"] >= 8
    assert took > 3 * 2, f"{took:.1f} s: the store was not slow enough to test anything"


def test_a_writer_process_killed_mid_write_is_an_error_at_once_and_the_next_save_commits(tmp_path, monkeypatch):
    """The rank's writer process dies while it writes (SIGKILL, an OOM kill): the save fails
    as soon as its socket closes, not after a timeout, and the next save starts a new one."""
    import signal

    monkeypatch.setenv("CKPT_FAULT", "writer_process:0:2:sleep=30")  # the writer is busy with step 2's file
    model = build("plain", 1)
    opt, _ = optimizer(model)
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=ckpt.Every(steps=1), on_error="log",
                           handle_sigterm=False, lease=None, save_on_exit=False) as cp:
        train_step(cp, model, opt)
        cp.wait()
        train_step(cp, model, opt)  # step 2: its file goes to the writer, which sleeps in it
        sink = next(iter(cp._slot.sinks.values()))
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(sink.proc.pid, signal.SIGKILL)
        cp.wait()
        detected = time.monotonic() - killed
        assert cp.failures_in_row == 1 and cp.last_commit.step == 1
        print(f"\nwriter process killed mid-write: the save failed {detected:.3f} s later")
        assert detected < 5, detected
        monkeypatch.delenv("CKPT_FAULT")
        train_step(cp, model, opt)
        cp.wait()
        assert cp.failures_in_row == 0 and cp.last_commit.step == 3
