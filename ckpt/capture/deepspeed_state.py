"""A DeepSpeed engine's state, in a form any world size can load (ZeRO stage 0 to 3).

`Checkpointer(model=engine)` saves what DeepSpeed's universal checkpoint holds: per parameter
(by its name in the module), the full fp32 master weight and the full optimizer state
(Adam's moments), gathered from the ZeRO partitions with DeepSpeed's own tensor-fragment API
(`deepspeed.utils.safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), plus the
optimizer's step and hyperparameters, the frozen parameters as the module holds them (no
optimizer owns them, so ZeRO keeps no fp32 copy), the module's buffers, the engine's
counters and, if DeepSpeed owns one, its LR scheduler. Restoring scatters each full tensor into whatever
partition this rank owns now (`safe_set_full_*`) and refreshes the low-precision copies, so
a job resumes on another world size without a conversion script. CPU offload of the
optimizer keeps its fp32 state on the host, where the same API reads and writes it.

The full tensors are equal on every rank: DCP writes each once (spread over the ranks) and
every rank reads them all back. The price: during a save's capture each rank holds the full
fp32 weights and optimizer state of the model on the host (not only its partition).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch


def is_engine(model: Any) -> bool:
    """A DeepSpeed engine (checked by class name: deepspeed is imported only if it is one)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def check(engine: Any) -> None:
    """ZeRO stages 1 to 3 are taken whole; stage 0 is a plain module and optimizer."""
    if engine.zero_optimization_stage() == 0 or engine.optimizer is None:
        raise ValueError(
            "a DeepSpeed engine without ZeRO (stage 0) or without an optimizer: pass "
            "model=engine.module, optimizer=engine.optimizer instead (or use ZeRO stage 1-3)"
        )


def _named_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _frozen_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters no optimizer owns (`requires_grad=False`): ZeRO keeps no fp32 copy of
    them, so they are saved as the module holds them, in their own dtype."""
    return [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]


def frozen_names(engine: Any) -> list[str]:
    """The state dict keys of the frozen parameters (`model.<name>`)."""
    return [f"model.{n}" for n, _ in _frozen_params(engine)]


def _gathered(stage: int, params: list[tuple[str, torch.nn.Parameter]], modify: bool = False) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """`params` in runs whose full tensors are in `p.data` while the caller is at each:
    under ZeRO-3 each run is gathered (a collective), at most GATHER_BYTES at once (all at
    once would put the whole model on each device), and with `modify` rank 0's values are
    partitioned again after it; below ZeRO-3 every rank holds them whole."""
    if stage != 3:
        yield params
        return
    import deepspeed

    for group in _gather_groups(params):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=0 if modify else None):
            yield group


def _base_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt) if opt is not None else None


def _state_keys(base: torch.optim.Optimizer) -> list[str]:
    """The optimizer's per-parameter tensors (Adam: exp_avg, exp_avg_sq), its step aside."""
    for st in base.state.values():
        return sorted(k for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0)
    return []


