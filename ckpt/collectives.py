"""ckpt's collectives: a `Group` of ranks over a gloo group of ckpt's own, and the few
operations a save and a restore take on it (a broadcast and a gather of pickled objects in one
collective when they are short, a scatter, element-wise max and bitwise OR of a few ints);
and how many of the job's ranks share this one's node (`ranks_per_node`, `a_core_each`).

The objects are this job's own ranks' (never read from storage): unpickling them is as safe as
torch's `broadcast_object_list` and `gather_object`, which these replace.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Ranks per node as launchers say it: torchrun, Slurm, Open MPI, MPICH/Intel MPI.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def ranks_per_node() -> int:
    for name in _LOCAL_SIZE_VARS:
        value = os.environ.get(name, "").split("(")[0].strip()  # Slurm may say "8(x4)"
        if value.isascii() and value.isdigit() and int(value) > 0:  # "²" is a digit to isdigit()
            return int(value)
    return 1


def a_core_each() -> bool:
    """Whether each of this node's ranks has a core of its own (`ranks_per_node` against the
    cores this process may run on). Where they outnumber the cores, work a rank starts ahead on
    its own threads (early reads, its store's client) takes CPU that another rank's part of the
    restore waits for: slower with 8 and 16 ranks on this machine's 2 cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return ranks_per_node() <= cores


@dataclass
class Group:
    """The ranks that save together, or one process alone when `pg` is None."""

    pg: Any
    rank: int
    world: int
    plan_key: str = dataclasses.field(default_factory=lambda: f"ckpt-{uuid.uuid4().hex}")
    # Bytes each rank sends in `gather_short`'s one collective; learnt, on every rank alike,
    # from the longest object that did not fit (`fit`). 0: always `gather`.
    gather_bytes: int = 4 << 10

    @classmethod
    def new(cls, timeout_s: float) -> Group:
        """A fresh gloo group over the default world (a collective: all ranks call it)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, 0, 1)
        import datetime

        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(pg, dist.get_rank(), dist.get_world_size())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank. One collective when its pickle is short (up to
        `_SHORT` bytes: a refusal, a restore's plan, a manifest of a dozen ranks), two else;
        torch's `broadcast_object_list` always takes two (the length, then the bytes)."""
        if self.pg is None:
            return obj
        data = pickle.dumps(obj) if self.rank == 0 else b""
        head = _framed(data, _SHORT)
        dist.broadcast(head, src=0, group=self.pg)
        n = _length(head)
        rest = b""
        if n > _SHORT - 8:  # the rest, in a second collective
            tail = torch.frombuffer(bytearray(data[_SHORT - 8 :]), dtype=torch.uint8) if self.rank == 0 else None
            tail = tail if tail is not None else torch.empty(n - (_SHORT - 8), dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.pg)
            rest = tail.numpy().tobytes() if self.rank else b""
        if self.rank == 0:
            return obj
        return pickle.loads(head.numpy()[8 : 8 + min(n, _SHORT - 8)].tobytes() + rest)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, on rank 0 (the others get None); two collectives."""
        if self.pg is None:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank 0's `objs[r]` on each rank r (the others pass None): each rank receives its
        own, as long as the longest one's pickle (torch's `scatter_object_list`)."""
        if self.pg is None:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=0, group=self.pg)
        return out[0]

    def scatter_framed(self, framed: list[torch.Tensor] | None) -> Any:
        """`scatter` of objects rank 0 pickled and framed already (`frame`, perhaps long
        before): each rank unpickles its own; the others pass None."""
        if self.pg is None:
            assert framed is not None
            return self._unframed(framed[0])
        cap = torch.tensor([framed[0].numel() if self.rank == 0 and framed else 0], dtype=torch.long)
        dist.broadcast(cap, src=0, group=self.pg)
        out = torch.empty(int(cap.item()), dtype=torch.uint8)
        dist.scatter(out, framed if self.rank == 0 else None, src=0, group=self.pg)
        return self._unframed(out)

    @staticmethod
    def _unframed(framed: torch.Tensor) -> Any:
        """What `frame` framed: from this job's rank 0 over ckpt's own group, never storage."""
        return pickle.loads(framed.numpy()[8 : 8 + _length(framed)].tobytes())

    def gather_short(self, obj: Any) -> list[Any] | None:
        """`gather` in one collective: every rank sends `gather_bytes` bytes. Rank 0 gets, for
        a rank whose pickle did not fit, `TooLong(its length)` instead: it then tells every
        rank (as the outcome it broadcasts anyway), and all call `fit` and `gather`."""
        if self.pg is None or not self.gather_bytes:
            return self.gather(obj)
        cap = self.gather_bytes
        mine = _framed(pickle.dumps(obj), cap)
        out = [torch.empty(cap, dtype=torch.uint8) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, out, dst=0, group=self.pg)
        if out is None:
            return None
        got = []
        for t in out:
            n = _length(t)
            got.append(pickle.loads(t.numpy()[8 : 8 + n].tobytes()) if n <= cap - 8 else TooLong(n))
        return got

    def all_gather_fixed(self, data: bytes) -> list[bytes]:
        """Every rank's `data` on every rank, in rank order: one collective; every rank
        sends the same number of bytes."""
        if self.pg is None:
            return [data]
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.pg)
        return [t.numpy().tobytes() for t in out]

    def fit(self, n: int) -> None:
        """Make `gather_short` fit an object whose pickle is `n` bytes (all ranks, alike)."""
        need = 1 << (n + 8 - 1).bit_length()
        self.gather_bytes = need if need <= _GATHER_MAX else 0

    def any(self, flag: bool) -> bool:
        """Did any rank say yes (a collective: all ranks call it)."""
        return bool(self.max([int(flag)])[0])

    def bits(self, value: int) -> int:
        """The bitwise OR of every rank's `value` (one int64): several yes-or-no answers in one
        collective, none lost to another (a max keeps only the highest bit set anywhere)."""
        return self._reduce([value], dist.ReduceOp.BOR)[0]

    def union(self, words: list[int]) -> list[int]:
        """Element-wise bitwise OR over ranks of a few int64 words: a bitmap of "who wants what"."""
        return self._reduce(words, dist.ReduceOp.BOR)

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over ranks: "did any rank say yes"."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: list[int], op: Any) -> list[int]:
        if self.pg is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.pg)
        return t.tolist()


@dataclass(frozen=True)
class TooLong:
    """In `Group.gather_short`'s answer: a rank's object, `n` bytes pickled, did not fit."""

    n: int


_SHORT = 16 << 10  # bytes of a broadcast's first collective
_GATHER_MAX = 1 << 20  # longer objects take `gather` from then on


def _framed(data: bytes, size: int) -> torch.Tensor:
    """`size` bytes: the length of `data` (8 bytes, little-endian), then as much of it as fits."""
    buf = bytearray(size)
    buf[:8] = len(data).to_bytes(8, "little")
    part = data[: size - 8]
    buf[8 : 8 + len(part)] = part
    return torch.frombuffer(buf, dtype=torch.uint8)


def frame(objs: list[Any]) -> list[torch.Tensor]:
    """Each object pickled into a buffer of one common size (`scatter_framed`)."""
    blobs = [pickle.dumps(o) for o in objs]
    cap = 8 + max(map(len, blobs), default=0)
    return [_framed(b, cap) for b in blobs]


def _length(framed: torch.Tensor) -> int:
    return int.from_bytes(framed.numpy()[:8].tobytes(), "little")
