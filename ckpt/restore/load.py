"""Restore on enter: the newest checkpoint that loads, into the training state of every rank.

Rank 0 surveys the root and picks the candidates (committed, newest first; incomplete and
corrupt ones passed over, saying why). On an object store the survey lists the root's top
level and looks at each step's manifest (`Store.survey(whole=False)`), where a recursive
listing costs more round trips: about 2·W keys for each checkpoint kept, one page of 1,000
after another, each parsed on rank 0 (1.4 s of its CPU for one checkpoint of 10,000 ranks).
No step's directory is listed then: the ranks find a file of the candidate missing or short as
they read it (every byte is checked against the manifest), and the restore falls back to the
one before, as it did when the listing passed the candidate over. Every rank loads the same one through ckpt's verified
reader, and all ranks learn each phase's outcome together, so none is left alone in a
collective. A checkpoint that fails to load falls back to the one before; a storage error or
a state that does not match the checkpoint (another model) stops the restore, and committed
checkpoints that cannot be trusted are never silently replaced by a fresh start.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt._gc import gc_paused
from ckpt.capture.state import CUDA_RNG, TrainingState
from ckpt.collectives import Group
from ckpt.errors import (
    CheckpointError,
    RestoreFailed,
    StorageError,
    dcp_failures,
)
from ckpt.format.manifest import MANIFEST_NAME, Manifest
from ckpt.restore.dcp_read import make_reader
from ckpt.restore.partial import metadata_of
from ckpt.restore.pick import Prepared, held_by_strays, newest_commit, restore_plan, second_look
from ckpt.restore.planner import SafeLoadPlanner
from ckpt.restore.prefetch import Prefetch
from ckpt.restore.view import checked_manifest, tell
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey
    from ckpt.node.handoff import Handoff, Tiered

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What a restore loaded: the step it resumes at, the saved counters, the manifest, and
    how many bytes this rank read for it."""

    step: int
    counters: dict[str, Any]
    manifest: Manifest
    read_bytes: int = 0
    source: str = "store"  # where most of the bytes came from: "store", or "spool" (the node agent's)
    unasked: tuple[str, ...] = ()  # values under model./extra. the checkpoint holds and this rank did not load
    received_bytes: int = 0  # of the pieces it loads, sent by the ranks that read them (`ckpt.restore.replicas`)


