"""What asks a rank to checkpoint and stop: a SIGTERM, a Ctrl-C, or a preemption notice file.

A scheduler's SIGTERM reaches the process. So does a Ctrl-C (SIGINT): the first one stops
the run as a SIGTERM does (exit status 130), a second one exits at once, abandoning the save
in flight (the last committed checkpoint stays). A notice file serves the rest: a cloud's
preemption notice or a Kubernetes preStop hook only has to create it (`touch`), and every
rank that watches the path (`Checkpointer(preempt_file=)` or `CKPT_PREEMPT_FILE`) stops at
its next step boundary, after a checkpoint. A notice already there when the run starts is not
for it (it stopped the run before), so a restart does not stop again at once; touching it
again, or creating it anew, is.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# Under torchrun one Ctrl-C reaches a rank twice within milliseconds: from the terminal (to
# the whole foreground process group) and from torchrun, which passes it on to its workers.
# A second SIGINT this soon after the first is that same Ctrl-C, not a second one.
SAME_CTRL_C_S = 1.0
EXIT_SIGINT = 130  # 128 + SIGINT: "interrupted", as a shell reports it

# A notice file is looked for at most this often: a stat per step can be slow on a network
# filesystem, and a preemption gives tens of seconds.
CHECK_EVERY_S = 0.5


class Preemption:
    """Set once something asked this rank to stop; `why` says what."""

    def __init__(self, notice_file: str | None = None) -> None:
        notice_file = notice_file if notice_file is not None else (os.environ.get("CKPT_PREEMPT_FILE") or None)
        #: The notice files watched: the user's, and the node agent's (`watch`).
        self.notice_files = [notice_file] if notice_file else []
        self.why = ""
        self._asked = threading.Event()
        self._stale: dict[str, float | None] = {}  # the mtime of each notice that predates the run
        self._next_check = 0.0
        self._prev_handler: Any = None
        self._prev_sigint: Any = None
        self._sigint_at: float | None = None  # when the first Ctrl-C came
        self._rank = 0

    def start(self, sigterm: bool, rank: int = 0) -> None:
        """From now on: a notice counts unless it is the one already there; with `sigterm`,
        SIGTERM asks too, and so does a Ctrl-C unless the program handles SIGINT itself."""
        self._stale = {path: mtime_of(path) for path in self.notice_files}
        self._rank = rank  # a Ctrl-C reaches every rank: rank 0 says so
        if not sigterm:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM will not trigger a checkpoint")
            return
        self._prev_handler = signal.signal(signal.SIGTERM, lambda *_: self.ask("SIGTERM"))
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._prev_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._sigint_at is None:
            self._sigint_at = now
            self.ask("SIGINT")
            log.log(
                logging.WARNING if self._rank == 0 else logging.DEBUG,
                "Ctrl-C: saving a checkpoint at the next step boundary, then exiting (status %d); Ctrl-C again exits at once", EXIT_SIGINT,
            )  # fmt: skip
        elif now - self._sigint_at >= SAME_CTRL_C_S:
            log.warning("second Ctrl-C: exiting now (status %d); the save in flight, if any, is abandoned, the last committed checkpoint stays", EXIT_SIGINT)
            logging.shutdown()
            # IMPORTANT: not an exception: leaving the block would wait for the save in flight,
            # and so would the interpreter's exit (its thread).
            os._exit(EXIT_SIGINT)

    def watch(self, notice_file: str) -> None:
        """Watch another notice file too (before `start`)."""
        if notice_file not in self.notice_files:
            self.notice_files.append(notice_file)

    def stop(self) -> None:
        if self._prev_handler is not None:
            signal.signal(signal.SIGTERM, self._prev_handler)
            self._prev_handler = None
        if self._prev_sigint is not None:
            # Stopping for a Ctrl-C: the same Ctrl-C passed on again (torchrun) finds the
            # process on its way out, and must not turn its exit 130 into a traceback.
            signal.signal(signal.SIGINT, self._on_sigint if self._sigint_at is not None else self._prev_sigint)
            self._prev_sigint = None

    def ask(self, why: str) -> None:
        if not self._asked.is_set():
            self.why = why
            self._asked.set()

    def asked(self) -> bool:
        """Whether to stop: asked already, or a notice file appeared (checked now and then)."""
        if self._asked.is_set():
            return True
        if self.notice_files and (now := time.monotonic()) >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            for path in self.notice_files:
                mtime = mtime_of(path)
                if mtime is not None and mtime != self._stale.get(path):
                    self.ask(f"notice file {path}")
                    return True
        return False


def mtime_of(path: str) -> float | None:
    """A notice file's modification time, or None when there is none (or no path)."""
    if not path:
        return None
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None
