"""A 2-rank job for test_resave: a replicated model, a tensor sharded over the ranks, and at
step 5 a tensor on rank 1 alone. Writes what each step saved (as full tensors) and the layout
generation after each save."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckpt


class Extra:
    def __init__(self, mesh) -> None:
        self.sharded = distribute_tensor(torch.arange(40, dtype=torch.float32).reshape(8, 5), mesh, [Shard(0)])
        self.only_on_rank1: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {"sharded": self.sharded, "note": "n" * int(self.sharded.to_local()[0, 0].item()), **self.only_on_rank1}

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("not restored here")


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = Extra(mesh)
    gens = []
    with ckpt.Checkpointer(root, model=model, optimizer=opt, extra={"x": extra}, interval=None, restore="none",
                           on_error="log", keep=ckpt.Keep(last=100), handle_sigterm=False, save_on_exit=False) as cp:
        for step in range(1, 7):
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            extra.sharded = extra.sharded + 1
            if step == 5 and rank == 1:
                extra.only_on_rank1 = {"late": torch.full((3,), 7.0)}
            cp.step_done()
            want = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
            want["extra.x.sharded"] = extra.sharded.full_tensor()
            if step >= 5:
                want["extra.x.late"] = torch.full((3,), 7.0)
            cp.save(blocking=True)
            gens.append(cp._slot.resaver.generation)
            if rank == 0:
                torch.save(want, out / f"want{step}.pt")
        # Step 7: another job committed that step meanwhile. Rank 0 refuses to write there,
        # and every rank's save fails with its reason (on_error="log": logged, not raised).
        cp.step_done()
        if rank == 0:
            (Path(root) / "step-0000000007").mkdir()
            (Path(root) / "step-0000000007" / "manifest.json").write_text("{}")
        dist.barrier()
        cp.save(blocking=True)
        (out / f"last{rank}.txt").write_text(str(cp.last_commit.step))
    (out / f"generations{rank}.txt").write_text(" ".join(map(str, gens)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
