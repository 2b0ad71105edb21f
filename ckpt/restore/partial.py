"""A restore reads the part of `.metadata` it needs, not all of it (issue 40).

Where the checkpoint has the index files (`ckpt.format.dcp_index`: one beside each data
file, and the shared `.index`), rank 0 reads `.index` and sends it over the job's group (each
rank checks it against the manifest); each rank reads the indexes of the data files that
hold its pieces (`.index`'s layout says which: `ckpt.format.dcp_layout`; on the world size
that saved, its own), and their union stands in for `.metadata`, if it covers every value
this rank loads: each piece of each tensor, whole. Where it does not on any rank (a model
that changed, a layout that is not a grid, a replicated model whose every rank would read
every index), every rank uses `.metadata` as before. A rank then reads O(what it loads) of
metadata, not O(tensors × ranks), on any world size."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ckpt.collectives import Group
from ckpt.errors import InvalidCheckpoint
from ckpt.format.dcp_index import index_name, merged
from ckpt.format.dcp_layout import LAYOUT, Budget, checked_layout, files_for
from ckpt.format.index_file import decode_index
from ckpt.format.manifest import MAX_INDEXES, METADATA_NAME, SHARED_INDEX, Manifest
from ckpt.restore.dcp_read import Parts
from ckpt.restore.planner import chunks_once
from ckpt.restore.shared_items import server
from ckpt.restore.view import fetch, saved_by
from ckpt.storage.store import Store
from ckpt.storage.verified import checked, read_verified

log = logging.getLogger(__name__)

_READERS = 8  # indexes read at once
# Saved pieces of one key that one piece a rank loads may overlap, in its indexes: a save's
# rank writes one piece of each tensor, and a rank reads at most MAX_INDEXES indexes.
_NEAR_MAX = 16 * MAX_INDEXES


def metadata_of(
    ctrl: Group, store: Store, rel: str, manifest: Manifest, state_dict: dict[str, Any], metadata: bytes | None,
    spool: Any = None,
) -> tuple[bytes | None, bool, Parts | None]:
    """What a rank of a job reads its metadata from (a collective when world > 1): this rank's
    part and the shared part (`partial_metadata`), or else `.metadata`, read once per job
    (`metadata_once`: its bytes, if read or kept, and whether they came from rank 0).
    `metadata`: on rank 0, the bytes of `.index` or `.metadata` the catalog checked and kept.
    `spool`: this rank's reader of its node's spool (`ckpt.node.handoff.Tiered`), where it holds
    files of the step: the indexes are read through it, and if any rank has one, each rank
    reads `.metadata`, where it must, itself (from its spool, mostly)."""
    kept = {name: metadata for name in (SHARED_INDEX, METADATA_NAME) if metadata is not None and _is(name, metadata, manifest)}
    if ctrl.world == 1:
        return kept.get(METADATA_NAME), False, None
    parts = partial_metadata(ctrl, spool or store, rel, manifest, state_dict, kept.get(SHARED_INDEX)) if manifest.indexed_for(ctrl.world) else None
    if parts is not None:
        return None, False, parts
    fetch(ctrl, manifest, None)  # a rank that reads `.metadata` may read any file: every entry
    if ctrl.any(spool is not None):  # a node's spool may hold the step and another's not: agreed
        return kept.get(METADATA_NAME), False, None
    return (*metadata_once(ctrl, store, rel, manifest, kept.get(METADATA_NAME)), None)


def _is(name: str, data: bytes, manifest: Manifest) -> bool:
    """Whether `data` are the bytes of `name` (the catalog kept those of one or the other)."""
    try:
        checked(name, name, manifest, data)
        return True
    except InvalidCheckpoint:
        return False


def partial_metadata(
    ctrl: Group, store: Store, rel: str, manifest: Manifest, state_dict: dict[str, Any], kept: bytes | None = None
) -> Parts | None:
    """This rank's part of the metadata and the shared part (which numbers the shared items
    alike on every rank), or None: every rank reads `.metadata` (a collective, when `usable`).
    `kept`: on rank 0, `.index` as the catalog checked it."""
    shared_bytes = kept
    if ctrl.rank == 0 and kept is None:
        try:
            shared_bytes = read_verified(store, rel, SHARED_INDEX, manifest)
        except Exception as e:  # every rank then reads .metadata
            log.warning("%s/%s/%s could not be read (%s): reading .metadata", store.display, rel, SHARED_INDEX, e)
    shared_bytes = ctrl.broadcast(shared_bytes)
    parts = None
    why = ""
    shared, names = None, None
    if shared_bytes is not None:
        try:
            shared = decode_index(checked(f"{store.display}/{rel}/{SHARED_INDEX}", SHARED_INDEX, manifest, shared_bytes), f"{rel}/{SHARED_INDEX}")
            names = indexes_to_read(shared, state_dict, manifest, ctrl.rank, ctrl.world)
            if names is None:
                why = "the index does not say where all of it is"
        except Exception as e:  # IMPORTANT: on this rank alone: all read .metadata, none left in a collective
            why = _unusable(ctrl, store, rel, e)
    # The entries of the files this rank may read, which its part of the manifest may lack (a
    # collective): the indexes it reads, their data files, and the data files whose shared
    # items it serves (`ckpt.restore.shared_items`).
    fetch(ctrl, manifest, _to_read(manifest, shared, names, ctrl.rank, ctrl.world) if shared is not None and names is not None else set())
    if shared is not None and names is not None:
        try:
            read = _read_indexes(store, rel, manifest, names)
            part = merged(shared, *(decode_index(data, f"{rel}/{name}") for name, data in read.items()))
            why = uncovered(part, state_dict)
            got = sum(map(len, read.values())) + (len(shared_bytes) if ctrl.rank == 0 else 0)  # kept: read by this restore's catalog
            parts = Parts(part, shared, got) if not why else None
        except Exception as e:  # IMPORTANT: on this rank alone (a store error, a bad index): all read .metadata, none left in `any`
            why = _unusable(ctrl, store, rel, e)
    if ctrl.any(parts is None):
        if why:
            log.debug("rank %d reads .metadata of %s: %s", ctrl.rank, rel, why)
        return None
    return parts


def _unusable(ctrl: Group, store: Store, rel: str, e: Exception) -> str:
    why = f"{type(e).__name__}: {e}"
    log.warning("rank %d: the index of %s/%s could not be used (%s): reading .metadata", ctrl.rank, store.display, rel, why)
    return why


def _to_read(manifest: Manifest, shared: Metadata, indexes: list[str], rank: int, world: int) -> set[str]:
    """The files a rank reads by the indexes (`indexes_to_read`): those indexes, their data
    files, and the data files of shared items it serves."""
    files = {*indexes, *(n.rpartition(".")[0] + ".distcp" for n in indexes)}  # a data file's index: `index_name`
    for info in shared.storage_data.values():
        name = info.relative_path
        saver = saved_by(manifest, name)
        if saver is not None and server(saver, manifest.world_size, world) == rank:
            files.add(name)
    return files


def indexes_to_read(shared: Metadata, state_dict: dict[str, Any], manifest: Manifest, rank: int, world: int) -> list[str] | None:
    """The indexes a rank reads besides `.index`: those of the data files that hold the pieces
    it loads (`.index`'s layout says which; on the world size that saved, its own too, which
    holds every key it saved), at most `MAX_INDEXES`; None: read `.metadata` (a key without a
    layout on another world size; a replicated model, which loads from every file)."""
    own = [n for n, e in manifest.files.items() if e.rank == rank and n.endswith(".distcp")] if manifest.world_size == world else []
    layout = checked_layout(shared.planner_data.get(LAYOUT)) if isinstance(shared.planner_data, dict) else None
    if layout is None:  # saved before the layout (or a bad one): its own index, on the same world size
        return [index_name(n) for n in own] if len(own) == 1 else None
    flat, _ = flatten_state_dict(state_dict)
    need: set[str] = set(own)
    empty: list[str] = []  # tensors of which this rank holds no element
    budget, layouts = Budget(), {}
    for fqn, obj in flat.items():
        if fqn in shared.state_dict_metadata or (isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None):
            continue  # held in `.index`; a tensor this rank holds no piece of
        pieces = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks_once(obj, layouts)] if isinstance(obj, torch.Tensor) else []
        if isinstance(obj, torch.Tensor) and not any(math.prod(p[1]) for p in pieces):
            empty.append(fqn)
            continue
        files = files_for(layout, fqn, pieces, budget)
        if files is None:
            if own:
                continue  # its own index holds what it saved: `uncovered` decides
            return None
        need |= files
        if len(need) > MAX_INDEXES:
            return None
    if empty and not need:  # every index holds each key its rank saved: one is needed
        files = files_for(layout, empty[0], [], budget)
        if not files:
            return None
        need |= files
    return sorted(index_name(n) for n in need)


def _read_indexes(store: Store, rel: str, manifest: Manifest, names: list[str]) -> dict[str, bytes]:
    """The indexes `names`, each checked against the manifest, read side by side."""
    if len(names) <= 1:
        return {n: read_verified(store, rel, n, manifest) for n in names}
    with ThreadPoolExecutor(min(len(names), _READERS), thread_name_prefix="ckpt-index") as pool:
        return dict(zip(names, pool.map(lambda n: read_verified(store, rel, n, manifest), names), strict=True))


def uncovered(md: Metadata, state_dict: dict[str, Any]) -> str:
    """Why `md` does not hold every piece this rank loads into `state_dict` ("" if it does):
    a key it lacks, another kind or size, or a piece of a tensor no chunk of it covers."""
    flat, _ = flatten_state_dict(state_dict)
    entries, layouts = md.state_dict_metadata, {}
    for fqn, obj in flat.items():
        entry = entries.get(fqn)
        if entry is None:
            return f"{fqn}: not in the index"
        if not isinstance(obj, torch.Tensor):
            if not isinstance(entry, BytesStorageMetadata):
                return f"{fqn}: a tensor in the index"
            if MetadataIndex(fqn) not in md.storage_data:
                return f"{fqn}: held in another rank's file"
            continue
        if not isinstance(entry, TensorStorageMetadata) or entry.size != obj.size():
            return f"{fqn}: another kind or size in the index"
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        if type(obj) not in (torch.Tensor, torch.nn.Parameter, DTensor):
            return f"{fqn}: a {type(obj).__name__}"
        for chunk in chunks_once(obj, layouts):
            # Only the saved pieces this one overlaps are checked against each other, and no
            # more than a save's indexes ever hold of one key: that check is quadratic, and an
            # index rewritten to list a tensor's every element as a piece (some MB) would keep
            # this rank in it for hours. More: `.metadata` says (DCP's planning is linear).
            near = [saved for saved in entry.chunks if _overlap(chunk, saved)]
            if len(near) > _NEAR_MAX:
                return f"{fqn}: {len(near)} saved pieces overlap the piece at {tuple(chunk.offsets)}"
            if any(_overlap(a, b) for i, a in enumerate(near) for b in near[i + 1 :]):
                return f"{fqn}: saved pieces that overlap"  # never written so: the count below would lie
            if sum(_overlap(chunk, saved) for saved in near) != math.prod(chunk.sizes):
                return f"{fqn}: a piece at {tuple(chunk.offsets)} is not whole in the index"
    return ""


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> int:
    """Elements two chunks of one tensor have in common (the saved chunks do not overlap)."""
    n = 1
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        n *= max(0, min(ao + asz, bo + bsz) - max(ao, bo))
    return n


def metadata_once(ctrl: Group, store: Store, rel: str, manifest: Manifest, metadata: bytes | None) -> tuple[bytes | None, bool]:
    """`.metadata` read from the store once per job, not once per rank: rank 0 reads it
    (unless the catalog kept it, checked) and sends it to the other ranks, each of which checks
    it against the manifest again before anything decodes it. Where rank 0 could not read it
    (or a copy does not check), a rank reads it itself, and fails there as it would have.
    Returns the bytes (None: read them from the store) and whether they came from rank 0."""
    if ctrl.rank == 0 and metadata is None:
        try:
            metadata = read_verified(store, rel, METADATA_NAME, manifest)
        except Exception:  # every rank then reads it itself, and says why it could not
            metadata = None
    got = ctrl.broadcast(metadata if ctrl.rank == 0 else None)
    if ctrl.rank == 0 or got is None:
        return metadata, False
    try:
        return checked(f"{store.display}/{rel}/{METADATA_NAME}", METADATA_NAME, manifest, got), True
    except InvalidCheckpoint:
        return None, False


def first_reads(manifest: Manifest, rank: int, world: int) -> list[str]:
    """The files a rank reads first: its metadata (on rank 0 `.index`; on the world size that
    saved, its own index; else `.metadata`), then, on the world size that saved the
    checkpoint, its own data files (on another, its plan picks parts of several)."""
    same = manifest.world_size == world
    if manifest.indexed_for(world):
        mine = sorted((n for n, e in manifest.files.items() if e.rank == rank and same), key=lambda n: (not n.endswith(".index"), n))
        return ([SHARED_INDEX] if rank == 0 else []) + mine
    names = [METADATA_NAME]
    if same:
        names += sorted(n for n, e in manifest.files.items() if e.rank == rank and n.endswith(".distcp"))
    return names
