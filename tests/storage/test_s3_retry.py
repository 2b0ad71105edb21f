"""Which S3 failures are tried again (ckpt.storage.s3_retry), through a fault-injecting proxy in
front of a real S3-protocol server (moto): transient ones are retried and the data still
round-trips, a store that keeps failing is a StorageError soon and leaves nothing, a refusal is
never retried."""

from __future__ import annotations

import logging
import mmap
import time

import pytest

from ckpt.errors import StorageError
from ckpt.storage.store import MiB
from tests.support.s3 import (
    PART,
    SECRET,
    SMALL,
    bucket_of,
    payload,
    through,
    uploads_in_progress,
)
from tests.support.s3proxy import FaultyProxy


def test_transient_failures_are_retried_and_the_data_still_round_trips(
    proxy, s3_root, s3_options, caplog
):
    caplog.set_level(logging.INFO, logger="ckpt.storage.s3")
    store = through(proxy, s3_root, s3_options, attempts=4)
    data, small = payload(23 * MiB), payload(1000)
    proxy.fail("part", "503", "reset", "500")
    proxy.fail("put", "reset", "reset")  # aiohttp resends a dropped PUT once by itself, then ckpt
    proxy.fail("range", "reset", "503")
    proxy.fail("head", "503")  # no body to a HEAD: no SlowDown code, a bare 503

    with store.open_write("big") as f:
        f.write(data)
    with store.open_write("small") as f:
        f.write(small)
    with store.open_read("big") as f:
        got = f.read()

    assert got == data and store.read_bytes("small") == small
    ranges = -(-len(data) // SMALL.read_size) + 1  # and one for the small file
    assert proxy.failed == {"part": 3, "put": 2, "range": 2, "head": 1}
    assert proxy.seen["part"] == 5 + 3 and proxy.seen["put"] == 1 + 2
    assert proxy.seen["range"] == ranges + 2
    retries = [r.getMessage() for r in caplog.records if " of 4 in " in r.getMessage() or "throttled 1 time" in r.getMessage()]
    # "(503)", not "503": the proxy's port may hold those digits. A SlowDown is sent again
    # without counting as a failed try (ckpt.storage.pacing); a bare 503 (the HEAD's) counts.
    assert len([m for m in retries if "SlowDown" in m or "InternalError" in m or "(503)" in m]) == 4
    assert len([m for m in retries if "throttled 1 time" in m]) == 2
    assert [m for m in retries if "(503)" in m and "attempt 2 of 4" in m]
    (put,) = [m for m in retries if "/small:" in m]
    assert "ClientError" not in put  # the dropped connection


def test_a_store_that_keeps_failing_gives_a_storage_error_quickly_and_leaves_nothing(
    proxy, s3_root, s3_options, s3_endpoint
):
    store = through(proxy, s3_root, s3_options, attempts=3)
    proxy.fail("part", "always")
    proxy.fail("put", "always")
    start = time.monotonic()

    arena = mmap.mmap(-1, 4 * PART)
    with pytest.raises(StorageError) as big:
        with store.open_write("step-0000000001/__0_0.distcp") as f:
            f.write(memoryview(arena))
    with pytest.raises(StorageError) as small:
        with store.open_write("step-0000000001/.metadata") as f:
            f.write(b"metadata")

    assert time.monotonic() - start < 10
    for err, name in ((big, "__0_0.distcp"), (small, ".metadata")):
        message = str(err.value)
        assert (
            f"{s3_root}/step-0000000001/{name}" in message and "gave up after 3 attempts" in message
        )
        assert SECRET not in message
    assert proxy.seen["put"] == 3 and proxy.seen["delete"] == 1  # the upload was aborted
    assert store.list_step(1) is None
    assert uploads_in_progress(s3_endpoint, bucket_of(s3_root)) == []
    arena.close()  # BufferError if the failed upload still held a view of it


@pytest.mark.parametrize(
    "answers, lands",
    [
        pytest.param(("500", "500"), True, id="two 500s: lands at the third try"),
        pytest.param(("500", "500", "500"), False, id="three 500s: fails"),
        pytest.param(("503", "500", "503", "500"), True, id="SlowDowns do not count"),
        pytest.param(("500", "503", "503", "500", "503", "500"), False, id="the third 500 fails"),
        pytest.param(("down", "down"), True, id="two bare 503s: lands at the third try"),
        pytest.param(("down", "500", "down"), False, id="a bare 503 is no throttle: the third failure fails"),
    ],
)
def test_failures_other_than_throttling_count_against_attempts_even_while_the_store_answers(
    proxy, s3_root, s3_options, answers, lands
):
    """Three tries (`attempts=3`) of one PUT, just after the store answered another: a 500
    is a failed try as before issue 40, and so is a 503 without a throttling code (a store
    that is down answers it too); only throttling answers are not."""
    store = through(proxy, s3_root, s3_options, attempts=3)
    store.put_atomic("answered", b"a")
    proxy.fail("put", *answers)
    puts = proxy.seen["put"]

    if lands:
        store.put_atomic("x", b"x")
        assert store.read_bytes("x") == b"x"
    else:
        with pytest.raises(StorageError, match=r"\((InternalError|503)\).*\(gave up after 3 attempts\)$"):
            store.put_atomic("x", b"x")
        assert not store.exists("x")
    assert proxy.seen["put"] - puts == len(answers) + lands


@pytest.mark.parametrize(
    "server, refusal",
    [
        ("s3_endpoint", "NoSuchBucket"),
        ("s3_strict_endpoint", "InvalidAccessKeyId"),
    ],
)
def test_a_refusal_is_not_retried(request, s3_options, server, refusal):
    proxy = FaultyProxy(request.getfixturevalue(server))
    request.addfinalizer(proxy.close)
    store = through(proxy, "s3://no-such-bucket-for-ckpt/run", s3_options, attempts=5)

    with pytest.raises(StorageError, match=refusal) as err:
        with store.open_write("x") as f:
            f.write(b"x")

    assert proxy.seen["put"] == 1
    assert "s3://no-such-bucket-for-ckpt/run/x" in str(err.value) and SECRET not in str(err.value)
