"""`.metadata` in parts a restore can read alone (issue 40): DCP's `.metadata` holds every
piece of every tensor of every rank (about 160 bytes per tensor and rank: hundreds of MB for a
70B model on 1,000 ranks), and each rank would read and unpickle all of it to load its part.

Beside it (which stays, unchanged: the step directory is plain DCP), a save writes:

    __<r>_0.index   rank r: the entries of what its own data file holds (its pieces of the
                    tensors, its pickled values), as DCP metadata
    .index          rank 0: the entries of the values held once that many ranks load
                    (`shared_refs`: a replicated tensor saved as one piece, a pickled value),
                    as DCP metadata

A rank that restores gets `.index` from rank 0 and reads the indexes of the files its pieces
are in (`.index` says which: `ckpt.format.dcp_layout`; its own, on the world size that
saved); their union covers what it loads (`ckpt.restore.partial` checks that, and reads the
whole `.metadata` where it does not: another model, a layout that is not a grid). Each is a pickle
of DCP's own metadata classes, read through `.metadata`'s allowlist after its checksum
matched the manifest.
"""

from __future__ import annotations

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ckpt.format.dcp_layout import LAYOUT, PER_RANK, layout_of
from ckpt.format.manifest import SHARED_INDEX, index_name

__all__ = ["SHARED_INDEX", "index_name", "merged", "own_part", "shared_part", "shared_refs"]

# An item this long or shorter is shared when it is held once: a torch.save'd scalar takes
# about 1 KiB, a pickled optimizer's hyperparameters a few hundred bytes. Longer replicated
# values (a DDP model's weights) are read by each rank that loads them.
SHARE_MAX = 64 << 10

Ref = tuple[str, int, int]  # an item: its file, offset and length


def shared_refs(md: Metadata) -> list[Ref]:
    """The items of `md` that many ranks load and that are read once per job: short, held
    once (a pickled value, or a tensor saved as one piece), not a rank's own. In file order."""
    return sorted({(info.relative_path, info.offset, info.length) for index, info in md.storage_data.items() if _shared(md, index, info)})


def _shared(md: Metadata, index: MetadataIndex, info: _StorageInfo) -> bool:
    if info.length > SHARE_MAX or info.transform_descriptors or PER_RANK.search(index.fqn):
        return False
    entry = md.state_dict_metadata.get(index.fqn)
    return isinstance(entry, BytesStorageMetadata) or (isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 1)


def shared_part(md: Metadata) -> Metadata:
    """`.index`: the entries of the shared items of the whole `md` (rank 0, at a save)."""
    keep = {index: info for index, info in md.storage_data.items() if _shared(md, index, info)}
    # planner_data (a dict: DCP's own .metadata keeps its flattening there): every key the
    # checkpoint holds, which a restore warns of when no rank asked for it.
    # And where each piece of each value is (`ckpt.format.dcp_layout`): a restore on another
    # world size reads the indexes of the files it loads from.
    # ckpt's own per-rank RNG and loader states, restored by their rank's rules, are not
    # listed: at 10,000 ranks they would be most of the list.
    listed = sorted(k for k in md.state_dict_metadata if not (k.startswith(("rng.", "loader.")) and PER_RANK.search(k)))
    held = {_HELD: listed, LAYOUT: layout_of(md)}
    return Metadata({i.fqn: md.state_dict_metadata[i.fqn] for i in keep}, planner_data=held, storage_data=keep, storage_meta=StorageMeta())


def own_part(items: list[WriteItem], written: dict[MetadataIndex, _StorageInfo], asked: list[WriteItem] = ()) -> Metadata:
    """A rank's index: the entries of the items it wrote (`items`, where `written` says), and
    of every other value it asked to save (`asked`: its plan before DCP kept one copy of each
    replicated piece) with no piece of it here: an empty shard, a copy saved by another rank.
    A restore then knows the key and finds what it covers (an empty shard: all of it)."""
    entries: dict[str, BytesStorageMetadata | TensorStorageMetadata] = {}
    for item in asked:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            entries.setdefault(item.index.fqn, TensorStorageMetadata(item.tensor_data.properties, item.tensor_data.size, []))
        else:
            entries.setdefault(item.index.fqn, BytesStorageMetadata())
    for item in items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            entries[item.index.fqn] = BytesStorageMetadata()
            continue
        data = item.tensor_data
        entry = entries.get(item.index.fqn)
        if not isinstance(entry, TensorStorageMetadata):
            entries[item.index.fqn] = entry = TensorStorageMetadata(data.properties, data.size, [])
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.append(data.chunk)
    return Metadata(entries, storage_data=dict(written), storage_meta=StorageMeta())


def merged(*parts: Metadata) -> Metadata:
    """One metadata of several parts (a rank's index and `.index`)."""
    entries: dict = {}
    storage: dict = {}
    keys = None
    for part in parts:
        for fqn, entry in part.state_dict_metadata.items():
            had = entries.get(fqn)
            if isinstance(had, TensorStorageMetadata) and isinstance(entry, TensorStorageMetadata):
                seen = {(tuple(c.offsets), tuple(c.sizes)) for c in had.chunks}
                chunks = had.chunks + [c for c in entry.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen]
                entries[fqn] = TensorStorageMetadata(had.properties, had.size, chunks)
            else:
                entries[fqn] = entry
        storage.update(part.storage_data or {})
        keys = part.planner_data if _held_list(part) is not None else keys
    return Metadata(entries, planner_data=keys, storage_data=storage, storage_meta=StorageMeta())


def held_keys(md: Metadata) -> list[str]:
    """Every key the checkpoint holds (`.index`'s list, in a part of the metadata, leaves out
    ckpt's per-rank RNG and loader states), else its own."""
    held = _held_list(md)
    return held if held is not None else list(md.state_dict_metadata)


_HELD = "ckpt.held_keys"


def _held_list(md: Metadata) -> list[str] | None:
    held = md.planner_data.get(_HELD) if isinstance(md.planner_data, dict) else None
    return held if isinstance(held, list) and all(type(k) is str for k in held) else None
