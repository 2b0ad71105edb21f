"""What the write-path tests write: arena segments of random bytes, pieces as a layout saved
again has them, the filesystems to write them on, and tensors held as a Checkpointer extra."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

MB = 1 << 20


def takes_o_direct(directory: Path) -> bool:
    """Does this filesystem open files with O_DIRECT (tmpfs on older kernels does not)?"""
    probe = directory / ".o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def segment(size: int) -> mmap.mmap:
    seg = mmap.mmap(-1, size)
    block = os.urandom(MB)
    for off in range(0, size, MB):
        seg[off : off + MB] = block[: min(MB, size - off)]
    seg[:16] = b"first-bytes-here"
    return seg


FILESYSTEMS = ["tmp_path"] + (["/dev/shm"] if os.path.isdir("/dev/shm") else [])


def prefix_pieces(seg: int = 0) -> list:
    """Pieces as a layout saved again has them: headers, packed small ranges, page-aligned
    large ones (one with a tail that is not a whole page), padding, an empty piece."""
    pieces: list = [b"H" * 300]
    for i in range(40):  # small tensors: header and trailer around each packed range
        pieces += [(seg, 64 * 1024 + i * 192, 100 + i), b"t" * (50 + i)]
    size = sum(len(p) if isinstance(p, bytes) else p[2] for p in pieces)
    pieces += [b"\0" * (-size % 4096), (seg, 4 * MB, 2 * MB + 700), b"trailer", b""]
    size = sum(len(p) if isinstance(p, bytes) else p[2] for p in pieces)
    pieces += [b"\0" * (-size % 4096), (seg, 8 * MB, 3 * MB), (seg, 12 * MB + 5, 5000), b"end"]
    return pieces


class Holder:
    """Tensors as an `extra` of the Checkpointer."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(sd)
