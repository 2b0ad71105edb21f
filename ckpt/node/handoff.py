"""A rank's side of the node agent: where a save's files go, their hand-off, the commit.

`Handoff.find` links a Checkpointer to the agent serving its node spool (`spool=` or
`CKPT_SPOOL`). Then each save writes this rank's files to the spool, where a local disk takes
them at its own speed, and hands them off (`ckpt.node.spool`); the agent uploads them and the last
party to make its rank durable commits. When the spool is full, or its agent is gone, the
rank writes to the root itself and takes part in the commit the same way
(`Handoff(spool=None)`: also what ranks without an agent do when another node has one); a
spool that fills during the write gives way to the root the same way. A save's side of all
this is `ckpt.save.upload.ViaAgent`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpt.errors import NotFound
from ckpt.format.manifest import Manifest
from ckpt.node.durable import TAKE_OVER_S, commit_if_complete, committed_as_requested, mark_durable
from ckpt.node.spool import (
    COMMITTED,
    DURABLE,
    FAILED,
    SPOOL_ENV,
    Request,
    Spool,
    job_key,
    public_options,
    read_json,
    request_of,
    status_of,
    write_json,
)
from ckpt.storage.nofollow import UnsafeEntry, open_dir
from ckpt.storage.store import Store

log = logging.getLogger(__name__)

_DURABLE_KEPT = 5  # learned commit times `busy_s` is the median of

POLL_S = 0.05  # the agent's status files, in the spool
ROOT_POLL_S = 1.0  # the root, for a save written there


@dataclass(eq=False)
class _Handed:
    """A save this rank handed off: `status` is the agent's status file ("": written to the
    root by this rank itself)."""

    status: str
    request: Request
    manifest: Manifest


class Handoff:
    """This rank's link to its node's agent; `spool` None: no agent here, the rank writes to
    the root itself and takes part in the commit."""

    def __init__(self, store: Store, spool: Spool | None, rank: int, storage_options: dict[str, Any] | None = None) -> None:
        self.store = store
        self.spool = spool
        self.rank = rank
        self.job = job_key(store)
        self.options = public_options(storage_options)
        self.local = Store(spool.job_dir(self.job)) if spool is not None else None
        if self.local is not None:  # the files it holds are the root's, checksummed alike
            self.local.checksum_algo = store.checksum_algo
        self._warned: str | None = None
        # A save's room in the spool: its staged bytes, or what this rank's data files of the
        # last save took if more (headers and padding: with many small tensors several times
        # more), on each rank of the node, and rank 0's `.metadata`.
        self._last_data = self._last_metadata = 0
        # After a write that ran out of space in the spool though its check had passed: the
        # next save goes to the root (one that DCP plans, as after a failed save, fails on
        # every rank if one rank's spool fills under it), the one after tries the spool again.
        self._pass_over = False
        self._pending: list[_Handed] = []  # handed off, not known to be committed yet
        self._lock = threading.Lock()
        # From a save's start to its commit, by the agent's clock as its status file says
        # (the hand-offs through the spool learned committed, newest last): what keeps a save
        # busy with an agent, not the hand-off (`busy_s`).
        self._durable: deque[float] = deque(maxlen=_DURABLE_KEPT)

    @classmethod
    def find(cls, spool: str | None, store: Store, rank: int, storage_options: dict[str, Any] | None) -> Handoff | None:
        """The agent at `spool` (or CKPT_SPOOL), or None when none is configured or alive."""
        path = spool if spool is not None else os.environ.get(SPOOL_ENV) or None
        if path is None:
            return None
        s = Spool(path)
        if s.agent() is None:
            log.warning("no live ckpt agent on the spool %s: writing to %s directly", s.path, store.display)
            return None
        return cls(store, s, rank, storage_options)

    # -- saving -------------------------------------------------------------------------------
    def target(self, need: int) -> Store:
        """Where this save's files go: the spool, or the root when the spool cannot take them
        (or cannot be looked at: never an error, as every rank must go on to write)."""
        try:
            return self._target(need)
        except Exception as e:
            log.warning("cannot look at the node spool (%s): writing to %s directly", e, self.store.display)
            return self.store

    def _target(self, need: int) -> Store:
        if self.spool is None or self.local is None:
            return self.store
        if self._pass_over:
            self._pass_over = False
            log.warning("the node spool ran out of space under the last save: this one goes to %s directly", self.store.display)
            return self.store
        # Every rank of the node writes its part at the same time.
        need = max(need, self._last_data) * int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) + self._last_metadata
        why = "its agent stopped" if self.spool.agent() is None else self._unwritable() or self.spool.room(need)
        if why is None:
            self._warned = None
            return self.local
        if why != self._warned:
            log.warning("the node spool cannot take this save (%s): writing to %s directly", why, self.store.display)
            self._warned = why
        return self.store

    def _unwritable(self) -> str | None:
        """Why this process cannot write its job's spool directory (a spool made for another
        user or group, a link put in its place), or None."""
        assert self.local is not None and self.spool is not None
        try:
            os.close(open_dir(self.spool.path, os.path.relpath(self.local.root, self.spool.path), create=True))
        except UnsafeEntry as e:
            return str(e)
        except OSError as e:
            return f"this user cannot create {self.local.root}: {e.strerror}"
        if not os.access(self.local.root, os.W_OK | os.X_OK):
            return f"this user (uid {os.getuid()}) cannot write to {self.local.root}"
        return None

    def wrote(self, manifest: Manifest) -> None:
        """A save committed (or handed off): what this rank's files took is the room the
        next one asks of the spool."""
        self._last_data = sum(f.size for f in manifest.files.values() if f.rank == self.rank)
        self._last_metadata = sum(f.size for f in manifest.files.values() if f.rank < 0) if self.rank == 0 else 0

    def spool_filled(self) -> None:
        """A write to the spool ran out of space after its room check passed: the next save
        goes to the root."""
        self._pass_over = True

    def writing(self, target: Store, rel: str) -> None:
        """This rank starts writing a save's files into the spool. Until its request names
        them (`submit`), the agent leaves the step directory alone: an earlier save of the
        same step may have failed there, and its leftovers go, but not these files."""
        if target is self.local and self.spool is not None:
            path = self.spool.writing_path(self.job, rel, self.rank)
            with contextlib.suppress(OSError, UnsafeEntry):  # the write to come says what is wrong
                write_json(path, {"rank": self.rank, "time": time.time()}, under=self.spool.path)  # its age is what counts

    def done_writing(self, rel: str) -> None:
        """This rank writes no more into the step directory (its request names the files, or the save failed)."""
        if self.spool is not None:
            marker = self.spool.writing_path(self.job, rel, self.rank)
            with contextlib.suppress(OSError):
                os.remove(marker)
            with contextlib.suppress(OSError):  # the last rank of the node to finish: no trace
                os.rmdir(os.path.dirname(marker))

    def discard(self, target: Store, rel: str, names: list[str]) -> None:
        """A save that failed: this rank's files of it leave the spool now (the agent would
        drop them only once they are old, counting them as used meanwhile)."""
        self.done_writing(rel)
        if target is self.local:
            for name in names:
                with contextlib.suppress(OSError):
                    os.unlink(target.path(rel, name))

    def submit(
        self, target: Store, rel: str, save_id: str, manifest: Manifest, files: list[str], world: int, started: float,
        draft: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Hand this rank's files of the save off (spool), or mark them durable and commit if
        they are the last (root). `manifest` lists them; `draft`: rank 0's draft of the whole
        manifest in the root (`ckpt.node.durable.write_draft`), which the commit writes."""
        request = Request(
            root=self.store.url,
            storage_options=self.options,
            rel=rel,
            step=manifest.step,
            save_id=save_id,
            rank=self.rank,
            world=world,
            files=sorted(files),
            manifest=_doc(manifest),
            started=started,
            draft=dict(draft or {}),
        )
        if target is self.local and self.spool is not None:
            status = self.spool.status_path(self.job, rel, self.rank)
            with contextlib.suppress(FileNotFoundError):
                os.remove(status)  # an earlier try of the same step: not this one's status
            # IMPORTANT: the files are durable in the spool (fsync'd) before the request names them
            write_json(self.spool.request_path(self.job, rel, self.rank), request.__dict__, under=self.spool.path)
            with self._lock:
                self._pending.append(_Handed(status, request, manifest))
            return
        mark_durable(self.store, rel, save_id, self.rank, {n: manifest.files[n].checksum for n in files})
        commit_if_complete(self.store, request)
        with self._lock:
            self._pending.append(_Handed("", request, manifest))

    def cancel(self, save_id: str) -> None:
        """The save failed on some rank: it can never commit. Forget it, and take its request
        back from the agent (an upload under way finishes; nothing commits)."""
        with self._lock:
            gone = [h for h in self._pending if h.request.save_id == save_id]
            self._pending = [h for h in self._pending if h not in gone]
        for h in gone:
            if h.status:
                with contextlib.suppress(OSError):
                    os.remove(request_of(h.status))

    def committed(self, timeout_s: float = 0.0) -> list[Manifest]:
        """The saves handed off since the last call that are committed now (waiting up to
        `timeout_s` for all of them). A hand-off that failed is logged and dropped."""
        deadline = time.monotonic() + timeout_s
        done: list[Manifest] = []
        while True:
            with self._lock:  # the metrics thread asks too; the store is asked outside the lock
                handed = list(self._pending)
            states = {id(h): self._state(h) for h in handed}
            with self._lock:
                for h in handed:
                    if states[id(h)] in (COMMITTED, FAILED) and h in self._pending:
                        self._pending.remove(h)
                        if states[id(h)] == COMMITTED:
                            done.append(h.manifest)
                            self._learn_durable(h)
                        else:
                            log.error("the hand-off of step %d failed: %s", h.manifest.step, self._why(h.status))
                left = list(self._pending)
            if not left or time.monotonic() >= deadline:
                return done
            if self.spool is not None and self.spool.agent() is None and all(h.status for h in left):
                log.error("the node agent is gone: steps %s stay in the spool %s for the next agent to upload", self.pending, self.spool.path)
                return done
            time.sleep(POLL_S if all(h.status for h in left) else ROOT_POLL_S)

    @property
    def pending(self) -> list[int]:
        return [h.manifest.step for h in self._pending]

    def busy_s(self) -> float:
        """How long a save keeps the agent busy, as known now: from a save's start to its
        commit, the median of the last `_DURABLE_KEPT` learned (one save held up by an
        outage, or left to the next agent, is not the price of the next). 0: none learned."""
        with self._lock:
            return statistics.median(self._durable) if self._durable else 0.0

    def _learn_durable(self, h: _Handed) -> None:
        """From a committed hand-off's status file: the time its agent recorded the commit
        (the agent that committed: at once; another node's commit: at its next look,
        `LOOKS_S`, seconds late at most, never a whole interval), no later than now (the
        status file is the agent's to write: a clock that jumped, a bad value)."""
        if not h.status:  # written to the root by this rank: its own background save's time
            return
        at = (read_json(h.status) or {}).get("time")
        if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
            self._durable.append(max(0.0, min(float(at), time.time()) - h.request.started))

    def _state(self, h: _Handed) -> str | None:
        if not h.status:  # written to the root by this rank: look (and commit, for a party that died before it)
            overdue = time.time() - h.request.submitted > TAKE_OVER_S
            outcome = commit_if_complete(self.store, h.request, markers=self.rank == 0 or overdue)
            return FAILED if outcome == "superseded" else COMMITTED if outcome else None
        state = h.request.state(read_json(h.status))
        if state is not None or os.path.exists(request_of(h.status)):
            return state
        # The agent is done with it and pruned it from the spool: the root says how it ended.
        return COMMITTED if committed_as_requested(self.store, h.request) else FAILED

    @staticmethod
    def _why(status: str) -> str:
        return str((read_json(status) or {}).get("why", "")) if status else "another save of the step committed or claimed it"

    def wait_idle(self, timeout_s: float) -> None:
        """Before a restore: let the agent finish what this job handed off on this node, so
        that the newest checkpoint is committed before one is picked."""
        if self.spool is None:
            return
        deadline, told = time.monotonic() + timeout_s, False
        while time.monotonic() < deadline and self.spool.agent() is not None:
            busy = self._busy_steps()
            if not busy:
                return
            if not told:
                log.info("waiting for the node agent to upload steps %s before restoring", busy)
                told = True
            time.sleep(POLL_S * 4)

    def _busy_steps(self) -> list[int]:
        """Steps this job handed off on this node that are not durable yet (the agent tries
        the commit before it says durable)."""
        assert self.spool is not None
        busy = set()
        for path in self.spool.requests(self.job):
            with contextlib.suppress(ValueError, TypeError):
                request = Request.from_doc(read_json(path))
                if request.state(read_json(status_of(path))) not in (COMMITTED, FAILED, DURABLE):
                    busy.add(request.step)
        return sorted(busy)

    # -- restoring ----------------------------------------------------------------------------
    def reader_store(self, rel: str, manifest: Manifest) -> Tiered | None:
        """A store that reads the step's files from the spool where its copies have the
        manifest's sizes (checksums are verified as they are read), else from the root."""
        if self.local is None:
            return None
        local = set()
        for name, entry in manifest.files.items():
            with contextlib.suppress(OSError):
                if os.path.getsize(self.local.path(rel, name)) == entry.size:
                    local.add(name)
        # A rank's part of the manifest grows as it learns which files it reads
        # (`ckpt.restore.view.fetch`): those are judged as they are first read.
        return Tiered(self.store, self.local, local, manifest.files) if local else None


