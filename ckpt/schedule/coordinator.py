"""The coordinator: rank 0's choice of when to save under `interval="auto"`.

It holds the MTBF estimate (the `Auto` prior, updated by the job's past runs in
`<root>/events/` when the run starts and by nothing else: failures end runs), and after each
commit turns what that save cost into the next interval. The loop's thread reads `seconds`
at the ranks' meetings, where rank 0 turns it into a step number from its measured step time
and every rank learns it (ckpt.schedule.agreement), so all ranks save at the same step.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from ckpt.collectives import ranks_per_node
from ckpt.errors import CheckpointError
from ckpt.events import read_runs
from ckpt.schedule.policy import Auto, exposure
from ckpt.storage.store import Store

log = logging.getLogger(__name__)


# How a run ends without a failure of the machine: the user stopped it.
_USER_EXITS = ("error: KeyboardInterrupt", "error: SystemExit")


def failed(ended: str | None) -> bool:
    """A run that never said how it ended (killed, a lost node) or ended in an error; not a
    completion, a preemption, the user's Ctrl-C or sys.exit, or a run that "failed to start"
    (its restore failed: a bad checkpoint would count once per restart)."""
    return ended is None or (ended.startswith("error") and not ended.startswith(_USER_EXITS))


def duration(seconds: float) -> str:
    """A long time in words: hours, or days past two."""
    return f"{seconds / 86400:.3g} days" if seconds >= 2 * 86400 else f"{seconds / 3600:.3g} h"


class Coordinator:
    """The interval `Auto` chooses, and why (see `schedule`)."""

    def __init__(self, policy: Auto, world: int) -> None:
        self.policy = policy
        self.nodes = max(1, -(-world // ranks_per_node()))
        self.mtbf = policy.prior()
        #: Seconds between saves; read by the loop's thread (one float: assigned whole).
        self.seconds = policy.first_after_s
        #: What the last choice was made from, recorded in the next manifest.
        self.schedule: dict[str, Any] = {"policy": "auto", "seconds": self.seconds}
        self._measured = False

    def learn_history(self, store: Store) -> None:
        """Update the MTBF estimate with the job's past runs: `failed` ones are failures, all
        are exposure."""
        try:
            runs = read_runs(store)
        except CheckpointError as e:
            log.warning("could not read the job's history for the MTBF: %s", e)
            return
        past = [(r.world_size, r.updated - r.started, failed(r.ended)) for r in runs]
        self.mtbf = self.mtbf.observe(*exposure(past, ranks_per_node()))

    def retune(
        self,
        blocking_s: float,
        persist_s: float,
        run_started: float,
        step_s: float | None = None,
        slowdown_s: float | None = None,
        agent: bool = False,
    ) -> None:
        """After a commit: the next interval, from what this save cost. `run_started` (unix
        time) is when this run began, the last restart (for Weibull hazards); `step_s`, the
        measured seconds per step, says how many steps the interval comes to; `slowdown_s`,
        what a save costs the steps beside it (`ckpt.schedule.slowdown`; None: not known
        yet). A save is priced at its blocking time plus that slowdown. `agent`: the saves are
        handed off to a node agent, and `persist_s` is its upload's time to durable."""
        mtbf_s = self.mtbf.job_mtbf_s(self.nodes)
        cost_s = blocking_s + (slowdown_s or 0.0)
        new = self.policy.seconds(cost_s, persist_s, mtbf_s, time.time() - run_started)
        # Never longer than the job's MTBF (nor not a number): a busy time from a clock that
        # jumped, or an upload held up for hours, would otherwise stop the saves for as long.
        new = min(new, mtbf_s) if math.isfinite(new) else mtbf_s
        if step_s:  # IMPORTANT: a clean step between saves, or no step time to price a save against
            new = max(new, 2 * step_s)
        old, self.seconds = self.seconds, new
        self.schedule = {
            "policy": "auto",
            "seconds": round(new, 3),
            "blocking_s": round(blocking_s, 4),
            "slowdown_s": None if slowdown_s is None else round(slowdown_s, 4),
            "cost_s": round(cost_s, 4),
            "persist_s": round(persist_s, 3),
            "persist_of": "node agent's upload" if agent else "save",
            "mtbf_s": round(mtbf_s, 1),
            "goodput": round(expected_goodput(cost_s, new, mtbf_s), 4),
            "nodes": self.nodes,
            "failures_seen": self.mtbf.failures,
        }
        steps = ""
        if step_s:
            self.schedule.update(step_s=round(step_s, 4), steps=max(1, round(new / step_s)))
            steps = f" = {self.schedule['steps']} steps of {step_s:.3g} s"
        if not self._measured or abs(new - old) > 0.1 * old:
            self._measured = True
            slowed = "not measured yet" if slowdown_s is None else f"{slowdown_s:.3g} s"
            log.info(
                "interval: every %.3g s%s (a save costs %.3g s: it blocked the loop %.3g s and slowed the steps beside it %s; %s %.3g s; job MTBF %s on %d node(s); expected goodput %.1f%%; rank 0's costs)",
                new,
                steps,
                cost_s,
                blocking_s,
                slowed,
                "the node agent made it durable in" if agent else "it kept its slot busy",
                persist_s,
                duration(mtbf_s),
                self.nodes,
                100 * self.schedule["goodput"],
            )


def expected_goodput(cost_s: float, interval_s: float, mtbf_s: float) -> float:
    """The share of time left to training when saves cost `cost_s` every `interval_s` and
    failures every `mtbf_s` lose half an interval each (restarts not counted)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    return max(0.0, 1.0 - cost_s / (interval_s + cost_s) - interval_s / (2 * mtbf_s))
