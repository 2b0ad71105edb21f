"""When a save comes due (ckpt.schedule.cadence): the interval a run reports in seconds is the
sooner of its steps at the measured step time and its clock."""

from __future__ import annotations

import pytest

import ckpt


@pytest.mark.parametrize(
    ("every", "seconds", "steps"),
    [(ckpt.Every(steps=50), 50 / 3, 50), (ckpt.Every(seconds=7.0), 7.0, 21), (ckpt.Every(steps=50, seconds=7.0), 7.0, 50), (ckpt.Every(steps=15, seconds=7.0), 5.0, 15)],
)
def test_the_interval_in_seconds_is_the_sooner_of_the_steps_at_the_step_time_and_the_clock(monkeypatch, every, seconds, steps):
    from ckpt.schedule.cadence import Cadence

    now = [100.0]
    monkeypatch.setattr("ckpt.schedule.cadence.time.monotonic", lambda: now[0])
    cadence = Cadence(every, agree_every_s=5.0)
    cadence.restart(0)  # the run starts: of the interval, only the clock's is known
    assert cadence.estimate()["seconds"] == every.seconds
    now[0] += 30 * 0.2 + 4.0  # 30 steps of 0.2 s and a 4 s evaluation: it counts, as it recurs
    cadence.restart(30)
    assert cadence.estimate() == {"policy": "every", "seconds": pytest.approx(seconds), "steps": steps, "step_s": pytest.approx(1 / 3), "slowdown_s": None}
