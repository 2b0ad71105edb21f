"""The CLI's verbs that delete: `rm` (one checkpoint) and `gc` (retention). Neither deletes
the checkpoint a restart would restore unless forced, nor what a job holding the root may
be writing. Both run without torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from ckpt.cli.arguments import key_option, require_root, signing_key, step_arg
from ckpt.cli.jobs import lease_line
from ckpt.cli.terminal import EXIT_OK, say, stray_line
from ckpt.errors import NotFound
from ckpt.schedule.policy import Keep
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    rm = sub.add_parser("rm", parents=[common], help="delete one checkpoint")
    rm.add_argument("--step", type=step_arg, required=True)
    rm.add_argument("--force", action="store_true", help="allow deleting the newest committed one")
    key_option(rm, "the newest one signed with it is the one protected")
    rm.set_defaults(func=cmd_rm)

    gc = sub.add_parser("gc", parents=[common], help="apply retention")
    gc.add_argument("--keep-last", type=int, required=True)
    gc.add_argument("--keep-every", type=int, help="also keep steps that are multiples of this")
    gc.add_argument("--dry-run", action="store_true")
    key_option(gc, "only checkpoints signed with it count; the others are left alone, neither kept in the count nor deleted")
    gc.set_defaults(func=cmd_gc)


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
    if not listing.has_manifest and not args.force and (job := lease_line(store)):
        raise ValueError(
            f"step {args.step} is not committed and a job holds the root ({job}): it may be writing it now. "
            "Pass --force to delete it anyway."
        )
    store.remove_step(args.step)
    say(f"deleted {store.display}/{step_dir_name(args.step)}")
    return EXIT_OK


def cmd_gc(store: Store, args: argparse.Namespace) -> int:
    require_root(store)
    keep = Keep(last=args.keep_last, every_steps=args.keep_every)
    key = signing_key(args)
    entries, strays = catalog.survey(store, key=key)
    committed, doomed = catalog.retired(entries, keep)
    for e in entries:
        if catalog.untrusted(e):
            say(f"left alone (not counted, not deleted): {e.problem}")
    for s in strays:
        say(stray_line(s))
    job = lease_line(store)
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
