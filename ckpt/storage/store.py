"""The root: where checkpoints live, reached through fsspec (local paths, s3://, gs://, ...).

`Store` owns what is the same on every backend: the root and the paths below it (none may
escape it), the layout of docs/design.md (`ckpt.storage.layout`), how much of a root's JSON file is
read, and the translation of backend errors into ckpt errors: an unreachable or forbidden root
is a StorageError, never "no checkpoint". What differs, the atomic put used for commits (rename
on a filesystem, a single PUT on an object store) among it, is its backend's
(`ckpt.storage.backend`): local disk, S3, or any other fsspec filesystem.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ckpt._faults import fault_point
from ckpt.errors import CheckpointError, DiskFull, InvalidCheckpoint, NotFound, StorageError
from ckpt.format.checksum import CHECKSUM_ALGO
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.redact import redact, redact_request_logs, remember_secrets
from ckpt.storage.backend import Backend, Tagged
from ckpt.storage.fsspec_backend import FsspecBackend
from ckpt.storage.layout import MiB, StepListing, Stray, json_cap, step_dir_name
from ckpt.storage.local import LocalBackend
from ckpt.storage.transfer import Transfer

log = logging.getLogger(__name__)

# How long check_reachable trusts its last look (a bucket deleted then is a listing found
# empty: "no checkpoint", a fresh start).
BUCKET_SEEN_S = 10.0


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn a backend failure into a StorageError that says what was being done, and where."""
    try:
        yield
    except (CheckpointError, FileNotFoundError):
        raise
    except Exception as e:  # botocore, aiohttp, OSError...: all mean "could not reach storage"
        raise (DiskFull if _no_room(e) else StorageError)(f"{what}: {type(e).__name__}: {redact(str(e))}") from e


def _no_room(e: BaseException | None) -> bool:
    """Whether `e`, or what it was raised from (`raise ... from`, not an error met while
    handling it), is a filesystem out of space or quota."""
    for _ in range(8):  # a cause chain is short; a cycle must not hang an error path
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__
    return False


