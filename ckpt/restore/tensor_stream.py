"""A tensor item of a checkpoint file streamed into the tensors being restored while the
file is read through its checksums (`ckpt.storage.verified.VerifyingReader`).

DCP stores each tensor item as a torch.save blob. Where `ckpt.format.tensor_blob` finds the
tensor's bytes in it without unpickling, they go straight into the target's memory, or
through a small reused scratch buffer (`Scratch`) that narrows them and converts dtype and
device; any other blob is read whole and loaded by torch.load (weights only) once the file
is verified (`load_blob`). Nothing is committed to the planner before that.
"""

from __future__ import annotations

import functools
import io
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckpt.errors import InvalidCheckpoint
from ckpt.format import tensor_blob
from ckpt.storage.verified import VerifyingReader

# The start of a tensor item read before deciding how to stream it: its zip headers and pickle
# take well under 1 KiB (the storage starts at byte 704 for a 2-d tensor).
_HEAD = 4 << 10
_HEAD_MAX = 64 << 10


def read_tensor_item(
    src: VerifyingReader, scratch: Scratch, length: int, reqs: list[ReadItem], planner: LoadPlanner
) -> Callable[[], None]:
    """Stream one torch.save blob into the targets of `reqs`; returns what is left to do
    once the file is verified. (Run for every tensor of a restore: 10,000 small ones
    make its per-item work count.)"""
    start = src.pos
    layout = tensor_blob.locate(src.peek(min(length, _HEAD)))
    if layout is None and length > _HEAD:  # an unusually long pickle: look further once
        layout = tensor_blob.locate(src.peek(min(length, _HEAD_MAX)))
    parts = _parts(layout, length, reqs) if layout is not None else None
    if layout is None or parts is None:
        blob = src.read(length)
        return functools.partial(load_blob, blob, reqs, planner)
    targets = [planner.resolve_tensor(r).detach() for r in reqs]
    for req, target in zip(reqs, targets, strict=True):
        if target.size() != tuple(req.lengths):
            raise RuntimeError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tuple(req.lengths)}")
    order = range(len(reqs)) if len(reqs) == 1 else sorted(range(len(reqs)), key=lambda i: parts[i])
    for i in order:
        _fill(src, scratch, start, layout, reqs[i], targets[i], parts[i])
    src.skip(start + layout.data_end - src.pos)
    if not layout.descriptor_ok(src.peek(layout.descriptor)):
        raise InvalidCheckpoint(
            f"{src.where}: the tensor at byte {start} is not laid out as its own header says "
            "(a torch.save blob that contradicts itself)"
        )
    src.skip(start + length - src.pos)
    return functools.partial(_commit, planner, reqs, targets)


