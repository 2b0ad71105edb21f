"""Jobs of tests/workers/worker.py on 2 ranks (gloo on loopback) and what they leave behind,
shared by the distributed tests; `straight_run` (in conftest) is the uninterrupted reference
job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ckpt.storage import catalog
from ckpt.storage.store import Store
from tests.support.compare import assert_bitwise_equal
from tests.support.launch import WORKERS, run

RANKS = 2
WORKER = WORKERS / "worker.py"


def job(log_dir: Path, script: Path, *args: object, timeout: float = 180) -> None:
    """Run `script` on RANKS ranks; fail with the ranks' logs unless every rank exits 0."""
    codes = run(RANKS, script, *map(str, args), log_dir=log_dir, timeout=timeout)
    assert codes == [0] * RANKS, f"exit codes {codes}\n{rank_logs(log_dir)}"


def train(log_dir: Path, *args: object) -> None:
    job(log_dir, WORKER, *args)


def rank_logs(log_dir: Path) -> str:
    return "\n".join(
        f"--- rank{r}\n" + (log_dir / f"rank{r}.log").read_text()[-3000:]
        for r in range(RANKS)
        if (log_dir / f"rank{r}.log").exists()
    )


def dumps(out: Path) -> list[dict]:
    """What each rank wrote to <out>.rank<R>.pt, by rank."""
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(RANKS)]


def states(root: Path, *, deep: bool = False) -> dict[int, str]:
    return {e.step: e.state for e in catalog.scan(Store(str(root)), deep=deep)}


TRAINING_STATE = ("step", "model", "optim", "sched", "rng")


def assert_same_training_state(got: list[dict], want: list[dict]) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in TRAINING_STATE:
            assert_bitwise_equal(g[key], w[key], f"rank{rank}.{key}")


def committed_steps(root: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in root.glob("step-*") if (d / "manifest.json").is_file())


@dataclass
class Reference:
    """An uninterrupted job: 20 steps, a checkpoint every 5, under `root`."""

    root: Path
    dumps: list[dict]  # the state after step 20, by rank


def reference_runs(tmp_path_factory):
    """The reference job per wrapping, run on first use: `straight_run(mode)`."""
    done: dict[str, Reference] = {}

    def get(mode: str) -> Reference:
        if mode not in done:
            d = tmp_path_factory.mktemp(f"straight-{mode}")
            train(d, "--mode", mode, "--root", d / "root", "--steps", 20, "--every", 5, "--out", d / "out")
            done[mode] = Reference(d / "root", dumps(d / "out"))
            assert [x["step"] for x in done[mode].dumps] == [20] * RANKS
        return done[mode]

    return get
