"""A restore begun before the training state exists: `ckpt.prepare(root)`.

A restarted job spends seconds to minutes before it can restore (at 10,000 GPUs: torch's
process group forms, the model is built and sharded), and a restore's fixed costs came after
that, one after another: each rank imports its store's client stack and makes its client (an
S3 root: 0.3-0.45 s of CPU here), rank 0 lists the root and reads and checks the newest
manifest (for 70B on 10,000 ranks, 0.3 s). Called first thing, `prepare` does them on a
thread of its own while the job sets up:

- every rank: the store (its client stack imported) and its client;
- rank 0 (as torch.distributed, `RANK` or the launcher's variable says; in a job of one
  process, that one): the root checked and its lease read as it stands, then the survey a
  restore makes (`restore.pick.restore_plan`: the candidates, the newest one's manifest read
  and checked, the part each rank is told made). What it would log is held back.

The Checkpointer made with the same root, storage options, transfer and timeout takes the
store over. At its restore, rank 0 takes the lease by a write conditional on the version read
before the survey. Where the lease was quiet then (none, released, expired, or its holder's
process gone from this machine: a holder commits only after writing such a lease) and that
write lands, no job that keeps to the lease wrote to the root since, and the survey stands
(its lines logged then). Otherwise (a live holder's fresh lease, under which it commits
without writing it; the lease changed or was shared within this process; no lease kept; a
node agent serves the job, which commits without it; or the restore mode, signing key or
world size differ) the survey is dropped and made anew. Nothing more is taken on trust: rank
0 looks at the root again as the ranks begin to read the pick (`restore.pick.second_look`), and
where a newer checkpoint was committed without the lease since (a node agent finishing a dead
job's save, a `lease=None` writer) or the pick's manifest changed, the restore starts over
from a survey made then; each rank still checks every byte it reads against the manifest,
and a checkpoint that fails falls back to the one before, as always. A prepare that fails leaves the Checkpointer to do
all of it, and to say what went wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from ckpt.format.manifest import Manifest
from ckpt.format.signing import SigningKey
from ckpt.options import check_restore, check_seconds
from ckpt.redact import redact
from ckpt.restore.pick import Prepared, restore_plan
from ckpt.restore.view import checked_manifest, parts
from ckpt.storage.lease_keeper import LeaseKeeper, Seen, seen_now
from ckpt.storage.store import Store, Transfer

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False, repr=False)
class Early:
    """One `prepare`'s work: made on its thread, taken over by one Checkpointer."""

    args: tuple[str, dict[str, Any] | None, Transfer]  # the store's, as the Checkpointer makes it
    mode: str | int
    key: SigningKey | None
    world: int
    surveys: bool  # rank 0: surveys the root
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    store: Store | None = None
    seen: Seen | None = None  # rank 0: the root before the survey
    plan: Prepared | None = None
    records: list[logging.LogRecord] = dataclasses.field(default_factory=list)  # held back
    held: list[logging.Logger] = dataclasses.field(default_factory=list)  # where `hold` filters
    hold: logging.Filter | None = None

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"Early({redact(self.args[0])!r}, restore={self.mode!r}, world={self.world}, done={self.done.is_set()})"

    def survey(self, mode: str | int, key: SigningKey | None, world: int, lease: LeaseKeeper | None, agents: bool) -> Prepared | None:
        """Rank 0's survey, where it still stands (see the module); its lines logged now."""
        same_key = (key.key_id if key is not None else None) == (self.key.key_id if self.key is not None else None)
        why = (
            "it found nothing it could use" if self.plan is None
            else "this Checkpointer's restore, signing key or world size differ" if not (mode == self.mode and same_key and world == self.world)
            else "no lease is kept" if lease is None
            else "a node agent serves this job (it commits without the lease)" if agents
            else "the root's lease was held, or written since" if not lease.as_seen
            else ""
        )  # fmt: skip
        if why:
            log.info("the survey made at prepare is not used (%s): the root is surveyed now", why)
            return None
        log.info("the survey made at prepare stands")
        for record in self.records:  # at the levels set now
            if (logger := logging.getLogger(record.name)).isEnabledFor(record.levelno):
                logger.handle(record)
        return self.plan

    def hold_lines(self) -> None:
        """From now on this thread's lines on ckpt's loggers wait in `records`."""
        self.hold = _Hold(self, threading.current_thread())
        self.held = [logging.getLogger(n) for n in ("ckpt", *(n for n in list(logging.root.manager.loggerDict) if n.startswith("ckpt.")))]
        for logger in self.held:  # a new list: another thread logging meanwhile goes through the old one whole
            logger.filters = [*logger.filters, self.hold]

    def release_lines(self) -> None:
        for logger in self.held:
            logger.filters = [f for f in logger.filters if f is not self.hold]
        self.held = []


class _Hold(logging.Filter):
    """Holds back the lines of one thread (by the thread, not its id: a later thread may
    reuse an id, a forked child's threads are others)."""

    def __init__(self, early: Early, thread: threading.Thread) -> None:
        super().__init__()
        self.early, self.thread = early, thread

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.current_thread() is not self.thread:
            return True
        self.early.records.append(record)
        return False


