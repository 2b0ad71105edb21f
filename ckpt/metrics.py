"""What a rank's checkpointing is doing, as Prometheus metrics.

Every `Checkpointer` keeps its metrics in its own registry (`cp.metrics.registry`: register
it with your exporter, or have ckpt serve it). With `metrics_port=` (or `CKPT_METRICS_PORT`)
the rank serves `/metrics` over HTTP on that port plus its local rank, on loopback unless
`CKPT_METRICS_ADDR` says otherwise. Names follow Prometheus conventions; the rank is a label
of `ckpt_rank_info` only, since each rank is its own scrape target. With a node agent, each
rank also writes its series to the spool every few seconds (`publish`), and the agent serves
them with `job` and `rank` labels (`RankFiles`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ckpt.errors import CheckpointError, SaveFailed, dcp_failures
from ckpt.format.manifest import Manifest
from ckpt.storage.nofollow import open_regular

log = logging.getLogger(__name__)

_RANK_FILE_MAX = 1 << 20  # a rank's metrics page is a few KB
_BLOCKING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LONG_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

# The interval policy's record (`Cadence.estimate`, rank 0's) and the gauge each value goes to.
_SCHEDULE = {
    "seconds": ("ckpt_coordinator_interval_seconds", "Seconds between saves under the interval policy (for Every(steps=N): N steps at the measured step time)"),
    "steps": ("ckpt_coordinator_interval_steps", "The interval in steps (for a time interval: at rank 0's measured step time)"),
    "step_s": ("ckpt_coordinator_step_seconds", "Rank 0's measured seconds per step"),
    "blocking_s": ("ckpt_coordinator_blocking_estimate_seconds", "C_b: the blocking time the interval was chosen from"),
    "persist_s": ("ckpt_coordinator_persist_estimate_seconds", "L: the persist time the interval was chosen from"),
    "slowdown_s": ("ckpt_coordinator_slowdown_estimate_seconds", "What a save costs the steps that run while it writes (rank 0's step times, median over recent saves)"),
    "cost_s": ("ckpt_coordinator_cost_estimate_seconds", "C: what a save costs training, blocking plus slowdown, the interval was priced at"),
    "goodput": ("ckpt_coordinator_expected_goodput_ratio", "The share of time left to training at the chosen interval, the save's cost and the MTBF"),
    "mtbf_s": ("ckpt_coordinator_mtbf_seconds", "The job's MTBF estimate the interval was chosen from"),
}


def failure_kind(exc: BaseException) -> str:
    """A bounded label for why a save failed: the class of its first cause."""
    while isinstance(exc, SaveFailed) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(getattr(exc, "failures", None), dict):  # DCP's CheckpointException (torch not imported: the agent)
        causes = dcp_failures(exc)
        exc = causes[0] if causes else exc
    return type(exc).__name__


class _Known:
    """Gauges with a sample only once their value is known (`values()` maps each key of
    `gauges` to a number, or leaves it out). A 0 for "not known yet" would read as a value: an
    interval of 0 s, which CkptCheckpointStale compares an age with."""

    def __init__(self, gauges: dict[str, tuple[str, str]], values: Callable[[], dict[str, Any]]) -> None:
        self.gauges, self.values = gauges, values

    def collect(self) -> Iterator[Metric]:
        values = self.values()
        for key, (name, text) in self.gauges.items():
            family = GaugeMetricFamily(name, text)
            value = values.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                family.add_metric([], value)
            yield family


class Metrics:
    """The series of one rank. Methods are called by the Checkpointer as things happen."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._info = Gauge("ckpt_rank_info", "This process's rank and the job's world size", ["rank", "world_size"], registry=r)
        self.saves = Counter("ckpt_saves", "Saves by outcome: committed, failed, skipped (due while the last was writing)", ["outcome"], registry=r)
        for outcome in ("committed", "failed", "skipped"):  # at 0, or increase() misses a first failure
            self.saves.labels(outcome)
        self.failures = Counter("ckpt_save_failures", "Failed saves by the class of their first cause", ["kind"], registry=r)
        self.blocking = Histogram("ckpt_blocking_seconds", "Seconds a save blocked the training loop (capture and staging)", registry=r, buckets=_BLOCKING_BUCKETS)
        self.persist = Histogram("ckpt_persist_seconds", "Seconds from the start of a save to its commit", registry=r, buckets=_LONG_BUCKETS)
        self.written = Counter("ckpt_written_bytes", "Bytes of checkpoint files this rank wrote", registry=r)
        self.read = Counter("ckpt_read_bytes", "Bytes of checkpoint files this rank read to restore", registry=r)
        self.received = Counter("ckpt_received_bytes", "Bytes of checkpoint pieces this rank loaded as other ranks of its replica group read and sent them", registry=r)
        self.last_step = Gauge("ckpt_last_committed_step", "The step of the last checkpoint this job committed", registry=r)
        self.last_time = Gauge("ckpt_last_commit_timestamp_seconds", "Unix time of the last commit", registry=r)
        self._at_risk_from: float | None = None  # this run's first step, then its last commit
        age = "Seconds of training since the last commit, or since this run's first step if later (0 before it)"
        Gauge("ckpt_checkpoint_age_seconds", age, registry=r).set_function(self._age)
        self.in_flight = Gauge("ckpt_saves_in_flight", "1 while a save is writing in the background", registry=r)
        self.restores = Counter("ckpt_restores", "Restores by where the files came from (store, spool)", ["source"], registry=r)
        self.restore_time = Histogram("ckpt_restore_seconds", "Seconds a restore took, discovery to the loaded state", registry=r, buckets=_LONG_BUCKETS)
        self.meetings = Counter("ckpt_rank_meetings", "Times the ranks met at a step boundary to agree (agree_every_s)", registry=r)
        self._schedule: Callable[[], dict[str, Any]] = dict
        r.register(_Known(_SCHEDULE, lambda: self._schedule()))
        self._server: Any = None
        self._publishing: threading.Event | None = None
        self._publisher: threading.Thread | None = None
        #: (address, port) being served, once `serve` ran.
        self.address: tuple[str, int] | None = None

    def _age(self) -> float:
        # The training a failure would lose. A restored checkpoint is as old as the job's
        # downtime and the start-up before the first step (a restore, a compile) is no
        # training: counted, either would read as a job whose saves stall (CkptCheckpointStale).
        return time.time() - self._at_risk_from if self._at_risk_from is not None else 0.0

    # -- events ---------------------------------------------------------------------------------
    def identify(self, rank: int, world: int) -> None:
        self._info.clear()
        self._info.labels(str(rank), str(world)).set(1)

    def stepped(self) -> None:
        """A step is done: the run's first starts the training that a commit protects."""
        if self._at_risk_from is None:
            self._at_risk_from = time.time()

    def staged(self, blocking_s: float) -> None:
        self.blocking.observe(blocking_s)
        self.in_flight.set(1)

    def committed(self, manifest: Manifest, rank: int) -> None:
        self.handed_off(manifest, rank)
        self.agent_committed(manifest, manifest.costs.persist_s)

    def handed_off(self, manifest: Manifest, rank: int) -> None:
        """This rank's files of the save are written (to the root, or to the node spool)."""
        self.written.inc(sum(f.size for f in manifest.files.values() if f.rank == rank or (f.rank < 0 and rank == 0)))
        self.in_flight.set(0)

    def agent_committed(self, manifest: Manifest, persist_s: float) -> None:
        """The save is committed (with a node agent: learnt from it, `persist_s` measured then)."""
        self.saves.labels("committed").inc()
        self.persist.observe(persist_s)
        self.commit_seen(manifest)
        self._at_risk_from = max(self._at_risk_from or 0.0, manifest.created)

    def commit_seen(self, manifest: Manifest) -> None:
        """The last commit of the job, whoever made it (a restore finds one too)."""
        self.last_step.set(manifest.step)
        self.last_time.set(manifest.created)

    def failed(self, exc: BaseException) -> None:
        self.saves.labels("failed").inc()
        self.failures.labels(failure_kind(exc)).inc()
        self.in_flight.set(0)

    def skipped(self) -> None:
        self.saves.labels("skipped").inc()

    def restored(self, seconds: float, bytes_read: int, manifest: Manifest, source: str = "store", received: int = 0) -> None:
        self.restores.labels(source).inc()
        self.restore_time.observe(seconds)
        self.read.inc(bytes_read)
        self.received.inc(received)
        self.commit_seen(manifest)

    def schedule_from(self, record: Callable[[], dict[str, Any]]) -> None:
        """Export the interval policy's record (`Cadence.estimate`), read at each scrape: the
        interval under `Every(steps=)` follows the measured step time. Rank 0 only (the others
        never learn what its coordinator decides): their ckpt_coordinator_* have no sample."""
        self._schedule = record

    # -- serving --------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on `addr:port` (0: any free port); returns the port."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.address = (addr, self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", *self.address)
        return self._server.server_port

    def publish(self, path: str, every_s: float = 5.0, before: Callable[[], None] | None = None) -> None:
        """Write the series to `path` now and every `every_s` seconds (calling `before` first)
        until `close`, which removes it: for the node agent to serve (a textfile collector)."""
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:  # metrics must never stop training
            log.warning("this rank's metrics are not published to %s: %s", path, e)
            return
        stop = self._publishing = threading.Event()

        def loop() -> None:
            while True:
                try:
                    if before is not None:
                        before()
                    tmp = f"{path}.{os.getpid()}.tmp"
                    with open(tmp, "wb") as f:
                        f.write(generate_latest(self.registry))
                    os.replace(tmp, path)
                except Exception as e:  # metrics must never stop training
                    log.debug("publishing metrics to %s: %s", path, e)
                if stop.wait(every_s):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                    return

        self._publisher = threading.Thread(target=loop, name="ckpt-metrics", daemon=True)
        self._publisher.start()

    def close(self) -> None:
        if self._publishing is not None:
            self._publishing.set()
            self._publisher.join(timeout=10)
            self._publishing = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def port_from_env(port: int | None) -> int | None:
    """The port this rank serves on: `port` (or CKPT_METRICS_PORT) plus its local rank."""
    if port is None:
        raw = os.environ.get("CKPT_METRICS_PORT", "")
        if not raw:
            return None
        try:
            port = int(raw)
        except ValueError:
            raise ValueError(f"CKPT_METRICS_PORT must be a port number, not {raw!r}") from None
    if port == 0:
        return 0
    return port + int(os.environ.get("LOCAL_RANK", "0") or 0)


