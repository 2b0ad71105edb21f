"""What each rank of a restore is told of the manifest (issue 40): not all of it.

The manifest holds an entry per file, a data file's with a checksum per block: about 15 MB for
70B on 10,000 ranks, which every rank was sent and parsed at every restore. Rank 0 reads and
checks it (its signature, step, ranks) and sends each rank a `Partial`: the manifest without
its files but the ones written for all (`.metadata`, `.index`) and the rank's own, with what the
others are needed for (whether the indexes can be read instead of `.metadata`, and which rank
saved each data file). A rank that then finds it must read other files (a restore on another
world size reads its neighbours' indexes and data) asks rank 0 for their entries, all ranks
together (`fetch`); one that must read `.metadata` whole gets all of them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt.collectives import Group, frame
from ckpt.errors import InvalidCheckpoint
from ckpt.format.checksum import BLAKE3
from ckpt.format.manifest import FileEntry, Manifest
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey

log = logging.getLogger("ckpt.restore.load")  # its lines are the restore's

# How ckpt and DCP name a rank's files: `__<rank>_<n>.distcp` and its index `__<rank>_<n>.index`.
_BY_RANK = re.compile(r"\A__([0-9]+)_[0-9]+\.(?:distcp|index)\Z")


@dataclass
class Partial(Manifest):
    """A manifest as rank 0 tells one rank of a restore: the header, the files written for
    all and the rank's own (more as `fetch` brings them). Never written anywhere: `to_json`
    would say only the files it holds."""

    restoring_world: int = 0  # the world size `indexed` was decided for
    indexed: bool = False  # `Manifest.indexed_for(restoring_world)`, on the whole manifest
    # Data file -> the rank that saved it, where a name does not say (`saved_by`); None: every
    # name does.
    saved: dict[str, int] | None = field(default=None, repr=False)

    def indexed_for(self, world: int) -> bool:
        return self.indexed and world == self.restoring_world


def saved_by(manifest: Manifest, name: str) -> int | None:
    """The rank that saved file `name` of the checkpoint (None: no rank's, or no such file)."""
    entry = manifest.files.get(name)
    if entry is not None:
        return entry.rank if entry.rank >= 0 else None
    if not isinstance(manifest, Partial):
        return None
    if manifest.saved is not None:
        return manifest.saved.get(name)
    m = _BY_RANK.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < manifest.world_size else None


def checked_manifest(store: Store, step: int, doc: bytes | str, key: SigningKey | None) -> Manifest | tuple[int, str]:
    """Rank 0: the manifest of `step` from its bytes `doc` (or why they could not be read),
    checked (its signature with `key`, its step, its ranks); else the code of the failure
    (2: the store's, 1: the checkpoint's) and why."""
    rel = step_dir_name(step)
    if isinstance(doc, str):
        return (2 if doc.startswith("StorageError") else 1), doc
    try:
        manifest = Manifest.from_json(doc, f"{store.display}/{rel}")
        # IMPORTANT: the manifest read now is the one checked, whatever the listing saw.
        why = key.check(manifest)[1] if key is not None else ""
        if why:
            raise InvalidCheckpoint(f"{store.display}/{rel}: {why}")
        if key is not None and (weak := sorted(n for n, e in manifest.files.items() if not e.checksum.startswith(BLAKE3))):
            log.warning(
                "%s/%s is signed, but %s carry xxh3-64 checksums (written by an earlier ckpt, or by a rank without "
                "the key): its signature covers them against corruption, not against a forger",
                store.display, rel, catalog.first_few(weak, ", "),
            )  # fmt: skip
        if manifest.step != step:  # IMPORTANT: another step's manifest lists that step's files
            raise InvalidCheckpoint(f"{store.display}/{rel}: manifest is for step {manifest.step}")
        catalog.check_ranks(manifest, f"{store.display}/{rel}")
    except Exception as e:  # told to every rank: none is left in the scatter
        return 1, f"{type(e).__name__}: {e}"
    return manifest


def tell(ctrl: Group, whole: Manifest | tuple[int, str] | None, told: tuple[Any, list[Any]] | None = None) -> Manifest | tuple[int, str]:
    """A collective: rank 0's `whole` manifest (or why there is none to restore from) as each
    rank is told it: on rank 0 itself, whole; on the others a `Partial`, or the same why. One
    broadcast of what every rank is told alike (the header, the files written for all), then
    a scatter of each rank's own files as plain tuples, pickled and framed: about 2 KB a
    rank, and 0.06 s of rank 0's CPU for 10,000 ranks (`told`: `parts(whole)`, made before)."""
    if ctrl.world == 1:
        assert whole is not None
        return whole
    common, framed = (told or parts(whole, ctrl.world)) if ctrl.rank == 0 else (None, None)
    common = ctrl.broadcast(common)
    if isinstance(common, tuple):  # why there is nothing to restore from, on every rank
        return common
    mine = ctrl.scatter_framed(framed)
    if ctrl.rank == 0:
        assert isinstance(whole, Manifest)
        return whole
    common.files.update((n, FileEntry(*rest)) for n, *rest in mine)
    return common


def parts(whole: Manifest | tuple[int, str] | None, world: int) -> tuple[Any, list[Any]]:
    """Rank 0: what every rank is told alike, and each rank's own entries (rank 0's: none),
    pickled and framed for the scatter (`collectives.frame`)."""
    if not isinstance(whole, Manifest):
        return whole, []  # not scattered: the ranks learn why from the broadcast
    own: list[list[tuple[str, FileEntry]]] = [[] for _ in range(world)]
    saved: dict[str, int] = {}
    named = True
    for n, e in whole.files.items():
        if e.rank >= 0:
            saved[n] = e.rank
            m = _BY_RANK.match(n)
            named = named and m is not None and int(m.group(1)) == e.rank
            if 0 < e.rank < world:
                own[e.rank].append((n, e))
    # Not the signature: it would not check on a part (rank 0 checked it).
    header = {f: getattr(whole, f) for f in ("step", "world_size", "created", "costs", "counters", "versions", "user", "schedule", "format", "format_version")}
    shared = {n: e for n, e in whole.files.items() if e.rank < 0}
    common = Partial(**header, files=shared, restoring_world=world, indexed=whole.indexed_for(world), saved=None if named else saved)
    return common, frame([_rows(dict(x)) for x in own])


def fetch(ctrl: Group, manifest: Manifest, wanted: set[str] | None) -> None:
    """A collective, on every rank once: the entries of `wanted` (None: every file) that this
    rank's manifest lacks, from rank 0's, added to it. Where any rank asks for every file (it
    reads `.metadata` whole: then all do), rank 0 broadcasts them once; else each rank is sent
    the few it named. Names the checkpoint does not hold stay missing (reading them fails as
    before: not listed in the manifest)."""
    if ctrl.world == 1:
        return
    if ctrl.rank == 0:  # it holds the whole
        missing: list[str] | None = []
    else:
        missing = None if wanted is None else sorted(n for n in wanted if n not in manifest.files)
    every, some = ctrl.max([int(missing is None), int(bool(missing))])
    if every:
        got = ctrl.broadcast(_rows(manifest.files) if ctrl.rank == 0 else None)
    elif some:
        asked = ctrl.gather(missing)
        rows = None
        if ctrl.rank == 0:
            assert asked is not None
            rows = [()] + [_rows({n: manifest.files[n] for n in want or () if n in manifest.files}) for want in asked[1:]]
        got = ctrl.scatter(rows)
    else:
        return
    if ctrl.rank != 0:
        manifest.files.update((n, FileEntry(*rest)) for n, *rest in got)


def _rows(files: dict[str, FileEntry]) -> tuple[tuple[Any, ...], ...]:
    """Entries as plain tuples: pickled (to send) several times faster than the dataclasses."""
    return tuple((n, e.size, e.checksum, e.rank, e.block, e.blocks) for n, e in files.items())
