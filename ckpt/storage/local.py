"""A root on this machine's filesystem (`LocalBackend`): listed with os.scandir, read and
deleted through no link, written durable (fsync, then a rename or a hard link into place), and
its lease replaced under an `flock`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

from ckpt.errors import InvalidCheckpoint, NotFound
from ckpt.format.checksum import checksum
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.storage.backend import Backend, Tagged, checksum_tagged
from ckpt.storage.layout import NOT_A_STEP_NAME, SMALL_JSON_MAX, StepListing, Stray, step_of
from ckpt.storage.nofollow import open_dir, remove_tree


class LocalBackend(Backend):
    """A root on this machine's filesystem."""

    is_local = True

    def __init__(self, fs: LocalFileSystem) -> None:
        self.fs = fs

    def url(self, root: str) -> str:
        return root

    def identity(self, root: str, options: dict[str, Any]) -> str:
        return os.path.realpath(root)  # through symbolic links: two spellings of one directory are one root

    # -- listing ----------------------------------------------------------------------------
    def survey(self, root: str) -> tuple[dict[int, StepListing], list[Stray]]:
        """Only the step directories are walked, and with os.scandir (fsspec's walk stats
        every file in Python: 150 checkpoints kept took 21 ms of the save thread's CPU at
        every save's retention, this 7 ms). A directory that cannot be read raises; one that
        a concurrent delete removed mid-walk is left out, as a file is.
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

    def list_step(self, path: str, step: int, where: str) -> StepListing | None:
        """NotFound when something else holds its name (a link, a file, a FIFO): nothing is
        read, written or deleted through it."""
        _step_dir(path, where)
        return _walk_step(path, step)

    def check_reachable(self, root: str, where: str) -> None:
        pass  # a directory that is not there is an empty root

    # -- reading ----------------------------------------------------------------------------
    def read_small(self, path: str, where: str, at_most: int) -> bytes | None:
        with _open_local(path, where) as f:
            size = os.fstat(f.fileno()).st_size
            if size > at_most:
                return None
            return f.read(size + 1)  # read(n) allocates n bytes up front

    def open_read(
        self, path: str, where: str, ranges: list[tuple[int, int]] | None, size: int | None, early: BinaryIO | None = None
    ) -> BinaryIO:  # fmt: skip
        f = _open_local(path, where)
        if hasattr(os, "posix_fadvise"):
            # Read front to back in pieces: the kernel may read further ahead (reading 1 GB
            # cold in 256 KiB pieces took 345 ms with the hint, 385 without).
            with contextlib.suppress(OSError):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return f

    # -- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, path: str, where: str, size: int | None) -> Iterator[BinaryIO]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "wb")
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(Exception):
                os.unlink(path)
            raise

    def put(self, path: str, data: bytes, where: str) -> None:
        # IMPORTANT: the directory entries of the files it commits (every rank's, here) are
        # durable before it is: a journal orders them, a filesystem without one may not.
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(os.path.dirname(path))
        write_atomic(path, data)
        fsync_dir(os.path.dirname(os.path.dirname(path)))  # and the step directory's own entry

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    # -- conditional writes: a hard link, a lock file ---------------------------------------
    def read_tagged(self, path: str, where: str) -> Tagged | None:
        try:
            with _open_local(path, where) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(min(size, SMALL_JSON_MAX))
        except FileNotFoundError:
            return None
        return checksum_tagged(data, size)

    def put_if_absent(self, path: str, data: bytes, where: str) -> str | None:
        return checksum(data) if _link_new(path, data) else None

    def put_if_unchanged(self, path: str, data: bytes, tag: str, where: str) -> str | None:
        with _locked(path):
            now = self.read_tagged(path, where)
            if now is None or now.tag != tag:
                return None
            write_atomic(path, data)
            return checksum(data)

    # -- deleting: through descriptors opened without following links ------------------------
    def remove_in_step(self, root: str, step_dir: str, name: str, where: str) -> bool:
        _step_dir(os.path.join(root, step_dir), where)
        try:
            fd = open_dir(root, step_dir)  # UnsafeEntry if a link took its place meanwhile
        except FileNotFoundError:
            return False
        try:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        return True

    def remove_tree(self, root: str, step_dir: str, where: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            remove_tree(root, step_dir)  # links inside it are removed, not followed


def _what(mode: int, path: str) -> str:
    """What a directory entry is, from its `lstat` mode, in words."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(path)}"
        except OSError:
            return "a symbolic link"
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    return next((what for test, what in kinds if test(mode)), "a device")


def _step_dir(path: str, where: str) -> None:
    """Nothing if the step directory `path` is a directory or is not there; NotFound when
    its name holds anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise NotFound(
            f"{where} is {_what(mode, path)}, not a step directory: "
            "nothing is read, written or deleted through it (remove it yourself if it should go)"
        )


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


def _link_new(path: str, data: bytes) -> bool:
    """Create the local file `path` holding `data` unless it exists. The bytes are written
    and fsync'd under a temporary name, then hard-linked into place, which fails if `path`
    exists: a crash never leaves a half-written file, and of racing creators one wins. The
    temporary's link count decides who won, so that an NFS client's retried link (EEXIST for
    a link that did happen) is read right."""
    tmp = _temporary(path, data)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        won = os.stat(tmp).st_nlink == 2
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if won:
        fsync_dir(os.path.dirname(path))
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


def write_atomic(path: str, data: bytes) -> None:
    """A local file written whole and durable: readers see the old one or the new one."""
    tmp = _temporary(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def _temporary(path: str, data: bytes) -> str:
    """A new file next to `path` (its directories made) holding `data`, fsync'd, for the
    caller to rename or link into place and remove: its path."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full disk must not keep what it could not finish
        raise
    return tmp


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
