"""Which data file holds which piece of each value, in a few bytes per key (issue 40), so a
restore on another world size reads the indexes of the files it loads from, and no others.

`.metadata` lists every piece of every tensor (O(tensors × ranks)); a rank that restores on
another world size needs the entries of the few saving ranks whose pieces overlap its own.
Rank 0 writes each key's layout in `.index`'s planner_data:

    int              a value held whole in one file (the file's number in `files`)
    ()               a tensor with no piece (no element): nothing to read
    (dims, cells)    a tensor cut along a grid. `dims`, per dimension: a tuple
                     `(chunk, count)`, piece i starting at i * chunk (an even split, DCP's
                     and FSDP's; the last piece clipped), or a list of the pieces' offsets.
                     `cells`, the file of each cell in row-major order: a tuple
                     `(first, step)`, cell i in file first + i * step, or a list of file
                     numbers (-1: no piece there, an empty shard)

A family of per-rank values (`rng.rank_7.torch`: rank 7's, in rank 7's file) is one entry of
`ranked`, its name with `rank_*`, whatever the world size. A key whose pieces are not such a
grid has no layout: a rank that loads it reads `.metadata`.
Plain ints, tuples, lists and strings only: `.index` unpickles through `.metadata`'s
allowlist. A layout only picks which indexes to read: `ckpt.restore.partial` still checks
that what they hold covers every piece a rank loads.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["LAYOUT", "PER_RANK", "Budget", "checked_layout", "files_for", "layout_of"]

LAYOUT = "ckpt.layout"
Piece = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes
Dim = tuple[int, int] | list[int]
# ckpt's per-rank values (rng.rank_3, loader.rank_3, extra.<name>.rank_3): held once, loaded
# by their own rank only, from its own file.
PER_RANK = re.compile(r"(^|\.)rank_(\d+)(\.|$)")
# Cells a rank may look up for one piece, and for a whole restore (`Budget`): more means a
# layout no save writes (a hostile one). A grid of more cells than this is not a layout.
_MAX_CELLS = 1 << 16
_BUDGET = 1 << 20
_MAX_GRID = 1 << 22
_MAX_INT = 1 << 62  # an offset, a size, a chunk


def layout_of(md: Metadata) -> dict[str, Any]:
    """The layout of every key of a whole metadata (rank 0, at a save)."""
    held: dict[str, dict[tuple[int, ...], str]] = {}
    for index, info in md.storage_data.items():
        held.setdefault(index.fqn, {})[tuple(index.offset or ())] = info.relative_path
    files = sorted({info.relative_path for info in md.storage_data.values()}, key=_natural)  # rank order: runs
    number = {name: i for i, name in enumerate(files)}
    keys: dict[str, Any] = {}
    ranked: dict[str, bool] = {}  # each family: is every member in its own rank's file?
    for fqn, entry in md.state_dict_metadata.items():
        where = {offsets: number[name] for offsets, name in held.get(fqn, {}).items()}
        rank = PER_RANK.search(fqn)
        if rank is not None:
            own = len(where) == 1 and next(iter(where.values())) == number.get(f"__{rank.group(2)}_0.distcp")
            ranked[_family(fqn, rank)] = ranked.get(_family(fqn, rank), True) and own
        if not isinstance(entry, TensorStorageMetadata):
            if len(where) == 1:
                keys[fqn] = next(iter(where.values()))
            continue
        pieces = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if math.prod(c.sizes)]  # an empty one holds nothing
        if all(p[0] in where for p in pieces) and len({p[0] for p in pieces}) == len(pieces):
            spec = _grid(tuple(entry.size), pieces, where)
            if spec is not None:
                keys[fqn] = spec
    families = sorted(f for f, own in ranked.items() if own)
    keys = {k: v for k, v in keys.items() if not ((m := PER_RANK.search(k)) and _family(k, m) in families)}
    return {"files": files, "keys": keys, "ranked": families}


def _grid(size: tuple[int, ...], pieces: list[Piece], file_at: dict[tuple[int, ...], int]) -> Any:
    """A tensor's layout, or None where its pieces are not the cells of a grid."""
    if not pieces:
        return ()
    if len(pieces) == 1 and pieces[0] == ((0,) * len(size), size):
        return file_at[pieces[0][0]]
    dims: list[Dim] = []
    for d, n in enumerate(size):
        starts = sorted({offsets[d] for offsets, sizes in pieces})
        step = starts[1] - starts[0] if len(starts) > 1 else n
        even = starts[0] == 0 and step > 0 and all(s == i * step for i, s in enumerate(starts))
        dims.append((step, len(starts)) if even else starts)
    grid = math.prod(_count(dim) for dim in dims)
    if grid > 2 * len(pieces) or grid > _MAX_GRID:  # a grid has a few holes at most (empty shards)
        return None
    cells = [-1] * grid
    for offsets, sizes in pieces:
        at = [_first(dim, o) for dim, o in zip(dims, offsets, strict=True)]
        bounds = [_span(dim, i, n) for dim, i, n in zip(dims, at, size, strict=True)]
        if any(o != lo or s != hi - lo for o, s, (lo, hi) in zip(offsets, sizes, bounds, strict=True)):
            return None  # a piece that is not exactly one cell
        cells[_row_major(dims, at)] = file_at[offsets]
    step = cells[1] - cells[0] if len(cells) > 1 else 0
    if all(f == cells[0] + i * step for i, f in enumerate(cells)):
        return (tuple(dims), (cells[0], step))
    return (tuple(dims), cells)