@gc_paused  # the restore makes many small objects: a full collection costs more than the read
def restore(
    store: Store,
    ctrl: Group,
    state: TrainingState,
    mode: str | int,
    handoff: Handoff | None = None,
    key: SigningKey | None = None,
    prepared: Prepared | None = None,
) -> tuple[Restored | None, set[int], float]:
    """Load the newest checkpoint that loads (`mode` "latest") or step `mode` into `state`
    on every rank; with `handoff`, files the node spool holds are read from there; with
    `key`, only checkpoints signed with it are trusted (the others are passed over); with
    `prepared` (rank 0's), its first pick is that survey's (`ckpt.prepare`). Returns
    what was restored (None: the root holds nothing to restore) and the steps that hold a
    manifest, which this run must never write into, and the newest commit time among them
    (`newest_commit`)."""
    problems: list[str] = []
    tried: list[int] = []
    taken: set[int] = set()
    passed: list[str] = []
    newest = 0.0
    while True:
        # Rank 0 picks the next candidate afresh after each failure: the catalog reads only
        # the manifests it needs to know the newest (catalog.restore_candidates), and the
        # pick's manifest, as it read and checked it, goes round with the pick in the same
        # collective (read again only if it did not keep it: it reads it, once, in
        # `_try_restore`, as the ranks build their templates meanwhile).
        plan: list[int] | str = []
        look: Callable[[], bool] | None = None  # rank 0's: whether `prepared` still stands
        doc: Manifest | bytes | str | None = None
        told = None  # rank 0's: the parts of `doc` made by `ckpt.prepare`
        metadata = None  # rank 0's: the pick's `.metadata`, as the catalog checked it
        error: Exception | None = None  # rank 0's, told to every rank: none is left in the broadcast
        if ctrl.rank == 0:
            try:
                # The first pick as `ckpt.prepare` made it, where it still stands: looked at again
                # while the ranks read it (at once where it found nothing to restore).
                use = prepared if prepared is not None and not tried else None
                if use is not None and not use.steps and not second_look(store, use)():
                    use = None
                got = use or restore_plan(store, mode, key, tried, ctrl.world)
                look = second_look(store, use, latest=mode == "latest") if use is not None and use.steps else None
                plan, passed = got.steps, got.passed
                taken |= got.taken
                newest = max(newest, got.created)
                if got.first is not None:
                    doc, metadata, told = got.manifest or got.first.doc, got.first.metadata, got.told
                    if not tried and mode == "latest":  # said as the pick is used (`ckpt.prepare` made it before)
                        log.info("restoring from %s/%s", store.display, got.first.dir)
            except Exception as e:
                plan, error = f"{type(e).__name__}: {e}", e
            if plan and not isinstance(plan, str) and doc is None and store.is_local:
                doc = _read_manifest(store, plan[0])
        # The manifest stays on rank 0: each rank is told its part of it (`_try_restore`).
        plan, taken, passed, newest = ctrl.broadcast((plan, taken, passed if ctrl.rank == 0 else [], newest))
        problems += passed
        if isinstance(plan, str):
            kind = plan.partition(":")[0]  # the error's type name, as rank 0 raised it
            if kind in ("StorageError", "DiskFull"):
                raise StorageError(plan) from error
            if error is None or isinstance(error, CheckpointError):
                raise RestoreFailed(plan if kind in ("NotFound", "InvalidCheckpoint", "RestoreFailed") else f"rank 0 could not pick a checkpoint: {plan}") from error
            raise error  # rank 0's own: not one of ckpt's, its traceback says where
        if not plan:
            break
        step = plan[0]
        tried.append(step)
        outcome, why, restored = _try_restore(store, ctrl, state, step, handoff, key, doc, metadata, told)
        # One collective for the outcome, whether a spool was used, whether any rank has values
        # left unloaded (only then are they gathered, to be named), and whether the pick
        # `ckpt.prepare` made went stale (then all of it again, from a survey made now).
        stale = int(look is not None and not look())
        worst, spooled, unasked, stale = ctrl.max([outcome, int(handoff is not None and handoff.local is not None), _has_unasked(restored), stale])
        if stale:
            if ctrl.rank == 0:
                log.info("%s changed since ckpt.prepare surveyed it (a checkpoint committed, removed or rewritten since): surveying it again", store.display)
            tried.pop()
            prepared = None
            # Read into the objects already, perhaps in part: never a fresh start from them.
            problems.append(f"{step_dir_name(step)}, as ckpt.prepare found it: changed while it was read")
            continue
        if worst == 1 and spooled:  # a spool's copy may be what failed: the root's decides
            log.warning("restoring %s with the node spool's copies failed (%s); reading it all from %s", step_dir_name(step), why, store.display)
            outcome, why, restored = _try_restore(store, ctrl, state, step, None, key, doc, metadata, told)
            worst, unasked = ctrl.max([outcome, _has_unasked(restored)])
        if worst == 0:
            assert restored is not None
            if unasked:
                _say_unasked(ctrl, store, restored)
            return restored, taken, newest
        if worst == 2:
            raise StorageError(f"restoring step {step} from {store.display}: {why}")
        if worst == 3:
            raise RestoreFailed(
                f"{store.display}/{step_dir_name(step)} does not hold what this job has "
                f"(another model, optimizer, tensor shapes, or objects added since it was saved): {why[:500]}. "
                "Nothing was deleted; restore=STEP restores a step that matches, restore='none' starts fresh"
            )
        problems.append(f"{step_dir_name(step)}: {why}")
        if isinstance(mode, int):  # the step asked for, or nothing
            raise RestoreFailed(
                f"{store.display}/{step_dir_name(step)} could not be restored ({why}); it is left as it is (the model may "
                "hold partly loaded values). restore='latest' restores the newest checkpoint that loads."
            )
        log.warning("could not restore %s (%s); falling back to the one before", step_dir_name(step), why)
    if tried or problems:
        raise RestoreFailed(
            f"no checkpoint under {store.display} could be restored ("
            + "; ".join(problems)
            + "). The checkpoints are left as they are (the model may hold partly loaded "
            + "values). To start fresh, pass restore='none' (the corrupt directories are kept "
            + "and their steps skipped) or use a new root."
        )
    return None, taken, newest


