"""DCP's `.metadata`, read from checksum-verified bytes through an exact allowlist.

`.metadata` is a pickle. A matching checksum proves the bytes are the ones written, not who
wrote them: whoever can write an unsigned root can rewrite its manifest too. So it is read by
an unpickler that builds DCP's metadata classes and a few inert values and nothing else (no
name but the exact ones DCP writes, no dotted name, no other callable): a file that asks for
anything more is refused, naming what it asked for, and nothing in it runs.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import InvalidCheckpoint
from ckpt.format.manifest import METADATA_NAME


@dataclasses.dataclass(frozen=True)
class _Maker:
    """What a class name in `.metadata` resolves to: inert until NEWOBJ or REDUCE, the only
    opcodes that take it, makes an object of it; so no class object ends up in the tree."""

    cls: Any


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """torch.serialization._get_layout, which DCP's pickles name: a layout by its name, only."""
    return _LAYOUTS[name]


_PATH_MAX = 4096  # characters of a path's parts, joined (Linux's PATH_MAX)


def _path(*parts: str) -> str:
    """pathlib's PosixPath, which DCP's file writer records as the checkpoint's id (plain DCP,
    torchtitan): its string only, no path object."""
    return os.path.join(*parts) if parts else "."


_BUILT = (Metadata, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, _StorageInfo)
# IMPORTANT: the exact names that DCP `.metadata` pickles hold (torch 2.13, protocols 2-5),
# each looked up as a whole: no dotted name, no other attribute of these modules.
_NAMES: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__name__): _Maker(c) for c in (*_BUILT, _MEM_FORMAT_ENCODING)},
    ("torch", "Size"): _Maker(torch.Size),
    ("torch.serialization", "_get_layout"): _Maker(_layout),
    **{(module, "PosixPath"): _Maker(_path) for module in ("pathlib", "pathlib._local")},
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},  # a dtype pickles as its name
}
# What NEWOBJ makes (cls.__new__(cls), no arguments), with the fields BUILD may then set (a
# TensorProperties is set from its 5-tuple by its own __setstate__); what REDUCE may call, with
# one argument (torch.Size's dims, the memory format's code, the layout's name).
_FIELDS = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in _BUILT}
_REDUCED = frozenset((torch.Size, _MEM_FORMAT_ENCODING, _layout))


def _describe(obj: Any) -> str:
    return f"{obj.cls.__module__}.{obj.cls.__qualname__} itself" if type(obj) is _Maker else f"a {type(obj).__name__}"


def _refusing(opcode: str) -> Callable[[_MetadataUnpickler], None]:
    def refuse(self: _MetadataUnpickler) -> None:
        raise self.refused(f"uses the pickle opcode {opcode}")

    return refuse


class _MetadataUnpickler(pickle._Unpickler):
    """DCP's `.metadata` is a pickle. A matching checksum proves the bytes are the ones
    written, not who wrote them (an unsigned manifest is rewritten as easily), so it builds
    DCP's metadata and nothing else: names from `_NAMES` only; objects of DCP's metadata
    classes (NEWOBJ, then BUILD of their fields), torch.Size, the memory format code and
    layouts (REDUCE); no INST, OBJ, NEWOBJ_EX, extension code or persistent id. The
    pure-Python unpickler: the C one can neither restrict BUILD nor refuse extension codes
    (it answers those from copyreg's cache, past find_class)."""

    def __init__(self, blob: bytes, where: str) -> None:
        super().__init__(io.BytesIO(blob))
        self.where = where

    def refused(self, what: str) -> InvalidCheckpoint:
        return InvalidCheckpoint(f"{self.where} {what}, which DCP metadata (torch {torch.__version__}) never holds: refused, nothing in it was run (the file was tampered with, or written by another torch)")

    def find_class(self, module: str, name: str) -> Any:
        found = _NAMES.get((module, name))
        if found is None:
            raise self.refused(f"refers to {module}.{name}")
        return found

    def get_extension(self, code: int) -> Any:
        raise self.refused(f"uses pickle extension code {code}")

    def persistent_load(self, pid: Any) -> Any:
        raise self.refused("holds a persistent id")

    def _reduce(self) -> None:
        args = self.stack.pop()
        maker = self.stack[-1]
        if type(maker) is _Maker and maker.cls is _path:
            # IMPORTANT: bounded, as a path is: the parts may be memo references to one long
            # string (or to an earlier path), and joined they would grow with each level.
            if not (type(args) is tuple and all(type(a) is str for a in args) and sum(len(a) + 1 for a in args) <= _PATH_MAX):
                raise self.refused("holds a PosixPath that is not a path (strings, at most 4096 characters in all)")
            self.stack[-1] = _path(*args)
            return
        if not (type(maker) is _Maker and maker.cls in _REDUCED and type(args) is tuple and len(args) == 1):
            raise self.refused(f"applies REDUCE to {_describe(maker)}")
        self.stack[-1] = maker.cls(args[0])

    def _newobj(self) -> None:
        args = self.stack.pop()
        maker = self.stack[-1]
        if not (type(maker) is _Maker and maker.cls in _FIELDS and type(args) is tuple and not args):
            raise self.refused(f"applies NEWOBJ to {_describe(maker)}")
        self.stack[-1] = maker.cls.__new__(maker.cls)

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = _FIELDS.get(type(inst))
        if fields is None:
            raise self.refused(f"sets the state of {_describe(inst)}")
        if type(inst) is TensorProperties and type(state) is tuple and len(state) == 5:
            TensorProperties.__setstate__(inst, state)
        elif type(state) is dict and state.keys() <= fields:
            vars(inst).update(state)
        else:
            what = list(state.keys() - fields)[:5] if type(state) is dict else f"a {type(state).__name__}"
            raise self.refused(f"sets {what} of {_describe(inst)}")

    dispatch = {
        **pickle._Unpickler.dispatch,  # type: ignore[attr-defined]
        pickle.REDUCE[0]: _reduce,
        pickle.NEWOBJ[0]: _newobj,
        pickle.BUILD[0]: _build,
        pickle.INST[0]: _refusing("INST"),
        pickle.OBJ[0]: _refusing("OBJ"),
        pickle.NEWOBJ_EX[0]: _refusing("NEWOBJ_EX"),
    }


