"""The staging arena: host memory for staged tensors that the writer process can read.

Staged tensors live in shared-memory segments (Linux memfd), mapped in the trainer and, by
file descriptor, in the writer process, so the write needs neither a copy nor the trainer's
GIL. A segment is reserved large and touched only where tensors are placed (memory is
committed page by page). Large tensors start on a page, which lets the writer hand them to
the disk with O_DIRECT; small ones are packed 64 bytes apart. On CUDA a segment is
page-locked (cudaHostRegister), so the device-to-host copy is a DMA.

Where memfd is missing (not Linux), segments are anonymous private mappings: the arena still
works, and the writer runs in a thread of the trainer instead of a process.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import mmap
import os
from dataclasses import dataclass, field

import torch

PAGE = 4096
_SMALL = 256 << 10  # tensors below this are packed, not page-aligned
_PACK = 64
_RESERVE = 1 << 30  # address space reserved per segment; memory is committed on first touch
_RESERVE_PINNED = 256 << 20  # page-locking commits all of it: reserve less
# IMPORTANT: segment ids are unique across the arenas of a process (a stager has a pageable
# and a pinned one), since a write names its pieces by segment id.
_segment_ids = itertools.count()


@dataclass(eq=False)
class Segment:
    id: int
    size: int
    fd: int  # -1 for an anonymous (unshareable) segment
    map: mmap.mmap
    base: int  # address of the first byte
    pinned: bool = False
    used: int = 0

    @property
    def view(self) -> memoryview:
        return memoryview(self.map)


@dataclass
class Arena:
    """Bump allocator over shared segments. Buffers are never freed one by one: the stager
    calls `reset` when too much of the arena is dead, and re-stages into a fresh one."""

    pin: bool = False
    segments: dict[int, Segment] = field(default_factory=dict)

    @property
    def shareable(self) -> bool:
        return hasattr(os, "memfd_create")

    @property
    def used(self) -> int:
        return sum(s.used for s in self.segments.values())

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor in the arena, owning its storage exactly."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        seg, offset = self._place(nbytes)
        flat = torch.frombuffer(seg.map, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(dtype).view(shape)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(segment id, offset) of a tensor's bytes if it is a whole arena buffer: contiguous,
        owning exactly its storage (what torch.save would write is then just these bytes)."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0:
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.untyped_storage().nbytes() != nbytes:
            return None
        ptr = t.data_ptr()
        for seg in self.segments.values():
            if seg.base <= ptr and ptr + nbytes <= seg.base + seg.size:
                return seg.id, ptr - seg.base
        return None

    def reset(self) -> None:
        """Forget every segment. Tensors still referring to one keep its mapping alive."""
        for seg in self.segments.values():
            _unpin(seg)
            if seg.fd >= 0:
                os.close(seg.fd)
        self.segments = {}

    def _place(self, nbytes: int) -> tuple[Segment, int]:
        align = PAGE if nbytes >= _SMALL else _PACK
        for seg in self.segments.values():
            offset = -(-seg.used // align) * align
            if offset + nbytes <= seg.size:
                seg.used = offset + nbytes
                return seg, offset
        seg = self._new_segment(
            max(_RESERVE_PINNED if self.pin else _RESERVE, -(-nbytes // PAGE) * PAGE)
        )
        seg.used = nbytes
        return seg, 0

    def _new_segment(self, size: int) -> Segment:
        seg_id = next(_segment_ids)
        if self.shareable:
            fd = os.memfd_create(f"ckpt-arena-{os.getpid()}-{seg_id}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        else:
            fd, m = -1, mmap.mmap(-1, size)
        seg = Segment(seg_id, size, fd, m, ctypes.addressof(ctypes.c_char.from_buffer(m)))
        if self.pin:
            _pin(seg)
        self.segments[seg.id] = seg
        return seg


def _pin(seg: Segment) -> None:
    # Page-locks the whole reservation: on CUDA the arena is sized by what is staged.
    err = torch.cuda.cudart().cudaHostRegister(seg.base, seg.size, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {seg.size} bytes of staging memory failed: error {int(err)}"
        )
    seg.pinned = True


def _unpin(seg: Segment) -> None:
    if seg.pinned:
        torch.cuda.cudart().cudaHostUnregister(seg.base)
        seg.pinned = False
