"""The manifest: the commit marker of a checkpoint and its table of contents.

A checkpoint exists only when `<root>/step-<N>/manifest.json` exists. It lists every file
of the checkpoint with its size and checksum, so that nothing is read (and nothing is
unpickled) before it is known to be the bytes that were written. Plain dataclasses, no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import InvalidCheckpoint

FORMAT = "ckpt"
FORMAT_VERSION = 3  # 2: per-block checksums of data files; 3: BLAKE3 checksums (a signing job's)
_XXH3_FORMAT = 2  # what a manifest of xxh3 checksums is still written as: every ckpt since 2 reads it
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"  # DCP's pickled global metadata, written by rank 0
SHARED_INDEX = ".index"  # the part of it every rank reads, beside each rank's own (`ckpt.format.dcp_index`)
# The most indexes a restoring rank reads instead of `.metadata` (`ckpt.restore.partial`): a
# restore on fewer ranks reads about (saving ranks / restoring ranks) + 1; a replicated model
# one per rank, and there one `.metadata` from rank 0 costs less.
MAX_INDEXES = 64
INDEX_SUFFIX = ".index"


def index_name(data_name: str) -> str:
    """A rank's index beside its data file: __3_0.distcp -> __3_0.index."""
    return data_name.rpartition(".")[0] + INDEX_SUFFIX
