"""The commit that whoever finishes last makes, and who owns a step directory of the root.

Each rank's files become durable in the root (uploaded by the node agent, or written by
the rank itself), and the checkpoint commits when every rank's are:

    <root>/step-N/.claim                         the save that owns the step directory now
    <root>/step-N/.durable/<save id>.rank-00003   one per rank, after its files are durable
    <root>/step-N/manifest.json                  written by whoever saw the last marker

Each party writes its marker and then lists the markers, so of any two the later one sees
both: the last one always commits. Writing the manifest twice is harmless (the same
checkpoint), and a party that died between its marker and the manifest is covered by the
others, which look again while they wait: the party of rank 0 lists the markers again, the
others look for the manifest alone and list only once the save is `TAKE_OVER_S` overdue (rank
0's party died too). A party's requests per save stay O(1) at any number of ranks, not a LIST
of every rank's marker from every node every few seconds. A rank whose node has no agent (or a full spool)
writes to the root itself and takes part the same way. On a local root every write here
goes through no link (`ckpt.storage.nofollow`): the agent writes there for whoever wrote
the request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from ckpt.errors import CheckpointError, InvalidCheckpoint, NotFound
from ckpt.format.manifest import MANIFEST_MAX, MANIFEST_NAME, Manifest, SaveCosts
from ckpt.node.spool import Request, rank_name
from ckpt.storage.nofollow import fsync_dir, new_file, put_file
from ckpt.storage.store import Store, storage_errors

DURABLE_DIR = ".durable"
# Seconds after its own marker a party that does not hold rank 0 starts listing the markers too.
TAKE_OVER_S = 60.0
CLAIM_NAME = ".claim"  # in a step directory of the root: the save that owns it now


def marker_name(save_id: str, rank: int) -> str:
    return f"{save_id}.{rank_name(rank)}"


def committed_name(save_id: str) -> str:
    """Beside the markers, once save `save_id` committed: the others need not read the
    manifest (one entry per file: tens of MB at 10,000 ranks) to know it is theirs."""
    return f"{save_id}.committed"


def draft_name(save_id: str) -> str:
    """Beside the markers, from rank 0 before any rank hands off: the manifest to commit. The
    ranks' requests carry its checksum, not it (tens of MB at 10,000 ranks, in every request)."""
    return f"{save_id}.draft"


def write_draft(store: Store, rel: str, save_id: str, manifest: Manifest) -> dict[str, Any]:
    """Rank 0: put the draft of save `save_id` in the root; what each request says of it."""
    data = manifest.to_json()
    put(store, f"{rel}/{DURABLE_DIR}/{draft_name(save_id)}", data)
    return {"checksum": hashlib.sha256(data).hexdigest(), "size": len(data), "digest": files_digest(json.loads(data)["files"]).decode()}


def _drafted(store: Store, request: Request) -> Manifest:
    """The manifest to commit: the request's own, or rank 0's draft in the root, read and
    checked against the request (its bytes' checksum, its step and world, this rank's files).
    IMPORTANT: whoever can write the root could put another draft there; the request (in the
    node's spool, or this rank's own) says which one."""
    if not request.draft:
        return request.manifest_obj()
    rel = f"{request.rel}/{DURABLE_DIR}/{draft_name(request.save_id)}"
    where = f"{store.display}/{rel}"
    size = request.draft.get("size")
    data = store.read_small(rel, size) if isinstance(size, int) and 0 < size <= MANIFEST_MAX else None
    if data is None or len(data) != request.draft.get("size") or hashlib.sha256(data).hexdigest() != request.draft.get("checksum"):
        raise InvalidCheckpoint(f"{where}: not the draft this save's ranks handed off (its size or checksum differs)")
    manifest = Manifest.from_json(data, where)
    mine = request.manifest.get("files", {})
    if manifest.step != request.step or manifest.world_size != request.world or any(
        n not in manifest.files or manifest.files[n].checksum != mine.get(n, {}).get("checksum") for n in request.files
    ):
        raise InvalidCheckpoint(f"{where}: of another step or world, or not listing this rank's files as it wrote them")
    return manifest


def _digest(request: Request) -> bytes:
    """`files_digest` of what the request's save commits."""
    return str(request.draft["digest"]).encode() if request.draft else files_digest(request.manifest.get("files"))


def files_digest(files: Any) -> bytes:
    """What the commit's record holds: a digest of every file's name and checksum in the
    committed manifest, which each party compares with its own request's (a record with the
    save's name over other files, a forger's or another save's, vouches for nothing)."""
    h = hashlib.sha256()
    for name in sorted(files) if isinstance(files, dict) else ():
        entry = files[name]
        h.update(json.dumps([name, entry.get("checksum") if isinstance(entry, dict) else None]).encode())
    return h.hexdigest().encode()


def mark_durable(store: Store, rel: str, save_id: str, rank: int, files: dict[str, str]) -> None:
    """Record in the root that `rank`'s files of save `save_id` are durable there."""
    doc = {"save_id": save_id, "rank": rank, "files": files, "time": time.time()}
    put(store, f"{rel}/{DURABLE_DIR}/{marker_name(save_id, rank)}", json.dumps(doc).encode())


