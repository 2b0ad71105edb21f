"""`ckpt plan`: the memory ledger, units as people write them, and the CLI's output."""

from __future__ import annotations

import json
import subprocess

import pytest

from ckpt.schedule.interval import HOUR, async_interval, daly_exact
from ckpt.schedule.plan import Ledger, parse_bytes, parse_count, parse_duration, plan
from tests.support.cli import ckpt_cli


def test_the_ledger_gives_designs_worked_case_208_gb_for_13b_at_16_bytes_per_parameter():
    assert Ledger().per_param == 14  # BF16 weights, FP32 Adam moments and master weights
    p = plan(13e9, 8, 8, 2e9, 6 * HOUR, ledger=Ledger(grads=2))
    assert p.checkpoint_bytes == pytest.approx(208e9)
    assert p.persist_s == pytest.approx(208e9 / (8 * 2e9))
    assert p.daly_exact_s == pytest.approx(daly_exact(p.blocking_s + p.persist_s, 6 * HOUR))
    assert p.async_s == pytest.approx(async_interval(p.blocking_s, 6 * HOUR, p.persist_s))
    assert 0.5 < p.ettr_sync < p.ettr_async < 1  # async pays only the staging copy


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GB/s", 2e9), ("500MB/s", 5e8), ("1.5GiB/s", 1.5 * 2**30), ("2e9", 2e9), ("10 GB", 1e10), ("3TB", 3e12), ("100Gbps", 12.5e9), ("8gb/s", 1e9)],
)
def test_sizes_and_bandwidths_parse_as_written(text, value):
    assert parse_bytes(text) == pytest.approx(value)


def test_counts_and_durations_parse_as_written():
    assert parse_count("13e9") == parse_count("13B") == 13e9
    assert parse_count("1.5T") == 1.5e12
    assert [parse_duration(t) for t in ("6h", "90min", "30s", "1.5d", "3600")] == [21600, 5400, 30, 129600, 3600]
    for bad, fn in (("13x", parse_count), ("2 parsecs", parse_duration), ("fast", parse_bytes), ("2ib", parse_bytes)):
        with pytest.raises(ValueError):
            fn(bad)


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    return ckpt_cli(*args)


def test_ckpt_plan_prints_a_table_and_json_and_refuses_bad_units_in_one_line():
    args = ["plan", "--params", "13e9", "--nodes", "8", "--gpus-per-node", "8", "--write-bandwidth", "2GB/s", "--mtbf", "6h"]
    out = _ckpt(*args, "--keep-grads")
    assert out.returncode == 0 and "208.0 GB (16 B/param)" in out.stdout and "ETTR" in out.stdout
    doc = json.loads(_ckpt(*args, "--json").stdout)
    assert doc["checkpoint_bytes"] == pytest.approx(182e9) and doc["job_mtbf_s"] == 6 * HOUR
    node = json.loads(_ckpt(*args[:-2], "--node-mtbf", "48h", "--json").stdout)
    assert node["job_mtbf_s"] == 6 * HOUR  # a node's MTBF over 8 nodes
    bad = _ckpt("plan", "--params", "13e9", "--nodes", "8", "--write-bandwidth", "fast", "--mtbf", "6h")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a size" in bad.stderr


def test_without_failures_a_job_loses_only_its_blocking_time():
    from ckpt.schedule.simulate import Job, simulate

    job = Job(mtbf_s=1e12, blocking_s=1.0, persist_s=10.0, wall_s=10 * 86400, fixed_steps=50, step_s=2.0)
    out = simulate(job, "fixed", runs=1)
    assert out.ettr[0] == pytest.approx(100 / 101, rel=1e-3)  # 1 s blocked per 100 s of work


@pytest.mark.parametrize("scenario", ["llama3", "rsc"])
@pytest.mark.parametrize(("blocking", "persist"), [(0.05, 30.0), (2.0, 60.0)])
def test_the_coordinator_learning_from_a_wrong_prior_is_within_2_points_of_the_best_oracle(scenario, blocking, persist):
    import dataclasses

    from ckpt.schedule.simulate import compare
    from ckpt.schedule.simulate import scenario as make

    job = dataclasses.replace(make(scenario), blocking_s=blocking, persist_s=persist, wall_s=20 * 86400)
    rows = compare(job, runs=4)
    best = max(rows[k]["ettr"] for k in ("young", "daly", "async-oracle"))
    for factor in ("2", "0.5"):
        got = rows[f"coordinator (prior {factor}x MTBF)"]["ettr"]
        assert got >= best - 0.02
        assert got >= rows["fixed"]["ettr"]


