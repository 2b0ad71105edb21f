"""The save in flight: one per rank at a time, from the staging copy to the commit.

A `SaveSlot` owns what a save holds after the loop has let go of it: the staging buffers and
their copies (`ckpt.save.stage`), the cached save plan (`ckpt.save.resave`), the writer process or
thread (`ckpt.save.writer_proc`), and the background thread that runs the save with its future.
The `Checkpointer` decides when to save and what happens after; the slot says whether the
copies are done (the optimizer's pre-hook waits on it), whether the save is still running
and how it ended.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ckpt._faults import fault_point
from ckpt.errors import SaveFailed, dcp_causes
from ckpt.format.manifest import Manifest
from ckpt.save.arena import Arena
from ckpt.save.commit import Save, Source, Upload, persist
from ckpt.save.copier import Copier
from ckpt.save.dcp_write import Sink
from ckpt.save.resave import Layout, Resaver
from ckpt.save.stage import Copies, Stager, StagingRaced
from ckpt.save.writer_proc import Sinks, ThreadSink
from ckpt.storage.store import Store

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Staged:
    """The loop's part of a save, done: the state staged in host buffers (or the live state,
    `streamed`, with no `copies`), or why this rank has nothing to save (`failed`: its
    staging copy failed)."""

    state: Any
    copies: Copies | None
    failed: Exception | None = None
    streamed: bool = False


class SaveSlot:
    """One save at a time: its staging, its writer and its background thread."""

    def __init__(self, store: Store, storage_options: dict[str, Any] | None) -> None:
        self.store = store
        self.stager = Stager()
        self.resaver = Resaver()
        self.sinks = Sinks(store, storage_options)
        self._staged = threading.Event()  # set: no staging copy is pending
        self._staged.set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future[Manifest] | None = None

    def open(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
        self._copy_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy")

    def stage(
        self, capture: Callable[[], Any], budget: int, group_max: Callable[[list[int]], list[int]], defer: Callable[[Any, Any], bool] | None,
        *, rank: int, step: int,
    ) -> Staged:  # fmt: skip
        """Capture the state (`capture()`) and copy it into the staging buffers, or with
        `defer` set them up and leave the copies `defer` picks to the background save (the
        next optimizer step waits for them). No copy when the state is over the host memory
        `budget` on any rank: the save streams from the live state. `group_max` is the
        ranks' element-wise max (a collective).

        A capture that raises (a state_dict() that fails, a state no restore could load)
        raises on every rank: on this one its own error, on the others a SaveFailed, as the
        ranks learn of it in the collective every save takes here. A capture that fails in
        a collective of its own (FSDP1's, DeepSpeed's gathers) leaves the others there:
        torch's timeout ends that. A copy that fails after it (host or shared memory to be
        had, a device error) is handed back (`Staged.failed`): the save then fails on every
        rank at its first collective, as `on_error` says."""
        state, failed, over = None, None, False
        try:
            state = capture()
            over = self.stager.over_budget(state, budget)
        except Exception as e:
            failed = e
        # IMPORTANT: every rank takes this collective, the one whose capture failed too.
        stream, any_failed = group_max([int(over), int(failed is not None)])
        if failed is not None:
            raise failed
        if any_failed:
            raise SaveFailed(f"save of step {step} failed: another rank could not capture its state (its log says why)")
        if stream:
            # No host copy: the write streams from the live tensors item by item, and the
            # loop waits for it (nothing may change them meanwhile).
            self.stager.said_over(state, budget)
            return Staged(state, None, streamed=True)
        try:
            fault_point("prepare", rank, step)
            staged, copies = self.stager.prepare(state, defer=defer or _now)
            if defer is None:
                copies.run()
        except Exception as e:
            return Staged(None, None, e)
        if defer is not None:
            self._staged.clear()  # IMPORTANT: the next optimizer.step() waits for the copies
        return Staged(staged, copies)

    def staging_done(self) -> None:
        """No staging copy is pending (whatever became of the save): set by the copies'
        runner, and again when the background save ends, so nothing waits on it forever."""
        self._staged.set()

    def wait_for_staging(self) -> float:
        """Wait until no staging copy is pending; returns the seconds waited."""
        if self._staged.is_set():
            return 0.0
        t = time.perf_counter()
        self._staged.wait()
        return time.perf_counter() - t

    @property
    def opened(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Manifest], *args: Any) -> None:
        """Run `fn(*args)` (the save) in the background thread: the save in flight."""
        assert self._pool is not None, "use the Checkpointer as a context manager"
        self._inflight = self._pool.submit(fn, *args)

    def write_and_commit(self, save: Save, staged: Staged, upload: Upload, timeout_s: float) -> Manifest:
        """The background save: the copies left to it, then `commit.persist`; every failure a
        `SaveFailed`. A rank that has nothing to write (its staging failed) still goes into
        the save, where every rank learns at the first collective that it failed."""
        unready = f"{type(staged.failed).__name__}: {staged.failed}" if staged.failed is not None else None
        # The last save's layout, if the state fits it: the copies come in its file's order.
        layout = self.resaver.fitting(staged.state) if unready is None else None
        sinks: Callable[[Store], Sink] = ThreadSink
        arenas: list[Arena] = []
        copier = None
        try:
            copier = self.copy(staged, layout, save.rank, save.step)
            if unready is None:
                sinks, arenas = self.writer(staged.copies, timeout_s)
        except Exception as e:  # told to the other ranks at persist's first collective
            log.error("rank %d: the save of step %d cannot start", save.rank, save.step, exc_info=True)
            unready = f"{type(e).__name__}: {e}"
        try:
            source = Source(staged.state, sinks, self.resaver, arenas, layout, copier, unready, self.stager.bytes_staged)
            return persist(save, source, upload)
        except SaveFailed:
            raise
        except CheckpointException as e:  # DCP's error is a BaseException: say what it wraps
            raise SaveFailed(f"save of step {save.step} to {self.store.display} failed: {dcp_causes(e)}") from e
        except Exception as e:
            raise SaveFailed(f"save of step {save.step} to {self.store.display} failed: {e}") from e
        finally:
            if copier is not None:
                copier.close()  # IMPORTANT: the next save reuses the buffers
                raced = copier.failure()
                if isinstance(raced, StagingRaced):
                    self.stager.copy_at_once(raced.paths)

    def copy(self, staged: Staged, layout: Layout | None, rank: int, step: int) -> Copier | None:
        """In the background save, first: the copies left to it, started in a thread of their
        own in the order `layout`'s file needs them (`ckpt.save.copier`), so the write need not
        wait for the last. The loop may go on once they have ended, however they ended."""
        copies = staged.copies
        if copies is None or staged.failed is not None or not copies.pending:
            self.staging_done()
            return None
        assert self._copy_pool is not None, "use the Checkpointer as a context manager"
        try:
            fault_point("staging", rank, step)
            batches, rest = layout.copy_order(copies.pairs, self.stager.arenas) if layout is not None else (None, copies.pairs)
            return Copier(copies, batches, rest, self._copy_pool, self.staging_done, rank=rank, step=step, order=layout)
        except BaseException:
            self.staging_done()
            raise

    def writer(self, copies: Copies | None, timeout_s: float) -> tuple[Callable[[Store], Sink], list[Arena]]:
        """Where the save's bytes are written from: the writer process over the staging
        arenas, or for a streamed save (no `copies`) a thread over the live state."""
        if copies is None:
            return ThreadSink, []
        return functools.partial(self.sinks.open, shareable=self.stager.arena.shareable, timeout_s=timeout_s), self.stager.arenas

    def take(self) -> concurrent.futures.Future[Manifest] | None:
        """The save in flight, if any, which leaves the slot."""
        fut, self._inflight = self._inflight, None
        return fut

    def busy(self) -> bool:
        """Is this rank's save still running?"""
        return self._inflight is not None and not self._inflight.done()

    def failed(self) -> bool:
        """Did this rank's save end in an error not reported yet?"""
        return self._inflight is not None and self._inflight.done() and self._inflight.exception() is not None

    def close(self) -> None:
        """After the last save: its thread ends, then its writer."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        self.sinks.close()


def _now(path: Any, tensor: Any) -> bool:
    return False
