"""A new user's first minutes: the README's loop, copied as it is (interval="auto", no
logging set up), saves within seconds and says what it does on stderr, from rank 0 only; a
program that sets up logging, or CKPT_LOG_LEVEL, decides instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.launch import REPO, start, wait

# The README's loop with its defaults, in a script that configures no logging.
LOOP = """
import glob, os, sys, time, torch, ckpt
if int(os.environ.get("WORLD_SIZE", 1)) > 1:
    torch.distributed.init_process_group("gloo")
if os.environ.get("SETUP_LOGGING"):
    import logging; logging.basicConfig(level=logging.WARNING)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt) as cp:
    for _ in range(cp.step, int(sys.argv[2])):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        cp.step_done()
        print("step", cp.step, flush=True)
        time.sleep(0.02)
        # A kill -9 a few steps after the first commit (a loaded machine may commit late),
        # once the save has also said so: its line comes after the manifest, from its thread.
        if cp.step >= int(os.environ.get("KILL_AT", 10**9)) and glob.glob(sys.argv[1] + "/step-*/manifest.json"):
            cp.wait()
            os.kill(os.getpid(), 9)
"""


def run(root, steps: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOOP, str(root), str(steps)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )  # fmt: skip


def ckpt_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ckpt")]


def test_the_readme_loop_saves_within_a_few_steps_and_says_so_and_a_kill_resumes_there(tmp_path):
    killed = run(tmp_path, 1000, KILL_AT="15")
    assert killed.returncode == -signal.SIGKILL
    said = ckpt_lines(killed.stderr)
    assert said[0] == f"ckpt: no checkpoint in {tmp_path}: starting at step 0", said
    assert said[1].startswith("ckpt: saving when it pays (interval='auto'): a first checkpoint after 10 steps or 60 s"), said
    assert any(line.startswith("ckpt: saved step 10: committed") and "next in about" in line for line in said), said
    assert not any("lease" in line for line in said), said  # nothing a new user need not know

    resumed = run(tmp_path, 20)
    assert resumed.returncode == 0, resumed.stderr
    said = ckpt_lines(resumed.stderr)
    assert any(line.startswith("ckpt: restored step 10 in") for line in said), said
    assert said[-1] == f"ckpt: exited at step 20; the last checkpoint is step 20 in {tmp_path}", said
    assert resumed.stdout.split()[:2] == ["step", "11"]


def test_a_program_that_sets_up_logging_or_ckpt_log_level_decides_what_is_shown(tmp_path):
    own = run(tmp_path / "a", 12, SETUP_LOGGING="1")
    assert own.returncode == 0 and not ckpt_lines(own.stderr) and "INFO" not in own.stderr, own.stderr
    quiet = run(tmp_path / "b", 12, CKPT_LOG_LEVEL="warning")
    assert quiet.returncode == 0 and not ckpt_lines(quiet.stderr), quiet.stderr
    bad = run(tmp_path / "c", 12, CKPT_LOG_LEVEL="loud")
    assert bad.returncode != 0 and "CKPT_LOG_LEVEL='LOUD': must be one of DEBUG, INFO, WARNING, ERROR" in bad.stderr


def test_only_rank_0_says_what_it_does(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    procs = start(2, script, str(tmp_path / "root"), "12", log_dir=tmp_path)
    assert wait(procs, timeout=120) == [0, 0]
    logs = [p.read_text() for p in sorted(tmp_path.glob("rank*.log"))]
    assert any(line.startswith("ckpt: saved step 10") for line in ckpt_lines(logs[0])), logs[0]
    assert not ckpt_lines(logs[1]), logs[1]
