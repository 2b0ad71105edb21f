"""Request pacing for object stores (issue 40, `ckpt.storage.pacing`): a process keeps to its
share of the job's request rate, a throttling answer slows it down for a while, and a store
that throttles slows a save down without failing it. The pace's arithmetic on a clock of the
test's own; its effect through a proxy in front of the moto S3 server that answers SlowDown
past a request rate, as S3 does per prefix."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
import uuid

import pytest
from botocore.exceptions import ClientError

from ckpt.errors import StorageError
from ckpt.storage import pacing
from ckpt.storage.pacing import FLOOR, Pace, pace_for
from ckpt.storage.s3_retry import GaveUp, answered, backoff_s, part_of, tried
from ckpt.storage.store import Store
from ckpt.storage.transfer import Transfer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pacing.time, "monotonic", c)
    return c


def test_a_pace_spaces_its_requests_and_after_a_calm_lets_one_seconds_worth_go_at_once(clock):
    pace = Pace(10.0)
    first = pace.delay()
    assert 0.0 < first <= 0.1  # a fresh pace starts near empty, at a random phase
    waits = [pace.delay() for _ in range(20)]
    assert waits == pytest.approx([first + 0.1 * k for k in range(1, 21)])  # each owes one more tenth
    clock.now += 4.0  # the debt paid, and one second's worth saved up
    assert [pace.delay() for _ in range(10)] == [0.0] * 10
    assert pace.delay() == pytest.approx(0.1)


def test_the_ranks_of_a_large_job_do_not_all_send_their_first_request_at_once(clock):
    """10,000 ranks pacing a job rate of 3,500 requests a second (0.35 each): each rank's first
    request waits a random part of its 2.9 s, so about 350 start in the first tenth of a
    second, not 10,000 (each bucket started full, every first request went at once)."""
    firsts = [Pace(0.35).delay() for _ in range(10_000)]
    assert max(firsts) <= 1 / 0.35 + 1e-9
    assert sum(f < 0.1 for f in firsts) < 600
    assert sum(f < 1.0 for f in firsts) == pytest.approx(3500, rel=0.15)


def test_a_throttling_answer_halves_the_pace_once_a_second_and_calm_seconds_bring_it_back(clock):
    pace = Pace(8.0)
    pace.slow_down()
    pace.slow_down()  # the same second: one halving
    assert pace.current == 4.0 and pace.throttled == 2
    for _ in range(10):
        clock.now += 1.0
        pace.slow_down()
    assert pace.current == FLOOR
    clock.now += 1.0
    pace.delay()
    assert pace.current == FLOOR * 1.5
    clock.now += 10.0
    pace.delay()
    assert pace.current == 8.0  # back to its bound, not past it


def test_without_a_rate_nothing_waits_and_the_job_rate_is_shared_by_its_ranks(clock):
    free = Pace(0.0)
    free.slow_down()
    assert all(free.delay() == 0.0 for _ in range(1000)) and free.throttled == 1
    assert pace_for(3500.0, 1000).bound == pytest.approx(3.5)
    assert pace_for(3500.0, 1000) is pace_for(3500.0, 1000)  # one per process and rate
    with pytest.raises(ValueError):
        Transfer(requests_per_s=-1)


def _write_many(store: Store, n: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: store.put_atomic(f"many/{i:03d}", b"x" * 100), range(n)))


def test_a_store_that_throttles_slows_writes_down_and_fails_none_and_a_paced_job_is_not_throttled(proxy, s3_root, s3_options):
    """60 PUTs from 8 threads against a store that takes 20 a second. Unpaced, with 2 tries a
    request: many are answered SlowDown, and every one still lands (a throttled request is sent
    again without counting as a failed try). Paced at 10 a second, for a job of one rank: none
    is throttled (half the store's rate: at 15 the full suite's load on 2 cores once delayed
    the proxy's threads into a burst it counted as one request too many)."""
    options = {**s3_options, "endpoint_url": proxy.url}
    proxy.limit(20.0)
    unpaced = Store(s3_root + "/unpaced", options, Transfer(attempts=2, backoff_s=0.05, max_backoff_s=0.5))
    _write_many(unpaced, 60)
    assert proxy.throttled > 0
    assert len(unpaced.list_dir("many")) == 60
    throttled = proxy.throttled
    proxy.limit(None)
    paced = Store(s3_root + "/paced", options, Transfer(attempts=2, requests_per_s=10.0))
    proxy.limit(20.0)
    _write_many(paced, 60)
    assert proxy.throttled == throttled, proxy.throttled - throttled
    assert len(paced.list_dir("many")) == 60


def test_a_request_throttled_for_longer_than_throttled_s_still_lands_while_others_get_through(proxy, s3_root, s3_options):
    """10 PUTs at once, one try each, into one directory of a store that takes 2.5 a second:
    the last to land is throttled for longer than `throttled_s` (1 s) and lands, because the
    store answers one of the others every 0.4 s. Before issue 40's fix, it failed at 1 s."""
    store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url}, Transfer(attempts=1, backoff_s=0.05, max_backoff_s=0.1, throttled_s=1.0))
    proxy.limit(2.5)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: store.put_atomic(f"many/{i}", str(i).encode()), range(10)))

    proxy.limit(None)
    assert [store.read_bytes(f"many/{i}") for i in range(10)] == [str(i).encode() for i in range(10)]
    spans: dict[str, list[float]] = {}
    for path, at in proxy.throttled_at:
        spans.setdefault(path, []).append(at)
    assert max(max(ats) - min(ats) for ats in spans.values()) > 1.0  # throttled_s


