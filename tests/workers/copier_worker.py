"""A 2-rank job for test_copier: a replicated model of large tensors (DCP saves each in one
rank's file only). `save`: four saves, the staging bytes each copied by each save, and the
state of the last save; `load`: the state a fresh model and optimizer restored."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ckpt
from ckpt.save import stage


def main() -> None:
    mode, root, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    copied: list[int] = []
    real = stage._copy_all

    def counting(pairs, non_blocking):
        copied[-1] += sum(d.numel() * d.element_size() for d, _ in pairs)
        return real(pairs, non_blocking)

    stage._copy_all = counting
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        if mode == "save":
            for _ in range(4):
                torch.manual_seed(100 + len(copied))  # the same batches on both ranks
                model(torch.randn(8, 512)).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
                copied.append(0)
                cp.save()
                cp.wait()
        else:
            assert cp.restored_step == 4, cp.restored_step
    state = {"model": model.state_dict(), "optim": {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items()}}
    total = sum(t.numel() * t.element_size() for t in [*state["model"].values(), *state["optim"].values()] if t.dim())
    torch.save({"state": state, "copied": copied, "total": total}, out / f"{mode}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
