"""A restore's files, read into the page cache while the restore still plans.

A restarted rank spends its first tens of milliseconds on CPU work (its state's template,
the manifest, DCP's planning) before it reads a byte of its data, and the disk idles
meanwhile. On a local disk (the root or the node spool) a thread pulls the rank's files in
during that time, and stops when the reader starts: from then on the reader's own reads and
the kernel's readahead keep the disk busy, and pulling further would only compete with them
or outrun the page cache.

The thread moves the bytes with sendfile() to /dev/null, 32 MiB per call: the kernel reads
the pages the usual sequential way, nothing is copied to user memory, and the GIL is held
only between calls. A chunk whose pages are in memory already (a restart on the node that
saved the checkpoint) is passed over: pulling it through costs CPU the planning needs.
Measured on a 2-core VM with 2 ranks of 95 MB each: a thread of read() calls waited on the
planning thread's GIL between calls and gained little; POSIX_FADV_WILLNEED, one call per
window, made the later read slower than a cold one. Linux only.

From an object store a rank's own data files and its index (on the world size that saved
them) are opened as soon as the manifest names them (`Store.read_early`): their first
`Transfer.readahead` ranged GETs go out while the rank still plans, and the reader goes on
with those streams, checking every byte as always. Streams the restore did not take up are closed with the
Prefetch. Through the node spool's tiers, nothing is read early; nor where the node's ranks
outnumber its cores: there receiving the bytes takes CPU the planning needs, and measured
with 16 ranks on 2 cores (the store on them too) the restore took 4.76 s with early reads
against 3.93 s without (`bench/early_reads.py --ranks 16 --latency 0`). With 2 ranks and a
store that answers each ranged GET 0.2 s later, 1.81 s against 2.14 s."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckpt.collectives import a_core_each
from ckpt.format.manifest import INDEX_SUFFIX, Manifest
from ckpt.restore.partial import first_reads

if TYPE_CHECKING:
    from ckpt.storage.store import Store

log = logging.getLogger(__name__)

_CHUNK = 32 << 20  # bytes per sendfile(): few GIL hand-overs; stop() takes effect within one
# At most this many bytes pulled in per restore: a rank whose planning waits long on another
# rank must not fill the node's page cache (its ranks restore at once) ahead of its reader.
_MAX_BYTES = 4 << 30
_JOIN_S = 5.0  # one chunk from a slow disk
_EARLY_FILES = 2  # a rank's files read early from an object store: as many as it reads at once


class Prefetch:
    """Reads `paths` (local files, in order) into the page cache on a thread of its own
    until `stop()` or the end of the files. A hint, never an error: a file that cannot be
    opened or read is passed over, and a thread that cannot start is none. Use as a context
    manager: leaving it stops the thread and waits for it (the chunk it is reading)."""

    def __init__(
        self, paths: Sequence[str] = (), chunk: int = _CHUNK, limit: int = _MAX_BYTES, early: tuple[Store, list[tuple[str, int]]] | None = None
    ) -> None:  # fmt: skip
        self._early = early[0] if early else None  # the store whose streams `__exit__` closes
        for rel, size in early[1] if early else ():
            early[0].read_early(rel, size)  # type: ignore[index]
        self.covered = 0  # bytes of the files gone through: pulled in, or found in the page cache
        self.pulled = 0  # of which pulled in (the kernel's readahead may pull more)
        self._stopped = threading.Event()
        self._chunk, self._limit = chunk, limit
        self._thread: threading.Thread | None = None
        if paths and sys.platform.startswith("linux") and hasattr(os, "sendfile"):
            thread = threading.Thread(target=self._run, args=(list(paths),), name="ckpt-prefetch", daemon=True)
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had: this rank plans without one
                log.debug("no prefetch: %s", e)
            else:
                self._thread = thread

    def stop(self) -> None:
        """No chunk after the current one; returns at once."""
        if not self._stopped.is_set():
            self._stopped.set()
            if self._thread is not None:
                log.debug("prefetch stopped after %.1f MB (%.1f MB pulled in)", self.covered / 1e6, self.pulled / 1e6)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        # Not left running behind the restore: a fallback's own prefetch, or a DataLoader
        # forking its workers next, would find it mid-chunk.
        self.join(_JOIN_S)
        if self._early is not None:
            self._early.drop_early()

    @classmethod
    def for_restore(cls, store: Store, tiered: Any, rel: str, manifest: Manifest, rank: int, world: int) -> Prefetch:
        """A rank's restore of `rel` (see `to_warm`)."""
        paths, early = to_warm(store, tiered, rel, manifest, rank, world)
        return cls(paths, early=(store, early) if early else None)

    def _run(self, paths: list[str]) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        try:
            for path in paths:
                if self._stopped.is_set() or self.pulled >= self._limit:
                    return
                # ValueError: a name the OS cannot take (a NUL byte): the reader says what is wrong.
                with contextlib.suppress(OSError, ValueError):
                    self._pull(path, null)
        finally:
            os.close(null)

    def _pull(self, path: str, null: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            size, at = os.fstat(fd).st_size, 0
            while at < size and not self._stopped.is_set() and self.pulled < self._limit:
                n = min(self._chunk, self._limit - self.pulled, size - at)
                # Not pulled again: what a restart on the node that saved it finds in memory.
                if not _cached(fd, at, at + n):
                    n = os.sendfile(null, fd, at, n)
                    if not n:
                        return
                    self.pulled += n
                at += n
                self.covered += n
        finally:
            os.close(fd)


_PROBES = 8  # pages looked at per chunk


def _cached(fd: int, start: int, end: int) -> bool:
    """Whether pages spread over [start, end) are all in the page cache: reads of one byte
    that must not wait (RWF_NOWAIT). False where the kernel cannot say."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    probe = bytearray(1)
    try:
        for i in range(_PROBES):
            if os.preadv(fd, [probe], start + (end - 1 - start) * i // (_PROBES - 1), os.RWF_NOWAIT) != 1:
                return False
    except OSError:  # EAGAIN: not in the page cache; EOPNOTSUPP: no such reads here
        return False
    return True


def to_warm(store: Store, tiered: Any, rel: str, manifest: Manifest, rank: int, world: int) -> tuple[list[str], list[tuple[str, int]]]:
    """What a rank's restore of `rel` warms: from a local disk (the root or the node spool,
    `tiered`) the paths of the files it reads first (`first_reads`); from an object store its
    own data files and their sizes, to open early (at most as many as it reads at once)."""
    source = tiered or store
    paths = [p for n in first_reads(manifest, rank, world) if (p := source.local_path(f"{rel}/{n}")) is not None]
    if tiered is not None or store.is_local or manifest.world_size != world or not a_core_each():
        return paths, []
    own = [(f"{rel}/{n}", e.size) for n, e in sorted(manifest.files.items()) if e.rank == rank and n.endswith(".distcp")]
    # And its own index, first: the rank reads it as it plans (`partial_metadata`), a round trip sooner.
    index = [(f"{rel}/{n}", e.size) for n, e in sorted(manifest.files.items()) if e.rank == rank and n.endswith(INDEX_SUFFIX)]
    return paths, index[:1] + own[:_EARLY_FILES]

