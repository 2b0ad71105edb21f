"""A Hugging Face Transformers Trainer with ckpt, one process per rank (tests/integrations/test_transformers.py).

    transformers_worker.py --root ROOT --out OUT --steps N [--every K] [--die-at STEP]

A small model with dropout (its forward returns the loss, as a Transformers model's does)
trained by the Trainer itself (DDP over gloo on CPU when WORLD_SIZE > 1, processes started by
the test): AdamW, a linear LR schedule, 48 samples in batches of 4 (6 an epoch per rank on 2
ranks). With --die-at, the process SIGKILLs itself after that step, once its last save
committed. Writes OUT.rank<R>.pt: the weights, the optimizer's state, the step it resumed from
and a draw of its RNG.
"""

from __future__ import annotations

import os
import signal
import tempfile

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

import ckpt
from ckpt.integrations.transformers import CkptTrainer
from tests.integrations.resume import worker_arguments


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Die(TrainerCallback):
    def __init__(self, at: int, trainer: CkptTrainer) -> None:
        self.at, self.trainer = at, trainer

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        if state.global_step == self.at:
            self.trainer.cp.wait()
            os.kill(os.getpid(), signal.SIGKILL)


class Counter(TrainerCallback, ExportableState):
    """A callback with a state of its own (as EarlyStoppingCallback's patience): steps seen."""

    def __init__(self, seen: int = 0) -> None:
        self.seen = seen

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        self.seen += 1

    def state(self) -> dict:
        return {"args": {}, "attributes": {"seen": self.seen}}


class Term(TrainerCallback):
    """SIGTERM this process after step `at` (every rank at the same step, as a scheduler would)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = worker_arguments()
    p.add_argument("--term-at", type=int, default=0)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="linear", save_strategy="no", logging_steps=1000, report_to=[], use_cpu=True, seed=1234,
        disable_tqdm=True, dataloader_num_workers=0, restore_callback_states_from_checkpoint=True,
    )  # fmt: skip
    torch.manual_seed(7)
    model = Net()
    trainer = CkptTrainer(model=model, args=args, train_dataset=Rows(), ckpt_root=a.root,
                          ckpt_options={"interval": ckpt.Every(steps=a.every), "keep": ckpt.Keep(last=100), "lease": None})  # fmt: skip
    trainer.add_callback(Counter())
    if a.die_at:
        trainer.add_callback(Die(a.die_at, trainer))
    if a.term_at:
        trainer.add_callback(Term(a.term_at))
    restored: list = []
    real = CkptTrainer._open

    def opened(self) -> None:  # noqa: ANN001
        real(self)
        restored.append(self.cp.restored_step)

    CkptTrainer._open = opened
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    torch.save(
        {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": trainer.optimizer.optimizer.state_dict()
         if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer.state_dict(), "step": trainer.state.global_step,
         "restored_step": restored[0] if restored else None, "rng": torch.rand(3), "world": args.world_size,
         "seen": [cb.seen for cb in trainer.callback_handler.callbacks if isinstance(cb, Counter)]},
        f"{a.out}.rank{rank}.pt",
    )  # fmt: skip


if __name__ == "__main__":
    main()
