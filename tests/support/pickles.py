"""Pickles that must never be unpickled: what a writer of an unsigned root could plant."""

from __future__ import annotations

import pickle
from pathlib import Path


def malicious_pickle(marker: Path, size: int) -> bytes:
    """A pickle that creates `marker` when unpickled, padded to exactly `size` bytes
    (pickle stops at its STOP opcode and ignores what follows)."""

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Evil())
    assert len(blob) < size
    return blob + b" " * (size - len(blob))
