"""The alert rules (deploy/prometheus/ckpt-alerts.yml), checked by Prometheus's own promtool:
they load, each fires for a broken job and never for a healthy one (the unit tests in
ckpt-alerts.test.yml), a live rank's and a live node agent's scrapes pass `promtool check
metrics`, and a live Every(steps=N) job's series, replayed through the rules, are stale only
once its saves fail.

promtool comes with Debian's `prometheus` package; .ci/run installs it. Without it these tests
skip, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import ckpt
from ckpt.node.spool import Spool
from tests.support.deploy_names import ALERTS
from tests.support.launch import REPO, free_port
from tests.support.loop import job, train

RULE_TESTS = ALERTS.with_name("ckpt-alerts.test.yml")
STALE = "CkptCheckpointStale"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing under CI: .ci/run installs it from Debian's prometheus package")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus); CI runs these tests")
    return path


def run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)


def alert_names() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_the_alert_rules_load_in_prometheus(promtool):
    checked = run(promtool, "check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_for_a_broken_job_and_never_for_a_healthy_one(promtool):
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    for alert in alert_names():
        fired = [t for g in tests for t in g.get("alert_rule_test", []) if t["alertname"] == alert and t["exp_alerts"]]
        quiet = [t for g in tests for t in g.get("promql_expr_test", []) if f'alertname="{alert}"' in t["expr"] and t["exp_samples"] == []]
        assert fired and quiet, f"{alert}: the rule tests need a firing case and a healthy one"
    tested = run(promtool, "test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


# -- a live rank ----------------------------------------------------------------------------------
def samples(text: str) -> dict[str, float]:
    """The unlabelled samples of a rank's scrape, by name."""
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def scrape(address: tuple[str, int]) -> str:
    return urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10).read().decode()


@pytest.fixture(scope="module")
def live_rank(tmp_path_factory) -> tuple[list[str], list[str]]:
    """Scrapes of a rank under Every(steps=10) at about 120 ms a step, every 2 steps: while its
    saves commit, then while they fail (its root is not a directory). Steps long enough that
    a save on a loaded machine (CI runs three test files at once on two cores) still commits
    within twice the interval, as a healthy job's does: at 50 ms a step it once did not."""
    root = tmp_path_factory.mktemp("live") / "root"
    model, opt = job()
    healthy, failing = [], []
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=10), metrics_port=0, on_error="log", save_on_exit=False) as cp:
        address = cp.metrics.address
        healthy.append(scrape(address))
        for scrapes, until in ((healthy, 40), (failing, 100)):
            if scrapes is failing:
                cp.wait()
                root.rename(root.with_name("aside"))
                root.write_text("not a directory")
            while cp.step < until:
                train(cp, model, opt, cp.step + 2, sleep_s=0.12)
                scrapes.append(scrape(address))
        root.unlink()
        root.with_name("aside").rename(root)
    return healthy, failing


def test_a_live_ranks_scrape_passes_promtool_check_metrics(promtool, live_rank):
    healthy, failing = live_rank
    for text in (healthy[0], failing[-1]):  # before the first step; after commits, failures
        checked = run(promtool, "check", "metrics", stdin=text)
        assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


def test_a_live_every_steps_job_replayed_through_the_rules_is_stale_only_once_its_saves_fail(promtool, live_rank, tmp_path):
    """Each scrape stands for a minute of Prometheus's time: the rule compares the age with
    the interval, whose scale does not matter, and `for: 5m` asks for 6 scrapes in a row."""
    healthy, failing = live_rank
    scraped = [samples(text) for text in healthy + failing]
    quiet_until = len(healthy) - 1  # the minute of the last healthy scrape
    assert len(failing) >= 20, len(failing)
    series = {
        name: " ".join(repr(s[name]) if name in s else "_" for s in scraped)
        for name in ("ckpt_checkpoint_age_seconds", "ckpt_coordinator_interval_seconds")
    }
    firing = f'ALERTS{{alertname="{STALE}",alertstate="firing",job="live",severity="critical"}}'
    replay = {
        "rule_files": [ALERTS.name],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": f'{name}{{job="live",rank="0"}}', "values": values} for name, values in series.items()],
            "promql_expr_test": [
                {"expr": f'count_over_time(ALERTS{{alertname="{STALE}"}}[{quiet_until + 1}m])', "eval_time": f"{quiet_until}m", "exp_samples": []},
                {"expr": firing, "eval_time": f"{len(scraped) - 1}m", "exp_samples": [{"labels": firing, "value": 1}]},
            ],
        }],
    }  # fmt: skip
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    (tmp_path / "replay.yml").write_text(yaml.safe_dump(replay))
    tested = run(promtool, "test", "rules", str(tmp_path / "replay.yml"))
    assert tested.returncode == 0, f"{tested.stdout}{tested.stderr}\n{series}"


# -- a live node agent ---------------------------------------------------------------------------
@pytest.fixture
def agent(tmp_path) -> Iterator[tuple[Path, int]]:
    """A `ckpt agent` process on a spool, serving its metrics on a free loopback port."""
    spool, port = tmp_path / "spool", free_port()
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt.cli.main", "agent", "--spool", str(spool), "--metrics-port", str(port)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not spool.is_dir() or Spool(str(spool)).agent() is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
            time.sleep(0.05)
        yield spool, port
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_a_live_agents_scrape_with_a_ranks_relayed_series_passes_promtool_check_metrics(promtool, agent, tmp_path):
    spool, port = agent
    model, opt = job()
    with ckpt.Checkpointer(tmp_path / "root", model=model, optimizer=opt, interval=ckpt.Every(steps=2), spool=str(spool), save_on_exit=False) as cp:
        train(cp, model, opt, 4, sleep_s=0.02)
        cp.wait()
        deadline = time.monotonic() + 30  # the rank rewrites its series every 5 s
        while "ckpt_coordinator_interval_seconds{" not in (text := scrape(("127.0.0.1", port))):
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
    assert 'ckpt_agent_commits_total' in text and 'ckpt_last_committed_step{job="' in text, text
    checked = run(promtool, "check", "metrics", stdin=text)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr
