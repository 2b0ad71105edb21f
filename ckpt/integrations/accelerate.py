"""Hugging Face Accelerate: a ckpt Checkpointer over what `accelerator.prepare` wrapped.

    from ckpt.integrations.accelerate import checkpointer

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True))
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    with checkpointer(accelerator, "s3://bucket/run", dataloader=loader) as cp:
        while cp.step < total_steps:
            for batch in loader:            # a resumed run starts at the batch it stopped at
                ...
                accelerator.backward(loss); opt.step(); sched.step(); opt.zero_grad()
                cp.step_done()

`checkpointer(accelerator, root, dataloader=None, extra=None, **options)` returns a
`ckpt.Checkpointer` (`options`: its options) over the prepared model (as Accelerate wraps it:
plain or DDP), the optimizers and LR schedulers under Accelerate's wrappers, the gradient
scaler, and the objects registered with `accelerator.register_for_checkpointing` (with
`extra`, yours). `dataloader`: a prepared loader whose position is saved per rank (it must be prepared with
`use_stateful_dataloader=True`): the batch it is at and the epoch it is in, so that a run
killed mid-epoch resumes at its next batch. In the same order if the order is a function of the
epoch: `use_seedable_sampler=True` for a shuffled loader (ckpt warns without it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ckpt.checkpointer import Checkpointer
from ckpt.data import own_generator

log = logging.getLogger(__name__)

__all__ = ["checkpointer"]


def checkpointer(accelerator: Any, root: str = "./checkpoints", *, dataloader: Any = None, extra: dict[str, Any] | None = None, **options: Any) -> Checkpointer:
    """A Checkpointer over what `accelerator.prepare` wrapped (see the module)."""
    # The models passed in extra= (as the error below asks) are saved there, not as `model`.
    # (Accelerate keeps some models unwrapped in `_models`, and returns them DDP-wrapped.)
    given = {id(o) for v in (extra or {}).values() for o in (v, getattr(v, "module", v))}
    models = [m for m in accelerator._models if id(m) not in given]
    if len(models) != 1:
        raise ValueError(
            f"ckpt saves one model per Checkpointer; this accelerator prepared {len(accelerator._models)}"
            f"{f' ({len(models)} not in extra=)' if extra else ''}: pass all but one in extra="
        )
    objects = {f"accelerate_{i}": obj for i, obj in enumerate(accelerator._custom_objects)}
    objects.update(extra or {})
    position = None
    if dataloader is not None:
        if not (hasattr(dataloader, "state_dict") and getattr(dataloader, "use_stateful_dataloader", False)):
            raise TypeError(
                "this loader has no position to save: prepare it with "
                "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))"
            )
        own_generator(getattr(dataloader, "base_dataloader", dataloader))  # the shard delegates to it
        config = getattr(accelerator, "dataloader_config", None)
        samplers = (getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None), "sampler", None))
        if any(isinstance(s, torch.utils.data.RandomSampler) for s in samplers) and not getattr(config, "use_seedable_sampler", False):
            log.warning(
                "the loader shuffles with a RandomSampler that draws each epoch's order from its generator as "
                "it goes: a run resumed after its first epoch takes another order. "
                "DataLoaderConfiguration(use_seedable_sampler=True) makes the order a function of the epoch"
            )
        position = _Position(dataloader)
    # An optimizer over another model's parameters cannot go through the model's DCP state
    # dict (DCP fails with a KeyError at the first save), and as an extra= object its lazily
    # made state (momentum, Adam's moments) would not be restored: refused here, by name.
    own = {id(q) for q in models[0].parameters()}
    optimizers = [getattr(o, "optimizer", o) for o in accelerator._optimizers]
    for i, inner in enumerate(optimizers):
        if not all(id(q) in own for g in inner.param_groups for q in g["params"]):
            raise ValueError(
                f"optimizer {i} ({type(inner).__name__}) updates parameters of a model other than the one ckpt saves as "
                "`model`, which checkpointer() does not support: one Checkpointer saves one model and its optimizers (build ckpt.Checkpointer yourself, with the other model and its optimizer in extra= wrapped so that their state exists before the restore)"
            )
    return Checkpointer(
        root,
        model=models[0],
        optimizer=optimizers or None,
        scheduler=[getattr(s, "scheduler", s) for s in accelerator._schedulers] or None,
        scaler=accelerator.scaler,
        extra=objects or None,
        dataloader=position,
        **options,
    )


class _Position:
    """A prepared loader's place, per rank: the torchdata loader's own state (the batch it is
    at) and Accelerate's count of the epochs it went through (which seeds each epoch's order)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state, epoch = self.loader.state_dict(), int(self.loader.iteration)
        if state.get("_iterator_finished") or state.get("_num_yielded", 0) >= len(self.loader):
            # Saved after the epoch's last batch (Accelerate counts the epoch done only when
            # the loop over it ends): a resume starts the next epoch, from its first batch.
            return {"loader": None, "epoch": epoch + 1}
        return {"loader": state, "epoch": epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["loader"] is not None:
            self.loader.load_state_dict(state["loader"])
        self.loader.iteration = state["epoch"]
