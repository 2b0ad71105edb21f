"""What a training script shows of ckpt without setting up logging.

ckpt logs through `logging.getLogger("ckpt...")`. A script that configured no logging would
see none of it but warnings, and not "restored step 1200" nor "saved step 1300": so when a
Checkpointer is entered in a program whose root logger has no handler, rank 0 says its few
lines (fresh start or restore, the interval, commits now and then, why it stopped) on stderr,
and the other ranks their warnings and errors. The moment the program configures logging
(`logging.basicConfig`, a framework's setup), its handlers have ckpt's records and this one
goes quiet. `CKPT_LOG_LEVEL` (DEBUG, INFO, WARNING, ERROR) sets ckpt's level either way.
"""

from __future__ import annotations

import logging
import os
import sys

_LOGGER = logging.getLogger("ckpt")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Console(logging.StreamHandler):
    """stderr, while the program has no logging of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show(rank: int) -> None:
    """Set up what this rank shows (once per process; see the module's docstring)."""
    level = os.environ.get("CKPT_LOG_LEVEL", "").strip().upper()
    if level:
        if level not in _LEVELS:
            raise ValueError(f"CKPT_LOG_LEVEL={level!r}: must be one of {', '.join(_LEVELS)}")
        _LOGGER.setLevel(level)
    elif _LOGGER.level == logging.NOTSET and not logging.getLogger().handlers:
        _LOGGER.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(isinstance(h, _Console) for h in _LOGGER.handlers):
        console = _Console(sys.stderr)
        console.setFormatter(logging.Formatter("ckpt: %(message)s" if rank == 0 else f"ckpt (rank {rank}): %(message)s"))
        _LOGGER.addHandler(console)
