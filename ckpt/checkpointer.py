"""The per-rank agent (the library side, not the node agent of `ckpt.agent`): `Checkpointer`,
the context manager in the training loop.

On enter it restores the newest committed checkpoint (falling back past incomplete or
corrupt ones, saying why); `step_done()` counts optimizer steps and saves when the interval
says so; a save blocks only while the state is copied to host buffers (shared memory), then
plans and commits in a background thread while a writer process of this rank writes the
bytes, one save in flight at a time (`CKPT_WRITER=thread` writes in the thread instead).
SIGTERM (a preemption) takes a checkpoint at the next step boundary, waits for its commit
and exits.

This module holds the options and the loop's touch points; entering and leaving the block
are `ckpt.lifecycle`'s, the background save and what follows a commit `ckpt.background`'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from ckpt._faults import fault_point
from ckpt._gc import gc_paused
from ckpt.background import BackgroundSaves
from ckpt.capture.state import TrainingState
from ckpt.collectives import Group
from ckpt.data import data_position, own_generator
from ckpt.early import store_config
from ckpt.early import take as take_early
from ckpt.errors import SaveFailed
from ckpt.events import Event, History
from ckpt.format.checksum import BLAKE3
from ckpt.format.manifest import Manifest
from ckpt.format.signing import SigningKey
from ckpt.lifecycle import Lifecycle
from ckpt.metrics import Metrics, port_from_env
from ckpt.node.handoff import Handoff
from ckpt.options import Counters, OnError, Restore, check_counters, check_options, checked_interval
from ckpt.preempt import Preemption
from ckpt.save.commit import Save
from ckpt.save.slot import SaveSlot, Staged
from ckpt.save.stage import default_host_budget
from ckpt.save.upload import Direct, ViaAgent
from ckpt.schedule.cadence import Cadence
from ckpt.schedule.policy import Auto, Every, Keep
from ckpt.storage import catalog
from ckpt.storage.lease import Lease
from ckpt.storage.lease_keeper import LeaseKeeper
from ckpt.storage.store import Store, Transfer, step_dir_name

log = logging.getLogger(__name__)

_OUTSIDE = (
    "{}() outside the Checkpointer's `with` block, where nothing is restored or saved: "
    "`with ckpt.Checkpointer(...) as cp:` around the training loop"
)


class Checkpointer(Lifecycle, BackgroundSaves):
    """Saves and restores the whole training state of this rank, in step with the others.

    Args:
        root: where checkpoints live: a local path or any fsspec URL (``s3://bucket/prefix``).
        model: the module (plain, DDP, FSDP2 ``fully_shard``, FSDP1, DTensor TP).
        optimizer: an optimizer or a list of them, for ``model``.
        scheduler: an LR scheduler or a list of them.
        scaler: a ``torch.amp.GradScaler``.
        extra: named objects with ``state_dict``/``load_state_dict`` (an EMA, ...). Their
            tensors may be DTensors (saved sharded) or equal on every rank (saved once).
        app_state: an object with ``state_dict``/``load_state_dict`` whose state dict is saved
            at the top level, keys as it names them, as ``dcp.save(app_state.state_dict())``
            would lay them out (so that a tool reading plain DCP, such as torchtitan, finds
            its keys: ``ckpt.integrations.torchtitan``). ckpt's own keys (model, optim,
            scheduler, scaler, extra, data, loader, counters, rng) are refused.
        data: the data position: a ``ckpt.ElasticSampler`` (or any object whose JSON state is
            global), restored on any world size.
        dataloader: a DataLoader. Its ElasticSampler becomes ``data``; a torchdata
            ``StatefulDataLoader`` is also restored itself, per rank, when the world size is
            unchanged (its prefetch-exact position); after a world-size change the global
            cursor rules.
        interval: when ``step_done`` saves. "auto" (default, or ``ckpt.Auto(...)`` to set the
            MTBF prior): when it pays, from the measured cost of the last save and the job's
            MTBF (see ``ckpt.Auto``); ``ckpt.Every(steps=, seconds=)``: fixed; None: only when
            asked. Time-based choices are made on rank 0 and shared by every rank.
        keep: retention, applied by rank 0 after each commit, in the background.
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for an S3-compatible store).
        transfer: how files move to and from an S3 root (``ckpt.Transfer``: part size, parts
            in flight, read size and readahead, retries and backoff, and the job's request
            rate, `requests_per_s`, which each rank paces itself at its share of).
        restore: "latest" (default) restores the newest committed checkpoint; "none" starts
            fresh whatever the root holds; a step number restores exactly that step.
        save_on_exit: leaving the block normally takes a final save if the last step is unsaved.
        on_error: a failed background save raises ``SaveFailed`` at the next ``step_done``
            ("raise", default), is only logged ("log": training goes on and the next save
            tries again), or is logged until this many saves in a row have failed (an int K:
            a store down for a while costs K intervals of progress at most, then the job
            stops). A save refused because another job took the root (see ``lease``) raises
            whatever this says. Either way nothing half-written is ever restored.
        handle_sigterm: SIGTERM takes a checkpoint and exits: at the next step boundary on one
            rank, at the next meeting (``agree_every_s``) of several. So does a Ctrl-C
            (SIGINT, unless the program installed its own handler), exiting with status 130;
            a second Ctrl-C exits at once, abandoning the save in flight.
        preempt_file: a path (default ``CKPT_PREEMPT_FILE``) whose appearance does what a
            SIGTERM does, for preemption notices and preStop hooks; a file older than the run
            is ignored (``ckpt.preempt``).
        preempt_exit_code: the exit status after a SIGTERM checkpoint committed. The default,
            143 (terminated by SIGTERM), tells torchrun and schedulers the job is not done:
            elastic agents restart the survivors, a Kubernetes Job retries. 0 would end it.
        timeout_s: the longest a collective of a save may wait for another rank before the
            save fails: a dead rank turns into an error, never a hang. A writer process that
            moves no bytes for this long (a hung store or mount) fails its save too. No S3
            request is tried for longer than half of it (``Transfer.deadline_s``).
        if_busy: a save that comes due while the previous one is still writing waits for it
            ("wait", the loop stalls until the store catches up) or is skipped and counted in
            ``skipped_saves`` ("skip", the loop never waits on a slow store).
        overlap: a save returns as soon as its host buffers are set up and module buffers
            copied; parameters and optimizer state are copied in the background while the
            next forward and backward run, and the next ``optimizer.step()`` waits for that
            copy (a step pre-hook). False copies everything before ``save`` returns.
        host_memory_budget: bytes of host memory the staging buffers may take (default: the
            memory available on the node divided by its local ranks). A save that would need
            more is streamed from the live state instead, item by item, and the loop waits
            for it; ckpt says so once.
        metadata: JSON values stored in every manifest (run id, git commit, ...).
        agree_every_s: with several ranks, they meet at a step boundary (one small
            collective) no more than this many seconds of rank 0's time apart, to save by
            the clock, to stop for a SIGTERM that reached any rank, and to report a failed
            background save, all at the same step; other steps cost no collective. Rank 0
            turns seconds into steps from its measured step time (``ckpt.schedule.agreement``).
        metrics_port: serve this rank's Prometheus metrics (``cp.metrics``) on this port plus
            its local rank, on loopback (``CKPT_METRICS_ADDR`` to change); default
            ``CKPT_METRICS_PORT``, else not served. See ``ckpt.metrics``.
        spool: the node spool of a ``ckpt agent`` (default ``CKPT_SPOOL``). With a live agent
            there, a save writes this rank's files to the spool and hands them off: the agent
            uploads them and the checkpoint commits when every rank's files are durable, even
            if this process dies meanwhile; ``last_commit`` is then the last save handed off,
            and leaving the block waits (up to ``timeout_s``) for its commit. A restart on the
            node reads the files the spool still holds from there. The agent's SIGTERM or
            notice asks for a checkpoint as a SIGTERM does. See ``ckpt.node.handoff``.
        signing_key: a secret (bytes or str, at least 16 bytes) to sign every manifest with
            (HMAC-SHA256 over its content, which lists every file's size and checksum);
            default: the file named by ``CKPT_SIGNING_KEY_FILE`` (preferred), else
            ``CKPT_SIGNING_KEY``, else no signing. With a key, restore trusts only checkpoints
            signed with it: an unsigned or wrongly signed one is passed over (saying why) for
            the one before, and if none is trusted the restore fails (``RestoreFailed``), never
            a silent fresh start. Retention (``keep``) then counts only checkpoints signed with
            it and leaves those signed otherwise or not at all alone. A node agent commits the
            signed draft and never sees the key; the key is never logged or stored. See
            ``ckpt.format.signing``.
        lease: one job per root (``ckpt.Lease(ttl_s=60, takeover=False)``; None: no lease).
            Rank 0 takes ``<root>/lease.json`` on enter, before anything there is read or
            written; if another live job holds it, every rank raises ``ckpt.LeaseHeld``
            saying who and how to take over. The same job restarting (the same
            ``CKPT_JOB_ID``, ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``), a crashed run's
            restart on the same machine and a lease not renewed for ``ttl_s`` seconds are
            taken at once. Renewed every ``ttl_s / 3``; released on a clean exit. A job whose
            lease was taken over commits nothing more: its saves fail with ``SaveFailed``.
            See ``ckpt.storage.lease``.
        frozen: the model's parameters that do not require grad (a LoRA or adapter job's
            base model) are in every checkpoint ("save", default) or in none ("skip"): the
            checkpoints then hold only what training changes, and the job loads the base
            itself before entering the block, on a restart as on a fresh start. A restore
            loads whatever the checkpoint holds, frozen or not, and leaves the frozen
            parameters it lacks as they are (a trained one it lacks fails the restore).
            Which parameters are frozen is read at each save. "skip" is for parameters that
            training does not change: a frozen module updated in place (an EMA teacher)
            needs "save".
    """

    def __init__(
        self,
        root: str = "./checkpoints",
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        app_state: Any = None,
        data: Any = None,
        dataloader: Any = None,
        interval: Every | Auto | Literal["auto"] | None = "auto",
        keep: Keep = Keep(last=3),
        storage_options: dict[str, Any] | None = None,
        restore: Restore = "latest",
        save_on_exit: bool = True,
        on_error: OnError = "raise",
        handle_sigterm: bool = True,
        preempt_exit_code: int = 143,
        timeout_s: float = 600.0,
        if_busy: Literal["wait", "skip"] = "wait",
        overlap: bool = True,
        host_memory_budget: int | None = None,
        metadata: dict[str, Any] | None = None,
        agree_every_s: float = 2.0,
        metrics_port: int | None = None,
        transfer: Transfer | None = None,
        preempt_file: str | None = None,
        spool: str | None = None,
        signing_key: bytes | str | None = None,
        lease: Lease | None = Lease(),
        frozen: Literal["save", "skip"] = "save",
    ) -> None:
        check_options(
            on_error=on_error, restore=restore, keep=keep, if_busy=if_busy, lease=lease, metadata=metadata,
            timeout_s=timeout_s, budget=host_memory_budget, agree_every_s=agree_every_s, frozen=frozen,
        )  # fmt: skip
        interval = checked_interval(interval)
        args = store_config(root, storage_options, transfer, timeout_s)
        self._early = early = take_early(args, timeout_s)  # `ckpt.prepare`'s, for this root
        self.store = early.store if early is not None and early.store is not None else Store(*args)
        self._signing_key = SigningKey.resolve(signing_key)
        if self._signing_key is not None:  # a signature over xxh3 checksums would not cover the data
            self.store.checksum_algo = BLAKE3
        self._storage_options = storage_options
        data, loader = data_position(data, dataloader)
        self.state = TrainingState.of(model, optimizer, scheduler, scaler, extra, data, loader, frozen, app_state)
        self.state.loader_generator = own_generator(dataloader)  # after every check: nothing changed if refused
        # A signal reaches one rank, a clock runs per rank: the ranks meet now and then to
        # share them. Always, whatever this rank's settings say: whether to meet must never
        # depend on something that could differ between ranks (an environment variable).
        self._cadence = Cadence(interval, agree_every_s)
        self.keep = keep
        self._scans = catalog.Scans()  # retention's, after every save
        self.restore_mode = restore
        self.save_on_exit = save_on_exit
        self.on_error = on_error
        #: Background saves that failed since the last one that committed.
        self.failures_in_row = 0
        self.handle_sigterm = handle_sigterm
        self.preempt_exit_code = preempt_exit_code
        self.timeout_s = timeout_s
        self.if_busy = if_busy
        self.metadata = dict(metadata or {})
        #: The user's own counters (epoch, tokens, ...): saved and restored with the step.
        self.counters: dict[str, Any] = Counters()
        #: The step the last restore resumed from, or None for a fresh start.
        self.restored_step: int | None = None
        #: The manifest of the last committed save of this process.
        self.last_commit: Manifest | None = None
        self._step = 0
        self._saved_step = 0  # the step of the last save actually started
        #: Saves that came due while the previous one was still writing, with if_busy="skip".
        self.skipped_saves = 0
        self.overlap = overlap
        self.host_memory_budget = int(host_memory_budget) if host_memory_budget is not None else default_host_budget()
        self._slot = SaveSlot(self.store, storage_options)
        #: Seconds optimizer steps spent waiting for a staging copy to finish (overlap mode).
        self.staging_wait_s = 0.0
        self._hooks: list[Any] = []
        self.history = History(self.store, 1, enabled=False)  # the real one starts on enter
        self._preempt = Preemption(preempt_file)
        self._spool = spool
        self.lease = lease
        self._lease: LeaseKeeper | None = None  # rank 0's hold on the root, taken on enter
        self._handoff: Handoff | None = None  # the node agent's link, found on enter
        self._ctrl = Group(None, 0, 1)
        self._io: Group | None = None  # the background writers' group: made at the first save
        self._taken: set[int] = set()  # steps whose directories hold a manifest: never written into
        self._newest = 0.0  # the root's newest commit time: this job's commits are dated after it
        self._said_commit_at: float | None = None  # when a commit was last said at INFO
        self._leaving = False  # the saves now are the last of this run (leaving, preempted)
        self._failed_step = -1  # the step of the last save that failed
        #: This rank's Prometheus metrics (``cp.metrics.registry``), served with ``metrics_port``.
        self.metrics = Metrics()
        self._metrics_port = port_from_env(metrics_port)
        self._entered = False  # inside the `with` block

    # -- the loop's four touch points ---------------------------------------------------------
    @property
    def restart_event(self) -> Event | None:
        """The restart event this start wrote (rank 0, after a restore), for the curious."""
        self.history.flush()
        return self.history.restart_event

    @property
    def interval(self) -> Every | Auto | None:
        """When ``step_done`` saves (the ``interval`` given, "auto" as ``Auto()``)."""
        return self._cadence.interval

    @property
    def step(self) -> int:
        """Completed optimizer steps: where the loop resumes."""
        return self._step

    def step_done(self) -> None:
        """Count one optimizer step; save if due; exit after a checkpoint if preempted."""
        if not self._entered:
            raise RuntimeError(_OUTSIDE.format("step_done"))
        self._step += 1
        self.metrics.stepped()
        self.history.progress(self._step)
        # A failed save is reported where every rank learns of it at the same step (each
        # rank's background thread fails at its own time): at the ranks' next meeting, or
        # when the next save waits for it.
        # Every rank must save at the same step (ckpt.schedule.cadence).
        due = self._cadence.at_step(self._step, self._ctrl.rank, self._ctrl.world, self._ctrl.max, self._preempt.asked(), self._slot.failed(), self._slot.busy())
        if due.met:
            self.metrics.meetings.inc()
        if due.failed:
            self._renew_io_group()
            self.wait()  # raises SaveFailed (or logs it) on every rank
        if due.preempt:
            self._exit_for_preemption()
        elif due.save and self.if_busy == "skip" and self._busy_somewhere():
            self.skipped_saves += 1
            # The interval counts from the skipped point; the step stays unsaved, so a final
            # save on exit still happens.
            self._restart_interval()
            self.metrics.skipped()
            log.info("step %d: a save is due but the last one is still writing; skipped", self._step)
        elif due.save:
            self.save()

    @property
    def meetings(self) -> int:
        """How many times the ranks met at a step boundary to agree (``agree_every_s``)."""
        return self._cadence.agreement.meetings

    def _count_from(self, step: int) -> None:
        """Count steps from `step` (done): a loop that keeps its own count and started from a
        checkpoint ckpt did not restore (`ckpt.integrations.torchtitan`'s initial load)."""
        self._step = self._saved_step = step
        self._restart_interval()

    def _restart_interval(self) -> None:
        """A save was taken (or skipped) at this step, on every rank alike."""
        self._cadence.restart(self._step)

    def save(self, blocking: bool = False) -> None:
        """Checkpoint the current step now. Returns once the state is staged in host memory
        (or, with `blocking`, committed). All ranks must call it at the same step."""
        if not self._entered:
            raise RuntimeError(_OUTSIDE.format("save"))
        if type(self.counters) is not Counters:  # checked when set; a plain dict assigned is not
            check_counters(self.counters)  # before anything changes
        # IMPORTANT: decided from what every rank knows alike (never from whether this rank's
        # background save has finished yet), so all ranks take the same branch.
        if self._saved_step == self._step and (self._step > 0 or self.last_commit is not None):
            if blocking:
                self.wait()
            return
        if self._step in self._taken:
            log.warning(
                "%s/%s is taken (a checkpoint passed over at restore, or something else under that name); "
                "it is left as it is and this save moves to the next step",
                self.store.display,
                step_dir_name(self._step),
            )
            self._cadence.deferred = True
            return
        self._cadence.deferred = False
        if self._io is None:  # a collective: every rank saves at this step
            try:
                self._io = Group.new(self.timeout_s)
            except Exception as e:  # a rank that never came (a save not called on every rank), a network down
                raise SaveFailed(f"save of step {self._step}: the ranks could not make the writers' group ({type(e).__name__}: {e})") from e
        # IMPORTANT: one save in flight at a time; the stager's buffers belong to it.
        waiting = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        counters = {"step": self._step, **self.counters}
        assert self._slot.opened, "use the Checkpointer as a context manager"
        staged = self._stage(counters)
        blocking = blocking or staged.streamed
        blocking_s = time.perf_counter() - started
        # The wait for the previous save's slot was blocking too: counted as if a staging wait.
        waited_before = self.staging_wait_s - (started - waiting)
        try:
            self.metrics.staged(blocking_s)  # before the save can end (in flight: 1, then 0)
            save = Save(
                self._step, self.store, self._io, counters, user=self.metadata, schedule=self.schedule, blocking_s=blocking_s,
                started=started, key=self._signing_key, guard=self._lease.check if self._lease is not None else None, after=self._newest,
            )  # fmt: skip
            upload = Direct() if self._handoff is None else ViaAgent(self._handoff)
            self._cadence.slowdown.began()  # the steps from here on are this save's (`Slowdown`): before its commit can come
            self._slot.submit(self._save_in_background, save, staged, upload, waited_before)
        except BaseException:
            self._slot.staging_done()  # IMPORTANT: no save will release the pre-hook's wait
            raise
        self._saved_step = self._step
        self._restart_interval()
        log.debug("step %d staged in %.1f ms", self._step, blocking_s * 1e3)
        if blocking:
            self.wait()

    @gc_paused
    def _stage(self, counters: dict[str, Any]) -> Staged:
        """The loop's part of a save: capture, and copy into staging buffers (or start the
        copies that overlap the next forward and backward); over the host memory budget, no
        copy: the save streams from the live state. A capture that fails raises on every
        rank; a copy that fails is logged here, with its traceback, and fails the save on
        every rank at its first collective (`SaveSlot.stage`)."""
        rank = self._ctrl.rank

        def capture() -> Any:
            fault_point("capture", rank, counters["step"])
            return self.state.capture(counters, rank)

        deferrable = self.state.deferrable() if self.overlap else None
        staged = self._slot.stage(capture, self.host_memory_budget, self._ctrl.max, deferrable, rank=rank, step=counters["step"])
        if staged.failed is not None:
            log.error("rank %d: the state of step %d cannot be staged", rank, counters["step"], exc_info=staged.failed)
        return staged

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state it needs. Called by itself
        before every optimizer.step(); call it by hand before anything else that changes
        parameters or optimizer state in place outside optimizer.step()."""
        self.staging_wait_s += self._slot.wait_for_staging()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and what it writes after its commit (retention,
        the job's history); report its failure as `on_error` says."""
        fut = self._slot.take()
        if fut is None:
            return
        try:
            self.last_commit = fut.result()
            self.failures_in_row = 0
        except SaveFailed as e:
            self._failed_step = self._saved_step  # one save in flight: the last one taken
            self.failures_in_row += 1
            limit = 1 if self.on_error == "raise" else None if self.on_error == "log" else self.on_error
            log.error("%s (%d failed save(s) in a row%s)", e, self.failures_in_row, f"; giving up at {limit}" if limit and limit > 1 else "")
            # Another job holds the root now: no later save can commit, whatever on_error says
            # (the text is the same on every rank: rank 0's, broadcast).
            lost_root = "LeaseHeld: " in str(e)
            if lost_root or (limit is not None and self.failures_in_row >= limit):
                raise
        finally:
            self.history.flush()

    @property
    def schedule(self) -> dict[str, Any]:
        """What the interval policy decided last: seconds, and for "auto" what it was chosen
        from (measured blocking and busy times, the MTBF, the nodes, failures seen). Rank 0
        decides, from its own costs; on other ranks this stays the initial choice."""
        return self._cadence.schedule

