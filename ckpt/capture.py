"""Capture: the whole training state as one DCP state dict, and back.

One small adapter per kind of state. Model and optimizers go through
`torch.distributed.checkpoint.state_dict` (plain module, DDP, FSDP2, FSDP1, DTensor TP),
so they come out sharded the way they live and reshard on load. The layout of the dict:

    model, optim          DCP state dicts (sharded where the model is)
    scheduler.<i>         LR scheduler state dicts
    scaler                GradScaler state dict
    extra.<name>          any object with state_dict/load_state_dict
    counters              JSON text: step and the user's counters (global, equal on all ranks)
    data                  JSON text: the global data position (an ElasticSampler)
    loader.rank_<r>       bytes: a StatefulDataLoader's own state (torch.save'd), per rank
    rng.rank_<r>          RNG of python, numpy, torch CPU and every CUDA device, per rank

IMPORTANT: per-rank state is keyed by rank; DCP keeps one copy of equal keys across ranks.
"""

from __future__ import annotations

import io
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class TrainingState:
    """The objects whose state a checkpoint holds."""

    model: torch.nn.Module | None = None
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    data: Any = None  # global position: the same on every rank, valid on any world size
    loader: Any = None  # per-rank loader state: valid only on the same world size

    @classmethod
    def of(
        cls, model: Any, optimizer: Any, scheduler: Any, scaler: Any, extra: Any, data: Any = None, loader: Any = None
    ) -> TrainingState:
        state = cls(model, _as_list(optimizer), _as_list(scheduler), scaler, dict(extra or {}), data, loader)
        if state.optimizers and state.model is None:
            raise ValueError("an optimizer needs its model: pass model= as well")
        for name, obj in state.extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"extra[{name!r}] has no state_dict/load_state_dict")
        return state

    def deferrable(self) -> Callable[[tuple[Any, ...], torch.Tensor], bool]:
        """Which tensors of a captured state may be copied after the loop goes on: those that
        only `optimizer.step()` changes (parameters and optimizer state). Module buffers
        (BatchNorm statistics change in forward), extras, RNG and the rest are copied at once."""
        buffers = set()
        if self.model is not None:
            for b in self.model.buffers():
                local = b._local_tensor if isinstance(b, DTensor) else b
                buffers.add(local.untyped_storage().data_ptr())

        def defer(path: tuple[Any, ...], tensor: torch.Tensor) -> bool:
            return path[0] in ("model", "optim") and tensor.untyped_storage().data_ptr() not in buffers

        return defer

    # -- save -------------------------------------------------------------------------------
    def capture(self, counters: dict[str, Any], rank: int) -> dict[str, Any]:
        """The state dict to save. Tensors are the live ones: stage before training resumes."""
        sd: dict[str, Any] = {}
        if self.model is not None and self.optimizers:
            sd["model"], sd["optim"] = get_state_dict(self.model, self.optimizers)
        elif self.model is not None:
            sd["model"] = get_model_state_dict(self.model)
        if self.schedulers:
            sd["scheduler"] = {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        if self.extra:
            sd["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self.data is not None:
            sd["data"] = _json(self.data.state_dict(), "data")
        if self.loader is not None:
            buf = io.BytesIO()
            torch.save(self.loader.state_dict(), buf)  # it may hold tensors (a generator's state)
            sd["loader"] = {f"rank_{rank}": buf.getvalue()}
        sd["counters"] = _json(counters, "counters")
        sd["rng"] = {f"rank_{rank}": rng_state()}
        return sd

    # -- restore ----------------------------------------------------------------------------
    def template(self, rank: int, world: int, saved_world: int) -> dict[str, Any]:
        """A state dict of the current objects to load into, limited to what the checkpoint,
        saved by `saved_world` ranks, holds for this rank of `world`."""
        sd = self.capture({}, rank)
        sd["counters"] = ""
        if "data" in sd:
            sd["data"] = ""
        if rank >= saved_world:
            del sd["rng"]  # a new rank: apply() derives its streams
        if "loader" in sd:
            if world == saved_world:
                sd["loader"] = {f"rank_{rank}": b""}
                sd.pop("data", None)  # IMPORTANT: the loader restores its sampler; never both
            else:
                del sd["loader"]
        return sd

    def apply(self, sd: dict[str, Any], rank: int) -> dict[str, Any]:
        """Load a restored state dict into the objects; returns the saved counters."""
        if "optim" in sd:
            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optim"],
            )
        elif "model" in sd:
            set_model_state_dict(self.model, sd["model"])
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(sd["scheduler"][str(i)])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        for name, obj in self.extra.items():
            obj.load_state_dict(sd["extra"][name])
        if "data" in sd:
            self.data.load_state_dict(json.loads(sd["data"]))
        if "loader" in sd:
            blob = sd["loader"][f"rank_{rank}"]
            self.loader.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        counters = json.loads(sd["counters"])
        if "rng" in sd:
            set_rng_state(sd["rng"][f"rank_{rank}"])
        else:
            derive_rng(int(counters["step"]), rank)
        return counters


def _json(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj)
    except TypeError as e:
        raise TypeError(f"the {what} state must be JSON values (numbers, strings, lists, dicts): {e}") from e


def derive_rng(step: int, rank: int) -> None:
    """RNG policy for a rank the checkpoint has no streams for (the job grew): every stream is
    seeded from (step, rank), so the new rank's randomness is reproducible and differs from
    every other rank's. Ranks that existed before keep their own streams exactly."""
    seed = xxhash.xxh64_intdigest(f"ckpt-rng:{step}:{rank}".encode()) & ((1 << 63) - 1)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # seeds every CUDA device too
    log.info("rank %d is new to this checkpoint: its RNG streams are seeded from (step %d, rank %d)", rank, step, rank)


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process, as tensors and plain values (no pickled objects)."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda: dict[str, torch.Tensor] = state.get("cuda") or {}
    if cuda and torch.cuda.is_available():
        states: Sequence[torch.Tensor] = [cuda[str(i)] for i in range(len(cuda))]
        n = min(len(states), torch.cuda.device_count())
        if n < len(states):
            log.warning("checkpoint has RNG for %d CUDA devices, %d are visible", len(states), n)
        torch.cuda.set_rng_state_all(list(states)[:n])
