"""What a save costs the steps that run while it writes, from each rank's step times.

A save blocks the loop for its capture and staging (milliseconds with overlap), then copies,
serializes, checksums, writes and commits in the background, taking CPU, memory bandwidth,
the GIL and I/O from the steps that run meanwhile. The interval must price a save at all of
it (issue 42): the blocking time plus the slowdown, the steps' extra time while the save was in
flight.

The loop's thread times each step. A step with no save in flight is clean. The steps of a save
run from the one that called it to the first that ends after it committed (a save shorter than
a step slows that one step: it is counted). Once that step ended the save is priced:

- per step, the median of its steps' times (past the one that called it, which holds the
  blocking, the wait for the save before and whatever the loop does at a save's step) against
  the median of the last `CLEAN` clean steps, less twice the standard error of that difference
  (from the clean steps' spread), and none unless it exceeds `z` of them (2 on one rank, more
  on many, `Slowdown.z`, since the save is priced at the slowest rank's figure and the largest
  of many ranks' noises is larger than one's): a difference the noise could make is no slowdown. Medians,
  not means: an evaluation, a data-loader stall or a slow batch is one long step, which a sum
  over the save's steps would count in full. (A save whose cost falls on one step among many
  is therefore under-priced; its cost is spread over its steps as the copy, checksums and
  writes are.)
- each save's steps are taken as excess over the clean step time of its own time: the mean of
  the medians of the `_SIDE` clean steps before it and of those after it (the step time
  drifts: a warm-up, longer sequences; a save is priced once half as many clean steps
  followed it as ran before it, up to `_SIDE`, or at the next save);
  the last `SAVES` saves' are pooled (the noise falls with their number; saves of a step or
  two, up to `_KEEP` of them, until `_POOL` steps are), and the
  slowdown is the per-step excess times the steps a save overlaps (their mean).
- saves within a step or two are priced from those steps, less the save's blocking time.

After `_STALE_AFTER` saves back to back with no clean step between, the baseline could be
stale (the step time drifts): those saves are not priced (`Coordinator` keeps a step between
saves). A save that fails is not
priced. Until `_MIN_SAVES` saves were priced (one save's stall is not its price) the slowdown
is unknown (None), never guessed as 0.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

CLEAN = 64  # recent clean steps the baseline is the median of (the machine's load changes)
SAVES = 5  # saves whose steps are pooled, at least
_POOL = 32  # steps pooled, at least: saves of a step or two each are pooled up to `_KEEP` of them
_KEEP = 20
_MIN_SAVES = 3  # saves priced before the estimate is trusted (one save's stall is not its price)
_SAMPLES = 512  # step times kept per save (a uniform sample of its steps: a long save's too)
_MIN_CLEAN = 5  # clean steps needed before a baseline is trusted
# A difference must exceed the standard errors a chance of _FALSE in one rank's noise makes
# (2 of them on one rank), the chance shared among the ranks: the save is priced at the
# slowest rank's figure, and the largest of W noises is larger than one (Bonferroni).
_FALSE = 0.0228
_Z = 2.0  # and what is priced is the difference less 2 standard errors (as on one rank)
_STALE_AFTER = 3  # saves back to back after a clean step before the baseline is too old to price against
_SIDE = 32  # clean steps on each side of a save its baseline is made of (the step time drifts)


@dataclass
class _Save:
    """The steps beside one save (a uniform sample of at most `_SAMPLES` of them, past the
    one that called it), and what the background thread says of it when it commits."""

    first: float | None = None  # the step that called it
    steps: int = 0  # every step, the first too
    sample: list[float] = field(default_factory=list)
    blocked_s: float | None = None  # set at its commit
    clean_before: bool = True  # a clean step came not long before (`_STALE_AFTER`)

    def excess(self, base: float) -> None:
        """Its steps as excess over `base`, the clean step time when it ended (the step time
        changes: each save is compared with the clean steps of its own time)."""
        self.sample = [s - base for s in self.sample]
        if self.first is not None:
            self.first -= base + (self.blocked_s or 0.0)

    def add(self, seconds: float, rng: random.Random) -> None:
        self.steps += 1
        if self.first is None:
            self.first = seconds
            return
        seen = self.steps - 1
        if len(self.sample) < _SAMPLES:
            self.sample.append(seconds)
        else:  # reservoir sampling: every step of the save equally likely to be kept
            j = rng.randrange(seen)
            if j < _SAMPLES:
                self.sample[j] = seconds


class Slowdown:
    """One rank's estimate of what a save costs the steps beside it (see the module). `step`
    runs on the loop's thread, `committed` on the save's; a lock keeps them apart."""

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = ranks  # whose figures the largest is taken of (`Cadence.start`)
        self._clean: deque[float] = deque(maxlen=CLEAN)
        self._saves: deque[_Save] = deque(maxlen=_KEEP)  # the last priced saves' steps
        self._open: _Save | None = None  # the save in flight (or committed, its last step running)
        # Saves ended, waiting for the clean steps after them: (the save, the median of the
        # clean steps before it, the clean steps after it so far, how many it waits for).
        self._awaiting: list[tuple[_Save, float, list[float], int]] = []
        self._clean_run = 0  # clean steps since the last save began
        self._run_before = 0  # those before the save in flight
        self._saves_since_clean = 0  # saves begun since the last clean step
        self._estimate: float | None = None
        self._rng = random.Random(0)
        self._lock = threading.Lock()

    def began(self) -> None:
        """A save was called (on the loop's thread, in the step now running)."""
        with self._lock:
            if self._open is not None:  # the last one is still in flight: it ends here
                self._close()
            self._price_awaiting()  # with the clean steps after them there are
            self._open = _Save(clean_before=self._saves_since_clean < _STALE_AFTER)
            self._run_before, self._clean_run = self._clean_run, 0
            self._saves_since_clean += 1

    def step(self, seconds: float, busy: bool) -> None:
        """A step took `seconds`; `busy`: a save is still in flight at its end."""
        with self._lock:
            if self._open is None:
                self._clean.append(seconds)
                self._saves_since_clean = 0
                self._clean_run += 1
                for _, _, after, _ in self._awaiting:
                    after.append(seconds)
                if self._awaiting and len(self._awaiting[0][2]) >= self._awaiting[0][3]:
                    self._price_awaiting()
                return
            self._open.add(seconds, self._rng)
            if not busy:
                if self._open.blocked_s is None:  # it ended without a commit (it failed): not a price
                    self._open = None
                else:
                    self._close()  # committed, and the step in progress at its commit has ended

    def committed(self, blocked_s: float) -> None:
        """The save in flight committed, having blocked the loop `blocked_s` (rank-local)."""
        with self._lock:
            if self._open is not None:
                self._open.blocked_s = blocked_s

    def _close(self) -> None:
        save, self._open = self._open, None
        if save is None or not save.clean_before or len(self._clean) < _MIN_CLEAN:
            return  # saves back to back (the baseline may be stale), or none yet
        # Half as many clean steps after it as ran before it (up to `_SIDE`): a save is priced
        # before the next one is due, whether saves come every few steps or every few hundred.
        self._awaiting.append((save, statistics.median(list(self._clean)[-_SIDE:]), [], max(1, min(_SIDE, self._run_before) // 2)))

    def _price_awaiting(self) -> None:
        """Price the saves that ended against the clean steps on both sides of them: the mean
        of the two medians is the step time in the middle of the save where it drifts (a
        warm-up, a curriculum of longer sequences), which the steps before alone are not."""
        for save, before, after, _ in self._awaiting:
            save.excess((before + statistics.median(after)) / 2 if after else before)
            self._saves.append(save)
        if self._awaiting and len(self._saves) >= _MIN_SAVES:
            self._estimate = self._priced()
        self._awaiting = []

    def _priced(self) -> float | None:
        clean = list(self._clean)
        base = statistics.median(clean)
        spread = 1.4826 * statistics.median(abs(c - base) for c in clean)  # a robust sigma
        saves: list[_Save] = []
        for save in reversed(self._saves):  # the newest, as many as make `_POOL` steps
            saves.append(save)
            if len(saves) >= SAVES and sum(len(s.sample) for s in saves) >= _POOL:
                break
        pooled = [s for save in saves for s in save.sample]
        steps = 1.0
        if len(pooled) < _MIN_SAVES:  # saves within a step or two: their steps, less what they blocked
            pooled = [save.first for save in saves if save.first is not None] + pooled
        else:
            steps = statistics.fmean(save.steps for save in saves)
        if not pooled:
            return self._estimate
        # 1.2533: a median's standard error against a mean's, for normal noise.
        se = 1.2533 * spread * math.sqrt(1 / len(pooled) + 1 / len(clean))
        excess = statistics.median(pooled)
        return (excess - _Z * se if excess > self.z * se else 0.0) * steps

    @property
    def z(self) -> float:
        """The standard errors a difference must exceed: 2 on one rank, 3.5 over 100, 4.6 over
        10,000 (the largest of the ranks' noises is within it as often as one rank's is within 2)."""
        return NormalDist().inv_cdf(1 - _FALSE / min(max(1, self.ranks), 1 << 40))

    def estimate(self) -> float | None:
        """The slowdown per save (seconds), or None until a save was priced."""
        with self._lock:
            return self._estimate

    @property
    def saves(self) -> int:
        """How many priced saves are kept for the estimate (it pools the newest of them)."""
        with self._lock:
            return len(self._saves)
