"""A PyTorch Lightning fit checkpointed by ckpt: run it, stop it (Ctrl-C, or kill it), run it
again, and it goes on from its last checkpoint.

    pip install -e '.[lightning]'
    python examples/lightning_fit.py --root ./lightning-run --steps 200
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckpt
from ckpt.integrations.lightning import Checkpointing


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./lightning-run")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 16, generator=g), torch.randn(2048, 1, generator=g))
    # A StatefulDataLoader resumes mid-epoch at its batch; torch's RandomSampler lets Lightning
    # put a DistributedSampler in its place under DDP (docs/lightning.md).
    loader = StatefulDataLoader(data, batch_size=32, sampler=RandomSampler(data))
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        callbacks=[Checkpointing(args.root, interval=ckpt.Every(steps=50), keep=ckpt.Keep(last=2))],
    )  # fmt: skip
    trainer.fit(Regressor(), train_dataloaders=loader)


if __name__ == "__main__":
    main()
