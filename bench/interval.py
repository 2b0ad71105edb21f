#!/usr/bin/env python
"""Issue 42's target: the interval `Auto` chooses against what a save really costs the loop.

    .venv/bin/python bench/interval.py                # 100 MB per rank, 2 ranks, ~8 min: interval-100mb.json
    .venv/bin/python bench/interval.py --show bench/results/interval-100mb.json

The stall benchmark's configuration (bench/stall.py: 2 gloo ranks, the same FSDP2 transformer
and AdamW, its K steps between saves), in the same two processes, in three phases:

1. C_whole, as stall.py measures it for its `ckpt` peer: one warm-up save, then half of
   `--saves` segments (save, K steps, wait for the commit), each between two baseline segments
   (K steps, no save); a save's whole cost to the loop (its overhead) is its segment, the
   slower rank's, minus the mean of the two baselines around it.
2. The same loop for `--auto-s` seconds under `ckpt.Checkpointer(interval=ckpt.Auto(
   node_mtbf_s=600, ...))`, with nothing else: rank 0's `cp.schedule` after every commit,
   every step's time on each rank, and when each save began.
3. Phase 1 again, the other half of the saves. C_whole is the median over both halves (more
   saves than stall.py's 6: one segment's noise is ~100 ms); the halves apart say whether the
   machine's load moved the cost while phase 2 ran. Blocking and persist: the same saves'.

The targets: the interval chosen within 25 % of sqrt(2 x C_whole x M) (M: the schedule's
`mtbf_s`; the ranks are one node, LOCAL_WORLD_SIZE=2, so the job MTBF is the node's), and the
simulated ETTR (`ckpt.schedule.simulate`, the measured costs, a 30 s restart) of the
coordinator within 1 point of the async oracle's. The interval is read at the end of phase 2,
and over phase 2 from the 6th priced save on (its median, and how many choices were within
25 %). The result (bench/results/interval-<size>mb.json) is replaced on a rerun. "Offline":
each phase-2 save's cost recomputed from the same step times, stall.py's way (the steps from
the one that took the save to the first that ended after its commit, against the median of the
4 clean steps on each side): a check on the estimator with the same data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout's ckpt
import stall  # noqa: E402  (the stall benchmark's model, loop and launcher)

TAG = "[interval]"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=100.0, help="state per rank, MB (default 100, as stall.py)")
    p.add_argument("--saves", type=int, default=20,
                   help="timed saves for C_whole (default 20: stall.py's 6 read -99 ms on a loaded machine, at 8134e6c)")
    p.add_argument("--auto-s", type=float, default=240.0, help="seconds of loop under Auto (default 240)")
    p.add_argument("--node-mtbf-s", type=float, default=600.0, help="Auto(node_mtbf_s=) (default 600)")
    p.add_argument("--first-after-s", type=float, default=10.0, help="Auto(first_after_s=) (default 10)")
    p.add_argument("--first-after-steps", type=int, default=10, help="Auto(first_after_steps=) (default 10)")
    p.add_argument("--restart-s", type=float, default=30.0, help="the simulation's restart time (default 30)")
    p.add_argument("--sim-days", type=float, default=7.0, help="the simulation's wall time per run, days (default 7)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (as stall.py)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a fresh dir under /tmp)")
    p.add_argument("--out", default=None, help="results file (default bench/results/interval-<size>mb.json, replaced)")
    p.add_argument("--show", metavar="JSON", help="print an earlier run's summary and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.many_small, args.device = False, "cpu"  # stall.build_model's other knobs
    args.interval_s = 1.0 + 0.006 * args.size_mb  # stall.py's training time between saves
    return args


# ============================================================================================
# Worker: one rank
# ============================================================================================


def worker(args: argparse.Namespace) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ckpt

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    model, shape = stall.build_model(args, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sys.path.insert(0, str(stall.REPO / "examples"))
    from train_transformer import SEQ, VOCAB

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)

    def train_step(peer: stall.Peer | None = None) -> float:  # stall.py's step
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        waited = peer.opt_step() if peer else (opt.step() or 0.0)
        opt.zero_grad()
        return waited

    t_log = time.monotonic()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"{TAG} {time.monotonic() - t_log:6.0f}s  {msg}", flush=True)

    for _ in range(3):
        train_step()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
    step_s = max(stall.all_gather(stall._med(times)))
    K = max(2, math.ceil(args.interval_s / step_s))
    log(f"step {step_s * 1e3:.0f} ms; K={K}; {args.saves} timed saves for C_whole, half before and half after the Auto phase")

    # -- phases 1 and 3: C_whole, as stall.py's rounds with the ckpt peer alone ---------------
    def base_segment() -> float:
        t0 = time.perf_counter()
        for _ in range(K):
            train_step()
        return time.perf_counter() - t0

    def segment(peer: stall.Ckpt, i: int) -> dict[str, float]:
        t0 = time.perf_counter()
        peer.t_start = t0
        peer.save(i)
        blocking = time.perf_counter() - t0
        for _ in range(K):
            blocking += train_step(peer)
            peer.after_step()
        t2 = time.perf_counter()
        persist = peer.wait()
        t3 = time.perf_counter()
        return {"blocking_s": blocking, "tail_wait_s": t3 - t2, "seg_s": t3 - t0, "persist_s": persist}

    def c_whole(n: int) -> dict[str, Any]:
        t0 = time.time()
        peer = stall.Ckpt(stall.Ctx(model, opt, rank, world, root, 0))
        if rank == 0:
            shutil.rmtree(peer.dir, ignore_errors=True)
        dist.barrier()
        peer.setup()
        first = segment(peer, 0)
        bases, saves = [base_segment()], []
        for i in range(n):
            saves.append(segment(peer, i + 1))
            bases.append(base_segment())
            log(f"save {i + 1}/{n}: segment {saves[-1]['seg_s'] * 1e3:.0f} ms, bases {bases[-2] * 1e3:.0f}/{bases[-1] * 1e3:.0f} ms")
        peer.teardown()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(peer.dir, ignore_errors=True)
        return {"t0": t0, "t1": time.time(), "first": first, "saves": saves, "bases": bases}

    t_start = time.time()
    before = c_whole(args.saves // 2)

    # -- phase 2: the same loop under Auto ------------------------------------------------------
    steps = math.ceil(args.auto_s / step_s)
    log(f"phase 2: {steps} steps (~{args.auto_s:g} s) under Auto(node_mtbf_s={args.node_mtbf_s:g})")
    auto_dir = root / "auto"
    if rank == 0:
        shutil.rmtree(auto_dir, ignore_errors=True)
    dist.barrier()
    cp = ckpt.Checkpointer(
        str(auto_dir),
        model=model,
        optimizer=opt,
        interval=ckpt.Auto(node_mtbf_s=args.node_mtbf_s, first_after_s=args.first_after_s, first_after_steps=args.first_after_steps),
        save_on_exit=False,
        handle_sigterm=False,
        keep=ckpt.Keep(last=3),  # the default: dozens of saves (stall.py's peer keeps all, for 7)
        restore="none",
    )
    cp.__enter__()
    started: list[tuple[int, float]] = []  # (step, perf_counter) of each save
    save = cp.save

    def timed_save(*a: Any, **k: Any) -> None:
        started.append((cp.step, time.perf_counter()))
        save(*a, **k)

    cp.save = timed_save  # type: ignore[method-assign]
    step_log: list[tuple[float, float, bool]] = []  # (end, seconds, this rank's save still writing at the end)
    schedules: list[dict[str, Any]] = []
    t2_start = time.time()
    last = time.perf_counter()
    for _ in range(steps):
        train_step(None)  # ckpt's optimizer pre-hook waits for its staging copy
        now = time.perf_counter()
        step_log.append((now, now - last, cp._slot.busy()))
        cp.step_done()
        last = time.perf_counter()  # the save's blocking, if one came due, counts in the next step
        if rank == 0 and cp.schedule != (schedules[-1]["schedule"] if schedules else None):
            sd = cp._cadence.slowdown
            schedules.append({"step": cp.step, "t": time.time() - t2_start, "schedule": dict(cp.schedule),
                              "rank0_last_slowdown_s": sd.estimate(), "rank0_saves_priced": sd.saves,
                              "slowest_ms_at_meeting": cp._cadence.agreement.slowest_ms})
            if len(schedules) > 1:
                s = cp.schedule
                slowed = "-" if s["slowdown_s"] is None else f"{s['slowdown_s'] * 1e3:.0f} ms"
                log(f"step {cp.step}: every {s['seconds']:.2f} s (blocking {s['blocking_s'] * 1e3:.0f} ms, "
                    f"slowdown {slowed}, persist {s['persist_s'] * 1e3:.0f} ms)")
    cp.wait()
    sd = cp._cadence.slowdown
    estimates = [x["rank0_last_slowdown_s"] for x in schedules if x.get("rank0_last_slowdown_s") is not None] if rank == 0 else []
    clean = list(sd._clean)
    mine = {"started": started, "steps": step_log, "per_save_s": estimates or ([sd.estimate()] if sd.estimate() is not None else []),
            "estimate_s": sd.estimate(), "baseline_s": statistics.median(clean) if clean else None}
    cp.__exit__(None, None, None)
    t2_end = time.time()
    log("phase 3: C_whole again")
    after = c_whole(args.saves - args.saves // 2)
    got = stall.all_gather({"before": before, "after": after, "auto": mine})
    if rank == 0:
        raw = {
            "when": datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
            "config": {"size_mb": args.size_mb, "world": world, "K": K, "step_s": step_s, "saves": args.saves,
                       "auto_steps": steps, "node_mtbf_s": args.node_mtbf_s, "first_after_s": args.first_after_s,
                       "first_after_steps": args.first_after_steps, "restart_s": args.restart_s, "sim_days": args.sim_days,
                       "ckpt_source": stall.ckpt_source(), "torch": torch.__version__, **shape},
            "phase1": {"t0": got[0]["before"]["t0"], "t1": got[0]["before"]["t1"], "per_rank": [r["before"] for r in got]},
            "phase3": {"t0": got[0]["after"]["t0"], "t1": got[0]["after"]["t1"], "per_rank": [r["after"] for r in got]},
            "phase2": {"t0": t2_start, "t1": t2_end, "schedules": schedules, "per_rank": [r["auto"] for r in got]},
        }
        tmp = root / "raw.json.tmp"
        tmp.write_text(json.dumps(raw))
        tmp.replace(root / "raw.json")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(auto_dir, ignore_errors=True)
    dist.destroy_process_group()


# ============================================================================================
# Summary
# ============================================================================================


def offline_costs(rank_log: dict[str, Any], around: int = 4) -> dict[str, Any]:
    """Each phase-2 save's whole cost on one rank, from its step times, as stall.py prices a
    save: the steps from the one its blocking fell in to the first that ended with the save no
    longer writing, minus as many clean steps at the median of the `around` clean steps on each
    side (the load drifts)."""
    steps = rank_log["steps"]  # step i (0-based) ended at steps[i][0]; a save at cp.step=s came after step s-1
    beside: set[int] = set()
    spans = []
    for s, _t in rank_log["started"]:
        first = s  # the step after the one that called the save (0-based index s): holds its blocking
        last = first
        while last < len(steps) and steps[last][2]:
            last += 1  # still writing at its end: the next step is beside the save too
        last = min(last, len(steps) - 1)
        spans.append((first, last))
        beside.update(range(first, last + 1))
    per_save = []
    for a, b in spans:
        near = [i for i in [*range(a - around, a), *range(b + 1, b + 1 + around)] if 0 < i < len(steps) and i not in beside]
        base = statistics.median(steps[i][1] for i in near) if near else math.nan
        per_save.append(sum(steps[i][1] for i in range(a, b + 1)) - (b - a + 1) * base)
    clean = [d for i, (_e, d, _b) in enumerate(steps) if i not in beside and i > 0]
    return {"clean_step_s": statistics.median(clean) if clean else math.nan, "steps_beside": [b - a + 1 for a, b in spans],
            "per_save_s": per_save}


def phase_costs(ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """stall.py's figures per save of phase 1 or 3: the slower rank's segment against its bases."""
    n = len(ranks[0]["saves"])
    seg = [max(r["saves"][i]["seg_s"] for r in ranks) for i in range(n)]
    bases = [max(r["bases"][i] for r in ranks) for i in range(n + 1)]
    return {
        "overhead_s": [seg[i] - (bases[i] + bases[i + 1]) / 2 for i in range(n)],
        "blocking_s": [max(r["saves"][i]["blocking_s"] for r in ranks) for i in range(n)],
        "persist_s": [max(r["saves"][i]["persist_s"] for r in ranks) for i in range(n)],
        "segments_s": seg,
        "bases_s": bases,
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    from ckpt.schedule.policy import Auto
    from ckpt.schedule.simulate import DAY, Job, compare, simulate

    cfg, p2 = raw["config"], raw["phase2"]
    before, after = phase_costs(raw["phase1"]["per_rank"]), phase_costs(raw["phase3"]["per_rank"])
    overhead, blocking, persist = (before[k] + after[k] for k in ("overhead_s", "blocking_s", "persist_s"))
    c_whole, c_b, c_l = statistics.median(overhead), statistics.median(blocking), statistics.median(persist)

    sched = p2["schedules"][-1]["schedule"] if p2["schedules"] else {}
    mtbf = sched.get("mtbf_s", cfg["node_mtbf_s"])
    auto = Auto(node_mtbf_s=cfg["node_mtbf_s"])
    target = math.sqrt(2 * max(c_whole, 1e-3) * mtbf)
    chosen = sched.get("seconds")
    measured_saves = [s for s in p2["schedules"] if "cost_s" in s["schedule"]]
    offline = [offline_costs(r) for r in p2["per_rank"]]
    off_cost = [max(vals) for vals in zip(*(o["per_save_s"] for o in offline), strict=False)]
    # Over phase 2, from the 6th priced save on (the estimate is a median of 5): every choice.
    later = [x["schedule"]["seconds"] for x in measured_saves[5:]]
    interval = {
        "chosen_s": chosen,
        "later_median_s": statistics.median(later) if later else None,
        "later_within_25pct": sum(abs(x / target - 1) <= 0.25 for x in later),
        "later_choices": len(later),
        "schedule": sched,
        "target_s": target,
        "chosen_over_target": chosen / target if chosen else None,
        "within_25pct": bool(chosen and abs(chosen / target - 1) <= 0.25),
        # what the same rule gives at the schedule's blocking time alone (as before issue 42), and at C_whole
        "blocking_only_s": auto.seconds(sched.get("blocking_s", c_b), sched.get("persist_s", c_l), mtbf),
        "at_c_whole_s": auto.seconds(c_whole, sched.get("persist_s", c_l), mtbf),
        "saves": len(measured_saves),
        "trajectory": [{"step": s["step"], "t": round(s["t"], 1), "seconds": s["schedule"]["seconds"],
                        "slowdown_s": s["schedule"].get("slowdown_s"), "blocking_s": s["schedule"].get("blocking_s"),
                        "rank0_last_slowdown_s": s["rank0_last_slowdown_s"]} for s in p2["schedules"]],
        "per_rank_estimate_s": [r["estimate_s"] for r in p2["per_rank"]],
        "per_rank_per_save_s": [r["per_save_s"] for r in p2["per_rank"]],
        "per_rank_baseline_step_s": [r["baseline_s"] for r in p2["per_rank"]],
        "offline": {"per_rank": offline, "cost_per_save_s": off_cost,
                    "median_last5_s": statistics.median(off_cost[-5:]) if off_cost else None,
                    "median_after_5th_s": statistics.median(off_cost[5:]) if len(off_cost) > 5 else None},
    }

    job = Job(mtbf_s=mtbf, blocking_s=c_b, slowdown_s=max(0.0, c_whole - c_b), persist_s=c_l,
              restart_min_s=cfg["restart_s"], restart_max_s=cfg["restart_s"], wall_s=cfg["sim_days"] * DAY,
              step_s=cfg["step_s"], first_after_s=cfg["first_after_s"])
    rows = compare(job)
    # The interval this run chose, held fixed (the "fixed" policy at 1 step of that length).
    if chosen:
        o = simulate(replace(job, fixed_steps=1, step_s=chosen), "fixed")
        rows["the interval chosen in phase 2, fixed"] = {"ettr": statistics.fmean(o.ettr), "ettr_sd": statistics.stdev(o.ettr),
                                                        "interval_s": chosen, "last_interval_s": chosen}
    oracle = rows["async-oracle"]["ettr"]
    coords = {k: v["ettr"] for k, v in rows.items() if k.startswith("coordinator (prior")}
    sim = {
        "job": {k: getattr(job, k) for k in ("mtbf_s", "blocking_s", "slowdown_s", "persist_s", "restart_min_s", "wall_s", "step_s", "first_after_s")},
        "rows": rows,
        "coordinator_minus_oracle_points": {k: 100 * (v - oracle) for k, v in coords.items()},
        "within_1_point": all(abs(100 * (v - oracle)) <= 1 for v in coords.values()),
    }
    return {
        "when": raw["when"], "command": raw["command"], "wall_s": raw["wall_s"], "machine": raw["machine"], "load": raw["load"],
        "config": cfg,
        "c_whole": {"c_whole_s": c_whole, "blocking_median_s": c_b, "persist_median_s": c_l,
                    "before_s": statistics.median(before["overhead_s"]), "after_s": statistics.median(after["overhead_s"]),
                    "phase1": before, "phase3": after},
        "interval": interval,
        "simulation": sim,
        "raw": raw,
    }


def report(res: dict[str, Any]) -> str:
    c, iv, sim, cfg = res["c_whole"], res["interval"], res["simulation"], res["config"]
    s = iv["schedule"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    lines = [
        f"{cfg['size_mb']:g} MB per rank, {cfg['world']} ranks, step {cfg['step_s'] * 1e3:.0f} ms, K={cfg['K']}; "
        f"other processes used {(res['load'].get('others_cores_whole_run') or 0):.2f} cores on average "
        f"(phases 1 / 2 / 3: {res['load'].get('others_cores_phase1') or 0:.2f} / {res['load'].get('others_cores_phase2') or 0:.2f} / "
        f"{res['load'].get('others_cores_phase3') or 0:.2f})",
        f"C_whole (stall.py's ckpt peer, {len(c['phase1']['overhead_s']) + len(c['phase3']['overhead_s'])} saves): {ms(c['c_whole_s'])}; before phase 2 {ms(c['before_s'])} "
        f"[{', '.join(f'{v * 1e3:.0f}' for v in c['phase1']['overhead_s'])}], after {ms(c['after_s'])} "
        f"[{', '.join(f'{v * 1e3:.0f}' for v in c['phase3']['overhead_s'])}]; blocking {ms(c['blocking_median_s'])}, persist {ms(c['persist_median_s'])}",
        f"phase 2 (Auto, {iv['saves']} saves priced): blocking {ms(s.get('blocking_s'))}, slowdown {ms(s.get('slowdown_s'))}, "
        f"cost {ms(s.get('cost_s'))}, persist {ms(s.get('persist_s'))}, mtbf {s.get('mtbf_s')} s -> every {s.get('seconds')} s",
        "  per-save slowdowns, rank 0 / 1 (ms): " + " / ".join(
            "[" + ", ".join(f"{v * 1e3:.0f}" for v in r) + "]" for r in iv["per_rank_per_save_s"]),
        f"  offline, the same steps: cost per save (ms) [{', '.join(f'{v * 1e3:.0f}' for v in iv['offline']['cost_per_save_s'])}], "
        f"median from the 6th {ms(iv['offline']['median_after_5th_s'])}, of the last 5 {ms(iv['offline']['median_last5_s'])}",
        f"target sqrt(2 x C_whole x M) = {iv['target_s']:.2f} s; chosen / target = {iv['chosen_over_target'] or math.nan:.2f} "
        f"({'met' if iv['within_25pct'] else 'MISSED'}: within 25 %); priced at blocking only: {iv['blocking_only_s']:.2f} s; "
        f"the rule at C_whole: {iv['at_c_whole_s']:.2f} s",
        f"  over phase 2 from the 6th priced save: median {iv['later_median_s'] or math.nan:.2f} s "
        f"({(iv['later_median_s'] or math.nan) / iv['target_s']:.2f}x the target), within 25 % in {iv['later_within_25pct']} of {iv['later_choices']} choices",
        f"simulated ({cfg['sim_days']:g} days x 10 runs; restart {cfg['restart_s']:g} s): ETTR",
    ]
    for name, r in sim["rows"].items():
        lines.append(f"  {name:40s} {100 * r['ettr']:6.2f} % (sd {100 * r['ettr_sd']:.2f}), interval {r['interval_s']:.2f} s")
    diffs = ", ".join(f"{k}: {v:+.2f}" for k, v in sim["coordinator_minus_oracle_points"].items())
    lines.append(f"coordinator - oracle, points: {diffs} ({'met' if sim['within_1_point'] else 'MISSED'}: within 1 point)")
    return "\n".join(lines)


# ============================================================================================
# Launcher
# ============================================================================================


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    out, work, made_dir = stall.run_paths("interval", f"interval-{args.size_mb:g}mb", args.out, args.dir)
    raw_path = work / "raw.json"
    raw_path.unlink(missing_ok=True)
    t_start = time.time()
    samples: list[tuple[float, float, float]] = []
    codes = stall.run_ranks(Path(__file__).resolve(), [*argv, "--worker", "--dir", str(work)], 2, work, samples, f"{TAG} {args.size_mb:g}mb")
    if any(codes) or not raw_path.exists():
        stall.print_log_tails(work, 2)
        print(f"{TAG} a rank failed (exit codes {codes}); logs under {work}", file=sys.stderr)
        return 1
    raw = json.loads(raw_path.read_text())
    raw["machine"] = stall.machine()
    raw["command"] = " ".join([Path(sys.executable).name, "bench/interval.py", *argv])
    raw["wall_s"] = time.time() - t_start
    raw["load"] = {
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "others_cores_whole_run": stall.others_cores(samples, samples[0][0], samples[-1][0]),
        "others_cores_phase1": stall.others_cores(samples, raw["phase1"]["t0"], raw["phase1"]["t1"]),
        "others_cores_phase2": stall.others_cores(samples, raw["phase2"]["t0"], raw["phase2"]["t1"]),
        "others_cores_phase3": stall.others_cores(samples, raw["phase3"]["t0"], raw["phase3"]["t1"]),
    }
    result = summarize(raw)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"\n{TAG} results: {out}")
    if made_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.show:
        print(report(json.loads(Path(args.show).read_text())))
        return 0
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
