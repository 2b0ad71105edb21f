"""When to save and what to keep: small named rules with one pure method each (no I/O)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """Save every `steps` optimizer steps, or every `seconds` of wall time, whichever comes first.

    A step-based rule is decided by every rank alone (all count the same steps); a time-based
    rule is decided on rank 0 and shared, since clocks differ across ranks.
    """

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise ValueError("Every() needs steps=N or seconds=S")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"Every(steps={self.steps}): steps must be >= 1")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"Every(seconds={self.seconds}): seconds must be > 0")

    def due_by_step(self, step: int, last_saved_step: int) -> bool:
        return self.steps is not None and step - last_saved_step >= self.steps

    def due_by_time(self, seconds_since_last_save: float) -> bool:
        return self.seconds is not None and seconds_since_last_save >= self.seconds


@dataclass(frozen=True)
class Keep:
    """Retention: the newest `last` committed checkpoints, plus every multiple of `every_steps`.

    "Newest" is by commit time. The newest committed checkpoint, any being written and any
    protected one are never deleted. Incomplete directories below the newest commit's step
    are debris of crashed saves (one above it may be a save in progress).
    """

    last: int = 3
    every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.last < 1:
            raise ValueError(f"Keep(last={self.last}): at least the newest checkpoint is kept")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"Keep(every_steps={self.every_steps}) must be >= 1")

    def to_delete(
        self,
        committed: Sequence[int],
        incomplete: Sequence[int] = (),
        in_flight: Collection[int] = (),
        protect: Collection[int] = (),
    ) -> list[int]:
        """Steps to delete, ascending.

        `committed` is in commit order, oldest first: step order, unless a run restarted from
        an older step, whose new checkpoints are then the newest although their steps are
        lower. `protect`: steps never deleted (the one just committed, the one restored)."""
        if not committed:
            return []
        keep = set(committed[-self.last :]) | {committed[-1]} | set(protect) | set(in_flight)
        if self.every_steps:
            keep |= {s for s in committed if s % self.every_steps == 0}
        newest = committed[-1]
        doomed = {s for s in committed if s not in keep}
        doomed |= {s for s in incomplete if s < newest and s not in keep}
        return sorted(doomed)
