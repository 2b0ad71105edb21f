"""A torchtitan training loop with ckpt's checkpoint manager (or torchtitan's own), one process
per rank (tests/integrations/test_torchtitan.py).

    torchtitan_worker.py --root ROOT --out OUT --steps N [--every K] [--die-at STEP]
        [--manager ckpt|torchtitan] [--initial PATH [--model-only]] [--dump-at STEP]

torchtitan's Trainer needs CUDA; this is its loop on CPU (`Trainer.train`: load, then per step
forward, backward, `maybe_wait_for_staging`, the optimizer and LR steps, `save(step,
last_step)`, and `close`), over torchtitan's own parts: the model (a small MLP with dropout
built from a config, FSDP2 over gloo), `OptimizersContainer` (AdamW), `LRSchedulersContainer`
(warmup then linear decay), `ParallelAwareDataloader` over a stateful stream of random
samples, and a train state of the step and the tokens seen. The checkpoint manager is built
from its config as the Trainer builds it.

--evil-loader: the data loader's state is a pickle that runs code when loaded. --die-at: SIGKILL after that step, once the last save committed. --dump-at: write the state
after that step (OUT.at<STEP>.rank<R>.pt). --initial: the manager's initial_load_path. Writes
OUT.loaded.rank<R>.pt (the state after load) and OUT.rank<R>.pt (at the end).
"""

from __future__ import annotations

import os
import pickle
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import CheckpointManager as TitanManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from ckpt.integrations.torchtitan import CheckpointManager
from tests.integrations.resume import worker_arguments

DIM = 16


class Stream(IterableDataset):
    """Random samples, a fixed sequence per data-parallel rank, with a position to save."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.i = 0

    def __iter__(self):  # noqa: ANN204
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            yield torch.randn(DIM, generator=g), torch.randn(1, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.i = sd["i"]


class Runs:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("a pickle ran code",))


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.ntokens_seen = int(sd["ntokens_seen"])


def build_model(config: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(7)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, config["hidden"]), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(config["hidden"], config["hidden"]), torch.nn.ReLU(), torch.nn.Linear(config["hidden"], 1),
    )  # fmt: skip


def full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def snapshot(model: torch.nn.Module, optimizers: Any, schedulers: Any, state: TrainState, loader: Any) -> dict[str, Any]:
    osd = optimizers.state_dict()
    return {
        "data": StatefulDataLoader.state_dict(loader),
        "model": {k: full(v).clone() for k, v in model.state_dict().items()},
        "optim": {k: full(v).clone() if isinstance(full(v), torch.Tensor) else v for k, v in osd.items()},
        "last_epoch": schedulers.schedulers[0].last_epoch,
        "train_state": state.state_dict(),
    }


def main() -> None:
    p = worker_arguments()
    p.add_argument("--dump-at", type=int, default=0)
    p.add_argument("--manager", choices=["ckpt", "torchtitan"], default="ckpt")
    p.add_argument("--initial", default="")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--no-load", action="store_true", help="never call manager.load()")
    p.add_argument("--evil-loader", action="store_true", help="save a data loader state whose pickle runs code on load")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # each rank its own dropout

    model = build_model({"hidden": 32})
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=4).build(optimizers=optimizers, training_steps=args.steps)
    loader = ParallelAwareDataloader(Stream(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    state = TrainState()
    if args.evil_loader:
        loader.state_dict = lambda: {f"dp_rank_{rank}": pickle.dumps(Runs()), "world_size": world}
    common = {
        "enable": True, "interval": args.every, "keep_latest_k": 0,
        "initial_load_path": args.initial or None, "initial_load_model_only": args.model_only,
    }  # fmt: skip
    if args.manager == "ckpt":
        config: Any = CheckpointManager.Config(root=args.root, options={"lease": None}, **common)
    else:  # torchtitan's own, saving its full state at the last step too
        config = TitanManager.Config(folder=args.root, last_save_model_only=False, **common)
    manager = config.build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None
    )

    if not args.no_load:
        manager.load(step=-1)
    torch.save(snapshot(model, optimizers, schedulers, state, loader), f"{args.out}.loaded.rank{rank}.pt")
    batches = iter(loader)
    while state.step < args.steps:
        state.step += 1
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.ntokens_seen += x.shape[0]
        manager.save(state.step, last_step=state.step == args.steps)
        if state.step == args.dump_at:
            torch.save(snapshot(model, optimizers, schedulers, state, loader), f"{args.out}.at{state.step}.rank{rank}.pt")
        if state.step == args.die_at:
            manager.maybe_wait_for_saving()
            os.kill(os.getpid(), signal.SIGKILL)
    manager.maybe_wait_for_saving()
    manager.close()
    end = snapshot(model, optimizers, schedulers, state, loader)
    end["rng"] = torch.rand(3)
    torch.save(end, f"{args.out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
