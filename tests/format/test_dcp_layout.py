"""Where each piece of each value is (`ckpt.format.dcp_layout`): for every kind of layout a
save makes (FSDP's rows, tensor parallel's columns, a 2-D mesh, HSDP's copies spread over the
replicas, uneven splits, empty shards, whole values), the files a restore reads for any piece
it asks for are exactly the files whose pieces overlap it, checked against a brute force over
`.metadata`'s own entries; pieces that are not a grid have no layout, and a hostile layout
gives no answer rather than a long walk."""

from __future__ import annotations

import math
import pickle
import random

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.format.dcp_index import shared_part
from ckpt.format.dcp_layout import LAYOUT, Budget, checked_layout, files_for, layout_of
from ckpt.format.index_file import decode_index, encode_index

Piece = tuple[tuple[int, ...], tuple[int, ...]]


def even(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of n into `parts`: (offset, size), empty ones last."""
    step = -(-n // parts)
    return [(min(i * step, n), max(0, min(step, n - i * step))) for i in range(parts)]


def rows(size: tuple[int, ...], parts: int) -> list[Piece]:
    return [((o,) + (0,) * (len(size) - 1), (s,) + size[1:]) for o, s in even(size[0], parts)]


def cols(size: tuple[int, int], parts: int) -> list[Piece]:
    return [((0, o), (size[0], s)) for o, s in even(size[1], parts)]


def grid(size: tuple[int, int], a: int, b: int) -> list[Piece]:
    return [((r0, c0), (rs, cs)) for r0, rs in even(size[0], a) for c0, cs in even(size[1], b)]


# name -> (size, the pieces, the file of piece i), as the saves of each kind write them
LAYOUTS: dict[str, tuple[tuple[int, ...], list[Piece], list[int]]] = {
    "fsdp rows, 4 ranks": ((10, 3), rows((10, 3), 4), [0, 1, 2, 3]),
    "fsdp rows, empty shards at the end": ((3, 5), rows((3, 5), 4), [0, 1, 2, 3]),
    "fsdp rows of a vector": ((17,), rows((17,), 5), [0, 1, 2, 3, 4]),
    "tensor parallel columns": ((4, 9), cols((4, 9), 3), [0, 1, 2]),
    "fsdp x tp, a 2-D mesh": ((8, 6), grid((8, 6), 2, 3), [0, 1, 2, 3, 4, 5]),
    "2-D mesh, files in column order": ((8, 6), grid((8, 6), 2, 3), [0, 2, 4, 1, 3, 5]),
    "hsdp: each shard in one replica's file": ((12, 2), rows((12, 2), 3), [4, 1, 5]),
    "an uneven split": ((10, 2), [((0, 0), (3, 2)), ((3, 0), (1, 2)), ((4, 0), (6, 2))], [2, 0, 1]),
    "one piece, the whole": ((5, 5), [((0, 0), (5, 5))], [3]),
    "a scalar": ((), [((), ())], [1]),
    "no element": ((0, 4), [((0, 0), (0, 4))], [0]),
}

NOT_A_GRID = {
    "a piece over two cells": ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]),
    "a hole": ((6,), [((0,), (2,)), ((4,), (2,))]),
}


def _file(f: int) -> str:
    return f"__{f}_0.distcp"


def _md(tensors: dict[str, tuple[tuple[int, ...], list[Piece], list[int]]], values: dict[str, int] | None = None) -> Metadata:
    """`.metadata` as DCP writes it: equal pieces (the empty shards at the end) saved once;
    `values`: pickled values, in that file."""
    entries, storage = {}, {}
    for fqn, f in (values or {}).items():
        entries[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo(_file(f), 0, 80)
    for fqn, (size, pieces, files) in tensors.items():
        chunks: list[ChunkStorageMetadata] = []
        for (o, s), f in zip(pieces, files, strict=True):
            if (o, s) not in [(tuple(c.offsets), tuple(c.sizes)) for c in chunks[-1:]]:
                chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
                storage[MetadataIndex(fqn, chunks[-1].offsets, len(chunks) - 1)] = _StorageInfo(_file(f), 0, 100)
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    entries["optim.param_groups"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.param_groups")] = _StorageInfo(_file(2), 0, 80)
    return Metadata(entries, storage_data=storage)


def _overlap(a: Piece, b: Piece) -> int:
    return math.prod(max(0, min(ao + asz, bo + bsz) - max(ao, bo)) for ao, asz, bo, bsz in zip(*a, *b, strict=True))


def _brute(size: tuple[int, ...], pieces: list[Piece], files: list[int], ask: list[Piece]) -> set[str]:
    """The files whose pieces overlap what is asked (an ask of no element: any one piece's)."""
    found = {_file(f) for p, f in zip(pieces, files, strict=True) for a in ask if math.prod(a[1]) and _overlap(p, a)}
    if not any(math.prod(a[1]) for a in ask):
        held = [_file(f) for p, f in zip(pieces, files, strict=True) if math.prod(p[1])]
        return set(held[:1])
    return found


def _asks(size: tuple[int, ...], rng: random.Random) -> list[list[Piece]]:
    """What ranks ask for: the whole; a new world's rows (2 and 3 ranks); random boxes; an
    empty shard."""
    asks: list[list[Piece]] = [[((0,) * len(size), size)]]
    if size:
        asks += [[p] for parts in (2, 3, 7) for p in rows(size, parts)]
        for _ in range(20):
            lo = [rng.randrange(n + 1) for n in size]
            asks.append([(tuple(lo), tuple(rng.randrange(n - o + 1) for o, n in zip(lo, size, strict=True)))])
    return asks


def test_for_every_kind_of_layout_a_restore_reads_the_files_its_pieces_are_in_and_no_others():
    md = _md(LAYOUTS)
    layout = layout_of(md)
    rng = random.Random(0)
    for name, (size, pieces, files) in LAYOUTS.items():
        assert name in layout["keys"], name
        for ask in _asks(size, rng):
            assert files_for(layout, name, ask) == _brute(size, pieces, files, ask), (name, ask, layout["keys"][name])
    assert files_for(layout, "optim.param_groups", []) == {_file(2)}
    # the layout of an even split is a few numbers, whatever the ranks
    assert layout["keys"]["fsdp rows, 4 ranks"] == (((3, 4), (3, 1)), (0, 1))


def test_pieces_that_are_not_a_grid_have_no_layout_and_a_restore_then_reads_metadata():
    md = _md({name: (size, pieces, list(range(len(pieces)))) for name, (size, pieces) in NOT_A_GRID.items()})
    layout = layout_of(md)
    for name in NOT_A_GRID:
        assert name not in layout["keys"] and files_for(layout, name, [((0,), (1,))]) is None, name
    assert files_for(layout, "a key it never held", []) is None


def test_a_layout_stays_small_at_ten_thousand_ranks_and_reads_back_from_its_index():
    ranks = 10_000
    tensors = {f"layers.{i}.w": ((8192, 1024), rows((8192, 1024), ranks), list(range(ranks))) for i in range(4)}
    own = {f"rng.rank_{r}.{kind}": r for r in range(ranks) for kind in ("torch", "python.state")}  # each rank's, in its file
    md = _md(tensors, own)
    layout = layout_of(md)
    assert layout["ranked"] == ["rng.rank_*.python.state", "rng.rank_*.torch"]
    assert files_for(layout, "rng.rank_7.torch", []) == {_file(7)} and files_for(layout, f"rng.rank_{ranks}.torch", []) is None
    keys = pickle.dumps(layout["keys"])
    assert len(keys) < 1000, len(keys)  # per key: a handful of numbers, not one per rank
    index = encode_index(shared_part(md))
    assert len(index) < len(layout["files"]) * 20 + 4000, len(index)  # the files' names, and little else
    shared = decode_index(index, ".index")
    assert shared.planner_data[LAYOUT] == layout
    # an index written by an earlier ckpt, a pickle, reads back the same, through the allowlist
    assert decode_index(pickle.dumps(shared_part(md)), ".index").planner_data[LAYOUT] == layout
    # a rank of 1,000 restoring reads the ~10 files its rows are in
    want = rows((8192, 1024), 1000)[500]
    assert len(files_for(layout, "layers.0.w", [want])) <= 11


# What someone who can write the manifest too may put in `.index`'s layout: refused whole.
HOSTILE = {
    "huge counts": {"w": (((16, 10**300000), (4, 10**300000)), (0, 0))},
    "a chunk of zero": {"w": (((0, 4),), (0, 1))},
    "a negative file": {"w": -2},
    "a file past the list": {"w": 7},
    "cells running off the list": {"w": (((1, 4),), (0, 1))},
    "too few cells": {"w": (((1, 4),), [0, 0])},
    "unsorted offsets": {"w": (([3, 1],), [0, 0])},
    "a float": {"w": (((1.0, 2),), (0, 0))},
    "a bool for an int": {"w": True},
    "a grid of billions": {"w": (((1, 1 << 20), (1, 1 << 20)), (0, 0))},
    "a key that is not a string": {3: 0},
}


def test_a_layout_from_storage_is_checked_whole_and_a_hostile_one_is_no_layout():
    files = [_file(0), _file(1)]
    assert checked_layout(layout_of(_md(LAYOUTS))) is not None
    for case, keys in HOSTILE.items():
        assert checked_layout({"files": files, "keys": keys}) is None, case
    assert checked_layout({"files": files, "keys": {}, "ranked": "rng.rank_*.torch"}) is None  # a string, not a list
    assert checked_layout({"files": [b"__0_0.distcp"], "keys": {}}) is None
    assert checked_layout(["files"]) is None


def test_lookups_stop_at_a_budget_per_restore_and_a_tensor_of_another_shape_has_no_answer():
    """A valid layout of one cell-file for every cell, asked for whole tensors key after key:
    the lookups end at the restore's budget instead of walking them all."""
    layout = {"files": [_file(0)], "keys": {f"w{i}": (((1, 256), (1, 256)), (0, 0)) for i in range(100)}}
    assert checked_layout(layout) is layout
    budget = Budget(5 * 256 * 256)
    got = [files_for(layout, f"w{i}", [((0, 0), (256, 256))], budget) for i in range(10)]
    assert got[:5] == [{_file(0)}] * 5 and got[5:] == [None] * 5
    assert files_for(layout, "w0", [((0,), (256,))]) is None  # one dimension, where two were saved


def test_pieces_of_a_brick_wall_are_not_a_grid_and_cost_no_grid_of_their_own():
    rows = 2000  # row r cut after column r: 4,000 pieces, whose starts make a 2000 x 2001 grid
    pieces = [p for r in range(rows) for p in (((r, 0), (1, r + 1)), ((r, r + 1), (1, rows - r)))]
    md = _md({"wall": ((rows, rows + 1), pieces, [0] * len(pieces))})
    assert "wall" not in layout_of(md)["keys"]  # refused before a cell list of 4 million


def test_cells_in_row_major_order_match_every_piece():
    """A 3-D grid with files in a scrambled order: each cell is found where it is."""
    size = (4, 6, 5)
    pieces = [((a, b, c), (sa, sb, sc)) for a, sa in even(4, 2) for b, sb in even(6, 3) for c, sc in even(5, 2)]
    files = list(range(len(pieces)))
    random.Random(1).shuffle(files)
    layout = layout_of(_md({"t": (size, pieces, files)}))
    for p, f in zip(pieces, files, strict=True):
        assert files_for(layout, "t", [p]) == {_file(f)}
    assert files_for(layout, "t", [((0, 0, 0), size)]) == {_file(f) for f in files}


def test_a_per_rank_value_outside_its_ranks_file_keeps_its_own_entry():
    """A family is one entry only where each member is in its own rank's file."""
    md = _md({}, {"rng.rank_0.torch": 0, "rng.rank_1.torch": 0, "extra.s.rank_0": 0, "extra.s.rank_1": 1})
    layout = layout_of(md)
    assert layout["ranked"] == ["extra.s.rank_*"]
    assert layout["keys"]["rng.rank_1.torch"] == 0 and files_for(layout, "rng.rank_1.torch", []) == {_file(0)}
    assert files_for(layout, "extra.s.rank_1", []) == {_file(1)}
