"""The node spool shared by the ranks of a node and its agent (`ckpt agent`), and the commit
that whoever finishes last makes.

With an agent on the node, a rank writes its files to the spool, a local directory, and
hands them off with a request; the agent uploads them to the job's root and marks them
durable there. The checkpoint commits when every rank's files are durable:

    <root>/step-N/.durable/<save id>.rank-00003   one per rank, after its files are durable
    <root>/step-N/manifest.json                  written by whoever saw the last marker

Each party writes its marker and then lists the markers, so of any two the later one sees
both: the last one always commits. Writing the manifest twice is harmless (the same
checkpoint), and a party that died between its marker and the manifest is covered by the
others, which look again while they wait. A rank whose node has no agent (or a full spool)
writes to the root itself and takes part the same way.

The spool (`<spool>/`):

    agent.json                                   the agent's heartbeat, budget and usage
    preempt                                      touched by the agent: the ranks checkpoint and stop
    jobs/<job>/step-N/<files>                    the rank's files, as in the root
    jobs/<job>/step-N/.requests/rank-00003.json  a hand-off, written once the files are durable
    jobs/<job>/step-N/.status/rank-00003.json    the agent's progress: uploading, durable, committed, failed
    metrics/<job>.rank-00003.prom                each rank's metrics, for the agent to serve

`<job>` is a digest of the root's URL. Everything is written whole (a temporary file and a
rename); nothing here needs torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError
from .manifest import MANIFEST_NAME, Manifest, SaveCosts
from .storage import Store, fsync_dir

log = logging.getLogger(__name__)

SPOOL_ENV = "CKPT_SPOOL"
AGENT_FILE = "agent.json"
NOTICE_FILE = "preempt"
DURABLE_DIR = ".durable"
REQUESTS_DIR = ".requests"
STATUS_DIR = ".status"
# The agent rewrites its heartbeat every second; one older than this is a dead agent.
AGENT_STALE_S = 10.0
# storage_options whose values are secrets: never written to the spool (the agent has its own).
_SECRET_OPTIONS = {"key", "secret", "token", "password", "session_token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "client_kwargs"}

UPLOADING, DURABLE, COMMITTED, FAILED = "uploading", "durable", "committed", "failed"


def job_key(store: Store) -> str:
    """The spool's name for a job: a digest of its root (the same on every node)."""
    protocol = store.fs.protocol if isinstance(store.fs.protocol, str) else store.fs.protocol[0]
    where = store.root if store.is_local else f"{protocol}://{store.root}"
    return hashlib.sha256(where.encode()).hexdigest()[:16]


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def public_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The storage options that may be written down: no credentials."""
    return {k: v for k, v in (options or {}).items() if k.lower() not in _SECRET_OPTIONS and _jsonable(v)}


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def write_json(path: str, doc: Any) -> None:
    """Write a small JSON file whole: readers see the old one or the new one."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


def listdir(path: str) -> list[str]:
    """The names in a directory, without hidden ones (temporary files); none if it is missing."""
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return []


def status_of(request_path: str) -> str:
    """The agent's status file for a request file."""
    step_dir = os.path.dirname(os.path.dirname(request_path))
    return os.path.join(step_dir, STATUS_DIR, os.path.basename(request_path))


