"""A rank's Prometheus metrics, scraped live from the port it serves them on."""

from __future__ import annotations

import logging
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import ckpt
from ckpt.metrics import port_from_env
from tests.support.loop import job, train


def scrape(cp: ckpt.Checkpointer) -> dict[tuple[str, tuple], float]:
    """Every sample served, by (name, sorted labels)."""
    assert cp.metrics.address is not None
    host, port = cp.metrics.address
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_saves_restores_and_failures_show_in_a_live_scrape(tmp_path: Path):
    root = tmp_path / "root"
    model, opt = job()
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=2), metrics_port=0, on_error="log") as cp:
        assert cp.metrics.address[0] == "127.0.0.1"  # loopback unless configured
        train(cp, model, opt, 4)
        cp.wait()
        m = scrape(cp)
        manifests = [ckpt.Manifest.from_json(p.read_bytes()) for p in sorted(root.glob("step-*/manifest.json"))]
        assert [x.step for x in manifests] == [2, 4]
        assert m[("ckpt_rank_info", (("rank", "0"), ("world_size", "1")))] == 1
        assert m[("ckpt_saves_total", (("outcome", "committed"),))] == 2
        assert m[("ckpt_blocking_seconds_count", ())] == 2 and m[("ckpt_persist_seconds_count", ())] == 2
        assert m[("ckpt_persist_seconds_sum", ())] == pytest.approx(sum(x.costs.persist_s for x in manifests))
        assert m[("ckpt_written_bytes_total", ())] == sum(x.total_bytes for x in manifests)
        assert m[("ckpt_last_committed_step", ())] == 4
        assert m[("ckpt_last_commit_timestamp_seconds", ())] == manifests[-1].created
        assert 0 <= m[("ckpt_checkpoint_age_seconds", ())] < 60
        assert m[("ckpt_saves_in_flight", ())] == 0
        assert m[("ckpt_coordinator_interval_steps", ())] == 2

        root.rename(tmp_path / "aside")  # the next save cannot make its directory
        root.write_text("not a directory")
        train(cp, model, opt, 6)
        cp.wait()
        m = scrape(cp)
        assert m[("ckpt_saves_total", (("outcome", "failed"),))] == 1
        assert sum(v for (name, _), v in m.items() if name == "ckpt_save_failures_total") == 1
        assert m[("ckpt_last_committed_step", ())] == 4
        root.unlink()
        (tmp_path / "aside").rename(root)
        # leaving: the failed save of step 6 is tried once more, and commits
        port = cp.metrics.address[1]
    with pytest.raises(OSError):  # the server went with the Checkpointer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)

    model2, opt2 = job()
    with ckpt.Checkpointer(root, model=model2, optimizer=opt2, interval=None, save_on_exit=False, metrics_port=0) as cp2:
        m = scrape(cp2)
        assert cp2.step == 6
        assert m[("ckpt_checkpoint_age_seconds", ())] == 0  # as old as the downtime, but nothing trained yet
        assert m[("ckpt_restores_total", (("source", "store"),))] == 1
        assert m[("ckpt_restore_seconds_count", ())] == 1
        total = ckpt.Manifest.from_json((root / "step-0000000006" / "manifest.json").read_bytes()).total_bytes
        assert 0 < m[("ckpt_read_bytes_total", ())] <= total
        assert m[("ckpt_last_committed_step", ())] == 6


