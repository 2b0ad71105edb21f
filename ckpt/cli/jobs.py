"""The CLI's verbs about the jobs that use a root rather than its checkpoints: `events` (the
job's runs, restarts and failures) and `lease` (which job holds the root; `--break` frees
it), and the lease in a line for the verbs that must heed it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from ckpt.cli.arguments import require_root
from ckpt.cli.terminal import EXIT_OK, emit_json, say, table, when
from ckpt.errors import InvalidCheckpoint
from ckpt.events import read_all
from ckpt.storage import lease
from ckpt.storage.store import Store


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    events = sub.add_parser("events", parents=[common], help="the job's runs, restarts and failures")
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=cmd_events)
    held = sub.add_parser("lease", parents=[common], help="which job holds the root (one at a time); --break frees it")
    held.add_argument("--break", dest="break_lease", action="store_true",
                      help="free the root even from a live job: that job's next save fails instead of writing here")
    held.add_argument("--json", action="store_true")
    held.set_defaults(func=cmd_lease)


def lease_line(store: Store) -> str | None:
    """The root's lease in a line while a job holds it (expired too); None when it is free."""
    try:
        holder = lease.read(store)
    except ValueError as e:
        return f"unreadable ({e}); `ckpt lease ROOT --break` replaces it"
    now = time.time()
    return None if lease.state(holder, now) == "free" else lease.describe(holder, now, lease.holder_alive(holder))


def cmd_events(store: Store, args: argparse.Namespace) -> int:
    require_root(store)
    runs, evs = read_all(store)
    if args.json:
        emit_json({"runs": [asdict(r) for r in runs], "events": [asdict(e) for e in evs]})
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
        rows.append([when(e.time), e.kind, what, lost, world, e.cause or "-"])
    table(rows, ["TIME", "EVENT", "WHAT", "STEPS LOST", "WORLD", "CAUSE"])
    say(f"{len(runs)} runs, {sum(e.kind == 'restart' for e in evs)} restarts")
    return EXIT_OK


def cmd_lease(store: Store, args: argparse.Namespace) -> int:
    require_root(store)
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
        emit_json({
            "root": store.display,
            "state": lease.state(holder, now),
            "holder": asdict(holder) if holder else None,
            "expires_in_s": holder.expires - now if holder and holder.released is None else None,
            "holder_alive": lease.holder_alive(holder),  # null: on another machine, nobody here can tell
        })
    else:
        say(f"{store.display}: {lease.describe(holder, now, lease.holder_alive(holder))}")
    return EXIT_OK
