"""What a save costs the steps beside it (`ckpt.schedule.slowdown`), and an interval priced at
it (issue 42): synthetic step times first, then a real loop whose saves burn CPU in the
background."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

import ckpt
from ckpt.schedule.coordinator import Coordinator
from ckpt.schedule.slowdown import Slowdown
from tests.support.cli import ckpt_cli


def run(slowdown: Slowdown, saves: int, *, step_s: float = 0.1, extra: list[float], blocked_s: float = 0.0, noise: float = 0.0, seed: int = 0) -> list[float | None]:
    """`saves` saves, each overlapping len(extra) steps that take step_s + extra[i] (the first
    also holds the blocking time), with 20 clean steps between; the estimate after each."""
    rng = random.Random(seed)
    t, got = 0.0, []
    for _ in range(saves):
        for _ in range(20):
            took = step_s * (1 + noise * rng.uniform(-1, 1))
            t += took
            slowdown.step(t, took, busy=False)
        started = t
        for i, e in enumerate(extra):
            took = step_s * (1 + noise * rng.uniform(-1, 1)) + e + (blocked_s if i == 0 else 0.0)
            t += took
            slowdown.step(t, took, busy=True)
        got.append(slowdown.priced(started, t, blocked_s))
    return got


def test_the_slowdown_is_the_extra_time_of_the_steps_a_save_overlapped_less_its_blocking():
    got = run(Slowdown(), 3, extra=[0.05, 0.05, 0.03, 0.02], blocked_s=0.004)
    assert got == [pytest.approx(0.15)] * 3


def test_with_noisy_steps_the_estimate_is_within_20_percent_after_three_saves():
    """Step times vary by +-20%: one save's figure is off by a few steps' noise; the median of
    the last five is within 20% of the true 0.5 s from the third save on."""
    for seed in range(20):
        got = run(Slowdown(), 6, extra=[0.05] * 10, noise=0.2, seed=seed)
        assert all(g == pytest.approx(0.5, rel=0.2) for g in got[2:]), (seed, got)


def test_no_clean_step_no_estimate_and_a_cheap_save_is_priced_at_nothing():
    slowdown = Slowdown()
    slowdown.step(1.0, 0.1, busy=True)
    assert slowdown.priced(0.5, 1.0, 0.0) is None  # no clean step time to compare with: unknown, not 0
    assert run(Slowdown(), 3, extra=[0.0, 0.0], blocked_s=0.002) == [pytest.approx(0.0, abs=1e-9)] * 3  # never below zero


def test_the_interval_grows_as_the_square_root_of_what_a_save_costs():
    coordinator = Coordinator(ckpt.Auto(node_mtbf_s=600), world=1)
    intervals = []
    for slowdown_s in (0.0, 0.3, 1.2):
        coordinator.retune(0.003, 0.5, 0.0, 0.1, slowdown_s)
        intervals.append(coordinator.seconds)
        assert coordinator.schedule["cost_s"] == pytest.approx(0.003 + slowdown_s, abs=1e-4)
        assert coordinator.schedule["slowdown_s"] == slowdown_s
        assert 0 < coordinator.schedule["goodput"] < 1
    assert intervals[2] / intervals[1] == pytest.approx(math.sqrt(1.203 / 0.303), rel=0.01)
    assert intervals[1] > 5 * intervals[0]  # priced at blocking alone: the busy floor


def train(tmp_path, monkeypatch, slower_s: float, interval, steps: int) -> tuple[ckpt.Checkpointer, float]:
    """A loop of ~20 ms steps whose saves are in flight for at least 0.4 s each (the store is
    slow) and make each step beside them `slower_s` slower: what a save's serialization,
    checksums and writes do to a real loop (the GIL, CPU, memory bandwidth), made a known
    amount, so that the machine's own load does not decide the test. Returns the Checkpointer
    and the true slowdown of a save (the extra time slept, per save)."""
    monkeypatch.setenv("CKPT_FAULT", "before_manifest:0:*:sleep=0.4")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=interval, keep=ckpt.Keep(last=100), lease=None, save_on_exit=False) as cp:
        slept = 0.0
        for _ in range(steps):
            extra = slower_s if cp._slot.busy() else 0.0
            slept += extra
            time.sleep(0.02 + extra)
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        cp.wait()
    return cp, slept / len(list(tmp_path.glob("step-*")))


@pytest.mark.slow
def test_a_save_that_slows_the_steps_beside_it_lengthens_the_interval_and_a_cheap_one_does_not(tmp_path, monkeypatch):
    """Saves in flight ~0.4 s that slow each step beside them by 100 ms (a few steps: ~0.3 s)
    are priced at that (within 35% of the time the loop really lost per save): the interval grows to ~sqrt(2 x cost x M). The same saves slowing
    nothing more are priced at their blocking time and what their own background work costs
    the loop's Python (the GIL: tens of ms here)."""
    auto = ckpt.Auto(node_mtbf_s=20, first_after_s=0.2, first_after_steps=5)
    cheap = train(tmp_path / "cheap", monkeypatch, 0.0, auto, 200)[0].schedule
    cp, truth = train(tmp_path / "costly", monkeypatch, 0.1, auto, 200)
    costly = cp.schedule
    assert costly["slowdown_s"] == pytest.approx(truth, rel=0.35), (truth, costly)
    assert cheap["slowdown_s"] is not None and cheap["slowdown_s"] < 0.1, cheap
    assert costly["cost_s"] > 2 * cheap["cost_s"] and costly["seconds"] > cheap["seconds"], (cheap, costly)
    for sc in (cheap, costly):  # sqrt(2 x cost x M), or the floor of what a save keeps its slot busy
        assert sc["seconds"] == pytest.approx(max(math.sqrt(2 * sc["cost_s"] * sc["mtbf_s"]), 1.1 * sc["persist_s"]), rel=0.05), sc
    # The newest manifest says what it was priced at, and `ckpt show` in words.
    shown = ckpt_cli("show", tmp_path / "costly", check=True).stdout
    assert "slowed the steps beside it" in shown and "expected goodput" in shown, shown


@pytest.mark.slow
def test_under_every_the_slowdown_is_measured_and_nothing_else_changes(tmp_path, monkeypatch):
    cp, truth = train(tmp_path, monkeypatch, 0.015, ckpt.Every(steps=40), 200)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{s:010d}" for s in range(40, 201, 40)]
    assert cp.schedule == {"policy": "every", "steps": 40, "seconds": None}
    assert cp._cadence.estimate()["slowdown_s"] == pytest.approx(truth, rel=0.35)


def test_with_a_node_agent_the_busy_time_is_the_uploads_time_to_durable_not_the_hand_off():
    """A save handed off in 0.5 s whose upload took 30 s to be durable: the next save cannot
    come sooner than the upload ends, whatever the hand-off said."""
    coordinator = Coordinator(ckpt.Auto(node_mtbf_s=600), world=1)
    coordinator.retune(0.001, 0.5, 0.0, None, 0.0)
    assert coordinator.seconds == pytest.approx(math.sqrt(2 * 0.001 * 600), rel=0.01)
    coordinator.durable(30.0)
    coordinator.retune(0.001, 0.5, 0.0, None, 0.0)
    assert coordinator.seconds == pytest.approx(1.1 * 30.0, rel=0.01)
    assert coordinator.schedule["handoff_s"] == 0.5 and coordinator.schedule["durable_s"] == 30.0 and coordinator.schedule["persist_s"] == 30.0
