"""Live tensors: whether a state dict is made of the model's and optimizers' own tensors.

Two shortcuts of `ckpt.capture.state` rest on it. A save reuses DCP's state dicts from the last
save while no parameter, buffer or optimizer state entry has been replaced (`StateDictCache`):
with 10,000 tensors DCP's state-dict API costs ~100 ms of Python a save. A restore skips
loading a state dict into the objects when DCP read every value into their very tensors
(`template_is_live`, `loaded_in_place` and their optimizer twins): loading would only copy
each tensor onto itself. Both say no whenever they cannot tell (hooks, tensor subclasses,
overridden state-dict methods).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.tensor import DTensor


class StateDictCache:
    """`get_state_dict(model, optimizers)`, reused while the objects it read are unchanged.

    With 10,000 tensors DCP's state-dict API spends ~100 ms of Python at every save (FQN maps,
    per-parameter lookups), more than copying the tensors. Its dicts hold the live tensors
    (views of the same storage), so as long as no parameter, buffer or optimizer state entry
    has been replaced, resized or added, and no other state value changed, the same dicts are
    the answer again; only the optimizer's hyperparameters (an LR schedule) are read anew.
    Models with state-dict hooks or extra state (FSDP1, Transformer Engine), whose output
    cannot be checked this way, always take the full path.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._value: dict[str, Any] = {}
        self.params: frozenset[int] = frozenset()  # storages of the modules' parameters, at the last get

    def get(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], reuse: bool, skip_frozen: bool = False) -> dict[str, Any]:
        """With `skip_frozen`, the model's dict leaves out the parameters that do not require
        grad (and the fingerprint says which do)."""
        modules = list(model.modules())  # walked once: 10,000 modules take milliseconds a walk
        tensors, self.params, plain = _walk(modules)
        local = _locals(tensors)
        checkable = _checkable(plain, local, optimizers)
        key = _fingerprint(tensors, local, optimizers, skip_frozen) if reuse and checkable else None
        if key is not None and key == self._key:
            if "optim" in self._value:
                groups = itertools.chain.from_iterable(o.param_groups for o in optimizers)
                for saved, live in zip(self._value["optim"]["param_groups"], groups, strict=True):
                    saved.update((k, v) for k, v in live.items() if k != "params")
            return dict(self._value)
        options = StateDictOptions(ignore_frozen_params=skip_frozen)
        if optimizers:
            msd, osd = get_state_dict(model, optimizers, options=options)
            value = {"model": msd, "optim": osd}
        else:
            value = {"model": get_model_state_dict(model, options=options)}
        # Taken after: FSDP2's hook may have swapped unsharded parameters for sharded ones.
        tensors, self.params, _ = _walk(list(model.modules()))
        if reuse:
            # IMPORTANT: not a restore's template: DCP loads into it, and set_state_dict renames
            # its keys in place (a DDP model's get the "module." prefix back).
            self._key = _fingerprint(tensors, _locals(tensors), optimizers, skip_frozen) if checkable else None
            self._value = value
        return dict(value)


# FSDP2 reshards parameters before a state dict is taken; the fingerprint sees which
# parameters are registered, so a state dict reused without the hook is still the right one.
# Matched by name: should torch rename it, the model is merely never reused (fails safe).
_KNOWN_HOOKS = {"FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"}
# What a module may override and still have the state dict its tensors make: none of these.
_STATE_DICT_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter, torch.nn.Buffer))


