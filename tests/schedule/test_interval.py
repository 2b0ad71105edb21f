"""The interval policy (issue 5's pure math), checked against published values and against
brute-force minimisation of the cost models it claims to optimise."""

from __future__ import annotations

import math

import pytest

from ckpt.schedule.interval import (
    DAY,
    HOUR,
    MtbfEstimate,
    async_interval,
    async_waste,
    daly,
    daly_exact,
    daly_wall_time_factor,
    weibull_mtbf,
    young,
)

MIN = 60.0


@pytest.mark.parametrize(("mtbf_s", "minutes"), [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MIN, 9.1)])
def test_daly_reproduces_his_published_cases_for_a_five_minute_checkpoint(mtbf_s, minutes):
    assert daly(5 * MIN, mtbf_s) / MIN == pytest.approx(minutes, abs=0.5 if minutes > 10 else 0.05)


def test_young_is_the_first_order_optimum_and_daly_falls_back_to_the_mtbf_when_saves_cost_more():
    assert young(5 * MIN, 24 * HOUR) == pytest.approx(math.sqrt(2 * 300 * 86400))
    assert daly(3 * HOUR, 1 * HOUR) == 1 * HOUR  # C >= 2M


def _argmin(f, lo: float, hi: float) -> float:
    """Golden-section search on a unimodal function."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(200):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


@pytest.mark.parametrize(("cost_s", "mtbf_s"), [(5 * MIN, 24 * HOUR), (5 * MIN, 6 * HOUR), (5 * MIN, 15 * MIN), (2.0, 3.1 * HOUR), (600.0, 600.0)])
def test_daly_exact_minimises_dalys_complete_model(cost_s, mtbf_s):
    best = _argmin(lambda t: daly_wall_time_factor(t, cost_s, mtbf_s), 1e-3, 20 * mtbf_s)
    assert daly_exact(cost_s, mtbf_s) == pytest.approx(best, rel=1e-6)
    # and eq. 37 is close to it where Daly says it is (C well below M)
    if cost_s < mtbf_s / 10:
        assert daly(cost_s, mtbf_s) == pytest.approx(best, rel=0.01)


def test_an_async_interval_balances_blocking_time_and_is_never_shorter_than_the_write():
    m = 3.1 * HOUR  # Llama 3's job MTBF
    t = async_interval(0.05, m, persist_s=30)
    best = _argmin(lambda x: async_waste(x, 0.05, m, 30, 600), 1, 10 * m)
    assert t == pytest.approx(max(best, 30), rel=1e-6)
    assert async_interval(0.001, 60.0, persist_s=30) == 30  # sqrt(2·0.001·60) = 0.35 s < L


def test_the_mtbf_estimate_starts_at_the_prior_and_learns_the_jobs_own_rate():
    prior = MtbfEstimate.from_rate(6.0, prior_failures=2)  # Meta RSC: 6 per 1000 node-days
    assert prior.job_mtbf_s(1) == pytest.approx(1000 * DAY / 6)
    assert prior.job_mtbf_s(100) == pytest.approx(1000 * DAY / 6 / 100)  # any node stops the job
    # The job fails 10 times as often as the prior says, seen over a long stretch.
    true_node_mtbf = 1000 * DAY / 60
    seen = prior.observe(failures=2000, node_seconds=2000 * true_node_mtbf)
    assert seen.job_mtbf_s(1) == pytest.approx(true_node_mtbf, rel=0.01)
    # A little data moves it part of the way, never past the data.
    early = prior.observe(failures=2, node_seconds=2 * true_node_mtbf)
    assert true_node_mtbf < early.job_mtbf_s(1) < prior.job_mtbf_s(1)


def test_a_job_that_shrinks_gets_a_longer_mtbf_and_so_a_longer_interval():
    est = MtbfEstimate(node_mtbf_s=30 * DAY)
    assert est.job_mtbf_s(8) == pytest.approx(2 * est.job_mtbf_s(16))
    assert async_interval(1.0, est.job_mtbf_s(8), 0) > async_interval(1.0, est.job_mtbf_s(16), 0)


def test_weibull_with_shape_below_one_lengthens_the_interval_as_time_since_a_failure_grows():
    m = 3 * HOUR
    assert weibull_mtbf(1.0, m, 10.0) == pytest.approx(m)  # exponential: constant
    local = [weibull_mtbf(0.7, m, t) for t in (60.0, HOUR, 10 * HOUR)]
    assert local[0] < local[1] < local[2]
    assert young(60, local[0]) < young(60, local[2])


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_nonsense_inputs_are_refused_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="positive finite"):
        young(bad, HOUR)
    with pytest.raises(ValueError, match="positive finite"):
        MtbfEstimate(node_mtbf_s=bad)


def test_auto_waits_for_a_measurement_then_takes_the_async_optimum():
    from ckpt.schedule.policy import Auto

    auto = Auto(node_mtbf_s=30 * DAY, first_after_s=120)
    assert auto.seconds(None, None, 3 * HOUR) == 120
    assert auto.seconds(0.2, 40, 3 * HOUR) == pytest.approx(math.sqrt(2 * 0.2 * 3 * HOUR))
    assert auto.seconds(0.0, 40, 60.0) == pytest.approx(44)  # never more often than a save keeps its slot (+10 %)
    assert Auto().prior().job_mtbf_s(1) == pytest.approx(1000 * DAY / 5)
    with pytest.raises(ValueError):
        Auto(first_after_s=0)


def test_exposure_counts_failed_runs_and_node_time():
    from ckpt.schedule.policy import exposure

    runs = [(16, 3600.0, True), (16, 7200.0, False), (8, 1800.0, True)]  # 8 ranks per node
    assert exposure(runs, ranks_per_node=8) == (2, 3600 * 2 + 7200 * 2 + 1800 * 1)


def test_auto_with_clustered_failures_lengthens_its_interval_as_the_run_survives():
    from ckpt.schedule.policy import Auto

    auto = Auto(node_mtbf_s=30 * DAY, weibull_shape=0.6)
    early, late = (auto.seconds(1.0, 10.0, 3 * HOUR, since) for since in (60.0, 12 * HOUR))
    assert early < auto.seconds(1.0, 10.0, 3 * HOUR, 3 * HOUR) < late
    assert Auto(weibull_shape=None).seconds(1.0, 10.0, 3 * HOUR, 60.0) == pytest.approx(math.sqrt(2 * 3 * HOUR))


def test_daly_exact_stays_accurate_for_tiny_costs():
    assert daly_exact(1e-6, 1e9) == pytest.approx(young(1e-6, 1e9), rel=1e-3)