def read_json(path: str) -> Any:
    """A JSON file, or None when it is missing or unreadable (a torn write never is: see
    `write_json`; an unreadable one is treated as absent and rewritten)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclass
class Request:
    """One rank's hand-off of one save's files."""

    root: str
    storage_options: dict[str, Any]
    rel: str  # the step directory
    step: int
    save_id: str
    rank: int
    world: int
    files: list[str]  # this rank's files, under rel
    manifest: dict[str, Any]  # the checkpoint's manifest, to write when every rank is durable
    started: float  # unix time the save started (the commit's persist time counts from it)
    submitted: float = field(default_factory=time.time)

    @classmethod
    def from_doc(cls, doc: Any) -> Request:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(doc, dict) or not names >= set(doc) or not {"root", "rel", "rank", "files", "manifest"} <= set(doc):
            raise ValueError("not a hand-off request")
        return cls(**doc)

    def manifest_obj(self) -> Manifest:
        return Manifest.from_json(json.dumps(self.manifest).encode(), f"request {self.rel}/{rank_name(self.rank)}")


class Spool:
    """The paths of a node spool."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))

    def __repr__(self) -> str:
        return f"Spool({self.path!r})"

    @property
    def agent_file(self) -> str:
        return os.path.join(self.path, AGENT_FILE)

    @property
    def notice_file(self) -> str:
        return os.path.join(self.path, NOTICE_FILE)

    def job_dir(self, job: str) -> str:
        return os.path.join(self.path, "jobs", job)

    def request_path(self, job: str, rel: str, rank: int) -> str:
        return os.path.join(self.job_dir(job), rel, REQUESTS_DIR, f"{rank_name(rank)}.json")

    def status_path(self, job: str, rel: str, rank: int) -> str:
        return os.path.join(self.job_dir(job), rel, STATUS_DIR, f"{rank_name(rank)}.json")

    def metrics_path(self, job: str, rank: int) -> str:
        return os.path.join(self.path, "metrics", f"{job}.{rank_name(rank)}.prom")

    def requests(self, job: str | None = None) -> list[str]:
        """The request files in the spool (of one job), in the order of their step."""
        found = []
        jobs = os.path.join(self.path, "jobs")
        for j in [job] if job else listdir(jobs):
            for rel in listdir(os.path.join(jobs, j)):
                reqs = os.path.join(jobs, j, rel, REQUESTS_DIR)
                found += [os.path.join(reqs, n) for n in listdir(reqs) if n.endswith(".json")]
        return sorted(found, key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))), p))

    def agent(self) -> dict[str, Any] | None:
        """The agent's last heartbeat, if it is recent: None when no agent serves this spool."""
        doc = read_json(self.agent_file)
        if not isinstance(doc, dict) or doc.get("stopped") or time.time() - float(doc.get("heartbeat", 0)) > AGENT_STALE_S:
            return None
        return doc

    def room(self, need: int) -> str | None:
        """Why `need` more bytes do not fit (the agent's budget, the disk), or None."""
        doc = self.agent() or {}
        budget, used = int(doc.get("budget", 0) or 0), int(doc.get("used", 0) or 0)
        if budget and used + need > budget:
            return f"the spool's budget of {budget / 1e9:.2f} GB holds {used / 1e9:.2f} GB"
        with contextlib.suppress(OSError):
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
            if need > free:
                return f"the spool's disk has {free / 1e9:.2f} GB free"
        return None


# -- the commit, by whoever finishes last ------------------------------------------------------
def marker_name(save_id: str, rank: int) -> str:
    return f"{save_id}.{rank_name(rank)}"


def mark_durable(store: Store, rel: str, save_id: str, rank: int, files: dict[str, str]) -> None:
    """Record in the root that `rank`'s files of save `save_id` are durable there."""
    doc = {"save_id": save_id, "rank": rank, "files": files, "time": time.time()}
    store.put_atomic(f"{rel}/{DURABLE_DIR}/{marker_name(save_id, rank)}", json.dumps(doc).encode())


def commit_if_complete(store: Store, request: Request) -> str | None:
    """Write the manifest if every rank's marker of this save is there. Returns "committed"
    (this call wrote it), "found" (it was there already) or None (a rank is not durable yet).
    Idempotent: any party may call it any number of times."""
    rel = request.rel
    if store.exists(f"{rel}/{MANIFEST_NAME}"):
        return "found"
    markers = set(store.list_dir(f"{rel}/{DURABLE_DIR}"))
    if not all(marker_name(request.save_id, r) in markers for r in range(request.world)):
        return None
    manifest = request.manifest_obj()
    # `created` stays the draft's: commits of different steps may land out of order (one
    # node slower), and the order of the saves is what restore and retention go by.
    persist_s = max(time.time() - request.started, 0.0)
    manifest = dataclasses.replace(manifest, costs=SaveCosts(manifest.costs.blocking_s, persist_s, manifest.costs.bytes))
    # IMPORTANT: the commit. Every rank's files are durable: their markers say so.
    store.put_atomic(f"{rel}/{MANIFEST_NAME}", manifest.to_json())
    return "committed"


def check_request(request: Request) -> None:
    """Refuse a request whose files the manifest does not list (nothing to verify them by)."""
    listed = request.manifest.get("files", {})
    missing = [n for n in request.files if n not in listed]
    if missing:
        raise CheckpointError(f"{request.rel}: {rank_name(request.rank)} hands off files the manifest does not list: {missing}")