# The most bytes of a manifest read before it is parsed (it is held whole, and parsing takes
# about twice its size again): a larger one is not a checkpoint. The manifest of 10,000 ranks,
# each with one data file of the most block checksums (64) in the longest form (BLAKE3), is
# 43 MiB; with xxh3 checksums 14 MiB.
MANIFEST_MAX = 64 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to its step directory."""

    size: int  # bytes
    checksum: str  # "<algorithm>:<hex digest>": "xxh3_64:0f1e...", or "blake3:..." (`ckpt.format.checksum`)
    rank: int  # the rank that wrote it (-1: written by the coordinator for all)
    # A large file's checksum is also kept per block of `block` bytes (the last may be
    # shorter), so that a reader can verify just the blocks it reads; `checksum` is then
    # "<algorithm>-blocks:" and the checksum of the block checksums. 0 and []: one checksum.
    block: int = 0
    blocks: tuple[str, ...] = ()


@dataclass
class SaveCosts:
    """What the save cost, as measured on rank 0 (seconds) and summed over ranks (bytes)."""

    blocking_s: float = 0.0  # the training loop waited this long (capture + stage)
    persist_s: float = 0.0  # from the start of the save to the commit
    bytes: int = 0  # all files of the checkpoint


@dataclass
class Manifest:
    """The commit record of one checkpoint. Field order is the JSON order."""

    step: int
    world_size: int
    created: float  # unix time of the commit
    files: dict[str, FileEntry]
    costs: SaveCosts = field(default_factory=SaveCosts)
    counters: dict[str, Any] = field(default_factory=dict)  # step and user counters at save
    versions: dict[str, str] = field(default_factory=dict)  # torch, ckpt, python
    user: dict[str, Any] = field(default_factory=dict)  # user metadata, JSON values
    # Why this save was taken when it was: the interval policy and, for "auto", the measured
    # blocking and persist times and the MTBF it was chosen from (seconds).
    schedule: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    # 0: the lowest its checksums allow (written so, a ckpt that cannot check BLAKE3 says
    # "upgrade ckpt" rather than "checksum mismatch"); read: as the JSON says.
    format_version: int = 0
    # With a signing key (`ckpt.format.signing`): {"alg": "hmac-sha256", "key_id": ..., "mac": hex}
    # over `signed_content()`. Absent from the JSON when unsigned; readers that predate it
    # ignore it, so it needs no new format version.
    signature: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if not self.format_version:
            blake3 = any(f.checksum.startswith("blake3") for f in self.files.values())
            self.format_version = FORMAT_VERSION if blake3 else _XXH3_FORMAT

    def indexed_for(self, world: int) -> bool:
        """Whether a restore by `world` ranks can read `.index` and the indexes of the files
        it loads from instead of `.metadata` (`ckpt.restore.partial`): several ranks restore
        a checkpoint saved with an index beside every rank's data file."""
        if world < 2 or SHARED_INDEX not in self.files:
            return False
        data = [n for n, e in self.files.items() if e.rank >= 0 and n.endswith(".distcp")]
        return len(data) == self.world_size and all(index_name(n) in self.files for n in data)

    def narrowed(self, files: dict[str, FileEntry]) -> Manifest:
        """This manifest listing `files` alone (what a rank other than 0 is told of a save:
        its own); without its signature, which would no longer check."""
        return dataclasses.replace(self, files=dict(files), signature=None)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def signed_key_id(self) -> str | None:
        """The id of the key the signature names, unchecked (None: unsigned). Only hex digits
        are shown as they are: the manifest may be anyone's."""
        kid = (self.signature or {}).get("key_id")
        if kid is None:
            return None
        return kid if all(c in "0123456789abcdef" for c in kid) and 0 < len(kid) <= 64 else "(not a key id)"

    def to_json(self) -> bytes:
        """The manifest as JSON: one line per field, and the files one per line. Built by hand
        and encoded by json's C encoder, line by line (`dataclasses.asdict` deep-copies every
        value, and `indent=` falls back to the pure-Python encoder: 0.39 against 0.13 ms for
        two ranks' manifest here)."""
        lines = []
        for k, v in self.to_doc().items():
            if k == "files":
                v = "{" + ",".join(f"\n  {json.dumps(n)}: {json.dumps(f)}" for n, f in v.items()) + "\n }"
                lines.append(f'"files": {v}')
            else:
                lines.append(f"{json.dumps(k)}: {json.dumps(v)}")
        return ("{\n " + ",\n ".join(lines) + "\n}\n").encode()

    def to_doc(self) -> dict[str, Any]:
        """The manifest as plain JSON values (what `to_json` writes), sharing nothing mutable."""
        doc: dict[str, Any] = {
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "files": {name: _file_doc(f) for name, f in self.files.items()},
            "costs": dataclasses.asdict(self.costs),
            "counters": copy.deepcopy(self.counters),
            "versions": dict(self.versions),
            "user": copy.deepcopy(self.user),
            "schedule": copy.deepcopy(self.schedule),
            "format": self.format,
            "format_version": self.format_version,
        }
        if self.signature is not None:
            doc["signature"] = dict(self.signature)
        return doc

    def signed_content(self) -> bytes:
        """What a signature covers: every field but the signature (each file's size and
        checksum too), as canonical JSON, the same for a manifest parsed back from its JSON."""
        doc = json.loads(self.to_json())  # as a reader sees it (keys as strings, tuples as lists)
        doc.pop("signature", None)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """Parse and validate; any malformed manifest is an InvalidCheckpoint naming `where`."""
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
            if doc.get("format_version", 0) > FORMAT_VERSION:
                raise ValueError(
                    f"format version {doc['format_version']} is newer than this ckpt "
                    f"understands ({FORMAT_VERSION}); upgrade ckpt"
                )
            files = {name: _file_entry(name, entry) for name, entry in doc["files"].items()}
            costs = SaveCosts(**doc.get("costs", {}))
            if not (_is_count(costs.bytes) and all(_is_time(t) for t in (costs.blocking_s, costs.persist_s))):
                raise ValueError(f"costs {doc.get('costs')!r} are not a byte count and seconds")
            for key in ("step", "world_size", "created"):
                if not (_is_time(doc[key]) if key == "created" else _is_count(doc[key])):
                    raise ValueError(f"{key} is {doc[key]!r}")
            return cls(
                step=doc["step"],
                world_size=doc["world_size"],
                created=float(doc["created"]),
                files=files,
                costs=costs,
                counters=dict(doc.get("counters", {})),
                versions=dict(doc.get("versions", {})),
                user=dict(doc.get("user", {})),
                schedule=dict(doc.get("schedule", {})),
                format=doc["format"],
                format_version=int(doc["format_version"]),
                signature=_signature(doc.get("signature")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidCheckpoint(f"{where}: unreadable manifest ({e})") from e


def _file_doc(f: FileEntry) -> dict[str, Any]:
    return {"size": f.size, "checksum": f.checksum, "rank": f.rank, "block": f.block, "blocks": list(f.blocks)}


def _signature(doc: Any) -> dict[str, str] | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise ValueError("signature is not an object of strings")
    return dict(doc)


def _file_entry(name: str, doc: dict[str, Any]) -> FileEntry:
    if not name or name.startswith("/") or ".." in name.split("/"):
        raise ValueError(f"file name {name!r} is not a path inside the step directory")
    entry = FileEntry(**{**doc, "blocks": tuple(doc.get("blocks", ()))})
    if not (_is_count(entry.size) and _is_count(entry.block) and _is_count(entry.rank + 1 if isinstance(entry.rank, int) else None)):
        raise ValueError(f"{name}: size {entry.size!r}, rank {entry.rank!r} or block {entry.block!r} is not a count")
    if not (isinstance(entry.checksum, str) and ":" in entry.checksum and all(isinstance(b, str) for b in entry.blocks)):
        raise ValueError(f"{name}: its checksum is not '<algorithm>:<hex>'")
    if entry.block < 0 or (entry.block and len(entry.blocks) != -(-entry.size // entry.block)):
        raise ValueError(f"{name}: {len(entry.blocks)} block checksums for {entry.size} bytes in blocks of {entry.block}")
    return entry


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_time(x: Any) -> bool:
    """A finite non-negative number (a unix time, seconds)."""
    return type(x) in (int, float) and 0 <= x < 1e15
