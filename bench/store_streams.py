"""The store's bandwidth as N processes see it, writing and reading at once: `bench/scale.py`'s
bandwidth for a job of N ranks, measured apart from any checkpoint.

Each of N processes (a rank's writer is a process of its own) makes its Store and sends one
small request (its client made, a connection open), then, at the same moment as the others,
writes one object of `total / N` bytes through `Store.open_write` (as a save's writer writes
its file), and after every process has written, reads it back through `Store.open_read`. The
bandwidth of a round is `total` over the time from the first process's start to the last
one's end; the median of `ROUNDS` rounds is kept. On this machine the store (moto) and the N
processes share 2 cores, so that what N writers get from it differs from what 4 threads of
one process get (160 MB/s from 4 threads; 16 ranks' writers saved at about 200).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 5


def measure(root: str, options: str, n: int, total: int, work: Path, env: dict[str, str]) -> dict[str, float]:
    """Write and read `total` bytes as `n` processes at once, `ROUNDS` times: the median
    bytes per second of each direction, and each round's."""
    work.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "--worker", root, options, str(n), str(total), str(work)]
    procs = [subprocess.Popen([*argv, str(i)], env={**env, "PYTHONPATH": str(REPO)}) for i in range(n)]
    try:
        _all(work, "ready", n, procs)
        for r in range(ROUNDS):
            for kind in ("write", "read"):
                (work / f"go-{kind}{r}").touch()
                _all(work, f"done-{kind}{r}", n, procs)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"the store's bandwidth with {n} processes: a process failed ({codes})")
    spans = [json.loads((work / f"spans{i}.json").read_text()) for i in range(n)]
    got: dict[str, float] = {}
    for kind in ("write", "read"):
        rates = [total / (max(s[kind][r][1] for s in spans) - min(s[kind][r][0] for s in spans)) for r in range(ROUNDS)]
        got[f"{kind}_bytes_per_s"] = sorted(rates)[len(rates) // 2]
        got[f"{kind}_rounds"] = rates  # type: ignore[assignment]
    return got


def _all(work: Path, mark: str, n: int, procs: list[subprocess.Popen]) -> None:
    """Wait until each of the `n` processes has left `mark`."""
    deadline = time.monotonic() + 300
    while sum((work / f"{mark}-{i}").exists() for i in range(n)) < n:
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            raise SystemExit(f"the store's bandwidth with {n} processes: a process failed or hung before {mark}")
        time.sleep(0.002)


def _worker(root: str, options: str, n: int, total: int, work: Path, i: int) -> None:
    from ckpt.storage.store import Store

    store = Store(root, json.loads(options) if options else None)
    store.exists(f"stream{i}.bin")  # the client made, a connection open
    blob = os.urandom(total // n)
    (work / f"ready-{i}").touch()
    spans: dict[str, list[tuple[float, float]]] = {"write": [], "read": []}
    for r in range(ROUNDS):
        for kind in ("write", "read"):
            while not (work / f"go-{kind}{r}").exists():
                time.sleep(0.001)
            began = time.time()  # the processes' clocks: one machine's
            if kind == "write":
                with store.open_write(f"stream{i}.bin", size=len(blob)) as f:
                    f.write(blob)
            else:
                with store.open_read(f"stream{i}.bin", size=len(blob)) as f:  # as a restore reads its file
                    if f.read() != blob:
                        raise SystemExit(f"stream {i} read back other bytes")
            spans[kind].append((began, time.time()))
            (work / f"done-{kind}{r}-{i}").touch()
    (work / f"spans{i}.json").write_text(json.dumps(spans))


if __name__ == "__main__":
    if sys.argv[1] != "--worker":
        raise SystemExit(__doc__)
    _, _, root, options, n, total, work, i = sys.argv
    _worker(root, options, int(n), int(total), Path(work), int(i))
