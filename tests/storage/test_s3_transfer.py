"""S3 transfers of `Store.open_write` / `open_read` against a real S3-protocol server (moto),
with a fault-injecting HTTP proxy on loopback in front of it for the retry tests."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import mmap
import os
import signal
import time

import boto3
import pytest
import s3fs

from ckpt.errors import InvalidCheckpoint, NotFound, StorageError
from ckpt.storage.store import MiB, Store, Transfer
from tests.support.s3proxy import FaultyProxy

PART = 5 * MiB  # S3's smallest part, so that a few MiB make several parts
SMALL = Transfer(part_size=PART, concurrency=3, read_size=2 * MiB, readahead=3, backoff_s=0.01)
SECRET = "testing-secret"  # the secret of conftest's s3_options


def bucket_of(root: str) -> str:
    return root.removeprefix("s3://").split("/", 1)[0]


def payload(n: int) -> bytes:
    return os.urandom(n)


def uploads_in_progress(endpoint: str, bucket: str) -> list:
    return (
        boto3.client("s3", endpoint_url=endpoint)
        .list_multipart_uploads(Bucket=bucket)
        .get("Uploads", [])
    )


def etag(endpoint: str, bucket: str, key: str) -> str:
    return (
        boto3.client("s3", endpoint_url=endpoint)
        .head_object(Bucket=bucket, Key=key)["ETag"]
        .strip('"')
    )


def read_in_odd_pieces(f, n: int) -> bytes:
    out = bytearray()
    sizes = itertools.cycle([1, 7, 3 * MiB + 5, 100_000])
    while len(out) < n:
        chunk = f.read(next(sizes))
        assert chunk, "early end of stream"
        out += chunk
    assert f.read(10) == b""
    return bytes(out)


@pytest.fixture
def store(s3_root, s3_options):
    return Store(s3_root, s3_options, transfer=SMALL)


@pytest.mark.parametrize(
    "size", [0, 1, PART, PART + 1, 2 * PART, 2 * PART + 1, 23 * MiB],
    ids=["0", "1", "part", "part+1", "2parts", "2parts+1", "23MiB"],
)
def test_every_size_round_trips_byte_for_byte_with_s3fs_on_either_side(
    store, s3_root, s3_endpoint, size
):
    data = payload(size)
    plain = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)

    with store.open_write("ours") as f:
        f.write(data[: size // 3])  # uneven writes: parts do not follow the write boundaries
        f.write(data[size // 3 :])
    plain.pipe_file(f"{bucket}/{prefix}/theirs", data)

    assert plain.cat_file(f"{bucket}/{prefix}/ours") == data
    assert store.read_bytes("theirs") == data
    with store.open_read("ours") as f:
        assert read_in_odd_pieces(f, size) == data
    parts = etag(s3_endpoint, bucket, f"{prefix}/ours").partition("-")[2]
    assert parts == ("" if size <= 2 * PART else str(-(-size // PART)))  # up to two parts: one PUT
    assert not uploads_in_progress(s3_endpoint, bucket)


def test_told_the_size_an_upload_sends_its_first_part_as_soon_as_it_is_full(store, s3_root, s3_endpoint):
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    data = payload(3 * PART)
    with store.open_write("sized", size=len(data)) as f:
        f.write(data[: PART + 1])
        assert len(uploads_in_progress(s3_endpoint, bucket)) == 1
        f.write(data[PART + 1 :])
    assert store.read_bytes("sized") == data and etag(s3_endpoint, bucket, f"{prefix}/sized").endswith("-3")
    with store.open_write("small", size=2 * PART) as f:
        f.write(data[: 2 * PART])
        assert uploads_in_progress(s3_endpoint, bucket) == []
    assert "-" not in etag(s3_endpoint, bucket, f"{prefix}/small")  # one PUT


def test_an_aborted_upload_lets_go_of_the_held_parts_buffers(store, s3_root, s3_endpoint):
    mm = mmap.mmap(-1, 2 * PART)
    mm[:] = payload(len(mm))
    view = memoryview(mm)
    with pytest.raises(StorageError, match="the writer failed"):
        with store.open_write("held") as f:
            f.write(view)  # two parts: held for one PUT
            raise RuntimeError("the writer failed")
    view.release()
    mm.close()  # BufferError if a held part still referred to it
    assert not store.exists("held") and uploads_in_progress(s3_endpoint, bucket_of(s3_root)) == []


def test_a_part_larger_than_s3_allows_is_refused():
    with pytest.raises(ValueError, match="5 MiB to 5 GiB"):
        Transfer(part_size=6 << 30)


def test_parts_are_held_while_one_put_may_do_and_go_as_soon_as_the_file_outgrows_two(store, s3_root, s3_endpoint):
    data = payload(2 * PART + 1)
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    with store.open_write("held") as f:
        for at in range(0, 2 * PART, MiB):
            f.write(data[at : at + MiB])  # copied pieces: the held parts are the upload's own
        assert uploads_in_progress(s3_endpoint, bucket) == []  # two parts: still one PUT
        f.write(data[2 * PART :])
        assert len(uploads_in_progress(s3_endpoint, bucket)) == 1  # begun before the block ends
    assert store.read_bytes("held") == data
    assert etag(s3_endpoint, bucket, f"{prefix}/held").endswith("-3")


@pytest.mark.parametrize("size", [8 * MiB, 23 * MiB], ids=["one-put", "multipart"])
def test_a_memoryview_of_an_mmap_goes_out_without_being_held_after_the_block(store, size):
    header = payload(1000)
    mm = mmap.mmap(-1, size)
    mm[:] = payload(len(mm))
    view = memoryview(mm)

    with store.open_write("arena") as f:
        f.write(header)
        f.write(view[: 7 * MiB])
        f.write(view[7 * MiB :])

    assert store.read_bytes("arena") == header + mm[:]
    view.release()
    mm.close()  # BufferError if a part still held a view of it


def test_memory_without_an_owner_is_copied_so_the_caller_may_reuse_it_at_once(store):
    # torch.save hands `write` views of memory it frees right after: they carry no owner.
    raw = ctypes.create_string_buffer(payload(6 * MiB), 6 * MiB)
    from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
    from_memory.restype, from_memory.argtypes = (
        ctypes.py_object,
        [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int],
    )
    ownerless = from_memory(ctypes.addressof(raw), len(raw), 0x100)  # PyBUF_READ
    assert ownerless.obj is None
    want = raw.raw

    with store.open_write("copied") as f:
        f.write(ownerless)
        ctypes.memset(raw, 0, len(raw))

    assert store.read_bytes("copied") == want


def test_an_exception_in_the_block_leaves_no_object_and_no_upload(store, s3_root, s3_endpoint):
    # An error in the block is reported as a failed write, as on every other store.
    with pytest.raises(StorageError, match="broken: RuntimeError: the caller failed"):
        with store.open_write("broken") as f:
            f.write(payload(3 * PART))  # two parts sent, the third waits for more bytes
            raise RuntimeError("the caller failed")
    with pytest.raises(KeyboardInterrupt):
        with store.open_write("small") as f:
            f.write(b"x")
            raise KeyboardInterrupt  # before the single PUT

    assert not store.exists("broken") and not store.exists("small")
    assert uploads_in_progress(s3_endpoint, bucket_of(s3_root)) == []


def test_reader_seeks_and_reads_into_buffers(store):
    data = payload(9 * MiB + 3)
    with store.open_write("seek") as f:
        f.write(data)

    with store.open_read("seek") as f:
        assert f.read(10) == data[:10]
        f.seek(8 * MiB)  # past the ranges in flight
        assert f.tell() == 8 * MiB
        buf = bytearray(100)
        assert f.readinto(buf) == 100 and buf == data[8 * MiB : 8 * MiB + 100]
        f.seek(5)  # and back
        assert f.read(3 * MiB) == data[5 : 5 + 3 * MiB]
        f.seek(-4, os.SEEK_END)
        assert f.read() == data[-4:]
    with pytest.raises(NotFound, match="missing does not exist"):
        store.read_bytes("missing")


def test_a_range_read_in_the_pieces_the_connection_delivered_serves_any_seek_within_it(store):
    """A range's bytes are kept as they came off the connection (not joined): reads that
    cross pieces, seeks forward to a later piece and back to an earlier one of the same range,
    all read the object's bytes."""
    data = payload(6 * MiB + 11)
    with store.open_write("pieces") as f:
        f.write(data)
    with store.open_read("pieces", size=len(data)) as f:
        assert f.read(1) == data[:1]
        assert len(f._rest) > 1  # the first range came in several pieces
        f.seek(MiB + 77)  # later in the same 2 MiB range
        assert f.read(300_000) == data[MiB + 77 : MiB + 300_077]
        f.seek(10)  # back, to the range's first piece
        buf = bytearray(2 * MiB + 5)  # across into the next range
        assert f.readinto(buf) == len(buf) and buf == data[10 : 10 + len(buf)]
        f.seek(5 * MiB)
        assert read_in_odd_pieces(f, len(data) - 5 * MiB) == data[5 * MiB :]


