"""DCP's storage reader for ckpt: restore reads every byte through the manifest's checksum.

The files are plain DCP (written by `ckpt.save.dcp_write`). Each data file this rank needs is read
once, front to back, through its checksums: the whole file, or of a large one the blocks that
hold this rank's items (the manifest has a checksum per block). Tensor data goes straight into
the tensors being restored, and pickled values are unpickled (with `weights_only=True`) only
after everything read of the file matched the manifest. A mismatch fails the restore, which
then falls back to an older checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# DCP's own record of where an item lies in a file; its reader expects exactly this type.
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckpt.errors import InvalidCheckpoint
from ckpt.format import tensor_blob
from ckpt.format.dcp_metadata import load_metadata
from ckpt.format.manifest import METADATA_NAME, Manifest
from ckpt.storage.catalog import VerifyingReader, read_verified
from ckpt.storage.store import Store

# A single process saving without torch.distributed is a supported use, not a mistake.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


class _VerifiedFiles(FileSystemBase):
    """Read-only view of one checkpoint for DCP's reader: a file is handed out only after its
    size and checksum matched the manifest, so neither `.metadata` (a pickle) nor any data
    is decoded from bytes that were not the ones written."""

    def __init__(self, store: Store, step_dir: str, manifest: Manifest, metadata: bytes | None = None) -> None:
        self.store = store
        self.step_dir = step_dir
        self.manifest = manifest
        self.read_bytes = 0
        self._metadata = metadata  # `.metadata`, checked against this manifest already

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        if "r" not in mode or "+" in mode:
            raise PermissionError("a checkpoint is read-only once committed")
        name = os.path.basename(os.fspath(path))
        if name == METADATA_NAME and self._metadata is not None:
            data, self._metadata = self._metadata, None  # read for this restore, by the catalog
        else:
            data = read_verified(self.store, self.step_dir, name, self.manifest)
        self.read_bytes += len(data)
        yield io.BytesIO(data)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise PermissionError("a checkpoint is read-only once committed")

    def mkdir(self, path: str | os.PathLike) -> None:
        raise PermissionError("a checkpoint is read-only once committed")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def exists(self, path: str | os.PathLike) -> bool:
        return os.path.basename(os.fspath(path)) in self.manifest.files

    def rm_file(self, path: str | os.PathLike) -> None:
        raise PermissionError("a checkpoint is read-only once committed")


class _Reader(FileSystemReader):
    """DCP's reader, but each data file is read once, front to back, in bounded chunks through
    its checksums (skipping the blocks that hold nothing this rank needs): tensors go straight
    into their targets (or through a small scratch buffer), and everything that must be decoded
    (pickled values, any blob the parser does not know) waits until all that was read of the
    file matched the manifest."""

    def __init__(
        self, store: Store, step_dir: str, manifest: Manifest, before_read: Callable[[], None] | None = None,
        metadata: bytes | None = None,
    ) -> None:  # fmt: skip
        super().__init__(step_dir)
        self._before_read = before_read
        self.fs = _VerifiedFiles(store, step_dir, manifest, metadata)
        self.path = step_dir
        self.store = store
        self.manifest = manifest
        self._at_once = _FILES_AT_ONCE if getattr(store, "is_local", False) else _FILES_AT_ONCE_REMOTE
        self._scratches: list[_Scratch] = []  # not in use by a file's thread; reused
        self._lock = threading.Lock()
        self._streamed = 0  # bytes read by _stream_file

    @property
    def read_bytes(self) -> int:
        """Bytes this reader read from storage."""
        return self._streamed + self.fs.read_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            md = load_metadata(f.read(), f"{self.path}/{METADATA_NAME}")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._before_read is not None:
            self._before_read()
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        streamed: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        for name, reqs in per_file.items():
            spans = self._stream_spans(reqs)
            if spans is None:
                # A layout not streamed here goes to DCP's own reader, whose file view
                # (_VerifiedFiles) hands over a file only once it is verified whole.
                super().read_data(dataclasses.replace(plan, items=reqs), planner).wait()
            else:
                streamed[name] = spans
        # IMPORTANT: nothing is decoded (unpickled) before every file it came from was verified.
        for step in self._stream_files(streamed, planner):
            step()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _stream_spans(self, reqs: list[ReadItem]) -> dict[tuple[int, int], list[ReadItem]] | None:
        """The requests of one file by the (offset, length) of the item each reads, or None
        unless the file can be streamed: items one after another, untransformed."""
        spans: dict[tuple[int, int], list[ReadItem]] = {}
        for req in reqs:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if info.transform_descriptors:
                return None
            spans.setdefault((info.offset, info.length), []).append(req)
        if not _disjoint(list(spans)):
            return None
        if any(len({r.type == LoadItemType.BYTE_IO for r in group}) > 1 for group in spans.values()):
            return None
        return spans

    def _stream_files(
        self, files: dict[str, dict[tuple[int, int], list[ReadItem]]], planner: LoadPlanner
    ) -> list[Callable[[], None]]:
        """Stream each file, several at a time (`_at_once`); what is left to do once all were
        verified. On the first failure the other files stop at their next item, and that
        failure is raised once every file's thread has returned (none still fills a tensor)."""
        if len(files) <= 1:
            return [s for name, spans in files.items() for s in self._stream_file(name, spans, planner, threading.Event())]
        stop = threading.Event()
        first: list[BaseException] = []  # the failure that stopped the others
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def one(name: str, spans: dict[tuple[int, int], list[ReadItem]]) -> list[Callable[[], None]]:
            if device is not None:  # a new thread's current device is 0: pinned buffers would open a context there
                torch.cuda.set_device(device)
            try:
                return self._stream_file(name, spans, planner, stop)
            except BaseException as e:
                with self._lock:
                    if not stop.is_set():
                        first.append(e)
                        stop.set()
                raise

        with concurrent.futures.ThreadPoolExecutor(min(len(files), self._at_once), "ckpt-read") as pool:
            futures = [pool.submit(one, name, spans) for name, spans in files.items()]
        if first:
            raise first[0]
        return [s for f in futures for s in f.result()]

    def _stream_file(
        self, name: str, spans: dict[tuple[int, int], list[ReadItem]], planner: LoadPlanner, stop: threading.Event
    ) -> list[Callable[[], None]]:
        """Read one file's items in a single pass through its checksums; what is left to do
        once it was verified (commit the tensors, decode the pickled values)."""
        order = sorted(spans)
        after_verified: list[Callable[[], None]] = []
        with self._a_scratch() as scratch, VerifyingReader.open(self.store, self.path, name, self.manifest, items=order) as src:
            try:
                for offset, length in order:
                    if stop.is_set():
                        raise _Stopped(f"{src.where}: stopped, another file of this restore failed")
                    group = spans[(offset, length)]
                    # Padding and items of other ranks are hashed like the rest, or the blocks
                    # wholly between two items are not read at all.
                    src.skip(offset - src.pos)
                    if group[0].type == LoadItemType.BYTE_IO:
                        blob = src.read(length)
                        after_verified += [functools.partial(planner.load_bytes, r, io.BytesIO(blob)) for r in group]
                    else:
                        after_verified.append(self._read_tensor_item(src, scratch, length, group, planner))
                # IMPORTANT: nothing of this file is decoded before this returned.
                src.finish()
            finally:
                scratch.drain()
                with self._lock:
                    self._streamed += src.read_bytes
        return after_verified

    @contextlib.contextmanager
    def _a_scratch(self) -> Iterator[_Scratch]:
        """A scratch buffer for one file's thread, reused by the files read after it."""
        with self._lock:
            scratch = self._scratches.pop() if self._scratches else _Scratch()
        try:
            yield scratch
        finally:
            with self._lock:
                self._scratches.append(scratch)

    def _read_tensor_item(
        self, src: VerifyingReader, scratch: _Scratch, length: int, reqs: list[ReadItem], planner: LoadPlanner
    ) -> Callable[[], None]:
        """Stream one torch.save blob into the targets of `reqs`; returns what is left to do
        once the file is verified. (Run for every tensor of a restore: 10,000 small ones
        make its per-item work count.)"""
        start = src.pos
        layout = tensor_blob.locate(src.peek(min(length, _HEAD)))
        if layout is None and length > _HEAD:  # an unusually long pickle: look further once
            layout = tensor_blob.locate(src.peek(min(length, _HEAD_MAX)))
        parts = _parts(layout, length, reqs) if layout is not None else None
        if layout is None or parts is None:
            blob = src.read(length)
            return functools.partial(_load_blob, blob, reqs, planner)
        targets = [planner.resolve_tensor(r).detach() for r in reqs]
        for req, target in zip(reqs, targets, strict=True):
            if target.size() != tuple(req.lengths):
                raise RuntimeError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tuple(req.lengths)}")
        order = range(len(reqs)) if len(reqs) == 1 else sorted(range(len(reqs)), key=lambda i: parts[i])
        for i in order:
            self._fill(src, scratch, start, layout, reqs[i], targets[i], parts[i])
        src.skip(start + layout.data_end - src.pos)
        if not layout.descriptor_ok(src.peek(layout.descriptor)):
            raise InvalidCheckpoint(
                f"{src.where}: the tensor at byte {start} is not laid out as its own header says "
                "(a torch.save blob that contradicts itself)"
            )
        src.skip(start + length - src.pos)
        return functools.partial(_commit, planner, reqs, targets)

    @staticmethod
    def _fill(
        src: VerifyingReader,
        scratch: _Scratch,
        start: int,
        layout: tensor_blob.TensorLayout,
        req: ReadItem,
        target: torch.Tensor,
        part: tuple[int, int, bool],
    ) -> None:
        """Read the part `req` asks for (`part`: its bytes and whether they are one range, see
        `TensorLayout.part`) of the tensor whose blob starts at byte `start` into `target`:
        straight into its memory when both are one contiguous range, else through a scratch
        buffer, whole saved rows at a time, narrowed and copied (which also converts dtype
        and device)."""
        first, end, contiguous = part
        if first == end:
            return
        dtype = layout.dtype
        if (
            contiguous
            and target.dtype == dtype
            and target.device.type == "cpu"
            and target.layout == torch.strided
            and target.is_contiguous()
            and not (target.is_conj() or target.is_neg())
        ):
            src.skip(start + first - src.pos)
            src.readinto(_bytes_of(target))
            return
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        size, strides, itemsize = layout.size, layout.strides, dtype.itemsize
        if not size:  # a 0-d tensor
            src.skip(start + first - src.pos)
            scratch.copy(src, itemsize, dtype, (), target)
            return
        chunk = scratch.chunk(target.device)
        # The outermost dimension whose steps fit the buffer; the dimensions before it are
        # walked index by index.
        d = next(d for d, st in enumerate(strides) if st * itemsize <= chunk)
        row = strides[d] * itemsize
        step = max(1, chunk // row)
        for lead in itertools.product(*(range(offsets[k], offsets[k] + lengths[k]) for k in range(d))):
            base = start + layout.tensor_start + sum(i * st for i, st in zip(lead, strides, strict=False)) * itemsize
            dest = target[tuple(i - o for i, o in zip(lead, offsets, strict=False))]
            for at in range(offsets[d], offsets[d] + lengths[d], step):
                n = min(step, offsets[d] + lengths[d] - at)
                src.skip(base + at * row - src.pos)
                scratch.copy(
                    src, n * row, dtype, (n, *size[d + 1 :]), dest.narrow(0, at - offsets[d], n),
                    offsets=(0, *offsets[d + 1 :]), lengths=(n, *lengths[d + 1 :]),
                )  # fmt: skip


class _Scratch:
    """Reused buffers for bytes that cannot go straight into their target. A CUDA target gets
    two pinned buffers in turn: the copy of one to the device runs while the next is read."""

    _DEVICE_CHUNK = 8 << 20  # bytes per copy to a device: its fixed cost becomes small
    _HOST_CHUNK = 1 << 20  # bytes per copy on the host

    def __init__(self) -> None:
        self._host = torch.empty(0, dtype=torch.uint8)
        self._pinned: list[tuple[torch.Tensor, Any]] = []  # (buffer, event of its last copy)
        self._turn = 0

    def chunk(self, device: torch.device) -> int:
        return self._DEVICE_CHUNK if device.type == "cuda" else self._HOST_CHUNK

    def copy(
        self, src: VerifyingReader, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], dest: torch.Tensor,
        offsets: tuple[int, ...] = (), lengths: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        """Read the next `nbytes` (a `dtype` tensor of `shape`), narrow them to `offsets` and
        `lengths` and copy that into `dest`."""
        pinned = dest.device.type == "cuda"
        buf = self._take_pinned(nbytes) if pinned else self._take_host(nbytes)
        src.readinto(_bytes_of(buf))
        part = buf.view(dtype).view(shape)
        if offsets:
            part = narrow_tensor_by_index(part, offsets, lengths)
        dest.copy_(part, non_blocking=pinned)
        if pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self._pinned[self._turn] = (self._pinned[self._turn][0], event)

    def drain(self) -> None:
        """Wait for every copy to a device still running."""
        for _, event in self._pinned:
            if event is not None:
                event.synchronize()

    def _take_host(self, nbytes: int) -> torch.Tensor:
        if self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, self._HOST_CHUNK), dtype=torch.uint8)
        return self._host[:nbytes]

    def _take_pinned(self, nbytes: int) -> torch.Tensor:
        self._turn ^= 1
        if len(self._pinned) < 2:
            self._pinned = [(torch.empty(0, dtype=torch.uint8), None)] * 2
        buf, event = self._pinned[self._turn]
        if event is not None:
            event.synchronize()  # IMPORTANT: its last copy must be done before it is refilled
        if buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self._DEVICE_CHUNK), dtype=torch.uint8, pin_memory=True)
        self._pinned[self._turn] = (buf, None)
        return buf[:nbytes]


