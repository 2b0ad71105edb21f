"""When the ranks meet, at a step boundary, to act on what only some of them know.

Rank 0's clock decides time-based saves (`interval="auto"`, `Every(seconds=)`), a SIGTERM
reaches one rank, and a background save fails on one rank at its own time; yet every rank must
act on each at the same step. So the ranks meet in one small collective (a max over five
integers) at steps they all know beforehand, and between meetings a step costs no collective.

Rank 0 measures the time a step takes and turns seconds into steps: at each meeting it names
the step of the next one, no more than `every_s` of its wall time away, and whether that step
takes the save the interval asks for. A signal or a failed save is therefore acted on within
about `every_s` (and a change of interval takes effect by then); a step that suddenly takes
much longer stretches that, since nobody can call a collective alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# The step time is a moving average: a save, an evaluation or a slow batch moves it a little.
_SMOOTHING = 0.2


@dataclass
class Agreed:
    """What a meeting decided, alike on every rank."""

    preempt: bool  # some rank was asked to stop
    failed: bool  # some rank's background save failed
    save: bool  # the interval asks for a save at this step (rank 0's clock)


class Agreement:
    """The meetings of one run. Every rank calls `at_step` each step (or `meets`, then `meet`
    with the group's max when it says so); rank 0 also calls `tick` each step."""

    def __init__(self, every_s: float) -> None:
        if not every_s > 0:
            raise ValueError(f"the ranks must meet every so many seconds > 0, not {every_s!r}")
        self.every_s = every_s
        self.next_step = 0  # meet at the first step on or after this one
        self.meetings = 0
        #: Rank 0's seconds per step (None until two steps were timed).
        self.step_s: float | None = None
        self._save_next = False  # the last meeting put the interval's save on the next one
        #: The largest of the ranks' slowdowns (ms) at the last meeting (`ckpt.schedule.slowdown`).
        self.slowest_ms = 0
        self._last_tick: float | None = None

    def tick(self, now: float) -> None:
        """Rank 0, once a step: time it."""
        if self._last_tick is not None:
            took = now - self._last_tick
            self.step_s = took if self.step_s is None else (1 - _SMOOTHING) * self.step_s + _SMOOTHING * took
        self._last_tick = now

    def meets(self, step: int) -> bool:
        return step >= self.next_step

    def at_step(
        self,
        step: int,
        rank: int,
        group_max: Callable[[list[int]], list[int]],
        preempt: bool,
        failed: bool,
        since_save_s: float,
        interval_s: float | None,
        slowdown_ms: int = 0,
    ) -> Agreed | None:
        """What every rank of a run on several acts on at `step`: from this rank's `preempt`
        (a signal reached it), `failed` (its background save failed) and `slowdown_ms` (what
        its saves cost its steps), rank 0's proposal and the group's max over them; None
        between meetings (nothing is acted on then)."""
        if not self.meets(step):
            return None
        proposal = self.propose(since_save_s, interval_s) if rank == 0 else [0, 0, 0]
        return self.meet(step, group_max([int(preempt), int(failed), *proposal, max(0, int(slowdown_ms))]))

    def propose(self, since_save_s: float, interval_s: float | None) -> list[int]:
        """Rank 0's part of a meeting: [save now, steps to the next meeting, whether it saves].
        `interval_s`: the time-based interval (None: there is none)."""
        save = self._save_next or (interval_s is not None and since_save_s >= interval_s)
        poll = 1 if not self.step_s else max(1, int(self.every_s / self.step_s))
        if interval_s is not None and self.step_s:
            left = interval_s if save else interval_s - since_save_s
            to_save = max(1, math.ceil(left / self.step_s))
            if to_save <= poll:
                return [int(save), to_save, 1]
        return [int(save), poll, 0]

    def meet(self, step: int, agreed: list[int]) -> Agreed:
        """Take the group's max of every rank's [preempt, failed, *rank 0's proposal, slowdown]."""
        preempt, failed, save, gap, save_next, *slowest = agreed
        self.slowest_ms = slowest[0] if slowest else 0
        self.next_step, self._save_next = step + max(1, gap), bool(save_next)
        self.meetings += 1
        return Agreed(bool(preempt), bool(failed), bool(save))

    def replan(self, step: int) -> None:
        """A save (or a skipped one) at `step`, on every rank: the interval starts again, so
        meet at the next step to plan it."""
        self.next_step, self._save_next = step + 1, False
