"""Does a trainer's memory grow save after save? Many cheap saves, a line through them.

    python bench/memory_probe.py [--saves 1000] [--fsdp] [--control]

Starts 2 ranks (gloo, this machine) that train a stack of 8 Linear(1024, 1024) layers with
AdamW (100 MB of parameters and moments; halved per rank with `--fsdp`, FSDP2 per layer),
saving with ckpt before every step (`Keep(last=2)`, retention on), and prints each rank's
anonymous memory (`RssAnon`) after save 50, half-way and at the end, and the least-squares
slope over the second half and over saves 50 on, in KB per save. `--control` runs the same
loop without the saves. A leak is a steady slope; the allocator's ups and downs are not.
`bench/persist.py`'s memory check does the same on its transformer, fewer times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def slope(ys: list[float]) -> float:
    return statistics.linear_regression(range(len(ys)), ys).slope


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ckpt

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    if args.fsdp:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.randn(8, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    ys = []
    with ckpt.Checkpointer(args.root, model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False,
                           keep=ckpt.Keep(last=2), restore="none") as cp:  # fmt: skip
        for _ in range(args.saves):
            if not args.control:
                cp.save()
            step()
            cp.step_done()
            cp.wait()
            ys.append(rss_anon_mb())
    half = len(ys) // 2
    print(
        f"rank {rank} ({'FSDP2' if args.fsdp else 'plain'}, {'no saves' if args.control else 'saves'}, {args.saves}): "
        f"RssAnon {ys[49]:.0f} MB after 50, {ys[half - 1]:.0f} after {half}, {ys[-1]:.0f} at the end; "
        f"slope {slope(ys[half:]) * 1024:+.1f} KB/save over the second half, {slope(ys[50:]) * 1024:+.1f} over saves 50 on",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=1000)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--control", action="store_true", help="the same loop without the saves")
    p.add_argument("--root", help="(set for the ranks)")
    args = p.parse_args()
    if args.saves < 100:
        p.error("--saves: at least 100")
    if "RANK" in os.environ:
        return rank_main(args)
    root = tempfile.mkdtemp(prefix="ckpt-memory-probe-")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, *sys.argv[1:], "--root", root]
    try:
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(2)]
        codes = [proc.wait() for proc in procs]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
