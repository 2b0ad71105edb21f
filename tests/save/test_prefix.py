"""A file's fixed first pieces gathered once and written again and again (ckpt.save.prefix): the
file is the one written piece by piece, with each save's bytes; a whole-file image is written
again without the page cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt.save.filewrite import write_file
from ckpt.storage.store import Store
from tests.support.writes import FILESYSTEMS, MB, prefix_pieces, segment


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_layout_written_again_from_its_gathered_prefix_is_the_file_written_piece_by_piece(tmp_path, direct):
    from ckpt.save.prefix import Prefixes

    seg = segment(16 * MB)
    pieces = prefix_pieces()
    rest = [b"pickled objects", (0, 9, 33)]
    store = Store(tmp_path)
    prefixes = Prefixes()
    prefixes.learn(7, pieces)
    for save in range(3):  # the arena's bytes change between saves: each write has the new ones
        seg[64 * 1024 : 64 * 1024 + 16] = f"save {save:11d}".encode()
        seg[12 * MB + 5 : 12 * MB + 21] = f"tail {save:11d}".encode()
        plain = write_file(store, f"plain-{save}", pieces + rest, {0: memoryview(seg)}, rank=1, direct=direct)
        got = prefixes.write(store, f"fixed-{save}", 7, rest, {0: memoryview(seg)}, rank=1)
        assert got == plain
        assert (tmp_path / f"fixed-{save}").read_bytes() == (tmp_path / f"plain-{save}").read_bytes()
    # the image holds the literal pieces and the unaligned ranges, not the page-aligned ones
    built = prefixes.get(7, {0: memoryview(seg)})
    assert built is not None and built.nbytes < 64 * 1024
    prefixes.drop()
    seg.close()  # nothing of the prefix holds the segment any more


@pytest.mark.parametrize("where", FILESYSTEMS)
def test_a_whole_file_image_writes_its_bytes_again_and_again_without_the_page_cache(tmp_path, where):
    from ckpt.format.checksum import checksum
    from ckpt.save.prefix import Image

    root = tmp_path if where == "tmp_path" else Path(where)
    data = os.urandom(3 * MB + 1234)  # not a whole number of pages: the tail is written buffered
    image = Image(data, "xxh3_64")
    store = Store(root / f"img-{os.getpid()}")
    try:
        for save in range(3):
            entry = image.write(store, f"step-{save}/.metadata")
            assert Path(store.path(f"step-{save}/.metadata")).read_bytes() == data
            assert (entry.size, entry.checksum, entry.rank) == (len(data), checksum(data), -1)
    finally:
        store.fs.rm(store.root, recursive=True)
