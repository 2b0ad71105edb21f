"""The node spool shared by the ranks of a node and its agent (`ckpt agent`), and the
hand-off requests in it.

With an agent on the node, a rank writes its files to the spool, a local directory, and
hands them off with a request; the agent uploads them to the job's root, marks them durable
there, and the checkpoint commits when every rank's are (`ckpt.node.durable`).

The spool (`<spool>/`):

    agent.json                                   the agent's heartbeat, budget and usage
    agent.lock                                   flock'd by the agent for its life: one agent per spool
    preempt                                      touched by the agent: the ranks checkpoint and stop
    jobs/<job>/step-N/<files>                    the rank's files, as in the root
    jobs/<job>/step-N/.requests/rank-00003.json  a hand-off, written once the files are durable
    jobs/<job>/step-N/.status/rank-00003.json    the agent's progress: uploading, durable, committed, failed
    metrics/<job>.rank-00003.prom                each rank's metrics, for the agent to serve

`<job>` is a digest of the root's URL (sixteen hex digits). Everything is written whole (a
temporary file and a rename); nothing here needs torch.

Whoever can write `jobs/` (every trainer of the node) can put a link, a FIFO, a device or a
hard link where a file belongs, and the agent is another user, often a more privileged one.
So the agent follows no link below the spool or in a local root (every path is walked from
a directory it trusts, each part opened with O_NOFOLLOW), reads only regular files with a
single link (another's file hard-linked in has two), writes only temporary files it created
itself (O_EXCL) renamed into place, and prunes only directories named as a job's and a
step's, through descriptors. What it leaves alone it says once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CheckpointError, InvalidCheckpoint
from ckpt.format.manifest import Manifest
from ckpt.storage.layout import STEP_DIR
from ckpt.storage.nofollow import UnsafeEntry, open_dir, put_file
from ckpt.storage.store import Store, step_dir_name

log = logging.getLogger(__name__)

SPOOL_ENV = "CKPT_SPOOL"
AGENT_FILE = "agent.json"
LOCK_FILE = "agent.lock"
NOTICE_FILE = "preempt"
REQUESTS_DIR = ".requests"
STATUS_DIR = ".status"
WRITING_DIR = ".writing"  # a rank writing a save's files here, its request not written yet
# The agent rewrites its heartbeat every second; one older than this is a dead agent.
AGENT_STALE_S = 10.0
# The storage options a request may carry to the agent: where the store is, never who one is
# (the agent uploads with its own credentials). Anything else stays in the trainer.
_PUBLIC_OPTIONS = {"endpoint_url", "region_name", "anon", "use_ssl", "requester_pays"}
_PUBLIC_CLIENT_KWARGS = {"endpoint_url", "region_name"}
# A file a request may name: a plain name in its step directory (DCP's data files, .metadata,
# the indexes: each rank's and rank 0's `.index`).
_FILE_NAME = re.compile(r"^(\.metadata|\.index|[\w][\w.\-]*)$")
_SAVE_ID = re.compile(r"^[\w\-]{1,64}$")  # a file name in the root (its markers)
_JOB = re.compile(r"^[0-9a-f]{16}$")  # `job_key`
_REQUEST = re.compile(r"\Arank-[0-9]{5}\.json\Z")

UPLOADING, DURABLE, COMMITTED, FAILED = "uploading", "durable", "committed", "failed"


def job_key(store: Store) -> str:
    """The spool's name for a job: a digest of its root (the same on every node)."""
    return hashlib.sha256(store.where.encode()).hexdigest()[:16]


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def public_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The storage options that may be written down: where the store is, no credentials."""
    out = {k: v for k, v in (options or {}).items() if k in _PUBLIC_OPTIONS and isinstance(v, (str, bool, int))}
    client = (options or {}).get("client_kwargs")
    if isinstance(client, dict):
        kept = {k: v for k, v in client.items() if k in _PUBLIC_CLIENT_KWARGS and isinstance(v, str)}
        if kept:
            out["client_kwargs"] = kept
    return out


def write_json(path: str, doc: Any, under: str = "") -> None:
    """Write a small JSON file whole: readers see the old one or the new one. No link on
    the way from `under` (the spool; default: the file's directory) is followed."""
    base = under or os.path.dirname(path)
    put_file(base, os.path.relpath(path, base), json.dumps(doc).encode())


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


def request_of(status_path: str) -> str:
    """The request file a status file is about."""
    step_dir = os.path.dirname(os.path.dirname(status_path))
    return os.path.join(step_dir, REQUESTS_DIR, os.path.basename(status_path))


def read_json(path: str) -> Any:
    """A JSON file, or None when it is missing or unreadable (a torn write never is: see
    `write_json`; an unreadable one is treated as absent and rewritten), or is not a regular
    file: a link is not followed, a FIFO not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        try:
            return json.load(f) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        except (OSError, ValueError):
            return None


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "root": (str,), "storage_options": (dict,), "rel": (str,), "step": (int,), "save_id": (str,), "rank": (int,),
    "world": (int,), "files": (list,), "manifest": (dict,), "started": (int, float),
}  # fmt: skip


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
    # The checkpoint's manifest, to write when every rank is durable; with a `draft`, it lists
    # this rank's files alone (to check and mark them by), and the draft is the manifest.
    manifest: dict[str, Any]
    started: float  # unix time the save started (the commit's persist time counts from it)
    submitted: float = field(default_factory=time.time)
    # Rank 0's draft of the manifest in the root (`ckpt.node.durable.write_draft`): its
    # "checksum" (sha256 of its bytes), "size", and "digest" (`files_digest` of its files).
    # Empty: `manifest` is the whole draft (an earlier ckpt's request).
    draft: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_doc(cls, doc: Any) -> Request:
        """The request a JSON document holds; ValueError for anything else: one malformed
        file in the spool (another version's, another writer's) must not stop the agent."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(doc, dict) or not names >= set(doc) or not set(_FIELD_TYPES) <= set(doc):
            raise ValueError("not a hand-off request")
        kinds_of = {**_FIELD_TYPES, "submitted": (int, float), "draft": (dict,)}  # optional
        wrong = [k for k, v in doc.items() if not isinstance(v, kinds_of[k]) or (isinstance(v, bool) and bool not in kinds_of[k])]
        if wrong or not all(isinstance(n, str) for n in doc["files"]):
            raise ValueError(f"not a hand-off request: {', '.join(wrong) or 'files'} of the wrong type")
        return cls(**doc)

    def manifest_obj(self) -> Manifest:
        return Manifest.from_json(json.dumps(self.manifest).encode(), f"request {self.rel}/{rank_name(self.rank)}")

    def state(self, status: Any) -> str | None:
        """This request's state by the agent's status file (None: not looked at yet, or the
        status is of an earlier save of the same step)."""
        if isinstance(status, dict) and status.get("save_id") == self.save_id:
            return status.get("state")
        return None


class Spool:
    """The paths of a node spool."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self._said: set[str] = set()  # entries left alone, and said so

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

    def writing_path(self, job: str, rel: str, rank: int) -> str:
        return os.path.join(self.job_dir(job), rel, WRITING_DIR, rank_name(rank))

    def status_path(self, job: str, rel: str, rank: int) -> str:
        return os.path.join(self.job_dir(job), rel, STATUS_DIR, f"{rank_name(rank)}.json")

    def metrics_path(self, job: str, rank: int) -> str:
        return os.path.join(self.path, "metrics", f"{job}.{rank_name(rank)}.prom")

    def lock(self) -> int:
        """Take the spool for this process: an exclusive `flock` on `agent.lock`, held while
        the descriptor returned is open. SpoolTaken if another agent holds it."""
        os.makedirs(self.path, exist_ok=True)
        # 0600: a trainer that could open it could hold the lock and keep every agent out
        fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            doc = read_json(self.agent_file)
            pid = doc.get("pid", "unknown") if isinstance(doc, dict) else "unknown"
            raise SpoolTaken(
                f"another ckpt agent (pid {pid}) serves the spool {self.path}: one agent per spool "
                "(two would upload, prune and rewrite each other's files); stop that one first"
            ) from None
        return fd

    def steps(self, job: str | None = None) -> dict[str, list[str]]:
        """The step directories of each job (or of one): entries named as a job's and a
        step's that are directories themselves, not links. Anything else is left alone."""
        jobs = [job] if job else self._entries("jobs", _JOB, "a job's directory")
        return {j: self._entries(f"jobs/{j}", STEP_DIR, "a step directory") for j in jobs}

    def request_files(self, job: str, rel: str) -> list[str]:
        """The request files of one step directory: regular files named as a rank's."""
        where = f"jobs/{job}/{rel}/{REQUESTS_DIR}"
        return [os.path.join(self.path, where, n) for n in self._entries(where, _REQUEST, "a rank's request", directories=False)]

    def requests(self, job: str | None = None) -> list[str]:
        """The request files in the spool (of one job), in the order of their step."""
        found = [p for j, rels in self.steps(job).items() for rel in rels for p in self.request_files(j, rel)]
        return sorted(found, key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))), p))

    def usage(self, rel: str) -> tuple[int, float]:
        """Bytes of the regular files under the spool's directory `rel` and the newest
        modification time there (now, if none) of a file the trainer wrote: not of the agent's
        own records (`STATUS_DIR`), written as late as an upload ends, which would make an
        older save look newer than the next one; no link followed."""
        size, newest = 0, 0.0
        for base, _, names in os.walk(os.path.join(self.path, rel)):
            ours = os.path.basename(base) == STATUS_DIR
            for n in names:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(base, n))
                    size += st.st_size if stat.S_ISREG(st.st_mode) else 0
                    newest = newest if ours else max(newest, st.st_mtime)
        return size, newest or time.time()

    def writing(self, rel: str, within_s: float) -> bool:
        """Is a rank writing a save's files into the step directory `rel` (`Handoff.writing`):
        a marker made less than `within_s` seconds ago?"""
        markers = os.path.join(self.path, rel, WRITING_DIR)
        for name in listdir(markers):
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(os.path.join(markers, name)).st_mtime < within_s:
                    return True
        return False

    def _entries(self, rel: str, pattern: re.Pattern[str], what: str, directories: bool = True) -> list[str]:
        """The names in the spool's directory `rel` that match `pattern` and are directories
        (or regular files), as the entries themselves are: reached and listed through no
        link. Hidden names (temporary files) are passed over; others are said once."""
        try:
            fd = open_dir(self.path, rel)
        except UnsafeEntry as e:
            self._say(rel, str(e))
            return []
        except OSError:
            return []
        try:
            with os.scandir(fd) as it:
                found = list(it)
        finally:
            os.close(fd)
        names = []
        for e in found:
            with contextlib.suppress(OSError):  # gone since it was listed
                kind = e.is_dir(follow_symlinks=False) if directories else e.is_file(follow_symlinks=False)
                if kind and pattern.match(e.name):
                    names.append(e.name)
                elif not e.name.startswith("."):
                    link = e.is_symlink()
                    self._say(f"{rel}/{e.name}", "a symbolic link" if link else f"not named as {what}" if kind else f"not a {'directory' if directories else 'regular file'}")
        return sorted(names)

    def _say(self, rel: str, why: str) -> None:
        if len(self._said) > 10_000:  # a spool flooded with odd names: say them again, in time
            self._said.clear()
        if rel not in self._said:
            self._said.add(rel)
            log.warning("spool: left alone %s: %s (the agent follows no link and touches only what is named as its own)", os.path.join(self.path, rel), why)

    def agent(self) -> dict[str, Any] | None:
        """The agent's last heartbeat, if it is recent: None when no agent serves this spool."""
        doc = read_json(self.agent_file)
        if not isinstance(doc, dict) or doc.get("stopped"):
            return None
        beat = doc.get("heartbeat", 0)
        # A heartbeat that is not a number is no agent's: never an error here (every rank of
        # a job asks this before its first collective, and one that raised would leave alone).
        if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not time.time() - beat <= AGENT_STALE_S:
            return None
        return doc

    def room(self, need: int) -> str | None:
        """Why `need` more bytes do not fit (the agent's budget, the disk), or None. Committed
        copies the agent keeps count as free for the budget (it evicts them for new saves,
        keeping room on the disk for the largest save it has seen)."""
        doc = self.agent() or {}
        budget, used, evictable = (int(doc.get(k, 0) or 0) for k in ("budget", "used", "evictable"))
        if budget and used - evictable + need > budget:
            return f"the spool's budget of {budget / 1e9:.2f} GB holds {(used - evictable) / 1e9:.2f} GB not yet uploaded"
        with contextlib.suppress(OSError):
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
            if need > free:
                return f"the spool's disk has {free / 1e9:.2f} GB free"
        return None


def check_request(request: Request) -> Manifest:
    """The request's manifest, or InvalidCheckpoint for a request the agent must not act on:
    a step directory or file name that is not one (a path out of the spool), files the
    manifest does not list (nothing to verify them by), a manifest that does not parse."""
    where = f"request {request.rel}/{rank_name(request.rank)}"
    if not STEP_DIR.match(request.rel) or step_dir_name(request.step) != request.rel:
        raise InvalidCheckpoint(f"{where}: not a step directory")
    bad = [n for n in request.files if not isinstance(n, str) or not _FILE_NAME.match(n)]
    if bad or not request.files:
        raise InvalidCheckpoint(f"{where}: not plain file names: {bad}")
    if not _SAVE_ID.match(request.save_id):
        raise InvalidCheckpoint(f"{where}: {request.save_id[:80]!r} is not a save id")
    manifest = request.manifest_obj()
    missing = [n for n in request.files if n not in manifest.files]
    if missing or manifest.step != request.step or not 0 <= request.rank < request.world == manifest.world_size:
        raise InvalidCheckpoint(f"{where}: the manifest does not list its files {missing}, or is of another step or world")
    return manifest


class SpoolTaken(CheckpointError):
    """Another agent holds the spool."""