# -- failures ------------------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultyProxy(s3_endpoint)
    yield p
    p.close()


def through(proxy: FaultyProxy, root: str, options: dict, **transfer: object) -> Store:
    return Store(
        root,
        {**options, "endpoint_url": proxy.url},
        transfer=dataclasses.replace(SMALL, **transfer),
    )


def test_a_reader_told_what_it_will_read_fetches_only_that(proxy, s3_root, s3_options):
    """A rank that needs two blocks of another rank's 20 MiB file gets those sent, not the
    file (readahead would otherwise have 3 x 2 MiB in flight from the first byte on)."""
    store = through(proxy, s3_root, s3_options)
    data = payload(20 * MiB)
    with store.open_write("big") as f:
        f.write(data)
    proxy.ranges.clear()
    with store.open_read("big", [(0, MiB), (15 * MiB, 16 * MiB)]) as f:
        assert f.read(MiB) == data[:MiB]
        f.seek(15 * MiB)
        assert f.read(MiB) == data[15 * MiB : 16 * MiB]
        assert sorted(proxy.ranges) == [f"bytes=0-{MiB - 1}", f"bytes={15 * MiB}-{16 * MiB - 1}"]  # sent together
        f.seek(3 * MiB)  # where the hint did not say: still served, then read ahead as usual
        assert f.read(10) == data[3 * MiB : 3 * MiB + 10]
    # from 3 MiB on, plain 2 MiB ranges read ahead, in whatever order they reach the proxy
    # (those still unsent when the reader closed are never sent)
    after = set(proxy.ranges[2:])
    want = {f"bytes={a * MiB}-{(a + 2) * MiB - 1}" for a in (3, 5, 7, 9)}
    assert len(after) == len(proxy.ranges[2:]) and f"bytes={3 * MiB}-{5 * MiB - 1}" in after and after <= want


