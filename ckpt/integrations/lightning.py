"""PyTorch Lightning: ckpt as one callback.

    import lightning as L
    from ckpt.integrations.lightning import Checkpointing

    trainer = L.Trainer(max_steps=10_000, callbacks=[Checkpointing("s3://bucket/run")])
    trainer.fit(model, datamodule)     # restores the newest checkpoint first, if there is one

`Checkpointing(root, **options)` takes the `ckpt.Checkpointer` options (interval, keep,
storage_options, spool, signing_key, ...). When the fit starts (the strategy has wrapped the
model and made the optimizers) it opens a Checkpointer over everything the run's progress
depends on:

- the model as the strategy holds it (plain, DDP, FSDP), its optimizers, LR schedulers and
  the precision plugin's state (a GradScaler's);
- the trainer's progress: the fit loop (epoch, batches, optimizer steps), the state of the
  other callbacks and of the datamodule; equal on every rank, saved once;
- each rank's RNG, and each rank's data loader position where the loader has one (torchdata's
  `StatefulDataLoader`: Lightning keeps its place, and a resume continues mid-epoch exactly),
  restored on the same world size.

It restores the newest committed checkpoint then (as `restore=` says), and counts a step at
each optimizer step (`trainer.global_step`), where the interval decides whether to save: at the
batch's end, or where Lightning validates or ends its epoch after that batch, once that is done
(after the validation; as the next epoch starts), so that a restart neither skips nor repeats it.
Leaving the fit takes a final save, at the fit's last batch. A SIGTERM (a preemption, torchrun or
Kubernetes stopping the job), on any rank, is ckpt's (Lightning's own handler would stop that
rank alone): the ranks agree on a step, save it, wait for the commit and exit with status 143. Lightning's own `ModelCheckpoint` can stay or go: the two do not share files.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback

from ckpt.capture.state import rng_state, set_rng_state
from ckpt.checkpointer import Checkpointer
from ckpt.data import own_generator

log = logging.getLogger(__name__)

__all__ = ["Checkpointing"]


class Checkpointing(Callback):
    """Saves and restores a Lightning fit with ckpt (see the module)."""

    def __init__(self, root: str = "./checkpoints", **options: Any) -> None:
        self.root = root
        self.options = options
        self.cp: Checkpointer | None = None
        self._step = 0
        self._rng: dict[str, Any] | None = None
        self._loaders: _Loaders | None = None
        self._sigterm: Any = None
        self._pending = ""  # a step whose count waits for the validation or epoch end after it

    @property
    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (during a fit): its step, `last_commit`, metrics."""
        if self.cp is None:
            raise RuntimeError("ckpt's Checkpointing callback is open only while trainer.fit runs")
        return self.cp

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._loaders = _Loaders(trainer)
        self.cp = Checkpointer(
            self.root,
            model=trainer.strategy.model,
            optimizer=list(trainer.optimizers) or None,
            scheduler=[c.scheduler for c in trainer.lr_scheduler_configs] or None,
            scaler=scaler,
            extra={"lightning": _Progress(trainer, self)},
            dataloader=self._loaders,
            **self.options,
        )
        self.cp.__enter__()
        self._rng = rng_state()  # put back at train start
        self._sigterm = signal.getsignal(signal.SIGTERM)  # ckpt's: taken back at train start
        self._step = trainer.global_step
        if self.cp.step != self._step:  # the fit loop's count and ckpt's went apart: say so
            log.warning("resumed at ckpt step %d where Lightning's global_step is %d", self.cp.step, self._step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The training loaders exist now. A loader that draws its workers' base seed, or whose
        # shuffling sampler draws its epoch's seed, from torch's global generator draws at the
        # resumed run's first batch where the original run drew at the epoch's start: every
        # random number after (dropout) would differ. Each gets generators of its own (ckpt
        # does so for `dataloader=`); a StatefulDataLoader's state carries its sampler's.
        fit = trainer.fit_loop
        loaders = fit._combined_loader.flattened if fit._combined_loader is not None else []
        for loader in loaders:
            own_generator(loader)
            why = _unreplayable(loader)
            if why:
                log.warning("the training loader %s: a run resumed mid-epoch will not see the batches the original run would", why)
        restored = self._loaders.restored if self._loaders is not None else None
        if restored is not None and fit._data_fetcher is not None:
            # Lightning made the resumed epoch's iterator before it set the samplers' epoch: a
            # DistributedSampler would have shuffled as in epoch 0, and the loader taken up its
            # place in that order. Made again here, with the epoch set: mid-epoch from the
            # loaders' states; after a save at an epoch's last batch (Lightning counts that
            # epoch done on the restart) fresh, for the next epoch.
            for loader in loaders:
                _set_sampler_epoch(loader, fit.epoch_progress.current.processed)
            if fit.restarted_mid_epoch and not fit.epoch_loop.batch_progress.is_last_batch:
                fit._combined_loader._load_state_dicts(restored)
            iter(fit._data_fetcher)
            self._loaders.restored = None
        if fit.restarted_on_epoch_start and fit.epoch_loop.batch_progress.current.ready == 0:
            # Saved as an epoch started (`_epoch_started`): its batches begin as in a run that
            # never stopped. Lightning's restart of the batch loop would take a turn without a
            # batch first, and count it for the loggers.
            fit.epoch_loop.restarting = False
            fit.epoch_loop.reset_restart_stage()
        # Lightning draws random numbers between the restore and here (setting up the loop and
        # the loaders, the iterator above): the original run drew them before its first step,
        # the resumed one after the restore. The restored state is put back.
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
        # Lightning installs its own SIGTERM handler meanwhile, which on a rank other than 0
        # broadcasts from inside the handler and stops that rank alone: a job of which one node
        # is preempted hangs. ckpt's handler takes it back: the ranks agree on a step (as in any
        # loop), save it, and all exit with 143.
        if callable(self._sigterm):
            signal.signal(signal.SIGTERM, self._sigterm)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.cp is None or trainer.global_step == self._step:  # no optimizer step was taken
            return
        self._step = trainer.global_step
        if _last_batch(trainer):
            # Here, not when the fit ends: by then Lightning counts the epoch done, and a run
            # resumed with more steps would start the next epoch early.
            self.cp.step_done()
            if self.cp.save_on_exit:
                self.cp.save()
        elif _validates(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Lightning validates after this batch, or ends the epoch (its hooks, epoch-interval
            # LR schedules): a restart from a save here would skip that. The step is counted
            # (and saved, if due) once it is done: after the validation, or as the next epoch
            # starts.
            self._pending = "epoch" if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch else "validation"
        else:
            self.cp.step_done()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending == "validation" and self.cp is not None:
            self._pending = ""
            self.cp.step_done()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Last at each hook (what the other callbacks do at a batch's or a validation's end is
        # in the save), and a helper first at an epoch's start (a save there holds nothing of
        # the new epoch). A new list: Lightning is iterating over the one it has.
        if stage == "fit":
            others = [cb for cb in trainer.callbacks if cb is not self and not isinstance(cb, _EpochStart)]
            trainer.callbacks = [_EpochStart(self), *others, self]

    def _epoch_started(self, trainer: pl.Trainer) -> None:
        """The next epoch starts (nothing of it has happened yet): a step counted at the
        previous epoch's last batch is done, with all of its epoch's end."""
        if not self._pending or self.cp is None:
            return
        self._pending = ""
        # What Lightning does to the batch loop's counters as the epoch's batches begin, done
        # first: a restart from here starts the epoch's batches, not the last one's end.
        loop = trainer.fit_loop.epoch_loop
        loop.batch_progress.reset_on_run()
        loop.scheduler_progress.reset_on_run()
        loop.automatic_optimization.optim_progress.reset_on_run()
        loop.val_loop.batch_progress.total.reset()
        self.cp.step_done()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending and self.cp is not None:
            # The fit stopped where the next epoch would have counted it (EarlyStopping at an
            # epoch's end, max_time, should_stop): counted now, and saved as the fit is left.
            self._pending = ""
            self.cp.step_done()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exception: BaseException | None) -> None:
        cp, self.cp = self.cp, None
        if cp is not None:
            cp.__exit__(type(exception) if exception else None, exception, exception.__traceback__ if exception else None)


class _EpochStart(Callback):
    """The first callback at an epoch's start (`Checkpointing.setup`)."""

    def __init__(self, own: Checkpointing) -> None:
        self.own = own

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.own._epoch_started(trainer)


def _last_batch(trainer: pl.Trainer) -> bool:
    """Whether the fit stops after this batch (max_steps, or max_epochs' last batch)."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs
    return epochs not in (None, -1) and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and trainer.current_epoch + 1 >= epochs


def _validates(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates after the batch that just ended."""
    loop = trainer.fit_loop
    return loop._data_fetcher is not None and loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


def _unreplayable(loader: Any) -> str:
    """Why `loader`'s order cannot be replayed from a checkpoint, or ""."""
    if not hasattr(loader, "state_dict"):
        return "has no position to save (torchdata's StatefulDataLoader has)"
    batches = getattr(loader, "batch_sampler", None)
    samplers = (getattr(loader, "sampler", None), getattr(batches, "sampler", None))
    if any(type(s) is torch.utils.data.RandomSampler and s.generator is None for s in samplers):
        return "shuffles with torch's RandomSampler, which draws each epoch's order from the global RNG (StatefulDataLoader(shuffle=True) keeps it)"
    return ""


class _Progress:
    """The trainer's progress, equal on every rank: the fit loop without its data loaders'
    states (those are per rank: `_Loaders`), the precision plugin, the other callbacks and the
    datamodule."""

    def __init__(self, trainer: pl.Trainer, own: Callback) -> None:
        self.trainer = trainer
        self.own = own

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        loop = t.fit_loop.state_dict()
        loop.get("state_dict", {}).pop("combined_loader", None)
        callbacks = {str(cb.state_key): cb.state_dict() for cb in t.callbacks if cb is not self.own and not isinstance(cb, _EpochStart)}
        datamodule = t.datamodule.state_dict() if t.datamodule is not None else {}
        return {"fit_loop": loop, "precision": t.precision_plugin.state_dict(), "callbacks": callbacks, "datamodule": datamodule}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.fit_loop.load_state_dict(state["fit_loop"])
        t.precision_plugin.load_state_dict(state["precision"])
        for cb in t.callbacks:
            if cb is not self.own and str(cb.state_key) in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][str(cb.state_key)])
        if t.datamodule is not None and state["datamodule"]:
            t.datamodule.load_state_dict(state["datamodule"])


class _Loaders:
    """This rank's training data loaders' states, as Lightning's fit loop keeps them (those of
    loaders that have one): read at each save, handed to the fit loop at a restore, which
    gives them to the loaders it makes next."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.restored: list[dict[str, Any]] | None = None  # kept for `Checkpointing.on_train_start`

    def state_dict(self) -> dict[str, Any]:
        combined = self.trainer.fit_loop._combined_loader
        return {"combined_loader": combined._state_dicts() if combined is not None else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop._combined_loader_states_to_load = list(state["combined_loader"])
        self.restored = list(state["combined_loader"])
