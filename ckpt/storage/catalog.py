"""Discovery: which checkpoints a root holds, and which of them can be trusted.

A step directory is `committed` when its manifest parses, names its own step and every file
it lists is there with the listed size; `incomplete` without a manifest (a save that never
finished, or one being written); `corrupt` otherwise. Checking reads only the listing and
the manifests, plus the metadata a restore reads first (checksummed, never unpickled: the
shared `.index` where the manifest lists one, else `.metadata`) for the restore candidates;
`deep` checks every checksum, streaming each file through it in bounded chunks
(`ckpt.storage.verified`). Retention (`retired`, `retire`) and the restore's choice of a
checkpoint (`restore_candidates`, `find`) read what this finds.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ckpt.errors import CheckpointError, InvalidCheckpoint, NotFound
from ckpt.format.checksum import algorithm
from ckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, SHARED_INDEX, Manifest
from ckpt.format.signing import BAD, SIGNED_OK, UNSIGNED, SigningKey
from ckpt.storage.layout import StepListing, Stray, step_dir_name
from ckpt.storage.store import Store
from ckpt.storage.verified import read_verified, verify_file

log = logging.getLogger(__name__)

COMMITTED, INCOMPLETE, CORRUPT = "committed", "incomplete", "corrupt"
# Retention after a job's own commit lists the root at least this often (`Scans.committed`).
FULL_SCAN_S = 600.0


class Retention(Protocol):
    """What retention asks of a policy (`ckpt.Keep` is one): the steps to delete. Storage
    sits below the schedule, so it names the question, not the class."""

    def to_delete(self, committed: Sequence[int], incomplete: Sequence[int] = (), in_flight: Collection[int] = (), protect: Collection[int] = ()) -> list[int]: ...


@dataclass
class Entry:
    """One step directory and what is known about it."""

    step: int
    state: str  # COMMITTED, INCOMPLETE or CORRUPT
    manifest: Manifest | None = None
    problem: str | None = None  # why it is not committed
    bytes_on_store: int = 0
    # Checked with a signing key: "signed-ok", "unsigned" or "BAD" (ckpt.format.signing); else None.
    signature: str | None = None
    # The manifest's bytes as read, and those of the metadata a restore reads first (`.index`,
    # or `.metadata`) once checked (when read whole), kept where asked (`inspect(keep_doc=True)`):
    # a restore hands the ranks the very manifest that was checked, and rank 0 loads that
    # metadata, without reading either again.
    doc: bytes | None = field(default=None, repr=False, compare=False)
    metadata: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def dir(self) -> str:
        return step_dir_name(self.step)


def check_ranks(manifest: Manifest, where: str) -> None:
    """InvalidCheckpoint unless the manifest lists one data file from each of the ranks it
    says saved it (every rank writes one): a restore reads each rank's own state by it."""
    ranks = sorted({f.rank for f in manifest.files.values() if f.rank >= 0})
    if ranks != list(range(manifest.world_size)):
        raise InvalidCheckpoint(f"{where}: manifest says world size {manifest.world_size}, but lists data files of ranks {ranks}")


