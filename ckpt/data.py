"""Data position that survives a change of world size.

`ElasticSampler` keeps one global cursor, (epoch, samples consumed in the epoch), instead of
a per-rank position. Each epoch is one global sequence of sample indices (a permutation
seeded by (seed, epoch)); whatever ranks exist deal out the rest of it round-robin: rank r
of W takes remaining[r], remaining[r+W], ... So when every rank consumes B samples per
micro-batch and A micro-batches per optimizer step, optimizer step k reads exactly the global
samples [k*G, (k+1)*G) with G = A*B*W, on any W that keeps G. This is Megatron's
`consumed_samples` rule, for any map-style dataset behind a plain DataLoader.

What is exact and what is not:
- exact: which samples each global batch holds, and the order of the global stream, across
  restarts on any world size that keeps the global batch (see `accumulation_steps`);
- the order *within* a global batch differs across world sizes, so a loss summed in another
  order differs in the last bits;
- the cursor counts indices handed to the DataLoader. With `num_workers=0` that is what the
  loop consumed. With worker processes the DataLoader fetches ahead (up to
  num_workers * prefetch_factor batches per rank), and a checkpoint taken then skips those
  samples on resume. For exact resume with workers use torchdata's StatefulDataLoader at the
  same world size, or num_workers=0;
- the epoch's tail: give `global_batch=G` and each epoch is padded by wrapping to its start
  (drop_last=False) or cut (drop_last=True) to a multiple of G, so every epoch ends on a
  global-batch boundary whatever W: then nothing depends on W. Without it the tail is padded
  or cut to a multiple of W (as DistributedSampler does), so after an epoch boundary crossed
  on another world size the global batches no longer line up with an uninterrupted run;
- iterable datasets keep their own per-rank streams: give them to the Checkpointer through
  `extra=` with their own state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

log = logging.getLogger(__name__)


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step that keep `global_batch` on `world_size` ranks."""
    per_step = micro_batch * world_size
    if global_batch <= 0 or micro_batch <= 0 or world_size <= 0:
        raise ValueError("global_batch, micro_batch and world_size must be positive")
    if global_batch % per_step:
        raise ValueError(
            f"a global batch of {global_batch} cannot be kept on {world_size} ranks with micro-batches "
            f"of {micro_batch}: {global_batch} is not a multiple of {micro_batch} x {world_size}. "
            "Change the micro-batch size or run on a world size that divides it."
        )
    return global_batch // per_step


class ElasticSampler(Sampler[int]):
    """A DataLoader sampler whose position is global and independent of world size.

    Args:
        dataset_len: number of samples in the (map-style) dataset.
        seed: seeds each epoch's permutation together with the epoch number.
        shuffle: permute each epoch; False walks the dataset in order.
        drop_last: drop the epoch's tail that does not divide evenly, instead of padding it
            by wrapping around to the epoch's start.
        global_batch: samples per optimizer step over all ranks. Given, every epoch holds a
            whole number of global batches, which makes resume exact across epoch
            boundaries on any world size that divides it.
        rank, world_size: default to the current torch.distributed job (0 and 1 without one).
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        global_batch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, not {dataset_len}")
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.global_batch = global_batch
        if global_batch is not None and (global_batch <= 0 or global_batch % self.world_size):
            raise ValueError(f"global_batch={global_batch} must be a positive multiple of the world size {self.world_size}")
        self.epoch = 0
        self._start = 0  # global samples consumed in this epoch before the current iteration
        self._yielded = 0  # indices this rank handed out in the current iteration

    @property
    def consumed(self) -> int:
        """Global samples consumed in the current epoch (every rank yields the same count)."""
        return self._start + self._yielded * self.world_size

    def order(self, epoch: int) -> list[int]:
        """The global sequence of sample indices of `epoch`, the same on every world size."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def epoch_sequence(self, epoch: int) -> list[int]:
        """The global sequence of `epoch`, its tail padded or cut to whole units (the global
        batch when known, else the world size)."""
        order = self.order(epoch)
        unit = self.global_batch or self.world_size
        if self.drop_last:
            return order[: len(order) - len(order) % unit]
        pad = -len(order) % unit
        return order + (order * (pad // len(order) + 1))[:pad]

    def _epoch_len(self) -> int:
        """len(epoch_sequence(...)), without drawing the permutation."""
        n, unit = self.dataset_len, self.global_batch or self.world_size
        return n - n % unit if self.drop_last else n + -n % unit

    def _share(self) -> list[int]:
        remaining = self.epoch_sequence(self.epoch)[self._start :]
        w = self.world_size
        remaining = remaining[: len(remaining) - len(remaining) % w]  # whole rounds only
        return remaining[self.rank :: w]

    def __len__(self) -> int:
        """Indices this rank takes in a whole epoch, as DistributedSampler counts them (what
        `len(loader)` and steps-per-epoch arithmetic expect); after a restore in mid-epoch
        the first iteration yields only `remaining` of them."""
        return self._epoch_len() // self.world_size

    @property
    def remaining(self) -> int:
        """Indices this rank has still to take in the current epoch."""
        return max(0, (self._epoch_len() - self._start) // self.world_size - self._yielded)

    def __iter__(self) -> Iterator[int]:
        self._start = self.consumed
        self._yielded = 0
        for index in self._share():
            self._yielded += 1
            yield index
        self.epoch += 1
        self._start = self._yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (for loops that count epochs themselves)."""
        if epoch != self.epoch:
            self.epoch, self._start, self._yielded = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset_len", "seed", "shuffle", "drop_last", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's sampler has {key}={state[key]!r}, this one {getattr(self, key)!r}: "
                    "resuming would not continue the same data order"
                )
        if self.global_batch is None and state.get("world_size", self.world_size) != self.world_size:
            log.warning(
                "ElasticSampler without global_batch resumed on %d ranks (saved on %d): the rest of "
                "this epoch is dealt out exactly, but its tail and later epochs pad to the world "
                "size and no longer line up with an uninterrupted run; pass global_batch=",
                self.world_size,
                state["world_size"],
            )
        self.epoch, self._start, self._yielded = int(state["epoch"]), int(state["consumed"]), 0


def data_position(data: Any, dataloader: Any) -> tuple[Any, Any]:
    """(global position, per-rank loader state) from what the user passed."""
    if dataloader is None:
        return data, None
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, ElasticSampler):
        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
    loader = dataloader if hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict") else None
    if data is None and isinstance(sampler, ElasticSampler):
        data = sampler
    if data is None and loader is None:
        raise TypeError(
            "this DataLoader has no position to save: give it a ckpt.ElasticSampler "
            "(exact on any world size) or use torchdata's StatefulDataLoader"
        )
    return data, loader


def own_generator(dataloader: Any) -> torch.Generator | None:
    """Give a DataLoader without a generator one of its own, seeded with torch's initial seed
    (nothing is drawn), and return it. Each `iter(loader)` draws its workers' base seed, from
    torch's global generator unless the loader has one. A run creates its iterator before its
    first step, a resumed run after the restore: that one draw would shift every random number
    after it (dropout), and the resumed run would not be the run it resumes."""
    if dataloader is None or getattr(dataloader, "generator", False) is not None:
        return None
    generator = torch.Generator().manual_seed(torch.initial_seed())
    try:
        dataloader.generator = generator
    except (AttributeError, ValueError) as e:  # a loader class that will not have it
        log.warning("cannot give %s a generator of its own (%s): a resumed run's random numbers may differ from the run it resumes", type(dataloader).__name__, e)
        return None
    return generator

