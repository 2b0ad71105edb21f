"""DCP storage plugins: our writer and reader behind `torch.distributed.checkpoint`.

The files are plain DCP (`__<rank>_0.distcp` and `.metadata`, the layout of DCP's own
FileSystemWriter), so `torch.distributed.checkpoint.load` reads them without ckpt. What we
add: each file is checksummed while it is written and made durable before the save returns
(fsync locally, a completed PUT or multipart upload on an object store), and on the way
back every byte is checked against the manifest before DCP unpickles or loads any of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# DCP's own record of where an item lies in a file; its reader expects exactly this type.
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemBase,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ._faults import fault_point
from .catalog import read_verified
from .errors import InvalidCheckpoint
from .manifest import METADATA_NAME, FileEntry, Manifest
from .storage import Hasher, Store, checksum

DATA_SUFFIX = ".distcp"

# A single process saving without torch.distributed is a supported use, not a mistake.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


class _HashingStream(io.RawIOBase):
    """Write-through wrapper that checksums and counts every byte."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.hasher = Hasher()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.raw.write(view)
        self.hasher.update(view)
        return len(view)

    def tell(self) -> int:
        return self.hasher.size

    def flush(self) -> None:
        pass


class Writer(StorageWriter):
    """Writes one rank's items into `<step dir>/__<rank>_0.distcp`; rank 0 also `.metadata`.

    After `dcp.save` returns, `files` holds what this rank wrote, for the manifest.
    """

    def __init__(self, store: Store, step_dir: str, step: int) -> None:
        super().__init__()
        self.store = store
        self.step_dir = step_dir
        self.step = step
        self.files: dict[str, FileEntry] = {}
        self.rank = 0
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.files = {}
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
        results: list[WriteResult] = []
        # Small pickled objects first, then tensors: DCP's own order.
        items = sorted(plan.items, key=lambda it: it.type != WriteItemType.BYTE_IO)
        with self.store.open_write(f"{self.step_dir}/{name}") as raw:
            out = _HashingStream(raw)
            for item in items:
                fault_point("write_item", self.rank, self.step)
                offset = out.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer())
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    torch.save(tensor, out)
                length = out.tell() - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
        self.files[name] = FileEntry(out.hasher.size, out.hasher.hexdigest(), self.rank)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        with self.store.open_write(f"{self.step_dir}/{METADATA_NAME}") as f:
            f.write(blob)
        self.files[METADATA_NAME] = FileEntry(len(blob), checksum(blob), -1)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.step_dir, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.step_dir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class _VerifiedFiles(FileSystemBase):
    """Read-only view of one checkpoint for DCP's reader: a file is handed out only after its
    size and checksum matched the manifest, so neither `.metadata` (a pickle) nor any data
    is decoded from bytes that were not the ones written."""

    def __init__(self, store: Store, step_dir: str, manifest: Manifest) -> None:
        self.store = store
        self.step_dir = step_dir
        self.manifest = manifest

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        if "r" not in mode or "+" in mode:
            raise PermissionError("a checkpoint is read-only once committed")
        name = os.path.basename(os.fspath(path))
        yield io.BytesIO(read_verified(self.store, self.step_dir, name, self.manifest))

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


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle. A matching checksum proves the bytes are the ones
    written, not who wrote them, so it is read with an allowlist: DCP's metadata types,
    torch.Size, dtypes and layouts; anything else (os.system, eval, ...) is refused."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name) if self._allowed(module, name) else None
        if obj is None:
            raise InvalidCheckpoint(f".metadata refers to {module}.{name}, which a checkpoint never holds")
        return obj

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._ALLOWED:
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype)
        return module == "torch.distributed.checkpoint.metadata" and not name.startswith("__")


def load_metadata(blob: bytes) -> Metadata:
    """DCP metadata from checksum-verified bytes, through the allowlist."""
    try:
        md = _MetadataUnpickler(io.BytesIO(blob)).load()
    except InvalidCheckpoint:
        raise
    except Exception as e:
        raise InvalidCheckpoint(f".metadata does not parse: {type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata):
        raise InvalidCheckpoint(f".metadata holds a {type(md).__name__}, not DCP metadata")
    return md


class _Reader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            md = load_metadata(f.read())
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def make_reader(store: Store, step_dir: str, manifest: Manifest) -> FileSystemReader:
    reader = _Reader(step_dir)
    reader.fs = _VerifiedFiles(store, step_dir, manifest)
    reader.path = step_dir
    return reader


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but pickled values load with `weights_only=True`: checksum-verified
    bytes may still have been written by someone else, so no code runs from them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


