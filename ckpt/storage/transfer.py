"""How files move to and from an S3 root (`Transfer`): part and read sizes, requests in flight,
retries and timeouts. Other roots ignore it."""

from __future__ import annotations

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
    or refused connection, a timeout) becomes a StorageError. Other errors are not retried."""
    backoff_s: float = 0.25
    """Most a first retry waits; the bound doubles with each retry up to `max_backoff_s`,
    and the wait is drawn uniformly below it (jitter, so that ranks do not retry in step)."""
    max_backoff_s: float = 20.0
    timeout_s: float = 60.0
    """Seconds one request may wait for the store, to connect and then for each read of its
    answer; past it the request counts as a transient failure and is retried. A store that
    hangs thus fails a save after about `attempts` times this, never later."""
    requests_per_s: float = 0.0
    """Requests a second the whole job may send to the root, shared evenly by its ranks
    (`ranks`): S3 takes about 3,500 writes and 5,500 reads a second per prefix. 0: no bound.
    Either way a SlowDown halves a rank's pace for a while (`ckpt.storage.pacing`)."""
    ranks: int = 1
    """The job's ranks: the Checkpointer sets it."""
    throttled_s: float = 300.0
    """Seconds the store may answer this process nothing but throttles (SlowDown, 429, 503)
    before they count against `attempts`. While any request of the process (at its pace,
    `ckpt.storage.pacing`) succeeded within it, a throttled request is sent again after a
    backoff (at most `max_backoff_s`) without counting, however long it waits: a busy store
    slows a save down, it does not fail it. A store that answers only throttles for this long
    fails the save `attempts` tries later: it never hangs it."""

    def __post_init__(self) -> None:
        if not 5 * MiB <= self.part_size <= PUT_MAX:
            raise ValueError(f"Transfer.part_size must be from 5 MiB to 5 GiB (S3's smallest and largest part), not {self.part_size}")
        if min(self.concurrency, self.read_size, self.readahead, self.attempts, self.ranks) < 1 or self.timeout_s <= 0 or self.requests_per_s < 0:
            raise ValueError(f"Transfer's counts and sizes must be positive: {self}")
