"""When to checkpoint: the interval that wastes the least training time, from the save's
cost and the job's mean time between failures. Pure functions of numbers; no I/O.

A job that checkpoints every T seconds of work, with each save costing C seconds of
training and a failure arriving on average every M seconds, loses C/T to saving and, per
failure, the restart time R plus on average half an interval of recomputation. Young (1974)
minimised the first-order model; Daly (2006) the complete one (eq. 37 is his
approximation, `daly_exact` its exact optimum). With asynchronous saves only the blocking
part C_b of a save costs training; the write (latency L) overlaps training, but one save is
in flight at a time, so the interval is never shorter than L, and a failure loses the save
in flight too.

The MTBF is estimated by `MtbfEstimate`: a gamma prior on the failure rate per node-second
(from a node MTBF or a published failure rate) updated by the job's own failures and
exposure, scaled to the job's node count, so a shrunken job checkpoints less often.
Failures that cluster early (Weibull shape < 1) make the hazard fall with the time since the
last failure: `weibull_mtbf` gives the local MTBF that the interval then lengthens with.

All times are in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOUR = 3600.0
DAY = 24 * HOUR


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's interval: sqrt(2·C·M)."""
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate (2006, eq. 37): for C < 2M,
    sqrt(2CM)·[1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C; else M."""
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


def daly_exact(cost_s: float, mtbf_s: float) -> float:
    """The exact optimum of Daly's cost model, where the expected wall time per unit of work
    is proportional to (exp((T + C)/M) − 1)/T: T* = M·(1 + W₀(−exp(−1 − C/M))), W₀ the
    principal branch of Lambert's W."""
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    c = cost_s / mtbf_s
    if c < 1e-8:  # W0 near its branch point cancels in floating point: its series instead
        p = math.sqrt(2 * -math.expm1(-c))
        return mtbf_s * (p - p * p / 3 + 11 * p**3 / 72)
    return mtbf_s * (1 + _lambert_w0(-math.exp(-1 - c)))


def daly_wall_time_factor(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Daly's complete model: expected wall-clock seconds per second of useful work,
    M·exp(R/M)·(exp((T + C)/M) − 1)/T (≥ 1; its inverse is the effective training time
    ratio)."""
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + cost_s) / mtbf_s) / interval_s


def async_interval(blocking_s: float, mtbf_s: float, persist_s: float) -> float:
    """With asynchronous saves: sqrt(2·C_b·M), never shorter than the persist latency L
    (one save in flight at a time: a shorter interval would only skip or wait)."""
    _check_positive(blocking_s=blocking_s, mtbf_s=mtbf_s)
    if persist_s < 0:
        raise ValueError(f"persist_s must be >= 0, not {persist_s}")
    return max(math.sqrt(2 * blocking_s * mtbf_s), persist_s)


def async_waste(interval_s: float, blocking_s: float, mtbf_s: float, persist_s: float, restart_s: float) -> float:
    """Expected fraction of wall time lost, to first order: C_b/T + (R + L + T/2)/M. A failure
    costs the restart, the work since the last committed save (half an interval on average)
    and the save in flight (L)."""
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    return blocking_s / interval_s + (restart_s + persist_s + interval_s / 2) / mtbf_s


@dataclass(frozen=True)
class MtbfEstimate:
    """The job's MTBF from a prior and its own history (gamma-Poisson).

    The failure rate per node-second has a gamma prior with mean 1/node_mtbf_s worth
    `prior_failures` observed failures (the prior's weight: 1 means "as if one failure had
    been seen at that rate"). Each failure the job sees, and each node-second it runs, update
    it; the posterior mean rate times the job's nodes gives the job's MTBF.
    """

    node_mtbf_s: float
    prior_failures: float = 1.0
    failures: int = 0
    node_seconds: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(node_mtbf_s=self.node_mtbf_s, prior_failures=self.prior_failures)
        if self.failures < 0 or self.node_seconds < 0:
            raise ValueError("failures and node_seconds must be >= 0")

    @classmethod
    def from_rate(cls, failures_per_1000_node_days: float, prior_failures: float = 1.0) -> MtbfEstimate:
        """A prior from a published rate (Meta's RSC: 5 to 6.5 per 1000 node-days)."""
        _check_positive(failures_per_1000_node_days=failures_per_1000_node_days)
        return cls(1000 * DAY / failures_per_1000_node_days, prior_failures)

    def observe(self, failures: int, node_seconds: float) -> MtbfEstimate:
        """This estimate, updated by `failures` seen over `node_seconds` of exposure (the sum
        over runs of wall time × nodes)."""
        return MtbfEstimate(self.node_mtbf_s, self.prior_failures, self.failures + failures, self.node_seconds + node_seconds)

    @property
    def node_rate(self) -> float:
        """Posterior mean failures per node-second."""
        alpha = self.prior_failures + self.failures
        beta = self.prior_failures * self.node_mtbf_s + self.node_seconds
        return alpha / beta

    def job_mtbf_s(self, nodes: int) -> float:
        """The MTBF of a job on `nodes` nodes (any one failing stops it)."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, not {nodes}")
        return 1 / (self.node_rate * nodes)


def weibull_mtbf(shape: float, job_mtbf_s: float, since_failure_s: float) -> float:
    """The local MTBF (1 / hazard) at `since_failure_s` after the last failure for Weibull
    inter-failure times of this shape and mean. Shape 1 is the exponential (constant);
    below 1 failures cluster and the local MTBF grows with the time since the last one."""
    _check_positive(shape=shape, job_mtbf_s=job_mtbf_s)
    scale = job_mtbf_s / math.gamma(1 + 1 / shape)
    t = max(since_failure_s, 1e-9 * scale)
    hazard = (shape / scale) * (t / scale) ** (shape - 1)
    return 1 / hazard


def _lambert_w0(x: float) -> float:
    """Principal branch of Lambert's W for -1/e <= x < 0 (all the interval needs)."""
    if not -1 / math.e <= x < 0:
        raise ValueError(f"W0 is computed here for -1/e <= x < 0, not {x}")
    # Start from the branch-point series near -1/e, else from log1p; Halley's iteration.
    p = math.sqrt(max(0.0, 2 * (math.e * x + 1)))
    w = -1 + p - p * p / 3 if x < -0.25 else math.log1p(x)
    for _ in range(50):
        ew = math.exp(w)
        f = w * ew - x
        if f == 0:
            break
        step = f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
        w -= step
        if abs(step) <= 1e-15 * (1 + abs(w)):
            break
    return w


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a positive finite number, not {v}")
