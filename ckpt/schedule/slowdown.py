"""What a save costs the steps that run while it writes, from rank 0's step times.

A save blocks the loop for its capture and staging (milliseconds with overlap), then copies,
serializes, checksums, writes and commits in the background, taking CPU, memory bandwidth,
the GIL and I/O from the steps that run meanwhile. The interval must price a save at all of
it (issue 42): the blocking time plus the slowdown, the steps' extra time while the save was
in flight.

The loop's thread records each step's duration and whether a save was in flight during it. A
step with no save in flight is clean: the median of the last `CLEAN` clean steps is the step
time the save is compared with (a median: an evaluation, a slow batch, a data-loader stall do
not move it). When a save commits, its slowdown is what the steps it overlapped took beyond
that median, summed, less its blocking time (the step that called the save holds that); the
estimate is the median over the last `SAVES` saves. With no save in flight between two saves
(saves back to back) there is no clean step: the last median stays, and until one is known
the slowdown is unknown (None), never guessed as 0.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

CLEAN = 32  # recent clean steps the baseline is the median of (the machine's load changes)
SAVES = 5  # saves the estimate is the median of
_STEPS = 4096  # steps kept to find those a save overlapped
_MIN_CLEAN = 3  # clean steps needed before a baseline is trusted


class Slowdown:
    """Rank 0's estimate of the extra step time a save causes (see the module). `step` is
    called on the loop's thread, `priced` on the save's; a lock keeps them apart."""

    def __init__(self) -> None:
        self._clean: deque[float] = deque(maxlen=CLEAN)
        self._steps: deque[tuple[float, float]] = deque(maxlen=_STEPS)  # (end, seconds) of busy steps
        self._per_save: deque[float] = deque(maxlen=SAVES)
        self._baseline: float | None = None
        self._lock = threading.Lock()
        #: The last save's own slowdown (seconds), for the metrics; None until one was priced.
        self.last_s: float | None = None

    def step(self, end: float, seconds: float, busy: bool) -> None:
        """A step ended at `end` (time.perf_counter) after `seconds`; `busy`: a save was in
        flight at some time during it."""
        with self._lock:
            if busy:
                self._steps.append((end, seconds))
            else:
                self._clean.append(seconds)
                self._baseline = None

    def baseline(self) -> float | None:
        """The clean step time (median), or None until `_MIN_CLEAN` clean steps were seen."""
        with self._lock:
            if self._baseline is None and len(self._clean) >= _MIN_CLEAN:
                self._baseline = statistics.median(self._clean)
            return self._baseline

    def priced(self, started: float, ended: float, blocked_s: float) -> float | None:
        """A save ran from `started` to `ended` (time.perf_counter) and blocked the loop
        `blocked_s`: record its slowdown; returns the estimate (median over recent saves), or
        None while no clean step time is known."""
        base = self.baseline()
        if base is None:
            return self.estimate()
        with self._lock:
            overlapped = [s for end, s in self._steps if end > started and end - s < ended]
        extra = sum(s - base for s in overlapped) - blocked_s
        self.last_s = max(0.0, extra)
        with self._lock:
            self._per_save.append(self.last_s)
        return self.estimate()

    def estimate(self) -> float | None:
        with self._lock:
            return statistics.median(self._per_save) if self._per_save else None

    @property
    def saves(self) -> int:
        """How many saves the estimate is made of."""
        with self._lock:
            return len(self._per_save)
