"""DCP's storage reader for ckpt: restore reads every byte through the manifest's checksum.

The files are plain DCP (written by `ckpt.save.dcp_write`). Each data file this rank needs is read
once, front to back, through its checksums: the whole file, or of a large one the blocks that
hold this rank's items (the manifest has a checksum per block). Tensor data goes straight into
the tensors being restored, and pickled values are unpickled (with `weights_only=True`) only
after everything read of the file matched the manifest. A mismatch fails the restore, which
then falls back to an older checkpoint.

This module reads the files; a tensor item goes into its targets by `ckpt.restore.tensor_stream`,
and what to read is planned by `ckpt.restore.planner`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

# DCP's own record of where an item lies in a file; its reader expects exactly this type.
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future

from ckpt.collectives import Group
from ckpt.errors import InvalidCheckpoint
from ckpt.format.dcp_layout import PER_RANK
from ckpt.format.dcp_metadata import load_metadata
from ckpt.format.manifest import METADATA_NAME, Manifest
from ckpt.restore.replicas import Replicas, group
from ckpt.restore.replicas import exchange as replicate
from ckpt.restore.shared_items import Ref, Servers, Sharing, exchange
from ckpt.restore.tensor_stream import Scratch, disjoint, load_blob, read_tensor_item
from ckpt.storage.store import Store
from ckpt.storage.verified import VerifyingReader, read_verified

# A single process saving without torch.distributed is a supported use, not a mistake.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a rank reads instead of `.metadata`."""

    mine: Metadata  # this rank's part (its index) and the shared part, merged
    shared: Metadata  # the shared part alone: it numbers the shared items alike on every rank
    read_bytes: int  # of the index files, read from the store by this rank