def inspect(
    store: Store, listing: StepListing, *, metadata: bool = False, deep: bool = False, key: SigningKey | None = None,
    keep_doc: bool = False, doc: bytes | None = None, world: int = 0,
) -> Entry:  # fmt: skip
    """Classify one step directory. Reads its manifest (unless given its bytes, `doc`); with
    `metadata`, also checks the checksum of what a restore by `world` ranks reads first:
    `.metadata`, or on the world size that saved it, `.index` where the manifest lists one
    (`ckpt.restore.partial`; 0: by no job, `.metadata`); with `deep`, of every file. With
    `key`, a manifest not signed with it is corrupt: never to be trusted. `keep_doc`: the
    entry keeps the manifest's bytes, and `.metadata`'s once checked (if read whole)."""
    entry = Entry(listing.step, INCOMPLETE, bytes_on_store=sum(listing.files.values()))
    where = f"{store.display}/{entry.dir}"
    if MANIFEST_NAME in listing.odd:  # a link to another root's manifest, say: never read
        entry.state, entry.problem = CORRUPT, _odd(where, MANIFEST_NAME, listing)
        return entry
    if not listing.has_manifest:
        entry.problem = "no manifest (never committed, or still being written)"
        return entry
    try:
        doc = store.read_bytes(f"{entry.dir}/{MANIFEST_NAME}") if doc is None else doc
        if keep_doc:
            entry.doc = doc
        manifest = Manifest.from_json(doc, where)
        entry.manifest = manifest
        if manifest.step != listing.step:
            raise InvalidCheckpoint(f"{where}: manifest is for step {manifest.step}")
        if key is not None:
            entry.signature, why = key.check(manifest)
            if why:
                raise InvalidCheckpoint(f"{where}: {why}")
        if METADATA_NAME not in manifest.files:
            raise InvalidCheckpoint(f"{where}: manifest lists no {METADATA_NAME}")
        check_ranks(manifest, where)
        for name, f in manifest.files.items():
            algorithm(f, f"{where}/{name}")  # one this ckpt cannot check is never trusted
            # A restore's survey: each rank finds a file missing or short as it reads it
            # (checked against the manifest), and the restore falls back. A listing of the
            # candidate's files is about 2·W keys, 1.4 s of rank 0's CPU at 10,000 ranks.
            if not listing.whole:
                continue
            size = listing.files.get(name)
            if size is None:
                raise InvalidCheckpoint(_odd(where, name, listing) if name in listing.odd else f"{where}/{name}: missing")
            if size != f.size:
                raise InvalidCheckpoint(f"{where}/{name}: {size} bytes, manifest says {f.size}")
        first = SHARED_INDEX if manifest.indexed_for(world) else METADATA_NAME
        names = manifest.files if deep else [first] if metadata else []
        for name in names:
            if deep and (name == METADATA_NAME or name.endswith(".index")):
                # Needs torch: only for deep checks (ls, verify and gc run without it).
                from ckpt.format.dcp_metadata import load_metadata
                from ckpt.format.index_file import decode_index

                blob = read_verified(store, entry.dir, name, manifest)
                decode_index(blob, f"{where}/{name}") if name.endswith(".index") else load_metadata(blob, f"{where}/{name}")
            else:
                checked = verify_file(store, entry.dir, name, manifest)
                if keep_doc and name == first:
                    entry.metadata = checked
    except (InvalidCheckpoint, NotFound) as e:
        entry.state, entry.problem = CORRUPT, str(e)
        return entry
    entry.state = COMMITTED
    return entry


def _odd(where: str, name: str, listing: StepListing) -> str:
    what = listing.odd[name]
    return f"{where}/{name} is {what}, not a file: {'links are never followed' if 'link' in what else 'never read'}"


def scan(store: Store, *, metadata: bool = False, deep: bool = False, key: SigningKey | None = None) -> list[Entry]:
    """Every step directory of the root, oldest first."""
    return survey(store, metadata=metadata, deep=deep, key=key)[0]


def survey(store: Store, **how: object) -> tuple[list[Entry], list[Stray]]:
    """`scan` (with its options), and the root's entries named `step-...` that are no step
    directory (`Store.survey`): not checkpoints, and left alone."""
    listings, strays = store.survey()
    return _inspect_all(store, [lst for _, lst in sorted(listings.items())], **how), strays


class Scans:
    """`scan` again and again (a job's retention, after every save), reading only what changed:
    a step directory committed (or, with a key, untrusted) at the last scan whose listing is
    the same (every file's name and size, the manifest's write time) is not inspected again.
    Keeping a thousand checkpoints then costs one listing per save, not a thousand manifest
    reads. And after a commit of the job's own (`committed`), not even that: the root changed
    by the job's commits alone (its lease keeps other jobs out), so the last scan, with the
    commits since (its own, and those its node agents made, `learned`), stands in for a
    listing, which at 10,000 ranks is tens of LIST pages for each checkpoint kept. A save
    handed off and not committed yet is not among them. The root is listed again at least every
    `FULL_SCAN_S` (debris of a failed save, a step copied in by hand)."""

    def __init__(self) -> None:
        self._committed: dict[int, tuple[StepListing, Entry]] = {}
        self._last: list[Entry] | None = None  # the last scan's entries, as retention left them
        self._listed_at = -math.inf
        self.listings = 0  # of the whole root, so far
        self._lock = threading.Lock()  # `learned` comes from the metrics thread too

    def committed(self, store: Store, key: SigningKey | None, manifest: Manifest | None = None) -> list[Entry]:
        """What `scan` would return now, this job having just committed `manifest` itself (or
        nothing new): without listing the root, where the last scan is less than
        `FULL_SCAN_S` old."""
        with self._lock:
            fresh = self._last is not None and time.monotonic() - self._listed_at <= FULL_SCAN_S
        if not fresh:
            return self.scan(store, key)
        if manifest is not None:
            self.learned(manifest, key is not None)
        with self._lock:
            return list(self._last or ())

    def learned(self, manifest: Manifest, signed: bool = False) -> None:
        """A checkpoint of this job's committed (by itself, or by its node agents)."""
        entry = Entry(manifest.step, COMMITTED, manifest, signature=SIGNED_OK if signed else None)
        with self._lock:
            if self._last is not None:
                self._last = [e for e in self._last if e.step != manifest.step] + [entry]

    def forget(self, step: int) -> None:
        """Retention deleted `step`."""
        with self._lock:
            self._committed.pop(step, None)
            if self._last is not None:
                self._last = [e for e in self._last if e.step != step]

    def scan(self, store: Store, key: SigningKey | None = None) -> list[Entry]:
        """What `scan(store, key=key)` returns (the same key at every call)."""
        listed_at = time.monotonic()
        listings = [lst for _, lst in sorted(store.scan().items())]
        fresh = [lst for lst in listings if not self._unchanged(lst)]
        inspected = dict(zip((lst.step for lst in fresh), _inspect_all(store, fresh, key=key), strict=True))
        entries = [inspected[lst.step] if lst.step in inspected else self._committed[lst.step][1] for lst in listings]
        self._committed = {
            lst.step: (lst, e)
            for lst, e in zip(listings, entries, strict=True)
            # no write time: no way to tell a rewrite
            if (e.state == COMMITTED or untrusted(e)) and lst.manifest_mtime is not None
        }
        with self._lock:
            self._last, self._listed_at, self.listings = list(entries), listed_at, self.listings + 1
        return entries

    def _unchanged(self, listing: StepListing) -> bool:
        last = self._committed.get(listing.step)
        return last is not None and (last[0].files, last[0].manifest_mtime) == (listing.files, listing.manifest_mtime)