def capture(engine: Any, frozen: bool = True) -> dict[str, Any]:
    """The engine's state dict: `model` (fp32 weights, the frozen parameters unless not
    `frozen`, buffers), `optim`, `engine`."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _check_boundary(engine)
    params = _named_params(engine)
    # Each full tensor goes to the host as it is gathered: on the device only one at a time.
    model: dict[str, Any] = {name: _on_host(safe_get_full_fp32_param(p)) for name, p in params}
    for group in _gathered(engine.zero_optimization_stage(), _frozen_params(engine) if frozen else []):
        model.update((name, _on_host(p.detach())) for name, p in group)
    for name, b in engine.module.named_buffers():
        model[name] = _on_host(b.detach())
    sd: dict[str, Any] = {"model": model}
    base = _base_optimizer(engine)
    if base is not None:
        _ensure_optimizer_state(engine, base)  # before the first step too: a restore loads into it
        keys = _state_keys(base)
        state = {name: {k: _on_host(safe_get_full_optimizer_state(p, k)) for k in keys} for name, p in params}
        steps = [st["step"] for st in base.state.values() if "step" in st]
        step = steps[0] if steps else 0
        sd["optim"] = {
            "state": state,
            "step": float(step.item()) if isinstance(step, torch.Tensor) else float(step),
            "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in base.param_groups]),
        }
    counters = {k: int(getattr(engine, k, 0)) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")}
    sd["engine"] = {"counters": json.dumps(counters)}
    if getattr(engine, "lr_scheduler", None) is not None and hasattr(engine.lr_scheduler, "state_dict"):
        sd["engine"]["lr_scheduler"] = engine.lr_scheduler.state_dict()
    return sd


GATHER_BYTES = 256 << 20  # ZeRO-3 parameters gathered at once by a restore, at most (bar one larger)


def _gather_groups(params: list[tuple[str, torch.nn.Parameter]]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """`params` in runs of at most GATHER_BYTES of full (gathered) parameters, in order."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    size = 0
    for name, p in params:
        n = int(getattr(p, "ds_numel", p.numel())) * p.element_size()
        if groups[-1] and size + n > GATHER_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += n
    return groups


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (never a view of the engine's own tensors)."""
    return t.to("cpu", copy=True)


class MidAccumulation(ValueError):
    """A save asked for between two micro-batches of one optimizer step."""

    def __init__(self, micro: int, accumulation: int) -> None:
        self.micro, self.accumulation = micro, accumulation
        super().__init__(
            f"a save in the middle of gradient accumulation (micro-batch {micro} of {accumulation}) would lose the "
            "gradients accumulated so far: call cp.step_done() once per optimizer step, after the engine.step() "
            "that ends the accumulation (engine.micro_steps % engine.gradient_accumulation_steps() == 0)"
        )


def _check_boundary(engine: Any) -> None:
    """A save between two micro-batches of one optimizer step would leave out the gradients
    accumulated so far, while the data position counts their samples as consumed: the
    resumed step would be built from the remaining micro-batches only."""
    if getattr(engine, "_is_gradient_accumulation_boundary", None) is not None:
        return  # the caller sets the boundaries itself
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    accumulation = engine.gradient_accumulation_steps()
    if managed and accumulation > 1 and engine.micro_steps % accumulation:
        raise MidAccumulation(engine.micro_steps % accumulation, accumulation)


def apply(engine: Any, sd: dict[str, Any]) -> None:
    """Put a restored state dict into the engine (a collective: every rank calls it)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    stage = engine.zero_optimization_stage()
    params = _named_params(engine)
    model = sd["model"]
    missing = [n for n, _ in params if n not in model]
    if missing:
        raise KeyError(f"Missing key in checkpoint state_dict: {missing[:5]}")
    base = _base_optimizer(engine)
    for name, p in params:
        safe_set_full_fp32_param(p, model[name])
    # The low-precision copies the forward uses, and the frozen parameters (those a
    # checkpoint of an earlier ckpt lacks were loaded with their current values).
    for group in _gathered(stage, params + _frozen_params(engine), modify=True):
        with torch.no_grad():
            for name, p in group:
                p.data.copy_(model[name].to(p.dtype))
    for name, b in engine.module.named_buffers():
        if name in model:
            b.data.copy_(model[name])
    if base is not None and "optim" in sd:
        optim = sd["optim"]
        _ensure_optimizer_state(engine, base)
        for name, p in params:
            for key, value in optim["state"][name].items():
                safe_set_full_optimizer_state(p, value, key)
        for st in base.state.values():
            if "step" in st:
                st["step"] = torch.tensor(optim["step"], dtype=st["step"].dtype) if isinstance(st["step"], torch.Tensor) else type(st["step"])(optim["step"])
        for live, saved in zip(base.param_groups, json.loads(optim["param_groups"]), strict=True):
            live.update(saved)
    counters = json.loads(sd["engine"]["counters"])
    for key, value in counters.items():
        if hasattr(engine, key):
            setattr(engine, key, value)
    # On another world size with the same global batch DeepSpeed accumulates over another
    # number of micro-batches: the next micro-batch starts an optimizer step, as it did.
    if hasattr(engine, "micro_steps"):
        engine.micro_steps = int(engine.global_steps) * engine.gradient_accumulation_steps()
    if "lr_scheduler" in sd["engine"]:
        engine.lr_scheduler.load_state_dict(sd["engine"]["lr_scheduler"])


def _ensure_optimizer_state(engine: Any, base: torch.optim.Optimizer) -> None:
    """A fresh engine's optimizer has no state before its first step (Adam creates its
    moments lazily), so there is nothing to scatter the saved state into: take one step of
    nothing (zero gradients, no learning rate, no weight decay), which creates the state and
    changes no weight, count it back to step 0 (the state is then what the first real step
    would have created), and have ZeRO link its partitions to it. ZeRO-3 hands its optimizer
    one sub-group's fp32 partition at a time, as its own step does."""
    if base.state:
        return
    zero3 = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if zero3 is not None:
        to_step = [(engine.optimizer.sub_group_to_group_id[i], [flat]) for i, flat in enumerate(zero3)]
    else:
        to_step = [(i, list(g["params"])) for i, g in enumerate(base.param_groups)]
    for group_id, params in to_step:
        group = base.param_groups[group_id]
        kept = (group["params"], group.get("lr"), group.get("weight_decay"), [p.grad for p in params])
        try:
            group["params"], group["lr"] = params, 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            for p in params:
                p.grad = torch.zeros_like(p)
            # Only this group steps: the others are emptied for the moment.
            others = [(g, g["params"]) for g in base.param_groups if g is not group]
            for g, _ in others:
                g["params"] = []
            try:
                base.step()
            finally:
                for g, ps in others:
                    g["params"] = ps
        finally:
            group["params"], group["lr"] = kept[0], kept[1]
            if kept[2] is not None:
                group["weight_decay"] = kept[2]
            for p, grad in zip(params, kept[3], strict=True):
                p.grad = grad
    for st in base.state.values():
        if "step" in st:
            st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], torch.Tensor) else 0
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO 1/2 (and DeepSpeed's BF16 optimizer)
        link()


def _plain(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False
