"""`ckpt`: the admin CLI. List, show, verify and delete checkpoints under any root.

This module builds the parser from the verbs' modules (`ckpt.cli.inspection`, `deletion`,
`jobs`, `planning`, `whole`; `ckpt agent` is the node daemon's own) and runs one verb.
A user's mistake (a bad URL, a missing step, credentials that do not work) is one line on
stderr and exit code 2; a checkpoint that fails verification is exit code 1. `diff` answers
as diff(1) does: 1 means the two differ, so a corrupt or untrusted side is 2 (no answer).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ckpt.cli import deletion, inspection, jobs, planning, whole
from ckpt.cli.arguments import split_step, storage_options
from ckpt.cli.terminal import EXIT_INVALID, EXIT_OK, EXIT_USAGE, printable, say
from ckpt.errors import CheckpointError, InvalidCheckpoint
from ckpt.redact import redact
from ckpt.storage.store import Store, Transfer

# An admin command on an unreachable store says so in seconds, not after a trainer's patience
# (the commands that copy a whole checkpoint excepted).
CLI_TRANSFER = Transfer(attempts=3, max_backoff_s=2.0, timeout_s=20.0)
# The verbs that move a whole checkpoint retry as a save does: a copy of gigabytes must not
# fail on one burst of throttling (its destination's store already does).
BULK = (whole.cmd_cp, whole.cmd_restore, whole.cmd_export, whole.cmd_diff)


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
            args.root, args.root_step = split_step(args.root)
        store = Store(args.root, storage_options(args.storage_option), Transfer() if args.func in BULK else CLI_TRANSFER)
        return args.func(store, args)
    except InvalidCheckpoint as e:
        _error(e)
        return EXIT_USAGE if args.func is whole.cmd_diff else EXIT_INVALID
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
        if args.func is not whole.cmd_diff:
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
    inspection.add_parsers(sub, common)
    deletion.add_parsers(sub, common)
    jobs.add_parsers(sub, common)
    planning.add_parsers(sub)
    whole.add_parsers(sub, common)
    return p


if __name__ == "__main__":
    sys.exit(main())
