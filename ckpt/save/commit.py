"""The commit protocol of one checkpoint, from staged state; runs on every rank, in the background.

`persist`: rank 0 claims a fresh step directory; every rank writes its files, durable before
it reports them; rank 0 checks every rank's report, writes `.metadata` (a layout saved again;
DCP's own save wrote it already) and `manifest.json` last, which is the commit. Anything that
stops before the manifest leaves an incomplete directory that restore never picks.

A save is one `Save` (what is saved, where, by which ranks) and this rank's `Source` (its
staged state and what writes it). Where the files go and who writes the manifest is the
save's `Upload` (`ckpt.save.upload`): straight to the root, rank 0 committing, or through the
node spool to its agent, the manifest only drafted by rank 0 and written by whoever makes the
last rank durable in the root (`ckpt.node.durable`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner

from ckpt._faults import fault_point
from ckpt._version import __version__
from ckpt.collectives import Group, TooLong
from ckpt.errors import CheckpointError, DiskFull, LeaseHeld, SaveFailed
from ckpt.format.dcp_index import SHARED_INDEX
from ckpt.format.manifest import METADATA_NAME, FileEntry, Manifest, SaveCosts
from ckpt.save.arena import Arena
from ckpt.save.dcp_write import Planner, Sink, Writer
from ckpt.save.resave import Layout, Placed, Resaver
from ckpt.storage.store import Store, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey
    from ckpt.save.copier import Copier

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Save:
    """One checkpoint being saved, the same on every rank but for `group.rank`."""

    step: int
    store: Store  # the root
    group: Group  # the ranks that save together (the writers' group)
    counters: dict[str, Any] = dataclasses.field(default_factory=dict)  # the step and the user's counters
    user: dict[str, Any] = dataclasses.field(default_factory=dict)  # the Checkpointer's `metadata`
    schedule: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the interval policy decided last
    blocking_s: float = 0.0  # what the loop spent on it
    started: float = dataclasses.field(default_factory=time.perf_counter)  # when it began (time.perf_counter)
    key: SigningKey | None = None  # rank 0 signs the manifest (a draft handed off is committed as signed)
    # Rank 0's check of the root's lease: raises when this job may not write there any more.
    # Called before the step directory is claimed and again just before the commit.
    guard: Callable[[], None] | None = None
    after: float = 0.0  # the root's newest commit this job knows of: the commit is dated after it

    @property
    def rel(self) -> str:
        return step_dir_name(self.step)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def began(self) -> float:
        """When it began, by the wall clock."""
        return time.time() - (time.perf_counter() - self.started)


@dataclasses.dataclass(frozen=True)
class Source:
    """This rank's part of a save: its state and what writes it."""

    state: Any  # staged in host buffers, or the live state (streamed)
    sinks: Callable[[Store], Sink]  # what writes files into a store
    resaver: Resaver  # the layout of the last save DCP planned, kept between saves
    arenas: list[Arena] = dataclasses.field(default_factory=list)  # where the staged tensors lie
    # The last save's layout when `state` fits it (`Resaver.fitting`): the file is written
    # from it again, without DCP's planning, unless another rank's state changed shape.
    layout: Layout | None = None
    copier: Copier | None = None  # the staging copies still being made; a copy that fails fails the write
    # Why this rank cannot write (its staging copy failed): every rank learns at the first
    # collective that the save failed, none waits for this one until `timeout_s`.
    unready: str | None = None
    need: int = 0  # bytes staged: the room this save asks of a node spool


#: A rank's report to rank 0: (step, layout generation, {name: entry} of its files, placed
#: objects) or why it failed. A plain tuple: it travels in `Group.gather_short`'s few bytes.
Report = tuple[int, int, dict[str, FileEntry], Placed] | str


