"""ckpt under PyTorch Lightning's own Trainer (`ckpt.integrations.lightning.Checkpointing`):
two gloo processes (DDP on CPU) train a small model with dropout on a StatefulDataLoader for 16
optimizer steps, saving every 3 (6 batches an epoch per rank); another run SIGKILLs both ranks
after step 11 (resuming mid-epoch from step 9) or 7 (from step 6, saved after an epoch's last
batch) and is restarted to step 16. Each
rank's weights, optimizer state and RNG at the end are bit for bit the uninterrupted run's."""

from __future__ import annotations

import signal

import pytest
import torch

pytest.importorskip("lightning")

from tests.support.jobs import rank_logs  # noqa: E402
from tests.support.launch import WORKERS, run  # noqa: E402

WORKER = WORKERS / "lightning_worker.py"


def _fit(tmp_path, name: str, *extra: str) -> list[int]:
    root = tmp_path / ("ref" if name == "ref" else "run")
    return run(2, WORKER, "--root", str(root), "--out", str(tmp_path / name), "--steps", "16", *extra, log_dir=tmp_path, timeout=300)


def _load(tmp_path, name: str) -> list[dict]:
    return [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("die_at", "resumes_at"), [(11, 9), (7, 6)], ids=["mid-epoch", "after-an-epochs-last-batch"])
def test_a_lightning_fit_killed_resumes_bit_for_bit(tmp_path, die_at, resumes_at):
    assert _fit(tmp_path, "ref") == [0, 0], rank_logs(tmp_path)
    assert _fit(tmp_path, "killed", "--die-at", str(die_at)) == [-signal.SIGKILL] * 2, rank_logs(tmp_path)
    assert _fit(tmp_path, "resumed") == [0, 0], rank_logs(tmp_path)
    for want, got in zip(_load(tmp_path, "ref"), _load(tmp_path, "resumed"), strict=True):
        assert got["restored_step"] == resumes_at  # the last commit before the kill
        assert got["global_step"] == want["global_step"] == 16 and got["epoch"] == want["epoch"]
        for key, value in want["model"].items():
            assert torch.equal(value, got["model"][key]), key
        for param, state in want["optim"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, got["optim"]["state"][param][name]), (param, name)
        assert torch.equal(want["rng"], got["rng"])  # each rank's RNG stream, where it would be


@pytest.mark.slow
def test_a_sigterm_saves_at_that_step_exits_143_and_the_restart_resumes_there_bit_for_bit(tmp_path):
    """Both ranks get a SIGTERM after step 8 (not a step the interval saves at): Lightning stops
    them at the end of that batch, the callback saves step 8 and waits for its commit, and both
    exit with 143. The restart resumes at step 8 and ends as the uninterrupted run."""
    assert _fit(tmp_path, "ref") == [0, 0], rank_logs(tmp_path)
    assert _fit(tmp_path, "stopped", "--term-at", "8") == [143, 143], rank_logs(tmp_path)
    assert (tmp_path / "run" / "step-0000000008" / "manifest.json").exists()
    assert _fit(tmp_path, "resumed") == [0, 0], rank_logs(tmp_path)
    for want, got in zip(_load(tmp_path, "ref"), _load(tmp_path, "resumed"), strict=True):
        assert got["restored_step"] == 8
        for key, value in want["model"].items():
            assert torch.equal(value, got["model"][key]), key
        assert torch.equal(want["rng"], got["rng"])
