"""When to save and what to keep: small named rules with one pure method each (no I/O)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ckpt.schedule.interval import MtbfEstimate, async_interval, weibull_mtbf


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


_BUSY_MARGIN = 1.1


@dataclass(frozen=True)
class Auto:
    """Save when it pays: every sqrt(2·C_b·M) seconds (never more often than 1.1 times what a
    save keeps its slot busy), from the measured blocking time C_b and busy time L of the last save and the
    job's MTBF M. M starts from a prior (a node's MTBF, or a failure rate per 1000 node-days,
    divided across the job's nodes) and learns from the job's own failures and run time in
    `<root>/events/`. Decided on rank 0 and shared, like a time interval.

    node_mtbf_s: a node's mean time between failures (seconds); overrides the rate.
    failures_per_1000_node_days: the prior's rate when no node MTBF is given. The default, 5,
        is the low end of Meta's RSC clusters (5 to 6.5).
    prior_failures: how many failures' worth of evidence the prior is (1: the job's own
        history outweighs it after a few failures).
    first_after_s, first_after_steps: a run's first save, before any save was measured,
        comes after this many seconds or steps, whichever is sooner: a checkpoint within a
        minute (or a few steps) of the start, and the save's measured cost, from which the
        interval is then chosen (and stretches).
    weibull_shape: failures that cluster (shape < 1: a restarted job fails again soon more
        often than an exponential says) make the hazard fall with the time since the last
        failure; the interval is then computed from that local MTBF and lengthens as the run
        goes on. None: exponential (constant MTBF).
    """

    node_mtbf_s: float | None = None
    failures_per_1000_node_days: float = 5.0
    prior_failures: float = 1.0
    first_after_s: float = 60.0
    first_after_steps: int = 10
    weibull_shape: float | None = None

    def __post_init__(self) -> None:
        self.prior()  # validates the numbers
        if self.first_after_s <= 0:
            raise ValueError(f"Auto(first_after_s={self.first_after_s}): must be > 0")
        if not (type(self.first_after_steps) is int and self.first_after_steps >= 1):
            raise ValueError(f"Auto(first_after_steps={self.first_after_steps!r}): must be an int >= 1")

    def prior(self) -> MtbfEstimate:
        if self.node_mtbf_s is not None:
            return MtbfEstimate(self.node_mtbf_s, self.prior_failures)
        return MtbfEstimate.from_rate(self.failures_per_1000_node_days, self.prior_failures)

    def seconds(
        self, blocking_s: float | None, persist_s: float | None, job_mtbf_s: float, since_failure_s: float = 0.0
    ) -> float:
        """The interval: `first_after_s` until a save was measured, then the optimum."""
        if blocking_s is None or persist_s is None:
            return self.first_after_s
        if self.weibull_shape is not None:
            job_mtbf_s = weibull_mtbf(self.weibull_shape, job_mtbf_s, since_failure_s)
        # IMPORTANT: a margin over the save's busy time, or every save would wait for the last.
        return async_interval(max(blocking_s, 1e-3), job_mtbf_s, _BUSY_MARGIN * persist_s)

    def due_by_step(self, step: int, last_saved_step: int) -> bool:
        return False


def exposure(runs: Iterable[tuple[int, float, bool]], ranks_per_node: int) -> tuple[int, float]:
    """(failures, node-seconds) of past runs given as (world size, seconds run, failed)."""
    failures, node_seconds = 0, 0.0
    for world, seconds, failed in runs:
        failures += int(failed)
        node_seconds += max(seconds, 0.0) * max(1, -(-world // max(1, ranks_per_node)))
    return failures, node_seconds


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
