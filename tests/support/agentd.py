"""A real node agent (`ckpt agent`) for a test: a process on a spool directory, serving its
metrics on a free loopback port, killed when the test is done with it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ckpt.node.spool import Spool
from tests.support.launch import REPO, free_port


@contextlib.contextmanager
def agent(spool: Path, log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Agentd]:
    """A `ckpt agent` process on `spool`, serving metrics on a free loopback port."""
    a = Agentd(spool, log, flags, env)
    try:
        yield a
    finally:
        a.kill()


class Agentd:
    def __init__(self, spool: Path, log: Path, flags: tuple[str, ...], env: dict[str, str] | None) -> None:
        self.spool, self.log, self.port = spool, log, free_port()
        (spool / "agent.json").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt.cli.main", "agent", "--spool", str(spool), "--metrics-port", str(self.port), *flags],
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while Spool(str(spool)).agent() is None:
            assert self.proc.poll() is None, f"the agent exited: {self.text()}"
            assert time.monotonic() < deadline, f"the agent did not start: {self.text()}"
            time.sleep(0.05)

    def text(self) -> str:
        return self.log.read_text()[-4000:]

    def scrape(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def until(what: str, ok, timeout: float = 60, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        time.sleep(0.1)
