"""The kill sweep (tests/support/torture.py) as a test: 32 seeded trials, every phase of the save
pipeline killed at least once (a rank while staging, writing, between data and manifest,
after the manifest, during retention, after handing off to the node agent; a rank's writer
process; the agent mid-upload), and every restart restores the newest committed checkpoint,
bit for bit what its step held when it was saved. `python -m tests.support.torture` runs longer
sweeps and prints the same figures."""

from __future__ import annotations

import json

import pytest

from tests.support import torture


@pytest.mark.slow
def test_a_kill_anywhere_in_the_save_pipeline_never_costs_more_than_the_last_commit(tmp_path):
    figures = torture.sweep(32, seed=8, base=tmp_path)
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=2))
    summary = {k: v for k, v in figures.items() if k not in ("trial_log", "verify_deep_tail")}
    assert figures["trials"] == 32
    assert figures["restores_wrong"] == [], summary
    assert figures["restores_correct"] == 32, summary
    assert figures["data_lost_beyond_last_commit"] == 0, summary
    assert figures["verify_deep_rc"] == 0, figures["verify_deep_tail"]
    # Every phase was reached and killed in at least one trial: a sweep that never fired
    # would prove nothing.
    assert set(figures["kills_by_phase"]) == set(torture.PHASES) | set(torture.AGENT_PHASES), summary
    assert figures["kills"] >= 30, summary
    # A dead peer turned into an error on the surviving rank (run_job fails a trial past
    # DIE_WITHIN_S): here well within the Checkpointer's collective timeout.
    assert figures["dead_rank_to_error_s"]["max"] < torture.RANK_TIMEOUT_S + 5, summary
