"""The tests' zygote (tests/support/zygote.py) starts a process that behaves as `python script`
does: a table of scripts, each run both ways, must end the same (exit code, output, what it saw
of its environment, what ran at its exit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import launch, zygote

SCRIPTS = {
    "exit code": "import sys; sys.exit(3)",
    "exit message": "import sys; sys.exit('bye')",
    "uncaught error": "raise ValueError('boom')",
    "os._exit": "import os; os._exit(7)",
    "environment and arguments": "import os, sys; print(os.environ['ZYGOTE_TEST'], sys.argv[1:], os.getcwd())",
    "name is main": "print(__name__)",
    "stderr apart": "import sys; print('out'); print('err', file=sys.stderr)",
    "atexit and a thread": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
    ),
    "own session": "import os; print(os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())",
    "signal handlers": "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGTERM))",
}


def run_both(tmp_path, name: str) -> tuple[tuple, tuple]:
    """The script run forked from the zygote, then as `python script`: each one's exit code,
    stdout and last line of stderr."""
    script = tmp_path / f"{name.replace(' ', '_')}.py"
    script.write_text(SCRIPTS[name])
    env = {**os.environ, "ZYGOTE_TEST": "seen"}
    got = []
    for how in ("forked", "fresh"):
        out, err = tmp_path / f"{how}.out", tmp_path / f"{how}.err"
        if how == "forked":
            code = zygote.Forked(script, ["a", "b"], env, out, err, cwd=tmp_path).wait(60)
        else:
            with open(out, "wb") as o, open(err, "wb") as e:
                argv = [sys.executable, str(script), "a", "b"]
                code = subprocess.run(argv, env=env, cwd=tmp_path, stdout=o, stderr=e, timeout=60, start_new_session=True).returncode
        stderr = err.read_text()
        got.append((code, out.read_text(), stderr.splitlines()[-1] if stderr else ""))
    return got[0], got[1]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_forked_process_ends_as_a_new_interpreter_does(tmp_path, name):
    forked, fresh = run_both(tmp_path, name)
    assert forked == fresh
    assert forked[0] != 0 or forked[1]  # it ran: an exit code or some output


def test_a_forked_process_dies_of_the_signal_sent_to_it_and_its_kill_is_seen(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time; print('up', flush=True); time.sleep(60)")
    p = zygote.Forked(script, [], dict(os.environ), tmp_path / "log")
    deadline = time.monotonic() + 60
    log = tmp_path / "log"
    while not (log.exists() and "up" in log.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    q = zygote.Forked(script, [], dict(os.environ), None)
    with pytest.raises(subprocess.TimeoutExpired):
        q.wait(0.2)
    q.kill()
    assert q.wait(30) == -signal.SIGKILL


def test_the_log_file_is_there_once_the_process_is_started(tmp_path):
    """As with `Popen(stdout=open(log, "ab"))`: a test may read it at once (before the child ran)."""
    script = tmp_path / "quiet.py"
    script.write_text("import time; time.sleep(1)")
    p = zygote.Forked(script, [], dict(os.environ), tmp_path / "log")
    assert (tmp_path / "log").read_text() == ""
    assert p.wait(30) == 0


def test_ranks_that_outlive_the_tests_timeout_are_killed_saying_where_they_were(tmp_path):
    """`launch.wait`'s timeout asks each rank still running for its threads' stacks (SIGUSR1,
    to the log) before it kills them: a hang in CI says where it hung."""
    script = tmp_path / "hangs.py"
    script.write_text("import time\n\ndef stuck_in_a_collective():\n    time.sleep(600)\n\nprint('up', flush=True)\nstuck_in_a_collective()\n")
    procs = launch.start(2, script, log_dir=tmp_path)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}.log").exists() and "up" in (tmp_path / f"rank{r}.log").read_text() for r in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        launch.wait(procs, timeout=1)
    assert "still running" in str(e.value), str(e.value)
    # a rank forked from the zygote says where it was (a new interpreter has no SIGUSR1 handler)
    assert ("stuck_in_a_collective" in str(e.value)) == zygote.enabled(), str(e.value)
    assert all(p.poll() is not None for p in procs)
