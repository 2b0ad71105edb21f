"""Staging: copy the captured state into host buffers that outlive the training step.

This copy is the only part of a save the training loop may wait for, and it need not wait at
all: `prepare` allocates (or reuses) the buffers, copies what is small or could change before
the next optimizer step, and returns the copies still to make, which `Copies.run` makes in
the background while the next forward and backward run (parameters and optimizer state do
not change until `optimizer.step()`). Buffers are allocated on the first save and reused by
every later one while shapes and dtypes stay the same (they do in training), pinned when the
source lives on an accelerator so the copy can be a DMA.
Sharded tensors (DTensor from FSDP2/TP, ShardedTensor from FSDP1) keep their sharding
metadata; only their local shards are copied.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from ckpt.capture.state import ATOMS
from ckpt.errors import SaveFailed
from ckpt.save.arena import Arena

log = logging.getLogger(__name__)

Path = tuple[Any, ...]
# Subtrees that capture hands back as the very same dict while nothing in them was replaced
# (ckpt.capture.live.StateDictCache): staged once, then their copies are simply made again.
_MEMO_PATHS = {("model",), ("optim", "state")}


class Stager:
    """Host copies of a state dict, with buffers cached by their place in the dict, allocated
    in staging arenas (shared memory the writer process reads; page-locked for CUDA sources)."""

    def __init__(self) -> None:
        self._cache: dict[Path, Any] = {}
        self.bytes_staged = 0  # host bytes held, for the memory ledger
        self.arena = Arena()
        self.pinned_arena = Arena(pin=True)
        self._memo: dict[Path, _Memo] = {}
        self._now: list[Pair] | None = None
        self._warned_budget = False
        # Tensors a deferred copy found changed in place before it was made: copied at once.
        self._at_once: set[Path] = set()

    @property
    def arenas(self) -> list[Arena]:
        return [self.arena, self.pinned_arena]

    def over_budget(self, state: Any, budget: int) -> bool:
        """Whether staging `state` would take more than `budget` bytes of host memory beyond
        what is staged already (this rank's view: the ranks agree on it, `said_over`)."""
        need = self.bytes_for(state)
        return need > budget and need > self.bytes_staged

    def said_over(self, state: Any, budget: int) -> None:
        """The ranks agreed to stream `state`: said once."""
        if not self._warned_budget:
            log.warning(
                "staging %.2f GB would exceed the host memory budget of %.2f GB (on this rank or another): saving "
                "without a host copy, streaming from the live state; the loop waits for the write",
                self.bytes_for(state) / 1e9,
                budget / 1e9,
            )
            self._warned_budget = True

    def stage(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in (reused) host memory, made now."""
        staged, later = self.prepare(state, defer=lambda path, t: True)
        later.run()
        return staged

    def prepare(self, state: Any, defer: Callable[[Path, torch.Tensor], bool]) -> tuple[Any, Copies]:
        """The staged structure, and the tensor copies left to make.

        Everything that is not a tensor is copied now, and so is every tensor for which
        `defer(path, local_tensor)` is false; the other copies are returned, to be run."""
        if sum(a.used for a in self.arenas) > 2 * self.bytes_staged + (64 << 20):
            # Layouts changed and left dead buffers behind: stage into fresh arenas. Only
            # between saves (the previous one has finished with the old buffers).
            self._cache, self._memo, self.bytes_staged = {}, {}, 0
            for arena in self.arenas:
                arena.reset()
        later = Copies()
        self._later, self._defer = later, defer
        try:
            staged = self._stage(state, ())
        finally:
            del self._later, self._defer
        later.mark_ready()
        return staged, later

    def _stage(self, obj: Any, path: Path) -> Any:
        if isinstance(obj, dict) and path in _MEMO_PATHS:
            return self._memoized(obj, path)
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
        return _copy_value(obj)

    def bytes_for(self, state: Any, path: Path = ()) -> int:
        """`tensor_bytes(state)`, a subtree staged before as the same object counted from
        its staged copies."""
        if isinstance(state, dict):
            hit = self._memo.get(path) if path in _MEMO_PATHS else None
            if hit is not None and hit.source is state:
                return hit.nbytes
            return sum(self.bytes_for(v, (*path, k)) for k, v in state.items())
        return tensor_bytes(state)

    def _memoized(self, obj: dict[Any, Any], path: Path) -> Any:
        hit = self._memo.get(path)
        if hit is not None and hit.source is obj:  # IMPORTANT: identity, held alive by the memo
            for dst, src in hit.now:
                self._copy_now(dst, src)
            self._later.pairs.extend(hit.later)
            self._later.paths.extend(hit.later_paths)
            self._later.cuda |= hit.cuda
            return hit.staged
        first_later, self._now = len(self._later.pairs), []
        try:
            staged = {k: self._stage(v, (*path, k)) for k, v in obj.items()}
            later = self._later.pairs[first_later:]
            pairs = self._now + later
            self._memo[path] = _Memo(
                obj, staged, self._now, later, self._later.paths[first_later:], _nbytes([d for d, _ in pairs]),
                any(s.is_cuda for _, s in pairs),
            )
        finally:
            self._now = None
        return staged

    def copy_at_once(self, paths: Iterable[Path]) -> None:
        """From the next save on, copy these tensors before the loop goes on (a deferred
        copy of theirs raced an in-place change: `Copies.run`)."""
        self._at_once.update(paths)
        self._memo = {}  # IMPORTANT: the memos hold the old split into copies now and later

    def _reuse(self, path: Path, src: Any, locals_of: Any, allocate: Any) -> Any:
        cached = self._cache.get(path)
        src_locals = locals_of(src)
        if cached is None or not _same_layout(locals_of(cached), src_locals):
            if cached is not None:
                self.bytes_staged -= _nbytes(locals_of(cached))
            cached = allocate(src, self._host_empty)
            self._cache[path] = cached
            self.bytes_staged += _nbytes(locals_of(cached))  # a running total: O(1) a tensor
        for dst, s in zip(locals_of(cached), src_locals, strict=True):
            if path not in self._at_once and self._defer(path, s):
                self._later.pairs.append((dst, s.detach()))
                self._later.paths.append(path)
                self._later.cuda |= s.is_cuda
            else:
                self._copy_now(dst, s.detach())
                if self._now is not None:
                    self._now.append((dst, s.detach()))
        return cached

    def _copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=dst.is_pinned())
        self._later.sync |= dst.is_pinned()

    def _host_empty(self, t: torch.Tensor) -> torch.Tensor:
        arena = self.pinned_arena if t.device.type == "cuda" else self.arena
        return arena.empty(t.shape, t.dtype)


Pair = tuple[torch.Tensor, torch.Tensor]  # (staging buffer, live tensor)


@dataclasses.dataclass
class _Memo:
    """A subtree staged before: while capture hands back the same `source` dict, its staged
    copy and its copies (made at once, deferred) are reused as they are."""

    source: Any
    staged: Any
    now: list[Pair]
    later: list[Pair]
    later_paths: list[Path]
    nbytes: int
    cuda: bool  # a source lives on a GPU


class Copies:
    """Tensor copies into staging buffers, made by whoever calls `run` (once).

    On CUDA they run on a side stream of their own, after what the training stream had queued
    when the save began (an event), so device-to-host DMA overlaps the next forward and
    backward instead of queueing behind them on the default stream."""

    _side_streams: dict[int, Any] = {}  # one per device, shared by all stagers of the process

    def __init__(self) -> None:
        self.pairs: list[Pair] = []
        self.paths: list[Path] = []  # where each pair's tensor is in the state
        self._versions: list[int] = []  # each source's version counter when the save began
        # IMPORTANT: copies to pinned memory made at once were asynchronous too: the writer
        # (another process, blind to CUDA streams) must not read their buffers before they land.
        self.sync = False
        self.cuda = False  # a deferred copy's source lives on a GPU
        self._ready: Any = None  # CUDA event: the state is final (recorded when the save began)
        self._device: torch.device | None = None

    def mark_ready(self) -> None:
        """Called in the training thread when the save begins: what its stream has queued so
        far (the last optimizer step, the copies made at once) is what is saved."""
        self._versions = [s._version for _, s in self.pairs]
        if self.sync or self.cuda:
            # The background thread has its own current device (device 0): name it.
            self._device = next((s.device for _, s in self.pairs if s.is_cuda), torch.device("cuda", torch.cuda.current_device()))
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self._device))

    @property
    def pending(self) -> bool:
        """Whether `run` has anything to do: copies, or copies made at once to wait for."""
        return bool(self.pairs) or self._ready is not None

    @property
    def bytes(self) -> int:
        return sum(d.numel() * d.element_size() for d, _ in self.pairs)

    def run(self, batches: Iterable[tuple[int, list[Pair]]] | None = None, done: Callable[[int], None] | None = None) -> None:
        """Make the copies: all at once, or by `batches` (the pairs in another order, each
        batch with a mark) calling `done(mark)` as each batch has landed in host memory."""
        if batches is None:
            batches = [(0, self.pairs)]
        made: list[list[Pair]] = []
        batches = ((mark, made.append(pairs) or pairs) for mark, pairs in batches)
        if self._ready is None:
            for mark, pairs in batches:
                _copy_all(pairs, non_blocking=False)
                if done is not None:
                    done(mark)
        else:
            stream = self._side_streams.get(self._device.index)
            if stream is None:
                stream = self._side_streams[self._device.index] = torch.cuda.Stream(self._device)
            stream.wait_event(self._ready)
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                for mark, pairs in batches:
                    _copy_all(pairs, non_blocking=True)  # into pinned buffers: DMA on the stream
                    if done is not None:
                        # IMPORTANT: this batch, and (after the event) the copies made at once
                        stream.synchronize()
                        done(mark)
            stream.synchronize()  # the deferred copies, and (after the event) the ones made at once
        self._check_unchanged(made)
        self.pairs, self.sync, self.cuda, self._ready = [], False, False, None

    def _check_unchanged(self, made: list[list[Pair]]) -> None:
        """Raise `StagingRaced` if a source of the copies `made` was changed in place since
        the save began (its version counter moved): the copy may hold the later value, or
        half of it. Deferred are only the tensors that `optimizer.step()` alone changes, and
        it waits for the copies; this catches whatever else changes one (a loop that clamps
        parameters after forward). Changes through `.data` move no counter and go unseen."""
        recorded = {id(p): (path, v) for p, path, v in zip(self.pairs, self.paths, self._versions, strict=True)}
        raced = [
            recorded[id(pair)][0]
            for pairs in made
            for pair in pairs
            if id(pair) in recorded and pair[1]._version != recorded[id(pair)][1]
        ]
        if raced:
            raise StagingRaced(raced)


class StagingRaced(SaveFailed):
    """Tensors that a save copies while the loop goes on were changed in place before their
    copy was made, by something other than `optimizer.step()` (which waits for the copies).
    The save does not commit (its copy may be torn) and the next saves copy them at once."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        names = ", ".join(".".join(map(str, p)) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        super().__init__(
            f"{names} changed in place after step_done() and before the next optimizer.step(): this save is dropped "
            "rather than commit a value of another step; from the next save on they are copied before step_done() "
            "returns (to keep the overlap, call cp.wait_for_staging() before changing them)"
        )


def _copy_value(obj: Any) -> Any:
    """A copy of a non-tensor value that no later change to `obj` can reach. Values that
    cannot change are shared, and plain lists and dicts copied level by level (an
    optimizer's param_groups holds one name per parameter: deepcopy walks them one by one,
    keeping a memo of each)."""
    kind = type(obj)
    if kind in ATOMS:
        return obj
    if kind is list:
        return list(obj) if ATOMS.issuperset(map(type, obj)) else [_copy_value(v) for v in obj]
    if kind is dict and all(type(k) in ATOMS for k in obj):
        return {k: _copy_value(v) for k, v in obj.items()}
    return copy.deepcopy(obj)


def _copy_all(pairs: list[Pair], non_blocking: bool) -> None:
    """All the copies in one call that holds the GIL only to start: this runs beside the
    training thread, and 10,000 `copy_` calls would take the GIL from it 10,000 times."""
    if pairs:
        dsts, srcs = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)


