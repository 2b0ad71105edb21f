"""`ckpt plan`: what checkpointing will cost a job before it runs, from the memory ledger.

Checkpoint bytes are the parameters times the bytes each one keeps (weights, optionally
gradients, Adam's two moments, master weights); save and restore times follow from the
bandwidths; the intervals and the expected effective training time ratio (ETTR, useful time
over wall time) from `ckpt.schedule.interval`. Pure arithmetic; the CLI prints it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ckpt.schedule.interval import (
    async_interval,
    async_waste,
    daly,
    daly_exact,
    daly_wall_time_factor,
    young,
)

_SI = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_TIME = {"ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400, "day": 86400, "w": 604800}


def parse_count(text: str) -> float:
    """13e9, 13B, 70b, 1.5T (parameters; B means billions here)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*", str(text), re.I)
    if not m:
        raise ValueError(f"not a count: {text!r} (try 13e9 or 13B)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * scale


def parse_bytes(text: str) -> float:
    """2GB, 500MB, 1.5GiB, 2e9 (bytes); a trailing /s is allowed (a bandwidth). A lowercase
    b is bits, as network rates are quoted: 100Gb/s, 100Gbps = 12.5e9 bytes/s."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*((?:[kKmMgGtTpP]i?)?)([Bb])?\s*(/s|ps)?\s*", str(text))
    if not m or (m.group(2) and m.group(3) is None):
        raise ValueError(f"not a size: {text!r} (try 2GB or 500MB/s; b is bits)")
    unit = m.group(2).lower()
    value = float(m.group(1)) * (_IEC[unit] if unit.endswith("i") else _SI[unit])
    return value / 8 if m.group(3) == "b" else value


def parse_duration(text: str) -> float:
    """6h, 30min, 90s, 50ms, 1.5d, 3600 (seconds)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text), re.I)
    if not m or m.group(2).lower() not in _TIME and m.group(2):
        raise ValueError(f"not a duration: {text!r} (try 6h, 30min, 90s)")
    return float(m.group(1)) * _TIME.get(m.group(2).lower() or "s", 1)


@dataclass(frozen=True)
class Ledger:
    """Bytes per parameter in a checkpoint (defaults: BF16 weights, FP32 Adam moments and
    FP32 master weights: 14 B; keeping BF16 gradients too makes 16)."""

    weights: float = 2.0
    grads: float = 0.0
    adam_m: float = 4.0
    adam_v: float = 4.0
    master: float = 4.0

    @property
    def per_param(self) -> float:
        return self.weights + self.grads + self.adam_m + self.adam_v + self.master


@dataclass(frozen=True)
class Plan:
    checkpoint_bytes: float
    bytes_per_param: float
    bytes_per_gpu: float
    blocking_s: float  # the staging copy of one GPU's shard
    persist_s: float  # all nodes writing in parallel
    restore_s: float
    job_mtbf_s: float
    young_s: float
    daly_s: float
    daly_exact_s: float
    async_s: float
    ettr_sync: float
    ettr_async: float
    slowdown_s: float = 0.0  # what a save costs the steps beside it (issue 42)
    async_blocking_only_s: float = 0.0  # the async interval priced at blocking alone
    ettr_async_blocking_only: float = 0.0  # and its ETTR at the save's real cost


def plan(
    params: float,
    nodes: int,
    gpus_per_node: int,
    write_bandwidth: float,
    mtbf_s: float,
    *,
    read_bandwidth: float | None = None,
    d2h_bandwidth: float = 25e9,
    restart_s: float = 600.0,
    ledger: Ledger = Ledger(),
    persist_s: float | None = None,
    restore_s: float | None = None,
    slowdown_s: float = 0.0,
) -> Plan:
    """Costs and intervals for a job. Bandwidths are per node (bytes/s), `mtbf_s` the job's.
    `persist_s`, `restore_s`: the save's and the restore's times where known better than from
    the bandwidths alone (`ckpt.schedule.scale_model`: requests, metadata). `slowdown_s`: what
    a save costs the steps that run while it persists; the async interval is priced at the
    blocking time plus that, and the interval priced at blocking alone is shown beside it."""
    if slowdown_s < 0:
        raise ValueError("the slowdown must be >= 0")
    if params <= 0 or nodes < 1 or gpus_per_node < 1 or write_bandwidth <= 0 or mtbf_s <= 0:
        raise ValueError("params, nodes, gpus per node, bandwidth and MTBF must be positive")
    size = params * ledger.per_param
    per_gpu = size / (nodes * gpus_per_node)
    blocking = per_gpu / d2h_bandwidth
    persist = size / (nodes * write_bandwidth) if persist_s is None else persist_s
    restore = size / (nodes * (read_bandwidth or write_bandwidth)) if restore_s is None else restore_s
    sync_cost = blocking + persist
    t_exact = daly_exact(sync_cost, mtbf_s)
    cost = blocking + slowdown_s
    t_async = async_interval(cost, mtbf_s, persist)
    t_blocking_only = async_interval(blocking, mtbf_s, persist)
    recover = restart_s + restore
    return Plan(
        checkpoint_bytes=size,
        bytes_per_param=ledger.per_param,
        bytes_per_gpu=per_gpu,
        blocking_s=blocking,
        persist_s=persist,
        restore_s=restore,
        job_mtbf_s=mtbf_s,
        young_s=young(sync_cost, mtbf_s),
        daly_s=daly(sync_cost, mtbf_s),
        daly_exact_s=t_exact,
        async_s=t_async,
        ettr_sync=1 / daly_wall_time_factor(t_exact, sync_cost, mtbf_s, recover),
        ettr_async=max(0.0, 1 - async_waste(t_async, cost, mtbf_s, persist, recover)),
        slowdown_s=slowdown_s,
        async_blocking_only_s=t_blocking_only,
        ettr_async_blocking_only=max(0.0, 1 - async_waste(t_blocking_only, cost, mtbf_s, persist, recover)),
    )


def as_dict(p: Plan) -> dict[str, float]:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in asdict(p).items()}
