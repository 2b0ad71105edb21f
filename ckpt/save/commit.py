"""Persist and commit one checkpoint from staged state; runs on every rank, in the background.

The protocol: rank 0 claims a fresh step directory; every rank writes its DCP files (durable
before `dcp.save` returns) and rank 0 writes `.metadata`; rank 0 gathers every rank's file
sizes and checksums and writes `manifest.json` last, which is the commit. Anything that stops
before the manifest leaves an incomplete directory that restore never picks.

With a node agent (`ckpt.node.handoff`), the files go to the node spool instead and rank 0 only
drafts the manifest: each rank hands its files off with the draft, and the manifest is
written by whoever makes the last rank durable in the root (`ckpt.node.spool`).
"""

from __future__ import annotations

import functools
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from ckpt._faults import fault_point
from ckpt._version import __version__
from ckpt.collectives import Group, TooLong
from ckpt.errors import CheckpointError, DiskFull, LeaseHeld, SaveFailed, dcp_failures
from ckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest, SaveCosts
from ckpt.node.spool import claim
from ckpt.save.arena import Arena
from ckpt.save.dcp_write import Sink, Writer
from ckpt.save.resave import Layout, Resaver
from ckpt.storage.store import Store, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey
    from ckpt.node.handoff import Handoff
    from ckpt.save.copier import Copier

log = logging.getLogger(__name__)


def forget_plans(key: str) -> None:
    """Drop what DCP cached for `key` (`Group.plan_key`): DCP keeps its save plans per key in
    class-level dicts and never lets go of them."""
    for cache in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
        getattr(SavePlanner, cache, {}).pop(key, None)


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


def persist(
    store: Store,
    group: Group,
    step: int,
    staged: dict[str, Any],
    *,
    sinks: Callable[[Store], Sink],
    arenas: list[Arena],
    resaver: Resaver,
    counters: dict[str, Any],
    user: dict[str, Any],
    schedule: dict[str, Any] | None = None,
    blocking_s: float,
    started: float,
    handoff: Handoff | None = None,
    need: int = 0,
    key: SigningKey | None = None,
    guard: Callable[[], None] | None = None,
    after: float = 0.0,
    unready: str | None = None,
    copier: Copier | None = None,
) -> Manifest:
    """Write and commit `staged` as step `step` (`sinks` writes files to a store). Returns
    the manifest on every rank: committed, or with `handoff` handed off for the commit.
    With `key`, rank 0 signs the manifest (a draft handed off is committed as signed).
    `guard` (rank 0's, the root lease's check) raises when this job may not write there any
    more: called before the step directory is claimed and again just before the commit.
    The commit is dated after `after` (the root's newest commit this job knows of).
    `unready`: why this rank cannot write (its staging copy failed); every rank learns at
    the first collective that the save failed, none waits for this one until `timeout_s`.
    `copier`: the staging copies still being made; a copy that fails fails the write."""
    rel = step_dir_name(step)
    began = time.time() - (time.perf_counter() - started)
    refusal, save_id = None, f"{secrets.randbits(63):016x}" if group.rank == 0 else ""
    # Every rank takes the same path: DCP's planned save if any rank's state changed shape.
    layout = resaver.layout if unready is None and resaver.can_resave(staged) else None
    if group.rank == 0:
        try:
            if guard is not None:
                guard()  # IMPORTANT: a job that lost the root writes nothing more there
            refusal = claim_step_dir(store, step)
            if refusal is None and handoff is not None:
                claim(store, rel, save_id)  # an agent holding an older save of this step leaves it be
        except CheckpointError as e:  # told to every rank below, not left to hang them
            refusal = f"{type(e).__name__}: {e}" if isinstance(e, LeaseHeld) or not str(e) else str(e)
    # One all-reduce of one number tells every rank whether a rank could not stage its state
    # (4), whether rank 0 refused (2; why follows only then) and whether any rank must plan
    # afresh (1). gloo reduces one element in a third of the CPU that it takes for three.
    agreed = group.bits(4 * int(unready is not None) + 2 * int(refusal is not None) + int(layout is None))
    # IMPORTANT: rank 0's refusal is said even when a rank could not stage: a lost lease must
    # stop the job at this save, whatever else failed (`Checkpointer.wait`).
    why = [group.broadcast(refusal)] if agreed & 2 else []
    if agreed & 4:
        why.insert(0, unready or "another rank could not stage its state")
    if why:
        raise SaveFailed(f"save of step {step} to {store.display} failed: {'; '.join(why)}")
    replan = bool(agreed & 1)
    chosen = handoff.target(need) if handoff is not None else store
    if handoff is not None:
        handoff.writing(chosen, rel)
    try:
        try:
            mine, layout, target = _write_data(
                chosen, group, rel, step, staged, sinks, arenas, resaver, None if replan else layout, store, copier
            )
        except CheckpointException as e:  # DCP's save, which its ranks fail together
            if handoff is not None and chosen is not store and isinstance(_own_failure(e, group.rank), DiskFull):
                handoff.spool_filled()  # so that the next save does not fail the same way
            if group.rank == 0 and handoff is None:
                _clear_failed(store, step, guard)
            raise
        if handoff is not None and target is not chosen:
            handoff.spool_filled()
        everyone = group.gather_short(mine) or []
        if group.rank != 0:
            fault_point("before_manifest", group.rank, step)

        tried: list[bool] = []  # rank 0 sent the manifest: it may have landed though it failed

        def commit(everyone: list[Any]) -> Manifest | str:  # rank 0's
            return _commit(
                store, target, group, rel, step, everyone, layout, counters=counters, user=user, schedule=schedule,
                blocking_s=blocking_s, started=started, handoff=handoff, key=key, guard=guard, tried=tried, after=after,
            )  # fmt: skip

        long = [m.n for m in everyone if isinstance(m, TooLong)]
        # Rank 0's save id travels with the outcome: the other ranks need it only to hand off.
        outcome, save_id = group.broadcast(((TooLong(max(long)) if long else commit(everyone)), save_id) if group.rank == 0 else None)
        if isinstance(outcome, TooLong):  # a rank's files did not fit gather_short: all send them again
            group.fit(outcome.n)
            everyone = group.gather(mine) or []  # IMPORTANT: on every rank
            outcome = group.broadcast(commit(everyone) if group.rank == 0 else None)
        if not isinstance(outcome, Manifest):
            resaver.layout = None  # the next save is planned afresh, on every rank
            if handoff is not None and not isinstance(mine, str):
                handoff.discard(target, rel, [*mine[2], *([METADATA_NAME] if group.rank == 0 else [])])
            if group.rank == 0 and handoff is None and not tried:  # else the next claim of the step decides
                _clear_failed(store, step, guard)
            raise SaveFailed(str(outcome))
        if handoff is not None:
            _hand_off(handoff, target, group, rel, save_id, outcome, mine, began)
            handoff.wrote(outcome)
        fault_point("after_manifest", group.rank, step)
        return outcome
    finally:
        if handoff is not None:
            handoff.done_writing(rel)  # written into the spool and handed off, or failed


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


