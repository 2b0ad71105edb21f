"""What the admin CLI does with whole checkpoints: copy one between roots, read its tensors
whole (for `diff` and `export`), and plan a restore on another world size (`load-test`).

Everything read goes through the manifest's checksums (`ckpt.storage.catalog`), pickled values load
with `weights_only=True`, and a copy commits (writes the manifest) only after every file
arrived and matched.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt._faults import fault_point
from ckpt.errors import CheckpointError, InvalidCheckpoint, dcp_causes, dcp_failures
from ckpt.format.manifest import MANIFEST_NAME, MAX_INDEXES, METADATA_NAME, SHARED_INDEX, Manifest
from ckpt.storage import catalog, verified
from ckpt.storage.store import Store, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey

log = logging.getLogger(__name__)

CHUNK = 8 << 20
BATCH_BYTES = 1 << 30  # tensors read whole at a time, by diff and export


class Progress:
    """A one-line progress bar on stderr (only on a terminal, or when asked)."""

    def __init__(self, total: int, what: str, enabled: bool | None = None) -> None:
        self.total, self.what, self.done = max(total, 1), what, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._began = self._shown = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._shown > 0.1 or self.done >= self.total):
            self._shown = now
            frac = min(self.done / self.total, 1.0)
            rate = self.done / max(now - self._began, 1e-9)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.what} [{bar:<30}] {frac:4.0%} {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB {rate / 1e6:.0f} MB/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


# -- cp -----------------------------------------------------------------------------------------
@dataclass
class Copied:
    step: int
    files: int  # copied now
    resumed: int  # already at the destination, verified, not copied again
    bytes: int  # copied now
    already: bool = False  # the destination held this checkpoint committed already


def copy(src: Store, dst: Store, step: int | None = None, progress: bool | None = None, key: SigningKey | None = None) -> Copied:
    """Copy a committed checkpoint (the newest when `step` is None; with `key`, signed with
    it) from `src` to `dst`.
    Every byte read is checked against the manifest and the manifest is written last: an
    interrupted copy is an incomplete directory at `dst`, and the next copy keeps the files
    that arrived whole (verified again) and copies the rest."""
    if _within(dst, src):
        raise ValueError(f"the destination {dst.display} is the source root or inside it: copy somewhere else")
    entry = catalog.find(src, step, key)
    manifest = entry.manifest
    assert manifest is not None
    rel = entry.dir
    there = dst.list_step(entry.step)
    if there is not None and there.has_manifest:
        theirs = Manifest.from_json(dst.read_bytes(f"{rel}/{MANIFEST_NAME}"), f"{dst.display}/{rel}")
        if {n: f.checksum for n, f in theirs.files.items()} != {n: f.checksum for n, f in manifest.files.items()}:
            raise CheckpointError(f"{dst.display}/{rel} holds another checkpoint of step {entry.step}; not overwriting it")
        if all(there.files.get(n) == f.size for n, f in manifest.files.items()):
            return Copied(entry.step, 0, len(manifest.files), 0, already=True)
        # The same checkpoint, but a file is missing or cut short there: repaired below (the
        # files of the right size verified, the rest copied again), the same manifest last.
        # IMPORTANT: uncommitted meanwhile, so that nobody restores it half repaired.
        dst.remove(f"{rel}/{MANIFEST_NAME}")
        there = dst.list_step(entry.step)
    bar = Progress(manifest.total_bytes, f"{step_dir_name(entry.step)}", progress)
    copied = resumed = sent = 0
    try:
        for name, f in sorted(manifest.files.items()):
            if there is not None and there.files.get(name) == f.size and _intact(dst, rel, name, manifest):
                resumed += 1
                bar.add(f.size)
                continue
            with verified.VerifyingReader.open(src, rel, name, manifest) as reader, dst.open_write(f"{rel}/{name}", f.size) as out:
                left = f.size
                while left:
                    data = reader.read(min(CHUNK, left))
                    out.write(data)
                    left -= len(data)
                    bar.add(len(data))
                reader.finish()  # IMPORTANT: inside the write, so a mismatch leaves no file behind
            copied, sent = copied + 1, sent + f.size
            fault_point("copy_file", 0, entry.step)
        # IMPORTANT: the commit, after every file is there and matched.
        dst.put_atomic(f"{rel}/{MANIFEST_NAME}", manifest.to_json())
    finally:
        bar.close()
    return Copied(entry.step, copied, resumed, sent)


def _within(inner: Store, outer: Store) -> bool:
    """Is `inner` the root `outer` or a directory under it (the same endpoint, for S3)?"""
    if inner.is_local != outer.is_local:
        return False
    if inner.is_local:
        return inner.identity == outer.identity or inner.identity.startswith(outer.identity.rstrip(os.sep) + os.sep)
    endpoint = inner.identity[len(inner.where) :], outer.identity[len(outer.where) :]
    return endpoint[0] == endpoint[1] and (inner.where == outer.where or inner.where.startswith(outer.where.rstrip("/") + "/"))


def _intact(store: Store, rel: str, name: str, manifest: Manifest) -> bool:
    try:
        verified.verify_file(store, rel, name, manifest)
        return True
    except CheckpointError:
        return False


# -- reading tensors whole ----------------------------------------------------------------------
def inventory(store: Store, entry: catalog.Entry) -> Any:
    """The checkpoint's DCP metadata (checksum-verified, read through the allowlist)."""
    from ckpt.format.dcp_metadata import load_metadata

    assert entry.manifest is not None
    return load_metadata(verified.read_verified(store, entry.dir, METADATA_NAME, entry.manifest))


def read_whole(store: Store, entry: catalog.Entry, keys: list[str], metadata: Any) -> dict[str, Any]:
    """The values of `keys`, full tensors (every shard put together) and objects."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckpt.restore.dcp_read import make_reader
    from ckpt.restore.planner import SafeLoadPlanner

    assert entry.manifest is not None
    sd: dict[str, Any] = {}
    for key in keys:
        item = metadata.state_dict_metadata[key]
        sd[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(sd, storage_reader=make_reader(store, entry.dir, entry.manifest), planner=planner, no_dist=True)
    except CheckpointException as e:  # DCP's wrapper, a BaseException: what it holds, in one line
        first = dcp_failures(e)[0]
        if isinstance(first, CheckpointError):
            raise first from None
        raise InvalidCheckpoint(f"{store.display}/{entry.dir}: {dcp_causes(e)}") from None
    return sd


def batches(metadata: Any, keys: list[str], limit: int = BATCH_BYTES) -> Iterator[list[str]]:
    """`keys` in groups of at most `limit` bytes of tensors (one key at least)."""
    group: list[str] = []
    size = 0
    for key in keys:
        n = tensor_bytes(metadata.state_dict_metadata[key])
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(key)
        size += n
    if group:
        yield group


def tensor_bytes(item: Any) -> int:
    size = getattr(item, "size", None)
    if size is None:
        return 0
    return math.prod(size) * item.properties.dtype.itemsize


# -- load-test ----------------------------------------------------------------------------------
def plan_reads(store: Store, entry: catalog.Entry, world: int) -> list[dict[str, Any]]:
    """What each of `world` ranks would read to restore this checkpoint into a job that
    shards model and optimizer state along the first dimension as FSDP2 does (evenly, the
    last ranks shorter), where rank r reads the RNG (and, on the same world size, the data
    loader state) saved by rank r, and every rank reads the rest (counters, data position,
    extras) whole. Counts what the verified reader fetches from the store: the metadata (the
    indexes of the files a rank reads from and rank 0's `.index`, where the checkpoint has
    them; else `.metadata` on rank 0, which sends it on: `ckpt.restore.partial`); whole blocks of the files holding the
    rows (a file without block checksums is read whole); the small values all ranks load only
    on the rank that serves their file (`ckpt.restore.shared_items`).
    Rank r's dict: bytes, files, and the bytes of state it ends up holding."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckpt.format.dcp_index import index_name, shared_refs
    from ckpt.restore.shared_items import server

    md = inventory(store, entry)
    manifest = entry.manifest
    assert manifest is not None
    shared = set(shared_refs(md))  # read by the rank that serves their file, sent to the others
    servers = {n: server(e.rank, manifest.world_size, world) for n, e in manifest.files.items() if e.rank >= 0}
    indexed = manifest.indexed_for(world)
    plans: list[dict[str, Any]] = []
    for rank in range(world):
        spans: dict[str, list[tuple[int, int]]] = {}
        needs: set[str] = set()  # the files whose index this rank reads
        holds = 0
        for key, item in md.state_dict_metadata.items():
            owner = _PER_RANK.match(key)
            if owner and (int(owner.group(2)) != rank or (owner.group(1) == "loader" and world != manifest.world_size)):
                continue  # another rank's RNG, or a loader state that cannot apply here
            if not isinstance(item, TensorStorageMetadata) or (len(item.chunks) == 1 and not item.size):
                holds += tensor_bytes(item) if isinstance(item, TensorStorageMetadata) else 0
                info = md.storage_data[_index(key, item.chunks[0].offsets if isinstance(item, TensorStorageMetadata) else None)]
                if (info.relative_path, info.offset, info.length) not in shared:
                    needs.add(info.relative_path)
                if world == 1 or (info.relative_path, info.offset, info.length) not in shared or servers.get(info.relative_path) == rank:
                    spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
                continue
            rows = item.size[0] if item.size else 1
            sharded = key.startswith(("model.", "optim.state.")) and len(item.size) > 0
            lo, hi = _rows(rows, world, rank) if sharded else (0, rows)
            holds += tensor_bytes(item) * (hi - lo) // max(rows, 1)
            for i, chunk in enumerate(item.chunks):
                start = chunk.offsets[0] if len(chunk.offsets) else 0
                n = chunk.sizes[0] if len(chunk.sizes) else 1
                first, last = max(lo, start), min(hi, start + n)
                if first >= last:
                    continue
                info = md.storage_data[_index(key, chunk.offsets, i)]
                needs.add(info.relative_path)
                row = info.length // max(n, 1)  # a chunk's rows lie one after another
                end = info.offset + info.length
                spans.setdefault(info.relative_path, []).extend(
                    [
                        (info.offset, info.offset + min(info.length, 4096)),  # the blob's header, read first
                        (info.offset + (first - start) * row, info.offset + (last - start) * row),
                        (end - 1, end),  # its trailer, checked last
                    ]
                )
        fetched = sum(_fetched(manifest, name, s) for name, s in spans.items())
        if indexed and len(needs) <= MAX_INDEXES:  # those files' indexes, on rank 0 the shared one too
            names = [index_name(n) for n in needs] + ([SHARED_INDEX] if rank == 0 else [])
        else:  # rank 0 reads .metadata and sends it on
            names = [METADATA_NAME] if rank == 0 else []
        metadata = sum(manifest.files[n].size for n in names)
        plans.append({"rank": rank, "bytes": fetched + metadata, "files": len(spans) + len(names), "state_bytes": holds})
    return plans


_PER_RANK = re.compile(r"^(rng|loader)\.rank_(\d+)(\.|$)")  # read by that rank alone (ckpt.capture.state)


def _index(key: str, offsets: Any = None, i: int = 0) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, offsets, i) if offsets is not None else MetadataIndex(key)


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def _fetched(manifest: Manifest, name: str, spans: list[tuple[int, int]]) -> int:
    """Bytes the reader fetches of `name` for those byte ranges: the blocks holding them."""
    entry = manifest.files[name]
    if not entry.block:
        return entry.size
    blocks = {b for start, end in spans for b in range(start // entry.block, (max(end, start + 1) - 1) // entry.block + 1)}
    return sum(min(entry.block, entry.size - b * entry.block) for b in blocks)
