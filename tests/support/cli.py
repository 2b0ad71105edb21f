"""The `ckpt` command as a test runs it: `python -m ckpt.cli.main`, a process of its own with
the test's environment, forked from the zygote (`tests/support/zygote.py`). A test that needs a
fresh interpreter (one where torch is not even importable: `tests/test_layout.py`) starts it
with subprocess itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import zygote
from tests.support.launch import REPO

MODULE = "ckpt.cli.main"


def environ(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}


def start(*args: object, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> zygote.Run:
    """`ckpt args...` started; `.result()` waits for it."""
    return zygote.Run(MODULE, [str(a) for a in args], environ(env), cwd)


def ckpt_cli(*args: object, env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    """`ckpt args...` to its end: its exit code, stdout and stderr (with `check`, it must exit 0)."""
    r = start(*args, env=env, cwd=cwd).result(timeout)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r
