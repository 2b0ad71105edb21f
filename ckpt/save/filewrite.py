"""Writing one data file of a checkpoint from a list of pieces, durably, with its checksums.

A file is described by pieces in order: literal `bytes` (torch.save headers, pickled
objects, alignment padding) and `(segment, offset, length)` ranges of the staging arena, the
shared memory the trainer copied its tensors into. `write_file` runs in the writer process
(`ckpt.save.writer_proc`, which never imports torch and so never takes the trainer's GIL) or, as
a fallback, in the trainer's background thread; the bytes on storage are the same.

On a local filesystem the file is written with O_DIRECT where the filesystem allows it: the
arena and the file layout are page-aligned, so large tensors go from shared memory to the
disk without a trip through the page cache, which is where a buffered write spends most of
its CPU. Everything else (headers, small tensors, unaligned tails) is gathered in an aligned
bounce buffer. Filesystems without O_DIRECT (tmpfs, some network filesystems) get buffered
writes. Either way the file is fsync'd before `write_file` returns.

A file saved again and again with the same layout starts with a `Head` laid out once
(`ckpt.save.prefix`); `write_file` writes it, then the rest of the pieces.

A save whose staging copies are still being made hands the writer a `Gate`: the writer reads
an arena range only once the copies have reached its place in the file, and writes what it
holds while it waits, so the disk starts on the first bytes staged instead of after the last.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from ckpt.errors import SaveFailed
from ckpt.format.checksum import Hasher, block_size
from ckpt.format.manifest import FileEntry
from ckpt.storage.store import Store, storage_errors

#: A piece of a file: literal bytes, or (segment id, offset, length) of the staging arena.
Piece = bytes | tuple[int, int, int]
#: (key, n): a file's first n pieces are those of the layout `key`, the same at every save of it.
Fixed = tuple[int, int]

def piece_len(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece[2]


ALIGN = 4096  # O_DIRECT alignment of memory, file offsets and lengths (the page size)
_BOUNCE = 8 << 20  # bytes gathered before a direct write
_IOV_MAX = 512  # pieces per writev call
_DIRECT_BATCH = 64 << 20  # bytes queued before an O_DIRECT writev
_SLICE = 64 << 20  # bytes of one range per write call at most: progress shows between them


class Progress:
    """What the writes of this process have done, for the writer process's heartbeat
    (`ckpt.save.writer_proc`): `moved` grows with every write call that returns; `waiting` is what
    may be under way meanwhile with nothing to show for it: the bytes of the write call in
    flight (and an upload's parts in flight), or of a file being made durable (its fsync, its
    upload's last parts). A store that hangs moves nothing."""

    def __init__(self) -> None:
        self.moved = 0
        self.waiting = 0


PROGRESS = Progress()

#: What a gate's pipe carries: a file position, 8 bytes, big-endian.
GATE_WORD = struct.Struct("!q")
GATE_OPEN = 1 << 62  # every copy made: the whole file may be read
GATE_FAILED = -1  # a copy failed: nothing more comes


class Gate:
    """The writer's side of staging copies still being made (`ckpt.save.copier`): after each batch
    of copies the copier writes to a pipe the position in the file before which every arena
    byte is staged; `GATE_OPEN` once all are, `GATE_FAILED` if a copy failed. The pipe, not a
    word of shared memory, orders the copies' stores before the reader's loads (the write and
    the read are system calls), in this process or another. Owns `fd`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.staged_to = 0  # arena bytes before this file position may be read
        self._partial = b""

    def ready(self, end: int) -> bool:
        return end <= self.staged_to

    def wait(self, end: int) -> None:
        """Block until the arena bytes before file position `end` are staged."""
        while self.staged_to < end:
            data = os.read(self.fd, 4096)
            if not data:
                raise SaveFailed("the staging copies of this save ended without finishing (the trainer's log says why)")
            data = self._partial + data
            cut = len(data) - len(data) % GATE_WORD.size
            self._partial = data[cut:]
            for (pos,) in GATE_WORD.iter_unpack(data[:cut]):
                if pos == GATE_FAILED:
                    raise SaveFailed("a staging copy of this save failed (the trainer's log says why)")
                self.staged_to = max(self.staged_to, pos)

    def close(self) -> None:
        os.close(self.fd)


def write_file(
    store: Store,
    rel: str,
    pieces: Iterable[Piece],
    segments: Mapping[int, memoryview],
    *,
    rank: int = -1,
    direct: bool = True,
    prefix: Head | None = None,
    gate: Gate | None = None,
) -> FileEntry:
    """Write `pieces` (literal bytes and arena ranges) as the file `rel` of `store`; with
    `prefix`, the file starts with its pieces and `pieces` are the rest. With `gate`, each
    arena range is read once the staging copies have reached it."""
    pieces = list(pieces)
    size = sum(map(piece_len, pieces)) + (prefix.size if prefix is not None else 0)
    block = block_size(size)
    views = _views(prefix, pieces, segments, gate)
    if store.is_local and direct and hasattr(os, "O_DIRECT"):
        path = store.path(rel)
        with storage_errors(f"writing {store.display}/{rel}"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                return _write_direct(path, views, Hasher(block, algo=store.checksum_algo)).entry(rank)
            except _NoDirectIO:
                # The filesystem refused O_DIRECT at its first write: nothing was read yet
                # but what that write took, which the buffered path below reads again.
                views = _views(prefix, pieces, segments, gate)
    in_flight = (store.transfer.concurrency + 1) * store.transfer.part_size  # an upload's parts
    try:
        with store.open_write(rel, size) as f:
            hasher = Hasher(block, algo=store.checksum_algo)
            if store.is_local:
                _writev_all(f.fileno(), views, hasher)
                PROGRESS.waiting = hasher.size  # the fsync, on leaving: the whole file may be dirty
            else:
                for view, _ in filter(None, views):  # an upload sends whole parts: it cannot write less
                    PROGRESS.waiting = len(view) + in_flight
                    f.write(view)
                    hasher.update(view)
                    PROGRESS.moved += len(view)
                PROGRESS.waiting = min(hasher.size, in_flight)  # the last parts, on leaving
    finally:
        PROGRESS.waiting = 0
    return hasher.entry(rank)


#: A file's bytes in order, as `_views` yields them: a view and whether it lies on a page of
#: memory (and so of the file, for an arena range on a page); None when the next bytes wait
#: for the staging copies, so that the writer first writes what it holds.
Views = Iterator["tuple[memoryview, bool] | None"]


def _views(prefix: Head | None, pieces: list[Piece], segments: Mapping[int, memoryview], gate: Gate | None) -> Views:
    pos = 0
    if prefix is not None:
        yield from prefix.views(gate)
        pos = prefix.size
    for piece in pieces:
        if isinstance(piece, bytes):
            if piece:
                yield memoryview(piece), False
            pos += len(piece)
            continue
        seg, off, length = piece
        pos += length
        if gate is not None and not gate.ready(pos):
            yield None
            gate.wait(pos)
        # Arena segments start on a page, so an offset on a page is an aligned address.
        for view in sliced(segments[seg][off : off + length]):
            yield view, off % ALIGN == 0


class Head(Protocol):
    """A file's first `size` bytes, laid out beforehand (`ckpt.save.prefix.Prefix`)."""

    size: int

    def views(self, gate: Gate | None = None) -> Views: ...


def sliced(view: memoryview) -> Iterable[memoryview]:
    """`view` in parts of at most `_SLICE` bytes (whole pages each, but for the last)."""
    for at in range(0, len(view), _SLICE):
        yield view[at : at + _SLICE]


def _writev_all(fd: int, views: Views, hasher: Hasher) -> None:
    batch: list[memoryview] = []
    queued = 0
    for item in views:
        if item is None:  # the next bytes are not staged yet: write these meanwhile
            _writev_batch(fd, batch)
            batch, queued = [], 0
            continue
        view = item[0]
        hasher.update(view)
        batch.append(view)
        queued += len(view)
        if len(batch) == _IOV_MAX or queued >= _SLICE:
            _writev_batch(fd, batch)
            batch, queued = [], 0
    _writev_batch(fd, batch)


def _writev_batch(fd: int, batch: list[memoryview]) -> None:
    while batch:
        PROGRESS.waiting = sum(map(len, batch))
        n = os.writev(fd, batch)
        PROGRESS.moved += n
        while batch and n >= len(batch[0]):  # drop what was written; a short write resumes
            n -= len(batch[0])
            batch.pop(0)
        if batch and n:
            batch[0] = batch[0][n:]


class _NoDirectIO(Exception):
    pass


def _write_direct(path: str, views: Views, hasher: Hasher) -> Hasher:
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644
        )
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise _NoDirectIO from e
        raise
    try:
        out = _DirectFile(fd, hasher)
        for item in views:
            if item is None:  # the next bytes are not staged yet: write these meanwhile
                out.flush()
            else:
                out.write(*item)
        out.finish()
        # The fsync: the data went to the device already, but for its last page, where O_DIRECT
        # is honoured (some filesystems take the flag and buffer all the same).
        PROGRESS.waiting = out.written
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        PROGRESS.waiting = 0
    os.close(fd)
    return hasher


