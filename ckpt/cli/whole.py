"""The admin CLI's verbs over whole checkpoints: cp, restore, diff, export, load-test
(`ckpt.admin.tools`, `ckpt.admin.export`); registered by `ckpt.cli.main`."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ckpt.admin import tools
from ckpt.cli.arguments import key_option, signing_key, split_step, step_arg, store_options
from ckpt.cli.terminal import EXIT_OK, emit_json, say
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name

EXIT_DIFFERENT = 1  # diff(1)'s: the two differ


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    cp = sub.add_parser("cp", parents=[common], help="copy a checkpoint to another root, verified, resumable")
    cp.add_argument("dst", help="the destination root")
    cp.add_argument("--step", type=step_arg, help="default: the newest committed")
    cp.add_argument("--progress", action="store_true", default=None, help="a progress bar (default: on a terminal)")
    key_option(cp)
    cp.set_defaults(func=cmd_cp)

    restore = sub.add_parser("restore", parents=[common], help="copy a checkpoint to a local directory (cp to a local root)")
    restore.add_argument("--step", type=step_arg, help="default: the newest committed")
    restore.add_argument("--to", required=True, help="a local directory: the checkpoint lands in <to>/step-N")
    restore.add_argument("--progress", action="store_true", default=None)
    key_option(restore)
    restore.set_defaults(func=cmd_restore)

    diff = sub.add_parser("diff", parents=[common], help="tensors that differ between two checkpoints (ROOT[:STEP] OTHER[:STEP])")
    diff.add_argument("other", help="the other checkpoint: ROOT[:STEP]")
    diff.add_argument("--atol", type=float, default=0.0, help="differences up to this are equal (default 0: bitwise)")
    diff.add_argument("--json", action="store_true")
    key_option(diff)
    diff.set_defaults(func=cmd_diff)

    ex = sub.add_parser("export", parents=[common], help="full tensors as safetensors, torch or zarr")
    ex.add_argument("--step", type=step_arg, help="default: the newest committed")
    ex.add_argument("--format", required=True, choices=["safetensors", "torch", "zarr"])
    ex.add_argument("--out", required=True, help="a file (safetensors, torch) or a directory (zarr)")
    ex.add_argument("--model-only", action="store_true", help="the model's tensors only, without the 'model.' prefix")
    ex.add_argument("--dtype", help="cast floating tensors (not scalars, such as an optimizer's step): bfloat16, float16, float32 (bf16 and fp16 too)")
    ex.add_argument("--progress", action="store_true", default=None)
    ex.add_argument("--force", action="store_true", help="replace the file --out names if it exists")
    key_option(ex)
    ex.set_defaults(func=cmd_export)

    lt = sub.add_parser("load-test", parents=[common], help="what each rank would read to restore on another world size")
    lt.add_argument("--world-size", type=int, required=True)
    lt.add_argument("--step", type=step_arg, help="default: the newest committed")
    lt.add_argument("--json", action="store_true")
    key_option(lt)
    lt.set_defaults(func=cmd_load_test)


def cmd_cp(store: Store, args: argparse.Namespace) -> int:
    dst = Store(args.dst, store_options(args))
    return _report_copy(tools.copy(store, dst, args.step, args.progress, signing_key(args)), store, dst)


def cmd_restore(store: Store, args: argparse.Namespace) -> int:
    dst = Store(args.to)
    if not dst.is_local:
        raise ValueError("--to is a local directory; use `ckpt cp` between object stores")
    return _report_copy(tools.copy(store, dst, args.step, args.progress, signing_key(args)), store, dst)


def _report_copy(done: tools.Copied, src: Store, dst: Store) -> int:
    where = f"{dst.display}/{step_dir_name(done.step)}"
    if done.already:
        say(f"{where} is already there (the same checkpoint, every file of its size; `ckpt verify --deep` reads them); nothing copied")
    else:
        resumed = f", {done.resumed} already there (verified)" if done.resumed else ""
        say(f"copied {src.display}/{step_dir_name(done.step)} to {where}: {done.files} files, {done.bytes / 1e6:.1f} MB{resumed}; committed")
    return EXIT_OK


def cmd_diff(store: Store, args: argparse.Namespace) -> int:
    import torch

    root_b, step_b = split_step(args.other)
    store_b = Store(root_b, store_options(args))
    root_a_step = getattr(args, "root_step", None)
    key = signing_key(args)
    a, b = catalog.find(store, root_a_step, key), catalog.find(store_b, step_b, key)
    md_a, md_b = tools.inventory(store, a), tools.inventory(store_b, b)
    keys_a, keys_b = set(md_a.state_dict_metadata), set(md_b.state_dict_metadata)
    report: dict[str, Any] = {"a": f"{store.display}/{a.dir}", "b": f"{store_b.display}/{b.dir}", "only_a": sorted(keys_a - keys_b), "only_b": sorted(keys_b - keys_a), "differ": [], "equal": 0}
    common = sorted(keys_a & keys_b)
    for group in tools.batches(md_a, common, tools.BATCH_BYTES // 2):
        va, vb = tools.read_whole(store, a, group, md_a), tools.read_whole(store_b, b, group, md_b)
        for key in group:
            x, y = va[key], vb[key]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.shape != y.shape or x.dtype != y.dtype:
                    report["differ"].append({"key": key, "why": f"{x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"})
                    continue
                if _same_bits(x, y):
                    report["equal"] += 1
                    continue
                d = (x.double() - y.double()).abs()
                d = torch.where(x.isnan() & y.isnan(), 0.0, torch.nan_to_num(d, nan=math.inf))  # a NaN on both sides is equal
                worst = float(d.max()) if d.numel() else 0.0
                if worst <= args.atol:
                    report["equal"] += 1
                    continue
                rel = float((d / y.double().abs().clamp_min(1e-12)).max())
                report["differ"].append({"key": key, "max_abs": worst, "max_rel": rel, "elements": int((d > args.atol).sum())})
            elif type(x) is not type(y) or x != y:
                report["differ"].append({"key": key, "why": f"{_short(x)} vs {_short(y)}"})
            else:
                report["equal"] += 1
    same = not (report["only_a"] or report["only_b"] or report["differ"])
    if args.json:
        emit_json(report)
        return EXIT_OK if same else EXIT_DIFFERENT
    say(f"a: {report['a']}")
    say(f"b: {report['b']}")
    for key in report["only_a"]:
        say(f"  only in a: {key}")
    for key in report["only_b"]:
        say(f"  only in b: {key}")
    for d in report["differ"]:
        how = d.get("why") or f"max abs {d['max_abs']:.3g}, max rel {d['max_rel']:.3g}, {d['elements']} elements"
        say(f"  differs: {d['key']}: {how}")
    say(f"{report['equal']} equal, {len(report['differ'])} different, {len(report['only_a'])} only in a, {len(report['only_b'])} only in b")
    return EXIT_OK if same else EXIT_DIFFERENT


def cmd_export(store: Store, args: argparse.Namespace) -> int:
    from ckpt.admin.export import export

    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
    entry = catalog.find(store, args.step, signing_key(args))
    done = export(store, entry, args.format, args.out, model_only=args.model_only, dtype=dtype, progress=args.progress, force=args.force)
    out = done["objects_left_out"]
    left = f"; {len(out)} objects left out (not tensors: {', '.join(out[:3])}{', ...' if len(out) > 3 else ''})" if out else ""
    say(f"exported {store.display}/{entry.dir} to {args.out} ({args.format}): {done['tensors']} tensors, {done['bytes'] / 1e6:.1f} MB{left}")
    return EXIT_OK


def cmd_load_test(store: Store, args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise ValueError("--world-size must be at least 1")
    entry = catalog.find(store, args.step, signing_key(args))
    plans = tools.plan_reads(store, entry, args.world_size)
    total = entry.manifest.total_bytes if entry.manifest else 0
    if args.json:
        emit_json({"dir": entry.dir, "world_size": args.world_size, "saved_on": entry.manifest.world_size if entry.manifest else None, "checkpoint_bytes": total, "ranks": plans})
        return EXIT_OK
    say(f"{store.display}/{entry.dir}: saved on {entry.manifest.world_size if entry.manifest else '?'} ranks, {total / 1e6:.1f} MB; restored on {args.world_size}:")
    for p in plans:
        say(f"  rank {p['rank']}: reads {p['bytes'] / 1e6:.1f} MB from {p['files']} files, holds {p['state_bytes'] / 1e6:.1f} MB")
    worst = max(plans, key=lambda p: p["bytes"])
    say(f"the slowest rank reads {worst['bytes'] / 1e6:.1f} MB ({worst['bytes'] / max(total, 1):.0%} of the checkpoint); all ranks {sum(p['bytes'] for p in plans) / 1e6:.1f} MB")
    return EXIT_OK


def _same_bits(x: Any, y: Any) -> bool:
    """Two tensors of one dtype and shape hold the same bytes (a NaN equals itself)."""
    import torch

    raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(raw(x), raw(y))


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