def _commit(
    store: Store,
    target: Store,
    group: Group,
    rel: str,
    step: int,
    everyone: list[Any],
    layout: Layout | None,
    *,
    counters: dict[str, Any],
    user: dict[str, Any],
    schedule: dict[str, Any] | None,
    blocking_s: float,
    started: float,
    handoff: Handoff | None,
    key: SigningKey | None,
    guard: Callable[[], None] | None,
    tried: list[bool],
    after: float,
) -> Manifest | str:
    """Rank 0: check what every rank wrote (`everyone`), write `.metadata` and the manifest
    (the commit; with `handoff`, only draft it). The manifest, or why the save failed."""
    try:
        failed = [m for m in everyone if isinstance(m, str)]
        if failed:
            raise SaveFailed("; ".join(failed))
        steps = {m[0] for m in everyone}
        if steps != {step}:  # IMPORTANT: never commit files that another step's save wrote
            raise SaveFailed(f"ranks disagree on the step being saved: {sorted(steps)}")
        if len({m[1] for m in everyone}) != 1:  # IMPORTANT: one layout, or .metadata lies
            raise SaveFailed("ranks laid out their files from different saves; the next save is planned afresh")
        files: dict[str, FileEntry] = {k: v for m in everyone for k, v in m[2].items()}
        if layout is not None:
            files[METADATA_NAME] = layout.write_metadata(target, rel, [m[3] for m in everyone])
        fault_point("before_manifest", 0, step)
        manifest = Manifest(
            step=step,
            world_size=group.world,
            created=_dated_after(after, rel),
            files=files,
            costs=SaveCosts(blocking_s, time.perf_counter() - started, sum(f.size for f in files.values())),
            counters=counters,
            versions=versions(),
            user=user,
            schedule=dict(schedule or {}),
        )
        if key is not None:
            manifest = key.sign(manifest)  # only the signature travels: never the key
        if handoff is None:
            if guard is not None:
                guard()  # another job may have taken the root while the files were written
            # IMPORTANT: the commit. Written last, after every rank's files are durable.
            tried.append(True)
            store.put_atomic(f"{rel}/{MANIFEST_NAME}", manifest.to_json())
        return manifest
    except Exception as e:  # reported to every rank, not left to hang them
        if isinstance(e, DiskFull) and handoff is not None and target is not store:
            handoff.spool_filled()  # `.metadata` found no room there: the next save goes to the root
        return f"commit of {rel} failed: {type(e).__name__}: {e}"


