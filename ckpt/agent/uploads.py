"""The node agent's work on the hand-offs of its spool: each rank's files uploaded to the
job's root (files in parallel, retried with backoff), every byte checked against the
manifest on the way, the rank marked durable there, and the checkpoint committed when every
rank is (`ckpt.node.durable.commit_if_complete`); each request's progress recorded in its
status file, which the rank waits on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Any

from ckpt._faults import fault_point
from ckpt.agent.config import Config
from ckpt.agent.intake import Requests, Roots, handed_off_bytes
from ckpt.agent.serving import AgentMetrics
from ckpt.errors import CheckpointError, InvalidCheckpoint
from ckpt.format.checksum import Hasher
from ckpt.format.manifest import FileEntry, Manifest
from ckpt.metrics import failure_kind
from ckpt.node.durable import (
    DURABLE_DIR,
    commit_if_complete,
    committed_as_requested,
    mark_durable,
    marker_name,
    open_new,
    superseded,
)
from ckpt.node.spool import (
    COMMITTED,
    DURABLE,
    FAILED,
    UPLOADING,
    Request,
    Spool,
    check_request,
    read_json,
    status_of,
    write_json,
)
from ckpt.redact import redact
from ckpt.storage.nofollow import UnsafeEntry, open_regular
from ckpt.storage.store import Store

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes read from the spool per write to the store
# When a durable party looks again at a commit it waits for: seconds after its last look (the
# first, after it was durable), the last one repeated. A rank leaving its job waits for its
# node to see the commit: at most the last of these after it landed.
LOOKS_S = (2.0, 4.0, 8.0)


class Abandoned(BaseException):
    """The agent is stopping: an upload gives up (aborted, no object) and stays pending. Not
    an Exception, so that nothing on the way up takes it for a failed upload to retry."""


class SpoolCopyBad(CheckpointError):
    """The spool's copy of a file does not match the manifest: never uploaded, never committed."""


class Superseded(CheckpointError):
    """A later save of the same step owns the step directory: this hand-off uploads nothing."""


