"""Files below a trusted directory, reached through no link.

The node agent runs as another user than the trainers that write its spool, and may write a
local root: a link or a FIFO put in either must not lead it to read, write or delete
anything else. So every path below a trusted base (the operator's spool, a root as
resolved) is opened one part at a time, following no link: a file is read only if it is a
regular one with no other hard link, written under a fresh temporary name renamed into place,
and a tree deleted through descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from ckpt.errors import InvalidCheckpoint


class UnsafeEntry(InvalidCheckpoint):
    """An entry of the spool or of a local root that the agent will not go through or read:
    a symbolic link, a FIFO, socket or device, a file with other hard links, a directory
    where a file belongs."""


_PATH = getattr(os, "O_PATH", os.O_RDONLY)  # a directory passed through: search permission is enough


def open_dir(base: str, rel: str = "", create: bool = False) -> int:
    """A descriptor of the directory `base`/`rel`, to list, fsync or open in (the caller
    closes it). `base` is trusted as given (the operator's spool, a root as resolved); no
    part of `rel` is followed if it is a link: UnsafeEntry. `create`: make what is missing."""
    parts = _parts(base, rel)
    if create:
        os.makedirs(base, exist_ok=True)
    fd = os.open(base, (_PATH if parts else os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
                    _fsync_at(fd)  # the new directory's entry is durable before what goes in it
            flags = (os.O_RDONLY if i == len(parts) - 1 else _PATH) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            sub = _open_at(fd, part, flags, os.path.join(base, *parts[: i + 1]))
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(base: str, rel: str) -> BinaryIO:
    """A file below `base` to read: a regular file with no other hard link, reached through
    no link (else UnsafeEntry; FileNotFoundError if it is missing). Nothing else is even
    opened: a FIFO would block the reader, a device would read on without end."""
    head, name = os.path.split(rel)
    where = os.path.join(base, rel)
    d = open_dir(base, head)
    try:
        before = os.lstat(name, dir_fd=d)
        _check_regular(before, where)
        fd = _open_at(d, name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, where)
    finally:
        os.close(d)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeEntry(f"{where}: replaced while it was opened; not read")
        _check_regular(now, where)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def new_file(base: str, rel: str) -> Iterator[BinaryIO]:
    """A file written whole at `base`/`rel`: its bytes go to a temporary name this call
    creates, are fsync'd and then renamed over `rel` when the block exits. The directories
    on the way are made as needed, none is followed if it is a link (UnsafeEntry)."""
    head, name = os.path.split(rel)
    d = open_dir(base, head, create=True)
    tmp = f".{name}.{uuid.uuid4().hex}.tmp"
    try:
        # IMPORTANT: a name no one else made (O_EXCL), renamed into place once whole: a link at
        # `rel` is replaced, never written through; an existing `rel` is never truncated,
        # and on any failure only the temporary goes.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=d)
        try:
            with open(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            os.fsync(d)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=d)
            raise
    finally:
        os.close(d)


def put_file(base: str, rel: str, data: bytes) -> None:
    """`data` written whole at `base`/`rel` (`new_file`)."""
    with new_file(base, rel) as f:
        f.write(data)


def remove_tree(base: str, rel: str) -> None:
    """Delete the directory `base`/`rel` and all in it, through descriptors: no link on the
    way to it, nor in it, is followed (a link in it goes, not what it names)."""
    head, name = os.path.split(rel)
    d = open_dir(base, head)
    try:
        shutil.rmtree(name, dir_fd=d)  # refuses a link at `name` itself
    finally:
        os.close(d)


def _parts(base: str, rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if rel.startswith("/") or any(p in (".", "..") for p in parts):
        raise UnsafeEntry(f"{rel!r} is not a path below {base}")
    return parts


def _open_at(dir_fd: int, name: str, flags: int, where: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(dir_fd, name):
            raise UnsafeEntry(f"{where}: a symbolic link; not followed (the agent follows no link in its spool or a local root)") from None
        raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _check_regular(st: os.stat_result, where: str) -> None:
    why = (
        "a symbolic link" if stat.S_ISLNK(st.st_mode)
        else "not a regular file (a directory, FIFO, socket or device)" if not stat.S_ISREG(st.st_mode)
        else f"a file with other hard links ({st.st_nlink}): another's file, perhaps" if st.st_nlink != 1
        else None
    )  # fmt: skip
    if why:
        raise UnsafeEntry(f"{where}: {why}; not read (the agent reads only a spool's own regular files)")


def fsync_dir(base: str, rel: str, create: bool = False) -> None:
    fd = open_dir(base, rel, create)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_at(dir_fd: int) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
