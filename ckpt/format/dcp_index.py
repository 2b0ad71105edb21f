"""`.metadata` in parts a restore can read alone (issue 40): DCP's `.metadata` holds every
piece of every tensor of every rank (about 160 bytes per tensor and rank: hundreds of MB for a
70B model on 1,000 ranks), and each rank would read and unpickle all of it to load its part.

Beside it (which stays, unchanged: the step directory is plain DCP), a save writes:

    __<r>_0.index   rank r: the entries of what its own data file holds (its pieces of the
                    tensors, its pickled values), as DCP metadata
    .index          rank 0: the entries of the values held once that many ranks load
                    (`shared_refs`: a replicated tensor saved as one piece, a pickled value),
                    as DCP metadata

A rank that restores on the world size that saved reads its own index and gets `.index`
from rank 0; their union covers what it loads (`ckpt.restore.partial` checks that, and reads
the whole `.metadata` where it does not: another world size, another model). Each is a pickle
of DCP's own metadata classes, read through `.metadata`'s allowlist after its checksum
matched the manifest.
"""

from __future__ import annotations

import re

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ckpt.format.manifest import SHARED_INDEX

__all__ = ["SHARED_INDEX", "index_name", "merged", "own_part", "shared_part", "shared_refs"]

INDEX_SUFFIX = ".index"

# An item this long or shorter is shared when it is held once: a torch.save'd scalar takes
# about 1 KiB, a pickled optimizer's hyperparameters a few hundred bytes. Longer replicated
# values (a DDP model's weights) are read by each rank that loads them.
SHARE_MAX = 64 << 10
# ckpt's per-rank values (rng.rank_3, loader.rank_3, extra.<name>.rank_3): held once, loaded
# by their own rank only, from its own file.
_PER_RANK = re.compile(r"(^|\.)rank_\d+(\.|$)")

Ref = tuple[str, int, int]  # an item: its file, offset and length


def index_name(data_name: str) -> str:
    """A rank's index beside its data file: __3_0.distcp -> __3_0.index."""
    return data_name.rpartition(".")[0] + INDEX_SUFFIX


def shared_refs(md: Metadata) -> list[Ref]:
    """The items of `md` that many ranks load and that are read once per job: short, held
    once (a pickled value, or a tensor saved as one piece), not a rank's own. In file order."""
    return sorted({(info.relative_path, info.offset, info.length) for index, info in md.storage_data.items() if _shared(md, index, info)})


def _shared(md: Metadata, index: MetadataIndex, info: _StorageInfo) -> bool:
    if info.length > SHARE_MAX or info.transform_descriptors or _PER_RANK.search(index.fqn):
        return False
    entry = md.state_dict_metadata.get(index.fqn)
    return isinstance(entry, BytesStorageMetadata) or (isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 1)


def shared_part(md: Metadata) -> Metadata:
    """`.index`: the entries of the shared items of the whole `md` (rank 0, at a save)."""
    keep = {index: info for index, info in md.storage_data.items() if _shared(md, index, info)}
    return Metadata({i.fqn: md.state_dict_metadata[i.fqn] for i in keep}, storage_data=keep, storage_meta=StorageMeta())


def own_part(items: list[WriteItem], written: dict[MetadataIndex, _StorageInfo]) -> Metadata:
    """A rank's index: the entries of the items it wrote (`items`, where `written` says)."""
    entries: dict[str, BytesStorageMetadata | TensorStorageMetadata] = {}
    for item in items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            entries[item.index.fqn] = BytesStorageMetadata()
            continue
        data = item.tensor_data
        entry = entries.setdefault(item.index.fqn, TensorStorageMetadata(data.properties, data.size, []))
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.append(data.chunk)
    return Metadata(entries, storage_data=dict(written), storage_meta=StorageMeta())


def merged(*parts: Metadata) -> Metadata:
    """One metadata of several parts (a rank's index and `.index`)."""
    entries: dict = {}
    storage: dict = {}
    for part in parts:
        entries.update(part.state_dict_metadata)
        storage.update(part.storage_data or {})
    return Metadata(entries, storage_data=storage, storage_meta=StorageMeta())
