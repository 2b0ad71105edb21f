"""Capture: the whole training state as one DCP state dict, and back.

One small adapter per kind of state. Model and optimizers go through
`torch.distributed.checkpoint.state_dict` (plain module, DDP, FSDP2, FSDP1, DTensor TP),
so they come out sharded the way they live and reshard on load. The layout of the dict:

    model, optim          DCP state dicts (sharded where the model is); for a DeepSpeed
                          engine, full per-parameter tensors (`ckpt.capture.deepspeed_state`)
    engine                a DeepSpeed engine's counters and LR scheduler
    scheduler.<i>         LR scheduler state dicts
    scaler                GradScaler state dict
    extra.<name>          any object with state_dict/load_state_dict
    counters              JSON text: step and the user's counters (global, equal on all ranks)
    data                  JSON text: the global data position (an ElasticSampler)
    loader.rank_<r>       bytes: a StatefulDataLoader's own state (torch.save'd), per rank
    rng.rank_<r>          RNG of python, numpy, torch CPU and the rank's CUDA device, per rank

With frozen="skip" the model's parameters that do not require grad are left out of what is
saved; a restore still asks for them, and keeps those a checkpoint lacks (`optional`).
Whether the model's and optimizers' dicts hold their live tensors: `ckpt.capture.live`.

IMPORTANT: per-rank state is keyed by rank; DCP keeps one copy of equal keys across ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.state_dict import _get_fqns, set_model_state_dict, set_state_dict

from ckpt.capture import deepspeed_state
from ckpt.capture.live import (
    StateDictCache,
    loaded_in_place,
    optim_loaded_in_place,
    optim_template_is_live,
    template_is_live,
)
from ckpt.capture.optim_init import init_state, saved_without_state

log = logging.getLogger(__name__)

# Values a state dict holds that are copied as they are (immutable): no tensors inside.
ATOMS = frozenset({str, int, float, bool, bytes, type(None)})
# The top-level keys of ckpt's own state dict: an app state (`TrainingState.app`) may not use them.
OWN_KEYS = frozenset({"model", "optim", "scheduler", "scaler", "extra", "data", "loader", "counters", "rng"})


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
    # A DCP app state: its state dict saved at the top level, keys as it names them (a plain
    # DCP layout another tool reads, such as torchtitan's: `ckpt.integrations.torchtitan`).
    app: Any = None
    # The generator ckpt gave a DataLoader that had none (`data.own_generator`): reseeded on
    # restore, so that its workers' seeds after a resume are not a fresh run's again.
    loader_generator: torch.Generator | None = None
    # frozen="skip": parameters with requires_grad=False are left out of what is saved (a
    # restore still loads those a checkpoint holds: `template`).
    skip_frozen: bool = False
    _dcp_state: StateDictCache = field(default_factory=lambda: StateDictCache())
    _loadable: set[type] = field(default_factory=set)  # types of saved objects a restore loads (`_check_loadable`)
    _template_model: dict[str, Any] = field(default_factory=dict)  # the model's values in the last template
    # The optimizers' in the last template: each state entry's values, and each group's params.
    _template_optim: tuple[dict[str, dict[str, Any]], list[list[Any]]] = field(default_factory=lambda: ({}, []))

    @classmethod
    def of(
        cls, model: Any, optimizer: Any, scheduler: Any, scaler: Any, extra: Any, data: Any = None, loader: Any = None,
        frozen: str = "save", app: Any = None,
    ) -> TrainingState:  # fmt: skip
        state = cls(model, _as_list(optimizer), _as_list(scheduler), scaler, dict(extra or {}), data, loader, app=app)
        state.skip_frozen = frozen == "skip"
        # IMPORTANT: checked here, not at the first save (with interval="auto", minutes in).
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (plain, DDP, FSDP) or a DeepSpeed engine, not {type(model).__name__}")
        for i, opt in enumerate(state.optimizers):
            if not (hasattr(opt, "param_groups") and hasattr(opt, "state_dict") and hasattr(opt, "load_state_dict")):
                raise TypeError(f"optimizer {i} must be a torch.optim.Optimizer, not {type(opt).__name__}")
        stateful = [
            *((f"scheduler {i}", o) for i, o in enumerate(state.schedulers)),
            *(("scaler", o) for o in [scaler] if o is not None),
            *(("app_state", o) for o in [app] if o is not None),
        ]
        for what, obj in [*stateful, *((f"extra[{name!r}]", o) for name, o in state.extra.items())]:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{what} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if deepspeed_state.is_engine(model):
            deepspeed_state.check(model)
            if state.optimizers:
                raise ValueError("a DeepSpeed engine brings its optimizer: pass model=engine alone")
        if state.optimizers and state.model is None:
            raise ValueError("an optimizer needs its model: pass model= as well")
        return state

    def deferrable(self) -> Callable[[tuple[Any, ...], torch.Tensor], bool]:
        """Which tensors of a captured state may be copied after the loop goes on: those that
        only `optimizer.step()` changes, which waits for the copies (a pre-hook): the
        optimizers' state, and the model's parameters (by storage: views of them too).
        Everything else is copied at once: module buffers (BatchNorm's statistics, spectral
        norm's vectors, counters: forward changes them), tensors a module's state dict makes
        of its own, extras, RNG. With no optimizer (a loop that updates the parameters by
        hand) there is no step to wait in: nothing is deferred. Asked during `capture`:
        `defer` reads the parameters that capture's walk of the modules found."""
        if deepspeed_state.is_engine(self.model) or not self.optimizers:
            return lambda path, tensor: False  # DeepSpeed: gathered copies, not the live tensors
        cache = self._dcp_state

        def defer(path: tuple[Any, ...], tensor: torch.Tensor) -> bool:
            if path[0] == "optim":
                return path[1] == "state"
            # IMPORTANT: an allowlist: a tensor not known to be a parameter is copied now.
            return path[0] == "model" and tensor.untyped_storage().data_ptr() in cache.params

        return defer

    # -- save -------------------------------------------------------------------------------
    def capture(self, counters: dict[str, Any], rank: int, *, reuse: bool = True, frozen: bool | None = None, template: bool = False) -> dict[str, Any]:
        """The state dict to save. Tensors are the live ones: stage before training resumes.
        With `reuse`, the model and optimizer dicts are those of the last capture when
        nothing they hold has been replaced (see `StateDictCache`). `frozen`: whether the
        frozen parameters are in it (default: unless frozen="skip")."""
        skip = self.skip_frozen if frozen is None else not frozen
        sd: dict[str, Any] = {}
        if deepspeed_state.is_engine(self.model):
            sd.update(deepspeed_state.capture(self.model, frozen=not skip))
        elif self.model is not None:
            # An optimizer that has taken no step (a restore's template; a save before the
            # first step) gets its state as its first step will make it: else DCP's state-dict
            # API takes a step of zeros, whose count a save would leave in the training. One
            # whose state cannot be made so is saved with none (`template`: a restore's fresh
            # objects take DCP's step, to load into; the restore drops what it did not load).
            for opt in self.optimizers:
                init_state(opt)
            with contextlib.nullcontext() if template else saved_without_state(self.optimizers):
                sd.update(self._dcp_state.get(self.model, self.optimizers, reuse, skip))
        if self.schedulers:
            sd["scheduler"] = {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        if self.extra:
            sd["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        for key in ("scheduler", "scaler", "extra"):  # torch's own dicts hold nothing else
            if key in sd:
                _check_loadable(sd[key], key, self._loadable)
        if self.app is not None:
            top = self.app.state_dict()
            taken = sorted(k for k in top if str(k).split(".", 1)[0] in OWN_KEYS)
            if taken:
                raise ValueError(f"app_state's keys {taken[:5]} are (or are under) ckpt's own {sorted(OWN_KEYS)}: name them otherwise")
            _check_loadable(top, "app_state", self._loadable)
            sd.update(top)
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
    def optional(self) -> Callable[[str], bool]:
        """What a checkpoint may lack, the restore leaving it as it is: `optional_in_checkpoint`,
        and the frozen parameters (`frozen_keys`: a checkpoint saved with frozen="skip" has
        none, nor has a DeepSpeed engine's of an earlier ckpt)."""
        frozen = self.frozen_keys()
        return lambda fqn: optional_in_checkpoint(fqn) or fqn in frozen

    def frozen_keys(self) -> frozenset[str]:
        """The state dict keys (`model.<fqn>`) of the model's parameters that do not require
        grad, named as DCP names them (no DDP `module.` or FSDP1 wrapper prefixes)."""
        if self.model is None:
            return frozenset()
        if deepspeed_state.is_engine(self.model):
            return frozenset(deepspeed_state.frozen_names(self.model))
        return frozenset(
            f"model.{fqn}" for name, p in self.model.named_parameters() if not p.requires_grad for fqn in _get_fqns(self.model, name)
        )

    def template(self, rank: int) -> dict[str, Any]:
        """A state dict of the current objects to load into; `fit_template` limits it to what
        a checkpoint holds for this rank, once its manifest is known. With frozen="skip" too,
        it asks for the frozen parameters: a checkpoint that holds them (saved with "save",
        or while they were trained) restores them, one that does not leaves them as they are
        (`optional`). Never a trained value left behind because the job froze it since."""
        sd = self.capture({}, rank, reuse=False, frozen=True, template=True)  # DCP loads into it: never the cached dicts
        # Whether the template's tensors are the objects' own, worked out now (while the
        # restore's files are still being read) rather than after the read: `apply` then only
        # checks that DCP loaded into those very tensors. Nothing touches the objects between.
        model = sd.get("model", {}) if self.model is not None and not deepspeed_state.is_engine(self.model) else {}
        self._template_model, self._template_optim = {}, ({}, [])
        try:  # only a shortcut: whatever it cannot tell (a tensor it cannot look into), it says no
            if model and template_is_live(self.model, model):
                self._template_model = dict(model)
            if self._template_model and "optim" in sd:  # DCP's optimizer state dict
                osd = sd["optim"]
                state = {fqn: dict(values) for fqn, values in osd["state"].items()}
                if optim_template_is_live(self.optimizers, state):
                    self._template_optim = (state, [list(g["params"]) for g in osd["param_groups"]])
        except Exception as e:  # IMPORTANT: never this rank alone out of the restore's collectives
            log.debug("the restore loads the state dicts again (%s: %s)", type(e).__name__, e)
            self._template_model, self._template_optim = {}, ({}, [])
        return sd

    def fit_template(self, sd: dict[str, Any], rank: int, world: int, saved_world: int) -> dict[str, Any]:
        """`sd` (a `template`, changed in place) limited to what the checkpoint, saved by
        `saved_world` ranks, holds for this rank of `world`."""
        sd["counters"] = ""
        if "data" in sd:
            sd["data"] = ""
        if rank >= saved_world:
            del sd["rng"]  # a new rank: apply() derives its streams
        for key in getattr(self.app, "skip_on_restore", lambda same_world: ())(world == saved_world):
            sd.pop(key, None)
        if "loader" in sd:
            if world == saved_world:
                sd["loader"] = {f"rank_{rank}": b""}
                sd.pop("data", None)  # IMPORTANT: the loader restores its sampler; never both
            else:
                del sd["loader"]
        return sd

    def apply(self, sd: dict[str, Any], rank: int, stateless: Collection[str] = ()) -> dict[str, Any]:
        """Load a restored state dict into the objects; returns the saved counters. The
        parameters in `stateless` had no optimizer state at the save: they have none after."""
        if deepspeed_state.is_engine(self.model):
            deepspeed_state.apply(self.model, sd)
        elif "optim" in sd:
            # The model's half skipped when loading it would copy each tensor onto itself.
            in_place = loaded_in_place(sd["model"], self._template_model)
            if in_place and optim_loaded_in_place(self.optimizers, sd["optim"], *self._template_optim):
                _load_hyperparameters(self.optimizers, sd["optim"]["param_groups"])
            else:
                set_state_dict(
                    self.model,
                    self.optimizers,
                    model_state_dict={} if in_place else sd["model"],
                    optim_state_dict=sd["optim"],
                )
        elif "model" in sd and not loaded_in_place(sd["model"], self._template_model):
            set_model_state_dict(self.model, sd["model"])
        self._template_model, self._template_optim = {}, ({}, [])  # views: they must not outlive a replaced tensor
        if stateless and not deepspeed_state.is_engine(self.model):
            params = {fqn: p for name, p in self.model.named_parameters() for fqn in _get_fqns(self.model, name)}
            for opt in self.optimizers:
                for fqn in stateless:
                    opt.state.pop(params.get(fqn), None)
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(sd["scheduler"][str(i)])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        for name, obj in self.extra.items():
            obj.load_state_dict(sd["extra"][name])
        if self.app is not None:
            self.app.load_state_dict({k: v for k, v in sd.items() if k not in OWN_KEYS})
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
        if self.loader_generator is not None:
            self.loader_generator.manual_seed(_seed(f"ckpt-loader:{torch.initial_seed()}:{counters['step']}"))
        return counters


def _load_hyperparameters(optimizers: list[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
    """Set the optimizers' groups' values (lr, betas, ...) to the saved ones, as their
    load_state_dict would: the state tensors were loaded in place (`optim_loaded_in_place`)."""
    live_groups = [g for o in optimizers for g in o.param_groups]
    for live, saved in zip(live_groups, groups, strict=True):
        live.update((k, v) for k, v in saved.items() if k != "params")


def _check_loadable(obj: Any, where: str, known: set[type]) -> None:
    """Every value of `obj` that is saved as a pickle must load again under `weights_only`
    (a restore never runs code from a checkpoint): else the save is refused now, rather than
    every restore of it failing later. Containers are walked (DCP flattens mappings and
    lists), tensors are not pickled, and each other type is tried once (`known`)."""
    if isinstance(obj, torch.Tensor) or type(obj) in known:
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_loadable(v, f"{where}.{k}", known)
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}.{i}", known)
        return
    if type(obj) in ATOMS:
        return
    try:
        buf = io.BytesIO()
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise TypeError(
            f"{where} is a {type(obj).__name__}, which a restore could not load: restores load objects with "
            f"torch.load(weights_only=True) ({' '.join(str(e).split())[:300]}). Save tensors and plain values "
            "(numbers, strings, lists, dicts) instead, or allow the class with torch.serialization.add_safe_globals"
        ) from None
    known.add(type(obj))


def _json(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj)
    except TypeError as e:
        raise TypeError(f"the {what} state must be JSON values (numbers, strings, lists, dicts): {e}") from e


def derive_rng(step: int, rank: int) -> None:
    """RNG policy for a rank the checkpoint has no streams for (the job grew): every stream is
    seeded from (step, rank), so the new rank's randomness is reproducible and differs from
    every other rank's. Ranks that existed before keep their own streams exactly."""
    seed = _seed(f"ckpt-rng:{step}:{rank}")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # seeds every CUDA device too
    log.info("rank %d is new to this checkpoint: its RNG streams are seeded from (step %d, rank %d)", rank, step, rank)


def _seed(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode()) & ((1 << 63) - 1)


CUDA_RNG = "cuda_device"


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
        # The current device's generator, the one this rank draws from: a resume may see more
        # or fewer devices, or this rank on another index (a checkpoint keyed by index failed
        # to restore on a node with more GPUs, and gave a rank another device's stream).
        state[CUDA_RNG] = torch.cuda.get_rng_state()
    return state


def optional_in_checkpoint(fqn: str) -> bool:
    """A value that a checkpoint may lack and the restore then leaves as it is: the CUDA RNG
    stream, which a process where CUDA was not in use at the save did not have."""
    return fqn.startswith("rng.") and fqn.endswith(f".{CUDA_RNG}")


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
    if CUDA_RNG in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[CUDA_RNG])  # the current device's
