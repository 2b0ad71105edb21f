"""What reading a rank's own files early gains a restore from an object store farther away.

A restoring rank learns which files are its own when the manifest is told, then builds its
template, reads its metadata and plans before it reads a byte of data. From an object store
its first ranged GETs now go out at that moment (`Store.read_early`), so that the store's
latency and the first ranges' transfer pass while the rank plans. On loopback the store
answers at once and this machine's two cores are the bound, which hides it: here the
recording proxy answers every ranged GET `--latency` later (a store farther away, or a busy
one), and the same checkpoint is restored `--runs` times with early reads and as before them
(the worker's `CKPT_BENCH_EARLY_READS=0`), alternately, each restore a new job.

`--feature warm-client` compares the same way a restore whose ranks make their store's client
as they enter (`Store.warm`, while rank 0 takes the lease and surveys the root) with one whose
client is made by its first request (`CKPT_BENCH_WARM_CLIENT=0`), the store on loopback.

`--feature prepare` compares a restore begun by `ckpt.prepare` before the ranks form their
group and build the model (`CKPT_BENCH_PREPARE=1`: each rank's store and client made, rank
0's survey of the root made, and waited for, as a job's longer set-up would) with one that
does all of it on entering; both timed from the Checkpointer's construction.

    .venv/bin/python bench/early_reads.py                                       # bench/results/early-reads.json
    .venv/bin/python bench/early_reads.py --feature warm-client --latency 0     # bench/results/warm-client.json
    .venv/bin/python bench/early_reads.py --feature prepare --latency 0         # bench/results/prepare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from scale import REPO, _job, _store

# What each feature's restores are told by the worker's environment ("0": without it).
_FEATURES = {"early-reads": "CKPT_BENCH_EARLY_READS", "warm-client": "CKPT_BENCH_WARM_CLIENT", "prepare": "CKPT_BENCH_PREPARE"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--latency", type=float, default=0.2, help="seconds the proxy holds each ranged GET")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--feature", choices=sorted(_FEATURES), default="early-reads", help="what the restores compared differ in")
    p.add_argument("--out", help="default: bench/results/FEATURE.json")
    args = p.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" / f"{args.feature}.json")
    variable = _FEATURES[args.feature]
    times: dict[str, list[dict]] = {"early": [], "before": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-early-") as d, _store("s3", Path(d)) as (base, options, proxy):
        root = f"{base}/root"
        _job(args.ranks, "save", root, Path(d, "save"), args, options)
        _job(args.ranks, "restore", root, Path(d, "warm-up"), args, options)  # untimed: compiles the bytecode
        proxy.range_latency_s = args.latency
        for run in range(args.runs):
            for mode in ("early", "before") if run % 2 == 0 else ("before", "early"):
                env = {variable: "1" if mode == "early" else "0"}
                ranks = _job(args.ranks, "restore", root, Path(d, f"{mode}{run}"), args, options, env)
                times[mode].append({"s_max": max(r["restore_s"] for r in ranks), "cpu_s_mean": statistics.mean(r["restore_cpu_s"] for r in ranks),
                                    "cpu_s_rank0": next(r["restore_cpu_s"] for r in ranks if r["rank"] == 0), "phases_max_s": {
                    k: max(r["phases_s"].get(k, 0.0) for r in ranks) for k in ranks[0]["phases_s"]}})  # fmt: skip
    doc: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "modes": {"early": "with it", "before": "without"}, "when": time.strftime("%Y-%m-%d %H:%M"), "runs": times}
    for mode, got in times.items():
        doc[mode] = {"median_s": statistics.median(t["s_max"] for t in got),
                     "median_cpu_s_mean": statistics.median(t["cpu_s_mean"] for t in got),
                     "median_cpu_s_rank0": statistics.median(t["cpu_s_rank0"] for t in got),
                     "median_phases_s": {k: statistics.median(t["phases_max_s"][k] for t in got) for k in got[0]["phases_max_s"]}}  # fmt: skip
    doc["gain_s"] = doc["before"]["median_s"] - doc["early"]["median_s"]
    for mode in ("before", "early"):
        ph = doc[mode]["median_phases_s"]
        print(f"{mode:6s}: restore {doc[mode]['median_s']:.3f} s (median of {args.runs}), CPU {doc[mode]['median_cpu_s_mean']:.3f} s a rank "
              f"(rank 0 {doc[mode]['median_cpu_s_rank0']:.3f}); "
              + ", ".join(f"{k} {ph[k]:.3f}" for k in ("connect", "lease", "template", "metadata", "read", "other") if k in ph))  # fmt: skip
    print(f"{args.feature} gains {doc['gain_s']:.3f} s with {args.latency:.2f} s a ranged GET, {args.ranks} ranks")
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"[early_reads] results: {args.out}")


if __name__ == "__main__":
    main()