def _clear_failed(store: Store, step: int, guard: Callable[[], None] | None) -> None:
    """Rank 0, once every rank knows that the save of `step` failed: the files the other
    ranks wrote go. On a disk that filled they would keep every later save from committing,
    and nothing but a later commit's retention would ever delete them. A directory with a
    manifest (a commit whose last step failed) is left, and so is a root this job no longer
    holds: another job may be writing there now."""
    try:
        if guard is not None:
            guard()
        claim_step_dir(store, step)  # removes it unless it holds a manifest
    except Exception as e:  # a clean-up: the save's own failure is what is raised
        log.warning("the files of the failed save of %s stay in %s: %s", step_dir_name(step), store.display, e)


def _hand_off(handoff: Handoff, target: Store, group: Group, rel: str, save_id: str, manifest: Manifest, mine: Any, began: float) -> None:
    """Every rank hands its files off (or marks them durable in the root); all learn whether
    every rank could."""
    files = list(mine[2]) + ([METADATA_NAME] if group.rank == 0 and METADATA_NAME not in mine[2] else [])
    why = ""
    try:
        handoff.submit(target, rel, save_id, manifest, files, group.world, began)
    except Exception as e:  # reported to every rank below, not left to hang them
        why = f"rank {group.rank}: {type(e).__name__}: {e}"
        log.warning("handing off %s failed: %s", rel, why)
    fault_point("after_handoff", group.rank, manifest.step)
    if group.any(bool(why)):
        handoff.cancel(save_id)  # it can never commit: nobody waits for it
        raise SaveFailed(f"hand-off of {rel} failed: {why or 'on another rank'}")


def _write_data(
    store: Store,
    group: Group,
    rel: str,
    step: int,
    staged: dict[str, Any],
    sinks: Callable[[Store], Sink],
    arenas: list[Arena],
    resaver: Resaver,
    layout: Layout | None,
    root: Store,
    copier: Copier | None = None,
) -> tuple[Any, Layout | None, Store]:
    """Every rank's data file, durable in `store` (the root, or the node spool); rank 0's
    `.metadata` too when DCP plans the save (`layout` None: on every rank alike). Returns
    what to tell rank 0 ((step, layout generation, files, placed objects), or why this rank
    failed), the layout reused, and where the file went: a spool that fills up during the
    write gives way to `root`."""
    if layout is None:
        # DCP's own save: its ranks fail together, so a spool that fills fails this save
        # (and the next save goes to the root: `Handoff.spool_filled`).
        # Local roots: directories are made as files are written.
        writer = Writer(store, rel, step, sinks(store), arenas, copier.ready if copier is not None else None)
        # The state's layout does not change between saves: rank 0's global planning is paid once.
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = group.plan_key  # DCP keys its cache by class: one per Checkpointer
        resaver.layout = None  # learnt again once DCP's save has succeeded
        dcp.save(staged, storage_writer=writer, planner=planner, process_group=group.pg)
        resaver.learn(writer, planner.mappings, staged)
        mine: Any = (step, resaver.generation, writer.files, {})
    else:
        # The spool had room when the save chose it: if it fills meanwhile (the partial file
        # is gone then), the root takes this rank's file, and the commit counts it there as
        # it counts a rank without a spool. (Retried outside the handler: a failure at the
        # root is its own, not one "during handling" of the spool's.)
        mine, why = None, None
        tries = [store] if store.url == root.url else [store, root]
        for where in tries:
            try:
                gate = functools.partial(copier.gate_fd, layout) if copier is not None else None
                if copier is not None and layout.objects_hold_tensors:
                    copier.ready()  # IMPORTANT: the objects are pickled before the file is written
                entry, placed = layout.write(sinks(where), rel, staged, arenas, group.rank, step, gate)
                mine, store = (step, layout.generation, {layout.name: entry}, placed), where
                break
            except DiskFull as e:
                why = e
            except Exception as e:  # reported to rank 0 below, not left to hang the others
                # A copy that failed fails the write: its own error says more than the writer's.
                why = (copier.failure() if copier is not None else None) or e
                break
            if where is not tries[-1]:
                log.warning("rank %d: the node spool ran out of space writing step %d (%s); writing to %s directly", group.rank, step, why, root.display)
        if mine is None:
            log.warning("rank %d: writing step %d failed: %s", group.rank, step, why)
            mine = f"rank {group.rank}: {type(why).__name__}: {why}"
    return mine, layout, store


def _own_failure(e: BaseException, rank: int) -> BaseException | None:
    """This rank's error in DCP's `CheckpointException` (which holds every failed rank's)."""
    failures = getattr(e, "failures", {})
    return dict(zip(failures, dcp_failures(e), strict=True)).get(rank) if isinstance(failures, dict) else None


def versions() -> dict[str, str]:
    return {
        "ckpt": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
