"""DCP's storage writer for ckpt: lays out each rank's file and hands the bytes to a sink.

The files are plain DCP (`__<rank>_0.distcp` and `.metadata`, the layout of DCP's own
FileSystemWriter), so `torch.distributed.checkpoint.load` reads them without ckpt: each
tensor is a torch.save archive and each other object a pickle, at the offset `.metadata`
records. What differs is who writes them. For a tensor staged in the arena, the archive's
header and trailer come from a template made once per dtype and shape
(`torch.serialization.skip_data`), and its data is named by arena range, not copied or
serialized; the sink (the writer process) writes the pieces, checksums them and makes the
file durable before `dcp.save` returns. Large tensors start on a page of the file, so the
writer can move them to disk with O_DIRECT. Tensors outside the arena (a save streamed from
live state) are torch.save'd here, as DCP would. Tensors come first in the file and pickled
objects after them, so that a pickle which grows between saves moves no tensor: the next save
can reuse this layout without DCP's planning (ckpt.save.resave).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckpt._faults import fault_point
from ckpt.format.dcp_index import SHARED_INDEX, index_name, own_part, shared_part
from ckpt.format.index_file import encode_index
from ckpt.format.manifest import METADATA_NAME, FileEntry
from ckpt.save.arena import PAGE, Arena
from ckpt.save.filewrite import Fixed, Piece, piece_len
from ckpt.save.prefix import Image
from ckpt.save.writer_proc import Segment
from ckpt.storage.store import Store

DATA_SUFFIX = ".distcp"
_ALIGN_FROM = 256 << 10  # tensors this large start on a page of the file
_ZEROS = bytes(PAGE)
_JOIN_UP_TO = 4 << 10  # adjacent literal pieces are joined up to this many bytes


class Sink(Protocol):
    def write(
        self, rel: str, pieces: list[Piece], segments: Sequence[Segment], rank: int, step: int, fixed: Fixed | None = None,
        gate_fd: int | None = None,
    ) -> FileEntry: ...  # fmt: skip


class Planner(DefaultSavePlanner):
    """DCP's default save planner (its plans cached), whose global metadata goes to no other
    rank. DCP's save ends by sending rank 0's result, the whole global metadata, to every rank
    (`_DistWrapper.all_reduce`): one entry per piece of every tensor, 3 GB for a 70B model over
    10,000 ranks, pickled once more on rank 0 and unpickled by each rank, which does nothing
    with it. Here it pickles as an empty `Metadata`; `Writer.finish` writes the real one."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, md = super().create_global_plan(all_plans)
        return plans, _Unsent(**{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)})


class _Unsent(Metadata):
    """Rank 0's global metadata, which pickles as an empty one (`Planner`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Metadata, ({},))


def plain(md: Metadata) -> Metadata:
    """`md` as DCP's own `Metadata` (an `_Unsent` would pickle as an empty one)."""
    return md if type(md) is Metadata else Metadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)})


class Writer(StorageWriter):
    """Writes one rank's items into `<step dir>/__<rank>_0.distcp`; rank 0 also `.metadata`.

    After `dcp.save` returns, `files` holds what this rank wrote, for the manifest.
    """

    def __init__(
        self, store: Store, step_dir: str, step: int, sink: Sink, arenas: Sequence[Arena] = (),
        staged: Callable[[], None] | None = None, indexed: bool = False,
    ) -> None:  # fmt: skip
        """`staged` waits for the staging copies still being made (raising if one failed);
        `indexed`: write the index files too (a job of several ranks: `ckpt.format.dcp_index`)."""
        super().__init__()
        self.indexed = indexed
        self.staged = staged
        self.store = store
        self.step_dir = step_dir
        self.step = step
        self.sink = sink
        self.arenas = list(arenas)
        self.files: dict[str, FileEntry] = {}
        self.rank = 0
        self.data_name = ""
        # What the data file looked like, for saving the same layout again (resave.Layout):
        # None when a tensor was not in an arena (its bytes, not its place, were laid out).
        self.tensor_part: tuple[list[Piece], int] | None = None
        self.bytes_items: list[WriteItem] = []
        self.metadata: Metadata | None = None  # rank 0, once finished, and its pickle:
        self.metadata_image: Image | None = None
        self.index: Metadata | None = None  # this rank's index (`ckpt.format.dcp_index`)
        self.asked: list[WriteItem] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.asked = list(plan.items)  # before DCP keeps one copy of each replicated piece: for the index
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.data_name = name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
        if self.staged is not None:
            self.staged()  # a failed copy fails the save here, where DCP tells every rank
        layout = FileLayout()
        results: list[WriteResult] = []
        # Tensors first, then the pickled objects: a pickle that grows from one save to the
        # next (a step counter) moves no tensor, so the next save can reuse this layout.
        # Small tensors lead: those another rank may need (a replicated scalar that DCP saved
        # once, in this file) then lie in the file's first checksum block, which that rank
        # reads and verifies without the rest.
        tensors = sorted(
            (it for it in plan.items if it.type != WriteItemType.BYTE_IO), key=lambda it: _nbytes(it) >= _ALIGN_FROM
        )
        self.bytes_items = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        located = True
        for item in tensors:
            fault_point("write_item", self.rank, self.step)
            offset, length, found = self._add_tensor(layout, planner.resolve_data(item).detach())
            located &= found
            results.append(written(item, name, offset, length))
        self.tensor_part = (list(layout.pieces), layout.size) if located else None
        for item in self.bytes_items:
            fault_point("write_item", self.rank, self.step)
            offset, length = layout.add([bytes(planner.resolve_data(item).getbuffer())])
            results.append(written(item, name, offset, length))
        self.files[name] = write_file(self.sink, f"{self.step_dir}/{name}", layout, self.arenas, self.rank, self.step)
        if self.indexed:
            self.index = own_part(plan.items, {r.index: r.storage_data for r in results}, self.asked)
            self.files.update(write_index(self.store, self.step_dir, name, self.index, self.rank))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _add_tensor(self, layout: FileLayout, tensor: torch.Tensor) -> tuple[int, int, bool]:
        """Lays out one tensor; the flag says it was found in an arena."""
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        where = next((w for a in self.arenas if (w := a.locate(tensor)) is not None), None)
        if where is None:
            buf = io.BytesIO()
            torch.save(tensor, buf)
            return (*layout.add([buf.getvalue()]), False)
        head, tail = _template(tensor.dtype, tuple(tensor.shape))
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= _ALIGN_FROM:
            layout.pad_to_page(len(head))
        return (*layout.add([head, (*where, nbytes), tail]), True)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata = plain(metadata)  # IMPORTANT: what `.metadata` holds is all of it
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        # Nothing that names this save or its directory: the same layout pickles to the same
        # bytes save after save, and a copied checkpoint does not point back at its origin.
        metadata.storage_meta = self.storage_meta()
        self.metadata, self.metadata_image = metadata, Image(pickle.dumps(metadata), self.store.checksum_algo)
        # Rank 0: DCP's global `.metadata`, written once every rank's data file is durable.
        self.files[METADATA_NAME] = self.metadata_image.write(self.store, f"{self.step_dir}/{METADATA_NAME}")
        if self.indexed:
            self.files.update(write_index(self.store, self.step_dir, SHARED_INDEX, metadata))

    def storage_meta(self) -> StorageMeta:
        return StorageMeta()

    @property
    def checkpoint_id(self) -> str:
        return self.step_dir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def write_index(store: Store, step_dir: str, name: str, md: Metadata, rank: int = -1) -> dict[str, FileEntry]:
    """A part of `.metadata` a restore can read alone (`ckpt.format.dcp_index`): beside the
    data file `name`, rank `rank`'s index `md`; as `.index` (`name`), the shared part of the
    whole metadata `md` (rank 0)."""
    rel, part = (name, shared_part(md)) if name == SHARED_INDEX else (index_name(name), md)
    entry = Image(encode_index(part), store.checksum_algo).write(store, f"{step_dir}/{rel}")
    return {rel: dataclasses.replace(entry, rank=rank)}


