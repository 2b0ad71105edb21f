"""Which failures of an S3 request are worth another try, and the tries: HTTP 5xx and 429,
throttling, timeouts, resets and refused connections are sent again after a wait drawn below a
bound that doubles with each try (jitter, so that ranks do not retry in step); a refusal
(AccessDenied) or a missing bucket is not. `Transfer` says how many tries and how long.

A throttling answer (SlowDown, 429, another throttling code; not a bare 503, which a store
that is down sends too) is not a failed try while the request's part of the store still
answers this process: a request to the same directory of the same bucket and endpoint
(`part_of`) succeeded within `Transfer.throttled_s`. S3 throttles per prefix, so an answer from
elsewhere (the lease's renewal, another job's root) says nothing of this one. Past
`Transfer.deadline_s` no request is sent again, however it was answered: a busy store slows a
save down, and no request is tried for as long as the collective that waits for it waits (a
Checkpointer sets it to half its `timeout_s`)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from botocore.exceptions import ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3fs.core import S3_RETRYABLE_ERRORS

from ckpt.redact import redact
from ckpt.storage.pacing import pace_for
from ckpt.storage.transfer import Transfer

logger = logging.getLogger("ckpt.storage.s3")  # a retry is the S3 layer's news
# IMPORTANT: the jitter's own generator: drawing from `random`'s global one would move the
# training loop's Python RNG stream, which a checkpoint saves and a resume must continue exactly.
_JITTER = random.Random()
T = TypeVar("T")

# Error codes that mean "try again" (botocore's standard retry mode lists the same ones).
_TRANSIENT_CODES = frozenset(
    {
        "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
        "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
        "ThrottledException", "RequestThrottled", "RequestThrottledException",
        "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
        "XAmzContentSHA256Mismatch",
    }
)  # fmt: skip


# Of those, the ones that mean "too many requests": the pace slows (`ckpt.storage.pacing`).
_THROTTLING = (
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
)  # fmt: skip


class ShortRead(Exception):
    """A GET ended before the bytes it announced: the connection broke mid-body."""


_TRANSIENT_TYPES = (
    *S3_RETRYABLE_ERRORS,  # timeouts, dropped connections, unparsable throttling replies
    BotoConnectionError,  # refused, unreachable
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,
    ShortRead,
)


def is_transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when sent again: HTTP 5xx and 429, throttling,
    timeouts, resets and refused connections; not a refusal (AccessDenied) or a missing bucket."""
    err = botocore_error(e)
    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return (
            status >= 500
            or status == 429
            or err.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
        )
    return isinstance(err, _TRANSIENT_TYPES)


def botocore_error(e: BaseException) -> BaseException:
    """s3fs turns a ClientError into an OSError whose cause is the original; that one says more."""
    return e.__cause__ if isinstance(e.__cause__, ClientError) else e