class Budget:
    """The cells `files_for` may still look up in one restore."""

    def __init__(self, cells: int = _BUDGET) -> None:
        self.cells = cells


def checked_layout(layout: Any) -> dict[str, Any] | None:
    """`layout` if it is one `layout_of` could have written (its types and ranges), else None:
    read from storage, it may be anything whose checksum the manifest holds."""
    if not isinstance(layout, dict):
        return None
    files, keys, ranked = layout.get("files"), layout.get("keys"), layout.get("ranked", [])
    if not (type(files) is list and all(type(f) is str for f in files) and type(keys) is dict):
        return None
    if not (type(ranked) is list and all(type(r) is str for r in ranked)):
        return None
    n = len(files)
    return layout if all(type(fqn) is str and _valid(spec, n) for fqn, spec in keys.items()) else None


def _valid(spec: Any, files: int) -> bool:
    if type(spec) is int:
        return 0 <= spec < files
    if spec == ():
        return True
    if not (type(spec) is tuple and len(spec) == 2 and type(spec[0]) is tuple):
        return False
    dims, cells = spec
    grid = 1
    for dim in dims:
        if type(dim) is tuple:
            ok = len(dim) == 2 and all(type(x) is int for x in dim) and 1 <= dim[0] <= _MAX_INT and 1 <= dim[1] <= _MAX_GRID
        else:
            ok = type(dim) is list and 0 < len(dim) <= _MAX_GRID and all(type(x) is int and 0 <= x <= _MAX_INT for x in dim) and dim == sorted(set(dim))
        if not ok:
            return False
        grid *= _count(dim)
        if grid > _MAX_GRID:
            return False
    if type(cells) is tuple:
        return len(cells) == 2 and all(type(x) is int for x in cells) and 0 <= cells[0] < files and 0 <= cells[0] + cells[1] * (grid - 1) < files
    return type(cells) is list and len(cells) == grid and all(type(f) is int and -1 <= f < files for f in cells)


def files_for(layout: dict[str, Any], fqn: str, pieces: Iterable[Piece], budget: Budget | None = None) -> set[str] | None:
    """The data files that hold the parts of `pieces` of `fqn` (for a value that is not a
    tensor, no `pieces`: where it is), or None where the layout does not say (or `budget`
    ran out). Pieces with no element (an empty shard): the file of the key's first piece, whose
    index says what `fqn` is. `layout`: as `checked_layout` passed it."""
    spec = layout["keys"].get(fqn)
    files = layout["files"]
    pieces = [p for p in pieces if math.prod(p[1])]
    if spec is None:
        rank = PER_RANK.search(fqn)
        if rank is not None and _family(fqn, rank) in layout.get("ranked", ()):
            name = f"__{rank.group(2)}_0.distcp"
            return {name} if name in files else None
        return None
    if isinstance(spec, int):
        return {files[spec]}
    if spec == ():
        return set()
    dims, cells = spec
    if not pieces:  # the file of the first piece
        first = cells[0] if isinstance(cells, tuple) else next((f for f in cells if f >= 0), -1)
        return {files[first]} if first >= 0 else set()
    found: set[str] = set()
    for offsets, sizes in pieces:
        if len(offsets) != len(dims) or len(sizes) != len(dims):
            return None  # a tensor of another shape than the one saved
        ranges = [_overlapping(dim, o, o + s) for dim, o, s in zip(dims, offsets, sizes, strict=True)]
        cells_here = math.prod(len(r) for r in ranges)
        if cells_here > _MAX_CELLS or (budget is not None and cells_here > budget.cells):
            return None
        if budget is not None:
            budget.cells -= cells_here
        for cell in itertools.product(*ranges):
            i = _row_major(dims, list(cell))
            f = cells[0] + i * cells[1] if isinstance(cells, tuple) else cells[i]
            if f >= 0:
                found.add(files[f])
    return found


def _family(fqn: str, rank: re.Match[str]) -> str:
    return f"{fqn[: rank.start(2)]}*{fqn[rank.end(2) :]}"


def _natural(name: str) -> list[Any]:
    """`__2_0.distcp` before `__10_0.distcp`."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _count(dim: Dim) -> int:
    return dim[1] if isinstance(dim, tuple) else len(dim)


def _first(dim: Dim, offset: int) -> int:
    """The cell along `dim` that starts at or before `offset`."""
    if isinstance(dim, tuple):
        return min(offset // dim[0], dim[1] - 1)
    return max(bisect.bisect_right(dim, offset) - 1, 0)


def _span(dim: Dim, i: int, n: int) -> tuple[int, int]:
    """Where cell i along `dim` starts and ends, in a dimension of n."""
    if isinstance(dim, tuple):
        return i * dim[0], (min((i + 1) * dim[0], n) if i < dim[1] - 1 else n)
    return dim[i], (dim[i + 1] if i + 1 < len(dim) else n)


def _overlapping(dim: Dim, lo: int, hi: int) -> range:
    """The cells along `dim` that [lo, hi) overlaps (none if it is empty)."""
    if hi <= lo:
        return range(0)
    return range(_first(dim, lo), _first(dim, hi - 1) + 1)


def _row_major(dims: list[Dim] | tuple[Dim, ...], at: list[int]) -> int:
    i = 0
    for dim, j in zip(dims, at, strict=True):
        i = i * _count(dim) + j
    return i
