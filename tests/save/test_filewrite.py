"""Writing one data file from its pieces (ckpt.save.filewrite): literal bytes and arena ranges
land in order with their block checksums, buffered or with O_DIRECT, on the test's ext4
directory and on /dev/shm's tmpfs (which has no O_DIRECT on older kernels); aligned ranges go
to the disk straight from shared memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from ckpt.save.filewrite import write_file
from ckpt.storage.store import Store
from tests.support.writes import FILESYSTEMS, MB, prefix_pieces, segment, takes_o_direct


@pytest.mark.parametrize("where", FILESYSTEMS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_pieces_land_in_order_with_their_checksum_on_any_filesystem(tmp_path, where, direct):
    root = tmp_path if where == "tmp_path" else Path(where)
    seg = segment(24 * MB)
    pieces = [
        b"header" * 50,  # unaligned literal, then an aligned arena run: goes through the bounce
        (0, 4096, 3 * MB + 5),
        b"",
        (0, 7, 4000),  # unaligned address
        b"\0" * (4096 - (300 + 3 * MB + 5 + 4000) % 4096),  # pad to a page
        (0, 8192, 18 * MB),  # aligned address and file offset: written without a copy
        (0, 0, 0),
        b"tail",
    ]
    want = b"".join(p if isinstance(p, bytes) else seg[p[1] : p[1] + p[2]] for p in pieces)
    store = Store(root / f"w-{os.getpid()}-{direct}")
    try:
        entry = write_file(store, "step-0000000001/__0_0.distcp", pieces, {0: memoryview(seg)}, rank=3, direct=direct)
        got = Path(store.path("step-0000000001/__0_0.distcp")).read_bytes()
    finally:
        store.fs.rm(store.root, recursive=True)
    assert got == want
    # 22 MB: blocks of 1 MiB, each with its own xxh3-64, the file's checksum that of theirs
    blocks = [xxhash.xxh3_64(want[i : i + MB]).hexdigest() for i in range(0, len(want), MB)]
    whole = xxhash.xxh3_64(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()
    assert (entry.size, entry.rank, entry.block, entry.blocks) == (len(want), 3, MB, tuple(blocks))
    assert entry.checksum == f"xxh3_64-blocks:{whole}"


@pytest.mark.parametrize("limits", [(64 << 10, 3, 16 << 10), (1 << 20, 512, 8 << 20)], ids=["tiny", "small"])
def test_direct_writes_queued_in_batches_land_in_order_whatever_the_batch(tmp_path, monkeypatch, limits):
    """O_DIRECT writes are queued and sent in batches (bytes, pieces), the bounce buffer's
    pages held until their batch is written: with tiny limits every flush path runs."""
    from ckpt.save import filewrite
    batch, iov, bounce = limits
    monkeypatch.setattr(filewrite, "_DIRECT_BATCH", batch)
    monkeypatch.setattr(filewrite, "_IOV_MAX", iov)
    monkeypatch.setattr(filewrite, "_BOUNCE", bounce)
    seg = segment(16 * MB)
    pieces = prefix_pieces() + [b"x" * 70000, (0, 8 * MB, 300000), b"y" * 5]  # more than a bounce buffer
    want = b"".join(p if isinstance(p, bytes) else seg[p[1] : p[1] + p[2]] for p in pieces)
    store = Store(tmp_path)
    if not takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: nothing to check here")
    direct = []
    finish = filewrite._DirectFile.finish
    monkeypatch.setattr(filewrite._DirectFile, "finish", lambda self: (direct.append(self), finish(self))[1])
    entry = write_file(store, "f", pieces, {0: memoryview(seg)}, rank=0)
    assert len(direct) == 1  # the O_DIRECT path wrote it
    assert (tmp_path / "f").read_bytes() == want
    plain = write_file(store, "g", pieces, {0: memoryview(seg)}, rank=0, direct=False)
    assert entry == plain  # the same checksums as the buffered path's


def test_direct_io_writes_aligned_tensors_straight_from_shared_memory(tmp_path, monkeypatch):
    import ckpt.save.filewrite as fw

    seen = []
    finish = fw._DirectFile.finish
    monkeypatch.setattr(fw._DirectFile, "finish", lambda self: (seen.append(self.zero_copy), finish(self))[1])
    seg = segment(8 * MB)
    head = b"h" * 700
    pieces = [head, b"\0" * (4096 - len(head)), (0, 0, 5 * MB + 100), b"tail"]
    if not takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: nothing to check here")
    write_file(Store(tmp_path), "f", pieces, {0: memoryview(seg)}, direct=True)
    assert seen == [5 * MB]
