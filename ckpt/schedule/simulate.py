"""`ckpt simulate`: how much of a long job's wall time is useful training under each interval
policy, in a discrete-event simulation with failures at published rates.

The job trains; a save blocks it for C_b, then persists for L while it trains on, slowed by
what the save's background work takes from it (`slowdown_s`, counted as time lost; one save in
flight: a save due while the last is still persisting waits for it); a failure loses the work
since the last committed save and the save in flight, then costs a restart drawn from
[restart_min, restart_max]. Every policy sees the same failures and restarts (common random
numbers), so their differences are the policies'. The effective training time ratio (ETTR)
is the work done over the wall time.

Policies: a fixed interval (torchtitan's default of 500 steps at a stated step time); Young's
and Daly's intervals for a synchronous save of C_b + L with the true MTBF, and the asynchronous
optimum sqrt(2·C_b·M) with the true MTBF (oracles: they know M); and the coordinator, which
starts from a wrong prior and learns M from the failures it sees, with `ckpt.Auto`'s own rule
(its first save of each run after `first_after_s`, M learned when a run starts).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt.schedule.interval import DAY, HOUR, MtbfEstimate, async_interval, daly, young
from ckpt.schedule.policy import Auto

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days of training on 16,384 GPUs.
LLAMA3_MTBF_S = 54 * DAY / 419


@dataclass(frozen=True)
class Job:
    mtbf_s: float = LLAMA3_MTBF_S  # the true job MTBF
    blocking_s: float = 0.05  # C_b: what one save blocks the loop
    slowdown_s: float = 0.0  # what one save costs the steps beside it (issue 42): lost like blocking
    persist_s: float = 30.0  # L: from save to commit
    restart_min_s: float = 5 * 60.0
    restart_max_s: float = 20 * 60.0
    wall_s: float = 54 * DAY
    step_s: float = 2.0  # for the fixed interval in steps
    fixed_steps: int = 500
    first_after_s: float = 60.0  # the coordinator's first save of each run (ckpt.Auto's default)


@dataclass
class Outcome:
    ettr: list[float] = field(default_factory=list)
    interval_s: list[float] = field(default_factory=list)  # the mean interval of each run
    last_interval_s: list[float] = field(default_factory=list)  # where each run ended up


Interval = Callable[[MtbfEstimate | None], float]


def simulate(job: Job, policy: str, *, prior_factor: float = 1.0, runs: int = 10, seed: int = 0) -> Outcome:
    """ETTR of `policy` over `runs` simulated jobs (seeds seed..seed+runs-1)."""
    choose = _policy(job, policy)
    out = Outcome()
    for r in range(runs):
        rng = random.Random(seed + r)
        learner = MtbfEstimate(job.mtbf_s * prior_factor) if policy == "coordinator" else None
        ettr, mean_t, last_t = _one_run(job, choose, rng, learner)
        out.ettr.append(ettr)
        out.interval_s.append(mean_t)
        out.last_interval_s.append(last_t)
    return out


def _policy(job: Job, policy: str) -> Interval:
    cost = job.blocking_s + job.slowdown_s
    sync_cost = job.blocking_s + job.persist_s  # a synchronous save has no steps beside it
    fixed = {
        "fixed": job.fixed_steps * job.step_s,
        "young": young(sync_cost, job.mtbf_s),
        "daly": daly(sync_cost, job.mtbf_s),
        "async-oracle": async_interval(cost, job.mtbf_s, job.persist_s),
        # what ckpt did before it measured the slowdown, with the true MTBF as the oracle's
        "async-oracle-blocking-only": async_interval(job.blocking_s, job.mtbf_s, job.persist_s),
    }
    if policy in fixed:
        return lambda _est: fixed[policy]
    if policy == "coordinator":
        # IMPORTANT: only what the job can know: its measured costs and its estimate of M.
        auto = Auto(node_mtbf_s=job.mtbf_s)  # the shipped rule (its prior is the learner's)
        return lambda est: auto.seconds(cost, job.persist_s, est.job_mtbf_s(1))  # type: ignore[union-attr]
    raise ValueError(f"unknown policy {policy!r}")


def _one_run(job: Job, choose: Interval, rng: random.Random, learner: MtbfEstimate | None) -> tuple[float, float, float]:
    """(ETTR, mean interval, last interval) of one simulated job."""
    wall = work = committed = 0.0
    run_start = 0.0  # wall time the current run (since the last restart) began
    pending: tuple[float, float] | None = None  # (work saved, wall time of its commit)
    next_failure = rng.expovariate(1 / job.mtbf_s)
    # The coordinator, as ckpt ships it: each run's first save after first_after_s, the
    # optimum from the first commit on; it learns M only when a run starts (from the failures
    # of the runs before), and a new choice applies to the countdown in progress.
    measured = learner is None
    interval = choose(learner) if measured else job.first_after_s
    next_due, last_save_work = interval, 0.0
    intervals: list[float] = []
    while wall < job.wall_s:
        commit_at = pending[1] if pending else math.inf
        due_at = wall + max(0.0, next_due - work)
        if pending is None:
            t = min(next_failure, due_at, job.wall_s)
            work += t - wall
        else:  # a save due while one is in flight waits for it: the loop stalls at due_at
            t = min(next_failure, commit_at, job.wall_s)
            work += max(0.0, min(t, due_at) - wall)
        wall = t
        if t == job.wall_s:
            break
        if t == next_failure:
            # Work since the last commit and the save in flight are lost. Failures are not
            # drawn during restarts (the same for every policy; Daly's model, in `plan`, has
            # them). A failure while a save blocks can land "before" the blocking ended: the
            # rest of that blocking never happens, so the clock is right.
            work, pending = committed, None
            if learner is not None:
                learner = learner.observe(1, wall - run_start)
            wall += rng.uniform(job.restart_min_s, job.restart_max_s)
            next_failure = wall + rng.expovariate(1 / job.mtbf_s)  # memoryless: drawn anew
            run_start = wall
            measured = learner is None
            interval = choose(learner) if measured else job.first_after_s
            next_due = last_save_work = work
            next_due += interval
        elif pending is not None and t == commit_at:
            committed, pending = pending[0], None
            if not measured:
                measured, interval = True, choose(learner)
                next_due = last_save_work + interval
        else:  # a save: the loop blocks for C_b, then it persists while training goes on, slowed
            wall += job.blocking_s + job.slowdown_s
            pending = (work, wall + job.persist_s)
            intervals.append(interval)
            last_save_work, next_due = work, work + interval
    return work / job.wall_s, statistics.fmean(intervals) if intervals else math.inf, intervals[-1] if intervals else math.inf


def compare(job: Job, *, runs: int = 10, seed: int = 0) -> dict[str, dict[str, float]]:
    """Every policy on the same failures: mean and spread of ETTR, mean interval."""
    rows: dict[str, dict[str, float]] = {}
    cases = [("fixed", 1.0), ("young", 1.0), ("daly", 1.0), ("async-oracle", 1.0), ("coordinator", 2.0), ("coordinator", 0.5)]
    if job.slowdown_s > 0:
        cases.append(("async-oracle-blocking-only", 1.0))
    for policy, factor in cases:
        o = simulate(job, policy, prior_factor=factor, runs=runs, seed=seed)
        name = {
            "coordinator": f"coordinator (prior {factor:g}x MTBF)",
            "async-oracle-blocking-only": "async-oracle priced at blocking only",
        }.get(policy, policy)
        rows[name] = {
            "ettr": statistics.fmean(o.ettr),
            "ettr_sd": statistics.stdev(o.ettr) if len(o.ettr) > 1 else 0.0,
            "interval_s": statistics.fmean(o.interval_s),
            "last_interval_s": statistics.fmean(o.last_interval_s),
        }
    return rows


def scenario(name: str, nodes: int = 2048) -> Job:
    """Published failure rates: "llama3" (job MTBF 3.1 h) or "rsc" (5.75 per 1000 node-days
    over `nodes` nodes)."""
    if name == "llama3":
        return Job()
    if name == "rsc":
        return Job(mtbf_s=1000 * DAY / 5.75 / nodes)
    raise ValueError(f"unknown scenario {name!r}: llama3 or rsc")


__all__ = ["HOUR", "Job", "compare", "scenario", "simulate"]
