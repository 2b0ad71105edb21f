"""Checksums of checkpoint files: xxh3-64 over a whole file, or per block for large files, so
that a reader can verify only the blocks it needs."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from .manifest import FileEntry

CHECKSUM_ALGO = "xxh3_64"

# A data file's checksum is kept per block too, so that a restore which needs a few items of
# another rank's file (a replicated scalar, one side of a reshard) reads and verifies only the
# blocks holding them. A file has at most BLOCKS_MAX blocks of a power of two bytes, at least
# BLOCK_MIN; a file of up to two of those has one checksum over all of it.
BLOCKS_ALGO = "xxh3_64-blocks"  # the xxh3-64 of the block checksums (8 bytes each, in order)
BLOCK_MIN = 1 << 20
BLOCKS_MAX = 64


def block_size(total: int) -> int:
    """Bytes per checksummed block of a file of `total` bytes; 0: one checksum for all of it."""
    if total <= 2 * BLOCK_MIN:
        return 0
    block = BLOCK_MIN
    while block * BLOCKS_MAX < total:
        block *= 2
    return block


def blocks_digest(blocks: list[str]) -> str:
    """A blocked file's checksum, from its block checksums (hex)."""
    return f"{BLOCKS_ALGO}:{xxhash.xxh3_64(b''.join(bytes.fromhex(b) for b in blocks)).hexdigest()}"


class Hasher:
    """Running checksum of the bytes that pass through it: one over all of them, or with
    `block`, one per block of that many bytes (`blocks`, hex) and the checksum of those.
    `on_block(index, hex)` is called as each block completes."""

    def __init__(self, block: int = 0, on_block: Callable[[int, str], None] | None = None) -> None:
        self._h = xxhash.xxh3_64()
        self.size = 0
        self.block = block
        self.blocks: list[str] = []
        self._on_block = on_block
        self._in_block = 0  # bytes of the current block hashed

    def update(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not self.block or self._in_block + n < self.block:  # most pieces: within a block
            self._h.update(data)
            self.size += n
            self._in_block += n if self.block else 0
            return
        view = data if isinstance(data, memoryview) else memoryview(data)
        while len(view):
            n = min(len(view), self.block - self._in_block)
            self._h.update(view[:n])
            self._in_block += n
            self.size += n
            view = view[n:]
            if self._in_block == self.block:
                self.end_block()

    def end_block(self) -> None:
        """Close the current block (the last of a file may be short); nothing if it is empty."""
        if self.block and self._in_block:
            digest = self._h.hexdigest()
            self.blocks.append(digest)
            self._h.reset()
            self._in_block = 0
            if self._on_block is not None:
                self._on_block(len(self.blocks) - 1, digest)

    def jump(self, index: int) -> None:
        """Hash from the start of block `index` on (a reader that skips whole blocks)."""
        if not self.block or self._in_block or index < len(self.blocks):
            raise ValueError("a jump goes forward to the start of a block")
        self.blocks += [""] * (index - len(self.blocks))
        self.size = index * self.block

    def hexdigest(self) -> str:
        if not self.block:
            return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"
        self.end_block()
        return blocks_digest(self.blocks)

    def entry(self, rank: int) -> FileEntry:
        """The manifest's record of the file that passed through (all of it)."""
        digest = self.hexdigest()
        return FileEntry(self.size, digest, rank, self.block, tuple(self.blocks))


def checksum(data: bytes | memoryview, block: int = 0) -> str:
    if not block:
        return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64(data).hexdigest()}"
    hasher = Hasher(block)
    hasher.update(data)
    return hasher.hexdigest()
