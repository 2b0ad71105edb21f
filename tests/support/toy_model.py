"""The small MLP the multi-rank tests train, under each wrapping (plain, ddp, fsdp2, fsdp1).

Kept free of ckpt imports, so that a test can prove plain `torch.distributed.checkpoint`
reads what ckpt wrote without ckpt anywhere in the process.
"""

from __future__ import annotations

import torch


class Forwards(torch.nn.Module):
    """The identity, counting its calls in a buffer: state that forward changes in place (as
    BatchNorm's statistics do), the same on every rank whatever its data."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def build(mode: str, world: int, seed: int = 1234, frozen_seed: int | None = None, counter: bool = True, width: int = 32) -> torch.nn.Module:
    """With `frozen_seed`, the first layer is frozen (requires_grad=False) and its weights are
    drawn from that seed, as a fine-tune loads its base model. A last layer counts the
    forwards in a buffer (`Forwards`), unless `counter` is false."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8),
        *([Forwards()] if counter else []),
    )
    if frozen_seed is not None:
        g = torch.Generator().manual_seed(frozen_seed)
        with torch.no_grad():
            for p in model[0].parameters():
                p.copy_(torch.randn(p.shape, generator=g))
                p.requires_grad_(False)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode in ("fsdp2", "hsdp"):  # HSDP: 2 replicas, each sharded over half the ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,)) if mode == "fsdp2" else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
