"""What asks a rank to stop: a notice file, a Ctrl-C (and SIGTERM, in test_distributed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ckpt import preempt
from ckpt.preempt import Preemption


def test_a_notice_counts_when_it_appears_or_is_touched_again_not_when_it_was_there_before(tmp_path, monkeypatch):
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 0.0)
    notice = tmp_path / "notice"
    p = Preemption(str(notice))
    p.start(sigterm=False)
    assert not p.asked()
    notice.touch()
    assert p.asked() and p.why == f"notice file {notice}"

    stale = Preemption(str(notice))  # the next run finds it there
    stale.start(sigterm=False)
    assert not stale.asked()
    st = notice.stat()
    os.utime(notice, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched again
    assert stale.asked()


def test_the_notice_path_comes_from_the_environment_and_is_looked_at_now_and_then(tmp_path, monkeypatch):
    notice = tmp_path / "notice"
    monkeypatch.setenv("CKPT_PREEMPT_FILE", str(notice))
    p = Preemption()
    assert p.notice_files == [str(notice)]
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 3600.0)  # a loaded machine may stall for a while
    p.start(sigterm=False)
    assert not p.asked()  # looked: nothing
    notice.touch()
    assert not p.asked()  # not looked again within CHECK_EVERY_S
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 0.0)
    p._next_check = 0.0
    assert p.asked()
    monkeypatch.delenv("CKPT_PREEMPT_FILE")
    assert Preemption().notice_files == []


# A loop that saves every 3 steps and stalls the save of step 6 before its commit, as a slow
# store would; it says each step on stdout.
_LOOP = """
import sys, time, torch, ckpt
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=ckpt.Every(steps=3)) as cp:
    for _ in range(cp.step, 1000):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        cp.step_done()
        print("step", cp.step, flush=True)
        time.sleep(0.05)
"""


def _start_loop(root, stall_step: int) -> subprocess.Popen:
    env = {**os.environ, "CKPT_FAULT": f"before_manifest:0:{stall_step}:sleep=60"}
    return subprocess.Popen([sys.executable, "-c", _LOOP, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(proc: subprocess.Popen, step: int) -> None:
    for line in proc.stdout:
        if line.strip() == f"step {step}":
            return
    raise AssertionError(f"the loop ended before step {step}: {proc.stderr.read()}")


def _committed(root) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if (p / "manifest.json").exists())


def test_ctrl_c_checkpoints_at_the_next_step_and_exits_130(tmp_path):
    proc = _start_loop(tmp_path, stall_step=-1)
    try:
        _wait_for_step(proc, 4)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)  # the same Ctrl-C again, as torchrun passes it on
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    stopped = max([4, *(int(w) for w in out.split() if w.isdigit())]) + 1  # its step_done() exits
    assert _committed(tmp_path)[-1] == stopped, err
    assert "Ctrl-C: saving a checkpoint at the next step boundary" in err
    assert "KeyboardInterrupt" not in err


def test_a_second_ctrl_c_exits_at_once_and_the_last_commit_stays(tmp_path):
    proc = _start_loop(tmp_path, stall_step=6)
    try:
        _wait_for_step(proc, 3)
        while 3 not in _committed(tmp_path):
            time.sleep(0.05)
        _wait_for_step(proc, 5)
        proc.send_signal(signal.SIGINT)  # the stop's save of step 6 stalls for a minute
        time.sleep(preempt.SAME_CTRL_C_S + 0.5)
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.monotonic() - t < 10, err
    assert "second Ctrl-C: exiting now" in err
    assert _committed(tmp_path) == [3]
    resumed = subprocess.run([sys.executable, "-c", _LOOP.replace("1000", "cp.step + 1"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0 and resumed.stdout.split()[:2] == ["step", "4"], resumed.stderr
