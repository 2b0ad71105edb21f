"""What the integration tests share: a 2-rank job of a framework's worker, run as the
uninterrupted reference, as a run that is stopped, and as its restart; and the comparison of
what each rank holds at the end."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import torch

from tests.support.jobs import rank_logs
from tests.support.launch import run

RANKS = 2
STEPS = 16
# (die after step, the step the restart resumes from): saves every 3 steps, 6 batches an epoch
KILLS = [(11, 9), (7, 6)]
KILL_IDS = ["mid-epoch", "after-an-epochs-last-batch"]


def worker_arguments() -> argparse.ArgumentParser:
    """The options every integration worker takes: where, how long, how often, when to die."""
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--die-at", type=int, default=0, help="SIGKILL after this step, once the last save committed")
    return p


def fit(worker: Path, tmp_path: Path, name: str, *extra: str) -> list[int]:
    """Run `worker` on 2 ranks: "ref" in a root of its own, any other name in the shared one."""
    root = tmp_path / ("ref" if name == "ref" else "run")
    return run(RANKS, worker, "--root", str(root), "--out", str(tmp_path / name), "--steps", str(STEPS), *extra, log_dir=tmp_path, timeout=300)


def load(tmp_path: Path, name: str) -> list[dict]:
    return [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(RANKS)]


def stopped_and_resumed(worker: Path, tmp_path: Path, stop: tuple[str, ...], code: int, *common: str) -> list[tuple[dict, dict]]:
    """The reference run, a run given `stop` (worker options) that every rank leaves with exit
    status `code`, and its restart, each given `common`: (reference, restart) of each rank."""
    assert fit(worker, tmp_path, "ref", *common) == [0] * RANKS, rank_logs(tmp_path)
    assert fit(worker, tmp_path, "stopped", *common, *stop) == [code] * RANKS, rank_logs(tmp_path)
    assert fit(worker, tmp_path, "resumed", *common) == [0] * RANKS, rank_logs(tmp_path)
    return list(zip(load(tmp_path, "ref"), load(tmp_path, "resumed"), strict=True))


def killed_and_resumed(worker: Path, tmp_path: Path, die_at: int, *common: str) -> list[tuple[dict, dict]]:
    """`stopped_and_resumed` with a SIGKILL after step `die_at`, once its last save committed."""
    return stopped_and_resumed(worker, tmp_path, ("--die-at", str(die_at)), -signal.SIGKILL, *common)


def assert_same_end(want: dict, got: dict) -> None:
    """Bit for bit: weights, optimizer state and the rank's RNG stream."""
    for key, value in want["model"].items():
        assert torch.equal(value, got["model"][key]), key
    for param, state in want["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, got["optim"]["state"][param][name]), (param, name)
    assert torch.equal(want["rng"], got["rng"])  # each rank's RNG stream, where it would be
