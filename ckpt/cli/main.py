"""`ckpt`: the admin CLI. List, show, verify and delete checkpoints under any root.

A user's mistake (a bad URL, a missing step, credentials that do not work) is one line on
stderr and exit code 2; a checkpoint that fails verification is exit code 1. `diff` answers
as diff(1) does: 1 means the two differ, so a corrupt or untrusted side is 2 (no answer).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from ckpt.cli import whole as cli_tools
from ckpt.cli.whole import key_option, printable, say, signing_key
from ckpt.errors import CheckpointError, InvalidCheckpoint, NotFound
from ckpt.format.manifest import METADATA_NAME
from ckpt.format.signing import SigningKey
from ckpt.redact import redact
from ckpt.schedule.policy import Keep
from ckpt.storage import catalog
from ckpt.storage.store import Store, Stray, Transfer, step_dir_name

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
# An admin command on an unreachable store says so in seconds, not after a trainer's patience
# (the commands that copy a whole checkpoint excepted).
CLI_TRANSFER = Transfer(attempts=3, max_backoff_s=2.0, timeout_s=20.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:  # the node daemon: its own flags, environment and config file
        from ckpt.agent.daemon import main as agent_main

        return agent_main(argv[1:])
    args = _parser().parse_args(argv)
    terminal = logging.StreamHandler()
    terminal.setFormatter(_Printable("%(message)s"))
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING, handlers=[terminal])
    try:
        if getattr(args, "root", None) is None:  # plan, simulate: no checkpoint root
            return args.func(args)
        if hasattr(args, "other"):  # diff: ROOT[:STEP]
            args.root, args.root_step = cli_tools.split_step(args.root)
        # The verbs that move a whole checkpoint retry as a save does: a copy of gigabytes must
        # not fail on one burst of throttling (its destination's store already does).
        bulk = args.func in (cli_tools.cmd_cp, cli_tools.cmd_restore, cli_tools.cmd_export, cli_tools.cmd_diff)
        store = Store(args.root, _options(args.storage_option), Transfer() if bulk else CLI_TRANSFER)
        return args.func(store, args)
    except InvalidCheckpoint as e:
        _error(e)
        return EXIT_USAGE if args.func is cli_tools.cmd_diff else EXIT_INVALID
    except (CheckpointError, ValueError) as e:
        _error(e)
        return EXIT_USAGE
    except ArithmeticError as e:  # plan, simulate: numbers out of any sensible range
        _error(ValueError(f"the numbers given are out of range ({type(e).__name__}: {e})"))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ckpt show ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a local path the command cannot write or read (--out, --to)
        _error(e)
        return EXIT_USAGE
    except Exception as e:
        if args.func is not cli_tools.cmd_diff:
            raise
        _error(e)  # diff's 1 is "they differ": anything else that stops it is no answer
        return EXIT_USAGE


def _error(e: Exception) -> None:
    # One line even when a backend's message has several (botocore's validation errors).
    say(f"ckpt: {redact(' '.join(str(e).split()))}", err=True)


class _Printable(logging.Formatter):
    """Log lines as `say` writes its own: a message naming what the root holds is escaped
    (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and exit 2, like every other mistake (subcommands too)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        head, sep, args = message.partition("unrecognized arguments: ")
        if sep:  # a mistyped option's value may be a credential: only the options are echoed
            names = [a for a in args.split() if a.startswith("-")]
            message = f"{head}unrecognized arguments: {' '.join(names) or '(values not shown)'}"
        self.exit(EXIT_USAGE, f"ckpt: {printable(redact(message))} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckpt", description="Inspect and manage ckpt checkpoints.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("root", help="checkpoint root: a path or fsspec URL (s3://bucket/prefix)")
    common.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)",
    )
    common.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    sub.add_parser("agent", help="run the node daemon: uploads, spool, metrics (ckpt agent --help)", add_help=False)
    ls = sub.add_parser("ls", parents=[common], help="list checkpoints")
    ls.add_argument("--json", action="store_true")
    key_option(ls, "a SIGNATURE column says which checkpoints are signed with it")
    ls.set_defaults(func=cmd_ls)

    show = sub.add_parser("show", parents=[common], help="manifest and tensor inventory")
    show.add_argument("--step", type=cli_tools.step_arg, help="default: the newest committed")
    show.add_argument("--json", action="store_true")
    key_option(show, "only a checkpoint signed with it is shown (by default the newest such)")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", parents=[common], help="check files against manifests")
    verify.add_argument("--step", type=cli_tools.step_arg, help="default: every checkpoint")
    verify.add_argument("--deep", action="store_true", help="check every checksum, not only sizes")
    verify.add_argument("--json", action="store_true")
    key_option(verify, "an unsigned or wrongly signed checkpoint fails")
    verify.set_defaults(func=cmd_verify)

    rm = sub.add_parser("rm", parents=[common], help="delete one checkpoint")
    rm.add_argument("--step", type=cli_tools.step_arg, required=True)
    rm.add_argument("--force", action="store_true", help="allow deleting the newest committed one")
    key_option(rm, "the newest one signed with it is the one protected")
    rm.set_defaults(func=cmd_rm)

    gc = sub.add_parser("gc", parents=[common], help="apply retention")
    gc.add_argument("--keep-last", type=int, required=True)
    gc.add_argument("--keep-every", type=int, help="also keep steps that are multiples of this")
    gc.add_argument("--dry-run", action="store_true")
    key_option(gc, "only checkpoints signed with it count; the others are left alone, neither kept in the count nor deleted")
    gc.set_defaults(func=cmd_gc)
    events = sub.add_parser("events", parents=[common], help="the job's runs, restarts and failures")
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=cmd_events)
    lease = sub.add_parser("lease", parents=[common], help="which job holds the root (one at a time); --break frees it")
    lease.add_argument("--break", dest="break_lease", action="store_true",
                       help="free the root even from a live job: that job's next save fails instead of writing here")
    lease.add_argument("--json", action="store_true")
    lease.set_defaults(func=cmd_lease)

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
    pl.add_argument("--weights", type=float, default=2.0, help="bytes per parameter (default 2: BF16)")
    pl.add_argument("--grads", type=float, default=0.0, help="bytes per parameter of gradients kept (default 0)")
    pl.add_argument("--keep-grads", action="store_true", help="gradients are saved too, as many bytes as the weights")
    pl.add_argument("--adam", type=float, default=8.0, help="bytes per parameter of optimizer state (default 8: two FP32 moments)")
    pl.add_argument("--master", type=float, default=4.0, help="bytes per parameter of master weights (default 4: FP32)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    sim = sub.add_parser("simulate", help="goodput (ETTR) of interval policies in a simulated long job")
    sim.add_argument("--scenario", choices=["llama3", "rsc"], default="llama3",
                     help="failure rate: Llama 3's 419 interruptions in 54 days (job MTBF 3.1 h), or Meta RSC's 5.75 per 1000 node-days")
    sim.add_argument("--nodes", type=int, default=2048, help="nodes, for --scenario rsc (default 2048)")
    sim.add_argument("--mtbf", help="the job's MTBF instead of a scenario: 3h")
    sim.add_argument("--blocking", default="50ms", help="what one save blocks the loop (default 50ms)")
    sim.add_argument("--persist", default="30s", help="from save to commit (default 30s)")
    sim.add_argument("--restart", default="5min-20min", help="restart time, a range drawn uniformly (default 5min-20min)")
    sim.add_argument("--days", type=float, default=54.0, help="simulated wall time (default 54 days)")
    sim.add_argument("--step-time", default="2s", help="for the fixed interval of --fixed-steps (default 2s)")
    sim.add_argument("--fixed-steps", type=int, default=500, help="the fixed interval in steps (torchtitan's default, 500)")
    sim.add_argument("--runs", type=int, default=10, help="simulated jobs per policy (default 10)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_simulate)
    cli_tools.add_parsers(sub, common)
    return p


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError("--storage-option wants KEY=VALUE; one was given without '=' (not echoed: it may hold a secret)")
        try:
            out[key] = json.loads(value)  # true, 3, {"a": 1}
        except json.JSONDecodeError:
            out[key] = value
    return out


def _require_root(store: Store) -> None:
    if not store.exists(""):
        raise catalog.NotFound(f"{store.display} does not exist")


def _emit_json(doc: Any) -> None:
    """Strict JSON (what every parser reads): a number that is not finite, which a manifest's
    user metadata may hold, is written as the string "inf", "-inf" or "nan"."""
    json.dump(_finite(doc), sys.stdout, indent=1, default=str, allow_nan=False)
    sys.stdout.write("\n")


def _finite(doc: Any) -> Any:
    if isinstance(doc, float) and not math.isfinite(doc):
        return str(doc)
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc


def _table(rows: list[list[str]], header: list[str]) -> None:
    cells = [[printable(str(c)) for c in r] for r in [header, *rows]]  # escaped first: they are what is aligned
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        say("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _entry_doc(e: catalog.Entry) -> dict[str, Any]:
    m = e.manifest
    return {
        "step": e.step,
        "state": _state(e),
        "time": m.created if m else None,
        "bytes": m.total_bytes if m else e.bytes_on_store,
        "world_size": m.world_size if m else None,
        "problem": e.problem,
        # Checked with a key: "signed-ok", "unsigned" or "BAD"; without one, None.
        "signature": e.signature,
        # Whose signature the manifest carries (whether or not it was checked).
        "signed_key_id": m.signed_key_id if m else None,
    }


def _state(e: catalog.Entry) -> str:
    """An entry's state as the CLI says it: checked with a key, one not signed with it is
    "untrusted" (the catalog counts it as corrupt)."""
    return "untrusted" if catalog.untrusted(e) else e.state


def _signature_cell(e: catalog.Entry, key: SigningKey | None) -> str:
    """ls's SIGNATURE column: the check with a key; without one, whose signature it carries."""
    if e.manifest is None:
        return "-"
    if key is not None:
        return e.signature or "-"  # no check: the manifest could not be read
    kid = e.manifest.signed_key_id
    return f"key {kid}, not checked" if kid else "unsigned"


def cmd_plan(args: argparse.Namespace) -> int:
    from ckpt.schedule.plan import Ledger, parse_bytes, parse_count, parse_duration, plan

    nodes = args.nodes
    if nodes < 1 or args.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    mtbf_s = parse_duration(args.mtbf) if args.mtbf else parse_duration(args.node_mtbf) / nodes
    if args.keep_grads and args.grads:
        raise ValueError("--keep-grads (gradients as large as the weights) and --grads N: give one")
    ledger = Ledger(args.weights, args.weights if args.keep_grads else args.grads, args.adam / 2, args.adam / 2, args.master)
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
    )
    if args.json:
        from ckpt.schedule.plan import as_dict

        _emit_json(as_dict(p))
        return EXIT_OK
    rows = [
        ["checkpoint", f"{human_bytes(p.checkpoint_bytes)} ({p.bytes_per_param:g} B/param), {human_bytes(p.bytes_per_gpu)} per GPU"],
        ["blocking (staging copy)", _dur(p.blocking_s)],
        ["persist (all nodes writing)", _dur(p.persist_s)],
        ["restore (all nodes reading)", _dur(p.restore_s)],
        ["job MTBF", _dur(p.job_mtbf_s)],
        ["interval, sync (Young / Daly / exact)", f"{_dur(p.young_s)} / {_dur(p.daly_s)} / {_dur(p.daly_exact_s)}"],
        ["interval, async (ckpt)", _dur(p.async_s)],
        ["expected ETTR, sync / async", f"{p.ettr_sync:.1%} / {p.ettr_async:.1%}"],
    ]
    _table(rows, ["quantity", "estimate"])
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from ckpt.schedule.interval import DAY
    from ckpt.schedule.plan import parse_duration
    from ckpt.schedule.simulate import compare, scenario

    if args.days <= 0 or args.nodes < 1 or args.runs < 1:
        raise ValueError("--days must be > 0, --nodes and --runs >= 1")
    lo, _, hi = args.restart.partition("-")
    job = dataclasses.replace(
        scenario(args.scenario, args.nodes),
        blocking_s=parse_duration(args.blocking),
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
    if args.json:
        _emit_json({"job": dataclasses.asdict(job), "policies": rows, **verdict})
        return EXIT_OK
    say(f"job MTBF {_dur(job.mtbf_s)}, save blocks {_dur(job.blocking_s)}, persists in {_dur(job.persist_s)}, "
        f"restarts {_dur(job.restart_min_s)}-{_dur(job.restart_max_s)}, {args.days:g} days, {args.runs} runs each")
    _table(
        [[k, f"{v['ettr']:.2%} ± {v['ettr_sd']:.2%}", _dur(v["interval_s"])] for k, v in rows.items()],
        ["policy", "ETTR", "mean interval"],
    )
    say(f"coordinator vs best oracle: {verdict['coordinator_gap_pp']:.2f} pp below (target <= 2); "
        f"never below the fixed interval: {'yes' if verdict['coordinator_above_fixed'] else 'NO'}")
    return EXIT_OK


def _dur(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def cmd_ls(store: Store, args: argparse.Namespace) -> int:
    key = signing_key(args)
    _require_root(store)
    entries, strays = catalog.survey(store, key=key)
    if args.json:
        _emit_json([_entry_doc(e) for e in entries])
        for s in strays:
            say(f"ckpt: note: {_stray(s)}", err=True)
        return EXIT_OK
    rows = [
        [str(d["step"]), _when(d["time"]), human_bytes(d["bytes"]), str(d["world_size"] or "-"), d["state"]]
        for d in map(_entry_doc, entries)
    ]
    head = ["STEP", "TIME", "SIZE", "WORLD", "STATE"]
    # The column only where signatures mean something: a key given, or a signed manifest.
    if key is not None or any(e.manifest is not None and e.manifest.signature for e in entries):
        rows = [[*row, _signature_cell(e, key)] for row, e in zip(rows, entries, strict=True)]
        head.append("SIGNATURE")
    _table(rows, head)
    for s in strays:
        say(_stray(s))
    held = _lease_line(store)
    if held:
        say(f"lease: {held}")
    return EXIT_OK


def _stray(s: Stray) -> str:
    """A root entry named like a step directory that is none, in a line."""
    return f"{s.name}  not a checkpoint: {s.what}; left alone (nothing is read, written or deleted through it)"


def _lease_line(store: Store) -> str | None:
    """The root's lease in a line while a job holds it (expired too); None when it is free."""
    from ckpt.storage import lease
    try:
        holder = lease.read(store)
    except ValueError as e:
        return f"unreadable ({e}); `ckpt lease ROOT --break` replaces it"
    now = time.time()
    return None if lease.state(holder, now) == "free" else lease.describe(holder, now, lease.holder_alive(holder))


def cmd_show(store: Store, args: argparse.Namespace) -> int:
    from ckpt.restore.dcp_read import read_verified

    key = signing_key(args)
    if key is not None and args.step is None:  # the newest trusted: say what newer was passed over
        good, passed = catalog.restore_candidates(store, key)
        entry = good[0] if good else catalog.find(store, None, key)  # none: find says why
        newer = [e.dir for e in passed if catalog.untrusted(e)]
        if newer:
            say(f"ckpt: note: newer checkpoints not signed with the key are not shown: {', '.join(newer)}", err=True)
    else:
        entry = catalog.find(store, args.step, key)
    m = entry.manifest
    assert m is not None
    tensors = inventory(read_verified(store, entry.dir, METADATA_NAME, m))
    # Found with a key: signed with it; else not checked.
    signature = {"signature": entry.signature, "signed_key_id": m.signed_key_id}
    if args.json:
        _emit_json({"root": store.display, "dir": entry.dir, **signature, "manifest": json.loads(m.to_json()), "tensors": tensors})
        return EXIT_OK
    say(f"{store.display}/{entry.dir}")
    say(f"  step {m.step}, world size {m.world_size}, committed {_when(m.created)}")
    say(f"  {len(m.files)} files, {human_bytes(m.total_bytes)}")
    if entry.signature is not None:
        say(f"  signature: {entry.signature} (key {m.signed_key_id})")
    else:
        say(f"  signature: {f'key {m.signed_key_id}, not checked (no key given)' if m.signed_key_id else 'unsigned'}")
    say(
        f"  save: blocked {m.costs.blocking_s * 1e3:.1f} ms, persisted in {m.costs.persist_s:.2f} s"
    )
    say(f"  counters: {json.dumps(m.counters)}")
    if m.schedule:
        say(f"  schedule: {json.dumps(m.schedule)}")
    say(f"  versions: {', '.join(f'{k} {v}' for k, v in m.versions.items())}")
    if m.user:
        say(f"  metadata: {json.dumps(m.user)}")
    say()
    _table(
        [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["bytes"]) if t["bytes"] is not None else "-", str(t["chunks"])] for t in tensors],
        ["KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS"],
    )
    return EXIT_OK


def inventory(metadata_blob: bytes) -> list[dict[str, Any]]:
    """Tensors and objects of a checkpoint, from its checksum-verified `.metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckpt.restore.dcp_read import load_metadata

    md = load_metadata(metadata_blob)  # verified against the manifest by the caller
    out = []
    for key, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            numel = 1
            for s in item.size:
                numel *= s
            out.append(
                {
                    "key": key,
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(item.size),
                    "bytes": numel * dtype.itemsize,
                    "chunks": len(item.chunks),
                }
            )
        else:
            out.append({"key": key, "dtype": "object", "shape": [], "bytes": None, "chunks": 1})
    return out


def cmd_verify(store: Store, args: argparse.Namespace) -> int:
    key = signing_key(args)
    _require_root(store)
    if args.step is not None:
        listing = store.list_step(args.step)
        if listing is None:
            raise catalog.NotFound(f"no checkpoint at step {args.step} under {store.display}")
        entries, strays = [catalog.inspect(store, listing, metadata=True, deep=args.deep, key=key)], []
    else:
        entries, strays = catalog.survey(store, metadata=True, deep=args.deep, key=key)
    newest = max((e.step for e in entries if e.state == catalog.COMMITTED), default=-1)
    # A directory without a manifest newer than the newest commit may be a save in flight.
    failed = [e for e in entries if e.state == catalog.CORRUPT or (e.state == catalog.INCOMPLETE and args.step is not None)]
    if newest < 0 and not failed:  # "0 ok" would pass a mistyped root, or one that lost everything
        raise catalog.NotFound(f"no committed checkpoint under {store.display}: nothing to verify")
    if args.json:
        docs = [_entry_doc(e) for e in entries]
        _emit_json({"ok": not failed, "deep": args.deep, "signing_key_id": key.key_id if key else None, "checkpoints": docs})
    else:
        for e in entries:
            note = "" if e.state == catalog.COMMITTED else f": {e.problem}"
            if e.state == catalog.INCOMPLETE and e.step > newest and args.step is None:
                note += " (may be a save in progress)"
            signed = f"  {e.signature}" if e.signature else ""
            say(f"{e.dir}  {'ok' if e.state == catalog.COMMITTED else _state(e).upper()}{signed}{note}")
        for s in strays:  # no checkpoint, so none that fails
            say(_stray(s))
        ok = sum(e.state == catalog.COMMITTED for e in entries)
        say(f"{ok} ok, {len(failed)} failed ({'checksums' if args.deep else 'sizes'})")
    return EXIT_INVALID if failed else EXIT_OK


def cmd_rm(store: Store, args: argparse.Namespace) -> int:
    try:
        listing = store.list_step(args.step)
    except NotFound as e:  # a link or a file holds the step's name
        raise NotFound(f"no checkpoint at step {args.step}: {e}") from e
    if listing is None:
        raise catalog.NotFound(f"no checkpoint at step {args.step} under {store.display}")
    # Newest by commit time, as a restore picks it; with a key, the newest signed with it.
    committed = catalog.commit_order(catalog.scan(store, key=signing_key(args)))
    if committed and args.step == committed[-1] and not args.force:
        raise ValueError(
            f"step {args.step} is the newest committed checkpoint; a restart would lose it. "
            "Pass --force to delete it anyway."
        )
    if not listing.has_manifest and not args.force and (job := _lease_line(store)):
        raise ValueError(
            f"step {args.step} is not committed and a job holds the root ({job}): it may be writing it now. "
            "Pass --force to delete it anyway."
        )
    store.remove_step(args.step)
    say(f"deleted {store.display}/{step_dir_name(args.step)}")
    return EXIT_OK


def cmd_gc(store: Store, args: argparse.Namespace) -> int:
    _require_root(store)
    keep = Keep(last=args.keep_last, every_steps=args.keep_every)
    key = signing_key(args)
    entries, strays = catalog.survey(store, key=key)
    committed, doomed = catalog.retired(entries, keep)
    for e in entries:
        if catalog.untrusted(e):
            say(f"left alone (not counted, not deleted): {e.problem}")
    for s in strays:
        say(_stray(s))
    job = _lease_line(store)
    if job:  # its saves in progress (and a node agent's uploads) look like debris from here
        incomplete = {e.step for e in entries if e.state == catalog.INCOMPLETE}
        writing = [s for s in doomed if s in incomplete]
        doomed = [s for s in doomed if s not in incomplete]
        for step in writing:
            say(f"left alone (not committed, and a job holds the root: it may be writing it): {store.display}/{step_dir_name(step)}")
    if key is None and any(e.manifest is not None and e.manifest.signature for e in entries):
        say(
            "ckpt: note: this root holds signed checkpoints but no signing key was given: unsigned "
            "ones count as any other (pass --signing-key-file to count only the signed)",
            err=True,
        )
    for step in doomed:
        if not args.dry_run:
            store.remove_step(step)
        say(f"{'would delete' if args.dry_run else 'deleted'} {store.display}/{step_dir_name(step)}")
    say(f"{len(doomed)} {'to delete' if args.dry_run else 'deleted'}, {len(committed) - len([s for s in doomed if s in committed])} committed kept")
    return EXIT_OK


def cmd_events(store: Store, args: argparse.Namespace) -> int:
    _require_root(store)
    from ckpt.events import read_all

    runs, evs = read_all(store)
    if args.json:
        _emit_json({"runs": [asdict(r) for r in runs], "events": [asdict(e) for e in evs]})
        return EXIT_OK
    rows = []
    for e in evs:
        if e.kind == "restart":
            what = f"resumed at step {e.step} from {e.restored_from}"
            lost = "-" if e.steps_lost is None else str(e.steps_lost)
            world = f"{e.world_size_before} -> {e.world_size}"
        else:
            what = "failed to start" if e.phase == "start" else f"failed at step {e.step}"
            lost, world = "-", str(e.world_size)
        rows.append([_when(e.time), e.kind, what, lost, world, e.cause or "-"])
    _table(rows, ["TIME", "EVENT", "WHAT", "STEPS LOST", "WORLD", "CAUSE"])
    say(f"{len(runs)} runs, {sum(e.kind == 'restart' for e in evs)} restarts")
    return EXIT_OK


def cmd_lease(store: Store, args: argparse.Namespace) -> int:
    from ckpt.storage import lease
    _require_root(store)
    if args.break_lease:
        held = lease.break_lease(store)
        say(f"{store.display}: " + ("no live lease to break" if held is None else f"broke the lease of {held.who()}; the root is free"))
        return EXIT_OK
    try:
        holder = lease.read(store)
    except ValueError as e:
        raise InvalidCheckpoint(f"{store.display}/{lease.LEASE_NAME} is unreadable ({e}); `ckpt lease ROOT --break` replaces it") from e
    now = time.time()
    if args.json:
        _emit_json({
            "root": store.display,
            "state": lease.state(holder, now),
            "holder": asdict(holder) if holder else None,
            "expires_in_s": holder.expires - now if holder and holder.released is None else None,
            "holder_alive": lease.holder_alive(holder),  # null: on another machine, nobody here can tell
        })
    else:
        say(f"{store.display}: {lease.describe(holder, now, lease.holder_alive(holder))}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
