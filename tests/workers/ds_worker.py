"""A DeepSpeed job for the tests, one process per rank (launch.py), on the CPU accelerator
over gloo: a small MLP under ZeRO stage 1, 2 or 3 (optionally with the optimizer offloaded
to the CPU) with AdamW and a DeepSpeed-owned LR scheduler, checkpointed by ckpt.

Writes <out>.rank<R>.pt: the step, the step it resumed from, and the full fp32 weights and
Adam moments (DeepSpeed's own tensor-fragment API) at the start (after the restore) and at
the end, so a test can compare a resumed job with the one that saved.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import ckpt  # noqa: E402
from tests.support.launch import exit_without_teardown
from tests.support.toy_model import Forwards  # noqa: E402

# DeepSpeed compiles its shared-memory all-reduce (a C++ op: over a CPU-minute) when its CPU
# backend starts. Only its inference all-reduce uses that op, never training, so these jobs
# leave it unbuilt, as DeepSpeed does on a platform it does not support. Their collectives
# are gloo's either way. (CPU Adam, which the offloaded engine trains with, is still built.)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def full_state(engine, optimizer: bool) -> dict:
    """Full fp32 weights (and Adam's moments, once the optimizer has stepped) of the trained
    parameters, and every parameter as the forward uses it (`module`: in the engine's dtype;
    the frozen ones are only there)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    state = {"params": {n: safe_get_full_fp32_param(p).clone() for n, p in named}, "lr": engine.get_lr()[0], "global_steps": engine.global_steps}
    state["module"] = module_weights(engine)
    if optimizer:
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = {n: safe_get_full_optimizer_state(p, key).clone() for n, p in named}
    return state


def module_weights(engine) -> dict:
    """Every parameter of the module, whole (gathered under ZeRO-3), and its buffers."""
    params = list(engine.module.named_parameters())
    gathered = deepspeed.zero.GatheredParameters([p for _, p in params]) if engine.zero_optimization_stage() == 3 else contextlib.nullcontext()
    with gathered:
        return {n: t.detach().clone() for n, t in [*params, *engine.module.named_buffers()]}




def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--no-save-on-exit", action="store_true")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gather-bytes", type=int, help="ZeRO-3: parameters gathered at once by a restore")
    p.add_argument("--count-micro-steps", action="store_true", help="step_done() after every engine.step() (a mistake)")
    p.add_argument("--trailing-micro", type=int, default=0, help="micro-batches after the last optimizer step (the data ran out)")
    p.add_argument("--frozen-seed", type=int, help="freeze the first layer, its weights drawn from this seed")
    p.add_argument("--bf16", action="store_true", help="bf16 weights for the forward (DeepSpeed's bf16 mode)")
    p.add_argument("--save-no-frozen", action="store_true", help="save as an earlier ckpt did: no frozen parameters")
    p.add_argument("--frozen", default="save", help="the Checkpointer's frozen=")
    args = p.parse_args()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("ckpt").addHandler(handler)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    from ckpt.capture import deepspeed_state
    if args.gather_bytes:
        deepspeed_state.GATHER_BYTES = args.gather_bytes
    if args.save_no_frozen:
        deepspeed_state._frozen_params = lambda engine: []
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8), Forwards())
    if args.frozen_seed is not None:  # as a fine-tune loads a frozen part; a resumed job may load other values
        g = torch.Generator().manual_seed(args.frozen_seed)
        for p in model[0].parameters():
            p.data = torch.randn(p.shape, generator=g)
            p.requires_grad_(False)
    zero: dict = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": args.accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": args.bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dist.barrier()  # every rank has mapped every other's shared allreduce buffer by now
    drop_shm_buffer(rank)
    before = module_weights(engine)  # before the restore
    with ckpt.Checkpointer(args.root, model=engine, interval=ckpt.Every(steps=args.every), save_on_exit=not args.no_save_on_exit, timeout_s=120, frozen=args.frozen) as cp:
        start = {"step": cp.step, "before": before, **full_state(engine, optimizer=cp.step > 0)}
        for step in range(cp.step, args.steps):
            for micro in range(args.accumulation):
                # The data depends on the global step, the micro-batch and the rank only: a
                # resumed job sees what the uninterrupted one saw.
                g = torch.Generator().manual_seed(step * 1000 + micro * 100 + rank)
                x = torch.randn(4, 16, generator=g).to(torch.bfloat16 if args.bf16 else torch.float32)
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
                if args.count_micro_steps:
                    cp.step_done()
            if not args.count_micro_steps:
                cp.step_done()  # one optimizer step
        for micro in range(args.trailing_micro):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(micro)).to(torch.bfloat16 if args.bf16 else torch.float32)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    torch.save({"step": cp.step, "restored_step": cp.restored_step, "world": world, "start": start, "end": full_state(engine, optimizer=cp.step > 0)}, f"{args.out}.rank{rank}.pt")
    dist.barrier()
    # Once in a CI run a finished 1-rank job aborted at teardown ("terminate called without
    # an active exception": a C++ thread of DeepSpeed's or gloo's destroyed at exit).
    exit_without_teardown()


def drop_shm_buffer(rank: int) -> None:
    """Unlink this rank's /dev/shm allreduce buffer (DeepSpeed's CPU communicator, 69 MB a
    rank) once all ranks have mapped it: DeepSpeed never unlinks it, so every run used to
    leave it behind until /dev/shm filled the machine's memory."""
    tail = f"_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_{rank}"
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*{tail}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


if __name__ == "__main__":
    main()