def is_code(e: BaseException | None, *codes: str) -> bool:
    err = botocore_error(e) if e is not None else None
    return isinstance(err, ClientError) and (
        err.response.get("Error", {}).get("Code") in codes
        or str(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")) in codes
    )


def describe(e: BaseException) -> str:
    err = botocore_error(e)
    text = re.sub(r" \(reached max retries: \d+\)", "", str(err))  # botocore's, which are off
    return f"{type(err).__name__}: {redact(text)}"


def backoff_s(cfg: Transfer, attempt: int) -> float:
    """The wait before try `attempt + 1`: drawn below a bound that doubles with each try, up
    to `cfg.max_backoff_s`."""
    # The exponent capped: a throttle of hours is thousands of tries, and 2.0 ** 1100 is no float.
    return _JITTER.uniform(0, min(cfg.max_backoff_s, cfg.backoff_s * 2.0 ** min(attempt - 1, 64)))


class GaveUp(Exception):
    """The last failure of a request `tried` gave up on, and why: the tries counted
    (`attempts`), how many of them were throttles counted because the request's part of the
    store had answered nothing else for `silent_s` (past `Transfer.throttled_s`), and, when it
    gave up at `Transfer.deadline_s`, how long after its first try (`elapsed_s`) and how many
    tries it had sent (`sent`, `throttled`). `why` says it in words."""

    def __init__(
        self, error: Exception, attempts: int, throttles: int = 0, silent_s: float = 0.0,
        elapsed_s: float | None = None, sent: int = 0, throttled: int = 0,
    ) -> None:  # fmt: skip
        self.error, self.attempts, self.throttles, self.silent_s = error, attempts, throttles, silent_s
        self.elapsed_s, self.sent, self.throttled = elapsed_s, sent, throttled
        super().__init__(f"{error}{self.why}")

    @property
    def told(self) -> bool:
        """Whether `why` says more than how many tries: a throttle counted, the deadline."""
        return bool(self.throttles) or self.elapsed_s is not None

    @property
    def why(self) -> str:
        """For a message, in parentheses after a space; empty for a request that failed at
        its first try."""
        if self.elapsed_s is not None:
            reasons = [
                f"gave up {self.elapsed_s:.1f} s after its first try, past Transfer.deadline_s: "
                f"{self.sent} tries, {self.throttled} of them throttled"
            ]  # fmt: skip
        else:
            reasons = [f"gave up after {self.attempts} attempts"] if self.attempts > 1 else []
        if self.throttles:
            reasons.append(
                f"{self.throttles} of them throttles, counted because its directory of the store answered this "
                f"process nothing else for {self.silent_s:.1f} s, past Transfer.throttled_s"
            )  # fmt: skip
        return f" ({'; '.join(reasons)})" if reasons else ""


async def tried(cfg: Transfer, what: str, request: Callable[[], Awaitable[T]], part: str) -> T:
    """`request()` at this process's pace (`ckpt.storage.pacing`), sent again after a
    transient failure (with `backoff_s`) until `cfg.attempts` tries have failed, and never
    `cfg.deadline_s` after the first; GaveUp with the last failure otherwise. A throttling
    answer slows the pace and is no failed try while `part` (`part_of`) answered a request of
    this process within `cfg.throttled_s` (or this one was first throttled less than that
    ago); counted, it stops counting once `part` answers again."""
    pace = pace_for(cfg.requests_per_s, cfg.ranks)
    started, first_throttled, counted_at = time.monotonic(), math.inf, math.inf
    failures = throttles = sent = throttled = 0  # throttles: those counted in the present silence
    silent_s = 0.0
    while True:
        if wait := pace.delay():
            await asyncio.sleep(wait)
        sent += 1
        try:
            answer = await request()
        except Exception as e:
            now, heard = time.monotonic(), answered_at(part)
            if heard > counted_at:
                throttles = 0  # the part answers again: what it throttled in its silence no longer counts
            throttle, free = is_throttled(e), False
            if throttle:
                pace.slow_down()
                throttled += 1
                first_throttled = min(first_throttled, now)
                # IMPORTANT: the silence of this part of the store, not of the process: while
                # other requests to it get through, a throttled one waits its turn.
                silent_s = now - max(first_throttled, heard)
                free = silent_s < cfg.throttled_s
                if not free:
                    throttles, counted_at = throttles + 1, now
            else:
                failures += 1
            attempts = failures + throttles
            if not is_transient(e) or (not free and attempts >= cfg.attempts):
                raise GaveUp(e, attempts, throttles, silent_s) from e
            left = started + cfg.deadline_s - now
            if left <= 0:
                raise GaveUp(e, attempts, throttles, silent_s, now - started, sent, throttled) from e
            # IMPORTANT: a wait always (the bound is positive: Transfer), and no try after the deadline.
            delay = min(left, backoff_s(cfg, throttled if free else attempts))
            if free:
                logger.info("%s: %s; sent again in %.2f s (throttled %d time(s); pace %.3g requests/s)", what, describe(e), delay, throttled, pace.current)
            else:
                counted = f"; a throttle counted: its directory answered nothing else for {silent_s:.1f} s" if throttle else ""
                logger.info("%s: %s; attempt %d of %d in %.2f s%s", what, describe(e), attempts + 1, cfg.attempts, delay, counted)
            await asyncio.sleep(delay)
        else:
            answered(part)
            return answer


def is_throttled(e: BaseException) -> bool:
    """Whether the store asked this process to slow down (SlowDown, 429, another throttling
    code). A bare 503 is not: a store that is down answers it too (an answer without a body, to
    a HEAD, has no code to tell them apart)."""
    return is_code(e, *_THROTTLING, "429")


# When a request of this process to each part of a store (`part_of`) last succeeded, by the
# monotonic clock: what tells a busy store from one that answers nothing but throttles.
_answered: dict[str, float] = {}
_answered_lock = threading.Lock()
_ANSWERED_KEPT = 4096  # parts remembered; the oldest half goes past it


def part_of(endpoint: str, bucket: str, key: str = "") -> str:
    """The part of a store a request to `key` (or a listing of the prefix `key`) goes to, as
    the record of answers keys it: the endpoint, the bucket and the key's directory (a step
    directory, the root's own files)."""
    return f"{endpoint} {bucket}/{key.rpartition('/')[0]}"


def answered(part: str) -> None:
    """A request of this process to `part` succeeded."""
    with _answered_lock:
        _answered[part] = time.monotonic()
        if len(_answered) > _ANSWERED_KEPT:
            # A node agent serves many roots for days, a directory more each save: the parts
            # answered longest ago are forgotten, and count as silent (which they nearly are).
            for old in sorted(_answered, key=_answered.__getitem__)[: _ANSWERED_KEPT // 2]:
                del _answered[old]


def answered_at(part: str) -> float:
    """When a request of this process to `part` last succeeded (-inf: never)."""
    with _answered_lock:
        return _answered.get(part, -math.inf)


def _forget_answers() -> None:
    """In a forked child: its requests are its own, and a lock held at the fork is never released."""
    global _answered_lock
    _answered.clear()
    _answered_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_answers)
