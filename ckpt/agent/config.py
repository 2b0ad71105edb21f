"""The settings of `ckpt agent` (flags, `CKPT_AGENT_*` environment variables, a TOML config
file, in that order of precedence) and its log format."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ckpt.node.durable import TAKE_OVER_S
from ckpt.redact import redact

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int | None) -> int:
    """'50GiB', '200MB', '1.5G', '4096' -> bytes (k/m/g/t: powers of 1000; with i: 1024)."""
    if text is None or isinstance(text, int):
        return int(text or 0)
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (say 50GiB, 200MB, 4096)")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


@dataclass
class Config:
    """The agent's settings (see `parser` for each one's meaning)."""

    spool: str = ""
    metrics_port: int = 9400  # 0: any free port; -1: not served
    metrics_addr: str = "127.0.0.1"
    upload_concurrency: int = 4
    part_concurrency: int = 2  # parts of one file in flight: memory is about files x (this + 1) x 64 MiB
    bandwidth_limit: int = 0  # bytes per second over all uploads; 0: unlimited
    requests_per_s: float = 0.0  # requests a second to the stores, this node's share of the job's; 0: unbounded
    spool_budget: int = 0  # bytes the spool may hold; 0: the disk's size
    keep_spool: int = 2  # committed checkpoints of each job kept in the spool
    preempt_file: str = ""  # a notice file to relay to the ranks (a cloud's preemption notice)
    shutdown_grace: float = 120.0  # seconds after SIGTERM before uploads are abandoned
    retries: int = 0  # tries of a hand-off's upload; 0: until commit_wait has passed
    commit_wait: float = 3600.0  # seconds a hand-off is retried and waits for the other ranks
    commit_takeover: float = TAKE_OVER_S  # seconds after which a node without rank 0 lists the markers too
    allowed_roots: list[str] = field(default_factory=list)  # URL prefixes it uploads to; empty: any
    log_format: str = "text"
    storage_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, argv: list[str] | None = None) -> Config:
        args = parser().parse_args(argv)
        given: dict[str, Any] = {}
        path = args.config or os.environ.get("CKPT_AGENT_CONFIG")
        if path:
            given.update(_read_config(path))
        for f in dataclasses.fields(cls):
            env = os.environ.get(f"CKPT_AGENT_{f.name.upper()}")
            if env is not None and f.name != "storage_options":
                given[f.name] = env
            flag = getattr(args, f.name, None)
            if flag is not None:
                given[f.name] = flag
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown agent settings: {sorted(unknown)}")
        config = cls(**{k: _coerce(k, v) for k, v in given.items()})
        if not config.spool:
            raise ValueError("the agent needs a spool directory: --spool, CKPT_AGENT_SPOOL or `spool` in the config file")
        if config.log_format not in ("text", "json"):
            raise ValueError(f"log_format is text or json, not {config.log_format!r}")
        if min(config.upload_concurrency, config.part_concurrency) < 1 or config.retries < 0:
            raise ValueError("upload_concurrency and part_concurrency must be at least 1, retries at least 0")
        if not -1 <= config.metrics_port <= 65535:
            raise ValueError(f"metrics_port is a TCP port (0: any free one; -1: not served), not {config.metrics_port}")
        return config


def within(root: str, allowed: str) -> bool:
    """Is the root `allowed` itself or under it, whole path components compared (s3://team-a
    does not admit s3://team-a-other)? A local path is resolved first (through `..` and
    symbolic links); a URL with a `.` or `..` component is under nothing."""
    def parts(url: str) -> tuple[str, list[str]] | None:
        protocol = fsspec.utils.get_protocol(url)
        path = url.split("://", 1)[1] if "://" in url else url
        if protocol == "file":
            return protocol, [p for p in os.path.realpath(os.path.expanduser(path)).split("/") if p]
        names = [p for p in path.split("/") if p]
        return None if any(p in (".", "..") for p in names) else (protocol, names)

    mine, theirs = parts(root), parts(allowed)
    return mine is not None and theirs is not None and mine[0] == theirs[0] and mine[1][: len(theirs[1])] == theirs[1]


def _read_config(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ValueError("a config file needs Python 3.11 or later (tomllib); use flags or CKPT_AGENT_* variables") from None
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read the agent's config file {path}: {e}") from None
    return dict(doc.get("agent", doc))


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(Config)}[name]
    if name in ("bandwidth_limit", "spool_budget"):
        return parse_size(value)
    if name == "storage_options":
        if not isinstance(value, dict):
            raise ValueError("storage_options must be a table")
        return value
    if name == "allowed_roots":
        roots = value.split(",") if isinstance(value, str) else value
        if not isinstance(roots, list) or not all(isinstance(r, str) for r in roots):
            raise ValueError("allowed_roots must be a list of URL prefixes")
        return [r.strip() for r in roots if r.strip()]
    try:
        return {"int": int, "float": float, "str": str}[kind](value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind}, not {value!r}") from None


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="ckpt agent")
    p.add_argument("--spool", help="the node spool: a local directory the ranks of this node share")
    p.add_argument("--metrics-port", type=int, help="serve /metrics and /healthz here (default 9400; -1: not at all)")
    p.add_argument("--metrics-addr", help="the address to serve on (default 127.0.0.1)")
    p.add_argument("--upload-concurrency", type=int, help="files uploaded at the same time (default 4)")
    p.add_argument("--part-concurrency", type=int, help="parts of one file in flight, 64 MiB each (default 2)")
    p.add_argument("--bandwidth-limit", help="bytes per second over all uploads: 200MB, 1GiB (default: unlimited)")
    p.add_argument(
        "--requests-per-s", type=float,
        help="requests a second this agent may send to the stores: its node's share of the job's rate (S3: about 3,500 writes a second per prefix); default 0: no bound, a SlowDown is waited out",
    )  # fmt: skip
    p.add_argument("--spool-budget", help="bytes the spool may hold: 50GiB (default: the disk); a full spool makes ranks write to the store")
    p.add_argument("--keep-spool", type=int, help="committed checkpoints of each job kept in the spool (default 2)")
    p.add_argument("--preempt-file", help="a preemption notice file to relay to the ranks of this node")
    p.add_argument("--shutdown-grace", type=float, help="seconds after SIGTERM before uploads are abandoned (default 120)")
    p.add_argument("--retries", type=int, help="tries of a hand-off's upload before it fails (default 0: until --commit-wait)")
    p.add_argument("--commit-wait", type=float, help="seconds a hand-off is retried and waits for the other ranks (default 3600)")
    p.add_argument(
        "--commit-takeover", type=float,
        help=f"seconds after its ranks are durable that a node without rank 0 also lists the other ranks' markers, to commit if rank 0's node died (default {TAKE_OVER_S:.0f})",
    )  # fmt: skip
    p.add_argument("--allowed-roots", help="comma-separated URL prefixes the agent uploads to (default: any)")
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON objects")
    p.add_argument("--config", help="a TOML file of these settings (env CKPT_AGENT_CONFIG)")
    return p


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's extras."""

    _PLAIN = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        doc.update({k: v for k, v in vars(record).items() if k not in self._PLAIN})
        if record.exc_info:
            doc["error"] = redact(self.formatException(record.exc_info))
        return json.dumps(doc, default=str)
