"""One job's hold on its root's lease (`LeaseKeeper`, rank 0's): taken when the job starts
(`take_for_job`, whose outcome every rank learns), renewed every ttl/3 in a background thread,
checked before each commit, and released when the job leaves cleanly. What the lease document
says and who may take it is `ckpt.storage.lease`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ckpt.errors import CheckpointError, DiskFull, LeaseHeld, StorageError
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.storage.lease import (
    ATTEMPTS,
    LEASE_NAME,
    Holder,
    Lease,
    Verdict,
    clock,
    describe,
    judge,
    parse,
    process_alive,
    read,
    refusal,
    this_process,
)

if TYPE_CHECKING:
    from ckpt.storage.backend import Tagged
    from ckpt.storage.store import Store

log = logging.getLogger("ckpt.storage.lease")  # the lease's news, under one name

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

    def __init__(self, store: Store, policy: Lease, mine: Holder, tag: str | None, as_seen: bool = False, pending: str | None = None) -> None:
        self.store = store
        #: The root is as `take` was given it as seen (`Seen`): see `take`.
        self.as_seen = as_seen
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
    def take(cls, store: Store, policy: Lease, seen: Seen | None = None) -> LeaseKeeper:
        """Take the root's lease for this job, or raise LeaseHeld saying who holds it. A root
        this process holds already is shared (the first take's ttl rules). `seen`: the root
        as `ckpt.prepare` found it; `as_seen` says whether the root is as it was seen: the
        lease was quiet then (`Seen.quiet`) and written over that version (nobody wrote it
        since)."""
        with _HELD_LOCK:
            taking = _TAKING.setdefault(store.identity, threading.Lock())
        with taking:
            with _HELD_LOCK:
                keeper = _HELD.get(store.identity)
                if keeper is not None and keeper.lost is None and not keeper._closed:
                    keeper._users += 1
                    keeper.as_seen = False  # another Checkpointer of this process holds it: it may have written there
                    log.info("the lease of %s is held by this process already: shared (%d users)", store.display, keeper._users)
                    return keeper
            keeper = cls._take(store, policy, seen)
            with _HELD_LOCK:
                _HELD[store.identity] = keeper
            return keeper

    @classmethod
    def _take(cls, store: Store, policy: Lease, seen: Seen | None) -> LeaseKeeper:
        me = this_process(policy.ttl_s)
        if seen is None:  # else checked as it was seen
            store.check_reachable()  # a missing bucket says so, not "could not create the lease"
        try:
            return cls(store, policy, me, *_acquire(store, policy, me, wait=True, seen=seen))
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
        (`pending`: a DiskFull while the disk stays full). A renewal under way (a store that
        throttles or stalls) is waited for up to the lease's ttl: past it the lease may have
        expired whatever the renewal does, and the check fails (a StorageError: the next save
        checks again)."""
        # IMPORTANT: never waits for the lock without end: the save's commit waits for this.
        if not self._lock.acquire(timeout=self.policy.ttl_s):
            raise StorageError(
                f"could not check the lease of {self.store.display}: its renewal has been under way for over "
                f"{self.policy.ttl_s:g} s (the lease's ttl), and the lease may have expired meanwhile; not writing there"
            )  # fmt: skip
        try:
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
        finally:
            self._lock.release()
        if self.lost is not None:
            raise LeaseHeld(self.lost)

    def _take_pending(self) -> None:
        """Take the lease this job could not write when it started. Under the lock."""
        me = this_process(self.policy.ttl_s)
        try:
            tag, _ = _acquire(self.store, self.policy, me, wait=False)
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
            log.warning("releasing the lease of %s failed (%s); it expires %s", self.store.display, e, clock(self.mine.expires))
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


def _acquire(store: Store, policy: Lease, me: Holder, *, wait: bool, seen: Seen | None = None) -> tuple[str, bool]:
    """Write the lease document `me` if the lease `judge` lets this job take it; its tag and
    whether it was written over the version `seen` (read earlier, `ckpt.prepare`), or
    LeaseHeld. With `wait`, a lease held from another machine is waited out once to see
    whether it is renewed (`_expiry_wait`)."""
    waited: str | None = None  # the version of the lease waited out, once
    for attempt in range(ATTEMPTS):
        # IMPORTANT: the first write is conditional on the version seen: it lands only if
        # nobody wrote the lease since.
        got = seen.lease if seen is not None and attempt == 0 else store.read_tagged(LEASE_NAME)
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
                raise LeaseHeld(refusal(store, got, me))
            tag = store.put_if_unchanged(LEASE_NAME, me.to_json(), got.tag)
            why, warn = verdict.why, verdict.warn
        if tag is not None:
            # IMPORTANT: DEBUG unless it says something is off: rank 0 shows INFO (`ckpt.console`).
            log.log(logging.WARNING if warn else logging.DEBUG, "took the lease of %s for job %r: %s", store.display, me.job_id, why)
            return tag, seen is not None and seen.quiet and attempt == 0
        # Another job wrote it between the read and the write: look again.
    raise LeaseHeld(f"{store.display}: its lease kept changing under {ATTEMPTS} attempts to take it: another job is starting there at the same time")


def take_for_job(store: Store, policy: Lease | None, group: Any, flag: bool = False, seen: Seen | None = None) -> tuple[LeaseKeeper | None, bool]:
    """Rank 0 of `group` (a `ckpt.collectives.Group`) takes the root's lease under `policy`
    (None: no lease), once it saw the root is not a checkpoint's own step directory (or as
    `seen` by `ckpt.prepare`); every rank learns the outcome and raises the same error, so
    that none goes on alone into a collective. Returns rank 0's keeper (None elsewhere), and
    whether any rank's `flag` was set: what the ranks must learn next (whether a node agent
    serves any of them) rides on the lease's one collective."""
    keeper, error = None, None
    if group.rank == 0:
        try:
            if seen is None and _is_checkpoint(store):  # a job there would write into a committed checkpoint
                raise ValueError(
                    f"{store.display} is a checkpoint (it holds {MANIFEST_NAME}), not a checkpoint root: "
                    "pass the directory that holds the step-* directories"
                )
            if policy is not None:
                keeper = LeaseKeeper.take(store, policy, seen)
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


@dataclasses.dataclass(frozen=True)
class Seen:
    """The root as `ckpt.prepare` found it before it surveyed it: reachable, no step
    directory, its lease (None: none), and whether that lease was `quiet`."""

    lease: Tagged | None
    quiet: bool


def seen_now(store: Store) -> Seen | None:
    """The root's `Seen` now, or None where it is a checkpoint's step directory (the lease
    take says so)."""
    store.check_reachable()
    if _is_checkpoint(store):
        return None
    got = store.read_tagged(LEASE_NAME)
    return Seen(got, _quiet(got))


def _quiet(got: Tagged | None) -> bool:
    """Whether no holder of the lease `got` could commit to the root without writing the
    lease first: none, released, expired (a holder renews an overdue lease before it commits),
    or held by a process gone from this machine. A live holder's commit needs no write while
    its lease is fresh (`LeaseKeeper.check` reads it): a survey made then may miss it."""
    if got is None:
        return True
    try:
        held = parse(got)
    except ValueError:
        return False
    if held.released is not None or time.time() > held.expires:
        return True
    return held.same_machine(this_process(0.0)) and not process_alive(held.pid, held.pid_start)


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
