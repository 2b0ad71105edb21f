"""A file's fixed first pieces, gathered once and written again and again (`Prefix`).

A file saved again and again with the same layout (`ckpt.save.resave`) names its fixed first
pieces once: a `Prefix` gathers them into an image of their bytes, headers filled in once, so
each later write copies only the arena ranges into it (a state of 10,000 small tensors is
40,000 pieces, which one by one cost the writer two copies of the state in Python) and writes
the image and the page-aligned ranges in a few large writes (`ckpt.save.filewrite.write_file`).
An `Image` is a whole file so written (rank 0's `.metadata`); `Prefixes` is a writer's one
prefix at a time, by the key of its layout.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping

from ckpt.format.checksum import checksum
from ckpt.format.manifest import FileEntry
from ckpt.save.filewrite import ALIGN, Gate, Piece, Views, piece_len, sliced, write_file
from ckpt.storage.store import Store

_PREFIX_IMAGE_MAX = 256 << 20  # a prefix whose gathered bytes exceed this is written piece by piece


class Prefix:
    """The fixed first pieces of a file, gathered for writing it again and again: their bytes
    in file order are runs, each a page-aligned range of an arena segment (written as it is)
    or of an image made once, which holds the literal pieces and into which `views` copies
    the other arena ranges of a run before it is written. Built where the file is written
    (the writer process), from the segments mapped there; `close` before any of them is
    unmapped."""

    def __init__(self, runs: _Runs, segments: Mapping[int, memoryview]) -> None:
        plan, fills, size = runs
        self.nbytes = size  # the image's
        self.size = sum(n for _, _, n in plan)  # the file's
        self._image = mmap.mmap(-1, max(size, 1))
        view = memoryview(self._image)
        copies: list[tuple[int, memoryview, memoryview]] = []  # (image offset, into, from)
        for at, piece in fills:
            if isinstance(piece, bytes):
                view[at : at + len(piece)] = piece
            else:
                seg, off, n = piece
                copies.append((at, view[at : at + n], segments[seg][off : off + n]))
        # Each run, the file position where it ends, whether it reads the arena, and the
        # arena ranges copied into it (an image run's; both in the image's order).
        self._runs: list[tuple[memoryview, int, bool, list[tuple[memoryview, memoryview]]]] = []
        pos = i = 0
        for seg, off, n in plan:
            pos += n
            if seg >= 0:
                self._runs.append((segments[seg][off : off + n], pos, True, []))
                continue
            mine = []
            while i < len(copies) and copies[i][0] < off + n:
                mine.append(copies[i][1:])
                i += 1
            self._runs.append((view[off : off + n], pos, bool(mine), mine))

    @classmethod
    def build(cls, pieces: list[Piece], segments: Mapping[int, memoryview]) -> Prefix | None:
        """The prefix of `pieces`; None if its image would exceed _PREFIX_IMAGE_MAX bytes."""
        runs = _lay_out_runs(pieces)
        return cls(runs, segments) if runs[2] <= _PREFIX_IMAGE_MAX else None

    def views(self, gate: Gate | None = None) -> Views:
        """The runs in file order (see `_views`), each image run with the arena's current
        bytes copied into it, once `gate` says they are staged."""
        for run, end, arena, copies in self._runs:
            if arena and gate is not None and not gate.ready(end):
                yield None
                gate.wait(end)
            for dst, src in copies:
                dst[:] = src
            for part in sliced(run):
                yield part, True

    def close(self) -> None:
        for run, _, _, copies in self._runs:
            run.release()
            for dst, src in copies:
                dst.release()
                src.release()
        self._runs = []
        self._image.close()


_Runs = tuple[list[tuple[int, int, int]], list[tuple[int, Piece]], int]


class Image:
    """A whole file's bytes, written again and again (rank 0's `.metadata`, at the save DCP
    planned and at every save of its layout after), kept in page-aligned memory: on a local filesystem each write goes to the
    disk with O_DIRECT, without a copy and without taking pages of the page cache. (4 MB of
    fresh page cache a save cost the trainer's background thread ~10 ms of kernel CPU; the
    data files never go through it.) Its entry has the one checksum of the whole file."""

    def __init__(self, data: bytes, algo: str) -> None:
        self.entry = FileEntry(len(data), checksum(data, algo=algo), -1)
        self._prefix = Prefix(_lay_out_runs([data]), {})

    def write(self, store: Store, rel: str) -> FileEntry:
        write_file(store, rel, [], {}, prefix=self._prefix)
        return self.entry


def _lay_out_runs(pieces: list[Piece]) -> _Runs:
    """A prefix's runs, (segment or -1 for the image, offset, length) in file order; what goes
    where in the image, (offset, piece); the image's size. An arena range on a page, at a page
    of the file, is a run of its own (its whole pages; the rest of it goes to the image); all
    else joins the image, where each run starts on a page."""
    plan: list[tuple[int, int, int]] = []
    fills: list[tuple[int, Piece]] = []
    pos = image = start = 0  # file position; image bytes used; the open image run's start
    for piece in pieces:
        n = piece_len(piece)
        if not isinstance(piece, bytes) and piece[1] % ALIGN == 0 and pos % ALIGN == 0 and n >= ALIGN:
            if image > start:
                plan.append((-1, start, image - start))
            whole = n - n % ALIGN
            plan.append((piece[0], piece[1], whole))
            pos += whole
            start = image = image + -image % ALIGN
            piece, n = (piece[0], piece[1] + whole, n - whole), n - whole
        if n:
            fills.append((image, piece))
            image += n
            pos += n
    if image > start:
        plan.append((-1, start, image - start))
    return plan, fills, image


class Prefixes:
    """A sink's prefix of the file it writes again and again: one at a time, by the key that
    `ckpt.save.resave` gives a layout; a new key, or the segments changing, drops the last one."""

    def __init__(self) -> None:
        self.key: int | None = None
        self.pieces: list[Piece] = []
        self._built: Prefix | None = None
        self._failed = False

    def learn(self, key: int, pieces: list[Piece]) -> None:
        if key != self.key:
            self.drop()
            self.key, self.pieces = key, pieces

    def get(self, key: int, segments: Mapping[int, memoryview]) -> Prefix | None:
        if key != self.key:
            raise ValueError(f"a write names prefix {key}, but prefix {self.key} was sent")
        if self._built is None and not self._failed:
            self._built = Prefix.build(self.pieces, segments)
            self._failed = self._built is None
        return self._built

    def write(
        self, store: Store, rel: str, key: int | None, rest: list[Piece], segments: Mapping[int, memoryview], rank: int,
        gate: Gate | None = None,
    ) -> FileEntry:  # fmt: skip
        """Write the file `rel`: the prefix `key` (learnt before), then `rest`; with no key,
        `rest` is all of it, and the prefix is dropped (a save of a new layout)."""
        if key is None:
            self.drop()
            return write_file(store, rel, rest, segments, rank=rank, gate=gate)
        prefix = self.get(key, segments)
        return write_file(store, rel, rest if prefix else self.pieces + rest, segments, rank=rank, prefix=prefix, gate=gate)

    def release(self) -> None:
        """Let go of the segments (and the image); the next write builds the prefix again."""
        if self._built is not None:
            self._built.close()
        self._built, self._failed = None, False

    def drop(self) -> None:
        self.release()
        self.key, self.pieces = None, []
