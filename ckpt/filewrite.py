"""Writing one data file of a checkpoint from a list of pieces, durably, with its checksums.

A file is described by pieces in order: literal `bytes` (torch.save headers, pickled
objects, alignment padding) and `(segment, offset, length)` ranges of the staging arena, the
shared memory the trainer copied its tensors into. `write_file` runs in the writer process
(`ckpt.writer_proc`, which never imports torch and so never takes the trainer's GIL) or, as
a fallback, in the trainer's background thread; the bytes on storage are the same.

On a local filesystem the file is written with O_DIRECT where the filesystem allows it: the
arena and the file layout are page-aligned, so large tensors go from shared memory to the
disk without a trip through the page cache, which is where a buffered write spends most of
its CPU. Everything else (headers, small tensors, unaligned tails) is gathered in an aligned
bounce buffer. Filesystems without O_DIRECT (tmpfs, some network filesystems) get buffered
writes. Either way the file is fsync'd before `write_file` returns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Iterable, Mapping

from .manifest import FileEntry
from .storage import Hasher, Store, block_size, storage_errors

#: A piece of a file: literal bytes, or (segment id, offset, length) of the staging arena.
Piece = bytes | tuple[int, int, int]

def piece_len(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece[2]


ALIGN = 4096  # O_DIRECT alignment of memory, file offsets and lengths (the page size)
_BOUNCE = 8 << 20  # bytes gathered before a direct write
_IOV_MAX = 512  # pieces per writev call on the buffered path


def write_file(
    store: Store,
    rel: str,
    pieces: Iterable[Piece],
    segments: Mapping[int, memoryview],
    *,
    rank: int = -1,
    direct: bool = True,
) -> FileEntry:
    """Write `pieces` (literal bytes and arena ranges) as the file `rel` of `store`."""
    pieces = list(pieces)
    block = block_size(sum(map(piece_len, pieces)))
    if store.is_local and direct and hasattr(os, "O_DIRECT"):
        path = store.path(rel)
        with storage_errors(f"writing {store.display}/{rel}"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                return _write_direct(path, pieces, segments, rank, block)
            except _NoDirectIO:
                pass  # the filesystem refused O_DIRECT: the buffered path below
    with store.open_write(rel) as f:
        hasher = Hasher(block)
        if store.is_local:
            _writev_all(f.fileno(), _views(pieces, segments), hasher)
        else:
            for view in _views(pieces, segments):
                f.write(view)
                hasher.update(view)
    return hasher.entry(rank)


def _views(pieces: list[Piece], segments: Mapping[int, memoryview]) -> Iterable[memoryview]:
    for piece in pieces:
        if isinstance(piece, bytes):
            if piece:
                yield memoryview(piece)
        else:
            seg, off, length = piece
            if length:
                yield segments[seg][off : off + length]


def _writev_all(fd: int, views: Iterable[memoryview], hasher: Hasher) -> None:
    batch: list[memoryview] = []
    for view in views:
        hasher.update(view)
        batch.append(view)
        if len(batch) == _IOV_MAX:
            _writev_batch(fd, batch)
            batch = []
    _writev_batch(fd, batch)


def _writev_batch(fd: int, batch: list[memoryview]) -> None:
    while batch:
        n = os.writev(fd, batch)
        while batch and n >= len(batch[0]):  # drop what was written; a short write resumes
            n -= len(batch[0])
            batch.pop(0)
        if batch and n:
            batch[0] = batch[0][n:]


class _NoDirectIO(Exception):
    pass


def _write_direct(
    path: str, pieces: list[Piece], segments: Mapping[int, memoryview], rank: int, block: int
) -> FileEntry:
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644
        )
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise _NoDirectIO from e
        raise
    try:
        out = _DirectFile(fd, block)
        for piece in pieces:
            if isinstance(piece, bytes):
                out.write(memoryview(piece), aligned=False)
            else:
                seg, off, length = piece
                # Arena segments start on a page, so an offset on a page is an aligned address.
                out.write(segments[seg][off : off + length], aligned=off % ALIGN == 0)
        out.finish()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)
    return out.hasher.entry(rank)


class _DirectFile:
    """Sequential O_DIRECT writer: page-aligned runs of the caller's memory go straight to the
    file; the rest is gathered in an aligned bounce buffer and written a page-multiple at a
    time. The last partial page is written with O_DIRECT switched off."""

    def __init__(self, fd: int, block: int) -> None:
        self.fd = fd
        self.hasher = Hasher(block)
        self.bounce = mmap.mmap(-1, _BOUNCE)  # anonymous mappings are page-aligned
        self.fill = 0  # bytes waiting in the bounce buffer
        self.written = 0  # bytes in the file
        self.zero_copy = 0  # of which written straight from the caller's memory

    def write(self, view: memoryview, aligned: bool) -> None:
        view = view.cast("B")
        if aligned and self.fill % ALIGN == 0 and len(view) >= ALIGN:
            # The file is at a page boundary (headers and padding before this piece fill whole
            # pages of the bounce buffer): flush them, then the aligned run without a copy.
            self._flush_bounce()
            n = len(view) - len(view) % ALIGN
            self._write_all(view[:n])
            self.zero_copy += n
            view = view[n:]
        while len(view):
            n = min(len(view), _BOUNCE - self.fill)
            self.bounce[self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == _BOUNCE:
                self._flush_bounce()

    def _flush_bounce(self) -> None:
        whole = self.fill - self.fill % ALIGN
        if whole:
            self._write_all(memoryview(self.bounce)[:whole])
            rest = self.fill - whole
            self.bounce[:rest] = self.bounce[whole : self.fill]
            self.fill = rest

    def finish(self) -> None:
        self._flush_bounce()
        if self.fill:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._write_all(memoryview(self.bounce)[: self.fill])
            self.fill = 0
        self.bounce.close()

    def _write_all(self, view: memoryview) -> None:
        # Hashed as it goes to the file, in the file's order: a few large updates rather than
        # one per piece (a state of 10,000 small tensors is 40,000 pieces).
        self.hasher.update(view)
        while len(view):
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                if e.errno == errno.EINVAL and self.written == 0:
                    raise _NoDirectIO from e  # the filesystem opened it, but refuses the write
                raise
            self.written += n
            view = view[n:]
