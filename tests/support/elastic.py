"""Jobs of tests/workers/elastic_worker.py, and the global batches each step of one read."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from tests.support.launch import WORKERS, run

WORKER = WORKERS / "elastic_worker.py"


def job(nprocs: int, root: Path, logs: Path, *extra: str) -> list[int]:
    logs.mkdir(parents=True, exist_ok=True)
    return run(nprocs, WORKER, "--root", str(root), "--log-dir", str(logs), *extra, log_dir=logs, timeout=240)


def global_batches(logs: Path) -> dict[int, set[int]]:
    """step -> the union of every rank's samples for it, in one job's log."""
    out: dict[int, set[int]] = defaultdict(set)
    for line in (logs / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] |= set(row["idx"])
    return dict(out)
