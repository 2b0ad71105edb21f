"""When a save comes due, at which step, on every rank alike.

A save comes due by steps (`Every(steps=)`), by the clock (`Every(seconds=)`, or the interval
`Auto`'s coordinator chose from the measured costs and the MTBF), or at the step after one
whose directory was taken (deferred). On several ranks the clock is rank 0's, and a SIGTERM
or a failed background save reaches one rank at its own time: they meet at steps known to
all (`ckpt.schedule.agreement`) to act on them together. The `Checkpointer` asks once a step and does
what the answer says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt.schedule.agreement import Agreement
from ckpt.schedule.coordinator import Coordinator, duration
from ckpt.schedule.policy import Auto, Every
from ckpt.schedule.slowdown import Slowdown
from ckpt.storage.store import Store


@dataclass(frozen=True)
class Due:
    """What a step must do, alike on every rank."""

    save: bool  # the interval asks for a save (or a deferred one is pending)
    preempt: bool  # stop after a checkpoint: a signal reached some rank
    failed: bool  # a background save failed on some rank: report it now
    met: bool = False  # the ranks met at this step to decide it


_NOTHING, _BY_STEP = Due(False, False, False), Due(True, False, False)


class Cadence:
    """The interval of one run, from the last save (or skipped one) on."""

    def __init__(self, interval: Auto | Every | None, agree_every_s: float) -> None:
        self.interval = interval
        self.coordinator: Coordinator | None = None  # for Auto, made on enter (needs the world size)
        self.agreement = Agreement(agree_every_s)
        self.deferred = False  # a due save found its step taken: save at the next step
        self._anchor = 0  # the step of the last save, or of a skipped one
        self._since = time.monotonic()  # and when it was
        self._running = False  # the run's first restart is its start: it ends no interval
        self._saved = False  # a save (or a skipped one) came due in this run
        self._interval_step_s: float | None = None  # seconds per step over the last interval
        #: This rank's measure of what saves cost the steps beside it (every policy: metrics).
        self.slowdown = Slowdown()
        self._step_ended: float | None = None  # when the last step ended (perf_counter)

    def start(self, store: Store, rank: int, world: int) -> None:
        """On enter: `Auto`'s coordinator, which rank 0 primes with the job's history."""
        self.slowdown.ranks = world
        if isinstance(self.interval, Auto):
            self.coordinator = Coordinator(self.interval, world)
            if rank == 0:
                self.coordinator.learn_history(store)

    def restart(self, step: int) -> None:
        """A save was taken (or skipped) at `step`, on every rank alike."""
        now = time.monotonic()
        if self._running and step > self._anchor:
            self._interval_step_s = (now - self._since) / (step - self._anchor)
        self._saved = self._running
        self._anchor, self._since, self._running = step, now, True
        self.agreement.replan(step)

    def slowest(self) -> float | None:
        """What a save costs the steps beside it on the slowest rank (as of the ranks' last
        meeting, and this rank's own now), seconds; None while nothing was measured."""
        mine = self.slowdown.estimate()
        others = self.agreement.slowest_ms / 1000 if self.agreement.slowest_ms else None
        return max((v for v in (mine, others) if v is not None), default=None)

    def _time_step(self, busy: bool) -> None:
        """The step that just ended, for `slowdown` (`busy`: a save still in flight)."""
        end = time.perf_counter()
        if self._step_ended is not None:
            self.slowdown.step(end - self._step_ended, busy)
        self._step_ended = end

    def step_s(self) -> float | None:
        """Seconds per step as the loop runs them: over the last interval, save to save, so
        that evaluations and the saves' own blocking count as they recur; before one ended,
        rank 0's moving average (None on other ranks, and until two steps were timed)."""
        return self._interval_step_s or self.agreement.step_s

    def seconds(self) -> float | None:
        """Seconds between saves by the clock: the coordinator's, or Every(seconds=)'s."""
        if self.coordinator is not None:
            return self.coordinator.seconds
        return self.interval.seconds if isinstance(self.interval, Every) else None

    def at_step(
        self, step: int, rank: int, world: int, group_max: Callable[[list[int]], list[int]], preempt: bool, failed: bool, busy: bool = False
    ) -> Due:
        """What `step` does, from this rank's `preempt` (a signal reached it) and `failed`
        (its background save failed); `busy`: its save is still writing (rank 0 times the
        steps beside a save: `slowdown`). Alone, at once; on several ranks, only at a meeting
        (`group_max`, the ranks' collective): between meetings nothing but the steps'
        interval is acted on, and a step pays one comparison."""
        by_step = self.deferred or (self.interval is not None and self.interval.due_by_step(step, self._anchor))
        if isinstance(self.interval, Auto) and not self._saved:
            # A run's first save comes soon: it protects the start and measures a save's cost.
            by_step = by_step or step - self._anchor >= self.interval.first_after_steps
        now = time.monotonic()
        if rank == 0:
            self.agreement.tick(now)
        self._time_step(busy)  # every rank: the slowest rank's slowdown prices the save
        # IMPORTANT: which way a step goes depends on the world size alone, and every rank asks
        # at every step: the meetings' collectives line up on all of them.
        if world == 1:
            interval_s = self.seconds()
            return Due(by_step or (interval_s is not None and now - self._since >= interval_s), preempt, failed)
        if not self.agreement.meets(step):  # the interval's seconds are worked out at meetings only
            return _BY_STEP if by_step else _NOTHING
        mine = self.slowdown.estimate()
        slowdown_ms = round(1000 * mine) if mine is not None else 0
        agreed = self.agreement.at_step(step, rank, group_max, preempt, failed, now - self._since, self.seconds(), slowdown_ms)
        assert agreed is not None
        return Due(by_step or agreed.save, agreed.preempt, agreed.failed, met=True)

    def describe(self) -> str:
        """The policy in a line, for the log when a run starts."""
        every = self.interval
        if isinstance(every, Every):
            parts = [f"{every.steps} steps" if every.steps else "", f"{every.seconds:g} s" if every.seconds else ""]
            return f"saving every {' or '.join(p for p in parts if p)}{', whichever comes first' if all(parts) else ''}"
        if isinstance(every, Auto) and self.coordinator is not None:
            c = self.coordinator
            return (
                f"saving when it pays (interval='auto'): a first checkpoint after {every.first_after_steps} steps or "
                f"{every.first_after_s:g} s, whichever comes first, then every sqrt(2 x what a save costs x the job's MTBF), "
                f"from the cost measured and the job's mean time between failures, {duration(c.mtbf.job_mtbf_s(c.nodes))} "
                f"for {c.nodes} node(s) so far"
            )
        return "saving only when asked (cp.save()) and on leaving the block"

    def next_due(self, step: int) -> str:
        """When the save after the one of `step` comes, in words."""
        every = self.interval
        if isinstance(every, Every) and every.steps:
            return f"next at step {step + every.steps}" + (f" or in {every.seconds:g} s" if every.seconds else "")
        seconds = self.seconds()
        return f"next in about {seconds:.3g} s" if seconds else "no save planned"

    @property
    def schedule(self) -> dict[str, Any]:
        """What the interval decided last: seconds, and for "auto" what it was chosen from."""
        if self.coordinator is not None:
            return self.coordinator.schedule
        if isinstance(self.interval, Every):
            return {"policy": "every", "steps": self.interval.steps, "seconds": self.interval.seconds}
        return {"policy": "auto" if isinstance(self.interval, Auto) else "none"}

    def estimate(self) -> dict[str, Any]:
        """`schedule` with the seconds between saves under every policy, for the metrics (an
        alert compares a checkpoint's age with them): `Every(steps=)`'s steps at the measured
        `step_s` (the sooner of that and `seconds=`), and the steps `seconds=` comes to.
        A value not known yet (no step timed) is None, never 0: "no interval" is no alert."""
        if not isinstance(self.interval, Every):
            return self.schedule if self.coordinator is not None else {**self.schedule, "slowdown_s": self.slowdown.estimate()}
        every, step_s = self.interval, self.step_s()
        by_steps = every.steps * step_s if every.steps is not None and step_s else None
        seconds = min((s for s in (every.seconds, by_steps) if s is not None), default=None)
        steps = every.steps
        if steps is None and seconds and step_s:
            steps = max(1, round(seconds / step_s))
        return {"policy": "every", "seconds": seconds, "steps": steps, "step_s": step_s, "slowdown_s": self.slowdown.estimate()}
