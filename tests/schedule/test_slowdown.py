"""What a save costs the steps beside it (`ckpt.schedule.slowdown`), and an interval priced at
it (issue 42): synthetic step times first, then a real loop whose saves burn CPU in the
background."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import pytest
import torch

import ckpt
from ckpt.schedule.coordinator import Coordinator
from ckpt.schedule.slowdown import Slowdown
from tests.support.cli import ckpt_cli


def drive(slowdown: Slowdown, saves: int, *, step: Callable[[int, bool], float], save_steps: int, blocked_s: float = 0.0, clean: int = 40) -> list[float | None]:
    """`saves` saves of `save_steps` steps each (the first calls it, the last ends after its
    commit), `clean` clean steps before the first and after each; `step(i, busy)` is the i-th
    step's time. The estimate after each save and the clean steps after it."""
    i, got = 0, []
    for n in range(saves):
        for _ in range(clean if n == 0 else 0):
            slowdown.step(step(i, False), busy=False)
            i += 1
        slowdown.began()
        for k in range(save_steps):
            if k == save_steps - 1:
                slowdown.committed(blocked_s)
            took = step(i, True) + (blocked_s if k == 0 else 0.0)
            slowdown.step(took, busy=k < save_steps - 1)
            i += 1
        for _ in range(clean):  # a save is priced once the clean steps after it are known too
            slowdown.step(step(i, False), busy=False)
            i += 1
        got.append(slowdown.estimate())
    return got


def noisy(base: float, rel: float, extra: float, seed: int) -> Callable[[int, bool], float]:
    """Steps of `base` +- `rel`, `extra` longer beside a save."""
    r = random.Random(seed)
    return lambda i, busy: base * (1 + rel * r.uniform(-1, 1)) + (extra if busy else 0.0)


def some_slow(share: float, extra: float, seed: int) -> Callable[[int, bool], float]:
    """0.1 s steps, `share` of them 3x slower (GC, a slow batch), `extra` longer beside a save."""
    r = random.Random(seed)
    return lambda i, busy: (0.3 if r.random() < share else 0.1) + (extra if busy else 0.0)


def rising(extra: float, seed: int) -> Callable[[int, bool], float]:
    """Steps rising from 0.1 to 0.2 s over 20,000 steps, +-1 %, `extra` longer beside a save."""
    r = random.Random(seed)
    return lambda i, busy: (0.1 + 0.1 * min(i, 20_000) / 20_000) * (1 + 0.01 * r.uniform(-1, 1)) + (extra if busy else 0.0)


