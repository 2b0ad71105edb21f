"""The root lease: one job writes to a checkpoint root at a time.

Two jobs pointed at one root by mistake would restore each other's checkpoints, commit over
each other's steps and delete each other's by retention. So a job's rank 0 takes
`<root>/lease.json` before it reads or writes anything there, renews it every ttl/3 in a
background thread and releases it when the `Checkpointer` block exits cleanly; another job is
refused (`LeaseHeld`) with who holds the root and how to take it over.

Who may take a lease someone holds (`judge`, pure): the same job restarting (the same
`CKPT_JOB_ID`, `TORCHELASTIC_RUN_ID` or `SLURM_JOB_ID`), this very process, a holder on this
machine whose process is gone (a crashed run restarted in place), a holder that has not
renewed it for its ttl (expired), and anyone told to take over (`Lease(takeover=True)`,
`CKPT_TAKEOVER=1`, `ckpt lease ROOT --break`). Every write is conditional
(`Store.put_if_absent`, `Store.put_if_unchanged`): of jobs racing for a free or expired lease
exactly one wins, and a holder whose lease was taken learns it at its next renewal, or at the
check before each commit, and never commits there again. A released lease stays in the root,
marked released (a conditional write, where a delete could remove a new holder's lease).

Expiry compares the wall clocks of different machines: they must agree to well within the
ttl (NTP does). The node agent (`ckpt agent`) commits saves handed off to it without the
lease: they were taken while the job held it.

This module owns the lease document and the rules over it (who holds it, who may take it, how
its state reads, breaking it); a job's live hold on it is `ckpt.storage.lease_keeper`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt.errors import LeaseHeld
from ckpt.storage.layout import SMALL_JSON_MAX

if TYPE_CHECKING:
    from ckpt.storage.backend import Tagged
    from ckpt.storage.store import Store

LEASE_NAME = "lease.json"
FORMAT = 1
JOB_ID_VARS = ("CKPT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
ATTEMPTS = 5  # reads and conditional writes before giving up on a lease that keeps changing
_FRESH_JOB_ID = f"run-{uuid.uuid4().hex[:12]}"  # this process's job when the environment names none


@dataclass(frozen=True)
class Lease:
    """One job per root: the lease policy of ``Checkpointer(lease=...)`` (None: no lease)."""

    ttl_s: float = 60.0
    """Seconds the lease stays valid after its last renewal; the holder renews it every
    ttl_s / 3. The default, 60 s: a job that died on another machine keeps its root for at
    most a minute (a restart takes longer than that anyway), and a store that stalls for
    40 s does not cost a live job its root. A holder on this machine whose process is gone
    is replaced at once, whatever the ttl."""
    takeover: bool = False
    """Take the root even from a live job (or set ``CKPT_TAKEOVER=1``): that job's next save
    then fails instead of writing here. For when the other job is known to be gone or
    unwanted; two live jobs on one root overwrite each other."""

    def __post_init__(self) -> None:
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) or not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"Lease(ttl_s={self.ttl_s!r}): the ttl is a positive number of seconds")

    @property
    def takes_over(self) -> bool:
        return self.takeover or os.environ.get("CKPT_TAKEOVER", "").strip().lower() in ("1", "true", "yes", "on")


def job_id() -> str:
    """This job's identity: `CKPT_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else `SLURM_JOB_ID`
    (each unless empty or "none", torchrun's default), else one fresh id per process."""
    for var in JOB_ID_VARS:
        value = os.environ.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    return _FRESH_JOB_ID


@dataclass(frozen=True)
class Holder:
    """Who holds a root's lease: the JSON document `<root>/lease.json`. Times are wall
    clock (`time.time()`)."""

    job_id: str
    host: str
    pid: int
    run_id: str  # one per take: tells this holder's own writes from anyone else's
    acquired: float
    renewed: float
    ttl_s: float
    boot_id: str = ""  # with host and pid_ns: the same machine, where a pid means something
    pid_ns: int = 0
    pid_start: int = 0  # the process's start (clock ticks after boot): a reused pid is another process
    released: float | None = None  # when the holder let it go, or it was broken
    released_by: str = ""
    format: int = FORMAT

    @property
    def expires(self) -> float:
        return self.renewed + self.ttl_s

    def who(self) -> str:
        return f"job {self.job_id!r} (host {self.host}, pid {self.pid})"

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder:
        """Raises ValueError for anything but a lease document."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} lease document")
            known = {f.name: f.type for f in dataclasses.fields(cls)}
            held = cls(**{k: v for k, v in doc.items() if k in known})
            for name, kind in known.items():
                value = getattr(held, name)
                want = {"str": str, "int": int, "float": (int, float), "float | None": (int, float, type(None))}[kind]
                if isinstance(value, bool) or not isinstance(value, want):
                    raise ValueError(f"its {name} is {value!r}")
            return held
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"not a lease document ({type(e).__name__}: {e})") from e

    def same_machine(self, other: Holder) -> bool:
        """Whether a pid of `other` names a process that this holder can look up."""
        return (self.host, self.boot_id, self.pid_ns) == (other.host, other.boot_id, other.pid_ns)


def this_process(ttl_s: float) -> Holder:
    """A fresh lease document for this process, taken now."""
    now = time.time()
    stat = _proc_stat(os.getpid())
    return Holder(
        job_id=job_id(),
        host=socket.gethostname(),
        pid=os.getpid(),
        run_id=uuid.uuid4().hex,
        acquired=now,
        renewed=now,
        ttl_s=float(ttl_s),
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        pid_ns=_pid_ns(),
        pid_start=stat[1] if stat else 0,
    )


@dataclass(frozen=True)
class Verdict:
    """Whether a held lease may be taken, and why (for the log)."""

    take: bool
    why: str
    warn: bool = False


def judge(held: Holder, me: Holder, now: float, *, takeover: bool, alive: bool | None) -> Verdict:
    """May `me` take the lease `held`? `alive`: whether the holder's process still runs,
    None when it is not on this machine (nobody here can tell)."""
    if held.released is not None:
        return Verdict(True, f"it was released at {clock(held.released)} ({held.released_by or 'by its holder'})")
    if held.job_id == me.job_id:
        return Verdict(True, f"it is held by this same job ({held.who()}): a restart")
    if held.same_machine(me) and (held.pid, held.pid_start) == (me.pid, me.pid_start):
        return Verdict(True, "it is held by this very process")
    if alive is False:
        return Verdict(True, f"its holder, {held.who()}, is gone from this machine")  # a restart after a crash: no news
    if now > held.expires:
        return Verdict(True, f"it expired: {held.who()} last renewed it {_span(now - held.renewed)} ago (ttl {_span(held.ttl_s)})", warn=True)
    if takeover:
        return Verdict(True, f"taking it over from {held.who()}, which renewed it {_span(now - held.renewed)} ago, as told (takeover)", warn=True)
    return Verdict(False, "held by another live job")


def describe(held: Holder | None, now: float, alive: bool | None = None) -> str:
    """The lease's state in a line, for `ckpt lease` and `ckpt ls`; `alive`: whether the
    holder's process still runs (`holder_alive`)."""
    if held is None:
        return "free (no lease)"
    if held.released is not None:
        return f"free (last held by {held.who()}, released at {clock(held.released)}: {held.released_by or 'by its holder'})"
    timing = f"renewed {_span(now - held.renewed)} ago"
    if alive is False:
        return f"held by {held.who()}, whose process is gone from this machine ({timing}): the next job here takes it at once"
    if now > held.expires:
        return f"expired {_span(now - held.expires)} ago: {held.who()}, {timing}; the next job takes it"
    return f"held by {held.who()}, {timing}, expires in {_span(held.expires - now)} unless renewed"


def holder_alive(held: Holder | None) -> bool | None:
    """Whether the holder's process still runs; None when nobody here can tell (another
    machine, or no holder)."""
    if held is None or not held.same_machine(this_process(0.0)):
        return None
    return process_alive(held.pid, held.pid_start)


def state(held: Holder | None, now: float) -> str:
    """"free", "expired" or "held"."""
    if held is None or held.released is not None:
        return "free"
    return "expired" if now > held.expires else "held"


def read(store: Store) -> Holder | None:
    """The root's lease document, None if there is none. ValueError if it is not one."""
    got = store.read_tagged(LEASE_NAME)
    return None if got is None else parse(got)


def parse(got: Tagged) -> Holder:
    """The lease document as read; ValueError if it is not one. One larger than any lease
    document is refused by its size, unparsed (and, but on S3, unread past the cap)."""
    size = max(got.size, len(got.data))
    if size > SMALL_JSON_MAX:
        raise ValueError(f"{size:,} bytes, more than the {SMALL_JSON_MAX >> 20} MiB a lease document may hold; not read")
    return Holder.from_json(got.data)


def break_lease(store: Store) -> Holder | None:
    """Mark the root's lease released whoever holds it (`ckpt lease ROOT --break`); its
    holder's next renewal or commit check finds it lost. Returns the holder it had (None:
    there was no lease, or it was released already)."""
    for _ in range(ATTEMPTS):
        got = store.read_tagged(LEASE_NAME)
        if got is None:
            return None
        try:
            held = parse(got)
        except ValueError:
            held = Holder("?", "?", 0, "", 0.0, 0.0, 0.0)
        if held.released is not None:
            return None
        me = this_process(0.0)
        broken = dataclasses.replace(held, released=time.time(), released_by=f"broken by `ckpt lease --break` on {me.host}, pid {me.pid}")
        if store.put_if_unchanged(LEASE_NAME, broken.to_json(), got.tag):
            return held
    raise LeaseHeld(f"{store.display}: the lease kept changing under {ATTEMPTS} attempts to break it; try again")


def refusal(store: Store, got: Tagged, me: Holder) -> str:
    """Why this job may not take the root (its LeaseHeld): who holds it, and what to do."""
    try:
        held = parse(got)
    except ValueError as e:
        holder = f"its lease, {store.display}/{LEASE_NAME}, is unreadable ({e})"
    else:
        now = time.time()
        holder = (
            f"{held.who()} holds its lease, last renewed {_span(now - held.renewed)} ago "
            f"({clock(held.renewed)}), and it expires at {clock(held.expires)} (in "
            f"{_span(held.expires - now)}) unless renewed"
        )
    return (
        f"{store.display} is in use by another job: {holder}. Two jobs on one root overwrite "
        "and delete each other's checkpoints, so this job has read and written nothing there. "
        f"The same job restarting is never refused (this job's id is {me.job_id!r}, "
        + (f"made up for this process: none of {' / '.join(JOB_ID_VARS)} is set" if me.job_id == _FRESH_JOB_ID else f"from {' / '.join(JOB_ID_VARS)}")
        + "). To take the root over anyway, after which the other job's "
        "next save fails instead of writing there: pass lease=ckpt.Lease(takeover=True), or set "
        f"CKPT_TAKEOVER=1, or run `ckpt lease {store.display} --break`. Or give this job a root of its own."
    )


def process_alive(pid: int, start: int) -> bool:
    """Whether process `pid` of this machine still runs: a zombie does not, and neither
    does a pid now reused by a process started at another time than `start` (0: unknown)."""
    stat = _proc_stat(pid)
    if stat is not None:
        return stat[0] not in ("Z", "X", "x") and (not start or stat[1] == start)
    if os.path.exists("/proc/self/stat"):
        return False  # Linux, and no such process
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's, and alive
        return True
    return True


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process, from /proc."""
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 on
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def clock(t: float) -> str:
    """A wall-clock time as people read it (local time, with its zone)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _span(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