class _Limiter:
    """A token bucket shared by the uploads: at most `rate` bytes per second (0: no limit)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    @property
    def chunk(self) -> int:
        """Bytes to move at a time: a tenth of a second's worth when limited."""
        return min(CHUNK, max(4096, self.rate // 10)) if self.rate else CHUNK

    def take(self, n: int) -> None:
        """Wait until `n` more bytes fit in the rate."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            until = self._next
        if until > now:
            time.sleep(until - now)


class Uploads:
    """The hand-offs of one spool: `schedule` starts the uploads of new requests (on a pool of
    `upload_concurrency` threads), `check_commits` commits the saves whose ranks are durable;
    `close` abandons what is in flight (aborted, left pending for the next agent)."""

    def __init__(self, config: Config, spool: Spool, metrics: AgentMetrics, requests: Requests, roots: Roots) -> None:
        self.config, self.spool, self.metrics = config, spool, metrics
        self.requests, self.roots = requests, roots
        self._limiter = _Limiter(config.bandwidth_limit)
        self._pool = concurrent.futures.ThreadPoolExecutor(config.upload_concurrency, thread_name_prefix="ckpt-upload")
        self._running: dict[str, concurrent.futures.Future[None]] = {}  # request path -> its upload
        self._waiting: dict[tuple[str, str], tuple[str, Request, float]] = {}  # (path, save id) -> durable since
        self._looks: dict[tuple[str, str, str], tuple[int, float]] = {}  # a save -> its looks so far, the next one's time
        self._durable_here: dict[tuple[str, str, str], set[str]] = {}  # a save -> its requests here this agent made durable
        self._lock = threading.Lock()
        self._abandon = threading.Event()

    @property
    def in_flight(self) -> int:
        """Uploads started and not finished."""
        return len(self._running)

    def close(self) -> None:
        """Abandon the uploads in flight and wait for their threads."""
        self._abandon.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def schedule(self) -> int:
        """Start the uploads of new requests; return how many are not durable yet."""
        depth, waiting_bytes = 0, 0
        with self._lock:
            for path, fut in list(self._running.items()):
                if fut.done():
                    del self._running[path]
        paths = self.spool.requests()
        self.requests.keep_only(paths)
        for path in paths:
            request = self.requests.get(path)
            state = request.state(read_json(status_of(path))) if request is not None else None
            if request is None or state in (COMMITTED, FAILED):
                continue
            if state == DURABLE:
                self._waiting.setdefault((path, request.save_id), (path, request, time.time()))
                continue
            depth += 1
            waiting_bytes += sum(handed_off_bytes(path, n) for n in request.files)
            if path not in self._running and not self._abandon.is_set():
                with self._lock:
                    self._running[path] = self._pool.submit(self.upload, path, request)
        self.metrics.queue_depth.set(depth)
        self.metrics.queue_bytes.set(waiting_bytes)
        return depth

    def upload(self, path: str, request: Request) -> None:
        """Upload one rank's files, mark them durable, commit if last. A failure of the store
        is retried with backoff (until `retries` tries, or `commit_wait` seconds); a request
        that can never be right (invalid, a bad spool copy, superseded) fails at once."""
        began = time.monotonic()
        where = {"job": os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(path)))), "step": request.step, "rank": request.rank}
        attempt = 0
        while True:
            attempt += 1
            try:
                if not self._set(path, request, UPLOADING):
                    return
                manifest = check_request(request)
                store = self.roots.store(request)
                why = superseded(store, request) or (committed_as_requested(store, request) is False and "its step was committed by another save")
                if why:
                    raise Superseded(why)
                done = self._send(path, request, manifest, store)
                self.metrics.uploaded.inc(done)
                why = superseded(store, request)  # claimed while this uploaded: no marker for it
                if why:
                    raise Superseded(why)
                mark_durable(store, request.rel, request.save_id, request.rank, {n: request.manifest["files"][n]["checksum"] for n in request.files})
                fault_point("agent_durable", request.rank, request.step)
                self.metrics.uploads.labels("durable").inc()
                self.metrics.upload_time.observe(max(0.0, time.time() - request.submitted))  # queued and earlier agents' tries too
                log.info("step %d rank %d durable in %s (%.1f MB in %.2f s)", request.step, request.rank, store.display, done / 1e6, time.monotonic() - began, extra=where)
                # IMPORTANT: the commit is tried before the status says durable, so that when
                # every rank of the node reads durable, the last marker's commit was tried. The
                # node's last rank of the save lists the markers: one listing per node and
                # save (ten LIST pages at 10,000 ranks), not one per rank.
                last_here = self._node_durable(path, request)
                self._settle(path, request, commit_if_complete(store, request, markers=last_here), durable_since=time.time())
                return
            except Abandoned:
                log.warning("upload of step %d rank %d abandoned (the agent is stopping); left for the next agent", request.step, request.rank, extra=where)
                return
            except (SpoolCopyBad, Superseded, InvalidCheckpoint) as e:
                self._fail(path, request, str(e), e, where)
                return
            except Exception as e:
                late = time.time() - request.submitted > self.config.commit_wait
                if (self.config.retries and attempt >= self.config.retries) or late:
                    self._fail(path, request, f"{type(e).__name__}: {e}", e, where)  # counts this attempt
                    return
                self.metrics.failures.labels(failure_kind(e)).inc()
                wait = min(2.0 ** (attempt - 1), 30.0)
                log.warning("upload of step %d rank %d failed (%s); try %d in %.0f s", request.step, request.rank, redact(str(e)), attempt + 1, wait, extra=where)
                if self._abandon.wait(wait):
                    return

    def _fail(self, path: str, request: Request, why: str, e: BaseException, where: dict[str, Any]) -> None:
        with self._lock:  # a save that failed here is never looked at again: not kept for it
            self._durable_here.pop((request.root, request.rel, request.save_id), None)
        self.metrics.uploads.labels("failed").inc()
        self.metrics.failures.labels(failure_kind(e)).inc()
        log.error("hand-off of step %d rank %d failed: %s", request.step, request.rank, redact(why), extra=where)
        self._set(path, request, FAILED, redact(why))

    def _send(self, path: str, request: Request, manifest: Manifest, store: Store) -> int:
        """Upload the request's files unless its marker says they are durable already (an
        agent that died after the marker). Every byte is checked against the manifest."""
        if store.exists(f"{request.rel}/{DURABLE_DIR}/{marker_name(request.save_id, request.rank)}"):
            return 0
        step_dir = os.path.relpath(os.path.dirname(os.path.dirname(path)), self.spool.path)
        return sum(self._send_file(os.path.join(step_dir, n), store, f"{request.rel}/{n}", manifest.files[n], request) for n in request.files)

    def _send_file(self, src: str, store: Store, rel: str, entry: FileEntry, request: Request) -> int:
        """Upload one file of the spool (`src`, relative to it); a link, a FIFO, a device, a
        file with other hard links is an UnsafeEntry, never read."""
        where = os.path.join(self.spool.path, src)
        hasher = Hasher.checking(entry, where)
        try:
            f = open_regular(self.spool.path, src)
        except FileNotFoundError:
            raise SpoolCopyBad(f"{where} is missing from the spool") from None
        with f, open_new(store, rel, entry.size) as out:
            while chunk := f.read(self._limiter.chunk):
                if self._abandon.is_set():
                    raise Abandoned()
                self._limiter.take(len(chunk))
                hasher.update(chunk)
                out.write(chunk)
                fault_point("agent_upload", request.rank, request.step)
            # IMPORTANT: raised inside the block, so the upload is aborted, never completed
            if hasher.size != entry.size or hasher.hexdigest() != entry.checksum:
                raise SpoolCopyBad(f"{where}: the spool's copy does not match the manifest ({hasher.size} bytes, expected {entry.size}); not uploaded")
        return hasher.size

    def _node_durable(self, path: str, request: Request) -> bool:
        """`request`'s rank is durable: are all of its save's ranks on this node now? Asked
        under the lock, so that of two finishing together the second sees the first."""
        step_dir = os.path.dirname(os.path.dirname(path))  # <spool>/jobs/<job>/<rel>/.requests/<rank>.json
        job, rel = os.path.basename(os.path.dirname(step_dir)), os.path.basename(step_dir)
        with self._lock:
            done = self._durable_here.setdefault((request.root, request.rel, request.save_id), set())
            done.add(path)
            for p in self.spool.request_files(job, rel):
                other = self.requests.get(p) if p not in done else None
                if other is not None and other.save_id == request.save_id and other.state(read_json(status_of(p))) not in (DURABLE, COMMITTED):
                    return False
        return True

    def _settle(self, path: str, request: Request, outcome: str | None, durable_since: float) -> None:
        """Record what a look at the commit found for one request."""
        key = (path, request.save_id)
        if outcome is not None or time.time() - durable_since > self.config.commit_wait:
            with self._lock:
                self._durable_here.pop((request.root, request.rel, request.save_id), None)
        if outcome == "superseded":
            self._waiting.pop(key, None)
            self._set(path, request, FAILED, "another save of the step committed or claimed it")
        elif outcome is not None:
            self._waiting.pop(key, None)
            if outcome == "committed":
                self.metrics.commits.inc()
                log.info("committed %s/%s", redact(request.root), request.rel, extra={"step": request.step})
            self._set(path, request, COMMITTED)
        elif time.time() - durable_since > self.config.commit_wait:
            self._waiting.pop(key, None)
            self._set(path, request, FAILED, f"the other ranks were not durable {self.config.commit_wait:.0f} s later")
        elif key not in self._waiting:
            self._waiting[key] = (path, request, durable_since)
            self._set(path, request, DURABLE)

    def check_commits(self) -> None:
        """The durable ranks wait for the others: commit when all are (a party that died
        before committing is covered), or give up `commit_wait` seconds after being durable.
        One look per save, however many of its ranks this node has, less and less often
        (`LOOKS_S`): the last party to be durable has committed already, unless it died there.
        At each look the node with rank 0 lists the markers; the others look for the manifest
        alone, and list too once `commit_takeover` seconds passed (rank 0's node died)."""
        saves: dict[tuple[str, str, str], list[tuple[str, Request, float]]] = {}
        for path, request, since in list(self._waiting.values()):
            saves.setdefault((request.root, request.rel, request.save_id), []).append((path, request, since))
        self._looks = {key: look for key, look in self._looks.items() if key in saves}
        now = time.time()
        for key, ranks in saves.items():
            request = ranks[0][1]
            since = min(s for _, _, s in ranks)
            looked, due = self._looks.get(key, (0, since + LOOKS_S[0]))
            if now < due:
                continue
            self._looks[key] = (looked + 1, now + LOOKS_S[min(looked + 1, len(LOOKS_S) - 1)])
            lead = any(r.rank == 0 for _, r, _ in ranks)
            try:
                outcome = commit_if_complete(self.roots.store(request), request, markers=lead or now - since > self.config.commit_takeover)
            except CheckpointError as e:
                log.warning("checking the commit of step %d: %s", request.step, e)
                continue
            for path, request, since in ranks:
                self._settle(path, request, outcome, since)

    def _set(self, path: str, request: Request, state: str, why: str = "") -> bool:
        """Record a request's state in its status file; False if that is a link (or on the
        way through one): the request is passed over from then on."""
        doc = {"state": state, "save_id": request.save_id, "step": request.step, "time": time.time(), "why": why}
        try:
            write_json(status_of(path), doc, under=self.spool.path)
        except UnsafeEntry as e:
            log.error("spool: passing over the hand-off %s: its status cannot be recorded: %s", path, e)
            self.requests.pass_over(path)  # until the request changes
            return False
        except OSError as e:  # the spool's disk is full: the next look at the request tries again
            log.error("cannot record that step %d rank %d is %s: %s", request.step, request.rank, state, e)
        return True
