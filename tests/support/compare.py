"""Comparisons the tests share."""

from __future__ import annotations

import struct

import torch


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: unlike `torch.equal`, -0.0 is not 0.0 and a NaN equals
    the same NaN."""
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return False
    raw = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(raw(got), raw(want))


def assert_bitwise_equal(got: object, want: object, where: str = "state") -> None:
    """Same structure, same values; tensors equal bit for bit, with the same dtype and shape."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        if not bits_equal(got, want):  # how far, for the message: a complex value's imaginary part too
            a, b = (t.detach().cpu().to(torch.complex128 if t.is_complex() else torch.float64) for t in (got, want))
            raise AssertionError(f"{where}: differs (max abs diff {(a - b).abs().max().item() if got.numel() else 0.0})")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and isinstance(got, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r} (bits)"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
