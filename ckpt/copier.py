"""The staging copies left to a save, made while its data file is being written.

The copies a save defers (`ckpt.stage`) are the largest fixed cost of a save after the
write itself: 100 MB take about 10 ms here, and the writer could not start until the last
was made. A `Copier` makes them in a thread of its own instead, in the order the file needs
them (`Layout.copy_order`, for a save of a layout written before), and after each batch
writes to a pipe how far into the file every arena byte is staged. The writer, given the
pipe's read end (`ckpt.filewrite.Gate`, in the writer process or a thread), writes each
range once the copies have reached it: the disk starts on the first batch.

A copy that fails ends the pipe with a mark that fails the write; the save then fails on
every rank as any failed write does. A save DCP plans (a new layout) waits for every copy
before it lays out anything (`ready`), as it did before the copies went to a thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable

from ._faults import fault_point
from .filewrite import GATE_FAILED, GATE_OPEN, GATE_WORD
from .stage import Copies, Pair

log = logging.getLogger(__name__)


class Copier:
    """One save's deferred copies, made in `pool`'s thread once the write (or anything
    else) needs them: started then, not before, they leave the two cores here to the save's
    first agreement and the write's request. `done` is called when they have ended, however
    they ended."""

    def __init__(
        self,
        copies: Copies,
        batches: list[tuple[int, list[Pair]]] | None,
        rest: list[Pair],
        pool: concurrent.futures.ThreadPoolExecutor,
        done: Callable[[], None],
        *,
        rank: int,
        step: int,
        order: object = None,
    ) -> None:
        """`batches`, `rest`: the copies in the file's order and those it does not hold
        (`Layout.copy_order` of `order`, the layout), or None and all copies in `rest`."""
        self.order = order if batches is not None else None
        self._read, self._write = os.pipe()
        self._rank, self._step = rank, step
        self._done = done
        self._start = functools.partial(pool.submit, self._run, copies, batches or [], rest)
        self._future: concurrent.futures.Future[None] | None = None

    def _started(self, file_only: bool = False) -> concurrent.futures.Future[None]:
        """The copies, started by the first that needs them: the write of the file laid out
        as `order` (`file_only`: only what that file holds), or whoever waits for them all
        (a save that DCP plans lays its file out anew)."""
        if self._future is None:
            self._future = self._start(file_only)
        return self._future

    def _run(self, copies: Copies, batches: list[tuple[int, list[Pair]]], rest: list[Pair], file_only: bool) -> None:
        # IMPORTANT: the copies the file does not hold are skipped only for that file's write:
        # nothing else reads this save's buffers, and the next save makes its own copies.
        try:
            try:
                copies.run(batches if file_only else [*batches, (GATE_OPEN, rest)], self._batch_done)
            except BaseException:
                log.error("rank %d: a staging copy of step %d failed", self._rank, self._step, exc_info=True)
                self._tell(GATE_FAILED)
                raise
            self._tell(GATE_OPEN)
        finally:
            os.close(self._write)
            self._done()

    def _batch_done(self, mark: int) -> None:
        if mark != GATE_OPEN:  # the last batch's is told once the copies have ended well
            self._tell(mark)
        fault_point("copying", self._rank, self._step)  # after the first batch, the writer under way

    def _tell(self, mark: int) -> None:
        os.write(self._write, GATE_WORD.pack(mark))  # a handful of words: never fills the pipe

    def gate_fd(self, order: object) -> int | None:
        """For the write of a file laid out as `order`: the pipe's read end, which the caller
        takes over, while the copies go on; for any other write, or a second one, None once
        every copy is made (raising if one failed)."""
        if order is self.order and order is not None and self._future is None:
            # A copy of the read end: this one stays open until the copies end, so that what
            # they tell never meets a closed pipe (EPIPE; SIGPIPE, where a program restored it).
            fd = os.dup(self._read)
            self._started(file_only=True)
            return fd
        self.ready()
        return None

    def ready(self) -> None:
        """Wait until the copies are made (all, unless the file's write started them);
        raises the error of one that failed."""
        self._started().result()

    def failure(self) -> BaseException | None:
        """The error of a copy that failed, once the copies have ended; None if none failed
        or none was started."""
        return self._future.exception() if self._future is not None else None

    def close(self) -> None:
        """Wait for the copies to end (the loop reuses their buffers at the next save). A
        save that ended before anything needed them makes none: nothing reads its buffers."""
        if self._future is None:
            self._future = concurrent.futures.Future()
            self._future.set_result(None)
            os.close(self._write)
            self._done()
        concurrent.futures.wait([self._future])
        os.close(self._read)
