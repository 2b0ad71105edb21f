"""The root: where checkpoints live, reached through fsspec (local paths, s3://, gs://, ...).

It owns the layout of DESIGN.md (`<root>/step-<N:010d>/`, `<root>/events/`), the
atomic put used for commits (rename on a filesystem, a single PUT on an object store), and
the translation of backend errors into ckpt errors: an unreachable or forbidden root is a
StorageError, never "no checkpoint".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import math
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt._faults import fault_point
from ckpt.errors import CheckpointError, DiskFull, InvalidCheckpoint, NotFound, StorageError
from ckpt.format.checksum import CHECKSUM_ALGO, checksum
from ckpt.format.manifest import MANIFEST_MAX, MANIFEST_NAME
from ckpt.redact import redact, redact_request_logs, remember_secrets
from ckpt.storage.nofollow import open_dir, remove_tree

if TYPE_CHECKING:
    from ckpt.storage.s3 import S3Transfers

log = logging.getLogger(__name__)

MiB = 1 << 20
# IMPORTANT: ASCII digits only. `\d` and `str.isdigit` take the digits of every script
# ("step-\u0660..." named step 6 and hid the real one), and `$` matches before a final newline.
STEP_DIR = re.compile(r"\Astep-([0-9]{10})\Z", re.ASCII)
EVENTS_DIR = "events"
# The most bytes read of any other JSON object of a root (lease.json, events/*.json): a few
# hundred bytes each when ckpt wrote them; a larger one is refused by its size, not parsed.
SMALL_JSON_MAX = 1 * MiB
NOT_A_STEP_NAME = "not step- and ten ASCII digits"


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or not 0 <= step < 10**10:
        raise ValueError(f"a step is an integer from 0 to 9999999999, not {step!r}")
    return f"step-{step:010d}"


def step_of(name: str) -> int | None:
    """The step a root entry's name says, or None when it is no step directory's name: the
    one check of step names, on every backend."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def json_cap(rel: str) -> int | None:
    """The most bytes of `rel` read before it is parsed, when it is a JSON object of the root
    (a manifest, the lease, an event); None for other files."""
    name = rel.rsplit("/", 1)[-1]
    if name == MANIFEST_NAME:
        return MANIFEST_MAX
    return SMALL_JSON_MAX if name.endswith(".json") else None


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


PUT_MAX = 5 << 30  # S3's largest PUT, and largest part

# How long check_reachable trusts its last look (a bucket deleted then is a listing found
# empty: "no checkpoint", a fresh start).
BUCKET_SEEN_S = 10.0


@dataclass(frozen=True)
class Transfer:
    """How files move to and from an S3 root (other roots ignore it). Memory per open file:
    a writer copies at most `(concurrency + 1) * part_size` bytes (only what it may not keep
    a reference to, see `Store.open_write`); a reader holds `(readahead + 1) * read_size`,
    and a rank's restore reads up to two files at once."""

    part_size: int = 64 * MiB
    """Bytes per part of a multipart upload. S3 wants at least 5 MiB and at most 10,000
    parts, so 64 MiB allows files up to 640 GiB. A file of up to two parts (and 5 GiB) is one
    PUT."""
    concurrency: int = 8
    """Parts of one file uploaded at the same time."""
    read_size: int = 32 * MiB
    """Bytes per ranged GET when reading."""
    readahead: int = 8
    """Ranged GETs in flight ahead of a reader."""
    attempts: int = 8
    """Tries of one request before a transient failure (HTTP 5xx or 429, throttling, a reset
    or refused connection, a timeout) becomes a StorageError. Other errors are not retried."""
    backoff_s: float = 0.25
    """Most a first retry waits; the bound doubles with each retry up to `max_backoff_s`,
    and the wait is drawn uniformly below it (jitter, so that ranks do not retry in step)."""
    max_backoff_s: float = 20.0
    timeout_s: float = 60.0
    """Seconds one request may wait for the store, to connect and then for each read of its
    answer; past it the request counts as a transient failure and is retried. A store that
    hangs thus fails a save after about `attempts` times this, never later."""

    def __post_init__(self) -> None:
        if not 5 * MiB <= self.part_size <= PUT_MAX:
            raise ValueError(f"Transfer.part_size must be from 5 MiB to 5 GiB (S3's smallest and largest part), not {self.part_size}")
        if min(self.concurrency, self.read_size, self.readahead, self.attempts) < 1 or self.timeout_s <= 0:
            raise ValueError(f"Transfer's counts and sizes must be positive: {self}")