def test_a_store_that_answers_nothing_but_throttles_for_throttled_s_fails_the_write_and_says_why(proxy, s3_root, s3_options):
    """Then throttling answers count against `attempts`: the write fails soon after
    `throttled_s`, with a message that says the store answered nothing else; it does not hang."""
    store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url}, Transfer(attempts=2, backoff_s=0.05, max_backoff_s=0.1, throttled_s=0.5))
    proxy.limit(0.0)
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.put_atomic("never", b"x")

    assert 0.5 <= time.monotonic() - start < 3.0
    message = str(err.value)
    assert f"{s3_root}/never" in message and "SlowDown" in message
    assert re.search(
        r"gave up after 2 attempts; 2 of them throttles, counted because its directory of the store answered this process "
        r"nothing else for 0\.\d s, past Transfer.throttled_s", message
    ), message  # fmt: skip
    proxy.limit(None)
    assert not store.exists("never")


def _write_while_read_elsewhere(dead: Store, other: Store, rel: str) -> tuple[str, float]:
    """Write `rel` into `dead` while another thread reads from `other` every 0.1 s: how it
    ended ("landed", or the StorageError's message) and after how long; "still retrying"
    after 8 s."""
    other.put_atomic("x", b"x")
    stop, outcome = threading.Event(), ["still retrying", 0.0]

    def read() -> None:
        while not stop.wait(0.1):
            other.read_bytes("x")

    def write() -> None:
        start = time.monotonic()
        try:
            dead.put_atomic(rel, b"{}")
            outcome[0] = "landed"
        except StorageError as e:
            outcome[0] = str(e)
        outcome[1] = time.monotonic() - start

    reader, writer = threading.Thread(target=read, daemon=True), threading.Thread(target=write, daemon=True)
    reader.start()
    writer.start()
    writer.join(8.0)
    stop.set()
    reader.join()
    return outcome[0], outcome[1]  # type: ignore[return-value]


@pytest.mark.parametrize("elsewhere", ["another endpoint", "another directory of the bucket"])
def test_a_directory_that_answers_only_slowdown_fails_a_write_though_the_process_is_answered_elsewhere(proxy, s3_root, s3_options, elsewhere):
    """Two roots of one process (a node agent serves many jobs' roots from one process): one
    answers nothing but SlowDown, the other a read every 0.1 s. The write to the first fails
    soon after `throttled_s`, as it would alone: S3 throttles per prefix, and an answer from
    elsewhere says nothing of this one. Before, any answer of the process kept it retrying
    for good (outside review of issue 40: one job's dead store hung its uploads)."""
    quick = Transfer(attempts=2, backoff_s=0.05, max_backoff_s=0.1, throttled_s=0.5)
    dead = Store(f"{s3_root}/dead", {**s3_options, "endpoint_url": proxy.url}, quick)
    other = Store(f"{s3_root}/other", s3_options if elsewhere == "another endpoint" else {**s3_options, "endpoint_url": proxy.url}, quick)
    proxy.limit(0.0, under=f"/{s3_root.removeprefix('s3://')}/dead/")

    outcome, took = _write_while_read_elsewhere(dead, other, "manifest.json")

    proxy.limit(None)
    assert "SlowDown" in outcome and "2 of them throttles, counted" in outcome, outcome
    assert took < 4.0
    assert not dead.exists("manifest.json")


