"""The two ways a save's files reach the root and commit (`ckpt.save.commit.Upload`).

`Direct`: every rank writes to the root; rank 0 writes the manifest once every rank's files
are durable there. `ViaAgent`: every rank writes to its node spool (the root where the spool
cannot take the save) and hands its files off to the node agent (`ckpt.node.handoff`); rank
0 puts its draft of the manifest in the root first, and each request names it by its
checksum and lists the rank's own files; the agent uploads them, and whoever makes the last
rank durable in the root commits the draft (`ckpt.node.durable`), even if the trainers died
meanwhile. No rank is sent the list of every rank's files, nor writes it into its request:
tens of MB at 10,000 ranks.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from ckpt._faults import fault_point
from ckpt.errors import DiskFull, SaveFailed, dcp_failures
from ckpt.format.manifest import MANIFEST_NAME, Manifest
from ckpt.node.durable import claim, write_draft
from ckpt.save.commit import Report, Save, Source, Written, claim_step_dir, draft, write_files
from ckpt.storage.store import step_dir_name

if TYPE_CHECKING:
    from ckpt.node.handoff import Handoff
    from ckpt.save.resave import Layout

log = logging.getLogger(__name__)


class Direct:
    """Straight to the root: rank 0 commits."""

    def __init__(self) -> None:
        self._tried = False  # rank 0 sent the manifest: it may have landed though it failed

    def claim(self, save: Save) -> str | None:
        return claim_step_dir(save.store, save.step)

    def write(self, save: Save, source: Source, layout: Layout | None) -> Written:
        try:
            return write_files(save, source, layout, save.store)
        except CheckpointException:  # DCP's save, which its ranks fail together
            if save.rank == 0:
                _clear_failed(save)
            raise

    def commit(self, save: Save, written: Written, everyone: list[Report]) -> Manifest:
        manifest = draft(save, written, everyone)
        if save.guard is not None:
            save.guard()  # another job may have taken the root while the files were written
        # IMPORTANT: the commit. Written last, after every rank's files are durable.
        self._tried = True
        save.store.put_atomic(f"{save.rel}/{MANIFEST_NAME}", manifest.to_json())
        return manifest

    def finish(self, save: Save, told: Manifest, written: Written) -> Manifest:
        """Rank 0's manifest; on the other ranks, it with the files written for all and their
        own (`commit._told`)."""
        if save.rank == 0 or isinstance(written.report, str):
            return told
        return told.narrowed({**told.files, **written.report[2]})

    def abandon(self, save: Save, written: Written) -> None:
        if save.rank == 0 and not self._tried:  # else the next claim of the step decides
            _clear_failed(save)

    def close(self, save: Save) -> None:
        pass


class ViaAgent:
    """Through the node agent (`handoff`): rank 0 drafts the manifest, every rank hands its
    files off with it, and whoever makes the last rank durable commits. A rank without a
    spool (`Handoff(spool=None)`) writes to the root itself and takes part the same way."""

    def __init__(self, handoff: Handoff) -> None:
        self.handoff = handoff
        self._save_id = ""  # rank 0's, made at the claim; the other ranks learn it with the draft

    def claim(self, save: Save) -> str | None:
        why = claim_step_dir(save.store, save.step)
        if why is None:
            self._save_id = f"{secrets.randbits(63):016x}"
            claim(save.store, save.rel, self._save_id)  # an agent holding an older save of this step leaves it be
        return why

    def write(self, save: Save, source: Source, layout: Layout | None) -> Written:
        target = self.handoff.target(source.need)  # the spool, or the root when it cannot take them
        self.handoff.writing(target, save.rel)
        try:
            written = write_files(save, source, layout, target)
        except CheckpointException as e:  # DCP's save, which its ranks fail together
            if target is not save.store and isinstance(_own_failure(e, save.rank), DiskFull):
                self.handoff.spool_filled()  # so that the next save does not fail the same way
            raise
        if written.where is not target:
            self.handoff.spool_filled()
        return written

    def commit(self, save: Save, written: Written, everyone: list[Report]) -> tuple[Manifest, str, dict[str, Any]]:
        try:
            manifest = draft(save, written, everyone)
        except DiskFull:
            if written.where is not save.store:
                self.handoff.spool_filled()  # `.metadata` found no room there: the next save goes to the root
            raise
        # The draft goes to the root once, before any rank hands off, for whoever commits;
        # each request names it by its checksum (`ckpt.node.durable.write_draft`). Rank 0's
        # save id travels with it: the other ranks need it only to hand off.
        return manifest, self._save_id, write_draft(save.store, save.rel, self._save_id, manifest)

    def finish(self, save: Save, told: tuple[Manifest, str, dict[str, Any]], written: Written) -> Manifest:
        """Every rank hands its files off (or marks them durable in the root); all learn
        whether every rank could."""
        whole, self._save_id, drafted = told
        names = written.names(save.rank)
        # The request lists this rank's files alone; rank 0 keeps the whole manifest.
        own = whole.files if save.rank == 0 else written.report[2] if not isinstance(written.report, str) else {}
        manifest = whole.narrowed({n: own[n] for n in names if n in own})
        why = ""
        try:
            self.handoff.submit(written.where, save.rel, self._save_id, manifest, names, save.group.world, save.began, drafted)
        except Exception as e:  # reported to every rank below, not left to hang them
            why = f"rank {save.rank}: {type(e).__name__}: {e}"
            log.warning("handing off %s failed: %s", save.rel, why)
        fault_point("after_handoff", save.rank, save.step)
        if save.group.any(bool(why)):
            self.handoff.cancel(self._save_id)  # it can never commit: nobody waits for it
            raise SaveFailed(f"hand-off of {save.rel} failed: {why or 'on another rank'}")
        self.handoff.wrote(manifest)
        return whole if save.rank == 0 else whole.narrowed({**whole.files, **manifest.files})

    def abandon(self, save: Save, written: Written) -> None:
        if not isinstance(written.report, str):
            self.handoff.discard(written.where, save.rel, written.names(save.rank))

    def close(self, save: Save) -> None:
        self.handoff.done_writing(save.rel)  # written into the spool and handed off, or failed


def _clear_failed(save: Save) -> None:
    """Rank 0, once every rank knows that the save failed: the files the other ranks wrote
    go. On a disk that filled they would keep every later save from committing, and nothing
    but a later commit's retention would ever delete them. A directory with a manifest (a
    commit whose last step failed) is left, and so is a root this job no longer holds:
    another job may be writing there now."""
    try:
        if save.guard is not None:
            save.guard()
        claim_step_dir(save.store, save.step)  # removes it unless it holds a manifest
    except Exception as e:  # a clean-up: the save's own failure is what is raised
        log.warning("the files of the failed save of %s stay in %s: %s", step_dir_name(save.step), save.store.display, e)


def _own_failure(e: BaseException, rank: int) -> BaseException | None:
    """This rank's error in DCP's `CheckpointException` (which holds every failed rank's)."""
    failures = getattr(e, "failures", {})
    return dict(zip(failures, dcp_failures(e), strict=True)).get(rank) if isinstance(failures, dict) else None

