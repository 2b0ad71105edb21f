"""ckpt's index files (`.index`, `__<r>_0.index`) as JSON: read at every restore by every rank,
so read fast, and parsed by a decoder that cannot run anything.

DCP's `.metadata` stays a pickle (plain DCP reads it); ckpt's own indexes need not be one. A
pickle must go through ckpt's restricted unpickler (`ckpt.format.dcp_metadata`), which checks
every opcode in Python: about 2-4 MB/s. The same entries as JSON take a third of the bytes and
decode some ten times faster (`bench/scale.py` measures both), which is what lets a restore at
10,000 ranks stay near the store's bandwidth bound (`docs/at-scale.md`).

    {"ckpt_index": 1, "version": DCP's metadata version,
     "files":   [data file, ...],
     "props":   [[dtype, layout, requires_grad, memory format, pin_memory], ...] (torch's names),
     "keys":    [[fqn, "b"], [fqn, "t", props number, [size], [[offsets], [sizes]], ...], ...],
     "pieces":  [[key number, [offsets] or null, index or null, file number, offset, length,
                  [transforms] or null], ...],
     "planner": planner_data, tuples as {"t": [...]} and dicts as {"d": [[key, value], ...]}}

Decoding builds DCP's metadata classes from those plain values,
then checks the whole as `.metadata` is checked (types and ranges); an index written by an
earlier ckpt (a pickle) is read through the restricted unpickler, as before.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import InvalidCheckpoint
from ckpt.format.dcp_metadata import load_metadata, malformed

_FORMAT = 1
# torch's values by the names str() gives them ("torch.float32"): the only ones an index names.
_NAMED = {str(v): v for v in vars(torch).values() if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))}


def encode_index(md: Metadata) -> bytes:
    """An index's bytes (a rank's part of the metadata, or `.index`)."""
    keys: list[list[Any]] = []
    props: dict[tuple, int] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            p = entry.properties
            kind = (str(p.dtype), str(p.layout), p.requires_grad, str(p.memory_format), p.pin_memory)
            chunks = [[list(c.offsets), list(c.sizes)] for c in entry.chunks]
            keys.append([fqn, "t", props.setdefault(kind, len(props)), list(entry.size), *chunks])
        else:
            keys.append([fqn, "b"])
    number = {key[0]: i for i, key in enumerate(keys)}
    files: dict[str, int] = {}
    pieces = [
        [number.get(i.fqn, i.fqn), None if i.offset is None else list(i.offset), i.index, files.setdefault(s.relative_path, len(files)),
         s.offset, s.length, None if s.transform_descriptors is None else list(s.transform_descriptors)]
        for i, s in (md.storage_data or {}).items()
    ]  # fmt: skip
    doc = {"ckpt_index": _FORMAT, "version": md.version, "files": list(files), "props": [list(k) for k in props],
           "keys": keys, "pieces": pieces, "planner": _tagged(md.planner_data)}  # fmt: skip
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def decode_index(blob: bytes, where: str) -> Metadata:
    """An index from checksum-verified bytes: JSON as `encode_index` writes it, or a pickle of
    an earlier ckpt (through `.metadata`'s allowlist). InvalidCheckpoint if it is neither."""
    if blob[:1] == b"\x80":  # a pickle (protocol 2 and up)
        return load_metadata(blob, where)
    try:
        md = _built(json.loads(blob))
    except InvalidCheckpoint:
        raise
    except Exception as e:  # a wrong type anywhere, too deep, not JSON
        raise InvalidCheckpoint(f"{where} is not an index ckpt writes: {type(e).__name__}: {str(e)[:200]}") from e
    problem = malformed(md)
    if problem:
        raise InvalidCheckpoint(f"{where} is not an index ckpt writes: {problem}")
    return md


def _built(doc: Any) -> Metadata:
    if not (type(doc) is dict and doc.get("ckpt_index") == _FORMAT):
        raise ValueError("no ckpt_index of a format this ckpt reads")
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    kinds = [_properties(_list(p)) for p in _list(doc["props"])]  # each entry gets its own copy
    files = [_str(f) for f in _list(doc["files"])]
    for key in _list(doc["keys"]):
        fqn, kind = _str(key[0]), key[1]
        if kind == "b" and len(key) == 2:
            entries[fqn] = BytesStorageMetadata()
        elif kind == "t" and len(key) >= 4:
            props = TensorProperties(*_at(kinds, key[2]))
            chunks = [ChunkStorageMetadata(_size(c[0]), _size(c[1])) for c in key[4:] if type(c) is list and len(c) == 2]
            if len(chunks) != len(key) - 4:
                raise ValueError(f"{fqn}: a chunk that is not [offsets, sizes]")
            entries[fqn] = TensorStorageMetadata(props, _size(key[3]), chunks)
        else:
            raise ValueError(f"{fqn}: an entry of kind {str(kind)[:20]!r}")
    names = list(entries)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for p in _list(doc["pieces"]):
        if len(_list(p)) != 7:
            raise ValueError("a piece that is not 7 fields")
        key, offset, index, name, at, length, transforms = p
        fqn = _at(names, key) if type(key) is int else _str(key)
        where = MetadataIndex(fqn, None if offset is None else _size(offset), None if index is None else _int(index))
        steps = None if transforms is None else [_str(t) for t in _list(transforms)]
        storage[where] = _StorageInfo(_at(files, name), _int(at), _int(length), steps)
    version = doc.get("version")
    if not (version is None or type(version) is str):
        raise ValueError("a version that is not a string")
    return Metadata(entries, planner_data=_untagged(doc.get("planner")), storage_data=storage, storage_meta=StorageMeta(), version=version)


def _tagged(value: Any) -> Any:
    """`value` in JSON's types, keeping which sequences were tuples and which dicts were dicts."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_tagged(v) for v in value]
    if isinstance(value, tuple):  # torch.Size too: read back as a tuple
        return {"t": [_tagged(v) for v in value]}
    if type(value) is dict:
        return {"d": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    raise ValueError(f"planner data holds a {type(value).__name__}, which an index does not keep")


def _untagged(value: Any) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_untagged(v) for v in value]
    if type(value) is dict and len(value) == 1 and type(value.get("t")) is list:
        return tuple(_untagged(v) for v in value["t"])
    if type(value) is dict and len(value) == 1 and type(value.get("d")) is list:
        out = {}
        for pair in value["d"]:
            if not (type(pair) is list and len(pair) == 2):
                raise ValueError("a dict entry that is not [key, value]")
            k = _untagged(pair[0])
            if type(k) not in (str, int, tuple) or (type(k) is tuple and not all(type(x) in (str, int) for x in k)):
                raise ValueError("a dict key that is not a string, an int or a tuple of them")
            out[k] = _untagged(pair[1])
        return out
    raise ValueError(f"planner data of a kind an index does not write: {str(value)[:40]!r}")


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise ValueError(f"{str(value)[:40]!r} is not a list")
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"{str(value)[:40]!r} is not a string")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"{str(value)[:40]!r} is not an integer")
    return value


def _properties(p: list[Any]) -> tuple[Any, ...]:
    """TensorProperties' fields, in order."""
    if len(p) != 5:
        raise ValueError("tensor properties that are not 5 fields")
    dtype, layout, grad, memory_format, pinned = p
    return _named(dtype, torch.dtype), _named(layout, torch.layout), _bool(grad), _named(memory_format, torch.memory_format), _bool(pinned)


def _at(table: list[Any], number: Any) -> Any:
    """`table[number]`: a number that is not in the table (negative ones too) is refused."""
    if not (type(number) is int and 0 <= number < len(table)):
        raise ValueError(f"{str(number)[:40]!r} is not a number of one of the {len(table)} entries")
    return table[number]


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{str(value)[:40]!r} is not true or false")
    return value


def _named(name: Any, kind: type) -> Any:
    value = _NAMED.get(_str(name))
    if type(value) is not kind:
        raise ValueError(f"{name[:40]!r} is not a {kind.__name__} of torch")
    return value


def _size(value: Any) -> torch.Size:
    """A list of ints as a torch.Size (whose constructor refuses anything else; JSON's true
    and false are 1 and 0 to it); the ranges are checked with the whole (`malformed`)."""
    if type(value) is not list:
        raise ValueError(f"{str(value)[:40]!r} is not a list")
    return torch.Size(value)