class _DirectFile:
    """Sequential O_DIRECT writer: page-aligned runs of the caller's memory go to the file as
    they are; the rest is gathered in an aligned bounce buffer and goes a page-multiple at a
    time. Both are queued and written together in few large `writev` calls (the kernel's
    cost per byte falls with the size of a write: 256 MB from 8 MiB writes took 11-13 ms of
    system time, from 64 MiB writes 6-10). The last partial page is written with O_DIRECT
    switched off. The caller's memory must hold until `finish` returns."""

    def __init__(self, fd: int, hasher: Hasher) -> None:
        self.fd = fd
        self.hasher = hasher
        self.bounce = mmap.mmap(-1, _BOUNCE)  # anonymous mappings are page-aligned
        self.base = 0  # bounce bytes before this are queued (whole pages)
        self.fill = 0  # bounce bytes up to this are taken; base..fill wait for a page to end
        self.queued: list[memoryview] = []  # in file order, each a whole number of pages
        self.queued_bytes = 0
        self.written = 0  # bytes in the file
        self.zero_copy = 0  # of which written straight from the caller's memory

    def write(self, view: memoryview, aligned: bool) -> None:
        view = view.cast("B")
        if aligned and (self.fill - self.base) % ALIGN == 0 and len(view) >= ALIGN:
            # The file is at a page boundary (headers and padding before this piece fill whole
            # pages of the bounce buffer): queue them, then the aligned run without a copy.
            self._queue_bounce()
            n = len(view) - len(view) % ALIGN
            for part in sliced(view[:n]):
                self._queue(part)
            self.zero_copy += n
            view = view[n:]
        while len(view):
            if self.fill == _BOUNCE:
                self._queue_bounce()
                self._flush()  # frees the bounce buffer
            n = min(len(view), _BOUNCE - self.fill)
            self.bounce[self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]

    def flush(self) -> None:
        """Write what is queued and the bounce buffer's whole pages."""
        self._queue_bounce()
        self._flush()

    def finish(self) -> None:
        self.flush()
        if self.fill:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            tail = memoryview(self.bounce)[: self.fill]
            self.hasher.update(tail)
            self._writev([tail])
            tail.release()
            self.fill = 0
        self.bounce.close()

    def _queue_bounce(self) -> None:
        whole = (self.fill - self.base) - (self.fill - self.base) % ALIGN
        if whole:
            self._queue(memoryview(self.bounce)[self.base : self.base + whole])
            self.base += whole

    def _queue(self, view: memoryview) -> None:
        # Hashed as it is queued, in the file's order: a few large updates rather than one
        # per piece (a state of 10,000 small tensors is 40,000 pieces).
        self.hasher.update(view)
        self.queued.append(view)
        self.queued_bytes += len(view)
        if self.queued_bytes >= _DIRECT_BATCH or len(self.queued) >= _IOV_MAX:
            self._flush()

    def _flush(self) -> None:
        """Write what is queued; the bounce buffer's queued pages become free again."""
        queued, self.queued, self.queued_bytes = self.queued, [], 0
        self._writev(queued)
        for view in queued:
            view.release()
        rest = self.fill - self.base  # less than a page, waiting: moved to the front
        self.bounce[:rest] = self.bounce[self.base : self.fill]
        self.base, self.fill = 0, rest

    def _writev(self, views: list[memoryview]) -> None:
        try:
            _writev_batch(self.fd, list(views))
        except OSError as e:
            if e.errno == errno.EINVAL and self.written == 0:
                raise _NoDirectIO from e  # the filesystem opened it, but refuses the write
            raise
        self.written += sum(map(len, views))
