#!/usr/bin/env python
"""The persist benchmark of issue 4: ckpt's write and restore against plain I/O of the same bytes.

    .venv/bin/python bench/persist.py                        # 100 and 400 MB per rank: ~5 min here
    .venv/bin/python bench/persist.py --sizes-mb 50,200 --repeats 5 --stores local
    .venv/bin/python bench/persist.py --show bench/results/persist-local.json

One command starts a moto S3 server on a free loopback port, then 2 ranks (gloo, this file
again with RANK/WORLD_SIZE/MASTER_* set) that train the FSDP2 TinyGPT of bench/stall.py with
AdamW, then one process for the resharded restore. It prints the table and writes every raw
measurement to bench/results/persist[-<sizes>][-<store>].json (persist.json for the default run,
persist-local.json with --stores local, persist-1000mb-local.json with --sizes-mb 1000 too),
replaced. The checks, each against its target:

  a) persist: bytes committed / time from save() to the commit (the manifest's persist_s),
     against a raw write of files of the same count and sizes by the same ranks at the same
     time to the same store (local: open/write/fsync, then the directory's fsync; S3: s3fs
     pipe_file and s3fs open("wb"), the faster of the two). Target: ckpt >= 80 % of the raw
     throughput.
  b) restore: entering a Checkpointer that restores the latest checkpoint, against a raw read
     of the checkpoint's files into memory (each rank the files it wrote; local reads start
     cold: the files are evicted from the page cache first). Target >= 80 %.
  c) resharding: a checkpoint saved by 2 ranks restored by 1 process (the same model, FSDP2 on
     one rank), against one saved by 1 and restored by 1. Target <= 1.25x.
  d) host memory: 50 saves in a row with training steps between; each rank's memory after
     save 5 against after save 50 (trainer VmRSS; PSS of the trainer and its child processes,
     shared memory counted once), as medians of saves 3-7 and 46-50: the training step's own
     allocations move RSS by a few % from one save to the next. Target: within 5 %.
  e) linear cost: ckpt's persist time per byte at the largest size over the smallest, divided
     by the same ratio of the raw write on the same store where that is above 1 (a store whose
     own cost per byte grows with the size, as moto's does, is not ckpt's cost growing; one
     whose fixed cost per write makes small writes dear is not let off); the table shows both,
     and ckpt's fixed cost per save of a two-point fit. Target <= 1.25 (no worse than linear).

Every measurement is repeated (--repeats) and ckpt's runs alternate with the raw ones, so the
load of a shared machine weighs on both alike; the table shows medians. ckpt is used through
its public API only (Checkpointer, Manifest), so the benchmark survives changes to its insides.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import stall  # the stall benchmark beside this file: model, launcher, /proc readings

TAG = "[persist]"
S3_KEY, S3_SECRET = "testing", "testing-secret"  # moto accepts any credentials
REPEATS = {"local": 7, "s3": 3}  # local runs take a second, S3 ones (moto) up to ten
TARGETS = {
    "persist": ("ckpt's throughput / the raw write's (same files, ranks, store; the faster raw way)", ">= 0.80", lambda r: r >= 0.8),
    "restore": ("ckpt's throughput / the raw read's (the checkpoint's own files)", ">= 0.80", lambda r: r >= 0.8),
    "reshard": ("restore time 2->1 / 1->1", "<= 1.25", lambda r: r <= 1.25),
    "memory": ("memory after the last saves / after saves 3-7 - 1 (medians)", "<= 5 %", lambda r: abs(r) <= 0.05),
    "linear": ("ckpt's persist time per byte, largest / smallest size, over the raw write's where that is > 1", "<= 1.25", lambda r: r <= 1.25),
    # No verdict: a diagnostic. A leak grows by the same amount every save, which a line
    # fitted through every save shows; the allocator's ups and downs (10 % and more here,
    # the control's too) swamp a comparison of two windows of five saves.
    "growth": ("trainer VmRSS per save, least squares over saves 6 on, minus the control's (KB/save)", "-", None),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="100,400", help="state (params + AdamW moments) per rank, MB, comma-separated (default 100,400)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each measurement, ckpt and raw alternating (default 7 local, 3 on S3)")
    p.add_argument("--stores", default="local,s3", help="local (a directory under --dir), s3 (a moto server on loopback), or both (default)")
    p.add_argument("--leak-saves", type=int, default=50, help="saves in a row for the host memory check (default 50; 0 skips it)")
    p.add_argument("--leak-steps", type=int, default=2, help="training steps between those saves (default 2)")
    p.add_argument("--malloc-trim", action=argparse.BooleanOptionalAction, default=True,
                   help="glibc's malloc_trim(0) in each trainer before its readings of the memory check, control "
                   "and saves alike (default; none where the C library is not glibc): the trainer's figures are then "
                   "memory in use, not free memory glibc's arenas keep, which swings by tens of MB with no saves at "
                   "all (its writer process is read as it is); --no-malloc-trim reads the trainer as it is too")
    p.add_argument("--reshard-size-mb", type=float, default=None,
                   help="size per rank of the 2->1 restore check (default: the largest of --sizes-mb; 0 skips it)")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="local reads: cold (default; the files are evicted from the page cache before each read, "
                   "as on a node that restarts) or warm (left in the page cache)")
    p.add_argument("--dir", default=None, help="local checkpoints and logs (default: a fresh dir under /tmp, deleted after)")
    p.add_argument("--out", default=None, help="the JSON results file (default bench/results/persist[-<sizes>][-<store>].json, replaced)")
    p.add_argument("--show", metavar="JSON", help="print the table of an earlier run's results file and exit")
    p.add_argument("--worker", choices=["ranks", "single"], help=argparse.SUPPRESS)
    p.add_argument("--s3-endpoint", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)  # single: d,layers,heads of the 2-rank model
    p.add_argument("--from-root", help=argparse.SUPPRESS)  # single: the 2-rank checkpoint's root
    args = p.parse_args(argv)
    try:
        args.sizes = [float(x) for x in args.sizes_mb.split(",") if x]
    except ValueError:
        p.error(f"--sizes-mb takes numbers separated by commas, not {args.sizes_mb!r}")
    args.stores = [x for x in args.stores.split(",") if x]
    if not args.sizes or any(s <= 0 for s in args.sizes):
        p.error("--sizes-mb needs at least one positive size")
    if not args.stores or any(s not in ("local", "s3") for s in args.stores):
        p.error(f"--stores takes local, s3 or both, not {args.stores}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.repeats_by_store = {s: args.repeats or REPEATS[s] for s in args.stores}
    if args.reshard_size_mb is None:
        args.reshard_size_mb = max(args.sizes)
    if args.reshard_size_mb and args.reshard_size_mb not in args.sizes:
        p.error("--reshard-size-mb must be one of --sizes-mb (the 2-rank checkpoint of that size is restored)")
    if args.reshard_size_mb and "local" not in args.stores:
        p.error("the reshard check restores a local checkpoint: --stores needs local (or --reshard-size-mb 0)")
    if 0 < args.leak_saves < 12:
        p.error("--leak-saves compares saves 3-7 with the last five: at least 12 (or 0 to skip)")
    return args


# ============================================================================================
# Launcher: the S3 server, the 2-rank job, the 1-process job, the table
# ============================================================================================


@contextlib.contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """A moto S3 server on a free loopback port while the block runs; yields its URL."""
    port = stall.free_port()
    with open(log_dir / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the moto S3 server did not start (log: {log_dir / 'moto.log'})") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def s3fs_for(endpoint: str) -> Any:
    import s3fs

    # Listings never from a cache (files come and go between measurements), as in ckpt.
    return s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_KEY, secret=S3_SECRET,
                             skip_instance_cache=True, use_listings_cache=False)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    sizes = "" if args.sizes == [100.0, 400.0] else "-" + "-".join(f"{s:g}mb" for s in args.sizes)
    store = "" if len(args.stores) > 1 else "-" + args.stores[0]
    out, work, made_dir = stall.run_paths("persist", f"persist{sizes}{store}", args.out, args.dir)
    for name in ("raw.json", "single.json"):
        with contextlib.suppress(FileNotFoundError):
            (work / name).unlink()
    script = Path(__file__).resolve()
    env = {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    samples: list[tuple[float, float, float]] = []
    failures = []
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        extra = ["--dir", str(work)]
        if "s3" in args.stores:
            endpoint = stack.enter_context(moto_server(work))
            bucket = f"persist-{uuid.uuid4().hex[:12]}"
            s3fs_for(endpoint).mkdir(bucket)
            extra += ["--s3-endpoint", endpoint, "--bucket", bucket]
        codes = stall.run_ranks(script, [*argv, *extra, "--worker", "ranks"], 2, work, samples, TAG, env)
        if any(codes):
            stall.print_log_tails(work, 2)
            failures.append(f"the 2-rank job failed (exit codes {codes}); logs under {work}")
        raw = json.loads((work / "raw.json").read_text()) if (work / "raw.json").exists() else None
        if raw and raw.get("reshard_from") and not any(codes):
            shape = ",".join(str(raw["reshard_from"]["shape"][k]) for k in ("d", "layers", "heads"))
            single = [*argv, *extra, "--worker", "single", "--shape", shape, "--from-root", raw["reshard_from"]["root"]]
            codes = stall.run_ranks(script, single, 1, work, samples, f"{TAG} reshard", env, log="single")
            if any(codes):
                stall.print_log_tails(work, 1, log="single")
                failures.append(f"the 1-process reshard job failed (exit code {codes[0]}); logs under {work}")
            if (work / "single.json").exists():
                raw["reshard"] = json.loads((work / "single.json").read_text())
    if raw is None:
        print(f"{TAG} no results; logs under {work}", file=sys.stderr)
        return 1
    raw["machine"] = {**stall.machine(), "fs_type": _fs_type(work)}
    raw["command"] = " ".join([Path(sys.executable).name, "bench/persist.py", *argv])
    raw["wall_s"] = time.time() - t_start
    raw["failures"] = failures + raw.get("failures", [])
    raw["load"] = {"others_cores_whole_run": stall.others_cores(samples, samples[0][0], samples[-1][0]) if samples else None}
    result = summarize(raw, samples)
    out.write_text(json.dumps(result, indent=1))
    print_report(result)
    print(f"\n{TAG} results: {out}")
    if made_dir and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (ext4, tmpfs, ...)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


# ============================================================================================
# Summary and the table
# ============================================================================================


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _slope(ys: list[float]) -> float:
    """The least-squares slope of `ys` against 0, 1, 2, ..."""
    if len(ys) < 2:
        return math.nan
    return statistics.linear_regression(range(len(ys)), ys).slope


def summarize(raw: dict[str, Any], samples: list[tuple[float, float, float]]) -> dict[str, Any]:
    """One row per check: ckpt's median, the baseline's median, their ratio and the target."""
    rows: list[dict[str, Any]] = []

    def others(runs: list[dict[str, Any]]) -> float | None:
        vals = [stall.others_cores(samples, r["t0"] - 0.5, r["t1"] + 0.5) for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    def add(check: str, store: str, size: str, ckpt: dict[str, Any], base: dict[str, Any], ratio: float, runs: list) -> None:
        what, target, ok = TARGETS[check]
        verdict = None if ok is None else (not math.isnan(ratio)) and ok(ratio)
        rows.append({"check": check, "what": what, "store": store, "size": size, "ckpt": ckpt, "baseline": base,
                     "ratio": ratio, "target": target, "ok": verdict, "others_cores": others(runs)})

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": _med(xs), "min": min(xs, default=math.nan), "max": max(xs, default=math.nan), "n": len(xs)}

    per_store: dict[str, list[tuple[float, float, float]]] = {}  # store: (bytes, ckpt s, raw s) per size
    for sz in raw["sizes"]:
        for store, r in sz["stores"].items():
            label = f"{sz['shape']['state_bytes_per_rank'] / 1e6:.0f} MB ({r['bytes'] / raw['config']['world'] / 1e6:.0f} MB files)"
            ck = [x["persist_s"] for x in r["saves"]]
            ways: dict[str, list[float]] = {}
            for x in r["raw_writes"]:
                ways.setdefault(x.get("way", "write"), []).append(x["s"])
            best = min(ways, key=lambda w: _med(ways[w]))  # the baseline: the faster plain way
            rw = ways[best]
            add("persist", store, label, {"s": spread(ck), "mb_s": r["bytes"] / 1e6 / _med(ck)},
                {"s": spread(rw), "mb_s": r["bytes"] / 1e6 / _med(rw), "what": f"raw {best}" if best != "write" else "raw write",
                 "ways_median_s": {w: _med(v) for w, v in ways.items()}},
                _med(rw) / _med(ck), r["saves"] + r["raw_writes"])
            per_store.setdefault(store, []).append((r["bytes"], _med(ck), _med(rw)))
            ck = [x["s"] for x in r["restores"]]
            rd = [x["s"] for x in r["raw_reads"]]
            ranged = [x["s"] for x in r.get("raw_ranged_reads", [])]
            add("restore", store, label, {"s": spread(ck), "mb_s": r["bytes"] / 1e6 / _med(ck)},
                {"s": spread(rd), "mb_s": r["bytes"] / 1e6 / _med(rd), "what": "raw read",
                 **({"ranged_s": spread(ranged), "ranged_ratio": _med(ranged) / _med(ck)} if ranged else {})},
                _med(rd) / _med(ck), r["restores"] + r["raw_reads"])
    for store, pts in per_store.items():
        (b0, c0, r0), (b1, c1, r1) = min(pts), max(pts)
        if b1 > b0:  # two sizes that differ (a tiny size rounds up to one layer)
            slope = (c1 - c0) / (b1 - b0)  # ckpt's seconds per byte between the two sizes
            add("linear", store, f"{b0 / raw['config']['world'] / 1e6:.0f} -> {b1 / raw['config']['world'] / 1e6:.0f} MB",
                {"s_per_gb": [c0 / b0 * 1e9, c1 / b1 * 1e9], "fixed_s": c0 - slope * b0, "gb_s_marginal": 1e-9 / slope if slope > 0 else None},
                {"s_per_gb": [r0 / b0 * 1e9, r1 / b1 * 1e9], "ratio": (r1 / b1) / (r0 / b0), "what": "raw write (the faster way)",
                 "ckpt_ratio": (c1 / b1) / (c0 / b0)},
                ((c1 / b1) / (c0 / b0)) / max(1.0, (r1 / b1) / (r0 / b0)), [])
    rs = raw.get("reshard")
    if rs:
        a = [x["s"] for x in rs["resharded"]]
        b = [x["s"] for x in rs["same"]]
        add("reshard", "local", f"{rs['bytes'][0] / 1e6:.0f} / {rs['bytes'][1] / 1e6:.0f} MB in 1 process",
            {"s": spread(a), "what": "saved by 2, restored by 1"}, {"s": spread(b), "what": "saved by 1, restored by 1"},
            _med(a) / _med(b), rs["resharded"] + rs["same"])
    leak = raw.get("leak")
    def window(xs: list[dict[str, Any]], key: str, point: int) -> dict[str, Any]:
        return {"bytes": _med([x[key] for x in xs]), "saves": f"{xs[0]['save']}-{xs[-1]['save']}", "point": xs[point][key]}

    control = raw.get("leak_control")
    if leak:
        for rank, series in enumerate(leak["per_rank"]):
            for key, name in (("vmrss", "trainer VmRSS"), ("tree_pss", "PSS trainer+children")):
                # saves 3-7 (and the 5th alone), the last five (and the last alone)
                a, b = window(series[-5:], key, -1), window(series[2:7], key, 2)
                add("memory", "local", f"rank {rank}, {name}", a, b, a["bytes"] / b["bytes"] - 1, [])
                if control:  # the same loop without saves: training's own drift
                    cs = control["per_rank"][rank]
                    ca, cb = window(cs[-5:], key, -1), window(cs[2:7], key, 2)
                    add("memory", "local", f"rank {rank}, {name}, no saves (control)", ca, cb, ca["bytes"] / cb["bytes"] - 1, [])
            a = {"kb_per_save": _slope([x["vmrss"] for x in series[5:]]) / 1024, "saves": f"6-{series[-1]['save']}"}
            b = {"kb_per_save": _slope([x["vmrss"] for x in control["per_rank"][rank][5:]]) / 1024 if control else math.nan}
            add("growth", "local", f"rank {rank}, trainer VmRSS", a, b, a["kb_per_save"] - b["kb_per_save"], [])
    return {**raw, "rows": rows}


def _s(d: dict[str, float]) -> str:
    return f"{d['median']:.2f} s [{d['min']:.2f}..{d['max']:.2f}]" if d.get("n") else "-"


def table(result: dict[str, Any]) -> str:
    cfg, m = result["config"], result["machine"]
    load = result["load"].get("others_cores_whole_run")
    head = [
        f"persist: {cfg['world']} ranks (gloo), sizes {', '.join(f'{s:g}' for s in cfg['sizes_mb'])} MB of state per rank, "
        f"runs each: {', '.join(f'{n} {s}' for s, n in cfg['repeats'].items())} (ckpt and raw alternating), "
        f"local reads {cfg['cache']}; {result['wall_s'] / 60:.1f} min",
        f"machine: {m['nproc']} cores, {m['cpu_model']}, {m['mem_total_gb']} GB, local dir on {m.get('fs_type', '?')}; "
        f"other processes used {load or 0:.2f} cores on average during the run",
        f"ckpt: {cfg['ckpt_source'].get('git_commit', '?')[:10]}{' (ckpt/ edited)' if cfg['ckpt_source'].get('ckpt_dir_edited') else ''}, "
        f"torch {cfg['torch']}; medians [min..max] over runs",
        *([f"memory check: {cfg['leak_saves']} saves, {cfg['leak_steps']} step(s) each; read "
           + ("after glibc's malloc_trim(0) (memory in use)" if cfg.get("malloc_trim") else "as is (--no-malloc-trim)")]
          if cfg.get("leak_saves") else []),
        "",
    ]
    cols = ["check", "store", "size per rank", "ckpt", "baseline", "ratio", "target", "", "others"]
    lines = [cols]
    for r in result["rows"]:
        c, b, ch = r["ckpt"], r["baseline"], r["check"]
        if ch in ("persist", "restore"):
            cell_c = f"{c['mb_s']:.0f} MB/s, {_s(c['s'])}"
            cell_b = f"{b['what']}: {b['mb_s']:.0f} MB/s, {_s(b['s'])}"
            ratio = f"{r['ratio']:.2f}"
        elif ch == "linear":
            cell_c = (f"{c['s_per_gb'][0]:.2f} -> {c['s_per_gb'][1]:.2f} s/GB ({c['s_per_gb'][1] / c['s_per_gb'][0]:.2f}), "
                      f"fixed {c['fixed_s'] * 1e3:.0f} ms/save")
            cell_b = f"raw: {b['s_per_gb'][0]:.2f} -> {b['s_per_gb'][1]:.2f} s/GB ({b['ratio']:.2f})"
            ratio = f"{r['ratio']:.2f}"
        elif ch == "reshard":
            cell_c, cell_b, ratio = f"2->1: {_s(c['s'])}", f"1->1: {_s(b['s'])}", f"{r['ratio']:.2f}x"
        elif ch == "growth":
            cell_c = f"saves {c['saves']}: {c['kb_per_save']:+.0f} KB/save"
            cell_b = f"no saves (control): {b['kb_per_save']:+.0f} KB/save"
            ratio = f"{r['ratio']:+.0f} KB"
        else:
            cell_c = f"saves {c['saves']}: {c['bytes'] / 1e6:.0f} MB (last {c['point'] / 1e6:.0f})"
            cell_b = f"saves {b['saves']}: {b['bytes'] / 1e6:.0f} MB (5th {b['point'] / 1e6:.0f})"
            ratio = f"{r['ratio'] * 100:+.1f} %"
        verdict = "-" if r["ok"] is None else "ok" if r["ok"] else "MISS"
        lines.append([ch, r["store"], r["size"], cell_c, cell_b, ratio, r["target"], verdict,
                      "-" if r["others_cores"] is None else f"{r['others_cores']:.2f}"])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(cols))]
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    body.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    tail = [""] + [f"ratio of {k}: {v[0]}" for k, v in TARGETS.items()]
    for r in result["rows"]:
        if "ranged_s" in r["baseline"]:
            tail.append(f"restore ({r['store']}, {r['size']}) against a raw read in ckpt's ranged GETs (diagnostic): "
                        f"{_s(r['baseline']['ranged_s'])}, ratio {r['baseline']['ranged_ratio']:.2f}")
    for sz in result["sizes"]:
        for store, r in sz["stores"].items():
            f = r["first_save"]
            tail.append(f"first save ({store}, {sz['size_mb']:g} MB, not in the medians): persisted in {f['persist_s']:.2f} s, "
                        f"blocked {f['blocking_s'] * 1e3:.0f} ms")
    tail += [f"FAILED: {x}" for x in result.get("failures", [])]
    return "\n".join(head + body + tail)


def print_report(result: dict[str, Any]) -> None:
    print()
    print(table(result))


# ============================================================================================
# The stores, seen the plain way (the raw baseline)
# ============================================================================================


class Place:
    """One store, as a ckpt root URL and through plain I/O: a local directory (open, write,
    fsync) or the moto S3 bucket (s3fs). Paths are relative to its base."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        self.kind = kind
        if kind == "local":
            self.base, self.options, self.fs = str(Path(args.dir).resolve() / "local"), None, None
        else:
            self.base = f"s3://{args.bucket}"
            self.options = {"endpoint_url": args.s3_endpoint, "key": S3_KEY, "secret": S3_SECRET}
            self.fs = s3fs_for(args.s3_endpoint)

    def url(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    def _path(self, rel: str) -> str:
        return self.url(rel) if self.fs is None else f"{self.base[len('s3://'):]}/{rel}"

    @property
    def ways(self) -> list[str]:
        """The plain ways to write a file here: s3fs has two, which differ on large files
        (pipe_file uploads up to 10 parts at once, a file opened "wb" one part at a time)."""
        return ["write"] if self.fs is None else ["pipe_file", "open"]

    def write(self, rel: str, data: bytes, way: str = "write") -> None:
        """A new file, durable on return: fsync'd, or a completed PUT (multipart when large)."""
        path = self._path(rel)
        if way == "pipe_file":
            self.fs.pipe_file(path, data)
            return
        if way == "open":
            with self.fs.open(path, "wb") as f:
                f.write(data)
            return
        with open(path, "wb", buffering=0) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
            os.fsync(f.fileno())

    def makedirs(self, rel: str) -> None:
        if self.fs is None:
            os.makedirs(self._path(rel), exist_ok=True)

    def sync_dir(self, rel: str) -> None:
        """Make the directory's entries durable (local; an object store has no directories)."""
        if self.fs is None:
            fd = os.open(self._path(rel), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self, rel: str, buf: bytearray) -> int:
        """Read a whole file into memory: into `buf` locally, as one GET on S3."""
        if self.fs is not None:
            return len(self.fs.cat_file(self._path(rel)))
        got, view = 0, memoryview(buf)
        with open(self._path(rel), "rb", buffering=0) as f:
            while n := f.readinto(view[got:]):
                got += n
        return got

    def read_ranged(self, rel: str) -> int:
        """S3: a whole file read as ckpt reads it, in ranged GETs of its read size, as many in
        flight as its reader keeps (a diagnostic: moto builds the whole object's body for each
        ranged GET, then slices it, which a real S3 does not)."""
        import ckpt

        t = ckpt.Transfer()
        path, size = self._path(rel), self.fs.size(self._path(rel))
        ranges = [(a, min(a + t.read_size, size)) for a in range(0, size, t.read_size)]
        with concurrent.futures.ThreadPoolExecutor(t.readahead + 1) as pool:
            return sum(len(b) for b in pool.map(lambda r: self.fs.cat_file(path, start=r[0], end=r[1]), ranges))

    def size(self, rel: str) -> int:
        return os.path.getsize(self._path(rel)) if self.fs is None else self.fs.size(self._path(rel))

    def remove(self, rel: str) -> None:
        if self.fs is None:
            shutil.rmtree(self._path(rel), ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._path(rel), recursive=True)

    def evict(self, rel: str) -> None:
        """Drop the files under `rel` from the page cache (local), so the next read is cold."""
        if self.fs is not None:
            return
        for dp, _, files in os.walk(self._path(rel)):
            for name in files:
                fd = os.open(os.path.join(dp, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def step_dir(step: int) -> str:
    return f"step-{step:010d}"  # the storage contract's layout (README)


# ============================================================================================
# Worker: the 2 ranks
# ============================================================================================


class Rank:
    """What every measurement needs: the rank, the model and optimizer, a training step."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.args, self.dist = args, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.t_log = time.monotonic()
        self.model: Any = None
        self.opt: Any = None

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"{TAG} {time.monotonic() - self.t_log:6.0f}s  {msg}", flush=True)

    def build(self, shape: dict[str, int]) -> dict[str, Any]:
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        sys.path.insert(0, str(stall.REPO / "examples"))
        from train_transformer import SEQ, VOCAB

        self.model, shape = stall.make_model(shape, self.world)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        g = torch.Generator().manual_seed(1000 + self.rank)
        self.batch = (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g))
        self.vocab = VOCAB
        for _ in range(3):  # the optimizer's state exists from here on
            self.train_step()
        leaves = stall.tensor_leaves(dict(zip(("model", "optim"), get_state_dict(self.model, self.opt), strict=True)))
        return {**shape, "state_bytes_per_rank": sum(t.numel() * t.element_size() for t in leaves), "tensors_per_rank": len(leaves)}

    def train_step(self) -> None:
        import torch.nn.functional as F

        x, y = self.batch
        F.cross_entropy(self.model(x).reshape(-1, self.vocab), y.reshape(-1)).backward()
        self.opt.step()
        self.opt.zero_grad()

    def checkpointer(self, place: Place, rel: str, **kw: Any) -> Any:
        import ckpt

        kw = {"interval": None, "save_on_exit": False, "handle_sigterm": False, "keep": ckpt.Keep(last=1000), **kw}
        return ckpt.Checkpointer(place.url(rel), model=self.model, optimizer=self.opt, storage_options=place.options, **kw)

    def gather(self, obj: Any) -> list[Any]:
        return stall.all_gather(obj) if self.world > 1 else [obj]

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()

    def timed(self, fn: Any) -> dict[str, Any]:
        """Run fn on every rank from a barrier; the slower rank's seconds, and fn's record."""
        self.barrier()
        t0, c0 = time.time(), time.perf_counter()
        rec = fn() or {}
        elapsed = time.perf_counter() - c0
        per_rank = self.gather(elapsed)
        return {"s": max(per_rank), "per_rank_s": per_rank, "t0": t0, "t1": time.time(), **rec}


def ckpt_save(r: Rank, cp: Any) -> dict[str, Any]:
    """One save, from save() to the commit: the manifest's persist_s (rank 0's clock, from
    the start of save() to the manifest written after every rank's files)."""
    cp.step_done()  # a new step: save() saves each step once

    def run() -> dict[str, Any]:
        cp.save()
        cp.wait()
        c = cp.last_commit.costs
        return {"persist_s": c.persist_s, "blocking_s": c.blocking_s, "bytes": c.bytes, "step": cp.last_commit.step}

    rec = r.timed(run)
    rec["persist_s"] = r.gather(rec["persist_s"])[0]  # rank 0's measurement, the one committed
    return rec


def raw_write(r: Rank, place: Place, rel: str, layout: dict[str, Any], blobs: dict[str, bytes], way: str) -> dict[str, Any]:
    """The same files written the plain way: every rank its own, durable, then (after a
    barrier, as ckpt's commit comes after every rank's files) rank 0 the files written for
    all (DCP's .metadata, the manifest), then the directory entries."""

    def run() -> None:
        place.makedirs(rel)
        for name in layout["by_rank"][r.rank]:
            place.write(f"{rel}/{name}", blobs[name], way)
        place.sync_dir(rel)
        r.barrier()
        if r.rank == 0:
            for name in layout["after"]:
                place.write(f"{rel}/{name}", blobs[name], way)
            place.sync_dir(rel)
            place.sync_dir(os.path.dirname(rel))

    return {**r.timed(run), "way": way}


def raw_read(r: Rank, place: Place, rel: str, layout: dict[str, Any], buf: bytearray, ranged: bool = False) -> dict[str, Any]:
    """The checkpoint's own files read into memory, each rank those it wrote (`ranged`: on S3,
    in ranged GETs as ckpt reads them)."""
    names = layout["by_rank"][r.rank] + (layout["after"] if r.rank == 0 else [])
    read = (lambda n: place.read_ranged(f"{rel}/{n}")) if ranged else (lambda n: place.read(f"{rel}/{n}", buf))
    rec = r.timed(lambda: {"bytes": sum(read(n) for n in names)})
    rec["bytes"] = sum(r.gather(rec["bytes"]))
    return rec


def ckpt_restore(r: Rank, place: Place, rel: str, step: int) -> dict[str, Any]:
    """Entering a Checkpointer that restores the latest checkpoint (discovery, verification,
    load into the model and optimizer): what a restarted job waits for."""
    cp = r.checkpointer(place, rel, restore="latest")

    def enter() -> None:
        cp.__enter__()

    rec = r.timed(enter)
    cp.__exit__(None, None, None)
    if cp.restored_step != step:
        raise RuntimeError(f"restored step {cp.restored_step} from {place.url(rel)}, expected {step}")
    return rec


def file_layout(r: Rank, place: Place, rel: str, manifest: Any) -> dict[str, Any]:
    """Who writes which file of a checkpoint, and their sizes, from its manifest."""
    sizes = {name: e.size for name, e in manifest.files.items()}
    sizes["manifest.json"] = place.size(f"{rel}/manifest.json")
    by_rank: list[list[str]] = [[] for _ in range(r.world)]
    after = []
    for name, e in manifest.files.items():
        (by_rank[e.rank] if 0 <= e.rank < r.world else after).append(name)
    return {"sizes": sizes, "by_rank": by_rank, "after": sorted(after) + ["manifest.json"]}


def bench_store(r: Rank, place: Place, size_mb: float, keep_root: bool) -> dict[str, Any]:
    """Checks a) and b) on one store at one size: saves against raw writes, then restores of
    the last save against raw reads of its files, alternating."""
    root, raw_root = f"ckpt-{size_mb:g}mb", f"raw-{size_mb:g}mb"
    repeats = r.args.repeats_by_store[place.kind]
    if r.rank == 0:  # fresh: what an earlier run left must not change this one
        place.remove(root)
        place.remove(raw_root)
    r.barrier()
    out: dict[str, Any] = {"saves": [], "raw_writes": [], "restores": [], "raw_reads": []}
    cp = r.checkpointer(place, root, restore="none")
    cp.__enter__()
    try:
        out["first_save"] = first = ckpt_save(r, cp)  # buffers, writer, plan: reported apart
        layout = file_layout(r, place, f"{root}/{step_dir(first['step'])}", cp.last_commit)
        mine = layout["by_rank"][r.rank] + (layout["after"] if r.rank == 0 else [])
        blobs = {name: os.urandom(layout["sizes"][name]) for name in mine}
        out.update(bytes=first["bytes"], files=layout)
        last = {"ckpt": f"{root}/{step_dir(first['step'])}"}
        out["first_raw_writes"] = []
        for way in place.ways:  # the first of each way, untimed too
            last[way] = f"{raw_root}/{way}-0"
            out["first_raw_writes"].append(raw_write(r, place, last[way], layout, blobs, way))
        kinds = ["ckpt", *place.ways]
        for i in range(repeats):
            for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:  # who goes first rotates
                if r.rank == 0:  # the previous one goes, untimed: one at a time on the store
                    place.remove(last[kind])
                if kind == "ckpt":
                    r.barrier()
                    rec = ckpt_save(r, cp)
                    out["saves"].append(rec)
                    last["ckpt"] = f"{root}/{step_dir(rec['step'])}"
                else:
                    last[kind] = f"{raw_root}/{kind}-{i + 1}"
                    out["raw_writes"].append(raw_write(r, place, last[kind], layout, blobs, kind))
        if r.rank == 0:
            place.remove(raw_root)
        step = cp.last_commit.step
    finally:
        cp.__exit__(None, None, None)
    del cp, blobs
    gc.collect()
    r.log(f"{place.kind} {size_mb:g} MB: persist ckpt {_med([x['persist_s'] for x in out['saves']]):.2f} s, "
          f"raw {_med([x['s'] for x in out['raw_writes']]):.2f} s")
    buf = bytearray(b"\x01") * max(layout["sizes"][n] for n in mine)  # touched once, reused
    # On S3 also a diagnostic raw read in the ranged GETs ckpt's reader makes.
    kinds = ["ckpt", "raw"] + (["ranged"] if place.fs is not None else [])
    for i in range(repeats):
        for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:  # who goes first rotates
            if r.args.cache == "cold" and r.rank == 0:
                place.evict(last["ckpt"])
            if kind == "ckpt":
                out["restores"].append(ckpt_restore(r, place, root, step))
            elif kind == "raw":
                out["raw_reads"].append(raw_read(r, place, last["ckpt"], layout, buf))
            else:
                out.setdefault("raw_ranged_reads", []).append(raw_read(r, place, last["ckpt"], layout, buf, ranged=True))
    r.log(f"{place.kind} {size_mb:g} MB: restore ckpt {_med([x['s'] for x in out['restores']]):.2f} s, "
          f"raw read {_med([x['s'] for x in out['raw_reads']]):.2f} s")
    if r.rank == 0 and not keep_root:
        place.remove(root)
    r.barrier()
    return out


def memory_now() -> dict[str, Any]:
    """This process's memory, its child processes' (a writer process, say), and /dev/shm."""
    st = stall._status()
    kids = stall.descendants(os.getpid())
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "vmrss": st.get("VmRSS", 0),
        "rss_anon": st.get("RssAnon", 0),
        "rss_shmem": st.get("RssShmem", 0),
        "children": len(kids),
        "children_rss": sum(stall._status(k).get("VmRSS", 0) for k in kids),
        # PSS splits a shared page among the processes that map it: the sum counts it once.
        "tree_pss": sum(_pss(p) for p in ["self", *kids]),
        "dev_shm_used": (shm.f_blocks - shm.f_bfree) * shm.f_frsize if shm else 0,
    }


def _pss(pid: int | str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def leak_check(r: Rank, place: Place, n: int, steps: int, control: bool = False, trim: bool = False) -> dict[str, Any]:
    """Check d): n saves in a row, `steps` training steps while each one writes, retention on
    (Keep(last=2)), as in training; memory after each commit. With `control`, the same loop
    without the saves: how much training alone moves the same numbers. With `trim`, glibc's
    malloc_trim(0) before each reading: what is left is memory still in use, not free memory
    the allocator keeps."""
    import ckpt

    release = _malloc_trim() if trim else None

    root = "leak"
    if r.rank == 0:
        place.remove(root)
    r.barrier()
    series = []
    with r.checkpointer(place, root, restore="none", keep=ckpt.Keep(last=2)) as cp:
        for i in range(1, n + 1):
            t = time.perf_counter()
            if not control:
                cp.save()
            for _ in range(steps):  # the write runs while these train
                r.train_step()
                cp.step_done()
            cp.wait()
            if release is not None:
                release(0)
            persist_s = cp.last_commit.costs.persist_s if cp.last_commit else 0.0
            series.append({"save": i, "s": time.perf_counter() - t, "persist_s": persist_s, **memory_now()})
            if i % 10 == 0:
                r.log(f"memory check: save {i}/{n}, trainer VmRSS {series[-1]['vmrss'] / 1e6:.0f} MB")
    if r.rank == 0:
        place.remove(root)
    return {"saves": n, "steps_between": steps, "per_rank": r.gather(series)}


def worker(args: argparse.Namespace) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    r = Rank(args)
    places = {kind: Place(kind, args) for kind in args.stores}
    if "local" in places:
        os.makedirs(places["local"].base, exist_ok=True)
    raw: dict[str, Any] = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {"world": r.world, "sizes_mb": args.sizes, "repeats": args.repeats_by_store, "stores": args.stores,
                   "cache": args.cache, "leak_saves": args.leak_saves, "leak_steps": args.leak_steps,
                   "malloc_trim": args.malloc_trim and _malloc_trim() is not None,
                   "reshard_size_mb": args.reshard_size_mb, "torch": torch.__version__, "ckpt_source": stall.ckpt_source(),
                   "dir": args.dir},
        "sizes": [],
    }

    def checkpoint_results() -> None:  # after each part, so a later failure keeps the earlier ones
        if r.rank == 0:
            write_json(Path(args.dir) / "raw.json", raw)

    for size in args.sizes:
        shape = r.build(stall.model_shape(size, r.world))
        r.log(f"{size:g} MB: {shape['state_bytes_per_rank'] / 1e6:.1f} MB of state per rank in "
              f"{shape['tensors_per_rank']} tensors (d={shape['d']}, {shape['layers']} layers)")
        rec = {"size_mb": size, "shape": shape, "stores": {}}
        raw["sizes"].append(rec)
        for kind, place in places.items():
            keep = kind == "local" and size == args.reshard_size_mb
            rec["stores"][kind] = bench_store(r, place, size, keep_root=keep)
            if keep:
                raw["reshard_from"] = {"root": f"ckpt-{size:g}mb", "shape": shape, "size_mb": size}
            checkpoint_results()
        if args.leak_saves and size == min(args.sizes):
            place = places.get("local") or next(iter(places.values()))
            raw["leak_control"] = leak_check(r, place, args.leak_saves, args.leak_steps, control=True,
                                            trim=args.malloc_trim)
            raw["leak"] = leak_check(r, place, args.leak_saves, args.leak_steps, trim=args.malloc_trim)
            checkpoint_results()
        r.model = r.opt = None
        gc.collect()
    r.barrier()
    dist.destroy_process_group()


# ============================================================================================
# Worker: the 1-process restore of a 2-rank checkpoint (check c)
# ============================================================================================


def single(args: argparse.Namespace) -> None:
    """Restore the 2-rank checkpoint into one process (FSDP2 on one rank, the same model),
    against a checkpoint of the same state saved and restored by this one process."""
    import logging
    import warnings

    import torch.distributed as dist

    logging.basicConfig(level=logging.ERROR)  # the reshard warning, once per restore
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    r = Rank(args)
    place = Place("local", args)
    d, layers, heads = (int(x) for x in args.shape.split(","))
    r.build({"d": d, "layers": layers, "heads": heads})
    same = "same-1rank"
    place.remove(same)
    with r.checkpointer(place, same, restore="none") as cp:
        r.train_step()
        cp.step_done()
        cp.save(blocking=True)
        same_manifest = cp.last_commit
    froms = {"resharded": args.from_root, "same": same}
    out: dict[str, Any] = {"resharded": [], "same": [], "bytes": []}
    for kind in froms:
        cp = r.checkpointer(place, froms[kind], restore="latest")
        with cp:
            out["bytes"].append(cp.last_commit.total_bytes)
            out[f"{kind}_world_size"] = cp.last_commit.world_size
        out[f"{kind}_step"] = cp.restored_step
    out["same_saved_bytes"] = same_manifest.total_bytes
    r.log(f"1 process: {out['bytes'][0] / 1e6:.0f} MB saved by {out['resharded_world_size']} ranks, "
          f"{out['bytes'][1] / 1e6:.0f} MB saved by 1 (warm-up restores done)")
    for i in range(args.repeats_by_store["local"]):
        for kind in ("resharded", "same") if i % 2 == 0 else ("same", "resharded"):
            if args.cache == "cold":
                place.evict(froms[kind])
            out[kind].append(ckpt_restore(r, place, froms[kind], out[f"{kind}_step"]))
    r.log(f"1 process: restore 2->1 {_med([x['s'] for x in out['resharded']]):.2f} s, "
          f"1->1 {_med([x['s'] for x in out['same']]):.2f} s")
    place.remove(same)
    write_json(Path(args.dir) / "single.json", out)
    dist.destroy_process_group()


def write_json(path: Path, obj: Any) -> None:
    """All of it or nothing: the launcher may read the file after this process died."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.show:
        print_report(json.loads(Path(args.show).read_text()))
        return 0
    if args.worker == "ranks":
        worker(args)
        return 0
    if args.worker == "single":
        single(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