class Tiered:
    """Reads from the node spool the files it holds, and the rest from the root (what the
    restore's reader needs of a Store). Counts the bytes read from each."""

    def __init__(self, store: Store, local: Store, names: set[str], files: dict[str, Any] | None = None) -> None:
        self.store, self.local, self.names = store, local, names
        self.display = store.display
        self.bytes = {"spool": 0, "store": 0}
        self._lock = threading.Lock()
        # The manifest's entries, which may grow after `names` was judged: a file first read
        # later is judged then (the spool's copy of the entry's size), once.
        self._files, self._judged = files, set(files or ())

    def _from(self, rel: str) -> str:
        name = rel.rsplit("/", 1)[-1]
        if self._files is not None and name not in self._judged and (entry := self._files.get(name)) is not None:
            with contextlib.suppress(OSError):
                if os.path.getsize(self.local.path(rel)) == entry.size:
                    with self._lock:
                        self.names.add(name)
            with self._lock:
                self._judged.add(name)
        return "spool" if name in self.names else "store"

    def local_path(self, rel: str) -> str | None:
        return self.local.path(rel) if self._from(rel) == "spool" else self.store.local_path(rel)

    def read_small(self, rel: str, at_most: int) -> bytes | None:
        """`Store.read_small` from the spool where it holds the file, else from the root."""
        if self._from(rel) == "spool":
            with contextlib.suppress(NotFound):
                data = self.local.read_small(rel, at_most)
                self._count("spool", len(data or b""))
                return data
        data = self.store.read_small(rel, at_most)
        self._count("store", len(data or b""))
        return data

    @contextlib.contextmanager
    def open_read(self, rel: str, ranges: list[tuple[int, int]] | None = None, size: int | None = None) -> Iterator[BinaryIO]:
        local: BinaryIO | None = None
        if self._from(rel) == "spool":
            with contextlib.suppress(FileNotFoundError):  # pruned by the agent meanwhile: the root has it
                local = open(self.local.path(rel), "rb")
        with local if local is not None else self.store.open_read(rel, ranges, size) as f:
            counting = _Counting(f)
            try:
                yield counting  # type: ignore[misc]
            finally:
                self._count("spool" if local is not None else "store", counting.n)

    def _count(self, source: str, n: int) -> None:
        with self._lock:  # a restore reads several files at once, one thread each
            self.bytes[source] += n

    @property
    def source(self) -> str:
        """Where most of the bytes came from: "spool" or "store"."""
        return "spool" if self.bytes["spool"] >= self.bytes["store"] and self.bytes["spool"] else "store"


class _Counting(io.RawIOBase):
    """A file that counts the bytes read through it (`n`)."""

    def __init__(self, f: Any) -> None:
        self._f, self.n = f, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._f.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.n += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self.n += n or 0
        return n


def _doc(manifest: Manifest) -> dict[str, Any]:
    return json.loads(manifest.to_json())
