"""Ranks meet at step boundaries known to all, not every step: rank 0 turns seconds into steps."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

import ckpt
from ckpt.schedule.agreement import Agreement


def _timed(agree: Agreement, steps: int, step_s: float) -> None:
    for i in range(steps):
        agree.tick(i * step_s)


def test_without_a_step_time_the_ranks_meet_every_step():
    agree = Agreement(every_s=1.0)
    assert agree.meets(0)
    assert agree.propose(since_save_s=0.0, interval_s=5.0) == [0, 1, 0]
    agree.meet(1, [0, 0, 0, 1, 0])
    assert not agree.meets(1) and agree.meets(2)


def test_rank0_names_the_save_step_from_its_step_time():
    agree = Agreement(every_s=1.0)
    _timed(agree, 5, 0.01)
    assert agree.step_s == pytest.approx(0.01)
    # 0.5 s to the save is 50 steps, within the 100 steps of every_s: that meeting saves
    assert agree.propose(since_save_s=0.1, interval_s=0.6) == [0, 50, 1]
    agreed = agree.meet(10, [0, 0, 0, 50, 1])
    assert not agreed.save and not agree.meets(59) and agree.meets(60)
    # at that meeting the save happens whatever the clock says now (the step was named)
    assert agree.propose(since_save_s=0.59, interval_s=0.6)[0] == 1


def test_a_long_interval_is_polled_every_every_s_and_a_due_one_saves_at_once():
    agree = Agreement(every_s=1.0)
    _timed(agree, 5, 0.01)
    assert agree.propose(since_save_s=0.0, interval_s=100.0) == [0, 100, 0]
    assert agree.propose(since_save_s=0.0, interval_s=None) == [0, 100, 0]
    assert agree.propose(since_save_s=100.0, interval_s=100.0) == [1, 100, 0]
    # a step slower than every_s: still one step at a time, never zero
    _timed(agree, 50, 3.0)
    assert agree.propose(since_save_s=0.0, interval_s=None) == [0, 1, 0]


def test_a_save_replans_on_every_rank_and_forgets_a_named_save():
    agree = Agreement(every_s=1.0)
    _timed(agree, 5, 0.01)
    agree.meet(10, [0, 0, 0, 30, 1])
    agree.replan(15)  # a save by step count or by hand, at the same step on every rank
    assert agree.meets(16)
    assert agree.propose(since_save_s=0.01, interval_s=0.6)[0] == 0
    agreed = agree.meet(16, [1, 1, 0, 5, 0])
    assert (agreed.preempt, agreed.failed, agreed.save) == (True, True, False)
    with pytest.raises(ValueError, match="seconds > 0"):
        Agreement(every_s=0)


def test_a_rank_sends_its_signal_and_failure_and_only_rank0_its_plan_and_acts_only_at_meetings():
    sent: list[list[int]] = []

    def group_max(mine: list[int]) -> list[int]:  # another rank saw a failed save
        sent.append(mine)
        return [max(a, b) for a, b in zip(mine, [0, 1, 0, 0, 0, 0], strict=True)]

    rank0, rank1 = Agreement(every_s=1.0), Agreement(every_s=1.0)
    _timed(rank0, 5, 0.01)
    a0 = rank0.at_step(7, 0, group_max, preempt=True, failed=False, since_save_s=0.1, interval_s=0.6)
    assert sent[-1] == [1, 0, 0, 50, 1, 0]  # rank 0: its SIGTERM and its plan (save in 50 steps)
    assert (a0.preempt, a0.failed, a0.save) == (True, True, False)
    assert rank0.at_step(8, 0, group_max, False, False, 0.11, 0.6) is None  # no meeting: no collective
    assert len(sent) == 1 and rank0.meets(57)

    # rank 1 sends no plan of its own; the group's max carries rank 0's
    def with_rank0s_plan(mine: list[int]) -> list[int]:
        sent.append(mine)
        return [max(a, b) for a, b in zip(mine, [1, 0, 0, 50, 1, 40], strict=True)]

    a1 = rank1.at_step(7, 1, with_rank0s_plan, preempt=False, failed=True, since_save_s=99.0, interval_s=0.6, slowdown_ms=250)
    assert sent[-1] == [0, 1, 0, 0, 0, 250]  # and what its saves cost its steps: the slowest rank's prices the save
    assert rank1.slowest_ms == 250
    assert (a1.preempt, a1.failed, a1.save) == (True, True, False) and rank1.meets(57) and not rank1.meets(56)


def _run(tmp_path: Path, how: str, steps: int, step_s: float) -> tuple[list[dict], list[ckpt.Manifest]]:
    from tests.support import launch

    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    codes = launch.run(2, launch.WORKERS / "agree_worker.py", str(root), str(out), how, str(steps), str(step_s), log_dir=tmp_path)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    manifests = [ckpt.Manifest.from_json(p.read_bytes()) for p in sorted(root.glob("step-*/manifest.json"))]
    return ranks, manifests


def test_two_ranks_save_by_rank0s_clock_at_the_same_steps_meeting_a_few_times(tmp_path):
    steps = 150
    ranks, manifests = _run(tmp_path, "seconds", steps, 0.01)
    # every save committed (both ranks wrote the step), 0.3 s or a little more apart
    saved = [m.step for m in manifests]
    assert len(saved) >= 3, saved
    assert all(b - a >= 3 for a, b in pairwise(saved)), saved
    starts = [m.created - m.costs.persist_s for m in manifests]  # rank 0's save() calls
    # a save starts once the one before committed: the gap is the interval or that save's time
    gaps = [(b - a, m.costs.persist_s) for (a, b), m in zip(pairwise(starts), manifests, strict=False)]
    assert all(0.2 <= gap <= 1.5 + before for gap, before in gaps), gaps
    # the ranks met alike: twice per save (after it, and at the next save's step) and every
    # 0.1 s of rank 0's time in between, not every step
    meetings = ranks[0]["meetings"]
    assert meetings == ranks[1]["meetings"], ranks
    assert meetings <= min(steps // 2, 2 * len(saved) + ranks[0]["wall_s"] / 0.1 + 6), ranks


def test_auto_records_the_interval_as_a_number_of_steps(tmp_path):
    steps = 300  # 3 s: the interval after the first save is at least 1.1x that save's time
    ranks, manifests = _run(tmp_path, "auto", steps, 0.01)
    measured = [m.schedule for m in manifests if "step_s" in m.schedule]
    assert measured, [m.schedule for m in manifests]
    last = measured[-1]
    # steps = round(interval / step time), taken before the manifest rounded both (to 1 ms
    # and 0.1 ms): within a half step, plus what that rounding moves the ratio
    slack = 0.5 + (5e-4 + last["steps"] * 5e-5) / last["step_s"]
    assert last["steps"] >= 1 and abs(last["steps"] - last["seconds"] / last["step_s"]) <= slack, last
    # a step's time (10 ms of sleep and the loop), not a save's or the interval's; on a loaded
    # machine a step may take 5x its sleep (it once measured 55 ms under CI's load)
    assert 0.005 <= last["step_s"] <= 0.5, last
    assert ranks[0]["meetings"] == ranks[1]["meetings"] < steps, ranks
