"""The one error hierarchy of ckpt: every failure a user can act on is a CheckpointError."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error ckpt raises on purpose."""


class StorageError(CheckpointError):
    """The root could not be reached or read: bad URL, credentials, network. Never "no checkpoint"."""


class DiskFull(StorageError):
    """A filesystem had no room for a write (ENOSPC, or a quota: EDQUOT)."""


class NotFound(CheckpointError):
    """A step or root that was asked for does not exist."""


class InvalidCheckpoint(CheckpointError):
    """A checkpoint is incomplete or does not match its manifest (sizes, checksums, format)."""


class SaveFailed(CheckpointError):
    """A save did not commit; the previous checkpoint is untouched."""


class RestoreFailed(CheckpointError):
    """No committed checkpoint could be restored although at least one exists."""


class LeaseHeld(CheckpointError):
    """The root belongs to another job (its lease, `ckpt.storage.lease`), or no longer to this one."""


def dcp_failures(e: BaseException) -> list[BaseException]:
    """The errors a DCP `CheckpointException` wraps, one per failed rank."""
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # type: ignore[attr-defined]


def dcp_causes(e: BaseException) -> str:
    """What a DCP error wraps, rank by rank, instead of "CheckpointException ranks: [0]"."""
    return "; ".join(f"rank {r}: {c}" for r, c in zip(e.failures, dcp_failures(e), strict=True))  # type: ignore[attr-defined]
