"""ckpt: fault-tolerant, asynchronous checkpointing and exact resume for PyTorch training.

    with ckpt.Checkpointer("s3://bucket/run", model=model, optimizer=opt) as cp:
        for _ in range(cp.step, total_steps):
            ...
            cp.step_done()
"""

from .checkpointer import Checkpointer
from .errors import (
    CheckpointError,
    InvalidCheckpoint,
    NotFound,
    RestoreFailed,
    SaveFailed,
    StorageError,
)
from .manifest import Manifest
from .policy import Every, Keep

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "Every",
    "Keep",
    "Manifest",
    "CheckpointError",
    "StorageError",
    "NotFound",
    "InvalidCheckpoint",
    "SaveFailed",
    "RestoreFailed",
]
