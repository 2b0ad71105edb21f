"""Which failures of an S3 request are worth another try, and the tries: HTTP 5xx and 429,
throttling, timeouts, resets and refused connections are sent again after a wait drawn below a
bound that doubles with each try (jitter, so that ranks do not retry in step); a refusal
(AccessDenied) or a missing bucket is not. `Transfer` says how many tries and how long.
A throttling answer is not a failed try while the store still answers this process (some
request of it succeeded within `Transfer.throttled_s`): a long throttle slows a save, and only
a store that answers nothing but throttles for that long fails it."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
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
    """The last failure of a request `tried` gave up on, how many tries it took, and, when
    that failure was a throttling answer counted as a try, for how long no request of this
    process had been answered (`unanswered_s`). `why` says it in words."""

    def __init__(self, error: Exception, attempts: int, unanswered_s: float | None = None) -> None:
        self.error, self.attempts, self.unanswered_s = error, attempts, unanswered_s
        super().__init__(f"{error}{self.why}")

    @property
    def why(self) -> str:
        """For a message: how many tries, and why throttling answers counted as tries, in
        parentheses after a space; empty for a request that failed at its first try."""
        reasons = [f"gave up after {self.attempts} attempts"] if self.attempts > 1 else []
        if self.unanswered_s is not None:
            reasons.append(f"throttled for {self.unanswered_s:.1f} s with no request of this process answered, past Transfer.throttled_s")
        return f" ({'; '.join(reasons)})" if reasons else ""


async def tried(cfg: Transfer, what: str, request: Callable[[], Awaitable[T]]) -> T:
    """`request()` at this process's pace (`ckpt.storage.pacing`), sent again after a
    transient failure (with `backoff_s`), at most `cfg.attempts` times; GaveUp with the last
    failure otherwise. A throttling answer slows the pace and is sent again without counting
    as a try while a request at this pace succeeded within `cfg.throttled_s` (or this one was
    first throttled less than that ago); past that it counts as a failed try."""
    pace = pace_for(cfg.requests_per_s, cfg.ranks)
    attempt, throttled, first_throttled = 1, 0, math.inf
    while True:
        if wait := pace.delay():
            await asyncio.sleep(wait)
        try:
            answer = await request()
        except Exception as e:
            unanswered_s = None
            if is_throttled(e):
                pace.slow_down()
                throttled += 1
                now = time.monotonic()
                first_throttled = min(first_throttled, now)
                # IMPORTANT: the store's silence, not this request's: while other requests of
                # this process get through, a throttled one waits its turn and never fails.
                unanswered_s = now - max(first_throttled, pace.answered_at)
                if unanswered_s < cfg.throttled_s:
                    delay = backoff_s(cfg, throttled)
                    logger.info("%s: %s; sent again in %.2f s (throttled %d time(s); pace %.3g requests/s)", what, describe(e), delay, throttled, pace.current)
                    await asyncio.sleep(delay)
                    continue
            if attempt >= cfg.attempts or not is_transient(e):
                raise GaveUp(e, attempt, unanswered_s) from e
            delay = backoff_s(cfg, attempt)
            counted = "" if unanswered_s is None else f"; throttled with no request answered for {unanswered_s:.1f} s"
            logger.info("%s: %s; attempt %d of %d in %.2f s%s", what, describe(e), attempt + 1, cfg.attempts, delay, counted)
            await asyncio.sleep(delay)
            attempt += 1
        else:
            pace.answered()
            return answer


def is_throttled(e: BaseException) -> bool:
    """Whether the store asked this process to slow down (SlowDown, 429, another throttling
    code). A bare 503 is not: a store that is down answers it too (an answer without a body, to
    a HEAD, has no code to tell them apart)."""
    return is_code(e, *_THROTTLING, "429")