@pytest.mark.parametrize("factor", [10.0, 0.1])
def test_the_coordinator_ends_at_the_oracles_interval_from_a_prior_off_by_10x(factor):
    import dataclasses

    from ckpt.schedule.simulate import scenario, simulate

    # C_b = 2 s, L = 60 s: the optimum (211 s) is well above the floor, so the interval shows
    # what was learned (without learning, a 10x prior would stay at sqrt(10) x 211 s).
    job = dataclasses.replace(scenario("llama3"), blocking_s=2.0, persist_s=60.0, wall_s=20 * 86400)
    oracle = simulate(job, "async-oracle", runs=1).last_interval_s[0]
    learned = simulate(job, "coordinator", prior_factor=factor, runs=3).last_interval_s
    assert all(abs(t / oracle - 1) < 0.1 for t in learned), (oracle, learned)


def test_ckpt_simulate_reports_the_policies_and_the_verdict():
    out = _ckpt("simulate", "--runs", "2", "--days", "5", "--json")
    doc = json.loads(out.stdout)
    assert set(doc["policies"]) >= {"fixed", "young", "daly", "async-oracle", "coordinator (prior 2x MTBF)"}
    assert doc["coordinator_above_fixed"] is True and doc["coordinator_gap_pp"] <= 2
    assert "ETTR" in _ckpt("simulate", "--runs", "1", "--days", "2").stdout


def test_with_a_slowdown_the_coordinator_prices_the_whole_cost_and_blocking_only_pricing_loses():
    """The stall benchmark's kind of save: 3 ms blocked, 0.3 s lost by the steps beside it,
    MTBF 10 min. Priced at the whole cost the coordinator is within a point of the oracle;
    priced at the blocking time it saves ~10x too often and loses several points (issue 42)."""
    from ckpt.schedule.simulate import Job, compare

    job = Job(mtbf_s=600, blocking_s=0.003, slowdown_s=0.3, persist_s=1.0, restart_min_s=10, restart_max_s=30, wall_s=2 * 86400, step_s=0.1, fixed_steps=100)
    rows = compare(job, runs=3)
    oracle = rows["async-oracle"]
    assert oracle["interval_s"] == pytest.approx(async_interval(0.303, 600, 1.0))
    for factor in ("2", "0.5"):
        assert rows[f"coordinator (prior {factor}x MTBF)"]["ettr"] >= oracle["ettr"] - 0.01
    blocking_only = rows["async-oracle priced at blocking only"]
    assert blocking_only["interval_s"] < oracle["interval_s"] / 5 and blocking_only["ettr"] < oracle["ettr"] - 0.03
    out = json.loads(_ckpt("simulate", "--mtbf", "10min", "--blocking", "3ms", "--slowdown", "300ms", "--persist", "1s", "--restart", "10s-30s", "--days", "1", "--runs", "1", "--json").stdout)
    assert out["blocking_only_loss_pp"] > 3


def test_ckpt_plan_prices_the_async_interval_at_blocking_plus_slowdown():
    args = ["plan", "--params", "7B", "--nodes", "4", "--write-bandwidth", "2GB/s", "--mtbf", "2h", "--json"]
    base, slowed = (json.loads(_ckpt(*args, *extra).stdout) for extra in ((), ("--slowdown", "5s")))
    assert base["slowdown_s"] == 0 and base["async_s"] == base["async_blocking_only_s"]
    assert slowed["async_s"] == pytest.approx(async_interval(slowed["blocking_s"] + 5, 2 * HOUR, slowed["persist_s"]))
    assert slowed["ettr_async"] > slowed["ettr_async_blocking_only"]
    assert "priced at blocking only" in _ckpt(*args[:-1], "--slowdown", "5s").stdout