def _nbytes(item: WriteItem) -> int:
    """The bytes of the (local part of the) tensor an item writes."""
    data = item.tensor_data
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize if data is not None else 0


def written(item: WriteItem, name: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))


def write_file(
    sink: Sink, rel: str, layout: FileLayout, arenas: Sequence[Arena], rank: int, step: int,
    gate: Callable[[], int | None] | None = None,
) -> FileEntry:  # fmt: skip
    """Has the sink write a laid-out data file, durably; its checksum comes back. `gate`
    gives the file descriptor that tells how far the staging copies have come, if they are
    still being made (`ckpt.save.copier`): the sink takes it over."""
    segments = [s for a in arenas for s in a.segments.values()]
    entry = sink.write(rel, layout.pieces, segments, rank, step, layout.fixed, gate() if gate is not None else None)
    if entry.size != layout.size:  # IMPORTANT: the offsets in .metadata must be the file's
        raise OSError(f"{rel}: {entry.size} bytes written, {layout.size} laid out")
    return entry


class FileLayout:
    """The pieces of one file in order, and where each item lands."""

    def __init__(self, pieces: list[Piece] | None = None, size: int = 0) -> None:
        self.pieces: list[Piece] = pieces if pieces is not None else []
        self.size = size
        self.fixed: Fixed | None = None  # set by a layout saved again (ckpt.save.resave)

    def add(self, parts: list[Piece]) -> tuple[int, int]:
        offset = self.size
        for p in parts:
            last = self.pieces[-1] if self.pieces else None
            if isinstance(p, bytes) and isinstance(last, bytes) and len(last) + len(p) <= _JOIN_UP_TO:
                # One trailer and the next header: the writer handles pieces one by one, and a
                # state of many small tensors is mostly these.
                self.pieces[-1] = last + p
            else:
                self.pieces.append(p)
            self.size += piece_len(p)
        return offset, self.size - offset

    def pad_to_page(self, head: int) -> None:
        """Zeros so that an item whose data follows a `head`-byte header has its data on a
        page: DCP finds items by offset, so the gap is never read."""
        pad = -(self.size + head) % PAGE
        if pad:
            self.add([_ZEROS[:pad]])


@functools.lru_cache(maxsize=4096)
def _template(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """What torch.save writes before and after the data of a contiguous tensor of this dtype
    and shape. The data's bytes are skipped, so the archive's CRC of them is not theirs:
    torch.load does not check it; the manifest's checksum covers the whole file."""
    tensor = torch.empty(shape, dtype=dtype)  # never touched: no memory is committed
    buf = io.BytesIO()
    with torch.serialization.skip_data():
        torch.save(tensor, buf)
    blob = buf.getvalue()
    reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    record = next(r for r in reader.get_all_records() if r.rsplit("/", 2)[-2:] == ["data", "0"])
    start = reader.get_record_offset(record)
    end = start + tensor.numel() * tensor.element_size()
    return blob[:start], blob[end:]
