"""Checksums of checkpoint files: over a whole file, or per block for large files, so that a
reader can verify only the blocks it needs.

Two algorithms: xxh3-64 (fast, not cryptographic: against corruption) and, for a job that
signs its manifests, BLAKE3 (cryptographic: a signature over the checksums then covers the
data against tampering too). A manifest entry names its algorithm ("<algorithm>:<hex>"),
so a reader checks each file the way it was written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3
import xxhash

from ckpt.errors import InvalidCheckpoint
from ckpt.format.manifest import FileEntry

XXH3 = "xxh3_64"
BLAKE3 = "blake3"
CHECKSUM_ALGO = XXH3  # what files get unless their manifest is signed
# BLAKE3 hashes a large piece with up to this many threads (2.4 GB/s on one core here, against
# xxh3's 8): a few, so that the ranks of a node hashing at once do not each take every core.
BLAKE3_THREADS = 4
_NEW: dict[str, Callable[[], Any]] = {
    XXH3: xxhash.xxh3_64,
    BLAKE3: lambda: blake3.blake3(max_threads=BLAKE3_THREADS),
}

# A data file's checksum is kept per block too, so that a restore which needs a few items of
# another rank's file (a replicated scalar, one side of a reshard) reads and verifies only the
# blocks holding them. A file has at most BLOCKS_MAX blocks of a power of two bytes, at least
# BLOCK_MIN; a file of up to two of those has one checksum over all of it. Its checksum is then
# "<algorithm>-blocks:" and the checksum of the block checksums (their bytes, in order).
BLOCKS = "-blocks"
BLOCKS_ALGO = XXH3 + BLOCKS
BLOCK_MIN = 1 << 20
BLOCKS_MAX = 64


def algorithm(entry: FileEntry, where: str) -> str:
    """The algorithm `entry`'s checksum was made with; InvalidCheckpoint if this ckpt does not
    know it (a file written by a newer version, or a manifest that was tampered with)."""
    algo = entry.checksum.partition(":")[0] if isinstance(entry.checksum, str) else repr(entry.checksum)
    algo = algo[: -len(BLOCKS)] if algo.endswith(BLOCKS) else algo
    if algo not in _NEW:
        raise InvalidCheckpoint(f"{where}: its checksum is {algo[:40]!r}, which this ckpt cannot check (it knows {', '.join(_NEW)}); written by a newer ckpt?")
    return algo


def block_size(total: int) -> int:
    """Bytes per checksummed block of a file of `total` bytes; 0: one checksum for all of it."""
    if total <= 2 * BLOCK_MIN:
        return 0
    block = BLOCK_MIN
    while block * BLOCKS_MAX < total:
        block *= 2
    return block


def blocks_digest(blocks: list[str], algo: str = XXH3) -> str:
    """A blocked file's checksum, from its block checksums (hex)."""
    return f"{algo}{BLOCKS}:{_digest(algo, b''.join(bytes.fromhex(b) for b in blocks))}"


class Hasher:
    """Running checksum of the bytes that pass through it: one over all of them, or with
    `block`, one per block of that many bytes (`blocks`, hex) and the checksum of those.
    `on_block(index, hex)` is called as each block completes. `algo`: XXH3 or BLAKE3."""

    def __init__(self, block: int = 0, on_block: Callable[[int, str], None] | None = None, algo: str = XXH3) -> None:
        self.algo = algo
        self._h = _NEW[algo]()
        self.size = 0
        self.block = block
        self.blocks: list[str] = []
        self._on_block = on_block
        self._in_block = 0  # bytes of the current block hashed

    @classmethod
    def checking(cls, entry: FileEntry, where: str, on_block: Callable[[int, str], None] | None = None) -> Hasher:
        """A hasher that makes checksums comparable with `entry`'s (its algorithm, its blocks)."""
        return cls(entry.block, on_block, algorithm(entry, where))

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
            return f"{self.algo}:{self._h.hexdigest()}"
        self.end_block()
        return blocks_digest(self.blocks, self.algo)

    def entry(self, rank: int) -> FileEntry:
        """The manifest's record of the file that passed through (all of it)."""
        digest = self.hexdigest()
        return FileEntry(self.size, digest, rank, self.block, tuple(self.blocks))


def _digest(algo: str, data: bytes | memoryview) -> str:
    h = _NEW[algo]()
    h.update(data)
    return str(h.hexdigest())


def checksum(data: bytes | memoryview, block: int = 0, algo: str = XXH3) -> str:
    if not block:
        return f"{algo}:{_digest(algo, data)}"
    hasher = Hasher(block, algo=algo)
    hasher.update(data)
    return hasher.hexdigest()