def _inspect_all(store: Store, listings: list[StepListing], **how: object) -> list[Entry]:
    """`inspect` each, in order; an object store's several at a time (a thousand round trips
    one after another take seconds)."""
    one = functools.partial(inspect, store, **how)  # type: ignore[arg-type]
    # Not for checksums: each reader of an object store holds its readahead (about 300 MB).
    if how.get("deep") or how.get("metadata"):
        return [one(lst) for lst in listings]
    return store.each(one, listings, "ckpt-scan")


def commit_order(entries: list[Entry]) -> list[int]:
    """Committed steps, oldest commit first (by the manifest's commit time, then step)."""
    done = [e for e in entries if e.state == COMMITTED and e.manifest is not None]
    return [e.step for e in sorted(done, key=lambda e: (e.manifest.created, e.step))]  # type: ignore[union-attr]


def first_few(items: list[str], sep: str, n: int = 3) -> str:
    """The first `n` of `items` joined, and how many more there are (for one-line messages)."""
    return sep.join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def untrusted(entry: Entry) -> bool:
    """Scanned with a signing key, a checkpoint not signed with it (unsigned, or another key's
    or tampered with): never restored, and never counted as committed nor deleted as debris
    by retention (it may be a run's from before a key rotation, or planted)."""
    return entry.signature in (UNSIGNED, BAD)


