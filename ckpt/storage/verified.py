"""A checkpoint's files read as its manifest says they are: every byte that is read goes
through the checksum and the byte count, and a mismatch is an InvalidCheckpoint that says where.
`read_verified` reads a small file whole, `verify_file` checks one streaming it in bounded
chunks, and `VerifyingReader` hands out a file's bytes as a restore reads them (a block at a
time for block checksums, skipping the blocks a rank does not need).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from ckpt.errors import InvalidCheckpoint
from ckpt.format.checksum import Hasher, algorithm, checksum
from ckpt.format.manifest import FileEntry, Manifest

if TYPE_CHECKING:
    from ckpt.storage.store import Store

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
    data = store.read_small(f"{step_dir}/{name}", entry.size)  # never more than the manifest says, in memory
    if data is None:
        raise InvalidCheckpoint(f"{where}: longer than the {entry.size} bytes the manifest says")
    return _checked(where, entry, data)


def checked(where: str, name: str, manifest: Manifest, data: bytes) -> bytes:
    """`data`, said to be the whole of `name` (received from another rank, not read here),
    once its size and checksum matched the manifest's entry."""
    return _checked(where, _entry(where, name, manifest), data)


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
