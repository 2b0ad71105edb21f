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

This module is the agent's life: its loop, preemption, heartbeat and shutdown. Its parts:
`ckpt.agent.intake` (what it takes from a request), `uploads` (uploads and commits),
`retention` (the spool's), `serving` (metrics and `/healthz`), `config` (its settings).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import logging
import os
import signal
import sys
import threading
import time

from ckpt._version import __version__
from ckpt.agent.config import Config, JsonFormatter
from ckpt.agent.intake import Requests, Roots
from ckpt.agent.retention import SpoolRetention
from ckpt.agent.serving import AgentMetrics, serve
from ckpt.agent.uploads import Uploads
from ckpt.errors import CheckpointError
from ckpt.node.spool import Spool, write_json
from ckpt.preempt import mtime_of
from ckpt.redact import redact
from ckpt.storage.nofollow import open_dir
from ckpt.storage.store import Transfer

log = logging.getLogger("ckpt.agent.daemon")

LOOP_S = 0.2  # how often the spool is looked at for new requests
HOUSEKEEPING_S = 2.0  # how often commits are looked for, usage counted, the spool pruned
TRAINER_STALE_S = 15.0  # a rank's metrics file older than this: no live trainer behind it


class Agent:
    """One node's agent over its spool (`run` until stopped): its parts are the hand-offs'
    uploads and commits (`uploads`), the spool's retention (`retention`) and its metrics
    (`metrics`, served by `serve`)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.spool = Spool(config.spool)
        for name in ("jobs", "metrics"):  # the trainers write below them (the same group)
            os.close(open_dir(self.spool.path, name, create=True))
        self.metrics = AgentMetrics(os.path.join(self.spool.path, "metrics"), TRAINER_STALE_S * 4)
        requests = Requests()
        self.roots = Roots(config, Transfer(concurrency=config.part_concurrency, requests_per_s=config.requests_per_s))
        self.uploads = Uploads(config, self.spool, self.metrics, requests, self.roots)
        self.retention = SpoolRetention(config, self.spool, self.metrics, requests)
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-commits")
        self._checking: concurrent.futures.Future[None] | None = None
        self._stop_at: float | None = None  # SIGTERM: when the grace period ends
        self._done = threading.Event()
        self._started = time.time()
        self._beat = time.monotonic()  # the main loop's last pass
        self._notice_seen = mtime_of(config.preempt_file)
        self._server: http.server.ThreadingHTTPServer | None = None

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        if self._server is None:
            self.serve()
        self._heartbeat()
        threading.Thread(target=self._heartbeats, name="ckpt-agent-heartbeat", daemon=True).start()
        log.info("agent %s on spool %s (budget %.2f GB, %d uploads at a time)", __version__, self.spool.path, self.retention.budget / 1e9, self.config.upload_concurrency)
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
                    pending = self.uploads.schedule()
                    if now >= housekeeping:
                        housekeeping = now + HOUSEKEEPING_S
                        if self._checking is None or self._checking.done():  # store calls: off the loop
                            self._checking = self._checker.submit(self.uploads.check_commits)
                        self.retention.prune()
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
            self._done.set()
            self.uploads.close()
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
        self.metrics.preemptions.inc()
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
        if pending or self.uploads.in_flight:
            return False
        metrics = os.path.join(self.spool.path, "metrics")
        try:
            live = [n for n in os.listdir(metrics) if time.time() - os.lstat(os.path.join(metrics, n)).st_mtime < TRAINER_STALE_S]
        except OSError:
            live = []
        return not live

    def _heartbeats(self) -> None:
        """Its own thread: a main loop slowed by the store is not a dead agent to the ranks."""
        while not self._done.wait(1.0):
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
            "budget": self.retention.budget,
            **self.retention.usage,
            "queue": self.uploads.in_flight,
            "stopping": self._stop_at is not None,
        })

    # -- serving ----------------------------------------------------------------------------
    def serve(self) -> None:
        if self.config.metrics_port >= 0:
            self._server = serve(self.metrics.registry, self.config.metrics_addr, self.config.metrics_port, self._healthy)

    def _healthy(self) -> bool:
        return time.monotonic() - self._beat < 10 * HOUSEKEEPING_S

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


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