@dataclass
class StepListing:
    """What a scan of the root found for one step directory: file names and sizes."""

    step: int
    files: dict[str, int] = field(default_factory=dict)
    manifest_mtime: float | None = None  # when the store says the manifest was written
    # Entries that are neither files nor directories (links, FIFOs, ...) and what each is:
    # never followed, never read.
    odd: dict[str, str] = field(default_factory=dict)

    @property
    def has_manifest(self) -> bool:
        return MANIFEST_NAME in self.files


@dataclass(frozen=True)
class Stray:
    """An entry of the root named `step-...` that is no step directory (a link, a file, a
    FIFO, a name in other digits): no checkpoint, and never read, written or deleted through."""

    name: str
    what: str  # "a symbolic link to ...", "a file", NOT_A_STEP_NAME, ...
    step: int | None = None  # the step its name is, when it is a step directory's name


def _what(mode: int, path: str) -> str:
    """What a directory entry is, from its `lstat` mode, in words."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(path)}"
        except OSError:
            return "a symbolic link"
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    return next((what for test, what in kinds if test(mode)), "a device")


def _scan_local(root: str) -> tuple[dict[int, StepListing], list[Stray]]:
    """`Store.survey` of a local root: only its step directories are walked, and with
    os.scandir (fsspec's walk stats every file in Python: 150 checkpoints kept took 21 ms of
    the save thread's CPU at every save's retention, this 7 ms). A directory that cannot be
    read raises; one that a concurrent delete removed mid-walk is left out, as a file is.
    IMPORTANT: no link is followed (a link out of the root, or a loop)."""
    try:
        tops = [e for e in os.scandir(root) if e.name.startswith("step-")]
    except FileNotFoundError:
        return {}, []
    steps: dict[int, StepListing] = {}
    strays: list[Stray] = []
    for top in sorted(tops, key=lambda e: e.name):
        step = step_of(top.name)
        try:
            mode = top.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if step is None or not stat.S_ISDIR(mode):
            strays.append(Stray(top.name, NOT_A_STEP_NAME if step is None else _what(mode, top.path), step))
            continue
        listing = _walk_step(top.path, step)
        if listing is not None:
            steps[step] = listing
    return steps, strays


def _walk_step(path: str, step: int) -> StepListing | None:
    """The files of the local step directory `path`, links and other odd entries apart; None
    if it is gone."""
    listing = StepListing(step)
    pending = [(path, "")]
    while pending:
        where, rel = pending.pop()
        try:
            found = list(os.scandir(where))
        except FileNotFoundError:  # deleted since it was seen
            if where == path:
                return None
            continue
        for e in found:
            with contextlib.suppress(FileNotFoundError):
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append((e.path, f"{rel}{e.name}/"))
                elif not stat.S_ISREG(st.st_mode):
                    listing.odd[rel + e.name] = _what(st.st_mode, e.path)
                else:
                    listing.files[rel + e.name] = st.st_size
                    if not rel and e.name == MANIFEST_NAME:
                        listing.manifest_mtime = st.st_mtime
    return listing


def _open_local(path: str, where: str) -> BinaryIO:
    """A local file of a root, opened for reading. IMPORTANT: a link is not followed, and
    nothing but a plain file is read (a FIFO would block the reader forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidCheckpoint(f"{where} is a symbolic link, not a file: links are never followed") from e
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InvalidCheckpoint(f"{where} is {_what(mode, path)}, not a file: never read")
    return os.fdopen(fd, "rb")


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
        with storage_errors(f"opening root {self.display}"):
            protocol = fsspec.utils.get_protocol(root)
            options = dict(storage_options or {})
            for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
                if not isinstance(options.get(name) or {}, Mapping):
                    raise ValueError(f"storage option {name} must be an object (a dict; JSON on the command line), not a {type(options[name]).__name__}")
            if protocol in ("s3", "s3a"):
                # IMPORTANT: listings must never come from a cache; another process commits.
                options.setdefault("use_listings_cache", False)
                options.setdefault("skip_instance_cache", True)
                # IMPORTANT: every request, listings too, gives up after Transfer.timeout_s
                # and is tried Transfer.attempts times, by ckpt alone (s3.RetriedFS).
                cfg = transfer or Transfer()
                once = {"mode": "standard", "total_max_attempts": 1}
                options["config_kwargs"] = {"connect_timeout": cfg.timeout_s, "read_timeout": cfg.timeout_s, **(options.get("config_kwargs") or {}), "retries": once}
                from ckpt.storage.s3 import RetriedFS, file_system

                self.fs, path = file_system(RetriedFS, options, cfg), RetriedFS._strip_protocol(root)
            else:
                self.fs, path = fsspec.core.url_to_fs(root, **options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            path = os.path.abspath(os.path.expanduser(path))
        self.root = path.rstrip("/") or "/"
        named = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        #: The root as one string (`identity`: with the S3 endpoint), the same for every Store of it.
        self.where = self.root if self.is_local else f"{named}://{self.root}"
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
        # Through symbolic links: two spellings of one directory are one root.
        self.identity = os.path.realpath(self.root) if self.is_local else self.where if not endpoint else f"{self.where} at {endpoint}"
        # IMPORTANT: a directory that cannot be read is an error, never an empty listing (a
        # local walk omits unreadable directories by default: "no checkpoint", then "debris").
        self._strict: dict[str, Any] = {"on_error": "raise"} if self.is_local else {}
        self.transfer = transfer or Transfer()
        #: The checksum of the files written here (`ckpt.format.checksum`): BLAKE3 for a signing job.
        self.checksum_algo = CHECKSUM_ALGO
        self._s3: S3Transfers | None = None  # parallel, retried transfers; others use fsspec's files
        self._bucket_seen = -math.inf  # when check_reachable last found the bucket
        if protocol in ("s3", "s3a"):
            from ckpt.storage.s3 import S3Transfers

            self._s3 = S3Transfers(self.fs, self.transfer)

    def __repr__(self) -> str:
        return f"Store({self.display!r})"

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

    def survey(self) -> tuple[dict[int, StepListing], list[Stray]]:
        """`scan`, and the root's entries named `step-...` that are no step directory."""
        if self.is_local:
            with storage_errors(f"listing {self.display}"):
                return _scan_local(self.root)
        with storage_errors(f"listing {self.display}"):
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(self.root, detail=True, withdirs=True, **self._strict)
            except FileNotFoundError:
                return {}, []
        steps: dict[int, StepListing] = {}
        strays: dict[str, Stray] = {}
        prefix = self.root.rstrip("/") + "/"
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
                if tail == "manifest.json":
                    when = info.get("mtime", info.get("LastModified"))
                    listing.manifest_mtime = when.timestamp() if hasattr(when, "timestamp") else float(when) if when is not None else None
        return steps, sorted(strays.values(), key=lambda s: s.name)

    def list_step(self, step: int) -> StepListing | None:
        """The files of one step directory, or None if there is no such directory. NotFound
        when something else holds its name on a local root (a link, a file, a FIFO): nothing
        is read, written or deleted through it."""
        with storage_errors(f"listing {self.display}/{step_dir_name(step)}"):
            base = self.step_path(step)
            if self.is_local:
                self._step_dir_mode(step)
                return _walk_step(base, step)
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(base, detail=True, **self._strict)
            except FileNotFoundError:
                return None
            prefix = base + "/"
            files = {p[len(prefix):]: int(i.get("size") or 0) for p, i in found.items() if p.startswith(prefix)}
            # IMPORTANT: a plain file (or object) named like a step directory is no checkpoint,
            # not even debris: what removes debris (a save's claim, `ckpt rm`) must not touch it.
            if not files and not self.fs.isdir(base):
                return None
        return StepListing(step, files)

    def _step_dir_mode(self, step: int) -> int | None:
        """The `lstat` mode of a local step directory (None: there is none); NotFound when
        its name holds anything but a directory."""
        base = self.step_path(step)
        try:
            mode = os.lstat(base).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            raise NotFound(
                f"{self.display}/{step_dir_name(step)} is {_what(mode, base)}, not a step directory: "
                "nothing is read, written or deleted through it (remove it yourself if it should go)"
            )
        return mode

    def check_reachable(self) -> None:
        """Fail now, with a clear error, if the root's bucket (on an object store) does not
        exist: an empty listing must mean "no checkpoint yet", never "wrong bucket". A look
        less than BUCKET_SEEN_S old is trusted."""
        if self.is_local or time.monotonic() - self._bucket_seen < BUCKET_SEEN_S:
            return
        bucket = self.root.split("/", 1)[0]
        with storage_errors(f"checking {self.display}"):
            self.fs.invalidate_cache()
            if not self._bucket_exists(bucket):
                raise StorageError(f"{self.display}: bucket {bucket!r} does not exist (or is not visible with these credentials)")
        # What a Checkpointer does on entering (the lease, then the restore's listing) asks
        # twice within a second: a round trip each on the restore's path.
        self._bucket_seen = time.monotonic()

    def list_dir(self, rel: str) -> list[str]:
        """Names of the files directly under `rel` (empty if it does not exist)."""
        with storage_errors(f"listing {self.display}/{rel}"):
            self.fs.invalidate_cache()
            try:
                found = self.fs.ls(self.path(rel), detail=True)
            except FileNotFoundError:
                return []
        return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in found if i.get("type") != "directory")

    def exists(self, rel: str) -> bool:
        with storage_errors(f"checking {self.display}/{rel}"):
            self.fs.invalidate_cache()
            path = self.path(rel)
            if self._s3 is not None and "/" not in path.strip("/"):  # a bucket: see check_reachable
                return self._bucket_exists(path.strip("/"))
            return self.fs.exists(path)

    def _bucket_exists(self, bucket: str) -> bool:
        # On S3 a HEAD that tells "no such bucket" from "cannot reach the store" (s3fs's
        # exists() answers False to both).
        return self._s3.bucket_exists(bucket, self.display) if self._s3 is not None else self.fs.exists(bucket)

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
        with storage_errors(f"reading {self.display}/{rel}"):
            if self._s3 is not None:
                data = self._s3.get_small(self.path(rel), f"{self.display}/{rel}")
                if data is not None:
                    return data
                with self.open_read(rel) as f:  # a large file: parallel ranged GETs
                    return f.read()
            try:
                return self._cat(self.path(rel))
            except FileNotFoundError as e:
                raise NotFound(f"{self.display}/{rel} does not exist") from e

    def read_small(self, rel: str, at_most: int) -> bytes | None:
        """The whole file in one request when it holds at most `at_most` bytes, else None
        (never more than `at_most` + 1 bytes in memory). NotFound if there is no such file."""
        where = f"{self.display}/{rel}"
        with storage_errors(f"reading {where}"):
            try:
                if self._s3 is not None:
                    data = self._s3.get_small(self.path(rel), where, limit=max(at_most, 1))
                    if data is None:
                        return None
                elif self.is_local:
                    with _open_local(self.path(rel), where) as f:
                        size = os.fstat(f.fileno()).st_size
                        if size > at_most:
                            return None
                        data = f.read(size + 1)  # read(n) allocates n bytes up front
                else:
                    data = self.fs.cat_file(self.path(rel), start=0, end=at_most + 1)
            except FileNotFoundError as e:
                raise NotFound(f"{where} does not exist") from e
        return data if len(data) <= at_most else None

    def _cat(self, path: str) -> bytes:
        """A whole file of a root that is not S3's (a local one without fsspec's layers)."""
        if self.is_local:
            with _open_local(path, path) as f:
                return f.read()
        return self.fs.cat_file(path)

    def _too_large(self, rel: str, cap: int) -> str:
        """Why `rel` is not read: its size (where the store tells it) and the cap."""
        try:
            size = f"{os.stat(self.path(rel)).st_size if self.is_local else self.fs.size(self.path(rel)):,} bytes"
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
        with storage_errors(f"reading {self.display}/{rel}"):
            if self._s3 is not None:
                with self._s3.reader(self.path(rel), f"{self.display}/{rel}", ranges, size) as f:
                    yield f
                return
            try:
                f: Any = _open_local(self.path(rel), f"{self.display}/{rel}") if self.is_local else self.fs.open(self.path(rel), "rb")
            except FileNotFoundError as e:
                raise NotFound(f"{self.display}/{rel} does not exist") from e
            with f:
                if self.is_local and hasattr(os, "posix_fadvise"):
                    # Read front to back in pieces: the kernel may read further ahead (reading
                    # 1 GB cold in 256 KiB pieces took 345 ms with the hint, 385 without).
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                yield f

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
        path = self.path(rel)
        with storage_errors(f"writing {self.display}/{rel}"):
            if self._s3 is not None:
                with self._s3.upload(path, f"{self.display}/{rel}", size) as up:
                    yield up
                return
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f: Any = open(path, "wb")
            else:
                f = self.fs.open(path, "wb")
            try:
                yield f
                if self.is_local:
                    f.flush()
                    os.fsync(f.fileno())
                f.close()
            except BaseException:
                with contextlib.suppress(Exception):
                    f.close() if self.is_local else f.discard()
                with contextlib.suppress(Exception):
                    self.fs.rm_file(path)  # the one path: rm() would read it as a glob pattern
                raise

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `data` so that readers see all of it or nothing: the commit primitive."""
        path = self.path(rel)
        with storage_errors(f"committing {self.display}/{rel}"):
            if self._s3 is not None:  # one PUT: atomic on object stores; retried, bounded
                bucket, key, _ = self._s3.fs.split_path(path)
                self._s3.call(f"committing {self.display}/{rel}", "put_object", Bucket=bucket, Key=key, Body=data)
                return
            if not self.is_local:
                self.fs.pipe_file(path, data)
                return
            # IMPORTANT: the directory entries of the files it commits (every rank's, here) are
            # durable before it is: a journal orders them, a filesystem without one may not.
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(os.path.dirname(path))
            write_atomic(path, data)
            fsync_dir(os.path.dirname(os.path.dirname(path)))  # and the step directory's own entry

    # -- conditional writes (the root lease, ckpt.storage.lease) ------------------------------------
    # Atomic on local filesystems (a hard link; a lock file) and on S3 (conditional PUTs);
    # on other fsspec backends a read then a write, which two racing writers can both pass.
    def read_tagged(self, rel: str) -> Tagged | None:
        """A small file's bytes and a tag of that version for `put_if_unchanged`, read
        together; None if it does not exist. Of a file over SMALL_JSON_MAX only that much is
        read (`Tagged.size` says how large it is); on S3 it is read whole."""
        path = self.path(rel)
        with storage_errors(f"reading {self.display}/{rel}"):
            if self._s3 is not None:
                got = self._s3.get_tagged(path, f"{self.display}/{rel}")
                return None if got is None else Tagged(got[0], got[1], len(got[0]))
            if not self.is_local:
                self.fs.invalidate_cache()
            try:
                if self.is_local:
                    with _open_local(path, f"{self.display}/{rel}") as f:
                        size = os.fstat(f.fileno()).st_size
                        data = f.read(min(size, SMALL_JSON_MAX))
                else:
                    data = self.fs.cat_file(path, start=0, end=SMALL_JSON_MAX + 1)
                    size = len(data) if len(data) <= SMALL_JSON_MAX else self.fs.size(path)
            except FileNotFoundError:
                return None
            data = data[:SMALL_JSON_MAX]
            # A file cut short is tagged by its size too: a rewrite of it reads as a change.
            return Tagged(data, checksum(data) + ("" if size == len(data) else f"-{size}"), size)

    def put_if_absent(self, rel: str, data: bytes) -> str | None:
        """Create `rel` holding `data`, whole, unless it exists. Returns the new version's
        tag, or None (nothing written) if it existed. Of several processes racing to create
        it, exactly one gets a tag."""
        path = self.path(rel)
        with storage_errors(f"creating {self.display}/{rel}"):
            if self._s3 is not None:
                tag = self._s3.put_if(path, f"{self.display}/{rel}", data, IfNoneMatch="*")
                return tag or self._reads_back(rel, data)
            if self.is_local:
                return checksum(data) if _link_new(path, data) else None
            _best_effort(self)
            self.fs.invalidate_cache()
            if self.fs.exists(path):
                return None
            self.fs.pipe_file(path, data)
            return checksum(data)

    def put_if_unchanged(self, rel: str, data: bytes, tag: str) -> str | None:
        """Replace `rel` with `data` if it still is the version `read_tagged` tagged `tag`.
        Returns the new version's tag, or None (nothing written) if it changed or is gone.
        Of several processes racing to replace one version, at most one gets a tag."""
        path = self.path(rel)
        with storage_errors(f"replacing {self.display}/{rel}"):
            if self._s3 is not None:
                new = self._s3.put_if(path, f"{self.display}/{rel}", data, IfMatch=tag)
                return new or self._reads_back(rel, data)
            if not self.is_local:
                _best_effort(self)
            with _locked(path) if self.is_local else contextlib.nullcontext():
                now = self.read_tagged(rel)
                if now is None or now.tag != tag:
                    return None
                if self.is_local:
                    write_atomic(path, data)
                else:
                    self.fs.pipe_file(path, data)
                return checksum(data)

    def _reads_back(self, rel: str, data: bytes) -> str | None:
        """After a conditional PUT was refused: did our own earlier attempt land (a reply
        lost, the request retried)? `data` holds a token unique to the write."""
        now = self.read_tagged(rel)
        return now.tag if now is not None and now.data == data else None

    def makedirs(self, rel: str) -> None:
        if self.is_local:
            with storage_errors(f"creating {self.display}/{rel}"):
                os.makedirs(self.path(rel), exist_ok=True)
        # object stores have no directories

    # -- deleting ---------------------------------------------------------------------------
    def remove(self, rel: str) -> None:
        """Delete one file (gone already: nothing to do)."""
        with storage_errors(f"deleting {self.display}/{rel}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def remove_step(self, step: int) -> None:
        """Delete a checkpoint. IMPORTANT: the manifest goes first, so that a crash half-way
        leaves an incomplete directory, never a committed checkpoint with files missing.

        Paths are taken literally: fsspec's `rm` reads `[`, `*` and `?` as a glob pattern, so
        that a root named `exp[12]` would delete the steps of `exp1` and `exp2`. On a local
        root nothing is deleted through a link: a step name that is not a directory is a
        NotFound, and the directory is opened without following links, then removed through
        file descriptors (links inside it are removed, not followed)."""
        where = f"deleting {self.display}/{step_dir_name(step)}"
        if self.is_local:
            with storage_errors(where):
                self._remove_local_step(step)
            return
        with storage_errors(where):
            self.fs.invalidate_cache()
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.step_path(step, MANIFEST_NAME))
            fault_point("retention", 0, step)
            base = self.step_path(step)
            try:
                found = self.fs.find(base, withdirs=True, detail=True, **self._strict)
            except FileNotFoundError:
                return
            keys = sorted(p for p, d in found.items() if d.get("type") != "directory")
            if self._s3 is not None:
                self._s3.delete(keys, where)
                return
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(key)
            # A store with real directories (sftp, hdfs, memory://) keeps them otherwise, and
            # the step would still be listed: the deepest first, the step's own last.
            for d in [*sorted((p for p, x in found.items() if x.get("type") == "directory"), key=len, reverse=True), base]:
                with contextlib.suppress(OSError):
                    self.fs.rmdir(d)


    def _remove_local_step(self, step: int) -> None:
        self._step_dir_mode(step)  # NotFound when a link, a file or a FIFO holds the name
        name = step_dir_name(step)
        try:
            fd = open_dir(self.root, name)  # UnsafeEntry if a link took its place meanwhile
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(MANIFEST_NAME, dir_fd=fd)
        finally:
            os.close(fd)
        fault_point("retention", 0, step)
        with contextlib.suppress(FileNotFoundError):
            remove_tree(self.root, name)


@dataclass(frozen=True)
class Tagged:
    """A file's bytes and the tag of that version (an S3 ETag, else a checksum of the bytes)."""

    data: bytes  # all of it, unless `size` is larger (a file over the cap, cut short)
    tag: str
    size: int


def _link_new(path: str, data: bytes) -> bool:
    """Create the local file `path` holding `data` unless it exists. The bytes are written
    and fsync'd under a temporary name, then hard-linked into place, which fails if `path`
    exists: a crash never leaves a half-written file, and of racing creators one wins. The
    temporary's link count decides who won, so that an NFS client's retried link (EEXIST for
    a link that did happen) is read right."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        won = os.stat(tmp).st_nlink == 2
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if won:
        fsync_dir(directory)
    return won


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive `flock` on `.<name>.lock` next to `path` (left in place: removing a lock
    file races with the next locker)."""
    import fcntl

    lock = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_warned_best_effort: set[str] = set()


def _best_effort(store: Store) -> None:
    protocol = type(store.fs).__name__
    if protocol not in _warned_best_effort:
        _warned_best_effort.add(protocol)
        log.warning(
            "%s: %s has no conditional write here; the root lease is checked and written in two "
            "steps, which two jobs starting at the same moment can both pass",
            store.display,
            protocol,
        )


def write_atomic(path: str, data: bytes) -> None:
    """A local file written whole and durable: readers see the old one or the new one."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full disk must not keep what it could not finish
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