def _same_layout(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b, strict=True)
    )


Alloc = Callable[[torch.Tensor], torch.Tensor]


def _new_host_tensor(t: torch.Tensor, host_empty: Alloc) -> torch.Tensor:
    return host_empty(t)


def _local_of_dtensor(t: DTensor) -> list[torch.Tensor]:
    return [t._local_tensor]


def _new_host_dtensor(t: DTensor, host_empty: Alloc) -> DTensor:
    # A DTensor with the same spec (mesh, placements, global shape) over a host buffer;
    # built the way DCP's own stager does, without moving data to the mesh's device.
    host = t.detach().to("cpu") if t.device.type != "cpu" else copy.deepcopy(t.detach())
    host._local_tensor = host_empty(t._local_tensor)
    return host


def _locals_of_sharded(t: ShardedTensor) -> list[torch.Tensor]:
    return [s.tensor for s in t.local_shards()]


def _new_host_sharded(t: ShardedTensor, host_empty: Alloc) -> ShardedTensor:
    host = t.to("cpu") if t.device.type != "cpu" else copy.deepcopy(t)
    for shard in host.local_shards():
        shard.tensor = host_empty(shard.tensor)
    return host


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_bytes(state: Any) -> int:
    """Bytes of the local tensor data in a captured state (what staging would copy)."""
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state if type(v) not in ATOMS)
    if isinstance(state, DTensor):
        state = state._local_tensor
    if isinstance(state, ShardedTensor):
        return sum(sh.tensor.numel() * sh.tensor.element_size() for sh in state.local_shards())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def default_host_budget() -> int:
    """What the node has available now, shared by the ranks on it (LOCAL_WORLD_SIZE)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:  # not Linux: fall back to the physical memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
