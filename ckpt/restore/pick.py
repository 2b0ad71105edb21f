"""Rank 0's pick of the checkpoint to restore: its survey of the root (`restore_plan`), and
the second look that tells whether a survey made earlier (`ckpt.prepare`) still stands.

The survey lists the root's top level and looks at each step's manifest
(`Store.survey(whole=False)`), where a recursive listing costs more round trips: about 2·W
keys for each checkpoint kept, one page of 1,000 after another, each parsed on rank 0 (1.4 s
of its CPU for one checkpoint of 10,000 ranks). No step's directory is listed then: the ranks
find a file of the candidate missing or short as they read it.

A survey made before the job entered its Checkpointer may be stale by then: a node agent
finishing the last save of a job that died, or a writer that keeps no lease, may have
committed a newer checkpoint since. So rank 0 looks at the root again (`second_look`: the same
listing and HEADs, and the pick's manifest read) as the ranks begin to read the pick, and
where a checkpoint was committed since or the pick's manifest changed, the restore starts
over with a survey made then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import RestoreFailed
from ckpt.format.manifest import MANIFEST_NAME, Manifest
from ckpt.storage import catalog
from ckpt.storage.store import StepListing, Store, Stray, step_dir_name

if TYPE_CHECKING:
    from ckpt.format.signing import SigningKey

log = logging.getLogger("ckpt.restore.load")  # its lines are the restore's


@dataclass(frozen=True)
class Prepared:
    """Rank 0's pick (`restore_plan`): the next step to try (none left: []); the steps that
    hold a manifest; falling back, the corrupt ones passed over on the way; the newest commit
    time it saw (`newest_commit`); the catalog's entry of the step to try (with the manifest
    and `.metadata` it read and checked, where it kept them); and that manifest as
    `view.checked_manifest` checked it (`ckpt.prepare`'s)."""

    steps: list[int]
    taken: set[int]
    passed: list[str]
    created: float
    first: catalog.Entry | None
    manifest: Manifest | None = None
    told: tuple[Any, list[Any]] | None = None  # its parts, as `view.tell` tells them
    listings: dict[int, StepListing] | None = None  # the root's step directories as the survey found them


def restore_plan(store: Store, mode: str | int, key: SigningKey | None, tried: list[int], world: int) -> Prepared:
    """Rank 0: the next pick (`Prepared`), after the `tried` ones failed."""
    if isinstance(mode, int):
        if tried:
            return Prepared([], set(), [], 0.0, None)
        store.check_reachable()
        listings, strays = store.survey(whole=False)  # one survey for all three
        entry = catalog.find(store, mode, key, keep=True, listings=listings, world=world)
        taken = {s for s, lst in listings.items() if lst.has_manifest} | held_by_strays(store, strays)
        return Prepared([entry.step], taken, [], newest_commit(store, key, listings), entry, listings=listings)
    if not tried:
        store.check_reachable()
    listings, strays = store.survey(whole=False)
    good, skipped = catalog.restore_candidates(store, key, exclude=set(tried), keep=True, listings=listings, world=world)
    taken = {e.step for e in good} | {e.step for e in skipped if e.state == catalog.CORRUPT} | set(tried)
    taken |= held_by_strays(store, strays, say=not tried)
    if tried:  # falling back: the corrupt ones newer than the next candidate were said before
        passed = [e for e in skipped if e.state == catalog.CORRUPT and (not good or e.step < good[0].step)]
        for e in passed:
            log.warning("passing over %s/%s: %s", store.display, e.dir, e.problem)
        if good:
            log.info("falling back to %s/%s", store.display, good[0].dir)
        return Prepared([e.step for e in good[:1]], taken, [f"{e.dir}: {e.problem}" for e in passed], _newest(good), _first(good), listings=listings)
    for e in skipped:
        log.warning("passing over %s/%s: %s", store.display, e.dir, e.problem)
    if not good and any(e.state == catalog.CORRUPT for e in skipped):
        # Checkpoints were committed but none can be trusted: never silently start over.
        raise RestoreFailed(
            f"no checkpoint under {store.display} could be restored ("
            + "; ".join(f"{e.dir}: {e.problem}" for e in skipped)
            + "). The checkpoints are left as they are (the model may hold partly loaded "
            + "values). To start fresh, pass restore='none' (the corrupt directories are kept "
            + "and their steps skipped) or use a new root."
        )
    return Prepared([e.step for e in good[:1]], taken, [], _newest(good), _first(good), listings=listings)


def held_by_strays(store: Store, strays: list[Stray], say: bool = True) -> set[int]:
    """The steps whose names something else holds (a link, a file): this run saves past them,
    never into them. Said once, with the other entries named like steps that are none."""
    for s in strays if say else ():
        log.warning("%s/%s is not a checkpoint (%s): left alone", store.display, s.name, s.what)
    return {s.step for s in strays if s.step is not None}


def _first(good: list[catalog.Entry]) -> catalog.Entry | None:
    return good[0] if good else None


def newest_commit(store: Store, key: SigningKey | None, listings: dict[int, StepListing] | None = None) -> float:
    """The newest commit time (`created`) among the root's checkpoints whose manifests check
    (with `key`, those signed with it); 0 if none. This job's commits are dated after it
    (`commit.persist`'s `after`), whatever this host's clock says: a restore picks the newest
    commit, and a run that went on from an older step must win over the one it abandoned.
    `listings`: the root's `scan()`, where the caller has one. The newest one's `.metadata` is
    not read: a date after a checkpoint that turns out unusable is as good."""
    good, _ = catalog.restore_candidates(store, key, listings=listings, check_first=False)
    return _newest(good)


def _newest(entries: list[catalog.Entry]) -> float:
    return max((e.manifest.created for e in entries if e.manifest is not None), default=0.0)


def second_look(store: Store, prepared: Prepared, latest: bool = True) -> Callable[[], bool]:
    """Rank 0: whether the root still holds what `prepared`'s survey found, looked at once on a
    thread of its own as the ranks begin to read (a commit after it is missed, as by a survey
    made cold); the call returned waits for the answer. It stands where the pick's manifest
    reads the same bytes as then, and (`latest`: the newest was asked for) no step directory
    appeared or had its manifest written since, older or newer than the pick (the newest is
    the newest commit, not the highest step); steps removed besides the pick do not matter.
    A look that fails says no: the survey is made again, and says what fails."""
    answer: list[bool] = []

    def look() -> None:
        try:
            pick = prepared.steps[0] if prepared.steps else None
            if latest:
                now, then = store.survey(whole=False)[0], prepared.listings or {}
                if any(s not in then or _stamp(then[s]) != _stamp(lst) for s, lst in now.items()) or (pick is not None and pick not in now):
                    answer.append(False)
                    return
            # Its bytes, not only their size and time: a store's times may be whole seconds.
            doc = prepared.first.doc if prepared.first is not None else None
            answer.append(pick is None or (doc is not None and store.read_bytes(f"{step_dir_name(pick)}/{MANIFEST_NAME}") == doc))
        except Exception as e:
            log.debug("the second look at %s failed: %s", store.display, type(e).__name__)

    thread = threading.Thread(target=look, name="ckpt-second-look", daemon=True)
    thread.start()

    def stands() -> bool:
        thread.join()
        return bool(answer and answer[0])

    return stands


def _stamp(listing: StepListing) -> tuple[int | None, float | None]:
    return listing.files.get(MANIFEST_NAME), listing.manifest_mtime