# The start of a tensor item read before deciding how to stream it: its zip headers and pickle
# take well under 1 KiB (the storage starts at byte 704 for a 2-d tensor).
_HEAD = 4 << 10
_HEAD_MAX = 64 << 10


# Data files one rank reads at once, each on its own thread (reads and hashing release the GIL):
# a rank that needs a few items of another rank's file (values every rank holds, saved once)
# or several whole files (a restore on fewer ranks) reads them while its own file streams.
# From an object store two: each reader there keeps its readahead (`Transfer`) in memory.
_FILES_AT_ONCE = 4
_FILES_AT_ONCE_REMOTE = 2


class _Stopped(Exception):
    """A file's thread stopped early because another file of the same restore failed."""


def _disjoint(ranges: list[tuple[int, int]]) -> bool:
    """Whether no (start, length) range overlaps another."""
    spans = sorted(r for r in ranges if r[1])
    return all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))


def _parts(layout: tensor_blob.TensorLayout, length: int, reqs: list[ReadItem]) -> list[tuple[int, int, bool]] | None:
    """Where in the blob each request's bytes lie (`TensorLayout.part`), or None unless they
    can be streamed: the storage inside the item, every request a part of the saved tensor,
    none overlapping."""
    if layout.data_end + layout.descriptor > length:
        return None
    parts = [layout.part(r.storage_offsets, r.lengths) for r in reqs]
    if None in parts:
        return None
    if len(parts) > 1 and not _disjoint([(p[0], p[1] - p[0]) for p in parts]):  # type: ignore[index]
        return None
    return parts  # type: ignore[return-value]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable; it keeps the tensor alive."""
    if t.dtype in _NUMPY_DTYPES:  # numpy's own view: a third of the torch ops' time
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# The dtypes whose tensors numpy takes as they are (no bfloat16, no float8: those are viewed
# as bytes by torch first).
_NUMPY_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
     torch.uint8, torch.bool, torch.complex64, torch.complex128)
)  # fmt: skip


