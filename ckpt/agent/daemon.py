"""`ckpt agent`: the node daemon. Uploads what the ranks of its node hand off, commits.

The ranks of a node write their files to the node spool (a local directory) and hand them
off with a request (`ckpt.node.spool`). The agent uploads each rank's files to the job's root
(files in parallel, each in parallel parts, retried with backoff), checks every byte against
the manifest's checksum on the way, marks the rank durable in the root and commits the
checkpoint when every rank is (whoever finishes last). A trainer killed after its hand-off
costs nothing: the agent finishes. An agent killed mid-upload redoes it when it starts again
(an interrupted upload leaves no object; a request stays pending until its status is final).

It also keeps the newest checkpoints of each job in the spool for fast restarts on the node
(within `--keep-spool` and `--spool-budget`), serves Prometheus metrics (its own and the
ranks' of its node) and `/healthz`, relays preemption (its own SIGTERM or a notice file) to
the ranks, and on SIGTERM finishes the uploads in flight, or after `--shutdown-grace`
seconds abandons them safely (aborted; redone by the next agent), then exits.

Settings: flags, else `CKPT_AGENT_<FLAG>` environment variables, else a TOML config file
(`--config`; keys as the flags with underscores, and a `[storage_options]` table), else the
defaults below. Uploads use the agent's own credentials (the environment: AWS_*).
One agent per spool (a lock held for its life); whoever writes the spool's `jobs/` is trusted
with nothing (`ckpt.node.spool`), and `allowed_roots` bounds where it uploads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import fsspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ckpt._faults import fault_point
from ckpt._version import __version__
from ckpt.agent.config import Config, JsonFormatter, within
from ckpt.errors import CheckpointError, InvalidCheckpoint
from ckpt.format.checksum import Hasher
from ckpt.format.manifest import FileEntry, Manifest
from ckpt.metrics import RankFiles, failure_kind
from ckpt.node.spool import (
    COMMITTED,
    DURABLE,
    DURABLE_DIR,
    FAILED,
    UPLOADING,
    Request,
    Spool,
    check_request,
    commit_if_complete,
    committed_as_requested,
    mark_durable,
    marker_name,
    open_new,
    public_options,
    read_json,
    status_of,
    superseded,
    write_json,
)
from ckpt.preempt import mtime_of
from ckpt.redact import redact
from ckpt.storage.nofollow import UnsafeEntry, open_dir, open_regular, remove_tree
from ckpt.storage.store import Store, Transfer

log = logging.getLogger("ckpt.agent.daemon")


def _endpoint(options: dict) -> str | None:
    """The endpoint storage options name (s3fs takes it at the top or in client_kwargs)."""
    return options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")

CHUNK = 8 << 20  # bytes read from the spool per write to the store
LOOP_S = 0.2  # how often the spool is looked at for new requests
HOUSEKEEPING_S = 2.0  # how often commits are looked for, usage counted, the spool pruned
TRAINER_STALE_S = 15.0  # a rank's metrics file older than this: no live trainer behind it
ORPHAN_AFTER_S = 600.0  # a step directory without a request, untouched this long: a crashed write


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


class Agent:
    """One node's agent over its spool (`run` until stopped)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.spool = Spool(config.spool)
        for name in ("jobs", "metrics"):  # the trainers write below them (the same group)
            os.close(open_dir(self.spool.path, name, create=True))
        self.registry = r = CollectorRegistry()
        Gauge("ckpt_agent_info", "The agent's version", ["version"], registry=r).labels(__version__).set(1)
        self.queue_depth = Gauge("ckpt_agent_upload_queue_depth", "Hand-offs waiting or uploading", registry=r)
        self.queue_bytes = Gauge("ckpt_agent_upload_queue_bytes", "Bytes of hand-offs waiting or uploading", registry=r)
        self.uploaded = Counter("ckpt_agent_uploaded_bytes", "Bytes uploaded to the jobs' roots", registry=r)
        self.upload_time = Histogram(
            "ckpt_agent_upload_seconds", "Seconds from a hand-off to its files being durable",
            registry=r, buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
        )
        self.uploads = Counter("ckpt_agent_uploads", "Hand-offs by outcome: durable, failed", ["outcome"], registry=r)
        self.failures = Counter("ckpt_agent_upload_failures", "Failed upload attempts by the class of their cause", ["kind"], registry=r)
        self.commits = Counter("ckpt_agent_commits", "Checkpoints this agent committed (it saw the last rank durable)", registry=r)
        self.spool_bytes = Gauge("ckpt_agent_spool_bytes", "Bytes the spool holds", registry=r)
        self.budget = Gauge("ckpt_agent_spool_budget_bytes", "Bytes the spool may hold", registry=r)
        self.preemptions = Counter("ckpt_agent_preemptions", "Preemption notices relayed to the ranks", registry=r)
        r.register(RankFiles(os.path.join(self.spool.path, "metrics"), TRAINER_STALE_S * 4))
        self._budget = config.spool_budget or _disk_size(self.spool.path)
        self.budget.set(self._budget)
        self._limiter = _Limiter(config.bandwidth_limit)
        self._transfer = Transfer(concurrency=config.part_concurrency)
        self._pool = concurrent.futures.ThreadPoolExecutor(config.upload_concurrency, thread_name_prefix="ckpt-upload")
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-commits")
        self._checking: concurrent.futures.Future[None] | None = None
        self._running: dict[str, concurrent.futures.Future[None]] = {}  # request path -> its upload
        self._waiting: dict[tuple[str, str], tuple[str, Request, float]] = {}  # (path, save id) -> durable since
        self._requests: dict[str, tuple[float, Request | None]] = {}  # path -> (mtime, parsed)
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._stop_at: float | None = None  # SIGTERM: when the grace period ends
        self._abandon = threading.Event()
        self._started = time.time()
        self._beat = time.monotonic()  # the main loop's last pass
        self._usage = {"used": 0, "evictable": 0, "free": 0}
        self._largest = 0  # bytes of the largest step directory seen: room kept free for the next save
        self._notice_seen = mtime_of(config.preempt_file)
        self._server: http.server.ThreadingHTTPServer | None = None

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        if self._server is None:
            self.serve()
        self._heartbeat()
        threading.Thread(target=self._heartbeats, name="ckpt-agent-heartbeat", daemon=True).start()
        log.info("agent %s on spool %s (budget %.2f GB, %d uploads at a time)", __version__, self.spool.path, self._budget / 1e9, self.config.upload_concurrency)
        if not self.config.allowed_roots:
            log.warning("no allowed_roots: whoever can write the spool's jobs/ can have this agent write to any root its credentials reach")
        if os.geteuid() == 0:
            log.warning("running as root: give the agent a user of its own (agents/ckpt-agent.service)")
        housekeeping = 0.0
        try:
            while True:
                now = time.monotonic()
                try:
                    self._relay_notice()
                    pending = self._schedule()
                    if now >= housekeeping:
                        housekeeping = now + HOUSEKEEPING_S
                        if self._checking is None or self._checking.done():  # store calls: off the loop
                            self._checking = self._checker.submit(self._check_commits)
                        self._prune()
                    self._beat = now
                except Exception as e:  # a full disk, a permission: say so, stay up, try again
                    log.error("agent loop: %s: %s", type(e).__name__, redact(str(e)))
                    pending = 1  # not known: a stopping agent waits out its grace
                    time.sleep(HOUSEKEEPING_S)
                if self._stop_at is not None and self._drained(pending):
                    log.info("stopping: every hand-off is uploaded and no trainer is left on the node")
                    return 0
                if self._stop_at is not None and time.monotonic() >= self._stop_at:
                    log.warning("stopping after %.0f s of grace: %d hand-offs left in the spool for the next agent", self.config.shutdown_grace, pending)
                    return 0
                time.sleep(LOOP_S)
        finally:
            self._abandon.set()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._checker.shutdown(wait=True, cancel_futures=True)
            self.close()
            with contextlib.suppress(OSError):
                write_json(self.spool.agent_file, {"pid": os.getpid(), "version": __version__, "stopped": time.time()})

    def stop(self, why: str) -> None:
        """Finish the uploads in flight (within the grace period); tell the ranks to stop."""
        if self._stop_at is not None:
            self._stop_at = time.monotonic()  # asked twice: stop now
            return
        self._stop_at = time.monotonic() + self.config.shutdown_grace
        self.notify(why)

    def notify(self, why: str) -> None:
        """Ask the ranks of this node to checkpoint at their next step and stop."""
        log.warning("preemption (%s): asking the ranks of this node to checkpoint", why)
        self.preemptions.inc()
        try:
            write_json(self.spool.notice_file, {"time": time.time(), "why": why})
        except OSError as e:  # a full disk: the ranks' own SIGTERM is left
            log.error("cannot write the preemption notice %s: %s", self.spool.notice_file, e)

    def _relay_notice(self) -> None:
        mtime = mtime_of(self.config.preempt_file)
        if mtime is not None and mtime != self._notice_seen:
            self._notice_seen = mtime
            self.notify(f"notice file {self.config.preempt_file}")

    def _drained(self, pending: int) -> bool:
        if pending or self._running:
            return False
        metrics = os.path.join(self.spool.path, "metrics")
        try:
            live = [n for n in os.listdir(metrics) if time.time() - os.lstat(os.path.join(metrics, n)).st_mtime < TRAINER_STALE_S]
        except OSError:
            live = []
        return not live

    def _heartbeats(self) -> None:
        """Its own thread: a main loop slowed by the store is not a dead agent to the ranks."""
        while not self._abandon.wait(1.0):
            try:
                self._heartbeat()
            except OSError as e:
                log.error("cannot write the heartbeat %s: %s", self.spool.agent_file, e)

    def _heartbeat(self) -> None:
        write_json(self.spool.agent_file, {
            "pid": os.getpid(),
            "version": __version__,
            "started": self._started,
            "heartbeat": time.time(),
            "budget": self._budget,
            **self._usage,
            "queue": len(self._running),
            "stopping": self._stop_at is not None,
        })

    # -- requests ---------------------------------------------------------------------------
    def _request(self, path: str) -> Request | None:
        """A request file, parsed once per version of it."""
        try:
            mtime = os.lstat(path).st_mtime_ns
        except OSError:
            return None
        cached = self._requests.get(path)
        if cached is None or cached[0] != mtime:
            cached = self._requests[path] = (mtime, _load(path))
        return cached[1]

    def _schedule(self) -> int:
        """Start the uploads of new requests; return how many are not durable yet."""
        depth, waiting_bytes = 0, 0
        with self._lock:
            for path, fut in list(self._running.items()):
                if fut.done():
                    del self._running[path]
        paths = self.spool.requests()
        for gone in set(self._requests) - set(paths):
            del self._requests[gone]
        for path in paths:
            request = self._request(path)
            state = request.state(read_json(status_of(path))) if request is not None else None
            if request is None or state in (COMMITTED, FAILED):
                continue
            if state == DURABLE:
                self._waiting.setdefault((path, request.save_id), (path, request, time.time()))
                continue
            depth += 1
            waiting_bytes += sum(_size(path, n) for n in request.files)
            if path not in self._running and not self._abandon.is_set():
                with self._lock:
                    self._running[path] = self._pool.submit(self._upload, path, request)
        self.queue_depth.set(depth)
        self.queue_bytes.set(waiting_bytes)
        return depth

    def _upload(self, path: str, request: Request) -> None:
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
                store = self._store(request)
                why = superseded(store, request) or (committed_as_requested(store, request) is False and "its step was committed by another save")
                if why:
                    raise Superseded(why)
                done = self._send(path, request, manifest, store)
                self.uploaded.inc(done)
                why = superseded(store, request)  # claimed while this uploaded: no marker for it
                if why:
                    raise Superseded(why)
                mark_durable(store, request.rel, request.save_id, request.rank, {n: request.manifest["files"][n]["checksum"] for n in request.files})
                self.uploads.labels("durable").inc()
                self.upload_time.observe(max(0.0, time.time() - request.submitted))  # queued and earlier agents' tries too
                log.info("step %d rank %d durable in %s (%.1f MB in %.2f s)", request.step, request.rank, store.display, done / 1e6, time.monotonic() - began, extra=where)
                # IMPORTANT: the commit is tried before the status says durable, so that when
                # every rank of the node reads durable, the last marker's commit was tried.
                self._try_commit(path, request, store, durable_since=time.time())
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
                self.failures.labels(failure_kind(e)).inc()
                wait = min(2.0 ** (attempt - 1), 30.0)
                log.warning("upload of step %d rank %d failed (%s); try %d in %.0f s", request.step, request.rank, redact(str(e)), attempt + 1, wait, extra=where)
                if self._abandon.wait(wait):
                    return

    def _fail(self, path: str, request: Request, why: str, e: BaseException, where: dict[str, Any]) -> None:
        self.uploads.labels("failed").inc()
        self.failures.labels(failure_kind(e)).inc()
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

    def _try_commit(self, path: str, request: Request, store: Store, durable_since: float) -> None:
        self._settle(path, request, commit_if_complete(store, request), durable_since)

    def _settle(self, path: str, request: Request, outcome: str | None, durable_since: float) -> None:
        """Record what a look at the commit found for one request."""
        key = (path, request.save_id)
        if outcome == "superseded":
            self._waiting.pop(key, None)
            self._set(path, request, FAILED, "another save of the step committed or claimed it")
        elif outcome is not None:
            self._waiting.pop(key, None)
            if outcome == "committed":
                self.commits.inc()
                log.info("committed %s/%s", redact(request.root), request.rel, extra={"step": request.step})
            self._set(path, request, COMMITTED)
        elif time.time() - durable_since > self.config.commit_wait:
            self._waiting.pop(key, None)
            self._set(path, request, FAILED, f"the other ranks were not durable {self.config.commit_wait:.0f} s later")
        elif key not in self._waiting:
            self._waiting[key] = (path, request, durable_since)
            self._set(path, request, DURABLE)

    def _check_commits(self) -> None:
        """The durable ranks wait for the others: commit when all are (a party that died
        before committing is covered), or give up `commit_wait` seconds after being durable.
        One look per save, however many of its ranks this node has."""
        saves: dict[tuple[str, str, str], list[tuple[str, Request, float]]] = {}
        for path, request, since in list(self._waiting.values()):
            saves.setdefault((request.root, request.rel, request.save_id), []).append((path, request, since))
        for ranks in saves.values():
            request = ranks[0][1]
            try:
                outcome = commit_if_complete(self._store(request), request)
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
            if path in self._requests:
                self._requests[path] = (self._requests[path][0], None)  # until the request changes
            return False
        except OSError as e:  # the spool's disk is full: the next look at the request tries again
            log.error("cannot record that step %d rank %d is %s: %s", request.step, request.rank, state, e)
        return True

    def _store(self, request: Request) -> Store:
        root = request.root
        if fsspec.utils.get_protocol(root) == "file":
            # IMPORTANT: a local root as resolved now, checked and written the same: writes
            # walk it from / following no link (`spool.open_new`), so a link swapped in later
            # is refused rather than followed past allowed_roots.
            root = os.path.realpath(os.path.expanduser(root.split("://", 1)[-1]))
        if self.config.allowed_roots and not any(within(root, p) for p in self.config.allowed_roots):
            raise InvalidCheckpoint(f"{redact(request.root)} is not under the agent's allowed_roots")
        # IMPORTANT: a trainer says where the store is (endpoint, region), never more: the
        # agent's own credentials go only where its config says, and with allowed_roots, a
        # root is under them on the agent's own endpoint, not on one the request names.
        asked = public_options(request.storage_options)
        if self.config.allowed_roots and _endpoint(asked) not in (None, _endpoint(self.config.storage_options)):
            raise InvalidCheckpoint(f"{redact(request.root)}: the request names another endpoint ({redact(str(_endpoint(asked)))}) than the agent's")
        options = {**asked, **self.config.storage_options}
        key = json.dumps([root, options], sort_keys=True, default=str)
        with self._lock:
            if key not in self._stores:
                self._stores[key] = Store(root, options, self._transfer)
            return self._stores[key]

    # -- the spool's own retention ------------------------------------------------------------
    def _prune(self) -> None:
        """Keep the newest `keep_spool` committed checkpoints of each job, drop finished
        hand-offs that did not commit and orphaned step directories, and stay within the
        budget, with room for the next save (oldest committed first). Never a directory
        with a hand-off still pending, nor one not named as a job's and a step's."""
        kept: list[tuple[float, str, int]] = []
        used = 0
        for job, rels in self.spool.steps().items():
            done = []
            for rel in rels:
                d = f"jobs/{job}/{rel}"  # in the spool
                size, newest = self.spool.usage(d)
                used += size
                self._largest = max(self._largest, size)
                reqs = self.spool.request_files(job, rel)
                states = [r.state(read_json(status_of(p))) if (r := self._request(p)) else FAILED for p in reqs]
                # IMPORTANT: never while a rank writes a save's files here (its request comes once
                # they are durable, which may take as long as the slowest rank's write): a later
                # save of a step whose hand-off failed (a restarted job's) among them. A marker
                # older than commit_wait is a crashed writer's.
                writing = self.spool.writing(d, self.config.commit_wait)
                if not states:
                    if not writing and time.time() - newest > ORPHAN_AFTER_S:
                        self._remove(d, "no hand-off (a write that never finished)")
                        used -= size
                elif all(s == FAILED for s in states):
                    if not writing:
                        self._remove(d, "its hand-off failed")
                        used -= size
                elif all(s in (COMMITTED, FAILED) for s in states):
                    done.append((newest, d, size))
            done.sort()
            surplus = max(len(done) - self.config.keep_spool, 0)
            for _, d, size in done[:surplus]:
                self._remove(d, f"more than {self.config.keep_spool} committed checkpoints of the job")
                used -= size
            kept += done[surplus:]
        free = _disk_free(self.spool.path)
        for _, d, size in sorted(kept):
            if used <= self._budget - self._largest and free >= self._largest:
                break
            self._remove(d, "room for the next save (the spool's budget or its disk)")
            used, free = used - size, free + size
            kept = [k for k in kept if k[1] != d]
        self._usage = {"used": used, "evictable": sum(k[2] for k in kept), "free": free}
        self.spool_bytes.set(used)

    def _remove(self, d: str, why: str) -> None:
        """Remove the spool's step directory `d` (relative to the spool), through no link."""
        log.info("spool: removing %s: %s", d, why)
        try:
            remove_tree(self.spool.path, d)
        except (OSError, UnsafeEntry) as e:
            log.warning("spool: cannot remove %s: %s", d, e)

    # -- serving ----------------------------------------------------------------------------
    def serve(self) -> None:
        if self.config.metrics_port < 0:
            return
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?")[0] == "/metrics":
                    body, code, kind = generate_latest(agent.registry), 200, "text/plain; version=0.0.4; charset=utf-8"
                elif self.path.split("?")[0] == "/healthz":
                    ok = time.monotonic() - agent._beat < 10 * HOUSEKEEPING_S
                    body, code, kind = (b"ok\n" if ok else b"stalled\n"), (200 if ok else 503), "text/plain"
                else:
                    body, code, kind = b"not found\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((self.config.metrics_addr, self.config.metrics_port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="ckpt-agent-http", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, self._server.server_port)

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _load(path: str) -> Request | None:
    try:
        return Request.from_doc(read_json(path))
    except (ValueError, TypeError):
        return None


def _size(request_path: str, name: str) -> int:
    try:
        return os.lstat(os.path.join(os.path.dirname(os.path.dirname(request_path)), name)).st_size
    except OSError:
        return 0


def _disk_size(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def _disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def main(argv: list[str] | None = None) -> int:
    try:
        config = Config.load(argv)
    except ValueError as e:
        print(f"ckpt agent: {e}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if config.log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    try:
        # IMPORTANT: one agent per spool: the lock is held (its descriptor left open) until
        # this process exits
        Spool(config.spool).lock()
        agent = Agent(config)
    except (OSError, CheckpointError) as e:
        log.error("cannot start on spool %s: %s", config.spool, e)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: agent.stop("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: agent.stop("SIGINT"))
    try:
        agent.serve()
    except OSError as e:  # the port taken, an address not of this machine
        log.error("cannot serve metrics on %s:%d: %s", config.metrics_addr, config.metrics_port, e)
        return 2
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
