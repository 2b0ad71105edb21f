"""Reading an S3 object (ckpt.storage.s3_read, through `Store.open_read` and `read_bytes`)
against a real S3-protocol server (moto), counted through the fault-injecting proxy: a reader
seeks and reads into buffers, fetches only what it was told it will read, sends no HEAD when
told the size and refuses an object of another size or one replaced while it reads; a small
file is one GET."""

from __future__ import annotations

import os

import pytest

from ckpt.errors import InvalidCheckpoint, NotFound, StorageError
from ckpt.storage.store import MiB, Store
from tests.support.s3 import (
    payload,
    read_in_odd_pieces,
    through,
)


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
        with pytest.raises(InvalidCheckpoint, match=rf"{len(data)} bytes, manifest says {said}"):
            with store.open_read("f", size=said) as f:
                f.read()
    with pytest.raises(InvalidCheckpoint, match=rf"fewer than {8 * MiB + 1} bytes, manifest says {9 * MiB}"):
        with store.open_read("f", [(8 * MiB, 9 * MiB)], size=9 * MiB) as f:  # a range it does not hold
            f.seek(8 * MiB)
            f.read()
    with pytest.raises(NotFound, match="missing: missing"):
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


@pytest.mark.parametrize(("stored", "said", "outcome"), [(b"i" * 300, 300, "read"), (b"i" * 301, 300, "InvalidCheckpoint"), (b"i" * 299, 300, "InvalidCheckpoint"), (b"i" * 300, 400, "passed")])
def test_a_small_file_read_early_is_read_whole_from_its_stream_or_said_to_be_of_another_size(proxy, s3_root, s3_options, stored, said, outcome):
    """A restoring rank's own index, begun as the manifest names it (`Store.read_early`): the
    read of it takes that stream, one GET in all; an object of another size than the manifest
    says fails as it is read; a file said to be larger than the read allows is read as before."""
    store = through(proxy, s3_root, s3_options)
    store.put_atomic("step/__1_0.index", stored)
    proxy.requests.clear()
    store.read_early("step/__1_0.index", said)
    if outcome == "InvalidCheckpoint":
        with pytest.raises(InvalidCheckpoint, match="__1_0.index"):
            store.read_small("step/__1_0.index", said)
    else:
        assert store.read_small("step/__1_0.index", 300) == stored
    assert store._early == {}
    if outcome == "read":
        assert [k for k, _ in proxy.requests] == ["range"]


def test_a_small_file_whose_early_get_failed_is_read_by_a_get_sent_again(proxy, s3_root, s3_options):
    """The store failed the early GET of a rank's index (an outage while the rank waited for
    `.index`), and serves again by the time the rank reads it: the read sends it again."""
    import concurrent.futures

    store = through(proxy, s3_root, s3_options, attempts=1)
    store.put_atomic("step/__1_0.index", b"i" * 300)
    proxy.requests.clear()
    proxy.fail("range", "500")
    store.read_early("step/__1_0.index", 300)
    stream = store._early["step/__1_0.index"][1]
    futures = [f for _, _, f in list(stream._ahead)]
    concurrent.futures.wait(futures, timeout=30)
    assert [f.exception() is not None for f in futures] == [True]  # it gave up
    assert store.read_small("step/__1_0.index", 300) == b"i" * 300
    assert [k for k, _ in proxy.requests] == ["range", "range"]


def test_an_empty_file_said_by_the_manifest_is_read_anew_so_that_a_missing_one_is_said(proxy, s3_root, s3_options):
    """A Reader of 0 bytes sends no request: an early stream of an empty file would hide that
    there is no such object (outside review). ckpt writes no empty index; a foreign manifest may say one."""
    store = through(proxy, s3_root, s3_options)
    store.read_early("step/__1_0.index", 0)
    with pytest.raises(NotFound):
        store.read_small("step/__1_0.index", 0)
    store.put_atomic("step/__1_0.index", b"")
    store.read_early("step/__1_0.index", 0)
    assert store.read_small("step/__1_0.index", 0) == b"" and store._early == {}
