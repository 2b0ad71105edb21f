"""ckpt under PyTorch Lightning's own Trainer (`ckpt.integrations.lightning.Checkpointing`):
two gloo processes (DDP on CPU) train a small model with dropout on a StatefulDataLoader for 16
optimizer steps, saving every 3 (6 batches an epoch per rank); another run SIGKILLs both ranks
after step 11 (resuming mid-epoch from step 9) or 7 (from step 6, saved after an epoch's last
batch) and is restarted to step 16. Each
rank's weights, optimizer state and RNG at the end are bit for bit the uninterrupted run's."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.resume import (  # noqa: E402
    KILL_IDS,
    KILLS,
    assert_same_end,
    fit,
    killed_and_resumed,
    load,
    stopped_and_resumed,
)
from tests.support.jobs import rank_logs  # noqa: E402
from tests.support.launch import WORKERS  # noqa: E402

WORKER = WORKERS / "lightning_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize(("die_at", "resumes_at"), KILLS, ids=KILL_IDS)
def test_a_lightning_fit_killed_resumes_bit_for_bit(tmp_path, die_at, resumes_at):
    """With a validation every 3 batches: the save due at step 9 is taken once the validation
    after it ran, and the one at step 6 (an epoch's last batch) once the epoch ended."""
    for want, got in killed_and_resumed(WORKER, tmp_path, die_at, "--val"):
        assert got["restored_step"] == resumes_at  # the last commit before the kill
        assert got["global_step"] == want["global_step"] == 16 and got["epoch"] == want["epoch"]
        assert got["logged_steps"] == want["logged_steps"]  # the step loggers see
        assert got["callbacks"] == want["callbacks"]  # EarlyStopping's best validation loss
        assert_same_end(want, got)


@pytest.mark.slow
@pytest.mark.parametrize("term_rank", [-1, 1], ids=["every-rank", "rank-1-alone"])
def test_a_sigterm_saves_exits_143_and_the_restart_resumes_there_bit_for_bit(tmp_path, term_rank):
    """A SIGTERM after step 9, on every rank or on rank 1 alone (its node preempted: Lightning's
    own handler stopped that rank alone, and the job hung), with a validation after that step:
    ckpt's handler has it, the ranks agree on a step, save it once the validation ran, and both
    exit with 143. The restart resumes there and ends as the uninterrupted run."""
    for want, got in stopped_and_resumed(WORKER, tmp_path, ("--term-at", "9", "--term-rank", str(term_rank)), 143, "--val"):
        assert got["restored_step"] is not None and got["restored_step"] >= 9  # the SIGTERM's save
        assert got["callbacks"] == want["callbacks"]
        assert_same_end(want, got)


@pytest.mark.slow
def test_a_finished_fit_run_again_with_more_steps_goes_on_as_one_longer_run(tmp_path):
    """A fit of 16 steps, then the same fit with max_steps=24: the second resumes at step 16
    in the epoch it was in (the final save is taken at the last batch, before Lightning counts
    the epoch done) and ends as one run of 24 steps. (Found by an outside review.)"""
    assert fit(WORKER, tmp_path, "ref", "--steps", "24") == [0, 0], rank_logs(tmp_path)
    assert fit(WORKER, tmp_path, "short") == [0, 0], rank_logs(tmp_path)
    assert fit(WORKER, tmp_path, "resumed", "--steps", "24") == [0, 0], rank_logs(tmp_path)
    for want, got in zip(load(tmp_path, "ref"), load(tmp_path, "resumed"), strict=True):
        assert got["restored_step"] == 16 and got["global_step"] == want["global_step"] == 24 and got["epoch"] == want["epoch"]
        assert_same_end(want, got)


@pytest.mark.slow
def test_a_fit_stopped_at_an_epochs_end_saves_that_step(tmp_path):
    """The step of an epoch's last batch is counted as the next epoch starts; a fit that stops
    there instead (EarlyStopping at the epoch's validation) counts and saves it as it ends,
    not as the step before. (Found by an outside review.)"""
    assert fit(WORKER, tmp_path, "stopped", "--val", "--stop-at", "6") == [0, 0], rank_logs(tmp_path)
    assert [got["global_step"] for got in load(tmp_path, "stopped")] == [6, 6]
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*"))[-1] == "step-0000000006"
