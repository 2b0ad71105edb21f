"""ckpt: fault-tolerant, asynchronous checkpointing and exact resume for PyTorch training.

    with ckpt.Checkpointer("s3://bucket/run", model=model, optimizer=opt) as cp:
        for _ in range(cp.step, total_steps):
            ...
            cp.step_done()
"""

from typing import TYPE_CHECKING, Any

from ckpt._version import __version__ as __version__
from ckpt.errors import (
    CheckpointError,
    DiskFull,
    InvalidCheckpoint,
    LeaseHeld,
    NotFound,
    RestoreFailed,
    SaveFailed,
    StorageError,
)
from ckpt.format.manifest import Manifest
from ckpt.schedule.policy import Auto, Every, Keep
from ckpt.storage.lease import Lease

if TYPE_CHECKING:
    from ckpt.admin.export import read_export
    from ckpt.checkpointer import Checkpointer
    from ckpt.data import ElasticSampler, accumulation_steps
    from ckpt.early import prepare
    from ckpt.storage.transfer import Transfer

# The names that need torch load on first use, so that `ckpt ls` starts in a blink.
_LAZY = {
    "Checkpointer": "checkpointer",
    "ElasticSampler": "data",
    "accumulation_steps": "data",
    "Transfer": "storage.transfer",
    "read_export": "admin.export",
    "prepare": "early",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")


__all__ = [
    "Checkpointer",
    "prepare",
    "Auto",
    "Every",
    "Keep",
    "Lease",
    "Transfer",
    "ElasticSampler",
    "accumulation_steps",
    "Manifest",
    "read_export",
    "CheckpointError",
    "StorageError",
    "DiskFull",
    "NotFound",
    "InvalidCheckpoint",
    "SaveFailed",
    "RestoreFailed",
    "LeaseHeld",
]
