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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import CheckpointError, DiskFull, LeaseHeld, StorageError
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.storage.layout import SMALL_JSON_MAX

if TYPE_CHECKING:
    from ckpt.storage.backend import Tagged
    from ckpt.storage.store import Store

log = logging.getLogger(__name__)

LEASE_NAME = "lease.json"
FORMAT = 1
JOB_ID_VARS = ("CKPT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
_ATTEMPTS = 5  # reads and conditional writes before giving up on a lease that keeps changing
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
        return Verdict(True, f"it was released at {_clock(held.released)} ({held.released_by or 'by its holder'})")
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
        return f"free (last held by {held.who()}, released at {_clock(held.released)}: {held.released_by or 'by its holder'})"
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
    for _ in range(_ATTEMPTS):
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
    raise LeaseHeld(f"{store.display}: the lease kept changing under {_ATTEMPTS} attempts to break it; try again")


# This process's live holds, by root (`Store.identity`): a second Checkpointer on a root the
# process holds (an evaluation inside the training block) shares the hold. Taking one of its
# own would replace the lease under the first, whose next commit check then finds it lost.
_HELD: dict[str, LeaseKeeper] = {}
_HELD_LOCK = threading.Lock()  # over _HELD, _TAKING and each keeper's count of users
_TAKING: dict[str, threading.Lock] = {}  # held through a take of that root: one at a time


def _forget_holds() -> None:
    """In a forked child: the parent's holds are not its own (their renewal threads did not
    come along), and a lock held at the fork would never be released."""
    global _HELD_LOCK
    _HELD.clear()
    _TAKING.clear()
    _HELD_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_holds)


