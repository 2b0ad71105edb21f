"""An optimizer's state created for a restore to load into, without a step.

A restore loads into a template of the training state, and an optimizer that has taken no
step has no state to load into. DCP's state-dict API makes it by taking a step with zero
gradients and a zero learning rate (`_init_optim_state`): the optimizer's whole update,
once, in a fresh process. That costs what a step costs the first time: with FSDP2's DTensor
parameters and the foreach update (torch's default on GPUs) DTensor works out the sharding
of every foreach op anew, measured at 1.2 s for 200 parameters on CPU (the same update a
second time: 0.02 s), and 0.2 s with the single-tensor update; it grows with the parameters,
as a 70B model's 720 do.

The optimizers of torch that make their state in `_init_group` (their lazy initialisation,
which every step runs before its update) have it made here by that very method and no
update: the same entries, shapes, dtypes, devices and layouts as the step makes, with the
counters not yet advanced. Their values do not matter: the restore overwrites every one it
finds in the checkpoint, and drops the state of the parameters the checkpoint has none for.
Only the classes listed, and their subclasses whose `step` and `_init_group` are the listed
class's own (a subclass with its own `step` may make more state there); and only while their
step is theirs alone: a step hook (the optimizer's or torch's global ones) or a
`step` replaced on the object may keep state of its own in `optimizer.state` (an EMA of the
weights), which the template must ask for or the restore leaves it out. Any other
optimizer, and any that already has state or gradients, is left to DCP's step as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator

import torch
from torch.optim import optimizer as torch_optimizer

log = logging.getLogger(__name__)

# The classes whose `_init_group(group, *lists)` makes every state entry their step would
# (Adagrad makes its state in its constructor, SGD its momentum in the update: not here).
_MADE_BY_INIT_GROUP = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
)  # fmt: skip


def init_state(optimizer: torch.optim.Optimizer) -> bool:
    """Make `optimizer`'s state as its first step would, without the step; False (and the
    optimizer as it was) where this cannot be done: DCP then takes its step, as before."""
    if optimizer.state or not _steps_as_listed(type(optimizer)) or _step_does_more(optimizer):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):  # DCP makes no state then either
        return False
    try:
        lists = len(inspect.signature(optimizer._init_group).parameters) - 1  # after the group
    except (AttributeError, TypeError, ValueError):
        return False
    trained = [p for p in params if p.requires_grad]
    try:
        with torch.no_grad():
            for p in trained:
                # Looked at, never read: its shape, dtype and device pick the state's.
                p.grad = torch.empty_like(p)
            for group in optimizer.param_groups:
                optimizer._init_group(group, *([] for _ in range(lists)))
        # IMPORTANT: the step would have given every trained parameter state; else DCP's way.
        made = all(optimizer.state.get(p) for p in trained)
    except Exception as e:  # a torch whose _init_group differs: DCP's step still works
        log.debug("optimizer state made by a step (%s: %s)", type(e).__name__, e)
        made = False
    finally:
        for p in trained:
            p.grad = None
    if not made:
        optimizer.state.clear()
    return made


@contextlib.contextmanager
def saved_without_state(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """A save of optimizers of which some have no state `init_state` could make (another
    class, a step of its own, SGD): those are saved with none, and no step is taken on them.
    DCP's state-dict API would take its step of zeros on the live optimizer, and the training
    would keep what it left: a count one ahead, SGD's momentum with dampening, parameters
    moved by an update that does not scale with the learning rate (Adafactor's relative step
    with weight decay), a step hook's work (an EMA). It takes none where a parameter has a
    gradient, so the smallest trained parameter of each gets an empty one for the while. A
    restore of the checkpoint leaves those optimizers with no state, as the run had
    (`SafeLoadPlanner.stateless`, by parameter name): their first step then makes it. A plain
    DCP reader finds no state for them (its own objects take DCP's step and ask for it)."""
    lent = []
    try:
        for opt in optimizers:
            if opt.state:  # a save after a step: nothing to do
                continue
            params = [p for group in opt.param_groups for p in group["params"]]
            trained = [p for p in params if p.requires_grad]
            if not trained or any(p.grad is not None for p in params):
                continue
            smallest = min(trained, key=lambda p: p.numel())
            with torch.no_grad():
                smallest.grad = torch.empty_like(smallest)  # looked at, never read
            lent.append(smallest)
        yield
    finally:
        for p in lent:
            p.grad = None


def _steps_as_listed(cls: type) -> bool:
    """Whether `cls` is one of the listed classes, or a subclass whose `step` and `_init_group`
    are that class's own (one that sets other defaults, say): its state is made as theirs."""
    base = next((b for b in cls.__mro__ if b in _MADE_BY_INIT_GROUP), None)
    return base is not None and all(getattr(cls, name, None) is getattr(base, name) for name in ("step", "_init_group"))


def keeps_no_state(hook: Callable[..., None]) -> Callable[..., None]:
    """Marks a step hook as one that keeps no optimizer state (the Checkpointer's own, which
    waits for the staging copies): with it an optimizer's state is still made here."""
    hook._ckpt_keeps_no_state = True  # type: ignore[attr-defined]
    return hook


def _step_does_more(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of `optimizer` runs more than its class's code: hooks (but those marked
    `keeps_no_state`), or a `step` set on the object other than an LR scheduler's wrapper
    (which only marks that the step ran)."""
    hooks = [*getattr(optimizer, "_optimizer_step_pre_hooks", {}).values(), *getattr(optimizer, "_optimizer_step_post_hooks", {}).values()]
    if any(not getattr(hook, "_ckpt_keeps_no_state", False) for hook in hooks):
        return True
    if getattr(torch_optimizer, "_global_optimizer_pre_hooks", None) or getattr(torch_optimizer, "_global_optimizer_post_hooks", None):
        return True
    step = vars(optimizer).get("step")
    return step is not None and getattr(step, "__wrapped__", None) is not type(optimizer).step
