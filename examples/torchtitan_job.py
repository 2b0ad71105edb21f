"""ckpt as a torchtitan job's checkpoint manager (docs/torchtitan.md).

torchtitan's Trainer builds its checkpoint manager from `config.checkpoint`: set it to ckpt's.
Run with torchtitan's launcher as any torchtitan job, e.g.

    torchrun --nproc_per_node=8 examples/torchtitan_job.py --module llama3 --config llama3_debugmodel

(torchtitan's Trainer needs GPUs.) The config is torchtitan's debug Llama 3 with the
checkpoint section replaced; anything else of a torchtitan config stays as it is.
"""

from __future__ import annotations

import os

from ckpt.integrations.torchtitan import CheckpointManager


def main() -> None:
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    # torchtitan's own: --module llama3 --config llama3_debugmodel --training.steps ...
    config = ConfigManager().parse_args()
    config.checkpoint = CheckpointManager.Config(
        enable=True,
        root=os.environ.get("CKPT_ROOT", "./checkpoints"),  # s3://bucket/run, any fsspec URL
        interval=config.checkpoint.interval,
        keep_latest_k=config.checkpoint.keep_latest_k,
        options={"interval": "auto"} if os.environ.get("CKPT_AUTO") else {},
    )
    trainer = config.build()  # the Trainer, which builds its checkpoint manager from config.checkpoint
    try:
        trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
