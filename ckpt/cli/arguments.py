"""The arguments the CLI's verbs share, and what each is checked for: a root and its
storage options (`--storage-option KEY=VALUE`), a step (`--step`, `ROOT:STEP`), and the key
signatures are checked with (`--signing-key-file`, else the environment).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ckpt.format.signing import SigningKey
from ckpt.storage import catalog
from ckpt.storage.store import Store


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """`--storage-option` values as fsspec's options: a value that is JSON is read as JSON."""
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


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    return storage_options(args.storage_option)


def require_root(store: Store) -> None:
    if not store.exists(""):
        raise catalog.NotFound(f"{store.display} does not exist")


def step_arg(text: str) -> int:
    """A --step value: a step number, never a name or a path."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, not {text!r}")
    return int(text)


def split_step(spec: str) -> tuple[str, int | None]:
    """'ROOT:STEP' -> (ROOT, STEP); 'ROOT' -> (ROOT, None) (s3://b/x stays whole, and so does
    a local directory whose name ends in ':7')."""
    head, sep, tail = spec.rpartition(":")
    if os.path.isdir(spec):
        return spec, None
    if sep and tail.isascii() and tail.isdigit() and head and not head.endswith(":/") and "//" not in tail:
        return head, int(tail)
    return spec, None


def key_option(parser: argparse.ArgumentParser, what: str = "only a checkpoint signed with it is used (by default the newest such)") -> None:
    parser.add_argument(
        "--signing-key-file",
        help=f"check signatures with the key in this file (default: CKPT_SIGNING_KEY_FILE, else CKPT_SIGNING_KEY): {what}",
    )


def signing_key(args: argparse.Namespace) -> SigningKey | None:
    """--signing-key-file's key, else the environment's (CKPT_SIGNING_KEY_FILE, CKPT_SIGNING_KEY)."""
    return SigningKey.from_file(args.signing_key_file) if args.signing_key_file else SigningKey.resolve()
