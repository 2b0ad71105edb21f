"""A Hugging Face Trainer checkpointed by ckpt: run it, stop it (Ctrl-C, or kill it), run it
again, and it goes on from its last checkpoint. A tiny GPT-2 built from a config (nothing
downloaded) learns to continue random token sequences.

    pip install -e '.[transformers]'
    python examples/hf_trainer.py --root ./hf-run --steps 200
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import ckpt
from ckpt.integrations.transformers import CkptTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 1024, length: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./hf-run")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=a.steps, per_device_train_batch_size=16, learning_rate=3e-4,
        save_strategy="no", logging_steps=50, report_to=[], use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = CkptTrainer(model=model, args=args, train_dataset=Tokens(), ckpt_root=a.root,
                          ckpt_options={"interval": ckpt.Every(steps=50), "keep": ckpt.Keep(last=2)})  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