class RankFiles:
    """A collector of the metrics files the ranks of a node write (`Metrics.publish`, into
    the spool's `metrics/` as `<job>.rank-<R>.prom`), served by the node agent with a `job`
    label (and `rank` where they have none): what a rank serves itself when no agent runs.
    A file not rewritten for `stale_s` seconds (its trainer is gone) is left out."""

    def __init__(self, directory: str, stale_s: float) -> None:
        self.dir = directory
        self.stale_s = stale_s

    def collect(self) -> Any:
        families: dict[str, Metric] = {}
        now = time.time()
        try:
            names = sorted(os.listdir(self.dir))
        except OSError:
            names = []
        for name in names:
            m = re.fullmatch(r"(\w+)\.rank-([0-9]+)\.prom", name, re.ASCII)
            path = os.path.join(self.dir, name)
            try:
                if not m or now - os.lstat(path).st_mtime > self.stale_s:
                    continue
                # IMPORTANT: a trainer's file, read by the agent: no link, FIFO or device
                # (a FIFO would hang every scrape), and no more than a rank's page of metrics.
                with open_regular(self.dir, name) as f:
                    text = f.read(_RANK_FILE_MAX + 1).decode()
                if len(text) > _RANK_FILE_MAX:
                    raise ValueError(f"{path} is over {_RANK_FILE_MAX} bytes")
                parsed = list(text_string_to_metric_families(text))
            except (OSError, ValueError, CheckpointError) as e:
                log.debug("rank metrics %s left out: %s", path, e)
                continue
            extra = {"job": m.group(1), "rank": str(int(m.group(2)))}
            for fam in parsed:
                out = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                for s in fam.samples:
                    out.add_sample(s.name, {**{k: v for k, v in extra.items() if k not in s.labels}, **s.labels}, s.value, s.timestamp)
        yield from families.values()
