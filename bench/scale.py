"""What a save and a restore cost per rank as the job grows (issue 40): the first measurements.

For each world size, N processes on loopback (gloo) train a stack of FSDP2-sharded linear layers
one step, save it with ckpt, and restore it on the same world size in a new job. Per rank it
records the bytes the restore read (`ckpt_read_bytes`), the bytes of that rank's own files, the
size of `.metadata` and of the manifest, and the time of the restore; the table shows how the
busiest rank's read beyond its own files grows with the world size.

    .venv/bin/python bench/scale.py                       # 2, 4, 8 ranks: bench/results/scale.json
    .venv/bin/python bench/scale.py --ranks 2,4,8,16 --layers 24 --width 256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(REPO))
    import ckpt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict = {"rank": rank, "world": world}
    if args.phase == "save":
        model(torch.randn(4, args.width)).sum().backward()
        opt.step()
        with ckpt.Checkpointer(args.root, model=model, optimizer=opt, interval=None, handle_sigterm=False) as cp:
            began = time.perf_counter()
            cp.save(blocking=True)
            out["save_s"] = time.perf_counter() - began
    else:
        began = time.perf_counter()
        with ckpt.Checkpointer(args.root, model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False) as cp:
            out["restore_s"] = time.perf_counter() - began
            out["read_bytes"] = cp.metrics.registry.get_sample_value("ckpt_read_bytes_total") or 0.0
            manifest = cp.last_commit
            out["own_file_bytes"] = sum(e.size for e in manifest.files.values() if e.rank == rank)
            out["metadata_bytes"] = manifest.files[".metadata"].size
            out["files"] = len(manifest.files)
        step_dir = Path(args.root) / f"step-{manifest.step:010d}"
        out["manifest_bytes"] = (step_dir / "manifest.json").stat().st_size
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(n: int, phase: str, root: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
        argv = [sys.executable, __file__, "--worker", phase, "--root", str(root), "--out", str(out), "--layers", str(args.layers), "--width", str(args.width)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{out}.{phase}.rank{rank}.log", "w")))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        tail = Path(f"{out}.{phase}.rank{codes.index(next(c for c in codes if c))}.log").read_text()[-3000:]
        raise SystemExit(f"{phase} on {n} ranks failed: {codes}; a failed rank's log ends:\n{tail}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    p.add_argument("--worker", choices=["save", "restore"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.phase = args.worker
        _worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as d:
        for n in map(int, args.ranks.split(",")):
            root, out = Path(d, f"root{n}"), Path(d, f"out{n}")
            saved = _job(n, "save", root, out, args)
            restored = _job(n, "restore", root, out, args)
            beyond = [r["read_bytes"] - r["own_file_bytes"] for r in restored]
            row = {
                "ranks": n,
                "metadata_bytes": restored[0]["metadata_bytes"],
                "manifest_bytes": restored[0]["manifest_bytes"],
                "files": restored[0]["files"],
                "own_file_bytes_max": max(r["own_file_bytes"] for r in restored),
                "read_bytes_max": max(r["read_bytes"] for r in restored),
                "read_beyond_own_max": max(beyond),
                "restore_s_max": max(r["restore_s"] for r in restored),
                "save_s_max": max(r["save_s"] for r in saved),
                "per_rank": restored,
            }
            rows.append(row)
            print(
                f"{n:3d} ranks: .metadata {row['metadata_bytes'] / 1e3:8.1f} KB, manifest {row['manifest_bytes'] / 1e3:6.1f} KB, "
                f"busiest rank read {row['read_bytes_max'] / 1e6:6.2f} MB, of which beyond its own files {row['read_beyond_own_max'] / 1e6:6.2f} MB, "
                f"restore {row['restore_s_max']:.2f} s",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    print(f"[scale] results: {args.out}")


if __name__ == "__main__":
    main()
