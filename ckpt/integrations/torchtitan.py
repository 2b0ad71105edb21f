"""torchtitan: ckpt as the job's checkpoint manager, in torchtitan's own layout.

    from ckpt.integrations.torchtitan import CheckpointManager

    config.checkpoint = CheckpointManager.Config(enable=True, interval=500, root="s3://bucket/run")
    # or, with ckpt choosing the interval from the failure rate and the measured save cost:
    config.checkpoint = CheckpointManager.Config(enable=True, root="s3://bucket/run", options={"interval": "auto"})

torchtitan's `Trainer` builds its checkpoint manager from `config.checkpoint` and calls
`load()` before the first step, `save(step, last_step)` after each, `maybe_wait_for_staging()`
before the optimizer changes what a save is copying, and `close()` at the end. This manager
does the same with a `ckpt.Checkpointer` under it: asynchronous saves committed atomically with
checksums (S3 and any fsspec root), per-rank RNG, the interval from `interval` steps (or
ckpt's, `options={"interval": "auto"}`), a SIGTERM saved and left with 143, retention
(`keep_latest_k`), the node agent and metrics (`options`: any other `Checkpointer` option).

What it saves is what torchtitan's own manager saves, under the same keys (`app_state`): the
model's keys at the top level (`tok_embeddings.weight`, ...), `optimizer` (torchtitan's
flattened optimizer state), `lr_scheduler`, `dataloader` (each data-parallel rank's position)
and `train_state` (the step, tokens seen). So each tool reads the other's checkpoints:

- torchtitan reads a ckpt step directory as its own (it is plain DCP):
  `initial_load_path=<root>/step-0000000500` with `initial_load_model_only=False`;
- this manager reads a torchtitan step folder (`initial_load_path=<folder>/step-500`) when its
  root holds no checkpoint yet, model only (`initial_load_model_only`, torchtitan's default) or
  everything but `exclude_from_loading`. Such a folder has no manifest, so nothing is verified
  by checksum; it is read as ckpt reads anything: `.metadata` through the allowlist
  unpickler, values with `torch.load(weights_only=True)`, and the data loader's position (a
  pickle in torchtitan's layout) only if it is plain values.

A restart finds the newest committed step in the root (`load_step` for another); the data
loader's position is restored on the same number of data-parallel ranks, as torchtitan's own.
`last_save_model_only` is not followed: ckpt's last save is a full one, resumable (export the
model with `ckpt export --model-only`). HF safetensors (`last_save_in_hf`, `initial_load_in_hf`)
are torchtitan's: use its manager for those.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import (
    DATALOADER,
    MODEL,
    BaseCheckpointManager,
    ModelWrapper,
)

from ckpt.checkpointer import Checkpointer
from ckpt.data import own_generator
from ckpt.format.bytes_item import load_plain_pickle, load_value
from ckpt.format.dcp_metadata import load_metadata
from ckpt.format.manifest import METADATA_NAME
from ckpt.schedule.policy import Every, Keep

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, with ckpt under it (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        root: str = ""
        """Where checkpoints go: a directory or any fsspec URL (s3://...). Default: `folder`
        under the job's dump folder, as torchtitan's."""

        options: dict[str, Any] = field(default_factory=dict)
        """More `ckpt.Checkpointer` options (interval="auto", storage_options, spool,
        signing_key, metrics_port, ...)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        self.config = config
        self.app = _TitanState(model_parts, optimizers, lr_schedulers, dataloader, states, config.exclude_from_loading)
        self.root = config.root or os.path.join(base_folder, config.folder)
        options: dict[str, Any] = {
            "interval": None if config.load_only else Every(steps=config.interval),
            "keep": Keep(last=config.keep_latest_k or 2**31),
            "restore": "latest" if config.load_step == -1 else config.load_step,
            "save_on_exit": not config.load_only,
        }
        options.update(config.options)
        self.cp = Checkpointer(self.root, app_state=self.app, **options)
        # Each `iter(loader)` draws its workers' base seed from torch's global generator unless
        # the loader has one: a resumed run makes its iterator after the restore, the original
        # before its first step, and every random number after (dropout) would differ.
        self.cp.state.loader_generator = own_generator(dataloader)
        self._open = False

    @property
    def checkpointer(self) -> Checkpointer:
        """The ckpt Checkpointer under this manager: its step, `last_commit`, metrics."""
        return self.cp

    def _enter(self) -> None:
        if not self._open:
            self._open = True
            self.cp.__enter__()

    def _load(self, step: int = -1) -> bool:
        if step != -1 and step != self.cp.restore_mode:
            raise ValueError(f"load(step={step}): give checkpoint.load_step={step} in the config (ckpt restores as it opens)")
        self._enter()
        if self.cp.restored_step is not None:
            return True
        if not self.config.initial_load_path:
            return False
        if self.config.initial_load_in_hf:
            raise ValueError("initial_load_in_hf is torchtitan's own: use its CheckpointManager for a Hugging Face start")
        self._initial_load(self.config.initial_load_path, self.config.initial_load_model_only)
        return True

    def _initial_load(self, path: str, model_only: bool) -> None:
        """Load a torchtitan (or any plain DCP) step folder into the job, as torchtitan's
        `initial_load_path` does, through ckpt's safe readers."""
        if model_only:
            states = self.app.model.state_dict()
        else:
            states = self.app.state_dict()
            for key in self.app.excluded:
                states.pop(key, None)
            held = _reader(path).read_metadata().state_dict_metadata
            if DATALOADER in states and not _loader_held(held, self.app.states[DATALOADER], states[DATALOADER]):
                # IMPORTANT: decided alike on every rank (from the folder's keys and the job's
                # world size), or some ranks would load and others not, and wait apart.
                log.warning("%s holds no data loader position for this job's data-parallel ranks: the data starts over", path)
                del states[DATALOADER]
        log.info("loading %s from %s (not ckpt's: no checksums to verify)", "the model" if model_only else "the state", path)
        dcp.load(states, storage_reader=_reader(path), planner=_SafePlanner())
        if model_only:
            self.app.model.load_state_dict(states)
            return
        self.app.load_state_dict(states)
        done = getattr(self.app.states.get("train_state"), "step", None)
        if isinstance(done, int) and done > 0:
            self.cp._count_from(done)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._open:  # a loop that never called load(): nothing of the root goes into it now
            log.warning("save() before load(): ckpt restores nothing into this run (call load() first to resume)")
            self.cp.restore_mode = "none"
            self._enter()
        before = self.cp._saved_step
        if self.cp.step != curr_step - 1:  # the trainer's count is the one torchtitan saves
            log.warning("torchtitan is at step %d where ckpt counted %d: ckpt counts from torchtitan's", curr_step - 1, self.cp.step)
            self.cp._count_from(curr_step - 1)
        self.cp.step_done()
        if last_step and self.cp.save_on_exit:
            self.cp.save()
        return self.cp._saved_step != before

    def _maybe_wait_for_staging(self) -> None:
        if self._open:
            self.cp.wait_for_staging()

    def maybe_wait_for_saving(self) -> None:
        """Block until the last save committed (ckpt's saves have no `save_future`)."""
        if self.enable and self._open:
            self.cp.wait()

    def _wait_for_saving(self) -> None:
        self.cp.wait()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.cp.__exit__(*sys.exc_info())  # in an exception's handling: no save of that state


class _TitanState:
    """torchtitan's state as its own manager lays it out (`app_state`)."""

    def __init__(self, model_parts: list[torch.nn.Module], optimizers: Any, lr_schedulers: Any, dataloader: Any, states: dict[str, Any], excluded: list[str]) -> None:
        self.model = ModelWrapper(model_parts)
        self.states: dict[str, Any] = {"optimizer": optimizers, "lr_scheduler": lr_schedulers, **states}
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self.states = {k: v for k, v in self.states.items() if v is not None}
        unknown = sorted(set(excluded) - set(self.states))
        if MODEL in excluded or unknown:
            raise ValueError(f"exclude_from_loading: {sorted(excluded)} must name states other than the model ({sorted(self.states)})")
        self.excluded = tuple(excluded)

    def state_dict(self) -> dict[str, Any]:
        return {**self.model.state_dict(), **{k: v.state_dict() for k, v in self.states.items()}}

    def skip_on_restore(self, same_world: bool) -> tuple[str, ...]:
        """The keys a restore leaves out: `exclude_from_loading`, and on another world size
        the data loader's position (torchtitan's loader cannot take another rank count's)."""
        return self.excluded + (() if same_world or DATALOADER not in self.states else (DATALOADER,))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict({k: v for k, v in sd.items() if k not in self.states})
        for key, obj in self.states.items():
            if key in self.excluded:
                continue
            if key not in sd:
                log.warning("%s is not restored: not in the checkpoint, or saved on another number of ranks", key)
            elif key == DATALOADER:
                _load_loader(obj, sd[key])
            else:
                obj.load_state_dict(sd[key])


def _loader_held(held: Any, loader: Any, template: dict[str, Any]) -> bool:
    """Whether a folder whose keys are `held` has the data loader positions of this job: for
    torchtitan's loader, one per data-parallel rank of this job's world (the same answer on
    every rank); for another, the keys this rank's state asks for."""
    world = getattr(loader, "dp_world_size", None)
    if isinstance(world, int):
        saved = {k for k in held if k.startswith(f"{DATALOADER}.dp_rank_")}
        return saved == {f"{DATALOADER}.dp_rank_{r}" for r in range(world)}
    return all(f"{DATALOADER}.{k}" in held for k in template)


def _load_loader(loader: Any, state: dict[str, Any]) -> None:
    """torchtitan's data loader state: its rank's entry is a pickle of the StatefulDataLoader's
    state, which is unpickled here as plain values (never through `pickle.loads`)."""
    rank_id = getattr(loader, "_rank_id", None)
    if not isinstance(loader, StatefulDataLoader) or rank_id is None:
        loader.load_state_dict(state)
        return
    blob = state.get(rank_id)
    if blob is None:
        log.warning("the data loader's position for %s is not in the checkpoint: it starts over", rank_id)
        return
    if state.get("world_size") != loader.dp_world_size:
        raise ValueError(f"the checkpoint's data loader state is of {state.get('world_size')} data-parallel ranks, this job has {loader.dp_world_size}")
    StatefulDataLoader.load_state_dict(loader, load_plain_pickle(blob, "the data loader's state"))


def _reader(path: str) -> FileSystemReader:
    """DCP's reader of `path` (a directory or an fsspec URL), its `.metadata` read through
    ckpt's allowlist unpickler."""
    if "://" in path:
        from torch.distributed.checkpoint import FsspecReader  # noqa: PLC0415

        return type("_SafeFsspecReader", (_Safe, FsspecReader), {})(path)
    return type("_SafeReader", (_Safe, FileSystemReader), {})(path)


class _Safe:
    """`read_metadata` through ckpt's allowlist unpickler (mixed into DCP's readers)."""

    fs: Any
    path: Any
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_NAME), "rb") as f:
            md = load_metadata(f.read(), f"{self.path}/{METADATA_NAME}")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with values loaded as `torch.load(weights_only=True)` loads them."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

        got = load_value(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], got)
        else:
            self.state_dict[read_item.dest_index.fqn] = got
