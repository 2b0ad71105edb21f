"""Where a tensor's bytes lie inside one `torch.save` blob, found without unpickling.

DCP stores each tensor item as a standard torch.save zip: `<archive>/data.pkl` (a pickle that
rebuilds the tensor around its storage), a few small text records, then
`<archive>/data/<key>`, the storage's raw bytes (64-byte aligned), and a central directory
at the end. `locate` walks the zip local headers with struct and the pickle's opcodes
(`ckpt.format.tensor_pickle`, which never imports or calls anything), so the restore can
stream a tensor's bytes straight into its target while they are being checksummed.

Anything not in exactly this layout gives None and the caller verifies the whole item first,
then uses torch.load. Zip CRC fields are never read: a writer may emit the blob with
`torch.serialization.skip_data` and fill the data in afterwards.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.format import tensor_pickle

# signature, version, flags, method, time, date, crc, 2 sizes, name and extra lengths
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_DESCRIPTOR_SIG = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08  # flag bit 3: sizes follow the data instead of sitting in the header
_ZIP64 = 0x0001  # extra field id of the 64-bit sizes
_STORED = 0
# Records torch.save writes between data.pkl and the storage; any other means another layout.
_SMALL_RECORDS = (".format_version", ".storage_alignment", "byteorder")
_SMALL_RECORD_MAX = 4096  # bytes; they hold a few characters


@dataclass(frozen=True)
class TensorLayout:
    """One contiguous tensor saved by torch.save, as offsets into its blob."""

    dtype: torch.dtype
    size: tuple[int, ...]
    data_start: int  # the storage's first byte
    storage_bytes: int  # length of the storage record
    tensor_start: int  # the tensor's first byte (storage_offset * itemsize past data_start)
    descriptor: int  # length of the data descriptor after the storage (16, or 24 with zip64), or 0

    @property
    def data_end(self) -> int:
        return self.data_start + self.storage_bytes

    @functools.cached_property  # a layout serves every tensor of its shape and dtype
    def strides(self) -> tuple[int, ...]:
        """Element strides of the saved tensor (C-contiguous)."""
        out, stride = [], 1
        for s in reversed(self.size):
            out.append(stride)
            stride *= s
        return tuple(reversed(out))

    def fits(self, offsets: Any, lengths: Any) -> bool:
        """Whether DCP's `storage_offsets`/`lengths` name a sub-tensor of the saved one."""
        return len(offsets) == len(lengths) == len(self.size) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(offsets, lengths, self.size, strict=True)
        )

    def span(self, offsets: Any, lengths: Any) -> tuple[int, int]:
        """(first, end) bytes in the blob that the sub-tensor lies within; (x, x) if empty."""
        itemsize = self.dtype.itemsize
        first = sum(o * st for o, st in zip(offsets, self.strides, strict=True))
        if math.prod(lengths) == 0:
            return self.tensor_start + first * itemsize, self.tensor_start + first * itemsize
        last = sum((o + n - 1) * st for o, n, st in zip(offsets, lengths, self.strides, strict=True))
        return self.tensor_start + first * itemsize, self.tensor_start + (last + 1) * itemsize

    def part(self, offsets: Any, lengths: Any) -> tuple[int, int, bool] | None:
        """`span` and `is_contiguous_in_blob` of the sub-tensor DCP's `storage_offsets`/`lengths`
        name, or None if they name none (`fits`). Worked out once per (offsets, lengths): a
        restore asks it for every tensor of this shape and dtype, mostly the whole tensor."""
        key = (tuple(offsets), tuple(lengths))
        found = self._parts.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            fits = self.fits(offsets, lengths)
            found = (*self.span(offsets, lengths), self.is_contiguous_in_blob(offsets, lengths)) if fits else None
            if len(self._parts) < _PARTS_MAX:
                self._parts[key] = found
        return found

    @functools.cached_property
    def _parts(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int, bool] | None]:
        return {}

    def is_contiguous_in_blob(self, offsets: Any, lengths: Any) -> bool:
        """Whether the sub-tensor's bytes are one range (the whole tensor, any slice of its
        first dimension, ...): every dimension after the last partial one is whole, every
        one before it has length 1."""
        partial = [d for d, (o, n, s) in enumerate(zip(offsets, lengths, self.size, strict=True)) if (o, n) != (0, s)]
        return not partial or all(n == 1 for n in lengths[: partial[-1]])

    def descriptor_ok(self, tail: bytes | memoryview) -> bool:
        """Whether the data descriptor at the start of `tail` (the bytes after the storage)
        gives the storage length the pickle implies."""
        if not self.descriptor:
            return True
        return _descriptor_size(tail, 0, self.descriptor) == self.storage_bytes


def locate(head: bytes | memoryview) -> TensorLayout | None:
    """The layout of the blob that starts with `head` (which must reach at least the first
    byte of the storage), or None if it is not a single contiguous tensor as torch.save
    writes it."""
    head = memoryview(head)
    # The layout follows from the bytes before the storage alone, and those are the same for
    # every tensor of one shape and dtype: parse each such prefix once.
    for start in _SEEN_STARTS:
        if start <= len(head) and (hit := _SEEN.get(bytes(head[:start]))) is not None:
            return hit
    layout = _parse(head)
    if layout is not None:
        if len(_SEEN) >= _SEEN_MAX or len(_SEEN_STARTS) >= _SEEN_STARTS_MAX:
            _SEEN.clear()
            _SEEN_STARTS.clear()
        _SEEN[bytes(head[: layout.data_start])] = layout
        _SEEN_STARTS.setdefault(layout.data_start)
    return layout


