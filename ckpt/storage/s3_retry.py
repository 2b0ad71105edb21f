"""Which failures of an S3 request are worth another try, and the tries: HTTP 5xx and 429,
throttling, timeouts, resets and refused connections are sent again after a wait drawn below a
bound that doubles with each try (jitter, so that ranks do not retry in step); a refusal
(AccessDenied) or a missing bucket is not. `Transfer` says how many tries and how long."""

from __future__ import annotations

import asyncio
import logging
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
    """The wait before try `attempt + 1`: drawn below a bound that doubles with each try."""
    return _JITTER.uniform(0, min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (attempt - 1)))


class GaveUp(Exception):
    """The last failure of a request `tried` gave up on, and how many tries it took."""

    def __init__(self, error: Exception, attempts: int) -> None:
        super().__init__(str(error))
        self.error, self.attempts = error, attempts


async def tried(cfg: Transfer, what: str, request: Callable[[], Awaitable[T]]) -> T:
    """`request()` at this process's pace (`ckpt.storage.pacing`), sent again after a
    transient failure (with `backoff_s`), at most `cfg.attempts` times, and after a throttling
    answer (which slows the pace) for up to `cfg.throttled_s`; GaveUp with the last failure
    otherwise."""
    pace = pace_for(cfg.requests_per_s, cfg.ranks)
    attempt, throttled, throttled_since = 1, 0, time.monotonic()
    while True:
        if wait := pace.delay():
            await asyncio.sleep(wait)
        try:
            return await request()
        except Exception as e:
            if is_throttled(e) and (not throttled or time.monotonic() - throttled_since < cfg.throttled_s):
                pace.slow_down()
                throttled, throttled_since = throttled + 1, throttled_since if throttled else time.monotonic()
                delay = backoff_s(cfg, throttled)
                logger.info("%s: %s; sent again in %.2f s (throttled %d time(s); pace %.3g requests/s)", what, describe(e), delay, throttled, pace.current)
                await asyncio.sleep(delay)
                continue
            if attempt >= cfg.attempts or not is_transient(e):
                raise GaveUp(e, attempt) from e
            delay = backoff_s(cfg, attempt)
            logger.info("%s: %s; attempt %d of %d in %.2f s", what, describe(e), attempt + 1, cfg.attempts, delay)
            await asyncio.sleep(delay)
            attempt += 1


def is_throttled(e: BaseException) -> bool:
    """Whether the store asked this process to slow down (SlowDown, 503, 429, a throttling code)."""
    return is_code(e, *_THROTTLING, "503", "429")