def _fill(
    src: VerifyingReader,
    scratch: Scratch,
    start: int,
    layout: tensor_blob.TensorLayout,
    req: ReadItem,
    target: torch.Tensor,
    part: tuple[int, int, bool],
) -> None:
    """Read the part `req` asks for (`part`: its bytes and whether they are one range, see
    `TensorLayout.part`) of the tensor whose blob starts at byte `start` into `target`:
    straight into its memory when both are one contiguous range, else through a scratch
    buffer, whole saved rows at a time, narrowed and copied (which also converts dtype
    and device)."""
    first, end, contiguous = part
    if first == end:
        return
    dtype = layout.dtype
    if (
        contiguous
        and target.dtype == dtype
        and target.device.type == "cpu"
        and target.layout == torch.strided
        and target.is_contiguous()
        and not (target.is_conj() or target.is_neg())
    ):
        src.skip(start + first - src.pos)
        src.readinto(_bytes_of(target))
        return
    offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
    size, strides, itemsize = layout.size, layout.strides, dtype.itemsize
    if not size:  # a 0-d tensor
        src.skip(start + first - src.pos)
        scratch.copy(src, itemsize, dtype, (), target)
        return
    chunk = scratch.chunk(target.device)
    # The outermost dimension whose steps fit the buffer; the dimensions before it are
    # walked index by index.
    d = next(d for d, st in enumerate(strides) if st * itemsize <= chunk)
    row = strides[d] * itemsize
    step = max(1, chunk // row)
    for lead in itertools.product(*(range(offsets[k], offsets[k] + lengths[k]) for k in range(d))):
        base = start + layout.tensor_start + sum(i * st for i, st in zip(lead, strides, strict=False)) * itemsize
        dest = target[tuple(i - o for i, o in zip(lead, offsets, strict=False))]
        for at in range(offsets[d], offsets[d] + lengths[d], step):
            n = min(step, offsets[d] + lengths[d] - at)
            src.skip(base + at * row - src.pos)
            scratch.copy(
                src, n * row, dtype, (n, *size[d + 1 :]), dest.narrow(0, at - offsets[d], n),
                offsets=(0, *offsets[d + 1 :]), lengths=(n, *lengths[d + 1 :]),
            )  # fmt: skip


class Scratch:
    """Reused buffers for bytes that cannot go straight into their target. A CUDA target gets
    two pinned buffers in turn: the copy of one to the device runs while the next is read."""

    _DEVICE_CHUNK = 8 << 20  # bytes per copy to a device: its fixed cost becomes small
    _HOST_CHUNK = 1 << 20  # bytes per copy on the host

    def __init__(self) -> None:
        self._host = torch.empty(0, dtype=torch.uint8)
        self._pinned: list[tuple[torch.Tensor, Any]] = []  # (buffer, event of its last copy)
        self._turn = 0

    def chunk(self, device: torch.device) -> int:
        return self._DEVICE_CHUNK if device.type == "cuda" else self._HOST_CHUNK

    def copy(
        self, src: VerifyingReader, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], dest: torch.Tensor,
        offsets: tuple[int, ...] = (), lengths: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        """Read the next `nbytes` (a `dtype` tensor of `shape`), narrow them to `offsets` and
        `lengths` and copy that into `dest`."""
        pinned = dest.device.type == "cuda"
        buf = self._take_pinned(nbytes) if pinned else self._take_host(nbytes)
        src.readinto(_bytes_of(buf))
        part = buf.view(dtype).view(shape)
        if offsets:
            part = narrow_tensor_by_index(part, offsets, lengths)
        dest.copy_(part, non_blocking=pinned)
        if pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self._pinned[self._turn] = (self._pinned[self._turn][0], event)

    def drain(self) -> None:
        """Wait for every copy to a device still running."""
        for _, event in self._pinned:
            if event is not None:
                event.synchronize()

    def _take_host(self, nbytes: int) -> torch.Tensor:
        if self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, self._HOST_CHUNK), dtype=torch.uint8)
        return self._host[:nbytes]

    def _take_pinned(self, nbytes: int) -> torch.Tensor:
        self._turn ^= 1
        if len(self._pinned) < 2:
            self._pinned = [(torch.empty(0, dtype=torch.uint8), None)] * 2
        buf, event = self._pinned[self._turn]
        if event is not None:
            event.synchronize()  # IMPORTANT: its last copy must be done before it is refilled
        if buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self._DEVICE_CHUNK), dtype=torch.uint8, pin_memory=True)
        self._pinned[self._turn] = (buf, None)
        return buf[:nbytes]


def disjoint(ranges: list[tuple[int, int]]) -> bool:
    """Whether no (start, length) range overlaps another."""
    spans = sorted(r for r in ranges if r[1])
    return all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))


def _parts(layout: tensor_blob.TensorLayout, length: int, reqs: list[ReadItem]) -> list[tuple[int, int, bool]] | None:
    """Where in the blob each request's bytes lie (`TensorLayout.part`), or None unless they
    can be streamed: the storage inside the item, every request a part of the saved tensor,
    none overlapping."""
    if layout.data_end + layout.descriptor > length:
        return None
    parts = [layout.part(r.storage_offsets, r.lengths) for r in reqs]
    if None in parts:
        return None
    if len(parts) > 1 and not disjoint([(p[0], p[1] - p[0]) for p in parts]):  # type: ignore[index]
        return None
    return parts  # type: ignore[return-value]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable; it keeps the tensor alive."""
    if t.dtype in _NUMPY_DTYPES:  # numpy's own view: a third of the torch ops' time
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# The dtypes whose tensors numpy takes as they are (no bfloat16, no float8: those are viewed
# as bytes by torch first).
_NUMPY_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
     torch.uint8, torch.bool, torch.complex64, torch.complex128)
)  # fmt: skip


def _commit(planner: LoadPlanner, reqs: list[ReadItem], targets: list[torch.Tensor]) -> None:
    for req, target in zip(reqs, targets, strict=True):
        planner.commit_tensor(req, target)


def load_blob(blob: bytes, reqs: list[ReadItem], planner: LoadPlanner) -> None:
    """DCP's own way with a tensor item, for blobs not streamed: torch.load (weights only),
    narrow, copy. Runs only after the file's checksum matched."""
    tensor = _small(blob) if len(blob) <= _SMALL else _decoded(blob)
    for req in reqs:
        part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != part.size():
            raise RuntimeError(f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}")
        target.copy_(part)
        planner.commit_tensor(req, target)


def _decoded(blob: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


# Small blobs repeat: every parameter's optimizer `step` is one value, each saved as a blob of
# the same bytes (torch.save's are the same for the same tensor), and a 70B model has 720 of
# them, at 0.25 ms a torch.load. Each distinct one is decoded once; the tensor is only read
# (narrowed and copied into its targets), never handed out.
_SMALL = 64 << 10
_small = functools.lru_cache(maxsize=32)(_decoded)
