"""How files move to and from an S3 root (`Transfer`): part and read sizes, requests in flight,
retries and timeouts. Other roots ignore it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckpt.storage.layout import MiB

PUT_MAX = 5 << 30  # S3's largest PUT, and largest part


@dataclass(frozen=True)
class Transfer:
    """How files move to and from an S3 root (other roots ignore it). Memory per open file:
    a writer copies at most `(concurrency + 1) * part_size` bytes (only what it may not keep
    a reference to, see `Store.open_write`); a reader holds `(readahead + 1) * read_size`,
    and a rank's restore reads up to two files at once."""

    part_size: int = 64 * MiB
    """Bytes per part of a multipart upload. S3 wants at least 5 MiB and at most 10,000
    parts, so 64 MiB allows files up to 640 GiB. A file of up to two parts (and 5 GiB) is one
    PUT."""
    concurrency: int = 8
    """Parts of one file uploaded at the same time."""
    read_size: int = 32 * MiB
    """Bytes per ranged GET when reading."""
    readahead: int = 8
    """Ranged GETs in flight ahead of a reader."""
    attempts: int = 8
    """Tries of one request before a transient failure (HTTP 5xx or 429, throttling, a reset
    or refused connection, a timeout) becomes a StorageError. Other errors are not retried.
    A throttling answer is not a try while the store still answers (`throttled_s`)."""
    backoff_s: float = 0.25
    """Most a first retry waits; the bound doubles with each retry up to `max_backoff_s`,
    and the wait is drawn uniformly below it (jitter, so that ranks do not retry in step).
    Both must be positive: a throttled request sent again at once is a request more for a
    store that asked for fewer."""
    max_backoff_s: float = 20.0
    timeout_s: float = 60.0
    """Seconds one try may wait for the store, to connect and then for each read of its
    answer; past it the try counts as a transient failure and is retried. A store that
    hangs thus fails a save after about `attempts` times this, or `deadline_s`, whichever
    comes first."""
    requests_per_s: float = 0.0
    """Requests a second the whole job may send to the root, shared evenly by its ranks
    (`ranks`): S3 takes about 3,500 writes and 5,500 reads a second per prefix. 0: no bound.
    Either way a SlowDown halves a rank's pace for a while (`ckpt.storage.pacing`)."""
    ranks: int = 1
    """The job's ranks: the Checkpointer sets it."""
    throttled_s: float = 120.0
    """Seconds a part of the store (a bucket's directory: a step directory, the root's own
    files) may answer this process nothing but throttles (SlowDown, 429 or another throttling
    code; a bare 503 is an ordinary failure) before they count against `attempts`. While a
    request of this process to the same directory succeeded within it, a throttled request
    is sent again after a backoff (at most `max_backoff_s`) without counting, up to
    `deadline_s`: a busy store slows a save down, it does not fail it. Throttles counted
    during a silence stop counting once the directory answers again. Only below
    `deadline_s` does it come into play."""
    deadline_s: float = 300.0
    """Seconds after its first try that a request is not tried again, however it was
    answered (a throttle too): its last failure is then a StorageError that says so. A
    request thus ends about `deadline_s` plus one try (`timeout_s`) after it began. The
    ranks of a job wait for rank 0's commit in a collective for the Checkpointer's
    `timeout_s` (600 s by default): a Checkpointer lowers this to half of that, the other
    half left to the rest of the commit (`.metadata`, the lease's check). A manifest PUT
    still throttled then gives up while they wait, and the save fails on every rank rather
    than land after they gave it up."""

    def __post_init__(self) -> None:
        if not 5 * MiB <= self.part_size <= PUT_MAX:
            raise ValueError(f"Transfer.part_size must be from 5 MiB to 5 GiB (S3's smallest and largest part), not {self.part_size}")
        if min(self.concurrency, self.read_size, self.readahead, self.attempts, self.ranks) < 1 or self.requests_per_s < 0:
            raise ValueError(f"Transfer's counts and sizes must be positive: {self}")
        if not (all(t > 0 for t in (self.backoff_s, self.max_backoff_s, self.timeout_s, self.deadline_s)) and self.throttled_s >= 0):
            raise ValueError(f"Transfer's times must be positive (throttled_s may be 0: every throttle counts): {self}")

    def within(self, timeout_s: float) -> Transfer:
        """This Transfer for a job whose collectives wait `timeout_s` for a rank: no request
        tried for longer than half of it (`deadline_s`)."""
        return dataclasses.replace(self, deadline_s=min(self.deadline_s, timeout_s / 2))
