"""The pace of a process's requests to an object store (issue 40): S3 takes about 3,500
writes and 5,500 reads a second per prefix, and a job of 10,000 ranks sending as fast as each
can is answered SlowDown long before it runs out of bandwidth.

With `Transfer.requests_per_s` (the job's rate; each of its `Transfer.ranks` ranks takes an
even share), a `Pace` starts at most that many requests a second in this process (a token
bucket holding one second's worth, which starts near empty: its first request waits a random
part of 1/rate, so that the processes of a large job do not all start at once). A throttling answer (SlowDown) halves it, at most once a
second and down to `FLOOR`; each second without one it climbs back by half, to its bound.
Without a rate nothing is paced: a throttling answer is only sent again after a backoff.
`ckpt.storage.s3_retry.tried` waits for the pace before every request, and sends a throttled
one again without counting it as a failed try for as long as its part of the store still
answers this process (which that module keeps, per endpoint, bucket and directory: S3
throttles per prefix, a pace is the process's): a busy store slows a save down, it does not
fail it.

One per process and rate: a process's requests to its root share it, from any thread or event
loop (the lock is a thread lock, held for arithmetic only).
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time

from ckpt.storage.transfer import Transfer

FLOOR = 0.5  # requests a second: the slowest a throttled process goes
_CLIMB = 1.5  # per second without a throttling answer
_paces: dict[float, Pace] = {}
_paces_lock = threading.Lock()


class Pace:
    def __init__(self, rate: float = 0.0) -> None:
        self.bound = rate if rate > 0 else math.inf
        self.current = self.bound
        self.throttled = 0  # throttling answers so far
        # IMPORTANT: not a full bucket: 10,000 processes each sending its first request at
        # once is the burst pacing is for. The first waits up to 1/rate, at a random phase.
        self._tokens = random.random() if rate > 0 else 0.0
        self._at = self._slowed_at = time.monotonic()
        self._lock = threading.Lock()

    def delay(self) -> float:
        """Seconds to wait before the next request starts (counted as started now)."""
        if math.isinf(self.bound):
            return 0.0
        with self._lock:
            now = time.monotonic()
            calm = now - self._slowed_at
            if self.current < self.bound and calm >= 1.0:
                self.current = min(self.bound, self.current * _CLIMB ** math.floor(calm))
                self._slowed_at = now - (calm - math.floor(calm))
            self._tokens = min(max(self.current, 1.0), self._tokens + (now - self._at) * self.current)
            self._at = now
            self._tokens -= 1.0  # taken now; below zero, owed: the wait pays it back
            return 0.0 if self._tokens >= 0 else -self._tokens / self.current

    def slow_down(self) -> None:
        """The store answered SlowDown (or another throttling code)."""
        with self._lock:
            self.throttled += 1
            now = time.monotonic()
            if math.isinf(self.bound) or now - self._slowed_at < 1.0 and self.current < self.bound:
                return  # no pace to slow; halved less than a second ago
            self.current = max(FLOOR, self.current / 2)
            self._tokens = min(self._tokens, 0.0)
            self._slowed_at = now


def writer_share(transfer: Transfer) -> Transfer:
    """The Transfer of a rank's writer process: half the rank's share of a paced job's rate.
    The writer process sends a save's data (its PUTs or parts), the trainer then the rest (its
    index, on rank 0 the metadata and the commit): each paced at the rank's whole share, a rank
    sent up to twice it. With the writer at half, its data and then the trainer's few requests
    keep to the share together, and the trainer keeps the whole of it for what it sends alone
    (a restore)."""
    return dataclasses.replace(transfer, ranks=transfer.ranks * 2) if transfer.requests_per_s > 0 else transfer


def pace_for(requests_per_s: float, ranks: int) -> Pace:
    """This process's pace for a job rate of `requests_per_s` (0: no bound) over `ranks`."""
    rate = requests_per_s / max(ranks, 1) if requests_per_s > 0 else 0.0
    with _paces_lock:
        pace = _paces.get(rate)
        if pace is None:
            pace = _paces[rate] = Pace(rate)
        return pace