def start_fresh(store: Store, ctrl: Group, key: SigningKey | None = None) -> tuple[set[int], float]:
    """restore='none': train from step 0, never writing into what the root already holds.
    Returns the steps that hold a manifest, and the newest commit time among them."""
    got: tuple[set[int], float] | str = (set(), 0.0)
    error: Exception | None = None  # rank 0's, told to every rank: none is left in the broadcast
    if ctrl.rank == 0:
        try:
            store.check_reachable()
            listings, strays = store.survey(whole=False)
            taken = {s for s, lst in listings.items() if lst.has_manifest}
            got = (taken | held_by_strays(store, strays), newest_commit(store, key, listings) if taken else 0.0)
        except Exception as e:
            got, error = (str(e) if isinstance(e, CheckpointError) else f"rank 0: {type(e).__name__}: {e}"), e
    got = ctrl.broadcast(got)
    if isinstance(got, str):
        if error is not None and not isinstance(error, CheckpointError):
            raise error  # rank 0's own: not one of ckpt's, its traceback says where
        raise StorageError(got) from error
    taken, newest = got
    if taken and ctrl.rank == 0:
        log.warning(
            "restore='none' but %s holds checkpoints at steps %s: they are kept, this run skips "
            "saving at those steps, and a later restore picks the newest valid one of either run",
            store.display,
            sorted(taken),
        )
    return taken, newest


def _read_manifest(store: Store, step: int) -> bytes | str:
    """Rank 0's one read of the manifest of `step`, which goes to every rank: its bytes, or
    the error (its type's name first)."""
    try:
        return store.read_bytes(f"{step_dir_name(step)}/{MANIFEST_NAME}")
    except Exception as e:  # told to every rank: none is left in the broadcast
        return f"{type(e).__name__}: {e}"


def _try_restore(
    store: Store, ctrl: Group, state: TrainingState, step: int, handoff: Handoff | None, key: SigningKey | None,
    doc: Manifest | bytes | str | None, metadata: bytes | None = None, told: tuple[Any, list[Any]] | None = None,
) -> tuple[int, str, Restored | None]:  # fmt: skip
    """Load `step` into the objects, given its manifest `doc` as rank 0 read it (or why it
    could not; None: rank 0 reads it now; a Manifest: checked already) and on rank 0 perhaps
    its `.metadata`, checked
    against that manifest: 0 ok, 1 invalid (fall back), 2 storage error, 3 the training
    state does not match the checkpoint's (no fallback can help). Every phase ends with all
    ranks knowing its outcome, so no rank enters a collective alone."""
    rel = step_dir_name(step)
    rank = ctrl.rank
    # The rank's files are warmed (a local disk's into the page cache, an object store's first
    # GETs sent) while it builds its template, so the manifest that names them comes first.
    # Rank 0 reads and checks the manifest (as the catalog read it, or now) and tells each rank
    # its part of it (`ckpt.restore.view`), or why it cannot be restored from.
    whole = None
    if rank == 0:
        whole = doc if isinstance(doc, Manifest) else checked_manifest(store, step, doc if doc is not None else _read_manifest(store, step), key)
    got = tell(ctrl, whole, told if isinstance(doc, Manifest) and whole is doc else None)
    if isinstance(got, tuple):
        return (*got, None)
    manifest: Manifest = got
    prep: tuple[int, str] = (0, "")
    with contextlib.ExitStack() as stack:
        try:
            tiered = handoff.reader_store(rel, manifest) if handoff is not None else None
            # Stopped as the reader starts (nothing read ahead is trusted before the reader
            # verified it, as always).
            warm = stack.enter_context(Prefetch.for_restore(store, tiered, rel, manifest, rank, ctrl.world))
            sd = state.fit_template(state.template(rank), rank, ctrl.world, manifest.world_size)
        except Exception as e:  # IMPORTANT: on one rank only, still told to all (below): that step is passed over
            prep = (1, f"{type(e).__name__}: {e}")
        if failed := _agreed(ctrl, *prep, "another rank could not prepare the restore"):
            return (*failed, None)
        return _load(ctrl, state, store, rel, manifest, sd, tiered, warm.stop, metadata)