# (what the steps are like, the save's steps, the true slowdown per save, how close, as a
# share of the truth or of 1 s): a table of the step-time patterns a job has.
CASES = {
    "constant steps, 50 ms more beside a save": (lambda i, busy: 0.1 + (0.05 if busy else 0), 10, 0.5, 0.05),
    "20% noise, 50 ms more": (noisy(0.1, 0.2, 0.05, 1), 10, 0.5, 0.2),
    "20% noise, nothing more": (noisy(0.1, 0.2, 0.0, 3), 100, 0.0, 0.3),
    "an evaluation of 3 s every 50 steps, nothing more": (lambda i, busy: 3.0 if i % 50 == 49 else 0.1, 100, 0.0, 0.05),
    "5% of steps 3x slower, nothing more": (some_slow(0.05, 0.0, 5), 600, 0.0, 0.3),
    "5% of steps 3x slower, 20 ms more": (some_slow(0.05, 0.02, 6), 100, 2.0, 0.25),
    "a 12,000-step save of 5 ms steps, 1 ms more": (lambda i, busy: 0.005 + (0.001 if busy else 0), 12000, 12.0, 0.05),
    # The step time rising through a save (a warm-up, a curriculum of longer sequences) is no
    # cost: a save is priced against the clean steps on both sides of it (outside review: the
    # steps before alone priced this rise at 2.5 s a save).
    "steps rising 0.1 to 0.2 s over 20,000 steps, 1,000-step saves, nothing more": (rising(0.0, 8), 1000, 0.0, 0.1),
    "the same rise, 300-step saves, 10 ms more": (rising(0.01, 9), 300, 3.0, 0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_the_time_the_steps_beside_a_save_lost(case):
    step, save_steps, truth, close = CASES[case]
    got = drive(Slowdown(), 8, step=step, save_steps=save_steps, blocked_s=0.004)
    # Unknown until the third save (one save's stall is not its price), then within `close`
    # of the truth from that save on: the estimate converges in 3 saves (docs/training-loop.md).
    assert got[:2] == [None, None], (case, got)
    assert all(g is not None and abs(g - truth) <= close * max(truth, 1.0) for g in got[2:]), (case, got)


def test_a_save_shorter_than_a_step_is_priced_at_that_step_less_its_blocking():
    """2 s steps, a save that lives within one of them and slows it by 0.5 s: priced at the
    commit it would be priced at nothing (no step beside it had ended)."""
    got = drive(Slowdown(), 5, step=noisy(2.0, 0.02, 0.5, 7), save_steps=1, blocked_s=0.01)
    assert got[-1] == pytest.approx(0.5, abs=0.1)


def test_one_stall_beside_the_first_save_is_not_its_price():
    """A 4 s data-loader stall during the first save, nothing more: one long step among its 20."""
    got = drive(Slowdown(), 4, step=lambda i, busy: 4.0 if i == 45 else 0.1, save_steps=20)
    assert got == [None, None, 0.0, 0.0]  # trusted from the third save on


def test_saves_back_to_back_are_not_priced_against_a_stale_baseline():
    """The step time drifts from 0.1 to 0.2 s while saves run back to back (no clean step
    between): the three closest to the clean steps are priced (the drift reads as a slowdown
    there), then none: the estimate stops, it does not grow with the drift."""
    slowdown = Slowdown()
    for _ in range(40):
        slowdown.step(0.1, busy=False)
    t, after = 0.1, []
    for _ in range(10):
        slowdown.began()  # the save before is still in flight: it ends here
        for k in range(20):
            t += 0.0005
            if k == 19:
                slowdown.committed(0.0)
            slowdown.step(t, busy=True)
        after.append(slowdown.estimate())
    assert slowdown.saves == 3 and after[-1] == after[3] and after[-1] < 0.5, after


def test_no_clean_step_no_estimate_and_never_below_zero():
    slowdown = Slowdown()
    slowdown.began()
    slowdown.step(0.1, busy=True)
    slowdown.committed(0.0)
    slowdown.step(0.1, busy=False)
    assert slowdown.estimate() is None  # no clean step time to compare with: unknown, not 0
    assert drive(Slowdown(), 3, step=lambda i, busy: 0.1 - (0.01 if busy else 0), save_steps=5)[-1] == 0.0


def test_the_slowest_of_many_ranks_is_not_priced_at_their_noise():
    """The save is priced at the largest of the ranks' figures: over 256 ranks whose steps vary
    by +-30 % and that no save slows, the largest of W noises would price a save (0.18 s here
    with one rank's margin); the margin grows with the ranks (`Slowdown.z`) and it does not.
    A real slowdown (2 ms a step beside a save, steps of 0.1 s +- 2 %) is still priced on all."""
    assert Slowdown(1).z == pytest.approx(2.0, abs=0.01) and Slowdown(256).z > 3.5
    quiet = [drive(Slowdown(256), 5, step=noisy(0.5, 0.3, 0.0, seed), save_steps=20)[-1] for seed in range(256)]
    assert max(quiet) == 0.0, max(quiet)
    real = [drive(Slowdown(256), 5, step=noisy(0.1, 0.02, 0.002, seed), save_steps=20)[-1] for seed in range(32)]
    assert all(g is not None and 0.01 <= g <= 0.05 for g in real), real  # truth 0.04 s a save, less the noise margin


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


def train(tmp_path, monkeypatch, slower_s: float, interval, steps: int, fault: str = "before_manifest:0:*:sleep=0.4") -> tuple[ckpt.Checkpointer, float]:
    """A loop of ~20 ms steps whose saves are in flight for at least 0.4 s each (the store is
    slow) and make each step beside them `slower_s` slower: what a save's serialization,
    checksums and writes do to a real loop (the GIL, CPU, memory bandwidth), made a known
    amount, so that the machine's own load does not decide the test. Returns the Checkpointer
    and the true slowdown of a save (the extra time slept, per save). `fault`: what keeps the
    save in flight (a slow store by default)."""
    monkeypatch.setenv("CKPT_FAULT", fault)
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


def within(estimate: float | None, truth: float) -> bool:
    """The estimate against the time the test made the loop lose: not below 65 % of it, and
    above it by no more than the machine's own share (a loaded machine slows the steps beside a
    real save too: the suite runs 3 workers on 2 cores)."""
    return estimate is not None and 0.65 * truth <= estimate <= 2 * truth + 0.05


@pytest.mark.slow
def test_a_save_that_slows_the_steps_beside_it_lengthens_the_interval_and_a_cheap_one_does_not(tmp_path, monkeypatch):
    """Saves in flight ~0.4 s that slow each step beside them by 100 ms (a few steps: ~0.3 s)
    are priced at that (within 35% of the time the loop really lost per save): the interval grows to ~sqrt(2 x cost x M). The same saves slowing
    nothing more are priced at their blocking time and what their own background work costs
    the loop's Python (the GIL: tens of ms here)."""
    auto = ckpt.Auto(node_mtbf_s=20, first_after_s=0.2, first_after_steps=5)
    cheap = train(tmp_path / "cheap", monkeypatch, 0.0, auto, 300)[0].schedule
    cp, truth = train(tmp_path / "costly", monkeypatch, 0.1, auto, 300)
    costly = cp.schedule
    assert within(costly["slowdown_s"], truth), (truth, costly)
    assert (cheap["slowdown_s"] or 0.0) < 0.1, cheap  # None: fewer than 3 saves priced yet, priced at blocking
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
    # measured (how closely: the Auto test above; under the suite's load a 150-step run's
    # estimate has read 0.08-0.19 s against 0.13-0.14 s)
    assert 0.25 * truth <= (cp._cadence.estimate()["slowdown_s"] or 0.0) <= 2 * truth + 0.05, truth


@pytest.mark.slow
def test_a_save_whose_background_work_burns_cpu_is_priced_at_what_it_costs_the_loop(tmp_path, monkeypatch):
    """The same saves, in flight 0.4 s each: once their background thread computes in Python
    all that time (`burn=`: CPU and the GIL, as serialization and checksums take them), once
    it waits on a slow store (`sleep=`). Nothing else slows the loop. The burning saves slow
    the steps beside them, are priced at that, and the interval grows as sqrt(cost); the
    waiting ones cost next to nothing and keep the short interval."""
    auto = ckpt.Auto(node_mtbf_s=20, first_after_s=0.2, first_after_steps=5)
    waits = train(tmp_path / "waits", monkeypatch, 0.0, auto, 300, "before_manifest:0:*:sleep=0.4")[0]
    burns = train(tmp_path / "burns", monkeypatch, 0.0, auto, 300, "before_manifest:0:*:burn=0.4")[0]
    cheap, costly = waits.schedule, burns.schedule
    # what the burn cost the loop, offline: the steps beside a save against the clean ones
    assert costly["slowdown_s"] is not None and costly["slowdown_s"] > 0.05, (cheap, costly)
    assert costly["slowdown_s"] > 3 * (cheap["slowdown_s"] or 0.0), (cheap, costly)
    assert costly["seconds"] > 1.5 * cheap["seconds"], (cheap, costly)
    for sc in (cheap, costly):
        assert sc["seconds"] == pytest.approx(max(math.sqrt(2 * sc["cost_s"] * sc["mtbf_s"]), 1.1 * sc["persist_s"]), rel=0.05), sc


PRICED = {"policy": "auto", "seconds": 7.7, "cost_s": 0.05, "blocking_s": 0.002, "slowdown_s": 0.048, "persist_s": 0.4, "mtbf_s": 600.0, "goodput": 0.99}


@pytest.mark.parametrize(
    "schedule, says",
    [
        (PRICED, "slowed the steps beside it 0.048 s), its slot busy 0.4 s"),
        ({**PRICED, "persist_of": "node agent's upload", "persist_s": 3.0}, "made durable by the node agent in 3 s"),
        ({**PRICED, "slowdown_s": None}, "slowed the steps beside it not measured yet"),
        ({**PRICED, "seconds": "7 s"}, ""),  # the manifest may be anyone's: not numbers, no line
        ({**PRICED, "goodput": True}, ""),
        ({**PRICED, "seconds": 10**400}, ""),  # float() of it overflows
        ({**PRICED, "cost_s": float("nan")}, ""),
        ({k: v for k, v in PRICED.items() if k != "mtbf_s"}, ""),
        ({**PRICED, "policy": "every"}, ""),
    ],
)
def test_ckpt_show_says_what_an_interval_was_priced_at_and_nothing_for_a_schedule_of_other_values(schedule, says):
    from ckpt.cli.inspection import _priced

    got = _priced(schedule)
    assert (says in got) if says else got == "", got


@pytest.mark.parametrize("at", [1e308, "later", float("nan"), -5.0, True, "now+3e8"])
def test_a_status_file_time_from_a_jumped_clock_or_a_hostile_agent_never_stops_the_saves(tmp_path, at):
    """The agent's status file says when it recorded the commit; the trainer takes the time
    from the save's start to then as what a save keeps busy. A time in the future is taken
    as now, anything not a finite number is not taken, and whatever it says the interval is
    never longer than the job's MTBF (outside review: 1e308 crashed the save's aftermath, a
    clock 10 years ahead chose a 10-year interval)."""
    from ckpt.node.handoff import Handoff, _Handed
    from ckpt.node.spool import Request, Spool, write_json
    from ckpt.storage.store import Store

    started = time.time() - 2.0
    status = tmp_path / "spool" / "status.json"
    status.parent.mkdir()
    when = time.time() + 3e8 if at == "now+3e8" else at
    write_json(str(status), {"state": "committed", "time": when})
    handoff = Handoff(Store(str(tmp_path / "root")), Spool(str(tmp_path / "spool")), 0)
    request = Request(root="r", storage_options={}, rel="step-1", step=1, save_id="s", rank=0, world=1, files=[], manifest={}, started=started)
    handoff._learn_durable(_Handed(str(status), request, None))  # type: ignore[arg-type]
    busy = handoff.busy_s()
    assert 0.0 <= busy <= 3.0, busy
    coordinator = Coordinator(ckpt.Auto(node_mtbf_s=600), world=1)
    for persist_s in (busy, 3e8, float("inf")):
        coordinator.retune(0.003, persist_s, 0.0, 0.1, 0.05)
        assert 0 < coordinator.seconds <= 600, coordinator.schedule