class LeaseKeeper:
    """This job's hold on a root (rank 0): taken by `take`, renewed every ttl/3 in a
    background thread until `close`. Losing it (another job took it over, or it was
    broken) is final: `check` raises from then on, and nothing of this job commits.
    Shared by the Checkpointers of one process on one root: the last to close decides
    whether it is released.

    A root whose disk is full cannot take a lease document: the job still restores (reading
    needs no room), holding none (`pending`), and its first `check` (before its first save
    claims a step directory) takes it, or fails that save: the disk still full, or another
    job took the root meanwhile (then for good)."""

    def __init__(self, store: Store, policy: Lease, mine: Holder, tag: str | None, pending: str | None = None) -> None:
        self.store = store
        self.policy = policy
        self.mine = mine
        self._tag = tag  # the version of the lease this job wrote last
        #: Why this job no longer holds the root (None while it does).
        self.lost: str | None = None
        #: Why this job could not write its lease yet (None once it did).
        self.pending = pending
        self._closed = False
        self._users = 1  # the takes of this process that have not closed (under _HELD_LOCK)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if pending is None:
            self._start_renewing()

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_until_closed, name="ckpt-lease", daemon=True)
        self._thread.start()

    @classmethod
    def take(cls, store: Store, policy: Lease) -> LeaseKeeper:
        """Take the root's lease for this job, or raise LeaseHeld saying who holds it. A root
        this process holds already is shared (the first take's ttl rules)."""
        with _HELD_LOCK:
            taking = _TAKING.setdefault(store.identity, threading.Lock())
        with taking:
            with _HELD_LOCK:
                keeper = _HELD.get(store.identity)
                if keeper is not None and keeper.lost is None and not keeper._closed:
                    keeper._users += 1
                    log.info("the lease of %s is held by this process already: shared (%d users)", store.display, keeper._users)
                    return keeper
            keeper = cls._take(store, policy)
            with _HELD_LOCK:
                _HELD[store.identity] = keeper
            return keeper

    @classmethod
    def _take(cls, store: Store, policy: Lease) -> LeaseKeeper:
        me = this_process(policy.ttl_s)
        store.check_reachable()  # a missing bucket says so, not "could not create the lease"
        try:
            return cls(store, policy, me, _acquire(store, policy, me, wait=True))
        except DiskFull as e:
            # IMPORTANT: no lease is held, so nothing may be written before `check` takes it.
            log.warning(
                "could not write the lease of %s (%s): restoring without it; saving there will fail until the disk "
                "has room again (the lease is taken before the first save)", store.display, e,
            )  # fmt: skip
            return cls(store, policy, me, None, pending=str(e))

    def check(self) -> None:
        """Raise LeaseHeld unless this job still holds the root. Rank 0 calls it before it
        claims a step directory and before it commits; it reads the lease (one small GET), or
        renews it when its renewal is overdue, or takes it if it could not at the start
        (`pending`: a DiskFull while the disk stays full)."""
        with self._lock:
            if self.pending is not None and self.lost is None and not self._closed:
                self._take_pending()
            elif self.lost is None and not self._closed and time.time() - self.mine.renewed > self.policy.ttl_s / 2:
                # The renewals failed for a while (a store that stalled): the lease may have
                # expired, and a job that looks now may take it. Renewed here (a conditional
                # write: it fails if one did), so that none can while this save commits.
                self._renew_locked()
            elif self.lost is None:
                got = self.store.read_tagged(LEASE_NAME)
                if got is not None and self._still_mine(got):
                    self._tag = got.tag  # a renewal that seemed to fail may have landed
                else:
                    self._lose()
            if self.lost is not None:
                raise LeaseHeld(self.lost)

    def _take_pending(self) -> None:
        """Take the lease this job could not write when it started. Under the lock."""
        me = this_process(self.policy.ttl_s)
        try:
            tag = _acquire(self.store, self.policy, me, wait=False)
        except LeaseHeld as e:  # another job took the root meanwhile: it is that job's now
            self.lost = f"this job could not write the lease of {self.store.display} when it started ({self.pending}), and now: {e}"
            log.error("%s", self.lost)
            return
        self.mine, self._tag, self.pending = me, tag, None
        self._start_renewing()

    def close(self, release: bool) -> None:
        """Stop renewing; with `release` (a clean exit), mark the lease released if it is
        still this job's, so that any job may take the root at once. While another take of
        this process has not closed, the lease stays as it is."""
        with _HELD_LOCK:
            self._users -= 1
            if self._users > 0:
                return
            if _HELD.get(self.store.identity) is self:
                del _HELD[self.store.identity]
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.policy.ttl_s)
        if not self._lock.acquire(timeout=self.policy.ttl_s):
            log.warning("the lease of %s is still being renewed; it is left to expire", self.store.display)
            return
        try:
            self._closed = True
            if not release or self.lost is not None or self.pending is not None:
                return
            done = dataclasses.replace(self.mine, released=time.time(), released_by=f"job {self.mine.job_id!r} left cleanly")
            if self._write(done) is None:
                log.warning("did not release the lease of %s: %s", self.store.display, self.lost)
        except CheckpointError as e:
            log.warning("releasing the lease of %s failed (%s); it expires %s", self.store.display, e, _clock(self.mine.expires))
        finally:
            self._lock.release()

    def renew(self) -> None:
        """Write the lease again with a new renewal time, if it is still this job's."""
        with self._lock:
            if self.lost is None and not self._closed:
                self._renew_locked()

    def _renew_locked(self) -> None:
        self._write(dataclasses.replace(self.mine, renewed=time.time()))

    def _renew_until_closed(self) -> None:
        period = self.policy.ttl_s / 3
        while not self._stop.wait(period) and self.lost is None:
            try:
                self.renew()
            except Exception as e:  # IMPORTANT: a dead renewal thread would let the lease lapse unsaid
                # A store that stalls: the check before each commit decides whether the root is ours.
                log.warning("renewing the lease of %s failed (%s); trying again in %.1f s", self.store.display, e, period)

    def _write(self, doc: Holder) -> str | None:
        """Replace this job's last version of the lease with `doc`; None (and `lost` set)
        if it is not this job's any more. Under the lock."""
        tag = self.store.put_if_unchanged(LEASE_NAME, doc.to_json(), self._tag)
        if tag is None:
            # Not the version this job wrote last: an earlier write of this job that failed
            # late may have landed after all (its run id), else someone else wrote.
            now = self.store.read_tagged(LEASE_NAME)
            if now is not None and self._still_mine(now):
                self._tag = now.tag
                tag = self.store.put_if_unchanged(LEASE_NAME, doc.to_json(), self._tag)
            if tag is None:
                self._lose()
                return None
        self.mine, self._tag = doc, tag
        return tag

    def _still_mine(self, got: Any) -> bool:
        if got is None:
            return False
        if got.tag == self._tag:
            return True
        try:
            held = parse(got)
        except ValueError:
            return False
        return held.run_id == self.mine.run_id and held.released is None

    def _lose(self) -> None:
        """Say once why this job no longer holds the root. Under the lock."""
        try:
            held = read(self.store)
            now = "nobody: the lease was deleted" if held is None else describe(held, time.time())
        except (CheckpointError, ValueError) as e:
            now = f"unknown ({e})"
        self.lost = (
            f"this job ({self.mine.who()}) no longer holds the lease of {self.store.display}: it is now "
            f"{now}. Another job took the root over (takeover, CKPT_TAKEOVER, or `ckpt lease --break`), "
            "so this job commits nothing more there: its saves fail rather than overwrite that job's checkpoints"
        )
        log.error("%s", self.lost)


