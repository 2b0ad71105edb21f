"""Staging: copy the captured state into host buffers that outlive the training step.

This copy is the only part of a save the training loop waits for. Buffers are allocated on
the first save and reused by every later one while shapes and dtypes stay the same (they do
in training), pinned when the source lives on an accelerator so the copy can be a DMA.
Sharded tensors (DTensor from FSDP2/TP, ShardedTensor from FSDP1) keep their sharding
metadata; only their local shards are copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]


class Stager:
    """Host copies of a state dict, with buffers cached by their place in the dict."""

    def __init__(self) -> None:
        self._cache: dict[Path, Any] = {}
        self.bytes_staged = 0  # host bytes held, for the memory ledger

    def stage(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in (reused) host memory."""
        return self._stage(state, ())

    def _stage(self, obj: Any, path: Path) -> Any:
        if isinstance(obj, dict):
            return {k: self._stage(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in obj):
            staged = [self._stage(v, (*path, i)) for i, v in enumerate(obj)]
            return staged if isinstance(obj, list) else type(obj)(staged)
        if isinstance(obj, DTensor):
            return self._reuse(path, obj, _local_of_dtensor, _new_host_dtensor)
        if isinstance(obj, ShardedTensor):
            return self._reuse(path, obj, _locals_of_sharded, _new_host_sharded)
        if isinstance(obj, torch.Tensor):
            return self._reuse(path, obj, lambda t: [t], _new_host_tensor)
        return copy.deepcopy(obj)

    def _reuse(self, path: Path, src: Any, locals_of: Any, allocate: Any) -> Any:
        cached = self._cache.get(path)
        src_locals = locals_of(src)
        if cached is None or not _same_layout(locals_of(cached), src_locals):
            cached = allocate(src)
            self._cache[path] = cached
            self.bytes_staged = sum(
                sum(t.numel() * t.element_size() for t in _locals_any(c))
                for c in self._cache.values()
            )
        for dst, s in zip(locals_of(cached), src_locals, strict=True):
            dst.copy_(s.detach(), non_blocking=dst.is_pinned())
        return cached

    def synchronize(self) -> None:
        """Wait for non-blocking device-to-host copies (no-op on CPU)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _same_layout(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b, strict=True)
    )


def _host_empty(t: torch.Tensor) -> torch.Tensor:
    pin = t.device.type == "cuda"
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


def _new_host_tensor(t: torch.Tensor) -> torch.Tensor:
    return _host_empty(t)


def _local_of_dtensor(t: DTensor) -> list[torch.Tensor]:
    return [t._local_tensor]


def _new_host_dtensor(t: DTensor) -> DTensor:
    # A DTensor with the same spec (mesh, placements, global shape) over a host buffer;
    # built the way DCP's own stager does, without moving data to the mesh's device.
    host = t.detach().to("cpu") if t.device.type != "cpu" else copy.deepcopy(t.detach())
    host._local_tensor = _host_empty(t._local_tensor)
    return host


def _locals_of_sharded(t: ShardedTensor) -> list[torch.Tensor]:
    return [s.tensor for s in t.local_shards()]


def _new_host_sharded(t: ShardedTensor) -> ShardedTensor:
    host = t.to("cpu") if t.device.type != "cpu" else copy.deepcopy(t)
    for shard in host.local_shards():
        shard.tensor = _host_empty(shard.tensor)
    return host


def _locals_any(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, DTensor):
        return _local_of_dtensor(obj)
    if isinstance(obj, ShardedTensor):
        return _locals_of_sharded(obj)
    return [obj]