_pending: Early | None = None
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has no prepare thread: nothing of it is waited for, nor held back."""
    global _pending, _lock
    _lock = threading.Lock()
    early, _pending = _pending, None
    if early is not None:
        early.release_lines()


os.register_at_fork(after_in_child=_forget_in_child)


def store_config(root: str | os.PathLike, storage_options: dict[str, Any] | None, transfer: Transfer | None, timeout_s: float) -> tuple[str, dict[str, Any] | None, Transfer]:
    """The arguments of the Checkpointer's `Store`."""
    # IMPORTANT: no request of rank 0's commit outlives the other ranks' wait for it.
    transfer = (transfer or Transfer()).within(timeout_s)
    if transfer.requests_per_s > 0:  # each rank paces itself at its share
        transfer = dataclasses.replace(transfer, ranks=world_size())
    return os.fspath(root), storage_options, transfer


def world_size() -> int:
    """The job's ranks, as torch.distributed (or torchrun's environment) says."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


# Where launchers say a process's rank before torch.distributed knows it.
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank(world: int) -> int | None:
    """This process's rank, as torch.distributed or the launcher says; 0 in a job of one
    process; None where nothing says (then it surveys nothing: every process would)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for var in RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value.isascii() and value.isdigit():
            return int(value)
    return 0 if world == 1 else None


def prepare(
    root: str | os.PathLike = "./checkpoints",
    *,
    storage_options: dict[str, Any] | None = None,
    transfer: Transfer | None = None,
    timeout_s: float = 600.0,
    restore: str | int = "latest",
    signing_key: bytes | str | None = None,
) -> None:
    """Begin the restore of the Checkpointer that this process makes next, before the model
    exists: call it first thing, with that Checkpointer's own `root`, `storage_options`,
    `transfer`, `timeout_s`, `restore` and `signing_key` (those that differ make the work
    wasted, never wrong; so does a Checkpointer for another root made first, which drops
    it, or another `prepare`, which replaces it). Returns once the arguments are checked,
    the work on a thread of its own; see the module."""
    global _pending
    check_restore(restore)
    check_seconds("timeout_s", timeout_s)
    if not isinstance(root, (str, os.PathLike)):
        raise ValueError(f"root must be a path or URL, not {type(root).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ValueError(f"storage_options must be a dict (or None), not {type(storage_options).__name__}")
    if transfer is not None and not isinstance(transfer, Transfer):
        raise ValueError(f"transfer must be a ckpt.Transfer (or None), not {type(transfer).__name__}")
    key = SigningKey.resolve(signing_key)
    try:
        world = world_size()
    except ValueError:  # WORLD_SIZE unreadable: said where the job uses it
        world = 1
    try:  # as the options are now: changed later, they are other options (not taken over)
        options = copy.deepcopy(storage_options)
    except Exception as e:  # options that cannot be copied: no prepare, the Checkpointer does it all
        log.debug("no prepare of %s: its storage options cannot be copied (%s)", redact(os.fspath(root)), type(e).__name__)
        with _lock:
            _pending = None
        return
    early = Early(store_config(root, options, transfer, timeout_s), restore, key, world, _rank(world) == 0 and restore != "none")
    with _lock:
        _pending = early
    threading.Thread(target=_run, args=(early,), name="ckpt-prepare", daemon=True).start()


def _run(early: Early) -> None:
    try:
        early.store = Store(*early.args)  # its modules imported: their loggers made
        early.store.warm()
        if early.surveys:
            early.hold_lines()
            seen = seen_now(early.store)
            got = restore_plan(early.store, early.mode, early.key, [], early.world)
            if got.first is not None and got.first.doc is not None:
                checked = checked_manifest(early.store, got.first.step, got.first.doc, early.key)
                if isinstance(checked, Manifest):  # and what each rank is told of it, pickled
                    got = dataclasses.replace(got, manifest=checked, told=parts(checked, early.world) if early.world > 1 else None)
            early.seen, early.plan = seen, got if seen is not None else None
    except Exception as e:  # the Checkpointer does it again, and says what fails
        early.release_lines()
        log.debug("prepare of %s stopped: %s", redact(early.args[0]), type(e).__name__)
        early.seen = early.plan = None
    finally:
        early.release_lines()
        early.done.set()


def take(args: tuple[str, dict[str, Any] | None, Transfer], timeout_s: float) -> Early | None:
    """The Checkpointer's: the prepare made with these store arguments (waited for, at most
    `timeout_s`: its work is what the Checkpointer would do now), None if there is none, it
    could not make the store, or it is still at work. Taken once."""
    global _pending
    with _lock:
        early, _pending = _pending, None
    if early is None:
        return None
    if early.args != args:  # a mistake of the script's, said before the console is set up: a warning, once
        if _rank(early.world) == 0:
            log.warning("ckpt.prepare was for %s with other store settings than this Checkpointer's (%s): not used", redact(early.args[0]), redact(args[0]))
        return None
    if not early.done.wait(timeout_s):
        log.warning("ckpt.prepare of %s still runs after %.0f s: the Checkpointer goes on without it", redact(args[0]), timeout_s)
        return None
    return early if early.store is not None else None