def _agreed(ctrl: Group, code: int, why: str, otherwise: str) -> tuple[int, str] | None:
    """Every rank's outcome of one phase (`code` and `why`, this rank's): None if it went well
    on all, else a code of failure and why, every failing rank's reason on rank 0 (rare: so
    that it can say what went wrong where), this rank's own (or `otherwise`) elsewhere. The
    caller agrees on the worst code anyway."""
    if not ctrl.max([code])[0]:
        return None
    whys = ctrl.gather((code, why)) or [(code, why)]  # rank 0 gets all; the others their own
    text = "; ".join(f"rank {r}: {w}" if len(whys) > 1 else w for r, (c, w) in enumerate(whys) if c)
    return max(max(c for c, _ in whys), 1), text or otherwise


def _load(
    ctrl: Group, state: TrainingState, store: Store, rel: str, manifest: Manifest, sd: dict[str, Any],
    tiered: Tiered | None, before_read: Callable[[], None], metadata: bytes | None = None,
) -> tuple[int, str, Restored | None]:  # fmt: skip
    """The second half of `_try_restore`: read the step into `sd` and apply it."""
    rank = ctrl.rank
    # Each rank plans and reads its part alone (DCP's default load planning has no global
    # step: its collectives would only carry the plans around and wait); the ranks then
    # agree on the outcome before anything is applied, as applying may take collectives.
    metadata, received, parts = metadata_of(ctrl, store, rel, manifest, sd, metadata, spool=tiered)
    reader = make_reader(tiered or store, rel, manifest, before_read, metadata, received, ctrl, parts)  # type: ignore[arg-type]
    planner = SafeLoadPlanner(state.optional())
    loaded = _outcome(lambda: dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True))
    shared = _outcome(lambda: reader.share(planner, sd, ok=not loaded[0]))  # every rank, loaded or not
    loaded = loaded if loaded[0] or shared[0] == 0 else shared
    if failed := _agreed(ctrl, *loaded[:2], "another rank could not load its part"):
        return (*failed, None)
    applied = _outcome(lambda: state.apply(sd, rank, stateless=planner.stateless))
    if failed := _agreed(ctrl, *applied[:2], "another rank could not apply what it read"):
        return (*failed, None)
    _say_old_cuda_rng(planner, rank)
    if rank == 0 and (kept := planner.not_in_checkpoint("model.")):
        # Expected with frozen="skip"; otherwise the checkpoint is a "skip" job's or an earlier ckpt's.
        log.log(
            logging.INFO if state.skip_frozen else logging.WARNING,
            "this checkpoint holds no value for %d frozen parameter(s) (%s%s): they keep the values they have",
            len(kept), _few(kept), "" if state.skip_frozen else "; saved with frozen='skip' or by an earlier ckpt",
        )  # fmt: skip
    counters = cast(dict, applied[2])
    source = tiered.source if tiered else "store"
    restored = Restored(int(counters.pop("step")), counters, manifest, reader.read_bytes, source, tuple(planner.unasked(("model.", "extra."))), reader.received_bytes)
    if tiered is not None:
        log.info("rank %d read %.1f MB of %s from the node spool and %.1f MB from %s", rank, tiered.bytes["spool"] / 1e6, rel, tiered.bytes["store"] / 1e6, store.display)
    if rank == 0 and manifest.world_size != ctrl.world:
        log.warning(
            "resuming step %d on %d ranks (saved on %d): model and optimizer resharded%s",
            restored.step,
            ctrl.world,
            manifest.world_size,
            ""
            if state.loader is None
            else "; the data loader's per-rank state is dropped and the global data position rules"
            if state.data is not None
            else "; THE DATA POSITION IS LOST: the data loader's per-rank state cannot apply to "
            "another world size and it has no ckpt.ElasticSampler; its data starts over",
        )
    return 0, "", restored


