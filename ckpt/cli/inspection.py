"""The CLI's verbs that read a root and change nothing: `ls` (its checkpoints in a table),
`show` (one checkpoint's manifest and tensors) and `verify` (every file against its
manifest). `ls` and `verify` run without torch.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from ckpt.admin import tools
from ckpt.cli.arguments import key_option, require_root, signing_key, step_arg
from ckpt.cli.jobs import lease_line
from ckpt.cli.terminal import (
    EXIT_INVALID,
    EXIT_OK,
    emit_json,
    human_bytes,
    say,
    stray_line,
    table,
    when,
)
from ckpt.format.signing import SigningKey
from ckpt.storage import catalog
from ckpt.storage.store import Store


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    ls = sub.add_parser("ls", parents=[common], help="list checkpoints")
    ls.add_argument("--json", action="store_true")
    key_option(ls, "a SIGNATURE column says which checkpoints are signed with it")
    ls.set_defaults(func=cmd_ls)

    show = sub.add_parser("show", parents=[common], help="manifest and tensor inventory")
    show.add_argument("--step", type=step_arg, help="default: the newest committed")
    show.add_argument("--json", action="store_true")
    key_option(show, "only a checkpoint signed with it is shown (by default the newest such)")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", parents=[common], help="check files against manifests")
    verify.add_argument("--step", type=step_arg, help="default: every checkpoint")
    verify.add_argument("--deep", action="store_true", help="check every checksum, not only sizes")
    verify.add_argument("--json", action="store_true")
    key_option(verify, "an unsigned or wrongly signed checkpoint fails")
    verify.set_defaults(func=cmd_verify)


def cmd_ls(store: Store, args: argparse.Namespace) -> int:
    key = signing_key(args)
    require_root(store)
    entries, strays = catalog.survey(store, key=key)
    if args.json:
        emit_json([_entry_doc(e) for e in entries])
        for s in strays:
            say(f"ckpt: note: {stray_line(s)}", err=True)
        return EXIT_OK
    rows = [
        [str(d["step"]), when(d["time"]), human_bytes(d["bytes"]), str(d["world_size"] or "-"), d["state"]]
        for d in map(_entry_doc, entries)
    ]
    head = ["STEP", "TIME", "SIZE", "WORLD", "STATE"]
    # The column only where signatures mean something: a key given, or a signed manifest.
    if key is not None or any(e.manifest is not None and e.manifest.signature for e in entries):
        rows = [[*row, _signature_cell(e, key)] for row, e in zip(rows, entries, strict=True)]
        head.append("SIGNATURE")
    table(rows, head)
    for s in strays:
        say(stray_line(s))
    held = lease_line(store)
    if held:
        say(f"lease: {held}")
    return EXIT_OK


def cmd_show(store: Store, args: argparse.Namespace) -> int:
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
    tensors = _tensors(tools.inventory(store, entry))
    # Found with a key: signed with it; else not checked.
    signature = {"signature": entry.signature, "signed_key_id": m.signed_key_id}
    if args.json:
        emit_json({"root": store.display, "dir": entry.dir, **signature, "manifest": json.loads(m.to_json()), "tensors": tensors})
        return EXIT_OK
    say(f"{store.display}/{entry.dir}")
    say(f"  step {m.step}, world size {m.world_size}, committed {when(m.created)}")
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
        priced = _priced(m.schedule)
        if priced:
            say(f"  interval: {priced}")
    say(f"  versions: {', '.join(f'{k} {v}' for k, v in m.versions.items())}")
    if m.user:
        say(f"  metadata: {json.dumps(m.user)}")
    say()
    table(
        [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["bytes"]) if t["bytes"] is not None else "-", str(t["chunks"])] for t in tensors],
        ["KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS"],
    )
    return EXIT_OK


def _tensors(md: Any) -> list[dict[str, Any]]:
    """Tensors and objects of a checkpoint, from its DCP metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for key, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            out.append(
                {
                    "key": key,
                    "dtype": str(item.properties.dtype).removeprefix("torch."),
                    "shape": list(item.size),
                    "bytes": tools.tensor_bytes(item),
                    "chunks": len(item.chunks),
                }
            )
        else:
            out.append({"key": key, "dtype": "object", "shape": [], "bytes": None, "chunks": 1})
    return out


def cmd_verify(store: Store, args: argparse.Namespace) -> int:
    key = signing_key(args)
    require_root(store)
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
        emit_json({"ok": not failed, "deep": args.deep, "signing_key_id": key.key_id if key else None, "checkpoints": docs})
    else:
        for e in entries:
            note = "" if e.state == catalog.COMMITTED else f": {e.problem}"
            if e.state == catalog.INCOMPLETE and e.step > newest and args.step is None:
                note += " (may be a save in progress)"
            signed = f"  {e.signature}" if e.signature else ""
            say(f"{e.dir}  {'ok' if e.state == catalog.COMMITTED else _state(e).upper()}{signed}{note}")
        for s in strays:  # no checkpoint, so none that fails
            say(stray_line(s))
        ok = sum(e.state == catalog.COMMITTED for e in entries)
        say(f"{ok} ok, {len(failed)} failed ({'checksums' if args.deep else 'sizes'})")
    return EXIT_INVALID if failed else EXIT_OK


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


def _priced(schedule: dict[str, Any]) -> str:
    """What an "auto" interval was priced at, in words (issue 42), or "" (another policy, or
    a schedule that is not all numbers: the manifest may be anyone's)."""
    sc = schedule

    def num(key: str) -> float | None:
        v = sc.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return None
        try:
            return float(v) if math.isfinite(v) else None
        except OverflowError:  # an int of 400 digits
            return None

    seconds, cost, blocked, busy, mtbf, goodput = (num(k) for k in ("seconds", "cost_s", "blocking_s", "persist_s", "mtbf_s", "goodput"))
    if sc.get("policy") != "auto" or None in (seconds, cost, blocked, busy, mtbf, goodput):
        return ""
    slowdown = num("slowdown_s")
    slowed = "not measured yet" if slowdown is None else f"{slowdown:.3g} s"
    busy_as = "made durable by the node agent in" if sc.get("persist_of") == "node agent's upload" else "its slot busy"
    return (
        f"every {seconds:.3g} s, a save priced at {cost:.3g} s (blocked {blocked:.3g} s, "
        f"slowed the steps beside it {slowed}), {busy_as} {busy:.3g} s, job MTBF {mtbf:.3g} s: "
        f"expected goodput {100 * goodput:.1f}%"
    )
