"""Discovery: which checkpoints a root holds, and which of them can be trusted.

A step directory is `committed` when its manifest parses, names its own step and every file
it lists is there with the listed size; `incomplete` without a manifest (a save that never
finished, or one being written); `corrupt` otherwise. Checking reads only the listing and
the manifests, plus `.metadata` (checksummed, never unpickled) for the restore candidates;
`deep` checks every checksum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .errors import InvalidCheckpoint, NotFound
from .manifest import MANIFEST_NAME, METADATA_NAME, Manifest
from .storage import StepListing, Store, checksum, step_dir_name

log = logging.getLogger(__name__)

COMMITTED, INCOMPLETE, CORRUPT = "committed", "incomplete", "corrupt"


def read_verified(store: Store, step_dir: str, name: str, manifest: Manifest) -> bytes:
    """The whole file, after its size and checksum matched the manifest's entry."""
    where = f"{store.display}/{step_dir}/{name}"
    entry = manifest.files.get(name)
    if entry is None:
        raise InvalidCheckpoint(f"{where}: not listed in the manifest")
    data = store.read_bytes(f"{step_dir}/{name}")
    if len(data) != entry.size:
        raise InvalidCheckpoint(f"{where}: {len(data)} bytes, manifest says {entry.size}")
    if checksum(data) != entry.checksum:
        raise InvalidCheckpoint(f"{where}: checksum mismatch (corrupt file)")
    return data


@dataclass
class Entry:
    """One step directory and what is known about it."""

    step: int
    state: str  # COMMITTED, INCOMPLETE or CORRUPT
    manifest: Manifest | None = None
    problem: str | None = None  # why it is not committed
    bytes_on_store: int = 0

    @property
    def dir(self) -> str:
        return step_dir_name(self.step)


def inspect(store: Store, listing: StepListing, *, metadata: bool = False, deep: bool = False) -> Entry:
    """Classify one step directory. Reads its manifest; with `metadata`, also checks the
    checksum of `.metadata`; with `deep`, of every file."""
    entry = Entry(listing.step, INCOMPLETE, bytes_on_store=sum(listing.files.values()))
    if not listing.has_manifest:
        entry.problem = "no manifest (never committed, or still being written)"
        return entry
    where = f"{store.display}/{entry.dir}"
    try:
        manifest = Manifest.from_json(store.read_bytes(f"{entry.dir}/{MANIFEST_NAME}"), where)
        entry.manifest = manifest
        if manifest.step != listing.step:
            raise InvalidCheckpoint(f"{where}: manifest is for step {manifest.step}")
        if METADATA_NAME not in manifest.files:
            raise InvalidCheckpoint(f"{where}: manifest lists no {METADATA_NAME}")
        for name, f in manifest.files.items():
            size = listing.files.get(name)
            if size is None:
                raise InvalidCheckpoint(f"{where}/{name}: missing")
            if size != f.size:
                raise InvalidCheckpoint(f"{where}/{name}: {size} bytes, manifest says {f.size}")
        names = manifest.files if deep else [METADATA_NAME] if metadata else []
        for name in names:
            blob = read_verified(store, entry.dir, name, manifest)
            if deep and name == METADATA_NAME:
                from .dcp_io import load_metadata  # needs torch: only for deep checks

                load_metadata(blob)
    except (InvalidCheckpoint, NotFound) as e:
        entry.state, entry.problem = CORRUPT, str(e)
        return entry
    entry.state = COMMITTED
    return entry


def scan(store: Store, *, metadata: bool = False, deep: bool = False) -> list[Entry]:
    """Every step directory of the root, oldest first."""
    return [inspect(store, lst, metadata=metadata, deep=deep) for _, lst in sorted(store.scan().items())]


def commit_order(entries: list[Entry]) -> list[int]:
    """Committed steps, oldest commit first (by the manifest's commit time, then step)."""
    done = [e for e in entries if e.state == COMMITTED and e.manifest is not None]
    return [e.step for e in sorted(done, key=lambda e: (e.manifest.created, e.step))]  # type: ignore[union-attr]


def restore_candidates(store: Store) -> tuple[list[Entry], list[Entry]]:
    """(committed checkpoints newest commit first, the directories that were passed over).

    Newest by commit time: after a restart from an older step, the new run's checkpoints come
    before the abandoned run's higher steps. Manifests are read for every directory (they are
    small); `.metadata` is checksummed only for the first candidate."""
    listings = store.scan()
    entries = [inspect(store, listings[step]) for step in sorted(listings)]
    order = {step: i for i, step in enumerate(commit_order(entries))}
    good = sorted((e for e in entries if e.state == COMMITTED), key=lambda e: order[e.step], reverse=True)
    while good:
        checked = inspect(store, listings[good[0].step], metadata=True)
        if checked.state == COMMITTED:
            break
        entries[entries.index(good[0])] = checked
        good.pop(0)
    newest = order[good[0].step] if good else None
    skipped = [
        e
        for e in entries
        if e.state != COMMITTED and (newest is None or e.step > good[0].step or e.state == CORRUPT)
    ]
    return good, skipped


def find(store: Store, step: int | None) -> Entry:
    """The committed checkpoint at `step` (newest when None); NotFound or InvalidCheckpoint."""
    listings = store.scan()
    if not listings:
        raise NotFound(f"no checkpoints under {store.display}")
    if step is None:
        good, _ = restore_candidates(store)
        if not good:
            raise NotFound(f"no committed checkpoint under {store.display}")
        return good[0]
    if step not in listings:
        raise NotFound(f"no checkpoint at step {step} under {store.display}")
    entry = inspect(store, listings[step], metadata=True)
    if entry.state != COMMITTED:
        raise InvalidCheckpoint(f"step {step} is {entry.state}: {entry.problem}")
    return entry