@dataclasses.dataclass(frozen=True)
class Written:
    """What this rank wrote: its `report`, the layout written again (None: DCP planned the save
    and wrote `.metadata` itself) and `where` (the target, or the root where a spool filled)."""

    report: Report
    layout: Layout | None
    where: Store

    def names(self, rank: int) -> list[str]:
        """This rank's files in the step directory (rank 0's `.metadata` and `.index` included)."""
        mine = list(self.report[2]) if not isinstance(self.report, str) else []
        extra = (METADATA_NAME, SHARED_INDEX) if self.layout is not None and self.layout.index is not None else (METADATA_NAME,)
        return mine + [n for n in extra if rank == 0 and n not in mine]


class Upload(Protocol):
    """Where a save's files go and who commits it (`ckpt.save.upload`: `Direct`, `ViaAgent`).
    One per save, of the same kind on every rank; `persist` calls its methods in this order."""

    def claim(self, save: Save) -> str | None:
        """Rank 0, before any rank writes: the step directory is this save's (why not, else None)."""

    def write(self, save: Save, source: Source, layout: Layout | None) -> Written:
        """Every rank: its files, durable (`write_files`) where this upload puts them."""

    def commit(self, save: Save, written: Written, everyone: list[Report]) -> Any:
        """Rank 0, with every rank's report: check them (`draft`) and commit, or only draft;
        returns what every rank is told."""

    def finish(self, save: Save, told: Any, written: Written) -> Manifest:
        """Every rank, told rank 0's commit: the manifest committed, or handed off for the
        commit (rank 0's whole; on the other ranks it may list their own files alone)."""

    def abandon(self, save: Save, written: Written) -> None:
        """Every rank, once all know the save failed: what it left behind goes."""

    def close(self, save: Save) -> None:
        """Every rank, however the save ended: it writes no more into the step directory."""


def persist(save: Save, source: Source, upload: Upload) -> Manifest:
    """Write and commit one checkpoint; the manifest, on every rank (committed, or handed off
    for the commit). A failure raises on every rank alike."""
    layout = _go_ahead(save, source, upload)  # rank 0 claims the step directory; all agree to go on
    try:
        written = upload.write(save, source, layout)  # every rank's files, durable
        # IMPORTANT: rank 0 commits (the manifest, last) only with every rank's report.
        told = _decided(save, written, functools.partial(_commit, save, upload, written))
        if isinstance(told, str):
            source.resaver.layout = None  # the next save is planned afresh, on every rank
            upload.abandon(save, written)
            raise SaveFailed(told)
        manifest = upload.finish(save, told, written)
        fault_point("after_manifest", save.rank, save.step)
        return manifest
    finally:
        upload.close(save)


def _go_ahead(save: Save, source: Source, upload: Upload) -> Layout | None:
    """Rank 0 claims the step directory; every rank learns whether all can go on, and whether
    any must plan afresh. The layout every rank writes again, or None: DCP plans the save."""
    refusal = None
    if save.rank == 0:
        try:
            if save.guard is not None:
                save.guard()  # IMPORTANT: a job that lost the root writes nothing more there
            refusal = upload.claim(save)
        except CheckpointError as e:  # told to every rank below, not left to hang them
            refusal = f"{type(e).__name__}: {e}" if isinstance(e, LeaseHeld) or not str(e) else str(e)
    # Every rank takes the same path: DCP's planned save if any rank's state changed shape.
    layout = source.layout if source.unready is None else None
    # One all-reduce of one number tells every rank whether a rank could not stage its state
    # (4), whether rank 0 refused (2; why follows only then) and whether any rank must plan
    # afresh (1). gloo reduces one element in a third of the CPU that it takes for three.
    agreed = save.group.bits(4 * int(source.unready is not None) + 2 * int(refusal is not None) + int(layout is None))
    # IMPORTANT: rank 0's refusal is said even when a rank could not stage: a lost lease must
    # stop the job at this save, whatever else failed (`Checkpointer.wait`).
    why = [save.group.broadcast(refusal)] if agreed & 2 else []
    if agreed & 4:
        why.insert(0, source.unready or "another rank could not stage its state")
    if why:
        raise SaveFailed(f"save of step {save.step} to {save.store.display} failed: {'; '.join(why)}")
    return None if agreed & 1 else layout