def test_a_throttled_request_gives_up_at_deadline_s_though_its_directory_still_answers(proxy, s3_root, s3_options):
    """A PUT answered SlowDown for good, while reads of the same directory are answered every
    0.1 s: its throttles never count, and at `deadline_s` (1 s) it fails all the same, saying
    so. No request outlives the collective that waits for it (a rank 0's commit, which the
    other ranks wait for for the Checkpointer's `timeout_s`)."""
    store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url}, Transfer(attempts=2, backoff_s=0.05, max_backoff_s=0.1, throttled_s=60.0, deadline_s=1.0))
    proxy.limit(0.0, under=f"/{s3_root.removeprefix('s3://')}/dir/slow")

    outcome, took = _write_while_read_elsewhere(store, store, "dir/slow")

    proxy.limit(None)
    assert re.search(r"SlowDown.*\(gave up 1\.\d s after its first try, past Transfer.deadline_s: \d+ tries, \d+ of them throttled\)$", outcome), outcome
    assert 1.0 <= took < 2.0
    assert not store.exists("dir/slow")


def _slowdown() -> ClientError:
    return ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")


def _internal_error() -> ClientError:
    return ClientError({"Error": {"Code": "InternalError", "Message": "We encountered an internal error."}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "PutObject")


@pytest.mark.parametrize(
    "answers, outcome",
    [
        pytest.param(["503", "500", "500", "ok"], "landed", id="no silence: a throttle, two 500s, lands"),
        pytest.param(["503", "silence", "503", "answered", "503", "500", "500", "ok"], "landed", id="answered again: the throttle counted in the silence no longer counts"),
        pytest.param(["503", "silence", "503", "500", "500"], "gave up after 3 attempts; 1 of them throttles", id="still silent: it counts, and the message says so"),
    ],
)
def test_throttles_counted_in_a_silence_stop_counting_once_the_directory_answers_again(answers, outcome):
    """One PUT's answers, as botocore raises them, with three tries (`attempts`): a throttle
    counted after `throttled_s` (0.2 s) without an answer from its directory ("silence") no
    longer counts once another request to the directory succeeded ("answered"), and two 500s
    then leave it its third try. Before, the throttle stayed counted and the 500s failed it
    (outside review of issue 40)."""
    cfg = Transfer(attempts=3, backoff_s=0.001, max_backoff_s=0.002, throttled_s=0.2)
    part = part_of("http://store", f"bucket-{uuid.uuid4().hex}", "run/step-0000000001/manifest.json")
    answers = list(answers)

    async def put() -> str:
        while answers[0] in ("silence", "answered"):
            if answers.pop(0) == "silence":
                await asyncio.sleep(0.25)
            else:
                answered(part)  # another request to the directory succeeded
        answer = answers.pop(0)
        if answer == "ok":
            return "landed"
        raise _slowdown() if answer == "503" else _internal_error()

    try:
        got = asyncio.run(tried(cfg, "writing manifest.json", put, part))
    except GaveUp as e:
        got = e.why
    assert outcome in got and not answers


@pytest.mark.parametrize("field", ["backoff_s", "max_backoff_s", "deadline_s"])
def test_a_transfer_whose_retries_would_not_wait_or_whose_requests_would_never_retry_is_refused(field):
    """A backoff bound of 0 made a throttled request spin: sent again at once, for as long as
    the store answered others, to a store that asked for fewer requests."""
    with pytest.raises(ValueError, match="times must be positive"):
        Transfer(**{field: 0.0})
    Transfer(throttled_s=0.0)  # every throttle counts at once: allowed


def test_a_throttle_of_hours_waits_at_most_max_backoff_s_between_tries():
    """Thousands of throttled tries: the bound stops doubling at `max_backoff_s` (2.0 ** 1100
    overflowed), and the wait is drawn below it."""
    cfg = Transfer(backoff_s=0.25, max_backoff_s=20.0)
    waits = [backoff_s(cfg, n) for n in (1, 2, 8, 1100, 10**6) for _ in range(200)]
    assert 0.0 <= min(waits) and max(waits) <= 20.0
    assert max(backoff_s(cfg, 1) for _ in range(200)) <= 0.25


def test_a_node_agent_takes_its_nodes_share_from_a_flag_or_its_environment(tmp_path, monkeypatch):
    from ckpt.agent.config import Config

    assert Config.load(["--spool", str(tmp_path), "--requests-per-s", "12"]).requests_per_s == 12.0
    monkeypatch.setenv("CKPT_AGENT_REQUESTS_PER_S", "3")
    assert Config.load(["--spool", str(tmp_path)]).requests_per_s == 3.0


def test_a_ranks_writer_process_paces_at_half_its_share_so_that_with_the_trainer_it_keeps_to_it():
    """A save's data goes from the rank's writer process, its index then from the trainer: each
    pacing at the rank's whole share, a rank sent up to twice it (outside review of issue 40)."""
    from ckpt.storage.pacing import writer_share

    paced = Transfer(requests_per_s=3500.0, ranks=1000)
    assert pace_for(writer_share(paced).requests_per_s, writer_share(paced).ranks).bound == pytest.approx(1.75)
    assert writer_share(Transfer()) == Transfer()  # unpaced: nothing to share