def test_the_checkpointers_transfer_settings_reach_its_writer_process(proxy, s3_root, s3_options):
    """`Checkpointer(transfer=)`: the writer process uploads the data file in parts of the
    size asked for (5 MiB: a 12 MB file in 3 parts), not the default 64 MiB (one PUT)."""
    import torch

    import ckpt

    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    transfer = ckpt.Transfer(part_size=5 * MiB, concurrency=2)
    with ckpt.Checkpointer(s3_root, model=model, optimizer=opt, interval=None, save_on_exit=False, restore="none",
                           storage_options={**s3_options, "endpoint_url": proxy.url}, transfer=transfer) as cp:  # fmt: skip
        proxy.seen.clear()
        cp.save(blocking=True)
        assert cp._slot.sinks.get(cp.store.url) is not None and type(cp._slot.sinks.get(cp.store.url)).__name__ == "ProcessSink"
    size = max(e.size for e in cp.last_commit.files.values())
    assert 10 * MiB < size <= 15 * MiB
    assert proxy.seen["part"] == -(-size // (5 * MiB))


def test_transient_failures_are_retried_and_the_data_still_round_trips(
    proxy, s3_root, s3_options, caplog
):
    caplog.set_level(logging.INFO, logger="ckpt.storage.s3")
    store = through(proxy, s3_root, s3_options, attempts=4)
    data, small = payload(23 * MiB), payload(1000)
    proxy.fail("part", "503", "reset", "500")
    proxy.fail("put", "reset", "reset")  # aiohttp resends a dropped PUT once by itself, then ckpt
    proxy.fail("range", "reset", "503")
    proxy.fail("head", "503")

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
    retries = [r.getMessage() for r in caplog.records if " of 4 in " in r.getMessage()]
    # "(503)", not "503": the proxy's port may hold those digits
    assert len([m for m in retries if "SlowDown" in m or "InternalError" in m or "(503)" in m]) == 4
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


def test_the_stores_of_a_process_share_their_s3_clients_per_options(s3_root, s3_options):
    """A new S3 client costs 80-300 ms on its first request: Stores with the same options
    (each Checkpointer entered, each restore) reuse the process's; other options get their own."""
    a, b = Store(s3_root, s3_options), Store(s3_root + "-other", s3_options)
    assert a.fs is b.fs and a.backend.client.fs is b.backend.client.fs
    c = Store(s3_root, s3_options, Transfer(attempts=2))
    assert c.fs is not a.fs and (c.fs.transfer.attempts, a.fs.transfer.attempts) == (2, Transfer().attempts)
    d = Store(s3_root, {**s3_options, "secret": "another"})
    assert d.fs is not a.fs and d.backend.client.fs is not a.backend.client.fs
    b.put_atomic("x", b"each its own root")  # the shared client reaches each Store's own root
    assert Store(s3_root + "-other", s3_options).read_bytes("x") == b"each its own root"
    with pytest.raises(NotFound):
        a.read_bytes("x")


def test_a_small_file_is_read_in_one_get_a_large_one_in_ranges_a_missing_one_is_not_found(proxy, s3_root, s3_options):
    """Manifests, `.metadata` and events: one ranged GET each (no HEAD first), empty ones
    too; a file past the first GET's 8 MiB goes to the parallel reader; none: NotFound."""
    store = through(proxy, s3_root, s3_options)
    small, big = payload(3000), payload(9 * MiB)
    for name, data in (("small", small), ("empty", b""), ("big", big)):
        store.put_atomic(name, data)
    proxy.seen.clear()
    assert store.read_bytes("small") == small and store.read_bytes("empty") == b""
    assert dict(proxy.seen) == {"range": 2}
    proxy.seen.clear()
    assert store.read_bytes("big") == big
    assert proxy.seen["head"] == 1 and proxy.seen["range"] >= 2
    with pytest.raises(NotFound):
        store.read_bytes("missing")
    proxy.fail("range", "truncate")  # a body cut short is read again
    proxy.failed.clear()
    assert store.read_bytes("small") == small
    assert proxy.failed["range"] == 1


def test_objects_a_store_refuses_to_delete_fail_retention_loudly_and_nothing_is_taken_for_committed(proxy, s3_root, s3_options, caplog):
    """DeleteObjects answers 200 and lists the keys it did not delete (a bucket policy, an
    object lock). Retention says so, naming one; the save that ran it still commits; the
    checkpoint it was deleting has lost its manifest first, so it is never restored with
    files missing; and once the store deletes again, the next retention clears what was left."""
    import torch

    import ckpt

    model = torch.nn.Linear(64, 64)
    options = {**s3_options, "endpoint_url": proxy.url}
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False, keep=ckpt.Keep(last=1), storage_options=options)
    caplog.set_level(logging.WARNING, logger="ckpt")
    root = Store(s3_root, s3_options)
    with ckpt.Checkpointer(s3_root, model=model, **kw) as cp:
        cp.step_done()
        cp.save(blocking=True)
        proxy.fail("deletes", *["deny"] * 100)
        cp.step_done()
        cp.save(blocking=True)
        assert cp.last_commit.step == 2
        assert "retention skipped: deleting" in caplog.text and "objects were not deleted" in caplog.text
        assert "AccessDenied" in caplog.text
        left = root.scan()
        assert sorted(left) == [1, 2] and not left[1].has_manifest and left[1].files  # debris, not a checkpoint
        proxy.fail("deletes")  # healthy again
        cp.step_done()
        cp.save(blocking=True)
    assert sorted(root.scan()) == [3]
    with ckpt.Checkpointer(s3_root, model=model, **kw) as cp:
        assert cp.restored_step == 3


