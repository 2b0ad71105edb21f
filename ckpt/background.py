"""The Checkpointer's background save, in its slot's thread, and what follows a commit.

`save()` stages the state and hands the rest to `_save_in_background`: the write and the
commit (`ckpt.save.slot`, `ckpt.save.commit`), then this rank's metrics and, with a node agent,
the hand-offs it has committed since; on rank 0 retention, the job's history, the interval's
retune from what the save cost, and the line that says so. One save runs at a time: the next
`save()` waits for this one (`Checkpointer.wait`), retention included. The saves' collectives
run on a gloo group of their own (the writers' group), replaced together after a failure.
"""

from __future__ import annotations

import contextlib
import logging
import time

from ckpt.collectives import Group
from ckpt.errors import CheckpointError
from ckpt.format.manifest import Manifest
from ckpt.save.commit import Save, Upload, forget_plans
from ckpt.save.slot import Staged
from ckpt.storage import catalog
from ckpt.storage.store import step_dir_name

# The Checkpointer's lines, wherever its code sits: a program tunes them under this one name
# (the example shows every commit by setting its level).
log = logging.getLogger("ckpt.checkpointer")

# Rank 0 says a commit at INFO at most this often (the rest at DEBUG).
_SAY_COMMITS_EVERY_S = 600


class BackgroundSaves:
    """The Checkpointer's background saves and their aftermath (its state is the Checkpointer's)."""

    def _save_in_background(self, save: Save, staged: Staged, upload: Upload, waited_before: float) -> Manifest:
        """One save, from the staging copies left to it to its commit, then what follows; into
        the metrics however it ends. `waited_before`: the loop's staging waits before it."""
        try:
            try:
                manifest = self._slot.write_and_commit(save, staged, upload, self.timeout_s)
            finally:
                self._slot.staging_done()  # IMPORTANT: whatever failed, the optimizer's pre-hook never waits forever
            self._newest = max(self._newest, manifest.created)
            if self._ctrl.rank == 0:
                self._after_commit(save, manifest, waited_before)
            else:  # priced as the step in progress ends (`Slowdown`): for the ranks' next meeting
                self._cadence.slowdown.committed(save.blocking_s + self.staging_wait_s - waited_before)
        except BaseException as e:
            self.metrics.failed(e)
            raise
        if self._handoff is None:
            self.metrics.committed(manifest, self._ctrl.rank)
        else:
            self.metrics.handed_off(manifest, self._ctrl.rank)
            try:
                self._learn_commits()
            except CheckpointError as e:  # the save is handed off: a store that flakes now fails nothing
                log.warning("could not learn which hand-offs are committed: %s", e)
        return manifest

    def _after_commit(self, save: Save, manifest: Manifest, waited_before: float) -> None:
        """Rank 0, once a save committed (or was handed off): retention, the job's history,
        the interval's retune, the line that says so."""
        self._apply_retention(save.step, manifest if self._handoff is None else None)
        self.history.beat()
        if not self._leaving:  # a last save prices nothing
            # The loop also waited for the copy in the optimizer's pre-hook (overlap mode;
            # done by now) and, before this save, for the previous one's slot; the slot
            # stays busy until retention and history are done too, not just the commit.
            blocked = manifest.costs.blocking_s + self.staging_wait_s - waited_before
            now = time.perf_counter()
            # What the steps beside a save lose is priced once this one's last step ends
            # (`Slowdown`), under every policy (the metrics say it); the interval is priced
            # at the slowest rank's figure as of the ranks' last meeting: the saves before.
            self._cadence.slowdown.committed(blocked)
            if self._cadence.coordinator is not None:
                busy, handoff = now - save.started, self._handoff
                agent = handoff is not None and handoff.spool is not None
                if agent:  # IMPORTANT: the next save waits for the upload, not the hand-off
                    with contextlib.suppress(CheckpointError):  # a store that flakes: learned at the next save
                        self._learn_commits()
                    busy = max(busy, handoff.busy_s())  # type: ignore[union-attr]
                self._cadence.coordinator.retune(blocked, busy, self.history.record.started, self._cadence.agreement.step_s, self._cadence.slowest(), agent=agent)
        self._say_commit(save.step, manifest)

    def _renew_io_group(self) -> None:
        """After a failed save, on every rank at the same step: a failed collective can leave
        the writers' group unusable (gloo closes its pairs on a timeout), so replace it together."""
        if self._io is not None and self._io.pg is not None:
            # A fresh plan key too: a failed save may have left DCP's plan cache half updated
            # (rank 0 caches the global plan before the other ranks cache theirs). The old
            # key's plans go, or a job whose saves fail now and then keeps every one's.
            forget_plans(self._io.plan_key)
            self._io = Group.new(self.timeout_s)

    def _busy_somewhere(self) -> bool:
        """Is the previous save still writing on any rank? Asked of all ranks together, since
        each rank's background thread finishes at its own time."""
        return self._ctrl.any(self._slot.busy())

    def _say_commit(self, step: int, manifest: Manifest) -> None:
        """Rank 0's line on a commit: at INFO now and then, which a plain script shows
        (`ckpt.console`), at DEBUG the rest of the time."""
        now = time.monotonic()
        said = self._said_commit_at is None or now - self._said_commit_at >= _SAY_COMMITS_EVERY_S
        self._said_commit_at = now if said else self._said_commit_at
        log.log(
            logging.INFO if said else logging.DEBUG,
            "saved step %d: %s %s/%s (%.1f MB, blocked %.0f ms, persisted in %.2f s)%s",
            step,
            "committed" if self._handoff is None else "handed off to the node agent",
            self.store.display,
            step_dir_name(step),
            manifest.costs.bytes / 1e6,
            manifest.costs.blocking_s * 1e3,
            manifest.costs.persist_s,
            f"; {self._cadence.next_due(step)} (saves are shown every {_SAY_COMMITS_EVERY_S // 60} min at most)" if said else "",
        )

    def _learn_commits(self, timeout_s: float = 0.0) -> None:
        """The saves handed off to the node agent that are committed now."""
        if self._handoff is not None:
            for manifest in self._handoff.committed(timeout_s):
                self.metrics.agent_committed(manifest, time.time() - manifest.created + manifest.costs.persist_s)
                self._scans.learned(manifest, self._signing_key is not None)  # retention need not list the root for it

    def _retire_restored(self) -> None:
        """Leaving with a newer commit than the step this run restored: retention need keep
        that step no longer (`_apply_retention`)."""
        last = self.last_commit.step if self.last_commit is not None else None
        if self.restored_step is not None and last is not None and last != self.restored_step:
            try:
                self._apply_retention(last)
            except CheckpointError as e:  # the checkpoints are safe; an extra one stays
                log.warning("retention on leaving: %s", e)

    def _apply_retention(self, just_committed: int, manifest: Manifest | None = None) -> None:
        """`manifest`: the checkpoint this rank just committed itself (not handed off: the
        agent's commits come to the Scans as the trainer learns of them, `_learn_commits`)."""
        if self._lease is not None and self._lease.lost is not None:
            log.warning("retention skipped: the root is not this job's any more")  # nor its checkpoints
            return
        # The step this run restored is known to restore: kept while the run goes on.
        kept = self.restored_step if self.restored_step is not None and not self._leaving else None
        protect = {just_committed} | ({kept} if kept is not None else set())
        # Handed off to the node agent, not committed yet: never debris to delete.
        in_flight = self._handoff.pending if self._handoff is not None else ()
        catalog.retire(self.store, self._scans, self.keep, self._signing_key, in_flight=in_flight, protect=protect, committed=manifest)
