"""ckpt under Hugging Face Accelerate (`ckpt.integrations.accelerate.checkpointer`): two gloo
processes (DDP on CPU) train a small model with dropout on a stateful shuffled loader for 16
steps, saving every 3 (6 batches an epoch per rank); another run SIGKILLs both ranks after step
11 (resuming mid-epoch 1 from step 9) or 7 (from step 6, after an epoch's last batch) and is
restarted to step 16. Each rank's weights, optimizer state and RNG at the end are bit for bit
the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from tests.integrations.resume import KILL_IDS, KILLS, assert_same_end, killed_and_resumed  # noqa: E402
from tests.support.launch import WORKERS  # noqa: E402

WORKER = WORKERS / "accelerate_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize(("die_at", "resumes_at"), KILLS, ids=KILL_IDS)
def test_an_accelerate_loop_killed_resumes_bit_for_bit(tmp_path, die_at, resumes_at):
    for want, got in killed_and_resumed(WORKER, tmp_path, die_at):
        assert got["restored_step"] == resumes_at  # the last commit before the kill
        assert got["step"] == want["step"] == 16
        assert_same_end(want, got)



def _prepared(**config: bool):  # noqa: ANN202
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    model = torch.nn.Linear(2, 1)
    return accelerator, *accelerator.prepare(model, torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))


def test_a_loader_without_a_position_is_refused_and_an_order_that_cannot_be_replayed_is_said(tmp_path, caplog):
    from accelerate.state import AcceleratorState

    from ckpt.integrations.accelerate import checkpointer

    try:
        accelerator, _, loader = _prepared()
        with pytest.raises(TypeError, match="use_stateful_dataloader=True"):
            checkpointer(accelerator, str(tmp_path / "a"), dataloader=loader)
        AcceleratorState._reset_state(True)
        accelerator, _, loader = _prepared(use_stateful_dataloader=True)
        with caplog.at_level("WARNING", logger="ckpt"):
            checkpointer(accelerator, str(tmp_path / "b"), dataloader=loader)
        assert "use_seedable_sampler=True" in caplog.text
        AcceleratorState._reset_state(True)
        accelerator, _, loader = _prepared(use_stateful_dataloader=True, use_seedable_sampler=True)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ckpt"):
            checkpointer(accelerator, str(tmp_path / "c"), dataloader=loader)
        assert "use_seedable_sampler" not in caplog.text
    finally:
        AcceleratorState._reset_state(True)


def test_a_second_model_goes_in_extra_and_an_optimizer_over_it_is_refused(tmp_path):
    """(Found by an outside review: the error's own advice did not work.)"""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ckpt.integrations.accelerate import checkpointer

    try:
        accelerator = Accelerator(cpu=True)
        a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(a.parameters(), lr=0.1)
        a, b, opt = accelerator.prepare(a, b, opt)
        with pytest.raises(ValueError, match="pass all but one in extra="):
            checkpointer(accelerator, str(tmp_path / "x"))
        assert checkpointer(accelerator, str(tmp_path / "y"), extra={"teacher": b}).state is not None
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True)
        a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(b.parameters(), lr=0.1)
        a, b, opt = accelerator.prepare(a, b, opt)
        with pytest.raises(ValueError, match="updates parameters of a model other than"):
            checkpointer(accelerator, str(tmp_path / "z"), extra={"teacher": b})
    finally:
        AcceleratorState._reset_state(True)