def _few(keys: list[str]) -> str:
    """The first five model keys, without "model.", for a log line."""
    return catalog.first_few([k.removeprefix("model.") for k in keys], ", ", 5)


def _say_old_cuda_rng(planner: SafeLoadPlanner, rank: int) -> None:
    """A checkpoint of an earlier ckpt holds a rank's CUDA streams by device index, which
    another node may number otherwise: none of them is loaded, and the user is told."""
    stored = planner.metadata.state_dict_metadata if planner.metadata is not None else {}
    mine = f"rng.rank_{rank}."
    if f"{mine}{CUDA_RNG}" in planner.state_dict and f"{mine}{CUDA_RNG}" not in stored and any(k.startswith(f"{mine}cuda.") for k in stored):
        log.warning(
            "rank %d: this checkpoint holds its CUDA RNG streams by device index (saved by an earlier ckpt): "
            "they are not restored, and the current device's stream goes on from where it is", rank,
        )


def _has_unasked(restored: Restored | None) -> int:
    return int(restored is not None and bool(restored.unasked))


def _say_unasked(ctrl: Group, store: Store, restored: Restored) -> None:
    """Warn of the values under model. and extra. that the checkpoint holds and no rank loaded
    (a rank's own keys, extra.stream.rank_1, are another rank's to load)."""
    every = ctrl.gather(restored.unasked)
    if every is not None and (left := sorted(set.intersection(*map(set, every)))):
        log.warning(
            "%s/%s holds values that this job's objects do not ask for, left unrestored: %s (an object that "
            "builds its state lazily must list it in its state_dict() before the Checkpointer is entered)",
            store.display, step_dir_name(restored.step), catalog.first_few(left, ", "),
        )  # fmt: skip


def _outcome(load: Callable[[], Any]) -> tuple[int, str, Any]:
    """Run one phase of a restore: (0, "", its result), or the code and reason of its failure
    as `_try_restore` returns them."""
    try:
        return 0, "", load()
    except StorageError as e:
        return 2, str(e), None
    except CheckpointException as e:
        causes = dcp_failures(e)
        # Each rank loads alone (no_dist): DCP calls every one of them rank 0, so its own
        # "rank N:" would mislead; the caller names the rank.
        text = "; ".join(str(c) for c in causes)
        if any(isinstance(c, StorageError) for c in causes):
            return 2, text, None
        # The checkpoint is verified: a key it lacks or a shape it disagrees on is this job's
        # state that changed (another model), which no older checkpoint is likely to mend;
        # falling back would resume an older step and let retention delete the newer ones.
        if "Missing key in checkpoint" in text or "Size mismatch between saved" in text:
            return 3, text, None
        return 1, text, None
    except Exception as e:  # on this rank alone, maybe: told to all, none left in a collective
        return 1, f"{type(e).__name__}: {e}", None
