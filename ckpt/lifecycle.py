"""The Checkpointer's `with` block: what entering it sets up and what leaving it does.

Entering: the ranks' group, the node agent if one serves this rank's spool, the root's lease
(before anything there is read or written), then the restore of the newest checkpoint (or a
fresh start), the interval, the signal handlers, the optimizer's pre-hooks that wait for the
staging copies, and the metrics port. Leaving: the final save (or the wait for the last
one), the node agent's commits waited for, the hooks removed, the job's history told how the
run ended, the lease released on a clean exit. A preemption leaves the same way, after its
checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt import console
from ckpt.capture.deepspeed_state import MidAccumulation
from ckpt.capture.optim_init import keeps_no_state
from ckpt.collectives import Group, a_core_each
from ckpt.errors import CheckpointError
from ckpt.events import History, error_gist
from ckpt.node.handoff import Handoff
from ckpt.options import Counters
from ckpt.preempt import EXIT_SIGINT
from ckpt.restore.load import restore, start_fresh
from ckpt.storage.lease_keeper import take_for_job

if TYPE_CHECKING:
    from typing_extensions import Self

    from ckpt.early import Early

# The Checkpointer's lines, wherever its code sits: a program tunes them under this one name.
log = logging.getLogger("ckpt.checkpointer")


def _first_step_pre_hook(opt: Any, hook: Callable[..., None]) -> Any:
    """`opt.register_step_pre_hook(hook)`, run before the hooks registered already: a hook of
    the program's that changes the parameters (a decay, a clamp) is part of the step, and
    must find the staging copies made."""
    handle = opt.register_step_pre_hook(hook)
    hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
    if hasattr(hooks, "move_to_end") and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
    return handle


class Lifecycle:
    """The Checkpointer's entering and leaving of its block (its state is the Checkpointer's)."""

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("this Checkpointer is already entered: one `with` block at a time (another Checkpointer of the root may be opened inside it)")
        self._entered = True
        try:
            return self._enter()
        except BaseException:
            self._entered = False
            raise

    def _enter(self) -> Self:
        # The loop's group. The background writers get a group of their own (their collectives
        # and the loop's must never interleave), made at the first save: a restarted job's
        # restore does not wait for it. A restoring rank's store client is made meanwhile, and
        # while rank 0 takes the lease and surveys the root (not where ranks outnumber cores).
        if self.restore_mode != "none" and a_core_each():
            self.store.warm()
        self._ctrl = Group.new(self.timeout_s)
        console.show(self._ctrl.rank)
        # The node agent, if one serves this rank's spool (the spool is the node's, not the
        # root's): whether any rank has one goes round with the lease's outcome.
        agent = Handoff.find(self._spool, self.store, self._ctrl.rank, self._storage_options)
        # IMPORTANT: the root's lease first, before anything there is read or written (or
        # written over the version `ckpt.prepare` read before it surveyed the root).
        early, self._early = self._early, None
        seen = early.seen if early is not None and self._ctrl.rank == 0 else None
        self._lease, any_agent = take_for_job(self.store, self.lease, self._ctrl, flag=agent is not None, seen=seen)
        try:
            return self._start(agent, any_agent, early)
        except BaseException as e:
            # Said in the job's history (`ckpt events`), and to the next run as how this one
            # ended; not a failure of the machine for the MTBF (a bad checkpoint would count
            # once per restart).
            try:
                # Not waited for: the error is not held up by a store that may be what failed.
                self.history.end(self._step, f"failed to start: {type(e).__name__}: {error_gist(e)}", failure=True, phase="start", wait=False)
            finally:
                if self._lease is not None:
                    self._lease.close(release=False)
            raise

    def _start(self, agent: Handoff | None, any_agent: bool, early: Early | None = None) -> Self:
        """The rest of entering, once the root is this job's."""
        self._leaving = False
        self._slot.open()
        self.history = History(self.store, self._ctrl.world, enabled=self._ctrl.rank == 0)
        self._cadence.start(self.store, self._ctrl.rank, self._ctrl.world)
        self.metrics.identify(self._ctrl.rank, self._ctrl.world)
        if self._ctrl.rank == 0:
            self.metrics.schedule_from(self._cadence.estimate)
        self._handoff = self._link_agent(agent, any_agent)
        if self.restore_mode != "none":
            began = time.perf_counter()
            ctrl, mode, key = self._ctrl, self.restore_mode, self._signing_key
            prepared = early.survey(mode, key, ctrl.world, self._lease, any_agent) if early is not None and ctrl.rank == 0 else None
            restored, self._taken, self._newest = restore(self.store, ctrl, self.state, mode, self._handoff, key, prepared)
            if restored is not None:
                self._step = self.restored_step = restored.step
                took = time.perf_counter() - began
                self.metrics.restored(took, restored.read_bytes, restored.manifest, restored.source, restored.received_bytes)
                got = f" and {restored.received_bytes / 1e6:.1f} MB from the ranks that load the same" if restored.received_bytes else ""
                log.info("restored step %d in %.2f s, %.1f MB read%s, mostly from the %s", restored.step, took, restored.read_bytes / 1e6, got, "node spool" if restored.source == "spool" else "store")
                self.counters, self.last_commit = Counters(restored.counters), restored.manifest
            elif self._ctrl.rank == 0:
                log.info("no checkpoint in %s: starting at step 0", self.store.display)
        else:
            self._taken, self._newest = start_fresh(self.store, self._ctrl, self._signing_key)
            if self._ctrl.rank == 0:
                log.info("restore='none': starting at step 0 (the checkpoints in %s are left as they are)", self.store.display)
        self.history.start(self._step, self.last_commit if self.restored_step is not None else None)
        self._saved_step = self._step
        self._restart_interval()
        if self._ctrl.rank == 0:
            log.info("%s", self._cadence.describe())
        self._preempt.start(sigterm=self.handle_sigterm, rank=self._ctrl.rank)
        self._hooks = [_first_step_pre_hook(o, keeps_no_state(lambda *_: self.wait_for_staging())) for o in self.state.optimizers]
        if self._metrics_port is not None:
            try:
                self.metrics.serve(self._metrics_port, os.environ.get("CKPT_METRICS_ADDR", "127.0.0.1"))
            except OSError as e:  # a port taken must not stop training (nor this rank alone)
                log.warning("metrics not served on port %d: %s", self._metrics_port, e)
        return self

    def _link_agent(self, handoff: Handoff | None, any_agent: bool) -> Handoff | None:
        """This rank's node agent (`handoff`, if one serves its spool). If any rank has one
        (`any_agent`), all ranks commit its way (the last rank durable commits); ranks
        without write to the root."""
        if any_agent and handoff is None:
            handoff = Handoff(self.store, None, self._ctrl.rank)
        if handoff is not None and handoff.spool is not None:
            self._preempt.watch(handoff.spool.notice_file)
            self.metrics.publish(handoff.spool.metrics_path(handoff.job, self._ctrl.rank), before=self._learn_commits)
            handoff.wait_idle(self.timeout_s / 2)  # a save of this job still uploading: let it commit first
        if handoff is not None:
            self._ctrl.max([0])  # every node's agent is done before rank 0 picks the checkpoint
        return handoff

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None or (exc_type is SystemExit and self._preempt.why):
            how, failure = (f"preempted ({self._preempt.why})" if self._preempt.why else "exited"), False
        else:
            how, failure = f"error: {exc_type.__name__}: {error_gist(exc)}", True
        clean = False  # left without an error, the last save included: the root is free
        self._leaving = True
        try:
            if exc_type is None and self.save_on_exit:
                self._final_save()
            elif exc_type is None:
                self.wait()
            else:
                try:
                    self.wait()
                except CheckpointError as e:  # keep the loop's own exception the one raised
                    log.error("while leaving after %s: %s", exc_type.__name__, e)
            if exc_type in (None, SystemExit) and self._ctrl.rank == 0 and self._handoff is None:
                self._retire_restored()
            if self._handoff is not None and exc_type in (None, SystemExit):
                self._learn_commits(self.timeout_s)  # the last save committed by the agent, if it can be
                if self._handoff.pending:
                    log.error("steps %s were handed off to the node agent but are not committed yet", self._handoff.pending)
            clean = exc_type is None
        finally:
            self._entered = False
            for hook in self._hooks:
                hook.remove()
            self.history.end(self._step, how, failure)
            if self._ctrl.rank == 0:
                last = self.last_commit.step if self.last_commit is not None else None
                log.info(
                    "%s at step %d; %s", how, self._step,
                    f"the last checkpoint is step {last} in {self.store.display}" if last is not None else f"no checkpoint in {self.store.display}",
                )  # fmt: skip
            self._preempt.stop()
            self._slot.close()
            # The groups are not destroyed here: a peer may still be reading the last message
            # of a collective, and gloo aborts that peer if the socket closes under it.
            # `dist.destroy_process_group()` frees them with the rest, as long as nothing else
            # holds them: a reference kept alive to interpreter exit (a traceback that holds
            # this object does) tears gloo down in arbitrary order and aborts the process.
            self._ctrl = Group(None, self._ctrl.rank, self._ctrl.world)
            self._io = None
            self.metrics.close()
            if self._lease is not None:
                # A clean exit frees the root; after a failure the lease is left to the same
                # job's restart (or to expire), and its renewal stops with this block.
                self._lease.close(release=clean)
                self._lease = None

    def _final_save(self) -> None:
        """Leaving normally: the last step ends committed if it can be. A save of it that
        failed (on any rank: all must agree) is tried once more."""
        if self._saved_step == self._step:
            error: Exception | None = None
            try:
                self.wait()
            except Exception as e:  # IMPORTANT: every rank reaches the max below, whatever failed
                error = e
            if not self._ctrl.any(self._failed_step == self._step):
                if error is not None:
                    raise error
                return
            log.warning("the save of step %d failed; trying it once more before leaving", self._step)
            self._saved_step = -1
            self._renew_io_group()
        try:
            self.save(blocking=True)
        except MidAccumulation as e:  # equal on every rank: the engines step together
            # A data set whose micro-batches do not fill the last optimizer step: DeepSpeed
            # drops that partial step too, and the last checkpoint stands.
            last = f"step {self.last_commit.step}" if self.last_commit is not None else "none"
            log.warning(
                "step %d is not saved on leaving: the loop ended in the middle of gradient accumulation (micro-batch "
                "%d of %d), which no checkpoint can hold; the last checkpoint is %s", self._step, e.micro, e.accumulation, last,
            )  # fmt: skip

    def _exit_for_preemption(self) -> None:
        self._preempt.ask("asked on another rank")  # the meeting told this rank
        self._leaving = True
        level = logging.WARNING if self._ctrl.rank == 0 else logging.DEBUG  # every rank does it: one says so
        log.log(level, "preempted (%s): checkpointing step %d before exiting", self._preempt.why, self._step)
        self.save(blocking=True)
        if self.last_commit is None or self.last_commit.step != self._step:
            # The save could not happen here (the step's directory holds an older checkpoint):
            # say so by the exit status rather than claim a clean stop.
            log.error("preempted at step %d without a checkpoint of it; exiting with status 1", self._step)
            raise SystemExit(1)
        raise SystemExit(EXIT_SIGINT if self._preempt.why == "SIGINT" else self.preempt_exit_code)