def load_metadata(blob: bytes, where: str = METADATA_NAME) -> Metadata:
    """DCP metadata from checksum-verified bytes, through the allowlist (`where`: the file, for
    an error)."""
    try:
        md = _MetadataUnpickler(blob, where).load()
    except InvalidCheckpoint:
        raise
    except Exception as e:
        raise InvalidCheckpoint(f"{where} does not parse: {type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata):
        raise InvalidCheckpoint(f"{where} holds {_describe(md)}, not DCP metadata")
    problem = malformed(md)
    if problem:
        raise InvalidCheckpoint(f"{where} is not DCP metadata as DCP writes it: {problem}")
    return md


# A tensor's dimension, and the elements of one: what DCP itself could save (int64).
_DIM_MAX = 1 << 62


def malformed(md: Metadata) -> str | None:
    """What in `md` is not of the types and ranges DCP writes (the unpickler only proves which
    classes it is made of: BUILD may still have set a field to any plain value, which a verb
    would crash on, or allocate from, far from here); None if nothing. Every entry is looked
    at: `.metadata` is read once per restore, and these are a few checks per tensor."""
    if not (md.storage_meta is None or type(md.storage_meta) is StorageMeta):
        return "storage_meta"  # ckpt's reader sets an attribute of it
    if not (md.version is None or type(md.version) is str):
        return "version"
    if type(md.state_dict_metadata) is not dict:
        return "state_dict_metadata is not a dict"
    for fqn, entry in md.state_dict_metadata.items():
        why = None if type(fqn) is str else "a key that is not a string"
        if why is None and type(entry) is TensorStorageMetadata:
            why = _tensor_problem(entry)
        elif why is None and type(entry) is not BytesStorageMetadata:
            why = f"an entry of type {type(entry).__name__}"
        if why:
            return f"{fqn!r}: {why}"
    if not (md.storage_data is None or type(md.storage_data) is dict):
        return "storage_data is not a dict"
    stored: dict[tuple[str, tuple[int, ...] | None], int] = {}  # each piece's bytes in its file
    for index, info in (md.storage_data or {}).items():
        if not (type(index) is MetadataIndex and type(index.fqn) is str and (index.offset is None or _is_size(index.offset))
                and (index.index is None or type(index.index) is int)):  # fmt: skip
            return f"storage_data: a key {_describe(index)} that is not an index DCP writes"
        if not (type(info) is _StorageInfo and type(info.relative_path) is str and _plain_name(info.relative_path)
                and _count(info.offset) and _count(info.length)
                and (info.transform_descriptors is None or type(info.transform_descriptors) is list)):  # fmt: skip
            return f"storage_data[{index.fqn!r}]: not a file name and a byte range in it"
        if info.transform_descriptors:  # its bytes, once decoded, would have no bound here
            return f"storage_data[{index.fqn!r}]: stored transformed ({str(info.transform_descriptors)[:60]}, a DCP extension's compression): ckpt reads untransformed checkpoints only"
        stored[(index.fqn, None if index.offset is None else tuple(index.offset))] = info.length
    for fqn, entry in md.state_dict_metadata.items():
        if type(entry) is TensorStorageMetadata and md.storage_data is not None:
            # IMPORTANT: a chunk's elements fit in the bytes stored for it: a reader that
            # allocates from the sizes allocates no more than the files hold.
            itemsize = entry.properties.dtype.itemsize
            for chunk in entry.chunks:
                length = stored.get((fqn, tuple(chunk.offsets)))
                if length is None or math.prod(chunk.sizes) * itemsize > length:
                    return f"{fqn!r}: a chunk of {math.prod(chunk.sizes)} elements that {'no file holds' if length is None else f'{length} bytes cannot hold'}"
    if not (md.planner_data is None or type(md.planner_data) is dict):
        return "planner_data is not a dict"
    return None


def _tensor_problem(entry: TensorStorageMetadata) -> str | None:
    props = entry.properties
    if not (type(props) is TensorProperties and type(props.dtype) is torch.dtype and type(props.layout) is torch.layout
            and type(props.memory_format) is torch.memory_format and type(props.requires_grad) is bool
            and type(props.pin_memory) is bool):  # fmt: skip
        return "tensor properties (dtype, layout, memory format) that are not torch's"
    if not _is_size(entry.size):
        return "a size that is not a torch.Size of dimensions from 0 to 2**62"
    if type(entry.chunks) is not list:
        return "chunks that are not a list"
    for chunk in entry.chunks:
        if not (type(chunk) is ChunkStorageMetadata and _is_size(chunk.offsets) and _is_size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True))):  # fmt: skip
            return "a chunk that is not a box inside the tensor"
    return None


def _is_size(size: Any) -> bool:
    # torch.Size holds ints only: its constructor (the one way to make one) refuses the rest.
    return type(size) is torch.Size and (not size or (min(size) >= 0 and max(size) <= _DIM_MAX))


def _count(n: Any) -> bool:
    return type(n) is int and 0 <= n <= _DIM_MAX


def _plain_name(name: str) -> bool:
    """A file of the step directory, by name: no path, nothing hidden in it."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and name.isprintable()