def _acquire(store: Store, policy: Lease, me: Holder, *, wait: bool) -> str:
    """Write the lease document `me` if the lease `judge` lets this job take it; its tag, or
    LeaseHeld. With `wait`, a lease held from another machine is waited out once to see
    whether it is renewed (`_expiry_wait`)."""
    waited: str | None = None  # the version of the lease waited out, once
    for _ in range(_ATTEMPTS):
        got = store.read_tagged(LEASE_NAME)
        if got is None:
            tag = store.put_if_absent(LEASE_NAME, me.to_json())
            why, warn = "it had none", False
        else:
            verdict = _judge_stored(got, me, policy.takes_over)
            if not verdict.take and wait and waited is None and (pause := _expiry_wait(got, me)) is not None:
                # Held from another machine, nobody here can tell whether it still runs
                # (a crashed job's restart lands on another node): see if it renews.
                log.warning("the lease of %s is held from another machine; waiting %.0f s to see whether it renews", store.display, pause)
                time.sleep(pause)
                waited = got.tag
                continue
            if not verdict.take and waited == got.tag:
                verdict = judge(parse(got), me, math.inf, takeover=False, alive=None)  # not renewed: expired
            if not verdict.take:
                raise LeaseHeld(_refusal(store, got, me))
            tag = store.put_if_unchanged(LEASE_NAME, me.to_json(), got.tag)
            why, warn = verdict.why, verdict.warn
        if tag is not None:
            # IMPORTANT: DEBUG unless it says something is off: rank 0 shows INFO (`ckpt.console`).
            log.log(logging.WARNING if warn else logging.DEBUG, "took the lease of %s for job %r: %s", store.display, me.job_id, why)
            return tag
        # Another job wrote it between the read and the write: look again.
    raise LeaseHeld(f"{store.display}: its lease kept changing under {_ATTEMPTS} attempts to take it: another job is starting there at the same time")


def take_for_job(store: Store, policy: Lease | None, group: Any, flag: bool = False) -> tuple[LeaseKeeper | None, bool]:
    """Rank 0 of `group` (a `ckpt.collectives.Group`) takes the root's lease under `policy`
    (None: no lease), once it saw the root is not a checkpoint's own step directory; every
    rank learns the outcome and raises the same error, so that none goes on alone into a
    collective. Returns rank 0's keeper (None elsewhere), and whether any rank's `flag` was
    set: what the ranks must learn next (whether a node agent serves any of them) rides on
    the lease's one collective."""
    keeper, error = None, None
    if group.rank == 0:
        try:
            if _is_checkpoint(store):  # a job there would write into a committed checkpoint
                raise ValueError(
                    f"{store.display} is a checkpoint (it holds {MANIFEST_NAME}), not a checkpoint root: "
                    "pass the directory that holds the step-* directories"
                )
            if policy is not None:
                keeper = LeaseKeeper.take(store, policy)
        except Exception as e:  # told to every rank below, not left to hang them
            error = e
    # Always, whatever this rank's settings say: a collective must never depend on them.
    try:
        failed, anyone = group.max([int(error is not None), int(flag)])
        told = group.broadcast(None if error is None else (type(error).__name__, str(error))) if failed else None
    except BaseException:
        if keeper is not None:  # the job is not starting: nothing may keep renewing its hold
            keeper.close(release=False)
        raise
    if error is not None:
        raise error
    if told is not None:
        kind, text = told
        raise {"LeaseHeld": LeaseHeld, "StorageError": StorageError, "ValueError": ValueError}.get(kind, CheckpointError)(text)
    return keeper, bool(anyone)


def _is_checkpoint(store: Store) -> bool:
    """Whether the root holds a ckpt manifest of its own: it is a step directory."""
    try:
        doc = json.loads(store.read_bytes(MANIFEST_NAME))
    except CheckpointError:
        return False  # none (or unreadable: the lease take that follows says so)
    except ValueError:
        return False  # another tool's manifest.json: not ours to judge
    return isinstance(doc, dict) and doc.get("format") == "ckpt"


# The longest rank 0 waits out another machine's lease at enter (the other ranks wait in a
# collective meanwhile, whose timeout is longer by default).
MAX_EXPIRY_WAIT_S = 120.0


def _expiry_wait(got: Tagged, me: Holder) -> float | None:
    """Seconds until a lease held from another machine expires (plus a second), when that is
    short enough to wait out; None otherwise."""
    try:
        held = parse(got)
    except ValueError:
        return None
    left = held.expires - time.time() + 1.0
    return left if not held.same_machine(me) and held.released is None and 0 < left <= MAX_EXPIRY_WAIT_S else None


def _judge_stored(got: Tagged, me: Holder, takeover: bool) -> Verdict:
    try:
        held = parse(got)
    except ValueError as e:
        return Verdict(takeover, f"taking over an unreadable lease ({e}), as told (takeover)", warn=True)
    alive = process_alive(held.pid, held.pid_start) if held.same_machine(me) else None
    return judge(held, me, time.time(), takeover=takeover, alive=alive)


def _refusal(store: Store, got: Tagged, me: Holder) -> str:
    try:
        held = parse(got)
    except ValueError as e:
        holder = f"its lease, {store.display}/{LEASE_NAME}, is unreadable ({e})"
    else:
        now = time.time()
        holder = (
            f"{held.who()} holds its lease, last renewed {_span(now - held.renewed)} ago "
            f"({_clock(held.renewed)}), and it expires at {_clock(held.expires)} (in "
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


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _span(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
