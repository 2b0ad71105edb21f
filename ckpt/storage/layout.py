"""The layout of a root (docs/design.md): `<root>/step-<N:010d>/` and `<root>/events/`, which names
are step directories (`step_of`, the one check, for every backend), what a listing of the root
found (`StepListing`, `Stray`), and how much of a root's JSON file is read before it is parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckpt.format.manifest import MANIFEST_MAX, MANIFEST_NAME

MiB = 1 << 20
# IMPORTANT: ASCII digits only. `\d` and `str.isdigit` take the digits of every script
# ("step-\u0660..." named step 6 and hid the real one), and `$` matches before a final newline.
STEP_DIR = re.compile(r"\Astep-([0-9]{10})\Z", re.ASCII)
EVENTS_DIR = "events"
# The most bytes read of any other JSON object of a root (lease.json, events/*.json): a few
# hundred bytes each when ckpt wrote them; a larger one is refused by its size, not parsed.
SMALL_JSON_MAX = 1 * MiB
NOT_A_STEP_NAME = "not step- and ten ASCII digits"


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or not 0 <= step < 10**10:
        raise ValueError(f"a step is an integer from 0 to 9999999999, not {step!r}")
    return f"step-{step:010d}"


def step_of(name: str) -> int | None:
    """The step a root entry's name says, or None when it is no step directory's name: the
    one check of step names, on every backend."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def json_cap(rel: str) -> int | None:
    """The most bytes of `rel` read before it is parsed, when it is a JSON object of the root
    (a manifest, the lease, an event); None for other files."""
    name = rel.rsplit("/", 1)[-1]
    if name == MANIFEST_NAME:
        return MANIFEST_MAX
    return SMALL_JSON_MAX if name.endswith(".json") else None


@dataclass
class StepListing:
    """What a scan of the root found for one step directory: file names and sizes."""

    step: int
    files: dict[str, int] = field(default_factory=dict)
    manifest_mtime: float | None = None  # when the store says the manifest was written
    # Entries that are neither files nor directories (links, FIFOs, ...) and what each is:
    # never followed, never read.
    odd: dict[str, str] = field(default_factory=dict)
    # False: only the manifest was looked at (`Store.survey(whole=False)`), `files` holds it
    # alone if it is there; the directory's other files are not known (a deep check lists them).
    whole: bool = True

    @property
    def has_manifest(self) -> bool:
        return MANIFEST_NAME in self.files


@dataclass(frozen=True)
class Stray:
    """An entry of the root named `step-...` that is no step directory (a link, a file, a
    FIFO, a name in other digits): no checkpoint, and never read, written or deleted through."""

    name: str
    what: str  # "a symbolic link to ...", "a file", NOT_A_STEP_NAME, ...
    step: int | None = None  # the step its name is, when it is a step directory's name