class _VerifiedFiles(FileSystemBase):
    """Read-only view of one checkpoint for DCP's reader: a file is handed out only after its
    size and checksum matched the manifest, so neither `.metadata` (a pickle) nor any data
    is decoded from bytes that were not the ones written."""

    def __init__(self, store: Store, step_dir: str, manifest: Manifest, metadata: bytes | None = None, received: bool = False) -> None:
        self.store = store
        self.step_dir = step_dir
        self.manifest = manifest
        self.read_bytes = 0
        self._metadata = metadata  # `.metadata`, checked against this manifest already
        self._received = received  # from rank 0, not read here

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        if "r" not in mode or "+" in mode:
            raise PermissionError("a checkpoint is read-only once committed")
        name = os.path.basename(os.fspath(path))
        if name == METADATA_NAME and self._metadata is not None:
            data, self._metadata = self._metadata, None  # read for this restore: by the catalog, or rank 0
            self.read_bytes += 0 if self._received else len(data)
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
        metadata: bytes | None = None, received: bool = False, ctrl: Group | None = None,
        parts: Parts | None = None,
    ) -> None:  # fmt: skip
        super().__init__(step_dir)
        self._parts = parts  # read instead of `.metadata` (`ckpt.restore.partial`)
        self._ctrl = ctrl
        self.sharing: Sharing | None = None  # the small values read once per job (`share`)
        self.replicas: Replicas | None = None  # the replicated pieces read once per group (`share`)
        self._grouped = False
        self._before_read = before_read
        self.fs = _VerifiedFiles(store, step_dir, manifest, metadata, received)
        self.path = step_dir
        self.store = store
        self.manifest = manifest
        self._at_once = _FILES_AT_ONCE if getattr(store, "is_local", False) else _FILES_AT_ONCE_REMOTE
        self._scratches: list[Scratch] = []  # not in use by a file's thread; reused
        self._lock = threading.Lock()
        self._streamed = 0  # bytes read by _stream_file

    @property
    def read_bytes(self) -> int:
        """Bytes this reader read from storage."""
        return self._streamed + self.fs.read_bytes

    @property
    def received_bytes(self) -> int:
        """Bytes of replicated pieces other ranks read and sent to this one."""
        return self.replicas.received_bytes if self.replicas is not None else 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._parts is not None:
            md = self._parts.mine
            self.fs.read_bytes += self._parts.read_bytes
        else:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                md = load_metadata(f.read(), f"{self.path}/{METADATA_NAME}")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._before_read is not None:
            self._before_read()
        items = plan.items
        if self._ctrl is not None and self._ctrl.world > 1:
            items = self._defer(items, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for req in items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        streamed = {name: self._stream_spans(name, reqs) for name, reqs in per_file.items()}
        # IMPORTANT: nothing is decoded (unpickled) before every file it came from was verified.
        for step in self._stream_files(streamed, planner):
            step()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _defer(self, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """The items this rank reads from the store: not the small shared values other ranks
        serve, nor the replicated pieces another rank of its group reads (`_group`, a
        collective: joined here whatever happened before it)."""
        pieces: dict[Ref, list[ReadItem]] = {}
        try:
            if planner.metadata is not None:
                self.sharing = Sharing.of(self._ctrl, self.manifest, self._parts.shared if self._parts else planner.metadata)
                items = self.sharing.defer(items, self._ref)
            for req in items:
                if (ref := self._replicable(req)) is not None:
                    pieces.setdefault(ref, []).append(req)
            # Only pieces this rank loads whole: one it loads a slice of (a restore on another
            # layout) it streams, reading the blocks that hold its slice; sent whole, every
            # rank of its group would hold and receive all of it.
            pieces = {ref: reqs for ref, reqs in pieces.items() if _whole(reqs, planner.metadata)}
        finally:
            self._group(pieces)
        if self.replicas is not None and self.replicas.pending:
            items = [req for req in items if self._replicable(req) not in self.replicas.pending]
        return items

    def _replicable(self, req: ReadItem) -> Ref | None:
        """The piece `req` reads, if a rank of its group could read it for this one."""
        info: _StorageInfo = self.storage_data[req.storage_index]
        if PER_RANK.search(req.dest_index.fqn):
            return None
        ref = (info.relative_path, info.offset, info.length)
        return None if self.sharing is not None and self.sharing.number(ref) is not None else ref

    def _group(self, pieces: dict[Ref, list[ReadItem]]) -> None:
        """`replicas.group`, once per restore on every rank of the job."""
        assert self._ctrl is not None and not self._grouped
        self._grouped = True
        self.replicas = group(self._ctrl, pieces, Servers(self.manifest, self._ctrl.world))

    def share(self, planner: LoadPlanner, state_dict: dict[str, Any], ok: bool) -> None:
        """Send and receive the values several ranks load into `state_dict`: the small ones
        (`ckpt.restore.shared_items`) and the replicated pieces (`ckpt.restore.replicas`). A
        collective, called on every rank once `dcp.load` returned, `ok` or not."""
        if self._ctrl is None or self._ctrl.world == 1:
            return
        if not self._grouped:  # this rank did not get as far as reading: the others did
            self._group({})
        error: Exception | None = None
        try:
            exchange(self._ctrl, self.sharing, planner, ok, self._read_refs, self.manifest)
        except Exception as e:  # the replicas' transfers still take place: the others wait for them
            error, ok = e, False
        replicate(self._ctrl, self.replicas, planner, ok, self._read_refs)
        if error is not None:
            raise error
        if ok and any(part is not None and part.pending for part in (self.sharing, self.replicas)):
            # dcp.load loads into a shallow copy of `state_dict` and puts its top-level
            # values back before it returns: the values loaded since go the same way.
            loaded = getattr(planner, "original_state_dict", state_dict)
            for key in state_dict.keys() & loaded.keys():
                if not isinstance(state_dict[key], Stateful):
                    state_dict[key] = loaded[key]

    def _ref(self, req: ReadItem) -> Ref:
        info: _StorageInfo = self.storage_data[req.storage_index]
        return info.relative_path, info.offset, info.length

    def _read_refs(self, refs: list[Ref]) -> dict[Ref, bytes]:
        """Items read from the store, each file once through its checksums (only the blocks
        that hold them); nothing is returned before its file's part was verified."""
        out: dict[Ref, bytes] = {}
        for name in sorted({r[0] for r in refs}):
            mine = sorted((o, n) for f, o, n in refs if f == name)
            with VerifyingReader.open(self.store, self.path, name, self.manifest, items=mine) as src:
                try:
                    got = {}
                    for offset, length in mine:
                        src.skip(offset - src.pos)
                        got[(name, offset, length)] = src.read(length)
                    src.finish()
                finally:
                    with self._lock:
                        self._streamed += src.read_bytes
            out.update(got)
        return out

    def _stream_spans(self, name: str, reqs: list[ReadItem]) -> dict[tuple[int, int], list[ReadItem]]:
        """The requests of one file by the (offset, length) of the item each reads. DCP writes
        items one after another, each of one kind (the metadata's checks refuse transformed
        ones): items that overlap, or a tensor and a pickled value at the same bytes, come of
        a metadata someone else wrote, and are refused (read whole by DCP's own reader, they
        would have taken a whole data file into memory)."""
        spans: dict[tuple[int, int], list[ReadItem]] = {}
        for req in reqs:
            info: _StorageInfo = self.storage_data[req.storage_index]
            spans.setdefault((info.offset, info.length), []).append(req)
        if not disjoint(list(spans)) or any(len({r.type == LoadItemType.BYTE_IO for r in group}) > 1 for group in spans.values()):
            raise InvalidCheckpoint(f"{self.path}/{name}: the metadata places items that overlap in it, which DCP never writes")
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
        sharing = self.sharing if self.sharing is not None and self.sharing.serves(name) else None
        replicas = self.replicas if self.replicas is not None and len(self.replicas.members) > 1 else None
        captured: dict[int, bytes] = {}  # this file's shared items, kept to send
        pieces: dict[Ref, bytes] = {}  # its replicated pieces this rank reads for its group
        with self._a_scratch() as scratch, VerifyingReader.open(self.store, self.path, name, self.manifest, items=order) as src:
            try:
                for offset, length in order:
                    if stop.is_set():
                        raise _Stopped(f"{src.where}: stopped, another file of this restore failed")
                    group = spans[(offset, length)]
                    # Padding and items of other ranks are hashed like the rest, or the blocks
                    # wholly between two items are not read at all.
                    src.skip(offset - src.pos)
                    shared = sharing.number((name, offset, length)) if sharing is not None else None
                    sent = replicas is not None and replicas.reads((name, offset, length))
                    if group[0].type == LoadItemType.BYTE_IO:
                        blob = src.read(length)
                        after_verified += [functools.partial(planner.load_bytes, r, io.BytesIO(blob)) for r in group]
                    elif shared is not None or sent:  # kept whole, to send to the ranks that wait for it
                        blob = src.read(length)
                        after_verified.append(functools.partial(load_blob, blob, group, planner))
                    else:
                        after_verified.append(read_tensor_item(src, scratch, length, group, planner))
                    if shared is not None:
                        captured[shared] = blob
                    if sent:
                        pieces[(name, offset, length)] = blob
                # IMPORTANT: nothing of this file is decoded (or sent) before this returned.
                src.finish()
                with self._lock:
                    if sharing is not None:
                        sharing.captured.update(captured)
                    if replicas is not None:
                        replicas.captured.update(pieces)
            finally:
                scratch.drain()
                with self._lock:
                    self._streamed += src.read_bytes
        return after_verified

    @contextlib.contextmanager
    def _a_scratch(self) -> Iterator[Scratch]:
        """A scratch buffer for one file's thread, reused by the files read after it."""
        with self._lock:
            scratch = self._scratches.pop() if self._scratches else Scratch()
        try:
            yield scratch
        finally:
            with self._lock:
                self._scratches.append(scratch)

def _whole(reqs: list[ReadItem], md: Metadata | None) -> bool:
    """Whether `reqs` load all of the piece they read: a pickled value, or a saved chunk taken
    from its first element to its last."""
    if reqs[0].type == LoadItemType.BYTE_IO:
        return True
    entry = md.state_dict_metadata.get(reqs[0].storage_index.fqn) if md is not None else None
    if not isinstance(entry, TensorStorageMetadata):
        return False
    at = tuple(reqs[0].storage_index.offset or ())
    sizes = next((tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == at), None)
    return any(not any(r.storage_offsets) and tuple(r.lengths) == sizes for r in reqs)


# Data files one rank reads at once, each on its own thread (reads and hashing release the GIL):
# a rank that needs a few items of another rank's file (values every rank holds, saved once)
# or several whole files (a restore on fewer ranks) reads them while its own file streams.
# From an object store two: each reader there keeps its readahead (`Transfer`) in memory.
_FILES_AT_ONCE = 4
_FILES_AT_ONCE_REMOTE = 2


class _Stopped(Exception):
    """A file's thread stopped early because another file of the same restore failed."""


def make_reader(
    store: Store, step_dir: str, manifest: Manifest, before_read: Callable[[], None] | None = None,
    metadata: bytes | None = None, received: bool = False, ctrl: Group | None = None,
    parts: Parts | None = None,
) -> _Reader:  # fmt: skip
    """The reader of one checkpoint; `before_read` is called as it starts to read data;
    `metadata`: its `.metadata`, already checked against `manifest` (not read again), and
    `received` if it came from another rank (not counted in `read_bytes`: not read here);
    `ctrl`: the job's group, over which the ranks share the small values they all load
    (then `share` must be called on every rank once the load returned); `parts`: this rank's
    part of the metadata and the shared part, read instead of `.metadata`."""
    return _Reader(store, step_dir, manifest, before_read, metadata, received, ctrl, parts)