def _decided(save: Save, written: Written, commit: Callable[[list[Report]], Any]) -> Any:
    """Rank 0 gets every rank's report and commits (`commit`); every rank learns the outcome."""
    group = save.group
    everyone = group.gather_short(written.report) or []
    if group.rank != 0:
        fault_point("before_manifest", group.rank, save.step)
    long = [m.n for m in everyone if isinstance(m, TooLong)]
    mine = commit(everyone) if group.rank == 0 and not long else None
    told = group.broadcast((TooLong(max(long)) if long else _told(mine)) if group.rank == 0 else None)
    if isinstance(told, TooLong):  # a rank's report did not fit gather_short: all send theirs again
        group.fit(told.n)
        everyone = group.gather(written.report) or []  # IMPORTANT: on every rank
        mine = commit(everyone) if group.rank == 0 else None
        told = group.broadcast(_told(mine) if group.rank == 0 else None)
    return mine if group.rank == 0 else told


def _told(committed: Any) -> Any:
    """What the other ranks are told of rank 0's commit: a manifest without the ranks' files,
    only those written for all (`.metadata`, `.index`); each rank knows its own (`Upload.finish`).
    The list of every rank's files and their blocks' checksums is tens of MB at 10,000 ranks,
    which each rank would receive and unpickle at every save; rank 0 keeps it."""
    if isinstance(committed, tuple):  # a draft handed off, and what goes with it
        return tuple(_told(x) for x in committed)
    if isinstance(committed, Manifest):
        return committed.narrowed({n: e for n, e in committed.files.items() if e.rank < 0})
    return committed


def _commit(save: Save, upload: Upload, written: Written, everyone: list[Report]) -> Any:
    """Rank 0: the upload's commit, or why the save failed."""
    try:
        return upload.commit(save, written, everyone)
    except Exception as e:  # reported to every rank, not left to hang them
        return f"commit of {save.rel} failed: {type(e).__name__}: {e}"


def draft(save: Save, written: Written, everyone: list[Report]) -> Manifest:
    """Rank 0: check what every rank wrote (`everyone`), write `.metadata` of a layout saved
    again, and make the manifest, signed with the save's key."""
    failed = [m for m in everyone if isinstance(m, str)]
    if failed:
        raise SaveFailed("; ".join(failed))
    steps = {m[0] for m in everyone}
    if steps != {save.step}:  # IMPORTANT: never commit files that another step's save wrote
        raise SaveFailed(f"ranks disagree on the step being saved: {sorted(steps)}")
    if len({m[1] for m in everyone}) != 1:  # IMPORTANT: one layout, or .metadata lies
        raise SaveFailed("ranks laid out their files from different saves; the next save is planned afresh")
    files: dict[str, FileEntry] = {k: v for m in everyone for k, v in m[2].items()}
    if written.layout is not None:
        files.update(written.layout.write_metadata(written.where, save.rel, [m[3] for m in everyone]))
    fault_point("before_manifest", 0, save.step)
    manifest = Manifest(
        step=save.step,
        world_size=save.group.world,
        created=_dated_after(save.after, save.rel),
        files=files,
        costs=SaveCosts(save.blocking_s, time.perf_counter() - save.started, sum(f.size for f in files.values())),
        counters=save.counters,
        versions=versions(),
        user=save.user,
        schedule=dict(save.schedule),
    )
    return save.key.sign(manifest) if save.key is not None else manifest  # only the signature travels: never the key


def _dated_after(after: float, rel: str) -> float:
    """The commit's time: now, or just after `after` on a host whose clock is behind the
    root's newest commit. IMPORTANT: a restore picks the newest commit, so a run that went
    on from an older step must date its commits after the ones it abandoned."""
    now = time.time()
    if now > after:
        return now
    if after - now > 1.0:
        # Said once: every commit would repeat it until the clock has caught up.
        (log.debug if _said_behind.is_set() else log.warning)(
            "%s: this host's clock is %.0f s behind the newest commit of the root; the commit is dated after that one "
            "(and the next ones after theirs, said no more)", rel, after - now,
        )  # fmt: skip
        _said_behind.set()
    return after + 1e-3


