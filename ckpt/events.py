"""The job's history under `<root>/events/`: one small JSON object per run, restart or failure.

Object stores cannot append, so nothing is appended: each run keeps one record of its own
(`run-<id>.json`, rewritten as it progresses: world size, last step reached, how it ended),
and each restore and each failure that a process lived to see writes a new object. A restart
reads the previous run's record to tell how many steps were lost and why the run ended; a run
whose record never says how it ended was killed (SIGKILL, a lost node, an OOM kill).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ckpt.errors import CheckpointError
from ckpt.redact import redact
from ckpt.storage.layout import EVENTS_DIR
from ckpt.storage.store import Store

log = logging.getLogger(__name__)

UNKNOWN_CAUSE = "unknown: the process was killed or the node was lost"


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


@dataclass
class RunRecord:
    """One run of the job, from its start to its end (or its last sign of life)."""

    run_id: str
    world_size: int
    started: float
    updated: float
    first_step: int  # the step it started (or resumed) at
    last_step: int  # the last completed step it reported
    ended: str | None = None  # "completed", "preempted (SIGTERM)", "error: ..."; None: killed
    kind: str = "run"


@dataclass
class Event:
    """A restart or a failure."""

    kind: str  # "restart" or "failure"
    time: float
    run_id: str
    step: int  # restart: the step resumed at; failure: the step reached
    world_size: int  # the world size of the run that writes the event
    cause: str | None = None
    steps_lost: int | None = None  # restart: steps the previous run completed past the restored step
    world_size_before: int | None = None
    restored_from: str | None = None
    phase: str | None = None  # failure: "start" (the restore, before any step), else None (training)


def _name(prefix: str, run_id: str, when: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f"{when % 1:.3f}"[1:]
    return f"{EVENTS_DIR}/{stamp}-{prefix}-{run_id}.json"


def write_run(store: Store, record: RunRecord) -> None:
    store.put_atomic(f"{EVENTS_DIR}/run-{record.run_id}.json", json.dumps(asdict(record)).encode())


def write_event(store: Store, event: Event) -> None:
    store.put_atomic(_name(event.kind, event.run_id, event.time), json.dumps(asdict(event)).encode())


def read_all(store: Store) -> tuple[list[RunRecord], list[Event]]:
    """Every run record and event under the root, oldest first. Unreadable objects are
    skipped: the history informs decisions, it never blocks a restore."""
    read = _read(store, [n for n in store.list_dir(EVENTS_DIR) if n.endswith(".json")])
    runs = sorted((r for r in read if isinstance(r, RunRecord)), key=lambda r: r.started)
    return runs, sorted((e for e in read if isinstance(e, Event)), key=lambda e: e.time)


def read_runs(store: Store) -> list[RunRecord]:
    """Every run record under the root (not the events), oldest first."""
    return sorted((r for r in _read(store, _run_names(store)) if isinstance(r, RunRecord)), key=lambda r: r.started)


def previous_run(store: Store, current_run_id: str) -> RunRecord | None:
    """The run before `current_run_id`: of the others, the one that started last. A run's id,
    so its record's name, begins with its start time (to the second): only the records whose
    names sort last are read (`_LOOK_BACK` at a time, further back while none can be read),
    not the whole history, which grows by two objects a restart."""
    names = [n for n in _run_names(store) if n != f"run-{current_run_id}.json"]
    while names:
        names, batch = names[:-_LOOK_BACK], names[-_LOOK_BACK:]
        runs = [r for r in _read(store, batch) if isinstance(r, RunRecord) and r.run_id != current_run_id]
        if runs:
            return max(runs, key=lambda r: r.started)
    return None


# Run records read at a time for the previous run: more than the runs that may start within
# one second (their names sort by the second, then at random).
_LOOK_BACK = 4


def _run_names(store: Store) -> list[str]:
    return sorted(n for n in store.list_dir(EVENTS_DIR) if n.startswith("run-") and n.endswith(".json"))


def _read(store: Store, names: list[str]) -> list[RunRecord | Event]:
    """The records and events `names` (under events/) hold, those that can be read."""

    def read(name: str) -> bytes | None:
        try:
            return store.read_bytes(f"{EVENTS_DIR}/{name}")
        except CheckpointError:
            return None

    out: list[RunRecord | Event] = []
    # A job restarted a hundred times has two hundred objects here.
    for blob in store.each(read, names, "ckpt-history"):
        try:
            doc = json.loads(blob) if blob is not None else {}
            if not doc:
                continue
            cls = RunRecord if doc.get("kind") == "run" else Event
            known = {f.name for f in dataclasses.fields(cls)}  # newer writers may add fields
            obj = cls(**{k: v for k, v in doc.items() if k in known})
            times = (obj.started, obj.updated) if isinstance(obj, RunRecord) else (obj.time,)
            if not all(type(t) in (int, float) and math.isfinite(t) for t in times):
                continue  # hand-edited or not ours: it cannot be placed in time
            out.append(obj)
        except (ValueError, TypeError, AttributeError):
            continue
    return out


class History:
    """This run's entries under `<root>/events/`, written by rank 0 only (others hold a no-op).

    Writes go through one background thread so that a slow store never delays a step; a
    failed write is logged and forgotten: the history informs, it must never fail training."""

    HEARTBEAT_S = 5.0  # how stale "last step reached" may be when a run is killed

    def __init__(self, store: Store, world_size: int, enabled: bool) -> None:
        self.store = store
        self.enabled = enabled
        now = time.time()
        self.record = RunRecord(new_run_id(), world_size, now, now, 0, 0)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-events") if enabled else None
        if self._pool is not None:
            # Its thread started now, while a restore is still to come: started by the first
            # write, at the end of entering, it cost that rank ~1 ms (starting it, and handing
            # the GIL back and forth with the history's reads it began at once).
            self._pool.submit(_nothing)
        self._last_beat = 0.0
        self.restart_event: Event | None = None  # this start's, once written (start)

    def start(self, step: int, restored: Any = None) -> None:
        """Record the run's start; with `restored` (the manifest restored), a restart event
        naming what the previous run lost and why it ended (`restart_event`), made and
        written in the background: it reads the history, which the restore need not wait for."""
        if not self.enabled:
            return
        self.record.first_step = self.record.last_step = step
        if restored is not None:
            began = time.time()
            assert self._pool is not None
            self._pool.submit(self._restart, step, restored, began).add_done_callback(_log_failure)
        self._submit(write_run, self.record)

    def _restart(self, step: int, restored: Any, began: float) -> None:
        try:
            prev = previous_run(self.store, self.record.run_id)
        except CheckpointError as e:
            log.warning("could not read the job's history: %s", e)
            prev = None
        self.restart_event = Event(
            kind="restart",
            time=began,
            run_id=self.record.run_id,
            step=step,
            world_size=self.record.world_size,
            cause=(prev.ended or UNKNOWN_CAUSE) if prev else None,
            steps_lost=max(0, prev.last_step - step) if prev else None,
            world_size_before=prev.world_size if prev else restored.world_size,
            restored_from=f"step-{restored.step:010d}",
        )
        if prev is not None:
            log.info(
                "the run before reached step %d (as of its last record, at most %.0f s old) and ended: %s; %d step(s) after step %d are done again",
                prev.last_step, self.HEARTBEAT_S, prev.ended or UNKNOWN_CAUSE, self.restart_event.steps_lost, step,
            )  # fmt: skip
        write_event(self.store, self.restart_event)

    def progress(self, step: int) -> None:
        """The loop completed `step` (main thread); written at most every HEARTBEAT_S."""
        if not self.enabled:
            return
        self.record.last_step = step
        if time.monotonic() - self._last_beat >= self.HEARTBEAT_S:
            self.beat()

    def beat(self) -> None:
        """Write the run record now (the last step the loop reported, never an older one)."""
        if not self.enabled:
            return
        self._last_beat = time.monotonic()
        self.record.updated = time.time()
        self._submit(write_run, dataclasses.replace(self.record))

    def end(self, step: int, how: str, failure: bool, phase: str | None = None, wait: bool = True) -> None:
        """The run ended: its record says how, and a failure is an event too. With `wait`
        False the writes finish in the background (before the interpreter exits)."""
        if not self.enabled:
            return
        self.record.last_step, self.record.ended, self.record.updated = step, how, time.time()
        if failure:
            self._submit(
                write_event,
                Event("failure", time.time(), self.record.run_id, step, self.record.world_size, cause=how, phase=phase),
            )
        self._submit(write_run, dataclasses.replace(self.record))
        assert self._pool is not None
        self._pool.shutdown(wait=wait)
        self._pool, self.enabled = None, False

    def flush(self) -> None:
        """Wait for the writes already asked for."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def _submit(self, fn: Any, obj: Any) -> None:
        assert self._pool is not None
        fut = self._pool.submit(fn, self.store, obj)
        fut.add_done_callback(_log_failure)


def _nothing() -> None:
    pass


def _log_failure(fut: concurrent.futures.Future[None]) -> None:
    if fut.exception() is not None:
        log.warning("could not write to the job's history: %s", fut.exception())


def error_gist(exc: BaseException) -> str:
    """The gist of an error for the job's history: its first line, without a C++ source
    location prefix (gloo's "[/path/pair.cc:537] "), without credentials, at most 200 chars."""
    text = redact(str(exc)).strip().splitlines()[0] if str(exc).strip() else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:200]
