"""Saving the same layout again, without DCP's per-save planning.

From one save to the next, the staged state has the same layout: the same staging buffers
(the very same tensor objects, at the same arena ranges) under the same keys. `dcp.save`
plans every save from scratch all the same: it flattens the state dict, makes a write item
and tensor metadata for each tensor, gathers and scatters the plans over the ranks and
pickles a `.metadata` that is the last one's, byte for byte. With 10,000 tensors that is
about half a second of Python per save, on a host where the trainer needs the CPU.

A `Layout` remembers what a save planned by DCP wrote. On each rank: the data file's tensor
part (headers, arena ranges and padding, at fixed offsets) and which small objects were
pickled after it; on rank 0, the global metadata. A later save whose staged state has the
same shape on every rank (`shape_of`: the same keys, the same tensor objects) writes the
same file from it, pickling only the small objects again; rank 0 re-pickles the metadata
only when one of those objects changed size. The files are the ones `dcp.save` would have
written, so they load with plain `dcp.load`.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import operator
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckpt._faults import fault_point
from ckpt._gc import gc_paused
from ckpt.capture.state import ATOMS
from ckpt.format.dcp_index import SHARED_INDEX, index_name, shared_part
from ckpt.format.index_file import encode_index
from ckpt.format.manifest import METADATA_NAME, FileEntry
from ckpt.save.arena import Arena
from ckpt.save.dcp_write import FileLayout, Sink, Writer, write_file
from ckpt.save.filewrite import GATE_OPEN, piece_len
from ckpt.save.prefix import Image
from ckpt.save.stage import _MEMO_PATHS, Pair, tensor_bytes
from ckpt.storage.store import Store

# Where a rank's pickled objects landed in its file this save, sent to rank 0 for `.metadata`
# (their sizes can change from save to save).
Placed = dict[MetadataIndex, _StorageInfo]
# A layout's fixed pieces are sent to the writer once, under a key unique in the process.
_keys = itertools.count()


_NESTED = (dict, list, tuple, torch.Tensor, ShardedTensor)


def shape_of(obj: Any, known: dict[int, Any] | None = None, path: tuple[Any, ...] = ()) -> Any:
    """Everything DCP's plan depends on: the nesting and keys, each tensor by identity
    (staging buffers are reused objects) and each other leaf by type. A list of plain
    values is one leaf, as it is one pickled item to DCP. `known`: the shapes of subtrees
    the stager memoizes (stage._MEMO_PATHS) by the id of their staged dict, which the
    stager hands back, unchanged, as that very object while its source is unchanged."""
    if isinstance(obj, dict):
        if known is not None and path in _MEMO_PATHS and id(obj) in known:
            return known[id(obj)]
        return tuple((k, shape_of(v, known, (*path, k))) for k, v in obj.items())
    if isinstance(obj, (torch.Tensor, ShardedTensor)):
        return id(obj)
    if isinstance(obj, tuple) or (isinstance(obj, list) and _any_nested(obj)):
        return (type(obj), tuple(shape_of(v, known, (*path, i)) for i, v in enumerate(obj)))
    return type(obj)


def _any_nested(values: list[Any]) -> bool:
    """Whether a list holds anything but plain values: by the set of its types, in C (an
    optimizer's param_groups list one name per parameter; 0.1 ms for 10,000 of them, not 1.6)."""
    return any(issubclass(t, _NESTED) for t in set(map(type, values)))


def _memoized_shapes(staged: Any) -> dict[int, Any]:
    """The shapes of `staged`'s memoized subtrees, by the id of their dict."""
    known = {}
    for path in _MEMO_PATHS:
        sub = staged
        for key in path:
            sub = sub.get(key) if isinstance(sub, dict) else None
        if isinstance(sub, dict):
            known[id(sub)] = shape_of(sub)
    return known


def _real_path(root: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys of a DCP object path (where DCP made every dict key a string) as they are."""
    real, cur = [], root
    for part in path:
        if isinstance(cur, dict):
            keys = [part] if part in cur else [k for k in cur if str(k) == part]
            if len(keys) != 1:
                return None
            part = keys[0]
        real.append(part)
        cur = cur[part]
    return tuple(real)


_SAVED_MAX = 1 << 20  # a larger pickle is not kept from save to save
# Staging copies in the order of the file (`Layout.copy_order`): smaller ones are made first,
# all in one batch (the file's small tensors lead it); then batches from this size, doubling
# up to the last: the writer starts on the first batch while the copies go on.
_ORDERED_FROM = 256 << 10
_FIRST_BATCH = 4 << 20
_BATCH_MAX = 64 << 20  # ... or a 48th of the bytes: the marks of a save's batches are few


def _plain(obj: Any, depth: int = 0) -> bool:
    """Made of the stager's atoms (Python's own immutable scalars), lists, tuples and dicts
    alone (their exact types), whose pickle is all there is to them."""
    t = type(obj)
    if t in ATOMS:
        return True
    if depth > 32:
        return False
    if t is list or t is tuple:
        return ATOMS.issuperset(map(type, obj)) or all(_plain(v, depth + 1) for v in obj)
    if t is dict:
        return ATOMS.issuperset(map(type, obj)) and all(_plain(v, depth + 1) for v in obj.values())
    return False


def _element(root: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


@dataclasses.dataclass
class Layout:
    """One rank's data file as a planned save laid it out, and on rank 0 the metadata."""

    generation: int  # the planned save it came from: the same on every rank
    staged: Any  # IMPORTANT: held so that the tensor ids in `shape` (and `known`) are never reused
    shape: Any
    known: dict[int, Any]  # shape_of's memoized subtrees of `staged`
    name: str  # the data file, relative to the step directory
    tensor_pieces: list[Any]
    tensor_size: int
    objects: list[tuple[MetadataIndex, tuple[Any, ...]]]  # pickled after the tensors
    metadata: Metadata | None = None
    metadata_image: Image | None = dataclasses.field(default=None, repr=False)  # its pickle, page-aligned
    index: Metadata | None = None  # this rank's index (`ckpt.format.dcp_index`), and its pickle
    index_image: Image | None = dataclasses.field(default=None, repr=False)
    shared_image: Image | None = dataclasses.field(default=None, repr=False)  # rank 0: `.index`
    # An object pickled after the tensors holds a tensor (a tuple of them, which DCP does
    # not look into): its staging copies are made before it is pickled (`ckpt.save.commit`).
    objects_hold_tensors: bool = False
    key: int = dataclasses.field(default_factory=lambda: next(_keys))
    # By object: its plain pickle and torch.save bytes at the last save (see `_saved`).
    saved: dict[MetadataIndex, tuple[bytes, bytes]] = dataclasses.field(default_factory=dict, repr=False)

    # The last copy order worked out: the copies' buffers (by id), their batches, the rest.
    _order: tuple[tuple[int, ...], list[tuple[int, list[int]]], list[int]] | None = dataclasses.field(default=None, repr=False)

    @gc_paused  # in the background, but a collection it set off would hold the trainer's GIL
    def fits(self, staged: Any) -> bool:
        return shape_of(staged, self.known) == self.shape

    def write(
        self, sink: Sink, step_dir: str, staged: Any, arenas: list[Arena], rank: int, step: int,
        gate: Callable[[], int | None] | None = None,
    ) -> tuple[FileEntry, Placed]:  # fmt: skip
        """This rank's data file for `staged` (which `fits`), durable on return; `gate`, see
        `dcp_write.write_file` (for copies made in the order of `copy_order`)."""
        layout, placed = self._lay_out(staged)
        fault_point("write_item", rank, step)
        return write_file(sink, f"{step_dir}/{self.name}", layout, arenas, rank, step, gate), placed

    def copy_order(self, pairs: list[Pair], arenas: list[Arena]) -> tuple[list[tuple[int, list[Pair]]], list[Pair]]:
        """The staging copies `pairs` of a state that `fits`, in batches in the order this
        layout's file needs them, each with the file position before which every arena byte
        is staged once it and the batches before it are made (the last: GATE_OPEN); and the
        large copies this file does not hold (DCP saves a replicated tensor in one rank's
        file only). Worked out once for the same buffers (held by `staged`, so their ids
        stay theirs)."""
        ids = tuple(map(id, map(operator.itemgetter(0), pairs)))
        if self._order is None or self._order[0] != ids:
            self._order = (ids, *self._batches(pairs, arenas))
        _, batches, rest = self._order
        return [(mark, [pairs[i] for i in idx]) for mark, idx in batches], [pairs[i] for i in rest]

    def _batches(self, pairs: list[Pair], arenas: list[Arena]) -> tuple[list[tuple[int, list[int]]], list[int]]:
        places, pos = {}, 0  # arena place -> file position, of the tensor part's arena ranges
        for piece in self.tensor_pieces:
            if not isinstance(piece, bytes):
                places[piece[:2]] = pos
            pos += piece_len(piece)
        first: list[int] = []  # small: made before the others
        rest: list[int] = []  # large, not in the file
        ordered: list[tuple[int, int, int]] = []  # (file position, bytes, index)
        for i, (dst, _) in enumerate(pairs):
            n = dst.numel() * dst.element_size()
            if n < _ORDERED_FROM:
                first.append(i)
                continue
            where = next((w for a in arenas if (w := a.locate(dst)) is not None), None)
            at = places.get(where) if where is not None else None
            if at is None:
                rest.append(i)
            else:
                ordered.append((at, n, i))
        ordered.sort()
        batches: list[tuple[int, list[int]]] = []
        idx, size, target = first, 0, _FIRST_BATCH
        most = max(_BATCH_MAX, sum(n for _, n, _ in ordered) // 48)  # at most ~60 batches
        for at, n, i in ordered:
            if size >= target:  # everything before `at` is in the batches so far
                batches.append((at, idx))
                idx, size, target = [], 0, min(2 * target, most)
            idx.append(i)
            size += n
        batches.append((GATE_OPEN, idx))
        return batches, rest

    @gc_paused
    def _lay_out(self, staged: Any) -> tuple[FileLayout, Placed]:
        layout = FileLayout(list(self.tensor_pieces), self.tensor_size)
        # The last tensor piece may be joined with the first object's pickle (FileLayout.add).
        layout.fixed = (self.key, max(0, len(self.tensor_pieces) - 1))
        placed: Placed = {}
        for index, path in self.objects:
            offset, length = layout.add([self._saved(index, _element(staged, path))])
            placed[index] = _StorageInfo(self.name, offset, length)
        return layout, placed

    def _saved(self, index: MetadataIndex, obj: Any) -> bytes:
        """`torch.save` of `obj`, as DCP's planner writes a non-tensor. A value of plain types
        whose pickle is the last save's gets the last save's bytes (torch.save's output is a
        function of the pickle): an optimizer's param_groups are a dozen such items that
        rarely change, and torch.save costs 0.15 ms each here, pickle.dumps a few µs."""
        key = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if _plain(obj) else None
        last = self.saved.get(index)
        if key is not None and last is not None and last[0] == key:
            return last[1]
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        if key is not None and len(key) <= _SAVED_MAX:
            self.saved[index] = (key, data)
        else:
            self.saved.pop(index, None)
        return data

    def write_index(self, store: Store, step_dir: str, placed: Placed, rank: int) -> dict[str, FileEntry]:
        """This rank's index beside its data file (its pickled objects as `placed`), if the
        planned save wrote one."""
        if self.index is None:
            return {}
        moved = {i: info for i, info in placed.items() if self.index.storage_data.get(i) != info}
        if moved or self.index_image is None:
            self.index.storage_data.update(moved)
            self.index_image = Image(encode_index(self.index), store.checksum_algo)
        name = index_name(self.name)
        return {name: dataclasses.replace(self.index_image.write(store, f"{step_dir}/{name}"), rank=rank)}

    def write_metadata(self, store: Store, step_dir: str, placed: list[Placed]) -> dict[str, FileEntry]:
        """Rank 0, after every rank's data file is durable: `.metadata`, and `.index`."""
        assert self.metadata is not None
        moved = {i: info for p in placed for i, info in p.items() if self.metadata.storage_data.get(i) != info}
        if moved or self.metadata_image is None or (self.index is not None and self.shared_image is None):
            self.metadata.storage_data.update(moved)
            self.metadata_image = Image(pickle.dumps(self.metadata), store.checksum_algo)
            if self.index is not None:
                self.shared_image = Image(encode_index(shared_part(self.metadata)), store.checksum_algo)
        files = {METADATA_NAME: self.metadata_image.write(store, f"{step_dir}/{METADATA_NAME}")}
        if self.index is not None:  # a job of several ranks (`Writer.indexed`)
            files[SHARED_INDEX] = self.shared_image.write(store, f"{step_dir}/{SHARED_INDEX}")
        return files


class Resaver:
    """The layout of the last save that DCP planned, kept between saves (one per Checkpointer)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.generation = 0

    def fitting(self, staged: Any) -> Layout | None:
        """The last layout, if `staged` fits it: its file can be written again."""
        return self.layout if self.layout is not None and self.layout.fits(staged) else None

    def learn(self, writer: Writer, mappings: dict[str, tuple[Any, ...]], staged: Any) -> None:
        """After a save planned by DCP (the last layout already forgotten): remember this
        one, unless a tensor of it was written from outside the arenas (nothing to point at
        next time) or an object cannot be found again by its path."""
        self.generation += 1
        if writer.tensor_part is None:
            return
        objects = []
        for item in writer.bytes_items:
            path = mappings.get(item.index.fqn)
            real = _real_path(staged, path) if path is not None else None
            if real is None:
                return
            objects.append((item.index, real))
        pieces, size = writer.tensor_part
        # The shape holds the memoized subtrees' shapes as the very objects `fits` looks up:
        # comparing them is then an identity check, not a walk of 10,000 entries (2 ms).
        known = _memoized_shapes(staged)
        self.layout = Layout(
            generation=self.generation,
            staged=staged,
            shape=shape_of(staged, known),
            known=known,
            name=writer.data_name,
            tensor_pieces=pieces,
            tensor_size=size,
            objects=objects,
            metadata=writer.metadata,
            metadata_image=writer.metadata_image,
            index=writer.index,
            objects_hold_tensors=any(tensor_bytes(_element(staged, path)) for _, path in objects),
        )
