"""What the CLI writes: escaped lines, aligned tables, strict JSON, sizes and times as a
person reads them, and its exit codes. Every character of it that came from a root goes
through `printable` first: whoever can write the root writes what is shown.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

from ckpt.storage.store import Stray

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (escape sequences, carriage
    returns, newlines, bidirectional overrides) written as a Python escape (`\\x1b`): what
    the CLI shows comes from the root, and whoever can write the root writes it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def say(text: str = "", *, err: bool = False) -> None:
    """One line to the terminal (stdout, or stderr with `err`): the one way the CLI's text
    reaches it, escaped by `printable`."""
    print(printable(text), file=sys.stderr if err else sys.stdout)


def table(rows: list[list[str]], header: list[str]) -> None:
    cells = [[printable(str(c)) for c in r] for r in [header, *rows]]  # escaped first: they are what is aligned
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        say("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def emit_json(doc: Any) -> None:
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def duration(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def stray_line(s: Stray) -> str:
    """A root entry named like a step directory that is none, in a line."""
    return f"{s.name}  not a checkpoint: {s.what}; left alone (nothing is read, written or deleted through it)"
