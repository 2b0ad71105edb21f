"""Discovery: which checkpoints a root holds, and which of them can be trusted.

A step directory is `committed` when its manifest parses, names its own step and every file
it lists is there with the listed size; `incomplete` without a manifest (a save that never
finished, or one being written); `corrupt` otherwise. Checking reads only the listing and
the manifests, plus `.metadata` (checksummed, never unpickled) for the restore candidates;
`deep` checks every checksum, streaming each file through it in bounded chunks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from ckpt.errors import CheckpointError, InvalidCheckpoint, NotFound
from ckpt.format.checksum import Hasher, algorithm, checksum
from ckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from ckpt.format.signing import BAD, UNSIGNED, SigningKey
from ckpt.storage.store import StepListing, Store, Stray, step_dir_name

if TYPE_CHECKING:
    from ckpt.schedule.policy import Keep

log = logging.getLogger(__name__)

COMMITTED, INCOMPLETE, CORRUPT = "committed", "incomplete", "corrupt"

# Bytes read per call while streaming a file: the piece is still in the CPU cache when it is
# hashed. Measured (warm page cache, read + hash against a plain read): 2 busy cores, ~80 % for
# 256 KiB to 2 MiB, less above; H200 host, 16 cores, 70 % at 256 KiB, 65 % at 1 MiB, 53 % at
# 16 MiB. A hashing thread did worse on the busy 2 cores (55-70 %).
READ_CHUNK = 256 << 10


def _entry(where: str, name: str, manifest: Manifest) -> FileEntry:
    entry = manifest.files.get(name)
    if entry is None:
        raise InvalidCheckpoint(f"{where}: not listed in the manifest")
    return entry


def _check(where: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size:
        raise InvalidCheckpoint(f"{where}: {size} bytes, manifest says {entry.size}")
    if digest != entry.checksum:
        raise InvalidCheckpoint(f"{where}: checksum mismatch (corrupt file)")


def read_verified(store: Store, step_dir: str, name: str, manifest: Manifest) -> bytes:
    """The whole file, after its size and checksum matched the manifest's entry (for small
    files: `.metadata`; data files are streamed through `VerifyingReader`)."""
    where = f"{store.display}/{step_dir}/{name}"
    entry = _entry(where, name, manifest)
    return _checked(where, entry, store.read_bytes(f"{step_dir}/{name}"))


def _checked(where: str, entry: FileEntry, data: bytes) -> bytes:
    """`data`, the whole file, once its size and checksum matched `entry`."""
    _check(where, entry, len(data), checksum(data, entry.block, algorithm(entry, where)))
    return data


def _blocks_holding(items: list[tuple[int, int]], entry: FileEntry) -> list[tuple[int, int]] | None:
    """The byte ranges of the blocks holding `items` ((offset, length)), merged; None for a
    file checksummed whole."""
    block = entry.block
    if not block:
        return None
    ranges: list[tuple[int, int]] = []
    for offset, length in sorted(items):
        first, end = offset - offset % block, min(entry.size, -(-(offset + max(length, 1)) // block) * block)
        if ranges and first <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((first, end))
    return ranges


# A file the manifest says is no larger is checked from one whole read (`.metadata`, mostly):
# on an object store a streaming reader's HEAD before its GET would double the round trips.
WHOLE_READ_MAX = 8 << 20


def verify_file(store: Store, step_dir: str, name: str, manifest: Manifest) -> bytes | None:
    """Check one file's size and checksum against the manifest, holding at most a few
    chunks of it in memory; a small file is read whole, and returned once checked."""
    where = f"{store.display}/{step_dir}/{name}"
    entry = _entry(where, name, manifest)
    if entry.size <= WHOLE_READ_MAX:
        data = store.read_small(f"{step_dir}/{name}", WHOLE_READ_MAX)
        if data is None:
            raise InvalidCheckpoint(f"{where}: longer than the {entry.size} bytes the manifest says")
        return _checked(where, entry, data)
    with VerifyingReader.open(store, step_dir, name, manifest) as src:
        src.finish()
    return None


class VerifyingReader:
    """One file of a checkpoint, read front to back: every byte handed out or skipped goes
    through the checksum and the byte count, and `finish()` compares them with the manifest.
    Bytes handed out before `finish()` returned are not trusted yet: a caller may put them in
    place, but decodes (unpickles) nothing from them before.

    A file with block checksums is verified a block at a time, as each block is read whole.
    Opened for some `items` ((offset, length) ranges) only, a skip over whole blocks seeks
    past them instead of reading them, `finish()` verifies the blocks that were read, not the
    rest of the file, and an object store fetches ahead only the blocks holding those items:
    a rank that needs a few items of another rank's file reads only those blocks.

    Each piece is hashed right after it is read, while it is still in the CPU cache."""

    def __init__(self, f: BinaryIO, where: str, entry: FileEntry, *, partial: bool = False) -> None:
        self._f = f
        self.where = where
        self.entry = entry
        self.pos = 0  # bytes consumed by the caller
        self._hasher = Hasher.checking(entry, where, self._check_block)
        self._partial = partial and entry.block > 0 and f.seekable()
        self._ahead = b""  # read and hashed, not consumed yet (peek)
        self._scratch = memoryview(b"")
        self._unread = 0  # bytes of whole blocks seeked past

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, store: Store, step_dir: str, name: str, manifest: Manifest, *, items: list[tuple[int, int]] | None = None
    ) -> Iterator[VerifyingReader]:
        where = f"{store.display}/{step_dir}/{name}"
        entry = _entry(where, name, manifest)
        ranges = _blocks_holding(items, entry) if items is not None else None
        with store.open_read(f"{step_dir}/{name}", ranges, entry.size) as f:
            yield cls(f, where, entry, partial=items is not None)

    @property
    def read_bytes(self) -> int:
        """Bytes read from the file: all that was hashed, less the blocks seeked past."""
        return self._hasher.size - self._unread

    def peek(self, n: int) -> bytes:
        """Up to `n` next bytes (fewer only where the file ends), without consuming them."""
        while len(self._ahead) < n:
            more = self._f.read(n - len(self._ahead))
            if not more:
                break
            self._hasher.update(more)
            self._ahead += more
        return self._ahead[:n]

    def read(self, n: int) -> bytes:
        """The next `n` bytes; the file ending before is an InvalidCheckpoint."""
        parts = [self._ahead[:n]]
        self._ahead = self._ahead[n:]
        have = len(parts[0])
        while have < n:
            more = self._f.read(min(n - have, READ_CHUNK))
            if not more:
                self._short()
            self._hasher.update(more)
            parts.append(more)
            have += len(more)
        self.pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buf: memoryview) -> None:
        """Fill `buf` with the next bytes."""
        buf = buf.cast("B") if buf.format != "B" else buf
        done = min(len(buf), len(self._ahead))
        buf[:done] = self._ahead[:done]
        self._ahead = self._ahead[done:]
        self.pos += done
        while done < len(buf):
            piece = buf[done : done + READ_CHUNK]
            got = self._f.readinto(piece)
            if not got:
                self._short()
            self._hasher.update(piece[:got])
            self.pos += got
            done += got

    def skip(self, n: int) -> None:
        """Consume `n` bytes (hashed like any other, unless whole blocks can be left unread)."""
        if not n:
            return
        ahead = min(n, len(self._ahead))
        self._ahead = self._ahead[ahead:]
        self.pos += ahead
        n -= ahead
        if self._partial and n:
            n = self._seek_blocks(n)
        self._consume(n)

    def finish(self) -> None:
        """InvalidCheckpoint unless what was read matches the manifest: the rest of the file,
        its size and checksum; opened `partial`, the rest of the current block."""
        self.skip(len(self._ahead))
        if self._partial:
            self._consume(self._to_block_end())
            if self._hasher.size > self.entry.size:
                self._longer()
            if self._hasher.size == self.entry.size:
                self._hasher.end_block()
            return
        while self._read_scratch(READ_CHUNK):
            pass
        if self._hasher.size != self.entry.size:
            self._short()
        _check(self.where, self.entry, self._hasher.size, self._hasher.hexdigest())

    def _seek_blocks(self, n: int) -> int:
        """Skip toward `n` bytes ahead: finish the current block, seek past the blocks wholly
        skipped; what is left to read of the block where the skip ends."""
        block, at = self.entry.block, self._hasher.size
        if (at + n) // block * block <= at or at + n > self.entry.size:
            return n  # the skip ends in this block (or past the end: read, and fail, as usual)
        rest = self._to_block_end()
        self._consume(rest)
        at, n = at + rest, n - rest
        whole = n // block
        if whole:
            self._f.seek(at + whole * block)
            self._hasher.jump(at // block + whole)
            self.pos += whole * block
            self._unread += whole * block
        return n - whole * block

    def _to_block_end(self) -> int:
        at = self._hasher.size
        return 0 if at % self.entry.block == 0 else max(0, min(self.entry.size, at - at % self.entry.block + self.entry.block) - at)

    def _consume(self, n: int) -> None:
        while n > 0:
            got = self._read_scratch(n)
            if not got:
                self._short()
            n -= got

    def _check_block(self, index: int, digest: str) -> None:
        blocks = self.entry.blocks
        if index >= len(blocks) or self._hasher.size > self.entry.size:
            self._longer()
        if digest != blocks[index]:
            first = index * self.entry.block
            raise InvalidCheckpoint(
                f"{self.where}: checksum mismatch in bytes {first}-{min(first + self.entry.block, self.entry.size) - 1} (corrupt file)"
            )

    def _read_scratch(self, n: int) -> int:
        if not self._scratch:
            self._scratch = memoryview(bytearray(READ_CHUNK))
        got = self._f.readinto(self._scratch[: min(n, READ_CHUNK)]) or 0
        self._hasher.update(self._scratch[:got])
        self.pos += got
        return got

    def _longer(self) -> None:
        raise InvalidCheckpoint(f"{self.where}: longer than the {self.entry.size} bytes the manifest says")

    def _short(self) -> None:
        size = self._hasher.size
        if size != self.entry.size:
            raise InvalidCheckpoint(f"{self.where}: {size} bytes, manifest says {self.entry.size}")
        raise InvalidCheckpoint(f"{self.where}: ends at byte {size}, before the items its .metadata lists")


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
    # The manifest's bytes as read, and `.metadata`'s once checked (when read whole), kept
    # where asked (`inspect(keep_doc=True)`): a restore hands the ranks the very manifest that
    # was checked, and rank 0 loads that `.metadata`, without reading either again.
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
    keep_doc: bool = False, doc: bytes | None = None,
) -> Entry:  # fmt: skip
    """Classify one step directory. Reads its manifest (unless given its bytes, `doc`); with
    `metadata`, also checks the checksum of `.metadata`; with `deep`, of every file. With
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
            size = listing.files.get(name)
            if size is None:
                raise InvalidCheckpoint(_odd(where, name, listing) if name in listing.odd else f"{where}/{name}: missing")
            if size != f.size:
                raise InvalidCheckpoint(f"{where}/{name}: {size} bytes, manifest says {f.size}")
        names = manifest.files if deep else [METADATA_NAME] if metadata else []
        for name in names:
            if deep and name == METADATA_NAME:
                # needs torch: only for deep checks
                from ckpt.format.dcp_metadata import load_metadata

                load_metadata(read_verified(store, entry.dir, name, manifest))
            else:
                checked = verify_file(store, entry.dir, name, manifest)
                if keep_doc and name == METADATA_NAME:
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
    reads."""

    def __init__(self) -> None:
        self._committed: dict[int, tuple[StepListing, Entry]] = {}

    def scan(self, store: Store, key: SigningKey | None = None) -> list[Entry]:
        """What `scan(store, key=key)` returns (the same key at every call)."""
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


def retired(entries: list[Entry], keep: Keep, *, in_flight: Collection[int] = (), protect: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """Of a scan's `entries`: the committed steps (oldest commit first) and the steps `keep`
    lets go of, never one `in_flight` (handed off, not committed yet) or in `protect`.
    IMPORTANT: with a key, only trusted checkpoints count: an untrusted one dated in the future
    would otherwise be "the newest" and push the last trusted ones out."""
    committed = commit_order(entries)
    others = [e.step for e in entries if e.state != COMMITTED and not untrusted(e)]
    return committed, keep.to_delete(committed, others, in_flight=in_flight, protect=protect)


def retire(store: Store, scans: Scans, keep: Keep, key: SigningKey | None, *, in_flight: Collection[int], protect: Collection[int]) -> None:
    """A job's retention, after each commit: delete the checkpoints `keep` lets go of
    (`retired`). Housekeeping: a store that fails is logged, never fails the save."""
    try:
        for step in retired(scans.scan(store, key), keep, in_flight=in_flight, protect=protect)[1]:
            log.debug("retention: deleting %s", step_dir_name(step))
            store.remove_step(step)
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
) -> tuple[list[Entry], list[Entry]]:
    """(committed checkpoints newest commit first, the directories that were passed over).

    Newest by commit time (the manifest's `created`): after a restart from an older step,
    the new run's checkpoints come before the abandoned run's higher steps. Manifests are read
    newest written first (the listing's times), and no further once the rest were all written
    before the newest good one was created (less CLOCK_SKEW_S): a root of a thousand
    checkpoints costs one listing and a few reads. `.metadata` is checksummed for the first
    candidate. Directories with a manifest left unread come last, newest written first, for
    a restore that must fall back that far (it checks each as it tries it), in an order that
    is exact only for the first: a restore that falls back asks again, `exclude`-ing the steps
    it tried. With `key`, only checkpoints signed with it are candidates. `keep`: the first
    keeps the bytes of its manifest and of `.metadata` (if read whole: at most
    WHOLE_READ_MAX) that were checked (`Entry.doc`, `Entry.metadata`). `listings`: the
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
        checked = inspect(store, listings[good[0].step], metadata=True, key=key, keep_doc=keep, doc=good[0].doc)
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
    store: Store, step: int | None, key: SigningKey | None = None, keep: bool = False, listings: dict[int, StepListing] | None = None
) -> Entry:
    """The committed checkpoint at `step` (newest when None); NotFound or InvalidCheckpoint.
    With `key`, only one signed with it; `keep` and `listings`, see `restore_candidates`."""
    listings = store.scan() if listings is None else listings
    if not listings:
        raise NotFound(f"no checkpoints under {store.display}")
    if step is None:
        good, skipped = restore_candidates(store, key, keep=keep, listings=listings)
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
    entry = inspect(store, listings[step], metadata=True, key=key, keep_doc=keep)
    if entry.state != COMMITTED:
        raise InvalidCheckpoint(f"step {step} is {'untrusted' if untrusted(entry) else entry.state}: {entry.problem}")
    return entry