def test_a_reader_told_the_size_sends_no_head_and_an_object_of_another_size_is_invalid(proxy, s3_root, s3_options):
    """A checkpoint's files are read with the manifest's sizes: the GETs go out at once (a
    HEAD first costs a round trip per file), and a file of another size, or none, says so."""
    store = through(proxy, s3_root, s3_options)
    data = payload(7 * MiB + 3)
    with store.open_write("f") as f:
        f.write(data)
    proxy.seen.clear()
    with store.open_read("f", size=len(data)) as f:
        assert f.read() == data
    assert proxy.seen["head"] == 0 and proxy.seen["range"] == 4  # 2 MiB ranges

    for said in (len(data) + 1, len(data) - 1, 9 * MiB):  # longer, shorter, past its end
        with pytest.raises(InvalidCheckpoint, match=rf"{len(data)} bytes, {said} expected"):
            with store.open_read("f", size=said) as f:
                f.read()
    with pytest.raises(InvalidCheckpoint, match=rf"fewer than {8 * MiB + 1} bytes, {9 * MiB} expected"):
        with store.open_read("f", [(8 * MiB, 9 * MiB)], size=9 * MiB) as f:  # a range it does not hold
            f.seek(8 * MiB)
            f.read()
    with pytest.raises(NotFound, match="missing does not exist"):
        with store.open_read("missing", size=10) as f:
            f.read()


