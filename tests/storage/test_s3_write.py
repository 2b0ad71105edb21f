"""Writing an S3 object (ckpt.storage.s3_write, through `Store.open_write`) against a real
S3-protocol server (moto): every size round-trips byte for byte with s3fs on either side, parts
go out as soon as they are full and are let go of once sent, the caller's memory is sent by
reference and never held after the block, a failed or interrupted write leaves no object and no
upload, and the Checkpointer's transfer settings reach its writer process."""

from __future__ import annotations

import ctypes
import mmap
import signal

import pytest
import s3fs

from ckpt.errors import StorageError
from ckpt.storage.store import MiB, Store, Transfer
from tests.support.s3 import (
    PART,
    bucket_of,
    etag,
    payload,
    read_in_odd_pieces,
    through,
    uploads_in_progress,
)


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
    from ckpt.storage.s3_write import S3Upload
    from ckpt.storage.transfer import PUT_MAX

    big = Store(s3_root, s3_options, Transfer(part_size=3 << 30))
    assert S3Upload(big.backend.client, big.path("x"), "x")._one_put == PUT_MAX
    assert S3Upload(Store(s3_root, s3_options).backend.client, big.path("x"), "x")._one_put == 2 * Transfer().part_size


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