def retired(entries: list[Entry], keep: Retention, *, in_flight: Collection[int] = (), protect: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """Of a scan's `entries`: the committed steps (oldest commit first) and the steps `keep`
    lets go of, never one `in_flight` (handed off, not committed yet) or in `protect`.
    IMPORTANT: with a key, only trusted checkpoints count: an untrusted one dated in the future
    would otherwise be "the newest" and push the last trusted ones out."""
    committed = commit_order(entries)
    others = [e.step for e in entries if e.state != COMMITTED and not untrusted(e)]
    return committed, keep.to_delete(committed, others, in_flight=in_flight, protect=protect)


def retire(
    store: Store, scans: Scans, keep: Retention, key: SigningKey | None, *, in_flight: Collection[int], protect: Collection[int],
    committed: Manifest | None = None,
) -> None:  # fmt: skip
    """A job's retention, after each commit: delete the checkpoints `keep` lets go of
    (`retired`), by the root as `scans` last listed it and the commits since
    (`Scans.committed`). `committed`: the checkpoint this job just committed itself (not one
    handed off, which may yet fail). Housekeeping: a store that fails is logged, never fails
    the save."""
    try:
        entries = scans.committed(store, key, committed)
        for step in retired(entries, keep, in_flight=in_flight, protect=protect)[1]:
            log.debug("retention: deleting %s", step_dir_name(step))
            store.remove_step(step)
            scans.forget(step)
    except CheckpointError as e:
        log.warning("retention skipped: %s", e)


def restore_candidates(
    store: Store,
    key: SigningKey | None = None,
    exclude: set[int] | frozenset[int] = frozenset(),
    keep: bool = False,
    *,
    listings: dict[int, StepListing] | None = None,
    check_first: bool = True,
    world: int = 0,
) -> tuple[list[Entry], list[Entry]]:
    """(committed checkpoints newest commit first, the directories that were passed over).

    Newest by commit time (the manifest's `created`): after a restart from an older step,
    the new run's checkpoints come before the abandoned run's higher steps. Manifests are read
    newest written first (the listing's times), and no further once the rest were all written
    before the newest good one was created (less CLOCK_SKEW_S): a root of a thousand
    checkpoints costs one listing and a few reads. `.metadata` is checksummed for the first
    candidate (`.index` instead for a restore by `world` ranks that reads that: see `inspect`).
    Directories with a manifest left unread come last, newest written first, for
    a restore that must fall back that far (it checks each as it tries it), in an order that
    is exact only for the first: a restore that falls back asks again, `exclude`-ing the steps
    it tried. With `key`, only checkpoints signed with it are candidates. `keep`: the first
    keeps the bytes of its manifest and of `.metadata` (if read whole: at most
    `verified.WHOLE_READ_MAX`) that were checked (`Entry.doc`, `Entry.metadata`). `listings`: the
    root's `scan()`, where the caller has one. Without `check_first` the candidates' manifests
    are checked but not the first's `.metadata` (for their commit times alone), and `keep`
    keeps nothing."""
    listings = {step: lst for step, lst in (store.scan() if listings is None else listings).items() if step not in exclude}
    entries = [inspect(store, lst) for lst in listings.values() if not lst.has_manifest]  # nothing to read
    unread = sorted((lst for lst in listings.values() if lst.has_manifest), key=_written, reverse=True)
    good: list[Entry] = []
    while True:
        while unread and not (good and _written(unread[0])[0] < good[0].manifest.created - CLOCK_SKEW_S):  # type: ignore[union-attr]
            n = 1 if store.is_local else 16  # a remote store's in parallel: latency, not bytes
            batch, unread = unread[:n], unread[n:]
            for entry in _inspect_all(store, batch, key=key, keep_doc=True):  # for the check below
                entries.append(entry)
                if entry.state == COMMITTED:
                    good.append(entry)
            good.sort(key=lambda e: (e.manifest.created, e.step), reverse=True)  # type: ignore[union-attr]
        if not good or not check_first:
            break
        checked = inspect(store, listings[good[0].step], metadata=True, key=key, keep_doc=keep, doc=good[0].doc, world=world)
        if checked.state == COMMITTED:
            break
        entries[entries.index(good[0])] = checked
        good.pop(0)  # and read on: older manifests may hold the newest good one now
    for e in entries:
        e.doc = e.metadata = None  # but the first candidate's: a restore reads from that one
    if good and check_first:
        good[0] = checked
    skipped = sorted(
        (e for e in entries if e.state != COMMITTED and (not good or e.step > good[0].step or e.state == CORRUPT)),
        key=lambda e: e.step,
    )
    return good + [Entry(lst.step, COMMITTED, problem="manifest not read yet") for lst in unread], skipped


# The most the clock of a host that commits (a manifest's `created`) may run ahead of the
# store's (the time the listing gives the manifest): restore_candidates relies on it. Hosts
# kept by NTP agree within milliseconds.
CLOCK_SKEW_S = 60.0


def _written(lst: StepListing) -> tuple[float, int]:
    return (lst.manifest_mtime if lst.manifest_mtime is not None else math.inf), lst.step


def find(
    store: Store, step: int | None, key: SigningKey | None = None, keep: bool = False, listings: dict[int, StepListing] | None = None,
    world: int = 0,
) -> Entry:
    """The committed checkpoint at `step` (newest when None); NotFound or InvalidCheckpoint.
    With `key`, only one signed with it; `keep` and `listings`, see `restore_candidates`."""
    listings = store.scan() if listings is None else listings
    if not listings:
        raise NotFound(f"no checkpoints under {store.display}")
    if step is None:
        good, skipped = restore_candidates(store, key, keep=keep, listings=listings, world=world)
        passed = [e for e in skipped if e.state == CORRUPT or untrusted(e)]
        if not good and passed:  # committed once, by their listing: say why none is now
            why = first_few([f"{e.dir}: {e.problem}" for e in passed], "; ")
            raise InvalidCheckpoint(f"no checkpoint under {store.display} can be used ({why})")
        if not good:
            raise NotFound(f"no committed checkpoint under {store.display}")
        newer = [f"{e.dir} ({e.problem})" for e in passed if e.step > good[0].step]
        if newer:
            log.warning("ckpt: note: using %s; newer checkpoints that cannot be used were passed over: %s", good[0].dir, first_few(newer, "; "))
        return good[0]
    if step not in listings:
        raise NotFound(f"no checkpoint at step {step} under {store.display}")
    entry = inspect(store, listings[step], metadata=True, key=key, keep_doc=keep, world=world)
    if entry.state != COMMITTED:
        raise InvalidCheckpoint(f"step {step} is {'untrusted' if untrusted(entry) else entry.state}: {entry.problem}")
    return entry
