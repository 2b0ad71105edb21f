"""Capture: the whole training state as one DCP state dict, and back.

One small adapter per kind of state. Model and optimizers go through
`torch.distributed.checkpoint.state_dict` (plain module, DDP, FSDP2, FSDP1, DTensor TP),
so they come out sharded the way they live and reshard on load. The layout of the dict:

    model, optim          DCP state dicts (sharded where the model is)
    scheduler.<i>         LR scheduler state dicts
    scaler                GradScaler state dict
    extra.<name>          any object with state_dict/load_state_dict
    counters              JSON text: step and the user's counters (global, equal on all ranks)
    rng.rank_<r>          RNG of python, numpy, torch CPU and every CUDA device, per rank

IMPORTANT: per-rank state is keyed by rank; DCP keeps one copy of equal keys across ranks.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

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

    @classmethod
    def of(cls, model: Any, optimizer: Any, scheduler: Any, scaler: Any, extra: Any) -> TrainingState:
        state = cls(model, _as_list(optimizer), _as_list(scheduler), scaler, dict(extra or {}))
        if state.optimizers and state.model is None:
            raise ValueError("an optimizer needs its model: pass model= as well")
        for name, obj in state.extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"extra[{name!r}] has no state_dict/load_state_dict")
        return state

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
        sd["counters"] = json.dumps(counters)
        sd["rng"] = {f"rank_{rank}": rng_state()}
        return sd

    # -- restore ----------------------------------------------------------------------------
    def template(self, has_rng: bool, rank: int) -> dict[str, Any]:
        """A state dict of the current objects to load into; `has_rng`: the checkpoint holds
        RNG state for this rank (it was saved by at least rank+1 ranks)."""
        sd = self.capture({}, rank)
        sd["counters"] = ""
        if not has_rng:
            log.warning("checkpoint has no RNG state for rank %d; its RNG is left as seeded", rank)
            del sd["rng"]
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
        if "rng" in sd:
            set_rng_state(sd["rng"][f"rank_{rank}"])
        return json.loads(sd["counters"])


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
