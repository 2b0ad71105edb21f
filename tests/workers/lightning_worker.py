"""A PyTorch Lightning fit with ckpt's callback, one process per rank (tests/system/test_integrations.py).

    lightning_worker.py --root ROOT --out OUT --steps N [--every K] [--die-at STEP]

A small MLP with dropout (every step draws random numbers) trained by Lightning's own Trainer
(DDP over gloo on CPU when WORLD_SIZE > 1, processes started by the test), AdamW and a StepLR
schedule, on a torchdata StatefulDataLoader of random data with a batch of 4, two epochs' worth
of steps with accumulation off. With --die-at, the process SIGKILLs itself after that optimizer
step, once its last save committed (so that the step it resumes from is known). Writes OUT.rank<R>.pt: the model's
weights, the optimizer's state, the steps done, and the step it resumed from. With --val a
validation every 3 batches (mid-epoch and at each epoch's end), and at each epoch's end a hook
that draws random numbers, an epoch-interval LR schedule and one on the validation loss.
"""

from __future__ import annotations

import os
import signal

import lightning as L
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckpt
from ckpt.integrations.lightning import Checkpointing
from tests.integrations.resume import worker_arguments


class Net(L.LightningModule):
    def __init__(self, val: bool) -> None:
        super().__init__()
        self.val = val
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.drawn = torch.rand(1)  # an epoch's end that draws random numbers (an augmentation's schedule)

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        steps = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7), "interval": "step"}
        epochs = {"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5), "interval": "epoch"}
        plateau = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.9, patience=0), "interval": "epoch", "monitor": "val_loss"}
        return [opt], [steps, epochs, *([plateau] if self.val else [])]


class Die(L.Callback):
    """SIGKILL this process after optimizer step `at`, once ckpt's last save committed."""

    def __init__(self, at: int, ours: Checkpointing) -> None:
        self.at = at
        self.ours = ours

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.at:
            self.ours.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


class Stop(L.Callback):
    """Stop the fit at the validation after optimizer step `at`, as EarlyStopping would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if trainer.global_step == self.at:
            trainer.should_stop = True


class Term(L.Callback):
    """SIGTERM this process after optimizer step `at`: on every rank (torchrun or Kubernetes
    stopping the job) or on one (its node preempted)."""

    def __init__(self, at: int, rank: int) -> None:
        self.at, self.rank = at, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.at and self.rank in (-1, trainer.global_rank):
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = worker_arguments()
    p.set_defaults(steps=12)
    p.add_argument("--term-at", type=int, default=0)
    p.add_argument("--term-rank", type=int, default=-1, help="the rank the SIGTERM reaches (-1: every rank)")
    p.add_argument("--stop-at", type=int, default=0, help="stop the fit (trainer.should_stop) at the validation after this step")
    p.add_argument("--val", action="store_true", help="validate every 3 batches (mid-epoch and at each epoch's end)")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(1234 + int(os.environ.get("RANK", "0")), workers=True, verbose=False)  # each rank its own dropout
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    # torch's own RandomSampler: under DDP Lightning puts a DistributedSampler in its place,
    # whose order is a function of the epoch (see docs/integrations.md)
    loader = StatefulDataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data))
    model = Net(args.val)
    torch.manual_seed(7)  # the same initial weights on every rank
    for q in model.parameters():
        with torch.no_grad():
            q.copy_(torch.randn_like(q) * 0.3)
    # A plain DataLoader, which draws its iterator's seed from the global generator: a
    # validation skipped (or run twice) on a resume would shift every random number after it.
    val = torch.utils.data.DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)), batch_size=4) if args.val else None
    ours = Checkpointing(args.root, interval=ckpt.Every(steps=args.every), keep=ckpt.Keep(last=100), lease=None)
    # With --val, a callback whose state each validation changes (the best loss so far)
    stop = [L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=1000, check_on_train_epoch_end=False)] if args.val else []
    callbacks = [ours, *stop] + ([Die(args.die_at, ours)] if args.die_at else []) + ([Term(args.term_at, args.term_rank)] if args.term_at else []) + ([Stop(args.stop_at)] if args.stop_at else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=args.steps,
        callbacks=callbacks, enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, num_sanity_val_steps=0,
        **({"val_check_interval": 3} if args.val else {"limit_val_batches": 0}),
    )  # fmt: skip
    restored = []
    real_enter = ckpt.Checkpointer.__enter__

    def enter(self):  # noqa: ANN001, ANN202
        got = real_enter(self)
        restored.append(self.restored_step)
        return got

    ckpt.Checkpointer.__enter__ = enter
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=val)
    rank = trainer.global_rank
    torch.save(
        {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": trainer.optimizers[0].state_dict(),
         "global_step": trainer.global_step, "epoch": trainer.current_epoch, "logged_steps": trainer.fit_loop.epoch_loop._batches_that_stepped, "restored_step": restored[0] if restored else None,
         "rng": torch.rand(3), "callbacks": [cb.state_dict() for cb in stop]},
        f"{args.out}.rank{rank}.pt",
    )  # fmt: skip


if __name__ == "__main__":
    main()