_said_behind = threading.Event()


def write_files(save: Save, source: Source, layout: Layout | None, target: Store) -> Written:
    """This rank's data file, durable in `target` (the root, or the node spool); rank 0's
    `.metadata` too when DCP plans the save (`layout` None: on every rank alike). A spool that
    fills up while a layout is written again gives way to the root."""
    if layout is None:
        # DCP's own save: its ranks fail together, so a spool that fills fails this save
        # (and the next save goes to the root: `Handoff.spool_filled`).
        # Local roots: directories are made as files are written.
        ready = source.copier.ready if source.copier is not None else None
        writer = Writer(target, save.rel, save.step, source.sinks(target), source.arenas, ready, indexed=save.group.world > 1)
        # The state's layout does not change between saves: rank 0's global planning is paid once.
        planner = Planner(enable_plan_caching=True)
        planner._cached_plans_key = save.group.plan_key  # DCP keys its cache by class: one per Checkpointer
        source.resaver.layout = None  # learnt again once DCP's save has succeeded
        dcp.save(source.state, storage_writer=writer, planner=planner, process_group=save.group.pg)
        source.resaver.learn(writer, planner.mappings, source.state)
        return Written((save.step, source.resaver.generation, writer.files, {}), None, target)
    # The spool had room when the save chose it: if it fills meanwhile (the partial file is
    # gone then), the root takes this rank's file, and the commit counts it there as it counts
    # a rank without a spool. (Retried outside the handler: a failure at the root is its own,
    # not one "during handling" of the spool's.)
    copier, why = source.copier, None
    tries = [target] if target.url == save.store.url else [target, save.store]
    for where in tries:
        try:
            gate = functools.partial(copier.gate_fd, layout) if copier is not None else None
            if copier is not None and layout.objects_hold_tensors:
                copier.ready()  # IMPORTANT: the objects are pickled before the file is written
            entry, placed = layout.write(source.sinks(where), save.rel, source.state, source.arenas, save.rank, save.step, gate)
            files = {layout.name: entry, **layout.write_index(where, save.rel, placed, save.rank)}
            return Written((save.step, layout.generation, files, placed), layout, where)
        except DiskFull as e:
            why = e
        except Exception as e:  # reported to rank 0, not left to hang the others
            # A copy that failed fails the write: its own error says more than the writer's.
            why = (copier.failure() if copier is not None else None) or e
            break
        if where is not tries[-1]:
            log.warning("rank %d: the node spool ran out of space writing step %d (%s); writing to %s directly", save.rank, save.step, why, save.store.display)
    log.warning("rank %d: writing step %d failed: %s", save.rank, save.step, why)
    return Written(f"rank {save.rank}: {type(why).__name__}: {why}", layout, target)


def claim_step_dir(store: Store, step: int) -> str | None:
    """Rank 0: make sure step's directory is fresh. Returns why not, or None when it is.

    A leftover without a manifest is debris of a crashed save and is removed; a committed
    checkpoint at the same step is never overwritten."""
    listing = store.list_step(step)
    if listing is None:
        return None
    if listing.has_manifest:
        return f"{store.display}/{step_dir_name(step)} is already committed; not overwriting it"
    log.info("removing debris of an unfinished save at %s", step_dir_name(step))
    store.remove_step(step)
    return None


def forget_plans(key: str) -> None:
    """Drop what DCP cached for `key` (`Group.plan_key`): DCP keeps its save plans per key in
    class-level dicts and never lets go of them."""
    for cache in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
        getattr(SavePlanner, cache, {}).pop(key, None)


def versions() -> dict[str, str]:
    return {
        "ckpt": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