def _walk(modules: list[torch.nn.Module]) -> tuple[list[torch.Tensor], frozenset[int], bool]:
    """In one pass over the modules (10,000 of them at every save): every parameter and
    buffer, each once (shared ones too); the storages of the parameters; and whether the
    modules' state dicts are their tensors' (no hooks but FSDP2's, no overridden state-dict
    methods: quantized or custom modules)."""
    seen: set[int] = set()
    out = []
    params = set()
    plain = True
    for m in modules:
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        for p in m._parameters.values():
            if p is not None:
                params.add((p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr())
        if m._state_dict_hooks or m._state_dict_pre_hooks:
            hooks = itertools.chain(m._state_dict_hooks.values(), m._state_dict_pre_hooks.values())
            plain = plain and all(getattr(h, "__qualname__", "") in _KNOWN_HOOKS for h in hooks)
        kind = _PLAIN_MODULE_TYPES.get(type(m))
        if kind is None:
            kind = _PLAIN_MODULE_TYPES[type(m)] = all(
                getattr(type(m), n) is getattr(torch.nn.Module, n) for n in _STATE_DICT_METHODS
            )
        plain = plain and kind
    return out, frozenset(params), plain


# Whether a module class leaves its state dict to its tensors (no overridden state-dict
# method), by class.
_PLAIN_MODULE_TYPES: dict[type, bool] = {}


def _checkable(plain_modules: bool, local: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> bool:
    """Whether a state dict of the model is fully determined by its tensors' storages: its
    modules plain (`_walk` says), no tensor subclass among its parameters and buffers
    (`local`: DTensors as their shards; float8, NF4: their storage is not where their data
    lives), no optimizer state-dict hooks."""
    if not plain_modules or not set(map(type, local)) <= _PLAIN_TENSORS:
        return False
    return not any(o._optimizer_state_dict_pre_hooks or o._optimizer_state_dict_post_hooks for o in optimizers)


def _fingerprint(
    tensors: list[torch.Tensor], local: list[torch.Tensor], optimizers: list[torch.optim.Optimizer], frozen: bool = False
) -> tuple[Any, ...]:
    """What a state dict of these objects is made of: which storage every parameter, buffer
    and optimizer state tensor lives in (and its shape), every other state value, and the
    parameters of every optimizer group (`local`: the tensors, DTensors as their shards);
    with `frozen`, which parameters require grad (a dict without the frozen ones: a
    parameter unfrozen since is in it). Equal fingerprints, equal state dicts. (Built a
    column at a time, all tensors in one: it runs in the loop's part of every save, over
    every tensor.)"""
    parts: list[Any] = []
    described, local = list(tensors), list(local)
    for opt in optimizers:
        for group in opt.param_groups:
            params = group["params"]
            states = [opt.state.get(p, _NO_STATE) for p in params]
            values = [v for st in states for v in st.values()]
            is_tensor = [isinstance(v, torch.Tensor) for v in values]
            parts += [
                list(map(id, params)),
                [tuple(st) for st in states],  # the keys, in order
                [None if t else (type(v), v) for v, t in zip(values, is_tensor, strict=True)],
            ]
            state_tensors = list(itertools.compress(values, is_tensor))
            described += state_tensors
            local += _locals(state_tensors)
    parts.append(len(tensors))  # where the model's tensors end in the columns
    if frozen:
        parts.append(list(map(_REQUIRES_GRAD, tensors)))
    parts += [
        list(map(_DATA_PTR, local)),
        list(map(_SHAPE, local)),
        list(map(_STRIDE, local)),
        list(map(_DTYPE, local)),
        list(map(type, described)),
    ]
    return tuple(parts)


def template_is_live(model: torch.nn.Module, template: dict[str, Any]) -> bool:
    """Whether loading a restored state dict into the model can be skipped when DCP loaded
    every value into the very tensors of its `template` (`loaded_in_place`), as loading it
    would only copy each tensor onto itself (its Python costs more than the read of a 100 MB
    restore's model, and seconds with 10,000 tensors): each of those tensors is exactly the
    memory of a parameter or buffer; and no module does more on load than copy (no overridden
    loading method, no load hooks but FSDP2's, which have nothing to do when no parameter was
    replaced) nor makes its state dict other than of its tensors (`_walk`)."""
    if not template:
        return False
    modules = list(model.modules())
    tensors, _, plain = _walk(modules)
    local = _locals(tensors)
    if not (_checkable(plain, local, []) and all(map(_plain_loading, modules))):
        return False
    live = _where(local)
    mine = _locals(list(template.values()))
    if not set(map(type, mine)) <= _PLAIN_TENSORS:
        return False
    return _where(mine) <= live


def loaded_in_place(loaded: dict[str, Any], template: dict[str, Any]) -> bool:
    """Whether the model's restored state dict `loaded` holds the very tensors of a live
    `template` (`template_is_live`; empty if not): none replaced, none added or missing."""
    return bool(template) and loaded.keys() == template.keys() and all(loaded[k] is t for k, t in template.items())


def optim_template_is_live(optimizers: list[torch.optim.Optimizer], state: dict[str, dict[str, Any]]) -> bool:
    """Whether DCP's set_state_dict (its Python is more than a 100 MB restore's read of the
    optimizer state, and a third of a second with 10,000 tensors) can be skipped when DCP
    loaded every state value into the very tensors of the template's `state` (by FQN), as it
    would only copy each onto itself and set the groups' hyperparameters
    (`optim_loaded_in_place`): those tensors, none a plain value, are exactly the memory of
    all of the optimizers' state tensors, one each; and no optimizer does more on load (no
    overridden load_state_dict, no load hooks)."""
    if not state or any(
        type(o).load_state_dict is not torch.optim.Optimizer.load_state_dict
        or o._optimizer_load_state_dict_pre_hooks
        or o._optimizer_load_state_dict_post_hooks
        for o in optimizers
    ):
        return False
    mine = [v for values in state.values() for v in values.values()]
    live = [v for o in optimizers for st in o.state.values() for v in st.values()]
    if len(mine) != len(live) or not all(isinstance(v, torch.Tensor) for v in itertools.chain(mine, live)):
        return False
    mine, live = _locals(mine), _locals(live)
    if not set(map(type, mine)) | set(map(type, live)) <= _PLAIN_TENSORS:
        return False
    live_at = _where(live)
    return len(live_at) == len(live) and _where(mine) == live_at


def optim_loaded_in_place(
    optimizers: list[torch.optim.Optimizer], loaded: Any, state: dict[str, dict[str, Any]], params: list[list[Any]]
) -> bool:
    """Whether the optimizers' restored state dict `loaded` holds the very tensors of a live
    template's `state` (`optim_template_is_live`; empty if not), none replaced, added or
    missing, and the template's groups (`params`), one for each of the optimizers' groups,
    with the same keys: then only the hyperparameters are left to set (`_load_hyperparameters`)."""
    if not state or not isinstance(loaded, dict) or not isinstance(loaded.get("state"), dict):
        return False
    got = loaded["state"]
    if got.keys() != state.keys():
        return False
    for fqn, values in state.items():
        now = got[fqn]
        if not isinstance(now, dict) or now.keys() != values.keys() or any(now[k] is not v for k, v in values.items()):
            return False
    groups = loaded.get("param_groups")
    live_groups = [g for o in optimizers for g in o.param_groups]
    return (
        isinstance(groups, list)
        and len(groups) == len(live_groups) == len(params)
        and all(
            isinstance(g, dict) and g.get("params") == p and g.keys() == lg.keys()
            for g, lg, p in zip(groups, live_groups, params, strict=True)
        )
    )


def _where(tensors: list[torch.Tensor]) -> set[tuple[Any, ...]]:
    """The memory each (plain) tensor is: its storage address, shape, strides and dtype."""
    return set(zip(map(_DATA_PTR, tensors), map(_SHAPE, tensors), map(_STRIDE, tensors), map(_DTYPE, tensors), strict=True))


def _plain_loading(m: torch.nn.Module) -> bool:
    """Whether loading a state dict into `m` only copies its tensors: no overridden loading
    method, no load hooks but FSDP2's (matched by name: renamed, they fail safe)."""
    kind = _PLAIN_LOADING_TYPES.get(type(m))
    if kind is None:
        kind = _PLAIN_LOADING_TYPES[type(m)] = all(
            getattr(type(m), n) is getattr(torch.nn.Module, n) for n in _LOAD_METHODS
        )
    if not kind:
        return False
    hooks = itertools.chain(m._load_state_dict_pre_hooks.values(), m._load_state_dict_post_hooks.values())
    return all(getattr(getattr(h, "hook", h), "__qualname__", "") in _KNOWN_LOAD_HOOKS for h in hooks)


# FSDP2's load hooks: before, reshard (a no-op on a sharded model); after, re-register and
# re-pad a parameter that was replaced (none is when every value was loaded in place).
_KNOWN_LOAD_HOOKS = {
    "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook",
    "FSDPParam.__init__.<locals>.<lambda>",
}
_LOAD_METHODS = ("load_state_dict", "_load_from_state_dict", "set_extra_state")
_PLAIN_LOADING_TYPES: dict[type, bool] = {}


_NO_STATE: dict[str, Any] = {}
# The tensor methods by themselves, mapped over 10,000 tensors without a lookup each.
_DATA_PTR, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.stride
_SHAPE, _DTYPE = torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__
_REQUIRES_GRAD = torch.Tensor.requires_grad.__get__


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, a DTensor as its local shard."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