_UNKNOWN: Any = object()
_PARTS_MAX = 256  # the parts of one layout remembered: a few in practice, one per shard geometry
_SEEN: dict[bytes, TensorLayout] = {}
_SEEN_STARTS: dict[int, None] = {}  # the prefix lengths in _SEEN (an ordered set)
_SEEN_MAX = 4096
_SEEN_STARTS_MAX = 16  # a few in practice: the storage is 64-byte aligned after a short pickle


def _parse(head: memoryview) -> TensorLayout | None:
    rec = _header(head, 0)
    if rec is None or not rec.name.endswith("/data.pkl"):
        return None
    prefix = rec.name[: -len("data.pkl")]
    parsed = tensor_pickle.parse(head, rec.data_start)
    if parsed is None:
        return None
    (dtype, storage_key, storage_bytes, offset, size, stride), pkl_len = parsed
    pos = _skip_record(head, rec, pkl_len)
    small: dict[str, bytes] = {}
    while True:
        rec = _header(head, pos) if pos is not None else None
        if rec is None or not rec.name.startswith(prefix):
            return None
        short = rec.name[len(prefix) :]
        if short == f"data/{storage_key}":
            break
        if short not in _SMALL_RECORDS or short in small:
            return None
        length = rec.size if rec.size is not None else _find_descriptor(head, rec)
        if length is None:
            return None
        small[short] = bytes(head[rec.data_start : rec.data_start + length])
        pos = _skip_record(head, rec, length)
    byteorder = small.get("byteorder", b"little")  # torch.load's default for older blobs
    if byteorder != sys.byteorder.encode() or small.get(".format_version", b"1") != b"1":
        return None
    if rec.size is not None and rec.size != storage_bytes:
        return None
    if not _is_contiguous(size, stride):
        return None
    itemsize = dtype.itemsize
    start, nbytes = offset * itemsize, math.prod(size) * itemsize
    if start + nbytes > storage_bytes:
        return None
    descriptor = _descriptor_length(rec) if rec.size is None else 0
    return TensorLayout(dtype, size, rec.data_start, storage_bytes, rec.data_start + start, descriptor)


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if math.prod(size) == 0:
        return True
    expected = 1
    for s, st in zip(reversed(size), reversed(stride), strict=True):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


# -- zip local headers -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Record:
    name: str
    data_start: int
    size: int | None  # from the header; None when a data descriptor after the data holds it
    zip64: bool


def _header(head: memoryview, pos: int) -> _Record | None:
    if pos + _LOCAL.size > len(head):
        return None
    sig, _, flags, method, _, _, _, csize, usize, nlen, xlen = _LOCAL.unpack_from(head, pos)
    data_start = pos + _LOCAL.size + nlen + xlen
    if sig != _LOCAL_SIG or method != _STORED or data_start > len(head):
        return None
    try:
        name = bytes(head[pos + _LOCAL.size : pos + _LOCAL.size + nlen]).decode()
    except UnicodeDecodeError:
        return None
    zip64 = _zip64_sizes(head[pos + _LOCAL.size + nlen : data_start])
    if zip64 is False:
        return None
    if flags & _HAS_DESCRIPTOR:
        size = None
    else:
        if (csize, usize) == (0xFFFFFFFF, 0xFFFFFFFF) and zip64:
            csize, usize = zip64
        if csize != usize:
            return None
        size = usize
    return _Record(name, data_start, size, bool(zip64))


def _zip64_sizes(extra: memoryview) -> tuple[int, int] | None | bool:
    """(compressed, uncompressed) from the zip64 extra field, None without one, False if the
    extra fields do not parse."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + n > len(extra):
            return False
        if tag == _ZIP64:
            if n < 16:
                return False
            usize, csize = struct.unpack_from("<QQ", extra, pos + 4)
            return csize, usize
        pos += 4 + n
    return None if pos == len(extra) else False


def _descriptor_length(rec: _Record) -> int:
    # signature (optional in the spec, always written by torch's miniz), crc, two sizes
    return 24 if rec.zip64 else 16


def _descriptor_size(buf: memoryview | bytes, pos: int, length: int) -> int | None:
    """The size a data descriptor of `length` bytes at `pos` gives, or None."""
    buf = memoryview(buf)
    if pos + length > len(buf) or bytes(buf[pos : pos + 4]) != _DESCRIPTOR_SIG:
        return None
    csize, usize = struct.unpack_from("<II" if length == 16 else "<QQ", buf, pos + 8)
    return usize if csize == usize else None


def _find_descriptor(head: memoryview, rec: _Record) -> int | None:
    """The length of a small record written with a data descriptor: the first descriptor
    after its data whose sizes equal the distance to it."""
    length = _descriptor_length(rec)
    window = bytes(head[rec.data_start : rec.data_start + _SMALL_RECORD_MAX + length])
    at = 0
    while (at := window.find(_DESCRIPTOR_SIG, at)) >= 0:
        if _descriptor_size(window, at, length) == at:
            return at
        at += 1
    return None


def _skip_record(head: memoryview, rec: _Record, length: int) -> int | None:
    """Where the next local header starts, after `length` bytes of data and any descriptor."""
    end = rec.data_start + length
    if rec.size is not None:
        return end
    desc = _descriptor_length(rec)
    return end + desc if _descriptor_size(head, end, desc) == length else None
