"""Start a job of N real processes on loopback (gloo), like torchrun but with handles on
each rank, so a test can kill one of them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support import zygote

REPO = Path(__file__).resolve().parents[2]  # the root of the repository, where ranks import ckpt and tests from
WORKERS = REPO / "tests" / "workers"  # the programs the jobs run, one process per rank


def exit_without_teardown() -> None:
    """A worker whose outputs are written leaves at once: gloo's (and DeepSpeed's) C++
    teardown at interpreter exit has aborted finished jobs now and then in CI. Call it after
    a barrier, so that no rank is still in a collective with this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A port that nothing listens on, for a process to listen on soon: below the kernel's
    ephemeral range. Every outgoing connection on the machine takes its local port from that
    range, and one can take a port from it between this check and the listen (a job's
    rendezvous then fails with EADDRINUSE: seen in the suite, with 3 test workers connecting
    to moto all the while); below it, only another listener can."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _PORTS.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    with socket.socket() as s:  # nothing free down there: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORTS = random.Random()  # not the global generator, which a test may have seeded


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def spawn(script: str | Path, *args: str, env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """One `python script args...` with exactly this environment, stdout and stderr in `log`,
    in a session of its own: forked from the zygote (`tests/support/zygote.py`), or with
    CKPT_TEST_ZYGOTE=0 a new interpreter."""
    if zygote.enabled():
        return zygote.Forked(script, list(args), env, log)  # type: ignore[return-value]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def start(nprocs: int, script: str | Path, *args: str, env: dict[str, str] | None = None, log_dir: Path | None = None) -> list[subprocess.Popen]:
    """A job of `nprocs` ranks of `script` on loopback (`spawn`)."""
    port = free_port()
    procs = []
    for rank in range(nprocs):
        penv = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        # Each rank leads a process group of its own: a rank that hangs is killed with what it
        # started (its DataLoader workers, its writer), which would otherwise outlive the test.
        procs.append(spawn(script, *args, env=penv, log=log_dir / f"rank{rank}.log" if log_dir else None))
    return procs


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank and every process of its group (see `start`)."""
    for q in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(q.pid, signal.SIGKILL)  # its group outlives it while a child is left
        q.kill()
        q.wait()


class RanksTimedOut(subprocess.TimeoutExpired):
    """`wait`'s timeout, saying where each rank still running was (its threads' stacks, which
    a rank forked from the zygote writes to its log on SIGUSR1)."""

    def __init__(self, e: subprocess.TimeoutExpired, stacks: str) -> None:
        super().__init__(e.cmd, e.timeout)
        self.stacks = stacks

    def __str__(self) -> str:
        return f"{super().__str__()}; where the ranks were:\n{self.stacks}"


def _stacks(procs: list[subprocess.Popen]) -> str:
    """Ask every rank still running for its stacks; the end of each one's log after."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    tails = []
    for i, p in enumerate(procs):
        path = getattr(p, "log_path", None)
        if p in alive and path is not None and Path(path).exists():
            tails.append(f"--- process {i} (still running)\n" + Path(path).read_text(errors="replace")[-6000:])
    return "\n".join(tails) or "(no log of a running rank)"


def wait(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired as e:
            stacks = _stacks(procs)
            kill_all(procs)
            raise RanksTimedOut(e, stacks) from None
    # What a rank started and left behind goes with it: a rank that killed itself (a lost
    # GPU) leaves its DataLoader's forkserver and workers waiting for it for good otherwise.
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    return codes


def run(nprocs: int, script: str | Path, *args: str, env: dict[str, str] | None = None, log_dir: Path | None = None, timeout: float = 180) -> list[int]:
    return wait(start(nprocs, script, *args, env=env, log_dir=log_dir), timeout)


def run_worker(nprocs: int, *args: str, env: dict[str, str] | None = None, log_dir: Path | None = None, timeout: float = 180) -> None:
    """Run tests/workers/worker.py on N ranks; fail with the ranks' logs if any rank fails."""
    codes = run(nprocs, WORKERS / "worker.py", *args, env=env, log_dir=log_dir, timeout=timeout)
    if any(codes):
        logs = ""
        if log_dir:
            logs = "\n".join(f"--- rank{r}\n" + (log_dir / f"rank{r}.log").read_text()[-3000:] for r in range(nprocs))
        raise AssertionError(f"worker exit codes {codes}\n{logs}")
