"""Rank processes forked from a process that has torch loaded already (a zygote), instead of
each one starting Python and importing torch, DCP and FSDP anew: that import is ~3 CPU-seconds
per rank, most of the suite's CPU on a 2-core machine, and none of what a test checks.

A forked rank is a real process like any other: its own pid, session and process group, its
environment, working directory, arguments and log file, its exit code or the signal that
killed it, signals sent to it, children it starts (a writer, DataLoader workers) and gloo
across ranks. The script runs as `__main__`, and at its end what the interpreter does at exit is
done too (non-daemon threads joined, then `atexit`). Set `CKPT_TEST_ZYGOTE=0` to start ranks as
plain `python script.py` processes instead (`tests/support/launch.py`).

The zygote is multiprocessing's forkserver, one per pytest process, which imports `PRELOAD`
once; nothing else of the test process is in it (it never runs a tensor operation before a
fork, so no thread pool of torch is forked half-made). ckpt and DeepSpeed are not preloaded:
they read their environment (`CKPT_*`, `DS_ACCELERATOR`) when imported, in each rank.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo", "numpy"]

_context: multiprocessing.context.ForkServerContext | None = None


def enabled() -> bool:
    return os.environ.get("CKPT_TEST_ZYGOTE", "1") != "0"


def _zygote() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def _redirect(path: str, *fds: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in fds:
        os.dup2(fd, target)
    os.close(fd)


def _run(what: str, module: bool, args: list[str], env: dict[str, str], out: str, err: str | None, cwd: str | None) -> None:
    """In the forked child: become `python script args...` (or `python -m module args...`)
    with this environment, its stdout in `out` and its stderr in `err` (or `out`)."""
    os.setsid()  # a session and process group of its own, as `start_new_session=True`
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if err:
        _redirect(out, 1)
        _redirect(err, 2)
    else:
        _redirect(out, 1, 2)
    # Line-buffered, as a fresh interpreter's stderr is: the zygote may have been started
    # unbuffered (`-u` from pytest-xdist), where `print("POS", 0, 10)` is five writes and a
    # log line from another thread lands between them.
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="backslashreplace", line_buffering=True)
    # A rank that hangs says where: the test's timeout sends SIGUSR1 first (`launch.wait`),
    # and every thread's stack goes to its log.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # What `python script` puts first on the path: the script's folder (`-m`: the working
    # directory), then PYTHONPATH.
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(what))
    sys.path[:0] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.argv = [what, *args]
    import torch

    with contextlib.suppress(ValueError):
        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "") or os.cpu_count() or 1)))
    code = 0
    try:
        if module:
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(what, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught one)
        traceback.print_exc()
        code = 1
    # The interpreter's exit: wait for non-daemon threads, then the atexit functions.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class Forked:
    """A rank forked from the zygote, with the part of `subprocess.Popen` the tests use."""

    def __init__(
        self, what: str | Path, args: list[str], env: dict[str, str], out: Path | None, err: Path | None = None,
        cwd: str | Path | None = None, module: bool = False,
    ) -> None:  # fmt: skip
        """`what` run with `args` (a script's path, or with `module` a module's name), its
        stdout in `out` (None: nowhere) and stderr in `err` (None: with stdout)."""
        self.args = [sys.executable, *(["-m"] if module else []), str(what), *args]
        self.returncode: int | None = None
        self.log_path = err or out  # where its stack goes when a test's timeout asks (`launch.wait`)
        for path in (out, err):  # there once this returns, as `Popen(stdout=open(path, "ab"))` leaves it
            if path:
                open(path, "ab").close()
        place = (str(out) if out else os.devnull, str(err) if err else None, str(cwd) if cwd else None)
        self._proc = _zygote().Process(target=_run, args=(str(what), module, list(args), dict(env), *place), daemon=False)
        self._proc.start()
        self.pid: int = self._proc.pid  # type: ignore[assignment]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)



class Run:
    """`python -m module args...` started, its output kept apart (stdout, stderr) until
    `result`: forked from the zygote, or with CKPT_TEST_ZYGOTE=0 a process of its own."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], cwd: str | Path | None = None) -> None:
        self.argv = [sys.executable, "-m", module, *args]
        self._dir = tempfile.TemporaryDirectory(prefix="run-")
        self._out, self._err = Path(self._dir.name, "out"), Path(self._dir.name, "err")
        if enabled():
            self.proc: Forked | subprocess.Popen = Forked(module, args, env, self._out, self._err, cwd=cwd, module=True)
        else:
            with open(self._out, "wb") as out, open(self._err, "wb") as err:
                self.proc = subprocess.Popen(self.argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def result(self, timeout: float = 120) -> subprocess.CompletedProcess:
        """As `subprocess.run(..., capture_output=True, text=True, timeout=timeout)` returns it."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        try:
            return subprocess.CompletedProcess(self.argv, code, self._out.read_text(), self._err.read_text())
        finally:
            self._dir.cleanup()


def run_module(module: str, args: list[str], env: dict[str, str], cwd: str | Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return Run(module, args, env, cwd).result(timeout)
