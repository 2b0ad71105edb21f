#!/usr/bin/env python
"""The stall benchmark of issue 4: what one checkpoint costs a training loop, ckpt against its peers.

    .venv/bin/python bench/stall.py                  # 100 MB of state per rank, 2 ranks (gloo)
    .venv/bin/python bench/stall.py --size-mb 1000   # 1 GB per rank
    .venv/bin/python bench/stall.py --many-small     # ~10,000 small tensors per rank
    .venv/bin/python bench/stall.py --device cuda --size-mb 1000   # on GPUs (bench/gpu_check.sh)

One command starts 2 ranks (gloo on loopback, this file again with RANK/WORLD_SIZE/MASTER_*
set) and prints the table; the numbers and every raw per-save measurement go to
bench/results/stall-<mode>.json (stall-100mb, stall-1000mb, stall-many-small; stall-cuda-<size>mb
on GPUs), the current result of that mode, replaced. See bench/README.md for what each column means.

Every rank trains the same FSDP2 transformer (the shape of examples/train_transformer.py,
wider and deeper) with AdamW, and every peer saves exactly the state that training holds:
`get_state_dict(model, opt)`. The peers run one after the other in the same processes, each
between two baseline loops (the same loop without saves), so drift in the machine's load
shows up as a difference between the two baselines, not as a cost of a peer.

Per peer: setup, one warm-up save (reported apart: spawns, buffer allocation, plan), then
`--saves` timed segments. A segment is: save, `K` training steps, wait for the commit. The
segment's time minus the median baseline segment (K steps, no save) is the save's whole cost to
the loop; the part spent inside the save call (and waiting for staging before
`optimizer.step()`) is its blocking time, the part spent waiting for the commit at the end of
the segment is its tail wait, and the rest is step-time inflation: the steps ran slower while
the write ran in the background.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS = ["floor", "ckpt", "dcp_sync", "dcp_thread", "dcp_process", "tc", "tc_fsync", "naive"]
CUDA_PEERS = ["floor", "ckpt"]  # the peers configured for --device cuda
DESCRIBE = {
    "floor": "one copy_ into preallocated host buffers (no write)",
    "ckpt": "ckpt.Checkpointer.save() (async, public API)",
    "dcp_sync": "torch.distributed.checkpoint.save (sync)",
    "dcp_thread": "dcp.async_save, thread mode",
    "dcp_process": "dcp.async_save, process mode, caching DefaultStager (shm)",
    "tc": "torch_checkpointing 0.1.1 CheckpointManager (CPU config, no fsync)",
    "tc_fsync": "torch_checkpointing, + fsync in pre_finalize_callback",
    "naive": "full state dict to rank 0, torch.save + fsync",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=100.0, help="state (params + AdamW moments) per rank, MB (default 100)")
    p.add_argument("--many-small", action="store_true", help="a narrow, deep model: ~10,000 small tensors per rank")
    p.add_argument("--saves", type=int, default=None, help="timed saves per peer (default 6; 3 at >= 500 MB and with --many-small)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="training time between saves, rounded up to whole steps (default: 1 s + 6 ms per MB of state; 6 s with --many-small)")
    p.add_argument("--peers", default=None, help=f"comma-separated subset of {','.join(PEERS)} (default: all; with "
                   f"--device cuda {','.join(CUDA_PEERS)})")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a fresh dir under /tmp)")
    p.add_argument("--out", default=None, help="the JSON results file (default bench/results/stall-<mode>.json, replaced)")
    p.add_argument("--order", choices=["rounds", "phases"], default=None,
                   help="rounds (default below 500 MB): all peers set up at once, one save of each per "
                   "round, so the machine's load weighs on all alike; phases (default from 500 MB): "
                   "one peer after the other, each alone in memory (every peer holds a copy of the "
                   "state: 8 copies of 1 GB per rank would not fit a 24 GB machine)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (of 32 tokens)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model trains: cpu (default; gloo) or cuda (one GPU per rank, nccl for "
                   "the model, pinned host buffers for the floor; peers floor and ckpt only)")
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2; with cuda at most the GPU count)")
    p.add_argument("--show", metavar="JSON", help="print the table of an earlier run's results file and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    allowed = CUDA_PEERS if args.device == "cuda" else PEERS
    args.peers = [x for x in (args.peers or ",".join(allowed)).split(",") if x]
    for x in args.peers:
        if x not in allowed:
            p.error(f"peer {x!r} is not available with --device {args.device}; choose from {allowed}")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.many_small:
        args.size_mb = 16.0  # what the narrow model holds; reported exactly below
    if args.order is None:
        args.order = "phases" if args.size_mb >= 500 else "rounds"
    if args.saves is None:
        args.saves = 3 if (args.size_mb >= 500 or args.many_small) else 6
    if args.interval_s is None:
        # long enough for the slowest peer's background write to finish within it, mostly;
        # with 10,000 tensors every peer takes seconds per save
        args.interval_s = 6.0 if args.many_small else 1.0 + 0.006 * args.size_mb
    return args


# ============================================================================================
# /proc readings (Linux)
# ============================================================================================


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssShmem", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_hwm(pid: int | str = "self") -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def _stat_fields(path: str) -> list[str]:
    text = Path(path).read_text()
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) "


def proc_cpu(pid: int | str = "self", children_too: bool = True) -> float:
    """utime+stime (+ reaped children's) in seconds."""
    f = _stat_fields(f"/proc/{pid}/stat")
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children_too else 0)
    return ticks / CLK_TCK


def thread_sched(tid: int) -> tuple[float, float]:
    """(seconds on CPU, seconds runnable but waiting for a CPU) of one thread."""
    try:
        on, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return int(on) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return math.nan, math.nan


def descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent[int(d)] = int(_stat_fields(f"/proc/{d}/stat")[1])
    out, frontier = [], [root]
    while frontier:
        nxt = [pid for pid, pp in parent.items() if pp in frontier]
        out += nxt
        frontier = nxt
    return out


def tree_cpu(root: int) -> float:
    """CPU seconds of root's descendants, alive or reaped (root's own time not counted)."""
    f = _stat_fields(f"/proc/{root}/stat")
    total = (int(f[13]) + int(f[14])) / CLK_TCK
    for pid in descendants(root):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += proc_cpu(pid)
    return total


def system_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = _meminfo()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_total_gb": round(mem.get("MemTotal", 0) / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def dir_bytes(path: Path) -> int:
    total = 0
    for dp, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dp, f))
    return total


# ============================================================================================
# Launcher: starts the ranks, watches the machine's load, prints and writes the results
# ============================================================================================


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < args.ranks:
            print(f"[stall] --device cuda needs {args.ranks} GPU(s) (one per rank); torch {torch.__version__} "
                  f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 'no usable'} GPU", file=sys.stderr)
            return 2
    mode = "many-small" if args.many_small else f"{args.size_mb:g}mb"
    out, work, made_dir = run_paths("stall", f"stall-{'cuda-' if args.device == 'cuda' else ''}{mode}", args.out, args.dir)
    raw_path = work / "raw.json"
    with contextlib.suppress(FileNotFoundError):
        raw_path.unlink()
    t_start = time.time()
    samples: list[tuple[float, float, float]] = []
    codes = run_ranks(
        Path(__file__).resolve(), [*argv, "--worker", "--dir", str(work)], args.ranks, work, samples, f"[stall] {mode}"
    )
    if any(codes) or not raw_path.exists():
        print_log_tails(work, args.ranks)
        print(f"[stall] a rank failed (exit codes {codes}); no results; logs under {work}", file=sys.stderr)
        return 1
    raw = json.loads(raw_path.read_text())
    raw["machine"] = machine()
    raw["command"] = " ".join([Path(sys.executable).name, "bench/stall.py", *argv])
    raw["wall_s"] = time.time() - t_start
    raw["load"] = _load_report(samples, raw)
    result = summarize(raw)
    out.write_text(json.dumps(result, indent=1))
    print_report(result)
    print(f"\n[stall] results: {out}")
    if made_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_paths(bench: str, stem: str, out: str | None, work: str | None) -> tuple[Path, Path, bool]:
    """The results file (`out`, or bench/results/<stem>.json: the current result of that
    configuration, replaced; the ones before stay in git) and the work directory (`work`, or a
    fresh one under /tmp), both made; True when the work directory was made here (to delete
    after a run that went well)."""
    out_path = Path(out) if out else HERE / "results" / f"{stem}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work_path = Path(work) if work else Path(tempfile.mkdtemp(prefix=f"ckpt-{bench}-", dir="/tmp"))
    work_path.mkdir(parents=True, exist_ok=True)
    return out_path, work_path, work is None


def run_ranks(
    script: Path,
    argv: list[str],
    world: int,
    work: Path,
    samples: list[tuple[float, float, float]],
    label: str,
    env: dict[str, str] | None = None,
    log: str = "rank",
) -> list[int]:
    """Run `script argv` as `world` ranks on loopback (RANK/WORLD_SIZE/MASTER_* set, one
    intra-op thread each), their output in `work/<log><rank>.log`; echo rank 0's progress
    lines (those starting with `label`'s tag) and append (time, machine busy CPU s, our tree's
    CPU s) to `samples` every 0.5 s. If a rank fails the others are killed (they would wait
    in a collective forever). Returns the exit codes."""
    port, procs = free_port(), []
    for rank in range(world):
        penv = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",  # one intra-op thread per rank: 2 ranks on 2 cores
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        # The peers' writer processes log freely; their output goes to the rank's log file.
        with open(work / f"{log}{rank}.log", "wb") as logf:
            procs.append(subprocess.Popen([sys.executable, str(script), *argv], env=penv, stdout=logf, stderr=subprocess.STDOUT))
    print(f"{label}: {world} ranks started (pids {[p.pid for p in procs]}), checkpoints and logs under {work}", flush=True)
    progress = _Follow(work / f"{log}0.log", label.split()[0].encode())
    # The machine is shared: sample every CPU second spent, ours and others', to report the load.
    me = os.getpid()
    failed = None
    while any(p.poll() is None for p in procs):
        samples.append((time.time(), system_busy(), tree_cpu(me)))
        progress.show()
        for p in procs:
            if p.poll() not in (None, 0) and failed is None:
                failed = p
                for q in procs:  # a rank died: the other would wait in a collective forever
                    if q.poll() is None:
                        q.kill()
        time.sleep(0.5)
    samples.append((time.time(), system_busy(), tree_cpu(me)))
    progress.show()
    return [p.returncode for p in procs]


def print_log_tails(work: Path, world: int, log: str = "rank") -> None:
    for rank in range(world):
        with contextlib.suppress(OSError):
            tail = (work / f"{log}{rank}.log").read_text(errors="replace").splitlines()[-30:]
            print(f"--- {log} {rank} log (last lines) ---", *tail, sep="\n", file=sys.stderr)


class _Follow:
    """Echo the progress lines ("[stall] ...", or another tag) rank 0 writes to its log."""

    def __init__(self, path: Path, tag: bytes = b"[stall]") -> None:
        self.path, self.pos, self.partial, self.tag = path, 0, b"", tag

    def show(self) -> None:
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
            self.pos += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.startswith(self.tag) or b"Error" in line or b"Traceback" in line:
                print(line.decode(errors="replace"), flush=True)