def test_a_reader_told_the_size_refuses_an_object_replaced_while_it_reads(proxy, s3_root, s3_options):
    store = through(proxy, s3_root, s3_options, readahead=1)
    first, second = payload(6 * MiB), payload(6 * MiB)
    with store.open_write("f") as f:
        f.write(first)
    with pytest.raises(StorageError, match="PreconditionFailed|412"):
        with store.open_read("f", size=len(first)) as f:
            assert f.read(2 * MiB) == first[: 2 * MiB]  # its ETag is the one asked for from now on
            with store.open_write("f") as w:
                w.write(second)
            f.read()


def test_read_small_reads_a_file_up_to_its_limit_whole_and_no_more(proxy, s3_root, s3_options, tmp_path):
    for store in (through(proxy, s3_root, s3_options), Store(tmp_path)):
        data = payload(5000)
        store.put_atomic("x", data)
        assert store.read_small("x", 5000) == data and store.read_small("x", 9000) == data
        assert store.read_small("x", 4999) is None
        with pytest.raises(NotFound):
            store.read_small("missing", 10)


def test_a_wrong_size_told_costs_requests_never_bytes(store, s3_root, s3_endpoint):
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    data = payload(3 * PART)
    with store.open_write("more", size=PART) as f:  # told one part, given three
        f.write(data)
    with store.open_write("fewer", size=3 * PART) as f:  # told three parts, given a byte
        f.write(data[:1])
    assert store.read_bytes("more") == data and store.read_bytes("fewer") == data[:1]
    assert etag(s3_endpoint, bucket, f"{prefix}/more").endswith("-3")
    assert uploads_in_progress(s3_endpoint, bucket) == []


def test_one_put_never_carries_more_than_s3_takes(s3_root, s3_options):
    from ckpt.storage.s3_write import Upload
    from ckpt.storage.transfer import PUT_MAX

    big = Store(s3_root, s3_options, Transfer(part_size=3 << 30))
    assert Upload(big.backend.client, big.path("x"), "x")._one_put == PUT_MAX
    assert Upload(Store(s3_root, s3_options).backend.client, big.path("x"), "x")._one_put == 2 * Transfer().part_size


def test_a_put_the_caller_stopped_waiting_for_is_stopped_and_lets_go_of_its_buffers(proxy, s3_root, s3_options):
    """An interrupt while the one PUT is under way (here SIGALRM's handler raising, as ^C
    does): the request is cancelled, not left reading the caller's memory after the block."""
    store = through(proxy, s3_root, s3_options)
    mm = mmap.mmap(-1, 2 * PART)
    mm[:] = payload(len(mm))
    view = memoryview(mm)
    proxy.delay_s = (1.5, 1.5)
    proxy.fail("put", "delay")

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            with store.open_write("x", size=len(mm)) as f:
                f.write(view)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    view.release()
    mm.close()  # BufferError if the PUT still held a view of it
