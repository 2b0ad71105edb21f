#!/usr/bin/env python
"""What frozen="skip" saves a LoRA fine-tune: ckpt with frozen="save" and with "skip" side by
side, in one process, on the same model, the same store and the same steps.

    .venv/bin/python bench/frozen.py                  # a 100 MB frozen base: ~2 minutes here
    .venv/bin/python bench/frozen.py --base-mb 400 --saves 5

The model: a stack of `--layers` square Linear layers (fp32, frozen: the base) sized to
`--base-mb`, each with a LoRA adapter of rank `--rank` (two small trainable matrices) beside it,
and AdamW over the trainable parameters only, as a LoRA job builds it. One process, one rank,
a local root under `--dir`. The two modes take turns: in each round each takes a training step
and a save (blocking `cp.save()` time, plus the wait of the next optimizer step for the
staging copy), then waits for its commit (persist time: from the save to the commit, as the
manifest records it, the step running beside it). After the
rounds, each restores its newest checkpoint into a fresh model that loaded the same base (time
to enter the `with` block). Reports the medians per mode, the bytes per checkpoint, and
skip/save for each.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import ckpt  # noqa: E402

MODES = ("save", "skip")


class LoRALinear(torch.nn.Module):
    """A frozen Linear plus a trainable low-rank update: y = W x + B (A x)."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, d) / math.sqrt(d))
        self.b = torch.nn.Parameter(torch.zeros(d, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(d: int, layers: int, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same base every time: what a fine-tune loads
    model = torch.nn.Sequential(*(LoRALinear(d, rank) for _ in range(layers)))
    torch.manual_seed(1)
    return model


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, d: int) -> None:
    model(torch.randn(8, d)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-mb", type=float, default=100)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the roots go (default: a fresh directory under /tmp)")
    p.add_argument("--out", default=None, help="JSON of every measurement (default: bench/results/frozen-<base>mb.json, replaced)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    d = int(math.sqrt(args.base_mb * 1e6 / 4 / args.layers))
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-frozen-"))
    try:
        result = run(args, d, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    out = Path(args.out or HERE / "results" / f"frozen-{args.base_mb:g}mb.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def run(args: argparse.Namespace, d: int, work: Path) -> dict:
    jobs = {}
    for mode in MODES:
        model = build(d, args.layers, args.rank)
        opt = optimizer(model)
        cp = ckpt.Checkpointer(str(work / mode), model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False,
                               keep=ckpt.Keep(last=1000), restore="none", frozen=mode, lease=None)  # fmt: skip
        cp.__enter__()
        jobs[mode] = (model, opt, cp)
    trainable = sum(p.numel() for p in jobs["save"][0].parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in jobs["save"][0].parameters() if not p.requires_grad)
    per: dict[str, dict[str, list[float]]] = {m: {"blocking_s": [], "persist_s": [], "bytes": []} for m in MODES}
    for i in range(args.saves + 1):  # the first save of each is a warm-up (buffers, plans)
        for mode in MODES:
            model, opt, cp = jobs[mode]
            step(model, opt, d)
            cp.step_done()
            waited = cp.staging_wait_s
            t0 = time.perf_counter()
            cp.save()
            blocking = time.perf_counter() - t0
            step(model, opt, d)  # the optimizer step waits for the staging copy
            cp.step_done()
            blocking += cp.staging_wait_s - waited
            cp.wait()
            if i:
                per[mode]["blocking_s"].append(blocking)
                per[mode]["persist_s"].append(cp.last_commit.costs.persist_s)  # the save to its commit, a step running beside it
                per[mode]["bytes"].append(cp.last_commit.total_bytes)
    restore_s = {}
    for mode in MODES:
        jobs[mode][2].save(blocking=True)  # the state as it is now: what the restore must give back
        jobs[mode][2].__exit__(None, None, None)
        model = build(d, args.layers, args.rank)
        t0 = time.perf_counter()
        with ckpt.Checkpointer(str(work / mode), model=model, optimizer=optimizer(model), interval=None, save_on_exit=False,
                               handle_sigterm=False, frozen=mode, lease=None) as cp:  # fmt: skip
            restore_s[mode] = time.perf_counter() - t0
            assert cp.restored_step == jobs[mode][2].step
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), jobs[mode][0].state_dict().values(), strict=True))
    return {
        "config": {**vars(args), "d": d, "frozen_params": frozen, "trainable_params": trainable, "torch": torch.__version__},
        "saves": per,
        "restore_s": restore_s,
    }


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"frozen base {c['frozen_params'] * 4 / 1e6:.0f} MB ({c['layers']} layers of d={c['d']}), LoRA rank {c['rank']}: "
        f"{c['trainable_params'] * 4 / 1e6:.1f} MB trainable; medians of {c['saves']} saves",
        f"{'':10}{'save':>12}{'skip':>12}{'skip/save':>12}",
    ]
    med = {m: {k: statistics.median(v) for k, v in result["saves"][m].items()} for m in MODES}
    for key, unit, scale in (("bytes", "MB", 1e-6), ("blocking_s", "ms", 1e3), ("persist_s", "ms", 1e3)):
        a, b = med["save"][key] * scale, med["skip"][key] * scale
        lines.append(f"{key:10}{a:>9.1f} {unit}{b:>9.1f} {unit}{b / a:>12.3f}")
    a, b = result["restore_s"]["save"] * 1e3, result["restore_s"]["skip"] * 1e3
    lines.append(f"{'restore':10}{a:>9.1f} ms{b:>9.1f} ms{b / a:>12.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