def commit_if_complete(store: Store, request: Request, markers: bool = True) -> str | None:
    """Write the manifest if every rank's marker of this save is there. Returns "committed"
    (this call wrote it), "found" (it was there already), "superseded" (another save of the
    step committed it, or claimed it) or None (a rank is not durable yet, or, without
    `markers`, not committed yet: the markers are not listed). Idempotent: any party may call
    it any number of times."""
    rel = request.rel
    found = committed_as_requested(store, request)
    if found is not None:
        return "found" if found else "superseded"
    if superseded(store, request):
        return "superseded"
    if not markers:
        return None
    durable = set(store.list_dir(f"{rel}/{DURABLE_DIR}"))
    if not all(marker_name(request.save_id, r) in durable for r in range(request.world)):
        return None
    manifest = _drafted(store, request)
    # `created` stays the draft's: commits of different steps may land out of order (one
    # node slower), and the order of the saves is what restore and retention go by.
    # IMPORTANT: a signed draft is committed exactly as signed (its persist time stays the
    # hand-off's): the signing key never leaves the trainer, so no one here could sign again.
    if manifest.signature is None:
        persist_s = max(time.time() - request.started, 0.0)
        manifest = dataclasses.replace(manifest, costs=SaveCosts(manifest.costs.blocking_s, persist_s, manifest.costs.bytes))
    # IMPORTANT: the commit. Every rank's files are durable: their markers say so.
    put(store, f"{rel}/{MANIFEST_NAME}", manifest.to_json())
    # After the commit, never before it: a party that finds no such record reads the manifest.
    with contextlib.suppress(CheckpointError):
        put(store, f"{rel}/{DURABLE_DIR}/{committed_name(request.save_id)}", _digest(request))
    return "committed"


# -- which save owns a step directory ----------------------------------------------------------
def claim(store: Store, rel: str, save_id: str) -> None:
    """Rank 0, when a save (with an agent) starts: this save owns the step directory now.
    An agent that finds another save's claim uploads nothing of its own (a stale hand-off)."""
    put(store, f"{rel}/{CLAIM_NAME}", save_id.encode())


def superseded(store: Store, request: Request) -> str | None:
    """Why the request's save no longer owns its step directory (a later save of the same
    step claimed it, or committed it), or None."""
    with contextlib.suppress(NotFound):
        owner = store.read_bytes(f"{request.rel}/{CLAIM_NAME}").decode(errors="replace")
        if owner != request.save_id:
            return f"{request.rel} was claimed by a later save of the same step"
    return None


def committed_as_requested(store: Store, request: Request) -> bool | None:
    """Is the step committed with this request's files (True), committed by another save
    (False), or not committed (None)? The committer's record says so in a few bytes, if it
    names these files; without it (a committer that died after the manifest, an earlier
    ckpt's), or naming others, the manifest is read."""
    with contextlib.suppress(NotFound):
        if store.read_bytes(f"{request.rel}/{DURABLE_DIR}/{committed_name(request.save_id)}") == _digest(request):
            return True
    try:
        doc = json.loads(store.read_bytes(f"{request.rel}/{MANIFEST_NAME}"))
    except NotFound:
        return None
    except ValueError:
        return False
    ours = request.manifest.get("files", {})
    theirs = doc.get("files", {}) if isinstance(doc, dict) else {}
    return all(isinstance(theirs.get(n), dict) and theirs[n].get("checksum") == ours[n]["checksum"] for n in request.files)


# -- writes into the root, never through a link on a local one ------------------------------------
@contextlib.contextmanager
def open_new(store: Store, rel: str, size: int | None = None) -> Iterator[BinaryIO]:
    """`Store.open_write`, but on a local root through `new_file`: never through a link."""
    if not store.is_local:
        with store.open_write(rel, size) as f:
            yield f
        return
    with storage_errors(f"writing {store.display}/{rel}"), new_file(*_in_root(store, rel)) as f:
        yield f


def put(store: Store, rel: str, data: bytes) -> None:
    """`Store.put_atomic`, but on a local root through `new_file`: never through a link."""
    if not store.is_local:
        store.put_atomic(rel, data)
        return
    base, path = _in_root(store, rel)
    directory = os.path.dirname(path)
    with storage_errors(f"committing {store.display}/{rel}"):
        # IMPORTANT: the entries of the files it commits are durable before it is, and then
        # its directory's own entry (as `Store.put_atomic`).
        fsync_dir(base, directory, create=True)
        put_file(base, path, data)
        fsync_dir(base, os.path.dirname(directory))


def _in_root(store: Store, rel: str) -> tuple[str, str]:
    """`rel` of a local root as (base, rel) for `new_file`. A root whose path has no link
    (the agent's: it resolves the root it checks) is walked from `/`, so that a link put in
    its place later is refused; a trainer's root with links in its path is taken as given."""
    if os.path.realpath(store.root) == store.root:
        return "/", os.path.join(store.root.lstrip("/"), rel)
    return store.root, rel