def others_cores(samples: list[tuple[float, float, float]], t0: float, t1: float) -> float | None:
    """Cores used on average by processes outside our tree between t0 and t1 (None: too
    few samples in the window)."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return None
    (a, busy0, ours0), (b, busy1, ours1) = inside[0], inside[-1]
    return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / (b - a)) if b > a else None


def _load_report(samples: list[tuple[float, float, float]], raw: dict[str, Any]) -> dict[str, Any]:
    """CPU cores used by other processes on the machine, over the run and per phase."""
    out: dict[str, Any] = {
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "others_cores_whole_run": others_cores(samples, samples[0][0], samples[-1][0]),
    }
    for ph in raw["phases"]:
        if ph["kind"] == "peer" and ph.get("saves"):
            vals = [others_cores(samples, x["t_end"] - x["seg_s"] - 0.5, x["t_end"] + 0.5) for x in ph["saves"]]
            vals = [v for v in vals if v is not None]
            ph["others_cores"] = statistics.fmean(vals) if vals else None
    return out


# ============================================================================================
# Summary and the table
# ============================================================================================


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def _spread(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs), "n": len(xs)}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    rows = []
    peers = [ph for ph in raw["phases"] if ph["kind"] == "peer"]
    # the trainer's RSS with no peer's buffers: model, gradients, optimizer state
    base_rss = min((ph["rss_before_setup"] for ph in peers if "rss_before_setup" in ph), default=0)
    for ph in peers:
        row: dict[str, Any] = {"peer": ph["peer"], "what": DESCRIBE[ph["peer"]]}
        if ph.get("error"):
            row["error"] = ph["error"]
            row["saves_done"] = len(ph.get("saves", []))
            rows.append(row)
            continue
        saves, bases = ph["saves"], ph["bases"]
        # Each save segment against the two baseline segments around it (K steps, no save):
        # the machine's load drifts over seconds, and this cancels most of it.
        overhead = [x["seg_s"] - b for x, b in zip(saves, ph["around"], strict=True)]
        inflation = [o - x["blocking_s"] - x["tail_wait_s"] for o, x in zip(overhead, saves, strict=True)]

        def extra(key: str, avg: Any = statistics.fmean, saves: Any = saves, bases: Any = bases) -> float:
            return avg([x[key] for x in saves]) - avg([b[key] for b in bases])

        transient = max(0, extra("rss_rise", _med))
        row.update(
            {
                "blocking_s": _spread([x["blocking_s"] for x in saves]),
                "inflation_s": _spread(inflation),
                "overhead_s": _spread(overhead),
                "tail_wait_s": _spread([x["tail_wait_s"] for x in saves]),
                "e2e_s": _spread([x["e2e_s"] for x in saves]),
                "first_save": ph["first"],
                "setup_s": ph["setup_s"],
                "baseline_seg_s": _spread([b["seg_s"] for b in bases]),
                "save_seg_s": _spread([x["seg_s"] for x in saves]),
                "steps_per_segment": raw["config"]["K"],
                "bytes_per_rank": ph["bytes_per_rank"],
                # memory of the trainer process (the larger rank)
                "rss_held_bytes": ph["rss_held"],
                "rss_transient_bytes": transient,
                "rss_first_save_peak_bytes": ph["rss_first_peak"],
                "peak_rss_bytes": base_rss + max(ph["rss_first_peak"], ph["rss_held"] + transient),
                "helper_procs": ph["helper_procs"],
                "helper_procs_hwm_bytes": max([x["helpers_hwm"] for x in saves] + [ph["first"]["helpers_hwm"]]),
                # CPU seconds per save beyond a segment without a save (mean of the ranks)
                "bg_threads_cpu_per_save_s": extra("bg_cpu_s"),
                "bg_threads_sys_cpu_per_save_s": extra("bg_sys_cpu_s"),
                "helper_procs_cpu_per_save_s": extra("helper_cpu_s"),
                # of the background threads' CPU: ckpt's staging copies (the floor's copy)
                "staging_copy_cpu_per_save_s": extra("copy_cpu_s"),
                "main_thread_cpu_extra_per_save_s": extra("main_cpu_s"),
                "main_thread_runq_extra_per_save_s": extra("main_runq_s", _med),
                "others_cores": ph.get("others_cores"),
                "notes": ph.get("notes", []),
            }
        )
        row["writer_cpu_per_save_s"] = row["bg_threads_cpu_per_save_s"] + row["helper_procs_cpu_per_save_s"]
        rows.append(row)
    by = {r["peer"]: r for r in rows if "error" not in r}
    ratios: dict[str, Any] = {"trainer_rss_without_peers_bytes": base_rss}
    if "ckpt" in by and "floor" in by:
        fl = by["floor"]["blocking_s"]["median"]
        ck = by["ckpt"]
        ratios["floor_copy_s"] = fl
        ratios["ckpt_blocking_over_floor_copy"] = ck["blocking_s"]["median"] / fl
        ratios["ckpt_inflation_over_floor_copy"] = ck["inflation_s"]["median"] / fl
        ratios["ckpt_writer_cpu_over_floor_copy"] = ck["writer_cpu_per_save_s"] / fl
        ratios["ckpt_staging_copy_cpu_over_floor_copy"] = ck.get("staging_copy_cpu_per_save_s", 0.0) / fl
        ratios["ckpt_writer_cpu_beyond_staging_over_floor_copy"] = (
            ck["writer_cpu_per_save_s"] - ck.get("staging_copy_cpu_per_save_s", 0.0)
        ) / fl
    others = [r for p, r in by.items() if p not in ("floor", "ckpt")]
    if "ckpt" in by and others:
        best = min(others, key=lambda r: r["overhead_s"]["median"])
        ratios["best_peer"] = best["peer"]
        ratios["best_peer_overhead_s"] = best["overhead_s"]["median"]
        if best["overhead_s"]["median"] > 0:  # (noise can make a cheap peer's median negative)
            ratios["ckpt_overhead_over_best_peer"] = by["ckpt"]["overhead_s"]["median"] / best["overhead_s"]["median"]
    return {
        "command": raw["command"],
        "when": raw["when"],
        "wall_s": raw["wall_s"],
        "machine": raw["machine"],
        "load": raw["load"],
        "config": raw["config"],
        "rows": rows,
        "ratios": ratios,
        "phases": raw["phases"],
    }


def _ms(d: dict[str, float] | float, spread: bool = True) -> str:
    if isinstance(d, dict):
        if d.get("n", 0) == 0:
            return "-"
        if not spread:
            return f"{d['median'] * 1e3:.0f}"
        return f"{d['median'] * 1e3:.0f} [{d['min'] * 1e3:.0f}..{d['max'] * 1e3:.0f}]"
    return "-" if d is None or math.isnan(d) else f"{d * 1e3:.0f}"


def table(result: dict[str, Any]) -> str:
    cfg, m = result["config"], result["machine"]
    head = [
        f"{cfg['mode']}: {cfg['state_mb_per_rank']:.1f} MB of state per rank in {cfg['tensors_per_rank']} tensors, "
        f"{cfg['world']} ranks ({_backends(cfg)}), {cfg['saves']} timed saves per peer ({cfg.get('order', 'rounds')}), K={cfg['K']} steps between saves "
        f"(step {cfg['step_s'] * 1e3:.0f} ms; model d={cfg['d']} layers={cfg['layers']}, {cfg['params'] / 1e6:.1f}M params)",
        f"machine: {m['nproc']} cores, {m['cpu_model']}, {m['mem_total_gb']} GB; other processes used "
        f"{(result['load']['others_cores_whole_run'] or 0):.2f} cores on average during the run",
        "times in ms, median [min..max] over saves (each save: the slower rank); "
        "overhead = the save's whole cost to the loop: its segment minus the mean of the baseline segments around it = blocking + inflation + tail wait",
        "",
    ]
    cols = ["peer", "blocking", "inflation", "overhead", "tail wait", "e2e commit", "1st save blk/e2e", "MB/rank",
            "peak RSS MB (held/transient)", "helpers MB", "writer CPU (sys)", "others"]
    lines = [cols]
    for r in result["rows"]:
        if "error" in r:
            lines.append([r["peer"], f"FAILED after {r['saves_done']} timed saves: " + r["error"][:90]] + [""] * (len(cols) - 2))
            continue
        fs = r["first_save"]
        lines.append(
            [
                r["peer"],
                _ms(r["blocking_s"]),
                _ms(r["inflation_s"]),
                _ms(r["overhead_s"]),
                _ms(r["tail_wait_s"], spread=False),
                _ms(r["e2e_s"]),
                f"{fs['blocking_s'] * 1e3:.0f}/{fs['e2e_s'] * 1e3:.0f}",
                f"{r['bytes_per_rank'] / 1e6:.0f}",
                f"{r['peak_rss_bytes'] / 1e6:.0f} ({r['rss_held_bytes'] / 1e6:.0f}/{r['rss_transient_bytes'] / 1e6:.0f})",
                f"{r['helper_procs_hwm_bytes'] / 1e6:.0f}" if r["helper_procs"] else "-",
                f"{_ms(r['writer_cpu_per_save_s'])} ({_ms(r['bg_threads_sys_cpu_per_save_s'])})",
                "-" if r["others_cores"] is None else f"{r['others_cores']:.2f}",
            ]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(cols))]
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    body.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    rt = result["ratios"]
    tail = [""]
    if "ckpt_blocking_over_floor_copy" in rt:
        tail.append(
            f"ckpt blocking / copy floor = {rt['ckpt_blocking_over_floor_copy']:.2f}x (floor {rt['floor_copy_s'] * 1e3:.0f} ms); "
            f"ckpt step-time inflation = {rt['ckpt_inflation_over_floor_copy']:.2f} copies; "
            f"ckpt writer CPU = {rt['ckpt_writer_cpu_over_floor_copy']:.2f} copies"
        )
    if "ckpt_writer_cpu_beyond_staging_over_floor_copy" in rt:
        tail.append(
            f"of which the staging copy (the floor's copy, done off the loop) = {rt['ckpt_staging_copy_cpu_over_floor_copy']:.2f} copies; "
            f"the writer beyond it = {rt['ckpt_writer_cpu_beyond_staging_over_floor_copy']:.2f} copies"
        )
    if "ckpt_overhead_over_best_peer" in rt:
        tail.append(f"ckpt overhead / best peer's ({rt['best_peer']}) = {rt['ckpt_overhead_over_best_peer']:.2f}x")
    if cfg.get("device", "cpu") != "cpu" and "floor_copy_s" in rt:
        tail.append(
            f"copy floor: {cfg['state_mb_per_rank']:.0f} MB per rank device-to-host into pinned buffers in "
            f"{rt['floor_copy_s'] * 1e3:.0f} ms = {cfg['state_mb_per_rank'] / 1e3 / rt['floor_copy_s']:.1f} GB/s per rank"
        )
    return "\n".join(head + body + tail)


def _backends(cfg: dict[str, Any]) -> str:
    return "gloo" if cfg.get("device", "cpu") == "cpu" else "nccl for the model, gloo for ckpt"


def print_report(result: dict[str, Any]) -> None:
    print()
    print(table(result))
    for r in result["rows"]:
        for n in r.get("notes", []):
            print(f"  note ({r['peer']}): {n}")


# ============================================================================================
# Worker: one rank
# ============================================================================================


def build_model(args: argparse.Namespace, world: int):  # noqa: ANN201
    shape = model_shape(args.size_mb, world, args.many_small)
    return make_model(shape, world, args.device, shard_blocks=not args.many_small)


def model_shape(size_mb: float, world: int, many_small: bool = False) -> dict[str, int]:
    """TinyGPT's width and depth for `size_mb` of state (params + 2 fp32 AdamW moments) per rank."""
    if many_small:
        # 48 tensors per block in the state (12 params, each with exp_avg, exp_avg_sq, step).
        return {"d": 32, "layers": 208, "heads": 2}
    params = size_mb * 1e6 * world / 12  # params + 2 fp32 moments, sharded over `world`
    d = 512 if size_mb <= 300 else 1024 if size_mb < 4000 else 2048
    return {"d": d, "layers": max(1, round(params / (12 * d * d + 13 * d))), "heads": d // 64}


def make_model(shape: dict[str, int], world: int, device: str = "cpu", shard_blocks: bool = True):  # noqa: ANN201
    """The example's TinyGPT at `shape`, under FSDP2 over `world` ranks on `device`."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(REPO / "examples"))
    from train_transformer import Block, TinyGPT  # the example's model, at a larger size

    torch.manual_seed(0)
    if device == "cpu":
        model = TinyGPT(d=shape["d"], layers=shape["layers"], heads=shape["heads"])
    else:
        with torch.device(device):  # initialized where it trains: GBs of parameters
            model = TinyGPT(d=shape["d"], layers=shape["layers"], heads=shape["heads"])

        class DeviceBlock(Block):
            """The example's block, with its causal mask made on the input's device."""

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                n = x.shape[1]
                mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
                h = self.ln1(x)
                x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
                return x + self.mlp(self.ln2(x))

        for block in model.blocks:
            block.__class__ = DeviceBlock
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device, (world,))
    if shard_blocks:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # many-small: one FSDP group, 10,000 tensors still
    return model, {**shape, "params": n_params}


def tensor_leaves(obj: Any) -> list[Any]:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_leaves(v)]
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    return []


def _fsync_tree(cb_args: Any) -> None:
    """torch_checkpointing pre_finalize_callback: make the files durable (it never fsyncs)."""
    for dp, _, files in os.walk(cb_args.path):
        for f in files:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Ctx:
    def __init__(self, model: Any, opt: Any, rank: int, world: int, root: Path, tensors: int, device: str = "cpu") -> None:
        self.model, self.opt, self.rank, self.world, self.root = model, opt, rank, world, root
        self.tensors, self.device = tensors, device


class Peer:
    """One way of saving. `save` is the blocking part; `opt_step` runs optimizer.step() with
    whatever the peer needs first (returns the seconds waited for it); `wait` waits for the
    commit of the save in flight and returns its end-to-end time (None: use the blocking time)."""

    name = ""
    record: dict[str, Any]

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.dir = ctx.root / self.name
        self.t_start = 0.0
        self.t_done: float | None = None
        self.notes: list[str] = []
        self.helpers: list[int] = []  # its writer processes

    def setup(self) -> None:
        pass

    def save(self, i: int) -> None:
        """Start (or make) save number `i`: every peer defines it."""
        raise TypeError(f"{type(self).__name__} defines no save()")

    def opt_step(self) -> float:
        self.ctx.opt.step()
        return 0.0

    def after_step(self) -> None:
        pass

    def wait(self) -> float | None:
        return None

    def teardown(self) -> None:
        pass

    # helpers
    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.ctx.model, self.ctx.opt)
        return {"model": msd, "optim": osd}

    def _stamp(self, fut: Any) -> None:
        def done(_: Any) -> None:
            self.t_done = time.perf_counter()

        self.t_done = None
        fut.add_done_callback(done)

    def _e2e_from_stamp(self) -> float:
        end = self.t_done if self.t_done is not None else time.perf_counter()
        return end - self.t_start


class Floor(Peer):
    name = "floor"

    def setup(self) -> None:
        import torch

        self.cuda = self.ctx.device == "cuda"
        # On CUDA the floor is a DMA: device-to-host into pinned buffers, asynchronous copies
        # queued, then one synchronize.
        self.bufs = [
            torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) if self.cuda else torch.empty_like(t, device="cpu")
            for t in tensor_leaves(self.state())
        ]
        self.gsd_s: list[float] = []

    def save(self, i: int) -> None:
        import torch

        t = time.perf_counter()
        leaves = tensor_leaves(self.state())
        self.gsd_s.append(time.perf_counter() - t)
        self.t_start = time.perf_counter()  # the floor is the copy alone
        for dst, src in zip(self.bufs, leaves, strict=True):
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()

    def teardown(self) -> None:
        self.notes.append(
            f"get_state_dict (not in the floor's blocking time, in every other peer's) took "
            f"{_med(self.gsd_s) * 1e3:.1f} ms median"
        )
        del self.bufs


# CPU seconds ckpt's background thread spent on the staging copies: the floor's copy, moved
# off the loop (overlap); the writer's own cost is its CPU beyond this.
_STAGING_COPY_CPU = [0.0]


def _time_staging_copies() -> None:
    from ckpt.save.stage import Copies

    run = Copies.run

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        t = time.thread_time()
        try:
            run(self, *args, **kwargs)
        finally:
            _STAGING_COPY_CPU[0] += time.thread_time() - t

    Copies.run = timed  # type: ignore[method-assign]


class Ckpt(Peer):
    name = "ckpt"

    def setup(self) -> None:
        import ckpt

        _time_staging_copies()

        self.cp = ckpt.Checkpointer(
            str(self.dir),
            model=self.ctx.model,
            optimizer=self.ctx.opt,
            interval=None,
            save_on_exit=False,
            handle_sigterm=False,  # the loop's own signals stay as the other peers have them
            keep=ckpt.Keep(last=1000),  # no retention while timing: no other peer deletes either
            restore="none",
        )
        self.cp.__enter__()

    def save(self, i: int) -> None:
        self.cp.save()

    def opt_step(self) -> float:
        # With overlap (ckpt's default) the copy runs while forward/backward run, and an
        # optimizer step pre-hook waits for it: that wait is blocking time too.
        before = getattr(self.cp, "staging_wait_s", 0.0)
        self.ctx.opt.step()
        return getattr(self.cp, "staging_wait_s", 0.0) - before

    def after_step(self) -> None:
        self.cp.step_done()

    def wait(self) -> float | None:
        self.cp.wait()
        return self.cp.last_commit.costs.persist_s  # from the start of save() to the commit

    def teardown(self) -> None:
        if getattr(self.cp, "skipped_saves", 0):
            self.notes.append(f"ckpt skipped {self.cp.skipped_saves} saves")
        self.cp.__exit__(None, None, None)


class DcpSync(Peer):
    name = "dcp_sync"

    def setup(self) -> None:
        import torch.distributed as dist

        self.g = dist.new_group(backend="gloo")

    def save(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(), checkpoint_id=str(self.dir / f"s{i}"), process_group=self.g)


class _FuturePeer(Peer):
    """A peer whose save returns a future that completes at the commit."""

    def wait(self) -> float | None:
        self.fut.result()
        return self._e2e_from_stamp()


class DcpThread(_FuturePeer, DcpSync):
    name = "dcp_thread"

    def save(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.fut = dcp.async_save(self.state(), checkpoint_id=str(self.dir / f"s{i}"), process_group=self.g)
        self._stamp(self.fut)


class _ShmPeer(Peer):
    """A peer that hands its staged tensors to a writer process through shared memory."""

    def share_many_tensors(self) -> None:
        # torch's default "file_descriptor" sharing keeps one fd per tensor in flight: with
        # ~10,000 tensors that passes `ulimit -n` (EMFILE). torch's documented way out is the
        # "file_system" strategy, which a user of this peer would have to choose as well.
        import torch.multiprocessing as tmp

        self._strategy = tmp.get_sharing_strategy()
        if self.ctx.tensors > 2000:
            tmp.set_sharing_strategy("file_system")
            self.notes.append(
                f"{self.ctx.tensors} tensors: torch.multiprocessing sharing strategy set to 'file_system' "
                f"(the default 'file_descriptor' fails with EMFILE at ulimit -n {_nofile()})"
            )

    def restore_sharing(self) -> None:
        import torch.multiprocessing as tmp

        if getattr(self, "_strategy", None) and self.ctx.tensors > 2000:
            tmp.set_sharing_strategy(self._strategy)


def _nofile() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class DcpProcess(_FuturePeer, DcpSync, _ShmPeer):
    name = "dcp_process"

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().setup()
        self.share_many_tensors()
        self.stager = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                           use_non_blocking_copy=False)
        )
        self.staging = None

    def save(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        resp = dcp.async_save(
            self.state(),
            checkpoint_id=str(self.dir / f"s{i}"),
            process_group=self.g,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
        )
        self.staging, self.fut = resp.staging_completion, resp.upload_completion
        self._stamp(self.fut)

    def opt_step(self) -> float:
        waited = 0.0
        if self.staging is not None:
            t = time.perf_counter()
            self.staging.result()  # the staged copy must be complete before the weights change
            waited = time.perf_counter() - t
            self.staging = None
        self.ctx.opt.step()
        return waited

    def teardown(self) -> None:
        import torch.distributed.checkpoint._async_process_executor as ape

        self.stager.close()
        proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
        if proc is not None:  # its writer process: stop it so that it holds no memory later
            proc.__del__()
        self.restore_sharing()


class Tc(_FuturePeer, _ShmPeer):
    name = "tc"
    fsync = False

    def setup(self) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        if self.ctx.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.share_many_tensors()
        cfg = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(
                staging_config=CheckpointStagerConfig(
                    use_pinned_memory=False, use_non_blocking_copy=False, use_shared_memory=True,
                    use_async_staging=True,
                )
            ),
            # Its default O_DIRECT storage fails on ext4 here (unaligned writes, EINVAL).
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            pre_finalize_callback=_fsync_tree if self.fsync else None,
        )
        self.mgr = CheckpointManager(cfg)

    def save(self, i: int) -> None:
        self.fut = self.mgr.save(str(self.dir / f"s{i}"), self.state())
        self._stamp(self.fut)

    def opt_step(self) -> float:
        t = time.perf_counter()
        with self.mgr.lock():  # waits while its staging copy is still running
            waited = time.perf_counter() - t
            self.ctx.opt.step()
        return waited

    def teardown(self) -> None:
        self.mgr.close()
        self.restore_sharing()


class TcFsync(Tc):
    name = "tc_fsync"
    fsync = True


class Naive(Peer):
    name = "naive"

    def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, i: int) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(
            self.ctx.model, self.ctx.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.ctx.rank == 0:
            with open(self.dir / f"s{i}.pt", "wb") as f:
                torch.save({"model": msd, "optim": osd}, f)
                f.flush()
                os.fsync(f.fileno())


PEER_CLASSES = {c.name: c for c in (Floor, Ckpt, DcpSync, DcpThread, DcpProcess, Tc, TcFsync, Naive)}


def worker(args: argparse.Namespace) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    logging.basicConfig(level=logging.WARNING)
    for name in ("torch_checkpointing", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)

    if args.device == "cuda":
        # One GPU per rank. The model's collectives run on nccl; object collectives and
        # barriers on gloo; ckpt makes its own gloo groups.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=900))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    main_tid = threading_native_id()
    root = Path(args.dir)
    model, shape = build_model(args, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    from train_transformer import SEQ, VOCAB

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g).to(args.device)
    y = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g).to(args.device)

    def train_step(peer: Peer | None) -> float:
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        waited = peer.opt_step() if peer else (opt.step() or 0.0)
        opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()  # a step's time is its GPU work (a loop's loss.item() does this)
        if peer:
            peer.after_step()
        return waited

    t_log = time.monotonic()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[stall] {time.monotonic() - t_log:6.0f}s  {msg}", flush=True)

    for _ in range(3):  # the optimizer's state exists from here on
        train_step(None)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        train_step(None)
        times.append(time.perf_counter() - t)
    step_s = max(all_gather(_med(times)))
    K = max(2, math.ceil(args.interval_s / step_s))
    from torch.distributed.checkpoint.state_dict import get_state_dict

    leaves = tensor_leaves(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
    state_bytes = sum(t.numel() * t.element_size() for t in leaves)
    config = {
        "mode": "many-small" if args.many_small else f"{args.size_mb:g} MB",
        "world": world,
        "saves": args.saves,
        "order": args.order,
        "K": K,
        "interval_s": args.interval_s,
        "step_s": step_s,
        "batch": args.batch,
        "state_mb_per_rank": state_bytes / 1e6,
        "tensors_per_rank": len(leaves),
        "peers": args.peers,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "torch_checkpointing": _version("torch_checkpointing"),
        "ckpt_source": ckpt_source(),
        "dir": str(root),
        **shape,
    }
    del leaves
    log(f"state {state_bytes / 1e6:.1f} MB/rank in {config['tensors_per_rank']} tensors; step {step_s * 1e3:.0f} ms; "
        f"K={K} steps between saves; {args.saves} saves per peer; peers {','.join(args.peers)}")

    phases: list[dict[str, Any]] = []

    def cpu_now() -> dict[str, float]:
        on, rq = thread_sched(main_tid)
        pu, ps = proc_user_sys("self")
        mu, ms = proc_user_sys(f"self/task/{main_tid}")
        return {
            "proc": pu + ps,  # every thread of this process
            "main": mu + ms,
            "bg_sys": ps - ms,  # kernel time of the other threads (page cache copies, ...)
            "main_runq": rq,  # runnable but waiting for a core
            "helpers": sum(_safe(lambda p=p: proc_cpu(p)) for p in descendants(os.getpid())),
            "copy": _STAGING_COPY_CPU[0],
        }

    def cpu_delta(c0: dict[str, float], c1: dict[str, float]) -> dict[str, float]:
        return {
            "bg_cpu_s": (c1["proc"] - c0["proc"]) - (c1["main"] - c0["main"]),
            "bg_sys_cpu_s": c1["bg_sys"] - c0["bg_sys"],
            "main_cpu_s": c1["main"] - c0["main"],
            "main_runq_s": c1["main_runq"] - c0["main_runq"],
            "helper_cpu_s": c1["helpers"] - c0["helpers"],
            "copy_cpu_s": c1["copy"] - c0["copy"],
        }

    def base_segment() -> dict[str, float]:
        rss0 = _status().get("VmRSS", 0)
        reset_hwm()
        c0 = cpu_now()
        t0 = time.perf_counter()
        for _ in range(K):
            train_step(None)
        out = {"seg_s": time.perf_counter() - t0}
        out.update(cpu_delta(c0, cpu_now()))
        out["rss_rise"] = _status().get("VmHWM", 0) - rss0
        return out

    def segment(peer: Peer, i: int) -> dict[str, float]:
        rss0 = _status().get("VmRSS", 0)
        reset_hwm()
        for pid in peer.helpers:
            reset_hwm(pid)
        c0 = cpu_now()
        t0 = time.perf_counter()
        peer.t_start = t0
        peer.save(i)
        blocking = time.perf_counter() - t0
        if isinstance(peer, Floor):
            blocking = time.perf_counter() - peer.t_start  # the copy alone
        for _ in range(K):
            blocking += train_step(peer)  # waits for staging before optimizer.step()
        t2 = time.perf_counter()
        e2e = peer.wait()
        t3 = time.perf_counter()
        out = {
            "blocking_s": blocking,
            "tail_wait_s": t3 - t2,
            "seg_s": t3 - t0,
            "e2e_s": blocking if e2e is None else e2e,
        }
        out.update(cpu_delta(c0, cpu_now()))
        # the trainer's RSS rise during the segment (training's own transient memory included;
        # the baseline segments' rise is subtracted in the summary), and its helper processes'
        out["rss_rise"] = _status().get("VmHWM", 0) - rss0
        out["helpers_hwm"] = sum(_status(p).get("VmHWM", 0) for p in peer.helpers)
        return out

    def agree_ok(err: str | None) -> str | None:
        """Every rank learns whether any rank failed (so that all skip the peer alike)."""
        errs = [e for e in all_gather(err) if e]
        return errs[0] if errs else None

    def fail(e: BaseException) -> str:
        import traceback

        traceback.print_exc()
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def stop(peer: Peer) -> None:
        try:  # stop its writer processes and threads; free its buffers
            peer.teardown()
        except BaseException as e:  # noqa: BLE001
            fail(e)

    def run_rounds(names: list[str]) -> None:
        """Set every peer up (one warm-up save each), then take the timed saves in rounds, one
        save of each peer per round, in an order that rotates, each save between two
        baseline segments: B S(a) B S(b) B ... So the machine's load, which other jobs drive
        and which drifts over minutes, weighs on every peer alike."""
        import gc

        peers: list[Peer] = []
        for name in names:
            peer = PEER_CLASSES[name](Ctx(model, opt, rank, world, root, config["tensors_per_rank"], args.device))
            peer.record = {"kind": "peer", "peer": name, "saves": [], "bases_before": [], "bases_after": []}
            if rank == 0:  # a fresh directory: what an earlier run left must not change this one
                shutil.rmtree(peer.dir, ignore_errors=True)
            gc.collect()
            dist.barrier()
            kids0 = set(descendants(os.getpid()))
            rss0 = _status().get("VmRSS", 0)
            reset_hwm()
            err = None
            try:
                t = time.perf_counter()
                peer.setup()
                peer.record["setup_s"] = time.perf_counter() - t
                peer.helpers = sorted(set(descendants(os.getpid())) - kids0)
                first = segment(peer, 0)  # warm-up: spawns, allocations, plans
                peer.helpers = sorted(set(descendants(os.getpid())) - kids0)
                st = _status()
                peer.record.update(
                    {
                        "first": first,
                        "t_first_end": time.time(),
                        "rss_before_setup": rss0,
                        "rss_held": st.get("VmRSS", 0) - rss0,  # kept between saves
                        "rss_first_peak": st.get("VmHWM", 0) - rss0,
                        "helper_procs": len(peer.helpers),
                    }
                )
            except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
                err = fail(e)
            err = agree_ok(err)
            if err:
                peer.record["error"] = err
                log(f"{name}: FAILED at setup/first save: {err}")
                stop(peer)
            else:
                log(f"{name}: set up in {peer.record['setup_s']:.1f} s, first save blocked "
                    f"{first['blocking_s'] * 1e3:.0f} ms, committed in {first['e2e_s'] * 1e3:.0f} ms")
            peers.append(peer)
        dist.barrier()
        t_rounds = time.time()
        bases = [base_segment()]
        for r in range(args.saves):
            live = [p for p in peers if "error" not in p.record]
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for peer in order:
                err = None
                try:
                    seg = segment(peer, r + 1)
                except BaseException as e:  # noqa: BLE001
                    err = fail(e)
                err = agree_ok(err)
                if err:
                    peer.record["error"] = err
                    log(f"{peer.name}: FAILED in save {r + 1}: {err}")
                    stop(peer)
                    continue
                seg["t_end"] = time.time()
                peer.record["saves"].append(seg)
                peer.record["bases_before"].append(len(bases) - 1)
                bases.append(base_segment())
                peer.record["bases_after"].append(len(bases) - 1)
            log(f"round {r + 1}/{args.saves} done")
        t_rounds_end = time.time()
        for peer in peers:
            if "error" not in peer.record:
                stop(peer)
                peer.record["notes"] = peer.notes
        dist.barrier()
        for peer in peers:
            peer.record["bytes_written"] = dir_bytes(peer.dir) if rank == 0 else 0
            if rank == 0:
                shutil.rmtree(peer.dir, ignore_errors=True)
        # one record per peer: per save, the slower rank's times and the ranks' mean CPU
        got = all_gather({"peers": [p.record for p in peers], "bases": bases})

        def merge(items: list[dict[str, float]]) -> dict[str, float]:
            out = {}
            for k in items[0]:
                vals = [x[k] for x in items]
                out[k] = statistics.fmean(vals) if k.endswith(("cpu_s", "runq_s")) else max(vals)
            return out

        merged_bases = [merge([g["bases"][i] for g in got]) for i in range(len(bases))]
        for j in range(len(peers)):
            recs = [g["peers"][j] for g in got]
            rec = dict(recs[0])
            if "error" not in rec and any("error" in x for x in recs):
                rec["error"] = next(x["error"] for x in recs if "error" in x)
            if rec.get("saves"):
                n = len(rec["saves"])
                rec["saves"] = [merge([x["saves"][i] for x in recs]) for i in range(n)]
                rec["bases"] = [merged_bases[i] for i in sorted(set(rec["bases_before"]) | set(rec["bases_after"]))]
                rec["around"] = [
                    (merged_bases[a]["seg_s"] + merged_bases[b]["seg_s"]) / 2
                    for a, b in zip(rec["bases_before"], rec["bases_after"], strict=True)
                ]
            if "first" in rec:
                rec["first"] = merge([x["first"] for x in recs])
                for k in ("rss_before_setup", "rss_held", "rss_first_peak", "setup_s", "helper_procs"):
                    rec[k] = max(x[k] for x in recs)
                rec["bytes_per_rank"] = recs[0]["bytes_written"] / (len(rec.get("saves", [])) + 1) / world
            rec["t0"], rec["t1"] = t_rounds, t_rounds_end
            rec["per_rank"] = recs
            phases.append(rec)
        phases.append({"kind": "baselines", "bases": merged_bases, "t0": t_rounds, "t1": t_rounds_end})

    when = time.time()
    if args.order == "rounds":
        run_rounds(args.peers)
    else:  # each peer alone: set up, its rounds, torn down
        for name in args.peers:
            run_rounds([name])
    if rank == 0:
        raw = {"when": datetime.datetime.fromtimestamp(when).isoformat(timespec="seconds"), "config": config, "phases": phases}
        tmp = root / "raw.json.tmp"
        tmp.write_text(json.dumps(raw))
        tmp.replace(root / "raw.json")
    dist.barrier()
    dist.destroy_process_group()


def ckpt_source() -> dict[str, Any]:
    """Which ckpt was measured: its files, and the git commit (and whether ckpt/ was edited)."""
    import ckpt

    where = Path(ckpt.__file__).resolve().parent
    out: dict[str, Any] = {"path": str(where), "version": getattr(ckpt, "__version__", None)}
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=where, capture_output=True, text=True, timeout=10)  # noqa: E731
        head = run("rev-parse", "HEAD")
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            out["ckpt_dir_edited"] = bool(run("status", "--porcelain", "--", ".").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def threading_native_id() -> int:
    import threading

    return threading.get_native_id()


def proc_user_sys(where: str) -> tuple[float, float]:
    """(user, system) CPU seconds of /proc/<where> (a process or one of its threads)."""
    f = _stat_fields(f"/proc/{where}/stat")
    return int(f[11]) / CLK_TCK, int(f[12]) / CLK_TCK


def _safe(fn: Any) -> float:
    try:
        return fn()
    except (OSError, ValueError, IndexError):
        return 0.0


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod.replace("_", "-"))
    except Exception:  # noqa: BLE001
        return None


def all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.show:
        print_report(json.loads(Path(args.show).read_text()))
        return 0
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
