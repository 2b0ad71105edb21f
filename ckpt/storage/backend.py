"""What differs between the stores a root can be on: the `Backend` interface.

A backend is the few operations that local disk (`ckpt.storage.local`: no link followed,
fsync, rename), S3 (`ckpt.storage.s3`: conditional PUTs, multipart uploads, ranged GETs) and
any other fsspec filesystem (`ckpt.storage.fsspec_backend`) each do their own way. `Store`
keeps what is the same on every one (the root and its paths, step names, how much of a file is
read, the errors) and calls these. Like fsspec's own filesystems, a backend overrides the
abstract methods, and the others where the filesystem's default is wrong for it.

Paths are full paths of the backend's filesystem (`Store.path`: checked not to escape the
root); `where` names the file in messages (its credentials masked). A missing file is a
FileNotFoundError or a NotFound; any other failure is whatever the backend raises, which
`Store` turns into a StorageError that says what was being done.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, BinaryIO

from fsspec import AbstractFileSystem

from ckpt.format.checksum import checksum
from ckpt.storage.layout import SMALL_JSON_MAX, StepListing, Stray


@dataclass(frozen=True)
class Tagged:
    """A file's bytes and the tag of that version (an S3 ETag, else a checksum of the bytes)."""

    data: bytes  # all of it, unless `size` is larger (a file over the cap, cut short)
    tag: str
    size: int


def checksum_tagged(data: bytes, size: int) -> Tagged:
    """The first bytes read of a file of `size` bytes (up to SMALL_JSON_MAX of them), tagged
    by their checksum where the store has no version tags. A file cut short is tagged by its
    size too: a rewrite of it reads as a change."""
    data = data[:SMALL_JSON_MAX]
    return Tagged(data, checksum(data) + ("" if size == len(data) else f"-{size}"), size)


def endpoint_of(options: dict[str, Any]) -> str:
    """The endpoint that storage options name ("": the default, AWS or AWS_ENDPOINT_URL)."""
    return options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url") or ""


class Backend(ABC):
    """The operations on a root's files that differ from store to store."""

    fs: AbstractFileSystem
    """The root's fsspec filesystem, which the default methods below use."""
    is_local = False
    """The files are on this machine: a path opens as it is, and a request costs no round
    trip (so many small ones go one after another, not in parallel)."""

    # -- naming the root --------------------------------------------------------------------
    def url(self, root: str) -> str:
        """The root as one string, with its protocol."""
        named = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{named}://{root}"

    def identity(self, root: str, options: dict[str, Any]) -> str:
        """The root as one string, the same for every Store of it (with the endpoint)."""
        endpoint = endpoint_of(options)
        return self.url(root) if not endpoint else f"{self.url(root)} at {endpoint}"

    # -- listing ----------------------------------------------------------------------------
    @abstractmethod
    def survey(self, root: str) -> tuple[dict[int, StepListing], list[Stray]]:
        """Every step directory under `root` with its files, and the entries named `step-...`
        that are no step directory. IMPORTANT: a directory that cannot be read is an error,
        never an empty listing ("no checkpoint", then "debris")."""

    def survey_manifests(self, root: str) -> tuple[dict[int, StepListing], list[Stray]]:
        """`survey`, where each step directory's listing may hold its manifest alone
        (`StepListing.whole` False): a root's entries and a look at each manifest, where a
        listing of every file of every checkpoint kept costs more (an object store's, at
        thousands of ranks). This: the whole survey (a local directory's costs no round trip)."""
        return self.survey(root)

    @abstractmethod
    def list_step(self, path: str, step: int, where: str) -> StepListing | None:
        """The files of the step directory `path`, or None if there is none. A file or
        object named like it is none (NotFound where it cannot be a directory's)."""

    @abstractmethod
    def check_reachable(self, root: str, where: str) -> None:
        """A StorageError now if the root's bucket does not exist (`where`: the root)."""

    def exists(self, path: str, where: str) -> bool:
        """Whether `path` exists (`where`: the root, for messages)."""
        self.fs.invalidate_cache()
        return self.fs.exists(path)

    def list_dir(self, path: str) -> list[str]:
        """Names of the files directly under `path` (empty if it does not exist)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in found if i.get("type") != "directory")

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: str, where: str) -> bytes:
        """The whole file."""
        with self.open_read(path, where, None, None) as f:
            return f.read()

    @abstractmethod
    def read_small(self, path: str, where: str, at_most: int) -> bytes | None:
        """The whole file in one request when it holds at most `at_most` bytes; else None, or
        more than `at_most` bytes read (either says it is larger)."""

    @abstractmethod
    def open_read(
        self, path: str, where: str, ranges: list[tuple[int, int]] | None, size: int | None, early: BinaryIO | None = None
    ) -> BinaryIO:  # fmt: skip
        """A stream over the file, to read front to back (see `Store.open_read`); `early`:
        the one `open_read_early` began for it, to go on with."""

    def open_read_early(self, path: str, where: str, size: int) -> BinaryIO | None:
        """A stream over the file whose first reads go out now (`Store.read_early`); None
        where that gains nothing (a local disk: `ckpt.restore.prefetch` warms its pages)."""
        return None

    def warm(self) -> None:
        """Begin making what the first request needs, in the background (`Store.warm`);
        nothing where there is nothing to make."""
        return None

    # -- writing ----------------------------------------------------------------------------
    @abstractmethod
    def open_write(self, path: str, where: str, size: int | None) -> contextlib.AbstractContextManager[BinaryIO]:
        """A new file, durable when the block exits; on error nothing of it is left."""

    @abstractmethod
    def put(self, path: str, data: bytes, where: str) -> None:
        """`data` written so that readers see all of it or nothing: the commit primitive."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Make the directory `path` and those above it, where the store has directories."""

    # -- conditional writes (the root lease) ------------------------------------------------
    @abstractmethod
    def read_tagged(self, path: str, where: str) -> Tagged | None:
        """A small file's bytes and their version's tag, read together; None if it does not
        exist. Of a file over SMALL_JSON_MAX only that much is read (but on S3)."""

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes, where: str) -> str | None:
        """Create `path` holding `data` unless it exists: the new version's tag, or None."""

    @abstractmethod
    def put_if_unchanged(self, path: str, data: bytes, tag: str, where: str) -> str | None:
        """Replace `path` if it still is the version tagged `tag`: the new tag, or None."""

    # -- deleting ---------------------------------------------------------------------------
    def remove(self, path: str) -> None:
        """Delete one file, the path taken literally (FileNotFoundError if it is gone)."""
        self.fs.rm_file(path)  # rm() would read it as a glob pattern

    @abstractmethod
    def remove_in_step(self, root: str, step_dir: str, name: str, where: str) -> bool:
        """Delete the file `name` of the step directory `root`/`step_dir` (gone already:
        nothing to do); False if there is no such directory. `where`: the directory."""

    @abstractmethod
    def remove_tree(self, root: str, step_dir: str, where: str) -> None:
        """Delete the step directory `root`/`step_dir` and all in it (gone: nothing to do)."""

