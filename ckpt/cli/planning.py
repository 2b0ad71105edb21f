"""The CLI's verbs that need no root: `plan` (a job's checkpoint size, save and restore
times, intervals and ETTR, from its numbers) and `simulate` (the goodput of interval
policies in a simulated long job with failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from ckpt.cli.terminal import EXIT_OK, duration, emit_json, human_bytes, say, table
from ckpt.schedule.interval import DAY
from ckpt.schedule.plan import Ledger, as_dict, parse_bytes, parse_count, parse_duration, plan
from ckpt.schedule.scale_model import AtScale, Scale, at_scale, llama_tensors
from ckpt.schedule.simulate import compare, scenario


def add_parsers(sub: Any) -> None:
    pl = sub.add_parser("plan", help="checkpoint size, save/restore time, intervals and ETTR of a job")
    pl.add_argument("--params", required=True, help="parameters: 13e9, 13B")
    pl.add_argument("--nodes", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--write-bandwidth", required=True, help="per node, to the checkpoint store: 2GB/s")
    pl.add_argument("--read-bandwidth", help="per node (default: the write bandwidth)")
    pl.add_argument("--d2h-bandwidth", default="25GB/s", help="device-to-host copy per GPU (default 25GB/s)")
    mtbf = pl.add_mutually_exclusive_group(required=True)
    mtbf.add_argument("--mtbf", help="the job's MTBF: 6h, 90min")
    mtbf.add_argument("--node-mtbf", help="one node's MTBF (divided by --nodes)")
    pl.add_argument("--restart", default="10min", help="time to restart a failed job, before loading (default 10min)")
    pl.add_argument("--slowdown", default="0s", help="what a save costs the steps beside it (`ckpt show`'s schedule, slowdown_s; default 0s)")
    pl.add_argument("--weights", type=float, default=2.0, help="bytes per parameter (default 2: BF16)")
    pl.add_argument("--grads", type=float, default=0.0, help="bytes per parameter of gradients kept (default 0)")
    pl.add_argument("--keep-grads", action="store_true", help="gradients are saved too, as many bytes as the weights")
    pl.add_argument("--adam", type=float, default=8.0, help="bytes per parameter of optimizer state (default 8: two FP32 moments)")
    pl.add_argument("--master", type=float, default=4.0, help="bytes per parameter of master weights (default 4: FP32)")
    at = pl.add_argument_group("at scale: metadata, store requests and which limit binds (docs/at-scale.md)")
    at.add_argument("--layout", default="fsdp", help="fsdp (default), ddp, or hsdp:R (R replicas of an FSDP group)")
    at.add_argument("--tensors", type=int, help="the model's parameter tensors (default: a Llama-like model's for --params)")
    at.add_argument("--store-bandwidth", help="the store's own bound, all nodes together: 1TB/s (default: none)")
    at.add_argument("--prefixes", type=int, default=1, help="partitions S3 spreads a step directory over (default 1: until it splits)")
    at.add_argument("--gpu-memory", default="80GB", help="a GPU's memory, which what a rank loads must fit in (default 80GB)")
    at.add_argument("--kept", type=int, default=5, help="checkpoints kept in the root, which a restore surveys first (default 5)")
    at.add_argument("--request-latency", default="30ms", help="one round trip to the store (default 30ms: S3)")
    at.add_argument("--cores-per-node", type=int, default=112, help="CPU cores for a node's ranks (default 112: they share them only when fewer than the ranks)")
    at.add_argument("--rank-cpu", help="a rank's CPU time in a save and in a restore besides its bytes: 1s/0.8s (default: the model's, from --tensors; rank 0 does 25/140 ms more)")
    at.add_argument("--cpu-per-byte", type=float,
                    help="nanoseconds of a rank's CPU per byte it saves, its checksums, copies and S3 client's signing "
                         "(default 3.4: this machine, HTTP with signed payloads; less over HTTPS, which signs none)")  # fmt: skip
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    sim = sub.add_parser("simulate", help="goodput (ETTR) of interval policies in a simulated long job")
    sim.add_argument("--scenario", choices=["llama3", "rsc"], default="llama3",
                     help="failure rate: Llama 3's 419 interruptions in 54 days (job MTBF 3.1 h), or Meta RSC's 5.75 per 1000 node-days")
    sim.add_argument("--nodes", type=int, default=2048, help="nodes, for --scenario rsc (default 2048)")
    sim.add_argument("--mtbf", help="the job's MTBF instead of a scenario: 3h")
    sim.add_argument("--blocking", default="50ms", help="what one save blocks the loop (default 50ms)")
    sim.add_argument("--persist", default="30s", help="from save to commit (default 30s)")
    sim.add_argument("--slowdown", default="0s", help="what a save costs the steps beside it (default 0s)")
    sim.add_argument("--restart", default="5min-20min", help="restart time, a range drawn uniformly (default 5min-20min)")
    sim.add_argument("--days", type=float, default=54.0, help="simulated wall time (default 54 days)")
    sim.add_argument("--step-time", default="2s", help="for the fixed interval of --fixed-steps (default 2s)")
    sim.add_argument("--fixed-steps", type=int, default=500, help="the fixed interval in steps (torchtitan's default, 500)")
    sim.add_argument("--runs", type=int, default=10, help="simulated jobs per policy (default 10)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_simulate)


def cmd_plan(args: argparse.Namespace) -> int:
    nodes = args.nodes
    if nodes < 1 or args.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    mtbf_s = parse_duration(args.mtbf) if args.mtbf else parse_duration(args.node_mtbf) / nodes
    if args.keep_grads and args.grads:
        raise ValueError("--keep-grads (gradients as large as the weights) and --grads N: give one")
    ledger = Ledger(args.weights, args.weights if args.keep_grads else args.grads, args.adam / 2, args.adam / 2, args.master)
    if args.kept < 1 or args.cores_per_node < 1:
        raise ValueError("--kept and --cores-per-node must be >= 1")
    if args.cpu_per_byte is not None and not 0 <= args.cpu_per_byte < math.inf:
        raise ValueError(f"--cpu-per-byte {args.cpu_per_byte}: nanoseconds a byte, 0 or more")
    save_cpu, _, restore_cpu = (args.rank_cpu or "").partition("/")
    if args.rank_cpu and not restore_cpu:
        raise ValueError(f"--rank-cpu {args.rank_cpu!r}: a save's and a restore's, as 1s/0.8s")
    scale = Scale(
        world=nodes * args.gpus_per_node,
        nodes=nodes,
        tensors=args.tensors or llama_tensors(parse_count(args.params)),
        layout=args.layout,
        write_bandwidth=parse_bytes(args.write_bandwidth),
        read_bandwidth=parse_bytes(args.read_bandwidth or args.write_bandwidth),
        store_bandwidth=parse_bytes(args.store_bandwidth) if args.store_bandwidth else float("inf"),
        prefixes=args.prefixes,
        cores_per_node=args.cores_per_node,
        save_cpu_s=parse_duration(save_cpu) if save_cpu else None,
        restore_cpu_s=parse_duration(restore_cpu) if restore_cpu else None,
        save_cpu_per_byte_s=args.cpu_per_byte * 1e-9 if args.cpu_per_byte is not None else None,
        request_latency=parse_duration(args.request_latency),
        kept=args.kept,
    )
    big = at_scale(parse_count(args.params) * ledger.per_param, scale)
    # The same restore begun by `ckpt.prepare` while the job sets up (docs/at-scale.md).
    early = at_scale(parse_count(args.params) * ledger.per_param, dataclasses.replace(scale, prepared=True))
    p = plan(
        parse_count(args.params),
        nodes,
        args.gpus_per_node,
        parse_bytes(args.write_bandwidth),
        mtbf_s,
        read_bandwidth=parse_bytes(args.read_bandwidth) if args.read_bandwidth else None,
        d2h_bandwidth=parse_bytes(args.d2h_bandwidth),
        restart_s=parse_duration(args.restart),
        ledger=ledger,
        persist_s=big.save_s,
        restore_s=big.restore_s,
        slowdown_s=parse_duration(args.slowdown),
    )
    if args.json:
        emit_json({**as_dict(p), "at_scale": as_dict(big), "at_scale_prepared": as_dict(early)})
        return EXIT_OK
    rows = [
        ["checkpoint", f"{human_bytes(p.checkpoint_bytes)} ({p.bytes_per_param:g} B/param), {human_bytes(p.bytes_per_gpu)} per GPU"],
        ["blocking (staging copy)", duration(p.blocking_s)],
        ["persist (all nodes writing; see below)", duration(p.persist_s)],
        ["restore (all nodes reading; see below)", duration(p.restore_s)],
        ["job MTBF", duration(p.job_mtbf_s)],
        ["interval, sync (Young / Daly / exact)", f"{duration(p.young_s)} / {duration(p.daly_s)} / {duration(p.daly_exact_s)}"],
        ["interval, async (ckpt)", duration(p.async_s)],
        ["expected ETTR, sync / async", f"{p.ettr_sync:.1%} / {p.ettr_async:.1%}"],
    ]
    if p.slowdown_s:
        rows[2:2] = [["slowdown (the steps beside a save)", duration(p.slowdown_s)]]
        rows.append(["priced at blocking only: interval, ETTR", f"{duration(p.async_blocking_only_s)}, {p.ettr_async_blocking_only:.1%} ({100 * (p.ettr_async - p.ettr_async_blocking_only):.2f} pp less)"])
    table(rows, ["quantity", "estimate"])
    say("")
    rows = scale_rows(big)
    rows.insert(next(i for i, r in enumerate(rows) if r[0] == "restore, predicted") + 1,
                ["restore begun by ckpt.prepare, predicted", f"{duration(early.restore_s)} (its survey and clients made as the job sets up)"])  # fmt: skip
    table(rows, [f"at {nodes * args.gpus_per_node} ranks ({args.layout})", "estimate"])
    if big.loaded_per_rank > parse_bytes(args.gpu_memory):
        say()
        say(
            f"note: each rank of this layout holds {human_bytes(big.loaded_per_rank)} of state, more than a GPU's "
            f"{args.gpu_memory} (--gpu-memory): the job cannot run so; shard it (fsdp, or hsdp:R with fewer replicas)"
        )
    return EXIT_OK


def scale_rows(a: AtScale) -> list[list[str]]:
    """`ckpt plan`'s second table: what the job's scale adds (`ckpt.schedule.scale_model`)."""
    return [
        ["per rank: saves / loads", f"{human_bytes(a.saved_per_rank)} / {human_bytes(a.loaded_per_rank)}"],
        [".metadata (every piece of every tensor)", human_bytes(a.metadata_bytes)],
        (
            ["a rank's metadata read: its index + .index", f"{human_bytes(a.index_bytes)} + {human_bytes(a.shared_index_bytes)}"]
            if a.metadata_read != ".metadata, whole"
            else ["a rank's metadata read: .metadata, whole", human_bytes(a.metadata_bytes)]
        ),
        ["save: bytes / requests (PUT) bound", f"{duration(a.save_bytes_s)} / {duration(a.save_requests_s)} ({a.save_requests:,.0f} requests)"],
        ["save: rank 0's .metadata, written again", duration(a.save_metadata_s)],
        ["save: a rank's CPU, fixed + its bytes' / rank 0's round trips", f"{duration(a.save_cpu_s)} + {duration(a.save_stream_s)} / {duration(a.save_round_trips_s)}"],
        ["save, predicted", f"{duration(a.save_s)} (bound by {a.save_binds})"],
        ["the first save (writer processes start, rank 0 pickles .metadata)", duration(a.first_save_s)],
        ["restore: bytes / requests (GET) bound", f"{duration(a.restore_bytes_s)} / {duration(a.restore_requests_s)} ({a.restore_requests:,.0f} requests)"],
        *([["restore: replicas send each other what they read", duration(a.restore_exchange_s)]] if a.restore_exchange_s else []),
        ["restore: a rank's CPU / rank 0's round trips", f"{duration(a.restore_cpu_s)} / {duration(a.restore_round_trips_s)}"],
        *([["restore: of the bytes' time, read while the ranks plan", f"-{duration(a.restore_overlap_s)}"]] if a.restore_overlap_s else []),
        ["restore: rank 0's survey of the root", f"{duration(a.restore_survey_s)} ({a.survey_round_trips} round trips, {a.survey_keys:,} keys listed)"],
        ["restore, predicted", f"{duration(a.restore_s)} (bound by {a.restore_binds})"],
        ["restore on half the ranks: a rank's metadata", duration(a.restore_resharded_metadata_s)],
    ]


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.days <= 0 or args.nodes < 1 or args.runs < 1:
        raise ValueError("--days must be > 0, --nodes and --runs >= 1")
    lo, _, hi = args.restart.partition("-")
    job = dataclasses.replace(
        scenario(args.scenario, args.nodes),
        blocking_s=parse_duration(args.blocking),
        slowdown_s=parse_duration(args.slowdown),
        persist_s=parse_duration(args.persist),
        restart_min_s=parse_duration(lo),
        restart_max_s=parse_duration(hi or lo),
        wall_s=args.days * DAY,
        step_s=parse_duration(args.step_time),
        fixed_steps=args.fixed_steps,
    )
    if args.mtbf:
        job = dataclasses.replace(job, mtbf_s=parse_duration(args.mtbf))
    if job.restart_min_s > job.restart_max_s:
        raise ValueError("--restart must be a range low-high")
    rows = compare(job, runs=args.runs, seed=args.seed)
    oracle = max(v["ettr"] for k, v in rows.items() if k in ("young", "daly", "async-oracle"))
    coord = [v["ettr"] for k, v in rows.items() if k.startswith("coordinator")]
    verdict = {
        "best_oracle_ettr": oracle,
        "coordinator_gap_pp": max(0.0, 100 * (oracle - min(coord))),
        "coordinator_above_fixed": min(coord) >= rows["fixed"]["ettr"],
    }
    blocking_only = rows.get("async-oracle priced at blocking only")
    if blocking_only is not None:  # both know the MTBF: the difference is the pricing alone
        verdict["blocking_only_loss_pp"] = 100 * (rows["async-oracle"]["ettr"] - blocking_only["ettr"])
    if args.json:
        emit_json({"job": dataclasses.asdict(job), "policies": rows, **verdict})
        return EXIT_OK
    slowed = f", slows the steps beside it {duration(job.slowdown_s)}" if job.slowdown_s else ""
    say(f"job MTBF {duration(job.mtbf_s)}, save blocks {duration(job.blocking_s)}{slowed}, persists in {duration(job.persist_s)}, "
        f"restarts {duration(job.restart_min_s)}-{duration(job.restart_max_s)}, {args.days:g} days, {args.runs} runs each")
    table(
        [[k, f"{v['ettr']:.2%} ± {v['ettr_sd']:.2%}", duration(v["interval_s"])] for k, v in rows.items()],
        ["policy", "ETTR", "mean interval"],
    )
    say(f"coordinator vs best oracle: {verdict['coordinator_gap_pp']:.2f} pp below (target <= 2); "
        f"never below the fixed interval: {'yes' if verdict['coordinator_above_fixed'] else 'NO'}")
    if blocking_only is not None:
        say(f"priced at its blocking time alone, a save would cost {verdict['blocking_only_loss_pp']:.2f} pp of ETTR (the oracle's, either way)")
    return EXIT_OK
