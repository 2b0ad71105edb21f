"""ckpt under the Hugging Face Transformers Trainer (`ckpt.integrations.transformers.CkptTrainer`):
two gloo processes (DDP on CPU) train a small model with dropout for 16 optimizer steps,
saving every 3 (6 batches an epoch per rank); another run SIGKILLs both ranks after step 11
(resuming mid-epoch from step 9) or 7 (from step 6, after an epoch's last batch) and is
restarted to step 16. Each rank's weights, optimizer state and RNG at the end are bit for bit
the uninterrupted run's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.resume import (  # noqa: E402
    KILL_IDS,
    KILLS,
    assert_same_end,
    killed_and_resumed,
    stopped_and_resumed,
)
from tests.support.launch import WORKERS  # noqa: E402

WORKER = WORKERS / "transformers_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize(("die_at", "resumes_at"), KILLS, ids=KILL_IDS)
def test_a_trainer_killed_resumes_bit_for_bit(tmp_path, die_at, resumes_at):
    for want, got in killed_and_resumed(WORKER, tmp_path, die_at):
        assert got["restored_step"] == resumes_at  # the last commit before the kill
        assert got["step"] == want["step"] == 16 and got["world"] == 2  # DDP over both ranks
        assert got["seen"] == want["seen"] == [16]  # a callback's own state (ExportableState)
        assert_same_end(want, got)


@pytest.mark.slow
def test_a_sigterm_saves_exits_143_and_the_restart_resumes_there_bit_for_bit(tmp_path):
    """Both ranks get a SIGTERM after step 8: ckpt saves at the step the ranks next agree on
    and both exit with 143 (the Trainer's loop is left through ckpt's SystemExit); the restart
    resumes from that save and ends as the uninterrupted run."""
    for want, got in stopped_and_resumed(WORKER, tmp_path, ("--term-at", "8"), 143):
        assert got["restored_step"] is not None and got["restored_step"] >= 8  # the SIGTERM's save
        assert_same_end(want, got)
