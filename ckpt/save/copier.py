"""The staging copies left to a save, made while its data file is being written.

The copies a save defers (`ckpt.save.stage`) are the largest fixed cost of a save after the
write itself: 100 MB take about 10 ms here, and the writer could not start until the last
was made. A `Copier` makes them in a thread of its own instead, in the order the file needs
them (`Layout.copy_order`, for a save of a layout written before), and after each batch
writes to a pipe how far into the file every arena byte is staged. The writer, given the
pipe's read end (`ckpt.save.filewrite.Gate`, in the writer process or a thread), writes each
range once the copies have reached it: the disk starts on the first batch.

A copy that fails ends the pipe with a mark that fails the write; the save then fails on
every rank as any failed write does. A save DCP plans (a new layout) waits for every copy
before it lays out anything (`ready`), as it did before the copies went to a thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Iterator

from ckpt._faults import fault_point
from ckpt.save.filewrite import GATE_FAILED, GATE_OPEN, GATE_WORD
from ckpt.save.stage import Copies, Pair

log = logging.getLogger(__name__)

# How long the copies wait for the write's request before they start all the same (seconds).
_HOLD_S = 0.02


class Copier:
    """One save's deferred copies, made in `pool`'s thread. They start when the file's write
    (or anything else) needs them, or `_HOLD_S` after the save began, whichever comes first:
    held back, they leave the two cores here to the save's first agreement and the write's
    request, and a slow store (rank 0 claims the step directory before that agreement) holds
    them, and so the loop's next `optimizer.step()`, for no longer than that. `done` is
    called when they have ended, however they ended."""

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
        self._rank, self._step = rank, step
        self._done = done
        self._go = threading.Event()
        self._gate_given = False  # the file's write took the gate: the rest may be skipped
        self._read, self._write = os.pipe()
        try:
            self._future = pool.submit(self._run, copies, batches or [], rest)
        except BaseException:
            os.close(self._read)
            os.close(self._write)
            raise

    def _run(self, copies: Copies, batches: list[tuple[int, list[Pair]]], rest: list[Pair]) -> None:
        try:
            self._go.wait(_HOLD_S)
            try:
                copies.run(self._in_order(batches, rest), self._batch_done)
            except BaseException:
                log.error("rank %d: a staging copy of step %d failed", self._rank, self._step, exc_info=True)
                self._tell(GATE_FAILED)
                raise
            self._tell(GATE_OPEN)
        finally:
            os.close(self._write)
            self._done()

    def _in_order(self, batches: list[tuple[int, list[Pair]]], rest: list[Pair]) -> Iterator[tuple[int, list[Pair]]]:
        yield from batches
        # IMPORTANT: the copies the file does not hold are skipped only once the file's write
        # has begun: nothing else reads this save's buffers, and the next save makes its own
        # copies. A save DCP plans (the ranks' layouts did not all fit) needs every one.
        if not self._gate_given:
            yield GATE_OPEN, rest

    def _batch_done(self, mark: int) -> None:
        if mark != GATE_OPEN:  # the last batch's is told once the copies have ended well
            self._tell(mark)
        fault_point("copying", self._rank, self._step)  # after each batch, the writer under way

    def _tell(self, mark: int) -> None:
        # A save's batches are at most ~60 (Layout.copy_order), and so are its words: they
        # fit in a pipe of one page (512 words), so this never blocks, read or not.
        os.write(self._write, GATE_WORD.pack(mark))

    def gate_fd(self, order: object) -> int | None:
        """For the write of a file laid out as `order`: a read end of the pipe, which the
        caller takes over, while the copies go on; for any other write, or a second one,
        None once every copy is made (raising if one failed)."""
        if order is self.order and order is not None and not self._gate_given:
            self._gate_given = True
            # A copy of the read end: this one stays open until the copies end, so that what
            # they tell never meets a closed pipe (EPIPE; SIGPIPE, where a program restored it).
            fd = os.dup(self._read)
            self._go.set()
            return fd
        self.ready()
        return None

    def ready(self) -> None:
        """Wait until the copies are made (all, unless the file's write took the gate);
        raises the error of one that failed."""
        self._go.set()
        self._future.result()

    def failure(self) -> BaseException | None:
        """Once the copies have ended: the error of one that failed, if any."""
        self._go.set()
        return self._future.exception()

    def close(self) -> None:
        """Wait for the copies to end (the loop reuses their buffers at the next save)."""
        self._go.set()
        concurrent.futures.wait([self._future])
        os.close(self._read)