def _commit(planner: LoadPlanner, reqs: list[ReadItem], targets: list[torch.Tensor]) -> None:
    for req, target in zip(reqs, targets, strict=True):
        planner.commit_tensor(req, target)


def _load_blob(blob: bytes, reqs: list[ReadItem], planner: LoadPlanner) -> None:
    """DCP's own way with a tensor item, for blobs not streamed: torch.load (weights only),
    narrow, copy. Runs only after the file's checksum matched."""
    tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    for req in reqs:
        part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != part.size():
            raise RuntimeError(f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}")
        target.copy_(part)
        planner.commit_tensor(req, target)


def make_reader(
    store: Store, step_dir: str, manifest: Manifest, before_read: Callable[[], None] | None = None,
    metadata: bytes | None = None,
) -> _Reader:  # fmt: skip
    """The reader of one checkpoint; `before_read` is called as it starts to read data;
    `metadata`: its `.metadata`, already checked against `manifest` (not read again)."""
    return _Reader(store, step_dir, manifest, before_read, metadata)


_OPTIM_STATE = "optim.state."  # DCP's flattened keys of the optimizers' state: <this><param fqn>.<name>


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but pickled values load with `weights_only=True`: checksum-verified
    bytes may still have been written by someone else, so no code runs from them. Values for
    which `optional` says so may be missing from the checkpoint: they are left as they are."""

    def __init__(self, optional: Callable[[str], bool] = lambda fqn: False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optional = optional
        #: Parameters (FQNs) the checkpoint holds no optimizer state for: no step had reached
        #: them when it was saved (an expert no token was routed to). DCP made theirs up for
        #: the state loaded into; `TrainingState.drop_optimizer_state` removes it again.
        self.stateless: set[str] = set()

    def create_local_plan(self) -> LoadPlan:
        """DCP's default local plan (`create_default_local_load_plan`: a read item per piece
        of every value, strict unless `allow_partial_load`), with each distinct tensor layout's
        arithmetic done once: the parameters and the optimizer's moments of a model's layers
        share a few layouts, and DCP works out each of them again for every tensor (DTensor's
        shard geometry, then the overlaps with the saved chunks), a third of a 100 MB restore's
        fixed cost. Unlike DCP it does not probe for keys flattened as torch 2.3 did: ckpt
        needs torch 2.6 or later, so no checkpoint of its own has them."""
        if self.metadata is None:
            raise AssertionError("create_local_plan before set_up_planner")
        stored = self.metadata.state_dict_metadata
        with_state = {k.rpartition(".")[0] for k in stored if k.startswith(_OPTIM_STATE)}
        chunks: dict[tuple[Any, ...], list[ChunkStorageMetadata]] = {}
        reads: dict[tuple[Any, ...], list[ReadItem]] = {}
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            if md is None:
                if self.allow_partial_load or self.optional(fqn):
                    continue
                param = fqn.rpartition(".")[0]
                if fqn.startswith(_OPTIM_STATE) and param not in with_state:  # none of its state, not a key of it
                    self.stateless.add(param.removeprefix(_OPTIM_STATE))
                    continue
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if not (isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor)):
                items += _create_read_items(fqn, md, obj)  # bytes, or a mismatch DCP words
                continue
            if md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank holds none of it
            mine = _chunks_once(obj, chunks)
            key = (tuple((c.offsets, c.sizes) for c in md.chunks), tuple((c.offsets, c.sizes) for c in mine))
            done = reads.get(key)
            if done is None:
                reads[key] = done = create_read_items_for_chunk_list(fqn, md, mine)
                items += done
            else:
                items += [_renamed(item, fqn) for item in done]
        return LoadPlan(items)

    def unasked(self, prefixes: tuple[str, ...]) -> list[str]:
        """The values under `prefixes` that the checkpoint holds and the state loaded into did
        not ask for (DCP leaves them unread: an object that builds its state lazily, a layer
        removed since the save)."""
        if self.metadata is None:
            return []
        return sorted(k for k in self.metadata.state_dict_metadata if k.startswith(prefixes) and k not in self.state_dict)

    def not_in_checkpoint(self, prefix: str) -> list[str]:
        """The values under `prefix` asked for that the checkpoint lacks (`optional` let them
        be: they were left as they are)."""
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        return sorted(k for k in self.state_dict if k.startswith(prefix) and k not in stored)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """DCP's lookup, but a DTensor's shard is its local tensor as it is, not through
        `to_local()`, an autograd function that costs more than reading a small tensor: the
        same memory, which the reader detaches anyway."""
        obj = self.state_dict.get(index.fqn)
        if type(obj) is DTensor and type(obj._local_tensor) is torch.Tensor and not any(p.is_partial() for p in obj.placements):
            return obj._local_tensor
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = tensor_blob.load_value(value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _chunks_once(t: torch.Tensor, memo: dict[tuple[Any, ...], list[ChunkStorageMetadata]]) -> list[ChunkStorageMetadata]:
    """DCP's local chunks of `t` (`_create_chunk_list`), worked out once per layout in `memo`:
    a DTensor's depend on its global shape, mesh and placements, a plain tensor's on its
    shape. Other kinds (a ShardedTensor, a DTensor over a tensor subclass) are asked each time."""
    if isinstance(t, DTensor):
        if hasattr(t._local_tensor, "__create_chunk_list__"):
            return _create_chunk_list(t)
        key: tuple[Any, ...] = (t.shape, id(t.device_mesh), tuple(t.placements))  # meshes outlive the plan
    elif hasattr(t, "__create_chunk_list__") or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return _create_chunk_list(t)
    else:
        key = (t.shape,)
    found = memo.get(key)
    if found is None:
        memo[key] = found = _create_chunk_list(t)
    return found


def _renamed(item: ReadItem, fqn: str) -> ReadItem:
    """A read item planned for another value of the same layout, for the value `fqn`."""
    return ReadItem(  # not dataclasses.replace: a third of the time, for every tensor
        item.type,
        MetadataIndex(fqn, item.dest_index.offset, item.dest_index.index),
        item.dest_offsets,
        MetadataIndex(fqn, item.storage_index.offset, item.storage_index.index),
        item.storage_offsets,
        item.lengths,
    )
