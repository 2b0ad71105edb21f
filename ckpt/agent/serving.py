"""What the node agent shows the outside: its Prometheus series (uploads, commits, the
spool, preemptions) with the ranks' of its node (`ckpt.metrics.RankFiles`) in one
registry, served over HTTP at `/metrics`, with `/healthz` for a liveness probe.
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ckpt._version import __version__
from ckpt.metrics import RankFiles

log = logging.getLogger(__name__)


class AgentMetrics:
    """The agent's series, and the ranks' metrics files under `rank_files` (older than
    `stale_s`: no trainer behind them, not served)."""

    def __init__(self, rank_files: str, stale_s: float) -> None:
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
        r.register(RankFiles(rank_files, stale_s))


def serve(registry: CollectorRegistry, addr: str, port: int, healthy: Callable[[], bool]) -> http.server.ThreadingHTTPServer:
    """Serve `/metrics` (the registry) and `/healthz` (200 while `healthy()`, else 503) on a
    thread of its own; the server returned is stopped with `shutdown` and `server_close`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0] == "/metrics":
                body, code, kind = generate_latest(registry), 200, "text/plain; version=0.0.4; charset=utf-8"
            elif self.path.split("?")[0] == "/healthz":
                ok = healthy()
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

    server = http.server.ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ckpt-agent-http", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
