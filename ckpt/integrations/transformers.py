"""Hugging Face Transformers: the `Trainer`, checkpointed by ckpt.

    from ckpt.integrations.transformers import CkptTrainer

    trainer = CkptTrainer(model=model, args=args, train_dataset=data, ckpt_root="s3://bucket/run",
                          ckpt_options={"interval": ckpt.Every(steps=500)})
    trainer.train()            # resumes from the newest checkpoint under ckpt_root, if there is one

`CkptTrainer` is a `transformers.Trainer` whose checkpoints are ckpt's: a Checkpointer opened
once the Trainer has made and prepared the optimizer and scheduler, over the model as it is
wrapped, the optimizer, the scheduler, the gradient scaler, the Trainer's state (`TrainerState`: step, epoch, log
history) and each rank's RNG; a step per optimizer step. Set `save_strategy="no"` to leave the
Trainer's own folders out (ckpt's checkpoints do not need them).

The Trainer decides which batches to skip on a resume before anything is restored, from the
resume folder's step. So `train()` first finds the newest committed step under the root (rank 0
lists it, and tells the others), hands the Trainer a folder that says only that step, and has
ckpt restore exactly that step: the Trainer then skips the batches it trained, as on its own
resume, and gets its RNG back where it resumes. A checkpoint that fails to load fails the
restore here (`ckpt.RestoreFailed`), rather than fall back to an older step the Trainer would
not skip to: `ckpt_options={"restore": STEP}` resumes from another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState

from ckpt.capture.state import rng_state, set_rng_state
from ckpt.checkpointer import Checkpointer
from ckpt.storage import catalog
from ckpt.storage.store import Store

__all__ = ["CkptTrainer"]

_STATE = "trainer_state.json"  # the Trainer's name for it


class CkptTrainer(Trainer):
    """A `transformers.Trainer` checkpointed by ckpt (see the module)."""

    def __init__(self, *args: Any, ckpt_root: str = "./checkpoints", ckpt_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckpt_root = ckpt_root
        self.ckpt_options = dict(ckpt_options or {})
        self.cp: Checkpointer | None = None
        self._resume_step: int | None = None
        self._rng: dict[str, Any] | None = None
        self._steps = _Steps(self)

    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint is not None:
            raise ValueError("CkptTrainer resumes from ckpt_root by itself: leave resume_from_checkpoint out (ckpt_options={'restore': STEP} picks a step)")
        restore = self.ckpt_options.get("restore", "latest")
        step = restore if isinstance(restore, int) else None if restore == "none" else self._newest_step()
        with tempfile.TemporaryDirectory(prefix="ckpt-resume-") as folder:
            if step is not None:
                # All the Trainer reads of a resume folder: which step it resumes at.
                state = TrainerState(global_step=step, train_batch_size=self._train_batch_size)
                state.save_to_json(os.path.join(folder, _STATE))
                self._resume_step = step
            try:
                return super().train(resume_from_checkpoint=folder if step is not None else None, **kwargs)
            finally:
                cp, self.cp = self.cp, None
                if cp is not None:
                    cp.__exit__(*sys.exc_info())

    def _newest_step(self) -> int | None:
        """The newest committed step under the root, as rank 0 finds it, on every rank."""
        found: list[int | None] = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            store = Store(self.ckpt_root, storage_options=self.ckpt_options.get("storage_options"))
            committed = [e.step for e in catalog.scan(store) if e.state == catalog.COMMITTED]
            found = [max(committed) if committed else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    # The Trainer's own loading, replaced: ckpt restores after the optimizer is made.
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        pass

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._open()

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass  # ckpt restores the scaler with the rest (`_open`)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._rng is not None:  # as restored: the Trainer drew random numbers since
            set_rng_state(self._rng)
            self._rng = None

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        got = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._open()  # a fresh start: nothing was restored above
        return got

    def _open(self) -> None:
        if self.cp is not None:
            return
        options = {k: v for k, v in self.ckpt_options.items() if k != "restore"}
        restore = self._resume_step if self._resume_step is not None else "latest"  # none there: a fresh start
        self.cp = Checkpointer(
            self.ckpt_root,
            model=self.model_wrapped,
            optimizer=getattr(self.optimizer, "optimizer", self.optimizer),
            scheduler=self.lr_scheduler,
            scaler=getattr(self.accelerator, "scaler", None),  # fp16's GradScaler, where there is one
            extra={"trainer_state": _State(self)},
            restore=restore,
            **options,
        )
        self.cp.__enter__()
        self._rng = rng_state()
        # ckpt's step last among the callbacks (the restore may have made the others anew):
        # what the others do at a step's end is in the save taken there.
        if self._steps in self.callback_handler.callbacks:
            self.callback_handler.remove_callback(self._steps)
        self.callback_handler.add_callback(self._steps)


class _State:
    """The Trainer's `TrainerState` (equal on every rank)."""

    def __init__(self, trainer: CkptTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self.trainer.state)
        # The callbacks' states (`ExportableState`: EarlyStoppingCallback's patience, the
        # TrainerControl) as the Trainer's own save records them.
        callbacks: dict[str, Any] = {}
        for cb in [*self.trainer.callback_handler.callbacks, self.trainer.control]:
            if isinstance(cb, ExportableState):
                callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        fields["stateful_callbacks"] = callbacks
        return {"json": json.dumps(fields, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in json.loads(state["json"]).items():
            if hasattr(self.trainer.state, name):
                setattr(self.trainer.state, name, value)
        if self.trainer.state.stateful_callbacks:
            self.trainer._load_callback_state()  # as the Trainer's own resume does


class _Steps(TrainerCallback):
    """A ckpt step at each optimizer step."""

    def __init__(self, trainer: CkptTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.cp is not None:
            self.trainer.cp.step_done()

