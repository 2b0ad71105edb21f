"""A root on any other fsspec filesystem (gs://, memory://, sftp, hdfs...): `FsspecBackend`,
fsspec's own files and listings, taken literally (no glob patterns). S3 builds on it
(`ckpt.storage.s3`) with what S3 does better. Without conditional writes here, the root lease
is checked then written in two steps, which two racing writers can both pass.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from fsspec import AbstractFileSystem

from ckpt.errors import StorageError
from ckpt.format.checksum import checksum
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.storage.backend import Backend, Tagged, checksum_tagged
from ckpt.storage.layout import (
    NOT_A_STEP_NAME,
    SMALL_JSON_MAX,
    StepListing,
    Stray,
    step_dir_name,
    step_of,
)

T = TypeVar("T")
LIST_PAGE = 1000  # keys a LIST answers at most
PARALLEL = 16  # small requests at once (`each`)
MANIFEST_BYTES_PER_FILE = 100  # the fewest a manifest's entry of a file takes: its name, size, checksum, rank
PROBES = 3  # newest step directories looked at for a manifest to judge the root by

log = logging.getLogger(__name__)


class FsspecBackend(Backend):
    """A root on an fsspec filesystem, through its own methods."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs

    # -- listing ----------------------------------------------------------------------------
    def survey(self, root: str) -> tuple[dict[int, StepListing], list[Stray]]:
        """In one recursive listing."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(root, detail=True, withdirs=True)
        except FileNotFoundError:
            return {}, []
        steps: dict[int, StepListing] = {}
        strays: dict[str, Stray] = {}
        prefix = root.rstrip("/") + "/"
        for full, info in found.items():
            rel = full[len(prefix) :] if full.startswith(prefix) else full
            head, _, tail = rel.partition("/")
            step = step_of(head)
            if step is None:
                if head.startswith("step-"):
                    strays.setdefault(head, Stray(head, NOT_A_STEP_NAME))
                continue
            if not tail and info.get("type") != "directory":  # an object named like a step: no checkpoint
                strays[head] = Stray(head, "an object, not a directory", step)
                continue
            listing = steps.setdefault(step, StepListing(step))
            if tail and info.get("type") != "directory":
                listing.files[tail] = int(info.get("size") or 0)
                if tail == MANIFEST_NAME:
                    listing.manifest_mtime = _mtime(info)
        return steps, sorted(strays.values(), key=lambda s: s.name)

    def survey_manifests(self, root: str) -> tuple[dict[int, StepListing], list[Stray]]:
        """The root's entries (one listing of its top level), and a look (HEAD) at each step
        directory's manifest, 16 at a time: ceil(steps/1000) + steps/16 round trips, whatever the
        checkpoints hold. A recursive listing is about the files of every checkpoint kept, a page
        of LIST_PAGE after another, each parsed here (2·W keys a checkpoint of W ranks: 1.4 s of
        CPU at 10,000 ranks); where that is fewer round trips (many checkpoints of a few ranks,
        by the size of the newest one's manifest), the root is listed whole instead (`survey`)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(root, detail=True)
        except FileNotFoundError:
            return {}, []
        steps: dict[int, StepListing] = {}
        strays: dict[str, Stray] = {}
        for info in found:
            head = info["name"].rstrip("/").rsplit("/", 1)[-1]
            step = step_of(head)
            if step is None:
                if head.startswith("step-"):
                    strays.setdefault(head, Stray(head, NOT_A_STEP_NAME))
            elif info.get("type") != "directory":  # an object named like a step: no checkpoint
                strays[head] = Stray(head, "an object, not a directory", step)
            else:
                steps[step] = StepListing(step, whole=False)
        prefix = root.rstrip("/") + "/"

        def look(listing: StepListing) -> None:
            try:
                info = self.fs.info(f"{prefix}{step_dir_name(listing.step)}/{MANIFEST_NAME}")
            except FileNotFoundError:
                return
            if info.get("type") != "directory":
                listing.files[MANIFEST_NAME] = int(info.get("size") or 0)
                listing.manifest_mtime = _mtime(info)

        # The newest manifests say how many files a checkpoint has (at most its size over an
        # entry's least): the newest step may be a save under way, or one that crashed.
        looked: list[int] = []
        for step in sorted(steps, reverse=True)[:PROBES]:
            listing = steps[step]
            look(listing)
            looked.append(step)
            if listing.has_manifest:
                files = max(1, listing.files[MANIFEST_NAME] // MANIFEST_BYTES_PER_FILE)
                if len(steps) * files / LIST_PAGE <= math.ceil(len(steps) / PARALLEL):
                    return self.survey(root)
                break
        each(look, [lst for step, lst in steps.items() if step not in looked])
        return steps, sorted(strays.values(), key=lambda s: s.name)

    def list_step(self, path: str, step: int, where: str) -> StepListing | None:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return None
        prefix = path + "/"
        files = {p[len(prefix) :]: int(i.get("size") or 0) for p, i in found.items() if p.startswith(prefix)}
        # IMPORTANT: a plain file (or object) named like a step directory is no checkpoint,
        # not even debris: what removes debris (a save's claim, `ckpt rm`) must not touch it.
        if not files and not self.fs.isdir(path):
            return None
        return StepListing(step, files)

    def check_reachable(self, root: str, where: str) -> None:
        """An empty listing must mean "no checkpoint yet", never "wrong bucket"."""
        bucket = root.split("/", 1)[0]
        self.fs.invalidate_cache()
        if not self.bucket_exists(bucket, where):
            raise StorageError(f"{where}: bucket {bucket!r} does not exist (or is not visible with these credentials)")

    def bucket_exists(self, bucket: str, where: str) -> bool:
        return self.fs.exists(bucket)

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: str, where: str) -> bytes:
        return self.fs.cat_file(path)

    def read_small(self, path: str, where: str, at_most: int) -> bytes | None:
        return self.fs.cat_file(path, start=0, end=at_most + 1)

    def open_read(
        self, path: str, where: str, ranges: list[tuple[int, int]] | None, size: int | None, early: BinaryIO | None = None
    ) -> BinaryIO:  # fmt: skip
        return self.fs.open(path, "rb")

    # -- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, path: str, where: str, size: int | None) -> Iterator[BinaryIO]:
        f: Any = self.fs.open(path, "wb")
        try:
            yield f
            f.close()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            with contextlib.suppress(Exception):
                self.fs.rm_file(path)
            raise

    def put(self, path: str, data: bytes, where: str) -> None:
        self.fs.pipe_file(path, data)

    def makedirs(self, path: str) -> None:
        pass  # object stores have no directories

    # -- conditional writes: a read, then a write --------------------------------------------
    def read_tagged(self, path: str, where: str) -> Tagged | None:
        self.fs.invalidate_cache()
        try:
            data = self.fs.cat_file(path, start=0, end=SMALL_JSON_MAX + 1)
            size = len(data) if len(data) <= SMALL_JSON_MAX else self.fs.size(path)
        except FileNotFoundError:
            return None
        return checksum_tagged(data, size)

    def put_if_absent(self, path: str, data: bytes, where: str) -> str | None:
        self._best_effort(where)
        self.fs.invalidate_cache()
        if self.fs.exists(path):
            return None
        self.fs.pipe_file(path, data)
        return checksum(data)

    def put_if_unchanged(self, path: str, data: bytes, tag: str, where: str) -> str | None:
        self._best_effort(where)
        now = self.read_tagged(path, where)
        if now is None or now.tag != tag:
            return None
        self.fs.pipe_file(path, data)
        return checksum(data)

    _warned: set[str] = set()  # the filesystems warned about, once per process

    def _best_effort(self, where: str) -> None:
        kind = type(self.fs).__name__
        if kind not in FsspecBackend._warned:
            FsspecBackend._warned.add(kind)
            log.warning(
                "%s: %s has no conditional write here; the root lease is checked and written in two "
                "steps, which two jobs starting at the same moment can both pass",
                where,
                kind,
            )

    # -- deleting ---------------------------------------------------------------------------
    def remove_in_step(self, root: str, step_dir: str, name: str, where: str) -> bool:
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{root}/{step_dir}/{name}")
        return True  # whether the directory is there shows in `remove_tree`

    def remove_tree(self, root: str, step_dir: str, where: str) -> None:
        """Paths are taken literally: fsspec's `rm` reads `[`, `*` and `?` as a glob pattern,
        so that a root named `exp[12]` would delete the steps of `exp1` and `exp2`."""
        base = f"{root}/{step_dir}"
        try:
            found = self.fs.find(base, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        self._remove_found(base, found, where)

    def _remove_found(self, base: str, found: dict[str, Any], where: str) -> None:
        """Delete what `find` found below `base`, and `base`."""
        for key in sorted(p for p, d in found.items() if d.get("type") != "directory"):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(key)
        # A store with real directories (sftp, hdfs, memory://) keeps them otherwise, and the
        # step would still be listed: the deepest first, the step's own last.
        for d in [*sorted((p for p, x in found.items() if x.get("type") == "directory"), key=len, reverse=True), base]:
            with contextlib.suppress(OSError):
                self.fs.rmdir(d)


def _mtime(info: dict[str, Any]) -> float | None:
    """When a listing says a file was written (seconds since the epoch), if it says."""
    when = info.get("mtime", info.get("LastModified"))
    return when.timestamp() if hasattr(when, "timestamp") else float(when) if when is not None else None


def each(fn: Callable[[T], None], items: list[T]) -> None:
    """`fn` over `items`, PARALLEL at a time (small requests: round trips, not bytes)."""
    if len(items) < 2:
        for x in items:
            fn(x)
        return
    with concurrent.futures.ThreadPoolExecutor(min(PARALLEL, len(items)), thread_name_prefix="ckpt-list") as pool:
        list(pool.map(fn, items))
