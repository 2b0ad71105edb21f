"""Save on one world size / wrapping, load on another: the reshard tests' job, one process per rank.

    --phase save: train a few steps, checkpoint, and write the full (unsharded) model and
                  optimizer state to <out> (rank 0) as the reference.
    --phase load: restore into a fresh model of this world size and wrapping, and write the
                  full state that came back to <out> (rank 0), plus the restored step, and
                  whether ckpt's load plan was DCP's own on every rank.

Wrappings: fsdp2 and ddp (from toy_model), and tp2d: tensor parallel (colwise, rowwise) on the
inner dimension of a 2-D mesh (dp x tp), FSDP2 on dp; `--mesh DPxTP` gives its shape.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckpt
import ckpt.capture.state
from tests.support.toy_model import build


def build_tp2d(dp: int, tp: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(1234)
    # Two 32x32 weights, one split by rows and one by columns: tensors of one shape whose
    # shards differ (a load plan worked out once per layout must tell them apart).
    layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())][:-1])
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    return fully_shard(model, mesh=mesh["dp"])


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd.get("state", {})}


def plan_is_dcps(model: torch.nn.Module, opt: torch.optim.Optimizer, root: str) -> bool:
    """On every rank: ckpt's local load plan for this rank's state and the newest checkpoint
    under `root` (worked out once per tensor layout) is item for item DCP's own."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from ckpt.restore.planner import SafeLoadPlanner

    step = max(Path(root).glob("step-*"))
    md = FileSystemReader(str(step)).read_metadata()
    msd, osd = get_state_dict(model, opt)
    planner = SafeLoadPlanner()
    planner.set_up_planner({"model": msd, "optim": osd}, md)
    ours = planner.create_local_plan().items
    same = bool(ours) and ours == create_default_local_load_plan(planner.state_dict, md, True).items
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--mode", choices=["fsdp2", "ddp", "tp2d"], required=True)
    p.add_argument("--mesh", default="", help="DPxTP for tp2d")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.mode == "tp2d":
        dp, tp = (int(x) for x in args.mesh.split("x"))
        model = build_tp2d(dp, tp)
    else:
        model = build(args.mode if world > 1 or args.mode != "ddp" else "plain", world)
    # The restore must bring back the saved hyperparameters over the new job's own.
    lr, wd = (1e-2, 0.1) if args.phase == "save" else (5e-3, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    torch.manual_seed(7)  # the same data on every rank: data parallel ranks see equal batches

    # Whether the restore loaded the model's values again after DCP (it need not when DCP
    # loaded them into the model's own tensors: ckpt.capture.live.loaded_in_place), and whether
    # only the optimizer's hyperparameters were set after (its state loaded in place:
    # ckpt.capture.live.optim_loaded_in_place): "optimizer in place".
    loaded_again: list[bool | str] = []
    real, real_groups = ckpt.capture.state.set_state_dict, ckpt.capture.state._load_hyperparameters

    def spy(model, optimizers, *, model_state_dict, optim_state_dict):  # noqa: ANN001, ANN202
        loaded_again.append(bool(model_state_dict))
        return real(model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict)

    def spy_groups(optimizers, groups):  # noqa: ANN001, ANN202
        loaded_again.append("optimizer in place")
        return real_groups(optimizers, groups)

    ckpt.capture.state.set_state_dict = spy
    ckpt.capture.state._load_hyperparameters = spy_groups
    with ckpt.Checkpointer(args.root, model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        if args.phase == "save":
            for _ in range(args.steps):
                model(torch.randn(4, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
            cp.save(blocking=True)
        state = full_state(model, opt)
        state["step"] = cp.step
        state["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        state["restored_step"] = cp.restored_step
        if args.phase == "load":
            state["plan_is_dcps"] = plan_is_dcps(model, opt, args.root)
            state["model_loaded_again"] = loaded_again
    if rank == 0:
        torch.save(state, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