def test_auto_interval_decisions_are_gauges(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    model, opt = job()
    auto = ckpt.Auto(node_mtbf_s=20.0, first_after_s=0.05)
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=auto, metrics_port=0, save_on_exit=False, handle_sigterm=False) as cp:
        train(cp, model, opt, 40, sleep_s=0.01)
        cp.wait()
        m = scrape(cp)
    schedule = cp.schedule
    assert "step_s" in schedule, schedule
    assert m[("ckpt_coordinator_mtbf_seconds", ())] == pytest.approx(20.0, rel=0.01)
    assert m[("ckpt_coordinator_interval_seconds", ())] == pytest.approx(schedule["seconds"])
    assert m[("ckpt_coordinator_interval_steps", ())] == schedule["steps"]
    assert m[("ckpt_coordinator_step_seconds", ())] == pytest.approx(schedule["step_s"])
    assert m[("ckpt_coordinator_blocking_estimate_seconds", ())] == pytest.approx(schedule["blocking_s"])
    assert m[("ckpt_coordinator_persist_estimate_seconds", ())] == pytest.approx(schedule["persist_s"])
    assert re.search(r"interval: every \S+ s = \d+ steps of", caplog.text), caplog.text[-2000:]


def test_a_port_taken_costs_the_metrics_endpoint_not_the_training(tmp_path, caplog):
    import socket

    caplog.set_level(logging.WARNING, logger="ckpt")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model, opt = job()
        with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=1), metrics_port=port) as cp:
            train(cp, model, opt, 2)
        assert cp.metrics.address is None
    assert f"metrics not served on port {port}" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000000001", "step-0000000002"]


def test_each_local_rank_serves_on_its_own_port(monkeypatch):
    monkeypatch.delenv("CKPT_METRICS_PORT", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert port_from_env(None) is None
    assert port_from_env(9400) == 9403
    assert port_from_env(0) == 0  # any free port
    monkeypatch.setenv("CKPT_METRICS_PORT", "9500")
    assert port_from_env(None) == 9503
    monkeypatch.setenv("CKPT_METRICS_PORT", "nine")
    with pytest.raises(ValueError, match="CKPT_METRICS_PORT must be a port number"):
        port_from_env(None)


def test_every_steps_exports_its_interval_in_seconds_and_a_healthy_job_is_not_stale(tmp_path):
    """Under Every(steps=N) the interval is N steps at the measured step time, never 0 (with
    0, CkptCheckpointStale's `age > 2 * interval` held at every scrape of a healthy job)."""
    model, opt = job()
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=10), metrics_port=0, save_on_exit=False) as cp:
        m = scrape(cp)  # no step timed yet: no interval, rather than 0; nothing trained, age 0
        assert ("ckpt_coordinator_interval_seconds", ()) not in m
        assert m[("ckpt_checkpoint_age_seconds", ())] == 0
        train(cp, model, opt, 5, sleep_s=0.02)
        m = scrape(cp)  # before the first save: from rank 0's moving average
        assert 10 * 0.02 <= m[("ckpt_coordinator_interval_seconds", ())] < 10 * 0.2
        assert m[("ckpt_checkpoint_age_seconds", ())] <= 2 * m[("ckpt_coordinator_interval_seconds", ())]
        for until in (20, 30, 39):  # the save at 30 is priced once half as many clean steps followed it as preceded it
            train(cp, model, opt, until, sleep_s=0.02)
            m = scrape(cp)
            assert m[("ckpt_checkpoint_age_seconds", ())] <= 2 * m[("ckpt_coordinator_interval_seconds", ())], m
        cp.wait()
    created = [ckpt.Manifest.from_json(p.read_bytes()).created for p in sorted(tmp_path.glob("step-*/manifest.json"))]
    assert len(created) == 3
    # the interval is what the job does, save to save
    assert m[("ckpt_coordinator_interval_seconds", ())] == pytest.approx(created[2] - created[1], rel=0.3)
    assert m[("ckpt_coordinator_interval_steps", ())] == 10
    assert m[("ckpt_coordinator_step_seconds", ())] * 10 == pytest.approx(m[("ckpt_coordinator_interval_seconds", ())])
    assert not any(name.endswith(("mtbf_seconds", "blocking_estimate_seconds", "persist_estimate_seconds", "cost_estimate_seconds")) for name, _ in m)  # Auto's alone
    assert m[("ckpt_coordinator_slowdown_estimate_seconds", ())] >= 0  # measured under every policy