@contextlib.contextmanager
def _missing_is_not_found(where: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as e:
        raise NotFound(f"{where} does not exist") from e


def connect(root: str, options: dict[str, Any], transfer: Transfer) -> tuple[Backend, str]:
    """The backend of the root at the URL or path `root`, and the root's path there."""
    if fsspec.utils.get_protocol(root) in ("s3", "s3a"):
        from ckpt.storage.s3 import S3Backend  # s3fs and botocore load for an S3 root only

        return S3Backend.connect(root, options, transfer)
    fs, path = fsspec.core.url_to_fs(root, **options)
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(fs), os.path.abspath(os.path.expanduser(path))
    return FsspecBackend(fs), path


class Store:
    """A checkpoint root. All paths handed in and out are relative to it."""

    def __init__(
        self,
        root: str | os.PathLike,
        storage_options: dict[str, Any] | None = None,
        transfer: Transfer | None = None,
    ):
        root = os.fspath(root)
        self.url = root
        remember_secrets(storage_options)
        # The root's URL as it may be logged (no credentials): worked out once, when its own
        # secrets are known (its options'; a URL's user:password and tokens are masked by
        # form), rather than in each of the nine error contexts a save builds.
        self.display = redact(root)
        redact_request_logs()
        self.transfer = transfer or Transfer()
        options = dict(storage_options or {})
        with storage_errors(f"opening root {self.display}"):
            for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
                if not isinstance(options.get(name) or {}, Mapping):
                    raise ValueError(f"storage option {name} must be an object (a dict; JSON on the command line), not a {type(options[name]).__name__}")
            self.backend, path = connect(root, options, self.transfer)
        self.root = path.rstrip("/") or "/"
        #: The root as one string (`identity`: with the S3 endpoint), the same for every Store of it.
        self.where = self.backend.url(self.root)
        self.identity = self.backend.identity(self.root, options)
        #: The checksum of the files written here (`ckpt.format.checksum`): BLAKE3 for a signing job.
        self.checksum_algo = CHECKSUM_ALGO
        self._bucket_seen = -math.inf  # when check_reachable last found the bucket
        self._early: dict[str, tuple[int, BinaryIO]] = {}  # `read_early`'s streams: rel -> (size, stream)

    def __repr__(self) -> str:
        return f"Store({self.display!r})"

    @property
    def fs(self) -> AbstractFileSystem:
        """The root's fsspec filesystem."""
        return self.backend.fs

    @property
    def is_local(self) -> bool:
        """Whether the root is on this machine's filesystem (see `Backend.is_local`)."""
        return self.backend.is_local

    # -- paths ------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        for p in parts:
            if p.startswith("/") or ".." in p.split("/"):
                raise ValueError(f"path {p!r} escapes the checkpoint root")
        return "/".join([self.root, *parts])

    def local_path(self, rel: str) -> str | None:
        """The file's path on this machine, or None on an object store."""
        return self.path(rel) if self.is_local else None

    def step_path(self, step: int, name: str | None = None) -> str:
        return self.path(step_dir_name(step), *([name] if name else []))

    # -- listing ----------------------------------------------------------------------------
    def scan(self) -> dict[int, StepListing]:
        """Every step directory under the root with its files, in one recursive listing."""
        return self.survey()[0]

    def survey(self, whole: bool = True) -> tuple[dict[int, StepListing], list[Stray]]:
        """`scan`, and the root's entries named `step-...` that are no step directory. Not
        `whole`: a step directory's listing may hold its manifest alone (`StepListing.whole`),
        which is what a restore needs to pick a checkpoint (`Backend.survey_manifests`)."""
        with storage_errors(f"listing {self.display}"):
            return self.backend.survey(self.root) if whole else self.backend.survey_manifests(self.root)

    def list_step(self, step: int) -> StepListing | None:
        """The files of one step directory, or None if there is no such directory. NotFound
        when something else holds its name on a local root (a link, a file, a FIFO): nothing
        is read, written or deleted through it."""
        where = f"{self.display}/{step_dir_name(step)}"
        with storage_errors(f"listing {where}"):
            return self.backend.list_step(self.step_path(step), step, where)

    def check_reachable(self) -> None:
        """Fail now, with a clear error, if the root's bucket (on an object store) does not
        exist: an empty listing must mean "no checkpoint yet", never "wrong bucket". A look
        less than BUCKET_SEEN_S old is trusted."""
        if time.monotonic() - self._bucket_seen < BUCKET_SEEN_S:
            return
        with storage_errors(f"checking {self.display}"):
            self.backend.check_reachable(self.root, self.display)
        # What a Checkpointer does on entering (the lease, then the restore's listing) asks
        # twice within a second: a round trip each on the restore's path.
        self._bucket_seen = time.monotonic()

    def list_dir(self, rel: str) -> list[str]:
        """Names of the files directly under `rel` (empty if it does not exist)."""
        with storage_errors(f"listing {self.display}/{rel}"):
            return self.backend.list_dir(self.path(rel))

    def exists(self, rel: str) -> bool:
        with storage_errors(f"checking {self.display}/{rel}"):
            return self.backend.exists(self.path(rel), self.display)

    def each(self, fn: Callable[[Any], Any], items: list[Any], name: str = "ckpt-read") -> list[Any]:
        """`fn` over `items`, results in order: one after another on a local root, up to 16
        at a time on an object store (small requests cost a round trip each, not bytes)."""
        if self.is_local or len(items) < 2:
            return [fn(x) for x in items]
        with concurrent.futures.ThreadPoolExecutor(min(16, len(items)), thread_name_prefix=name) as pool:
            return list(pool.map(fn, items))

    # -- reading ----------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        """The whole file. A JSON object of the root (`json_cap`) larger than its cap is an
        InvalidCheckpoint, and no more of it than the cap is read."""
        cap = json_cap(rel)
        if cap is not None:
            data = self.read_small(rel, cap)
            if data is None:
                raise InvalidCheckpoint(self._too_large(rel, cap))
            return data
        where = f"{self.display}/{rel}"
        with storage_errors(f"reading {where}"), _missing_is_not_found(where):
            return self.backend.read(self.path(rel), where)

    def read_small(self, rel: str, at_most: int) -> bytes | None:
        """The whole file in one request when it holds at most `at_most` bytes, else None
        (never more than `at_most` + 1 bytes in memory). NotFound if there is no such file."""
        where = f"{self.display}/{rel}"
        early = self._early.pop(rel, None)  # begun by `read_early`, of the size a manifest says
        with storage_errors(f"reading {where}"), _missing_is_not_found(where):
            if early is not None and 0 < early[0] <= at_most:  # its GETs that failed are sent again (none for 0 bytes: read anew)
                with self.backend.open_read(self.path(rel), where, None, early[0], early[1]) as f:
                    return f.read()  # an object of another size: InvalidCheckpoint as it is read
            if early is not None:
                early[1].close()
            data = self.backend.read_small(self.path(rel), where, at_most)
        return data if data is not None and len(data) <= at_most else None

    def _too_large(self, rel: str, cap: int) -> str:
        """Why `rel` is not read: its size (where the store tells it) and the cap."""
        try:
            size = f"{self.backend.size(self.path(rel)):,} bytes"
        except Exception:  # only to say how large: the cap is what counts
            size = "larger"
        kind = "a manifest" if rel.rsplit("/", 1)[-1] == MANIFEST_NAME else "a lease or an event"
        return f"{self.display}/{rel}: {size}, more than the {cap / MiB:g} MiB {kind} may hold; not read"

    @contextlib.contextmanager
    def open_read(self, rel: str, ranges: list[tuple[int, int]] | None = None, size: int | None = None) -> Iterator[BinaryIO]:
        """A sequential binary stream over one file (`read`, `readinto`, `seek`). On S3 it
        reads ahead with parallel ranged GETs (`Transfer.read_size`, `readahead`), only
        within `ranges` ((start, end) byte ranges, in order) when the caller knows that it
        will read nothing else. `size`: the file's size as a manifest says it; on S3 the
        GETs then go out without a HEAD first, and an object of another size is an
        InvalidCheckpoint as it is read (elsewhere the caller's checks find it)."""
        where = f"{self.display}/{rel}"
        early = self._early.pop(rel, None)
        if early is not None and early[0] != size:
            early[1].close()
            early = None
        with storage_errors(f"reading {where}"):
            with _missing_is_not_found(where):
                f = self.backend.open_read(self.path(rel), where, ranges, size, early[1] if early else None)
            with f:
                yield f

    def read_early(self, rel: str, size: int) -> None:
        """Begin reading the file `rel` of `size` bytes (as a manifest says) for an `open_read`
        of it soon: on an object store its first ranged GETs go out now, while the caller
        still plans, and `open_read(rel, ..., size)` goes on with that stream. A hint: what
        fails here fails there (nothing is trusted before the reader checked it). Streams not
        taken up are closed by `drop_early`."""
        where = f"{self.display}/{rel}"
        try:
            f = self.backend.open_read_early(self.path(rel), where, size)
        except Exception as e:  # the reader meets it again, and says so
            log.debug("no early read of %s: %s", where, type(e).__name__)
            return
        if f is not None:
            old = self._early.pop(rel, None)
            self._early[rel] = (size, f)
            if old is not None:
                old[1].close()

    def warm(self) -> None:
        """Begin making the store's client in the background (an object store's: its first
        request otherwise makes it), while the caller goes on: for a restoring rank, which
        sends no request until rank 0 has surveyed the root. Whatever fails here is met, and
        said, at the first request."""
        try:
            self.backend.warm()
        except Exception as e:
            log.debug("no early client for %s: %s", self.display, type(e).__name__)

    def drop_early(self) -> None:
        """Close the streams `read_early` began that no `open_read` took up (their GETs cancelled)."""
        while self._early:
            self._early.popitem()[1][1].close()

    # -- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, rel: str, size: int | None = None) -> Iterator[BinaryIO]:
        """A new file that is durable when the block exits: fsync'd locally, a completed PUT
        (or multipart upload) on an object store. On error the partial file is removed.
        `size`: the bytes that will be written, if known (a hint: on S3 a file that needs
        parts sends its first as soon as it is full, rather than after holding two).

        On S3 the bytes go out in parts while the block runs (`Transfer`), and a failure or
        an exception in the block aborts the upload: no object, no incomplete upload.
        IMPORTANT: on S3, `write` keeps a reference to big buffers that own their memory (an
        mmap, bytes, a numpy array) instead of copying them, and reads them until the block
        exits: do not change such a buffer before then. Views without an owner (what
        torch.save hands out) are copied."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"writing {where}"), self.backend.open_write(self.path(rel), where, size) as f:
            yield f

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `data` so that readers see all of it or nothing: the commit primitive."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"committing {where}"):
            self.backend.put(self.path(rel), data, where)

    def makedirs(self, rel: str) -> None:
        with storage_errors(f"creating {self.display}/{rel}"):
            self.backend.makedirs(self.path(rel))

    # -- conditional writes (the root lease, ckpt.storage.lease) ------------------------------------
    # Atomic on local filesystems (a hard link; a lock file) and on S3 (conditional PUTs);
    # on other fsspec backends a read then a write, which two racing writers can both pass.
    def read_tagged(self, rel: str) -> Tagged | None:
        """A small file's bytes and a tag of that version for `put_if_unchanged`, read
        together; None if it does not exist. Of a file over SMALL_JSON_MAX only that much is
        read (`Tagged.size` says how large it is); on S3 it is read whole."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"reading {where}"):
            return self.backend.read_tagged(self.path(rel), where)

    def put_if_absent(self, rel: str, data: bytes) -> str | None:
        """Create `rel` holding `data`, whole, unless it exists. Returns the new version's
        tag, or None (nothing written) if it existed. Of several processes racing to create
        it, exactly one gets a tag."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"creating {where}"):
            return self.backend.put_if_absent(self.path(rel), data, where)

    def put_if_unchanged(self, rel: str, data: bytes, tag: str) -> str | None:
        """Replace `rel` with `data` if it still is the version `read_tagged` tagged `tag`.
        Returns the new version's tag, or None (nothing written) if it changed or is gone.
        Of several processes racing to replace one version, at most one gets a tag."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"replacing {where}"):
            return self.backend.put_if_unchanged(self.path(rel), data, tag, where)

    # -- deleting ---------------------------------------------------------------------------
    def remove(self, rel: str) -> None:
        """Delete one file (gone already: nothing to do)."""
        with storage_errors(f"deleting {self.display}/{rel}"), contextlib.suppress(FileNotFoundError):
            self.backend.remove(self.path(rel))

    def remove_step(self, step: int) -> None:
        """Delete a checkpoint. IMPORTANT: the manifest goes first, so that a crash half-way
        leaves an incomplete directory, never a committed checkpoint with files missing.

        Paths are taken literally: fsspec's `rm` reads `[`, `*` and `?` as a glob pattern, so
        that a root named `exp[12]` would delete the steps of `exp1` and `exp2`. On a local
        root nothing is deleted through a link: a step name that is not a directory is a
        NotFound, and the directory is opened without following links, then removed through
        file descriptors (links inside it are removed, not followed)."""
        name = step_dir_name(step)
        where = f"{self.display}/{name}"
        with storage_errors(f"deleting {where}"):
            if self.backend.remove_in_step(self.root, name, MANIFEST_NAME, where):
                fault_point("retention", 0, step)
                self.backend.remove_tree(self.root, name, where)
