#!/usr/bin/env python
"""What ckpt's background work costs in CPU per save, beyond the staging copy, with no training
running beside it: the issue's "the writer should cost no more CPU than one more copy of the
bytes", measured where nothing else competes for the cores.

    .venv/bin/python bench/writer_cpu.py                 # 10,004 small tensors per rank, 2 ranks
    .venv/bin/python bench/writer_cpu.py --size-mb 100   # the 100 MB state of bench/stall.py
    .venv/bin/python bench/writer_cpu.py --ranks 1
    .venv/bin/python bench/writer_cpu.py --size-mb 100 --signed   # BLAKE3 checksums, as a signing job's
    .venv/bin/python bench/writer_cpu.py --size-mb 100,1000       # and the cost of each byte added

Each rank builds the model of `bench/stall.py` (FSDP2, AdamW), takes 3 warm-up saves, then
`--saves` saves in a row (save, optimizer step, wait for the commit). Per save it reports the
CPU of the rank's process and its children (the writer process) less the training thread's,
the part of it spent in the staging copies (`Copies.run`), the part the same threads spend in
the same loop without saves (the control, run afterwards: gloo's threads serving the
optimizer step's DTensors, 8-10 ms a step with 10,004 of them), what is left (the writer:
file writes, checksums, collectives, manifest, `.metadata`, retention), and that in units of
the floor: one `copy_` of every tensor of the state into preallocated buffers, timed afterwards.
A second control, two seconds of sleep, gives what the process's threads cost by the second
with nothing to do (gloo's loop threads, one per process group, wake every 10 ms): a save that
lasts longer than a step is charged that much more above, and a last line takes it off.

With two sizes or more (each run on its own), a last line per rank gives the writer's cost of
each byte added: the growth of its net CPU from the smallest size to the largest over the
growth of the floor's copy. A save's fixed work (collectives, the manifest, `.metadata`,
opening and syncing files) weighs on a small state and not on this.

In `bench/stall.py` the same background work runs while training steps run on the same two
cores, and its CPU time there reads higher (two busy threads per core slow each other down).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import stall  # noqa: E402  (the model, the CPU counters and the staging-copy timer)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", default=None, help="state per rank, MB, comma-separated for several (default: the many-small state)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--threads", action="store_true", help="also the CPU of each thread of a rank, per save")
    p.add_argument("--signed", action="store_true", help="with a signing key: files checksummed with BLAKE3, not xxh3")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sizes: list[float | None] = sorted(float(x) for x in args.size_mb.split(",")) if args.size_mb else [None]
    work = Path(tempfile.mkdtemp(prefix="ckpt-writer-cpu-"))
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        runs = []
        for i, size in enumerate(sizes):
            run = work / f"run{i}"  # its own root: a run restores nothing of another
            run.mkdir()
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
                "--master-port", str(stall.free_port()), __file__, *argv, *(["--size-mb", f"{size:g}"] if size else []),  # the last one counts
                "--worker", "--dir", str(run),
            ]  # fmt: skip
            code = subprocess.run(cmd, env=env, check=False).returncode
            if code:
                print(f"[writer_cpu] a rank failed (exit code {code})", file=sys.stderr)
                return 1
            runs.append([json.loads((run / f"rank{rank}.json").read_text()) for rank in range(args.ranks)])
            for rec in runs[-1]:
                print(rec["line"])
        if len(runs) > 1:
            for rank, (small, large) in enumerate(zip(runs[0], runs[-1], strict=True)):
                added = (large["net_s"] - small["net_s"]) / (large["floor_s"] - small["floor_s"])
                print(
                    f"rank {rank}: each byte added from {small['mb']:.0f} to {large['mb']:.0f} MB costs the writer "
                    f"{added:.2f} copies of it ({(large['net_s'] - small['net_s']) * 1e3:.1f} ms more for "
                    f"{(large['floor_s'] - small['floor_s']) * 1e3:.1f} ms more of the floor's copy)"
                )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckpt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    many_small = args.size_mb is None
    shape = stall.model_shape(float(args.size_mb or 0), world, many_small)
    model, _ = stall.make_model(shape, world, "cpu", shard_blocks=not many_small)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 16, (2, 16))
    model(x).float().mean().backward()
    opt.step()
    stall._time_staging_copies()

    def background_cpu() -> tuple[float, float]:
        """CPU of the process's threads but this one, and of its children (the writer process)."""
        me = os.getpid()
        return stall.proc_cpu(me, children_too=False) - time.thread_time(), sum(stall.proc_cpu(p) for p in stall.descendants(me))

    def per_thread() -> dict[str, float]:
        """CPU seconds of each thread of this process, by its Python name (else the kernel's
        name for it and its id); threads that ended meanwhile are left out."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid in os.listdir("/proc/self/task"):
            on = stall.thread_sched(int(tid))[0]
            if not math.isnan(on):
                comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
                out[names.get(int(tid), f"{comm}-{tid}")] = on
        return out

    root = Path(args.dir) / "ckpt"
    with ckpt.Checkpointer(
        str(root), model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False,
        keep=ckpt.Keep(last=1000), restore="none",  # no retention while timed, as in bench/stall.py
        signing_key=b"bench-signing-key-0123456789abcdef" if args.signed else None,
    ) as cp:  # fmt: skip
        for _ in range(3):  # the first plans, spawns the writer, allocates the buffers
            cp.save()
            cp.step_done()
            cp.wait()
        dist.barrier()
        cpu0, copies0, threads0 = background_cpu(), stall._STAGING_COPY_CPU[0], per_thread()
        began = time.perf_counter()
        for _ in range(args.saves):
            cp.save()
            opt.step()  # waits for the copies (the optimizer pre-hook)
            cp.step_done()
            cp.wait()
        save_s = (time.perf_counter() - began) / args.saves
        threads, children = ((b - a) / args.saves for a, b in zip(cpu0, background_cpu(), strict=True))
        by_thread = {n: (t - threads0.get(n, 0.0)) / args.saves for n, t in per_thread().items()}
        cpu, copies = threads + children, (stall._STAGING_COPY_CPU[0] - copies0) / args.saves
        nbytes = cp.last_commit.costs.bytes
        # The control: the same loop without the saves. What the process's other threads spend
        # then (gloo's, serving the optimizer step's DTensors; ckpt's idle lease and event
        # threads) is not the saves' and is taken off.
        dist.barrier()
        idle0, began = background_cpu(), time.perf_counter()
        for _ in range(args.saves):
            opt.step()
        step_s = (time.perf_counter() - began) / args.saves
        idle = sum(b - a for a, b in zip(idle0, background_cpu(), strict=True)) / args.saves
        # What those threads cost by the second with nothing to do (gloo's loop threads wake
        # every 10 ms, one per process group): a cost of having the groups at all, which a
        # save that lasts longer than a step is charged for above.
        dist.barrier()
        quiet0, began = background_cpu(), time.perf_counter()
        time.sleep(2.0)
        per_s = sum(b - a for a, b in zip(quiet0, background_cpu(), strict=True)) / (time.perf_counter() - began)
        always_on = per_s * max(0.0, save_s - step_s)
    leaves = stall.tensor_leaves(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
    bufs = [torch.empty_like(t) for t in leaves]
    floors = []
    for _ in range(10):
        t = time.perf_counter()
        for dst, src in zip(bufs, leaves, strict=True):
            dst.copy_(src)
        floors.append(time.perf_counter() - t)
    floor = statistics.median(floors)
    beyond = cpu - copies - idle
    line = (
        f"rank {rank}: {len(leaves)} tensors, {nbytes / world / 1e6:.1f} MB written per rank per save; per save: "
        f"background CPU {cpu * 1e3:.1f} ms, of which the staging copy {copies * 1e3:.1f} ms and "
        f"{idle * 1e3:.1f} ms spent as much without saves; the writer beyond them {beyond * 1e3:.1f} ms "
        f"= {beyond / floor:.2f} copies (the trainer's other threads {(threads - copies - idle) * 1e3:.1f} ms, "
        f"the writer process {children * 1e3:.1f} ms) (the floor's copy: {floor * 1e3:.1f} ms)\n"
        f"  the process's idle threads take {per_s * 1e3:.1f} ms of CPU per second doing nothing; over the "
        f"{save_s * 1e3:.0f} ms a save lasts (a step alone {step_s * 1e3:.0f} ms) that is {always_on * 1e3:.1f} ms of the above: "
        f"net of it, the writer {(beyond - always_on) * 1e3:.1f} ms = {(beyond - always_on) / floor:.2f} copies"
    )
    if args.threads:
        busy = sorted(((v, n) for n, v in by_thread.items() if v >= 0.0002), reverse=True)
        line += "\n  per save, by thread: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for v, n in busy)
    record = {"line": line, "mb": nbytes / world / 1e6, "net_s": beyond - always_on, "floor_s": floor}
    (Path(args.dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
