"""The node agent (`ckpt agent`) with real trainers: 2 ranks over gloo, the agent a real
process on a spool directory, the root on the moto S3 server or a local directory.

What it must do: finish and commit a checkpoint whose trainer died after handing it off;
redo an upload it was killed in the middle of, never committing anything half-written;
restore restarts on the node from the spool (and from the store when the spool's copy is
bad); relay a SIGTERM to the ranks as a preemption and finish the emergency checkpoint
before exiting; serve its own and the ranks' metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import pytest
import torch

import ckpt
from ckpt.agent.config import Config, parse_size
from ckpt.agent.daemon import Agent
from ckpt.node.handoff import Handoff
from ckpt.node.spool import Request, Spool, job_key, read_json, status_of
from ckpt.storage.store import Store
from tests.support.agentd import agent, until
from tests.support.cli import ckpt_cli
from tests.support.jobs import RANKS, assert_same_training_state, dumps, rank_logs
from tests.support.launch import REPO, WORKERS, kill_all, start, wait

WORKER = WORKERS / "worker.py"


# -- helpers ------------------------------------------------------------------------------------


def s3_keys(endpoint: str, root: str) -> set[str]:
    bucket, prefix = root.removeprefix("s3://").split("/", 1)
    listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"].removeprefix(prefix + "/") for o in listed.get("Contents", [])}


def job(log_dir: Path, *args: object, env: dict[str, str] | None = None, timeout: float = 180) -> list[int]:
    return wait(start(RANKS, WORKER, *map(str, args), env=env, log_dir=log_dir), timeout)


# -- 1. the trainer dies after the hand-off; restarts restore from the spool ------------------
@pytest.mark.slow
def test_ranks_killed_after_handing_off_still_commit_and_the_restart_reads_the_spool(tmp_path, s3_root, s3_endpoint, straight_run):
    spool = tmp_path / "spool"
    common = ("--mode", "fsdp2", "--root", s3_root, "--every", 5)
    env = {"CKPT_SPOOL": str(spool)}
    with agent(spool, tmp_path / "agent.log") as a:
        # Both ranks SIGKILL themselves right after handing step 10 off: nobody of the job is
        # left to commit it but the agent.
        codes = job(tmp_path, *common, "--steps", 10, "--no-save-on-exit", env={**env, "CKPT_FAULT": "after_handoff:*:10"})
        assert codes == [-signal.SIGKILL] * RANKS, rank_logs(tmp_path)
        until("the agent to commit step 10", lambda: "step-0000000010/manifest.json" in s3_keys(s3_endpoint, s3_root), logs=a.text)
        assert "committed" in a.text()
        keys = s3_keys(s3_endpoint, s3_root)
        assert sum(".durable/" in k and ".rank-" in k and k.startswith("step-0000000010/") for k in keys) == RANKS
        assert sum(k.startswith("step-0000000010/.durable/") and k.endswith(".committed") for k in keys) == 1  # the commit's record

        # The restart on the same node: the agent has nothing left to do, the ranks read their
        # files from the spool, and the run ends as if never interrupted.
        for r in range(RANKS):
            (tmp_path / f"rank{r}.log").write_text("")
        assert job(tmp_path, *common, "--steps", 20, "--out", tmp_path / "resumed", env=env) == [0] * RANKS, rank_logs(tmp_path)
        resumed = dumps(tmp_path / "resumed")
        assert [d["restored_step"] for d in resumed] == [10] * RANKS
        assert_same_training_state(resumed, straight_run("fsdp2").dumps)
        assert "from the node spool" in rank_logs(tmp_path)

        # A bad spool copy (same size, other bytes) is caught by its checksum and the store's
        # copy is read instead: the step restored is the same.
        job_dir = spool / "jobs" / job_key(Store(s3_root))
        # The spool keeps the newest --keep-spool (2) committed checkpoints of the job.
        until("the spool's retention", lambda: sorted(p.name for p in job_dir.glob("step-*")) == ["step-0000000015", "step-0000000020"], logs=a.text)
        newest = job_dir / "step-0000000020"
        data = newest / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        step = int(newest.name.split("-")[1])
        for r in range(RANKS):
            (tmp_path / f"rank{r}.log").write_text("")
        assert job(tmp_path, *common, "--steps", step, "--out", tmp_path / "again", env=env) == [0] * RANKS, rank_logs(tmp_path)
        assert [d["restored_step"] for d in dumps(tmp_path / "again")] == [step] * RANKS
        assert "node spool's copies failed" in rank_logs(tmp_path)


# -- 2. ranks on two nodes: the last one durable commits ------------------------------------
@pytest.mark.slow
def test_ranks_on_two_nodes_one_without_an_agent_commit_by_whoever_is_last(tmp_path):
    """Rank 0's node has a slow agent; rank 1's node has none, so rank 1 writes to the root
    itself and marks itself durable. The agent, always last, commits every save."""
    root = tmp_path / "root"
    env = {"TEST_SPOOL_OF_RANK": str(tmp_path / "node{rank}")}
    (tmp_path / "node1").mkdir()
    with agent(tmp_path / "node0", tmp_path / "agent.log", "--bandwidth-limit", "100kB") as a:
        assert job(tmp_path, "--mode", "plain", "--root", root, "--steps", 10, "--every", 5, "--out", tmp_path / "out", env=env) == [0] * RANKS, rank_logs(tmp_path)
        assert a.text().count("committed") == 2, a.text()
        assert "ckpt_agent_commits_total 2.0" in a.scrape()
    assert [d["step"] for d in dumps(tmp_path / "out")] == [10] * RANKS
    for step in (5, 10):
        durable = sorted(p.name.split(".")[1] for p in (root / f"step-{step:010d}" / ".durable").iterdir())
        # rank 0's draft of the manifest, each rank's marker, and the commit's record
        assert durable == ["committed", "draft", "rank-00000", "rank-00001"]
    assert not list((tmp_path / "node1").rglob("*.distcp"))  # rank 1 wrote to the root
    rc = ckpt_cli("verify", root, "--deep")
    assert rc.returncode == 0, rc.stdout + rc.stderr


# -- 3. the agent dies in the middle of an upload ----------------------------------------------
@pytest.mark.slow
def test_an_agent_killed_mid_upload_redoes_it_and_nothing_half_written_commits(tmp_path, s3_root, s3_endpoint):
    spool = tmp_path / "spool"
    env = {"CKPT_SPOOL": str(spool)}
    common = ("--mode", "plain", "--root", s3_root, "--every", 5, "--steps", 5, "--no-save-on-exit")
    with agent(spool, tmp_path / "agent.log", env={"CKPT_FAULT": "agent_upload:1:5"}) as a:
        codes = job(tmp_path, *common, env={**env, "CKPT_FAULT": "after_handoff:*:5"})
        assert codes == [-signal.SIGKILL] * RANKS, rank_logs(tmp_path)
        until("the agent to die in rank 1's upload", lambda: a.proc.poll() is not None, logs=a.text)
    assert a.proc.returncode == -signal.SIGKILL
    keys = s3_keys(s3_endpoint, s3_root)
    assert "step-0000000005/manifest.json" not in keys
    assert "step-0000000005/__1_0.distcp" not in keys  # an aborted multipart upload: no object
    assert not any(k.endswith("rank-00001") for k in keys)  # rank 1 never marked durable
    assert (spool / "jobs").exists()

    with agent(spool, tmp_path / "agent2.log") as a:
        until("the restarted agent to commit step 5", lambda: "step-0000000005/manifest.json" in s3_keys(s3_endpoint, s3_root), logs=a.text)
    rc = ckpt_cli("verify", s3_root, "--deep")
    assert rc.returncode == 0, rc.stdout + rc.stderr


# -- 4. SIGTERM to the agent: a preemption of the node -----------------------------------------
@pytest.mark.slow
def test_sigterm_to_the_agent_checkpoints_the_ranks_and_it_exits_once_uploaded(tmp_path):
    root, spool = tmp_path / "root", tmp_path / "spool"
    env = {"CKPT_SPOOL": str(spool)}
    with agent(spool, tmp_path / "agent.log", "--bandwidth-limit", "200kB") as a:
        procs = start(RANKS, WORKER, "--mode", "plain", "--root", str(root), "--steps", "40", "--every", "4", "--step-sleep", "0.2", "--out", str(tmp_path / "stopped"), env=env, log_dir=tmp_path)
        try:
            until("step 4 to commit", lambda: (root / "step-0000000004" / "manifest.json").exists(), logs=lambda: rank_logs(tmp_path) + a.text())
            scraped = a.scrape()
            a.proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            codes = wait(procs, timeout=60)
            # The ranks leave once the agent committed their last save: not after timeout_s
            # (60 s here), even though the agent prunes what it committed from the spool.
            assert time.monotonic() - began < 30
        finally:
            kill_all(procs)
        assert codes == [143] * RANKS, f"{codes}\n{rank_logs(tmp_path)}"
        assert a.proc.wait(timeout=60) == 0, a.text()
    stop = dumps(tmp_path / "stopped")[0]["step"]
    assert 4 < stop < 40
    assert json.loads((root / f"step-{stop:010d}" / "manifest.json").read_text())["step"] == stop
    assert "preempted (notice file" in rank_logs(tmp_path)
    assert "every hand-off is uploaded" in a.text()

    # The live scrape, taken while the ranks trained: the agent's series and the ranks' own,
    # labelled with the job and the rank.
    names = scraped_names(scraped)
    assert {"ckpt_agent_upload_queue_depth", "ckpt_agent_uploaded_bytes_total", "ckpt_agent_commits_total", "ckpt_agent_spool_bytes"} <= names
    job_label = f'job="{job_key(Store(str(root)))}"'
    for r in range(RANKS):
        assert any(line.startswith("ckpt_last_committed_step{") and job_label in line and f'rank="{r}"' in line for line in scraped.splitlines()), scraped
    # The deployment's dashboard and alerts (deploy/) use no metric name the code lacks.
    from tests.support.deploy_names import metric_names_used

    assert metric_names_used() <= names, sorted(metric_names_used() - names)


def scraped_names(text: str) -> set[str]:
    """The metric names a scrape exposes: sample names (histogram suffixes dropped) and the
    families announced by # TYPE (a labelled series with no sample yet)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])  # a counter's family is announced with its _total
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split()[0].removesuffix("_bucket").removesuffix("_sum").removesuffix("_count"))
    return names


@pytest.mark.slow
def test_after_its_grace_period_a_stopping_agent_abandons_uploads_safely_and_the_next_one_redoes_them(tmp_path):
    root, spool = tmp_path / "root", tmp_path / "spool"
    env = {"CKPT_SPOOL": str(spool), "CKPT_FAULT": "after_handoff:*:5"}
    with agent(spool, tmp_path / "agent.log", "--bandwidth-limit", "20kB", "--shutdown-grace", "1") as a:
        codes = job(tmp_path, "--mode", "plain", "--root", root, "--steps", 5, "--every", 5, env=env)
        assert codes == [-signal.SIGKILL] * RANKS, rank_logs(tmp_path)
        until("an upload to start", lambda: "uploading" in json.dumps([read_json(p) for p in spool.rglob(".status/*.json")]), logs=a.text)
        began = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=30) == 0, a.text()
        assert time.monotonic() - began < 10
    assert "left in the spool for the next agent" in a.text()
    assert "abandoned" in a.text()
    assert not (root / "step-0000000005" / "manifest.json").exists()
    assert not (root / "step-0000000005" / "__0_0.distcp").exists()  # abandoned: no partial file
    with agent(spool, tmp_path / "agent2.log") as a:
        until("the next agent to commit step 5", lambda: (root / "step-0000000005" / "manifest.json").exists(), logs=a.text)


# -- 5. a full spool: the ranks write to the store themselves --------------------------------
def test_a_full_spool_makes_the_rank_write_to_the_root_and_commit_itself(tmp_path, caplog):
    import torch

    spool, root = tmp_path / "spool", tmp_path / "root"
    with agent(spool, tmp_path / "agent.log", "--spool-budget", "1"):
        model = torch.nn.Linear(64, 64)
        with ckpt.Checkpointer(str(root), model=model, interval=None, spool=str(spool)) as cp:
            cp.step_done()
            cp.save(blocking=True)
    assert (root / "step-0000000001" / "manifest.json").exists()
    assert "cannot take this save" in caplog.text and "budget" in caplog.text
    assert not list((spool / "jobs").glob("*/step-*/*.distcp"))


@pytest.mark.slow
def test_with_an_agent_the_interval_is_priced_at_the_uploads_time_to_durable_not_the_hand_off(tmp_path):
    """Issue 42: with a node agent a save's hand-off takes milliseconds while its upload (at
    200 kB/s here) takes over a second; the next save waits for the upload, so `Auto`'s
    floor of what a save keeps busy is the upload's time to durable, by the agent's clock."""
    spool, root = tmp_path / "spool", tmp_path / "root"
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 257 KB: ~1.3 s an upload
    with agent(spool, tmp_path / "agent.log", "--bandwidth-limit", "200kB") as a:
        auto = ckpt.Auto(node_mtbf_s=20, first_after_s=0.2, first_after_steps=3)
        with ckpt.Checkpointer(str(root), model=model, interval=auto, spool=str(spool), lease=None, save_on_exit=False) as cp:
            schedules = []
            # The first saves are priced before any upload is known to be done (at their
            # hand-off); from the first commits learned on, at the uploads' time to durable.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                time.sleep(0.02)
                cp.step_done()
                if cp.schedule not in schedules:
                    schedules.append(dict(cp.schedule))
            handed = [json.loads(r.read_text())["manifest"]["costs"]["persist_s"] for r in spool.glob("jobs/*/step-*/.requests/rank-*.json")]
        assert "durable" in a.text(), a.text()
    priced = [s for s in schedules if s.get("persist_s") is not None]
    assert len(priced) >= 3, (schedules, a.text())
    last = priced[-1]
    assert last["persist_s"] >= 1.0, (last, handed)  # the upload, not the hand-off ...
    assert handed and min(handed) < 0.5, handed  # ... which the trainer's own persist time is
    assert last["seconds"] >= 1.1 * last["persist_s"] - 1e-3, last  # no save due while the last uploads
    assert last["persist_of"] == "node agent's upload", last


# -- 6. the agent alone: a bad spool copy, settings -------------------------------------------
def test_a_trainer_does_not_wait_for_a_dead_agent_and_a_bad_spool_copy_is_never_uploaded(tmp_path, caplog):
    """The agent dies during an upload while the trainer waits at exit for the commit: the
    trainer leaves once the agent's heartbeat is stale, not after timeout_s. Then the spool
    file is changed: the next agent fails the hand-off and the root gets neither the file nor
    a commit. Mended, the hand-off goes through a root that fails for a while, retried.
    (These agents run in this process, on a local root.)"""
    import threading

    import torch

    spool, root = tmp_path / "spool", tmp_path / "root"
    with agent(spool, tmp_path / "agent.log", env={"CKPT_FAULT": "agent_upload:0:1:sleep=60"}) as a:
        threading.Timer(2.0, a.kill).start()
        began = time.monotonic()
        with ckpt.Checkpointer(str(root), model=torch.nn.Linear(64, 64), interval=None, spool=str(spool), timeout_s=600) as cp:
            cp.step_done()
            cp.save(blocking=True)
        assert time.monotonic() - began < 30
    assert "the node agent is gone: steps [1] stay in the spool" in caplog.text
    request = next((spool / "jobs").glob("*/step-0000000001/.requests/rank-00000.json"))
    data = request.parent.parent / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    (spool / "agent.json").unlink()
    local = Agent(Config(spool=str(spool), metrics_port=-1, retries=1))
    path = str(request)
    local.uploads.upload(path, Request.from_doc(read_json(path)))
    status = read_json(status_of(path))
    assert status["state"] == "failed" and "does not match the manifest" in status["why"]
    assert not (root / "step-0000000001" / "manifest.json").exists()
    assert not (root / "step-0000000001" / "__0_0.distcp").exists()

    # The copy mended and the hand-off tried again, against a root that fails for a while
    # (a file where the step's directory must go): retried with backoff, then committed.
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    os.remove(status_of(path))
    (root / "step-0000000001").rename(tmp_path / "aside")  # its claim and rank 0's draft
    (root / "step-0000000001").write_text("in the way")

    def mended() -> None:
        (root / "step-0000000001").unlink()
        (tmp_path / "aside").rename(root / "step-0000000001")

    threading.Timer(1.5, mended).start()
    retrying = Agent(Config(spool=str(spool), metrics_port=-1, retries=5))
    retrying.uploads.upload(path, Request.from_doc(read_json(path)))
    assert read_json(status_of(path))["state"] == "committed"
    assert (root / "step-0000000001" / "manifest.json").exists()
    assert retrying.metrics.failures.labels("StorageError")._value.get() >= 1
    assert "try 2 in" in caplog.text


def test_settings_come_from_flags_then_environment_then_the_config_file(tmp_path, monkeypatch):
    conf = tmp_path / "agent.toml"
    conf.write_text('spool = "/from/file"\nupload_concurrency = 7\nspool_budget = "2GiB"\n[storage_options]\nendpoint_url = "http://x"\n')
    monkeypatch.setenv("CKPT_AGENT_UPLOAD_CONCURRENCY", "3")
    c = Config.load(["--config", str(conf), "--bandwidth-limit", "200MB"])
    assert (c.spool, c.upload_concurrency, c.spool_budget, c.bandwidth_limit) == ("/from/file", 3, 2 << 30, 200_000_000)
    assert c.storage_options == {"endpoint_url": "http://x"}
    assert Config.load(["--config", str(conf), "--upload-concurrency", "9"]).upload_concurrency == 9
    assert parse_size("1.5k") == 1500 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="needs a spool"):
        Config.load([])
    example = Config.load(["--config", str(REPO / "agents" / "ckpt-agent.toml")])  # the shipped example
    assert (example.spool, example.spool_budget, example.log_format) == ("/var/lib/ckpt-spool", 200 << 30, "json")
    conf.write_text("bogus = 1\n")
    with pytest.raises(ValueError, match="unknown agent settings"):
        Config.load(["--config", str(conf), "--spool", "/s"])
    with pytest.raises(ValueError, match="metrics_port is a TCP port"):
        Config.load(["--spool", "/s", "--metrics-port", "99999"])


def test_an_agent_that_cannot_serve_its_metrics_says_so_in_one_line_and_exits_2(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, says in ((["--metrics-port", str(port)], "Address already in use"), (["--metrics-addr", "192.0.2.1"], "cannot serve metrics on 192.0.2.1")):
            r = subprocess.run([sys.executable, "-m", "ckpt.cli.main", "agent", "--spool", str(tmp_path / "spool"), *flags], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_notice_file_given_to_the_agent_asks_the_ranks_of_the_node_to_stop(tmp_path, monkeypatch):
    from ckpt import preempt
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 0.0)
    spool, notice = tmp_path / "spool", tmp_path / "cloud-notice"
    local = Agent(Config(spool=str(spool), metrics_port=-1, preempt_file=str(notice)))
    rank = preempt.Preemption()
    rank.watch(Spool(str(spool)).notice_file)  # what a Checkpointer on the node watches
    rank.start(sigterm=False)
    local._relay_notice()
    assert not rank.asked()
    notice.touch()
    local._relay_notice()
    assert rank.asked() and "spool/preempt" in rank.why
    assert local.metrics.preemptions._value.get() == 1


def test_json_logs_carry_the_record_and_no_credentials():
    import logging

    from ckpt.agent.config import JsonFormatter

    record = logging.LogRecord("ckpt.agent.daemon", logging.INFO, __file__, 1, "uploading to %s", ("s3://AKIAXXX:hunter2@bucket/run",), None)
    record.step = 5
    doc = json.loads(JsonFormatter().format(record))
    assert doc["level"] == "info" and doc["step"] == 5 and doc["logger"] == "ckpt.agent.daemon"
    assert "hunter2" not in doc["message"] and "bucket/run" in doc["message"]


def test_a_stale_hand_off_never_overwrites_a_later_save_of_its_step(tmp_path):
    """Save A of step 1 is handed off on node X, whose agent stops before uploading it; the
    job restarts and saves step 1 again (save B) through node Y, committed. When X's agent
    comes back, A is superseded: it uploads nothing and the root keeps B's bytes."""
    import torch

    root, x, y = tmp_path / "root", tmp_path / "x", tmp_path / "y"
    model = torch.nn.Linear(64, 64)
    with agent(x, tmp_path / "x.log", env={"CKPT_FAULT": "agent_upload:0:1:sleep=60"}) as a:
        with ckpt.Checkpointer(str(root), model=model, interval=None, spool=str(x), timeout_s=3) as cp:
            cp.step_done()
            cp.save(blocking=True)
        a.kill()
    assert not (root / "step-0000000001" / "manifest.json").exists()
    with torch.no_grad():
        model.weight.add_(1.0)  # save B holds other bytes
    with agent(y, tmp_path / "y.log"):
        with ckpt.Checkpointer(str(root), model=model, interval=None, spool=str(y)) as cp:
            assert cp.step == 0
            cp.step_done()
            cp.save(blocking=True)
    committed = json.loads((root / "step-0000000001" / "manifest.json").read_text())
    (request,) = x.glob("jobs/*/step-0000000001/.requests/rank-00000.json")
    with agent(x, tmp_path / "x2.log") as a:
        # Its log, not the request's status file: the agent settles A and then removes what A
        # left in its spool (the status with it) a few ms later.
        until("X's agent to settle A", lambda: "claimed by a later save" in a.text(), logs=a.text)
        assert "hand-off of step 1 rank 0 failed" in a.text()
    assert json.loads((root / "step-0000000001" / "manifest.json").read_text()) == committed
    rc = ckpt_cli("verify", root, "--deep")
    assert rc.returncode == 0, rc.stdout + rc.stderr


def test_a_malformed_request_in_the_spool_neither_stops_the_agent_nor_fails_its_loop(tmp_path):
    """A request file of the wrong shape (another version's, another writer's) is passed over:
    the agent goes on serving the node. (A loop that failed at every pass stopped every upload
    and let the liveness probe restart the agent, which preempts every rank of the node.)"""
    spool, root = tmp_path / "spool", tmp_path / "root"
    bad = spool / "jobs" / "0000000000000000" / "step-0000000003" / ".requests" / "rank-00000.json"
    bad.parent.mkdir(parents=True)
    doc = {"root": str(root), "storage_options": {}, "rel": "step-0000000003", "step": 3, "save_id": "s", "rank": 0, "world": 1, "files": None, "manifest": {}, "started": 0.0}
    bad.write_text(json.dumps(doc))
    with agent(spool, tmp_path / "agent.log") as a:
        with ckpt.Checkpointer(str(root), model=torch.nn.Linear(2, 2), interval=None, spool=str(spool)) as cp:
            cp.step_done()
            cp.save(blocking=True)
        until("the agent to commit step 1", lambda: (root / "step-0000000001" / "manifest.json").exists(), logs=a.text)
        time.sleep(2.5)  # a housekeeping pass or two
        assert "agent loop" not in a.text()  # each failed pass says so (and stops the liveness beat)
    (step_dir,) = spool.glob("jobs/*/step-0000000001")
    assert not list(step_dir.glob(".writing/*"))  # the save's request was written: no rank is writing


def test_the_spool_keeps_a_failed_hand_offs_step_directory_while_a_later_save_of_the_step_writes_there(tmp_path):
    """A restarted job saves a step again whose earlier hand-off failed (superseded): its
    files land in the same spool directory before its request does. The agent's retention
    must not take them for the failed hand-off's leftovers."""
    spool = Spool(str(tmp_path / "spool"))
    store = Store(str(tmp_path / "root"))
    handoff = Handoff(store, spool, 0)
    rel, job, local = "step-0000000100", handoff.job, handoff.local
    assert local is not None
    old = {"root": str(tmp_path / "root"), "storage_options": {}, "rel": rel, "step": 100, "save_id": "old", "rank": 0, "world": 2, "files": ["__0_0.distcp"], "manifest": {}, "started": 0.0}
    request = spool.request_path(job, rel, 0)
    os.makedirs(os.path.dirname(request))
    Path(request).write_text(json.dumps(old))
    os.makedirs(os.path.dirname(status_of(request)))
    Path(status_of(request)).write_text(json.dumps({"state": "failed", "save_id": "old"}))
    handoff.writing(local, rel)  # the new save, as persist starts writing into the spool
    Path(local.path(rel, "__0_0.distcp")).write_bytes(b"the new save's bytes")
    agent = Agent(Config(spool=spool.path, metrics_port=-1))
    agent.retention.prune()
    assert Path(local.path(rel, "__0_0.distcp")).read_bytes() == b"the new save's bytes"
    # Its ranks elsewhere are slow: ten minutes later the files are old, the save still on.
    old = time.time() - 700
    for f in Path(spool.job_dir(job), rel).rglob("*"):
        os.utime(f, (old, old))
    marker = Path(spool.writing_path(job, rel, 0))
    os.utime(marker)
    agent.retention.prune()
    assert Path(local.path(rel, "__0_0.distcp")).read_bytes() == b"the new save's bytes"
    # A marker older than commit_wait is a crashed writer's: the directory goes.
    ancient = time.time() - agent.config.commit_wait - 1
    os.utime(marker, (ancient, ancient))
    agent.retention.prune()
    assert not os.path.exists(os.path.join(spool.job_dir(job), rel))
    # A save that fails takes its marker away with its files.
    handoff.writing(local, rel)
    assert marker.exists()
    handoff.discard(local, rel, [])
    assert not marker.exists()


def test_the_spool_keeps_the_newest_saves_even_when_an_older_ones_upload_ended_last(tmp_path):
    """Step 10's upload of one rank ended after steps 15 and 20 were handed off (the agent
    writes its record then): the spool's retention still keeps 15 and 20, the newest saves,
    not 10 because a file of the agent's own in it is newer."""
    spool = Spool(str(tmp_path / "spool"))
    handoff = Handoff(Store(str(tmp_path / "root")), spool, 0)
    now = time.time()
    for age, step in ((30, 10), (20, 15), (10, 20)):
        rel = f"step-{step:010d}"
        request = spool.request_path(handoff.job, rel, 0)
        os.makedirs(os.path.dirname(request))
        Path(handoff.local.path(rel, "__0_0.distcp")).write_bytes(b"bytes")
        doc = {"root": str(tmp_path / "root"), "storage_options": {}, "rel": rel, "step": step, "save_id": f"s{step}", "rank": 0,
               "world": 1, "files": ["__0_0.distcp"], "manifest": {}, "started": 0.0}  # fmt: skip
        Path(request).write_text(json.dumps(doc))
        os.makedirs(os.path.dirname(status_of(request)))
        Path(status_of(request)).write_text(json.dumps({"state": "committed", "save_id": f"s{step}"}))
        for f in Path(spool.job_dir(handoff.job), rel).rglob("*"):
            os.utime(f, (now - age, now - age))
        os.utime(status_of(request), (now - 30 + 25 if step == 10 else now - age,) * 2)  # step 10's record: last
    Agent(Config(spool=spool.path, metrics_port=-1, keep_spool=2)).retention.prune()
    assert sorted(p.name for p in Path(spool.job_dir(handoff.job)).glob("step-*")) == ["step-0000000015", "step-0000000020"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root, to run the trainer as another user")
def test_a_trainer_that_cannot_write_the_spool_writes_to_the_root_and_commits_itself(tmp_path):
    """A spool the agent made for its own user (a systemd StateDirectory, root's and 0755):
    a trainer running as another user neither fails to start nor fails its saves; it says
    why and writes to the root itself."""
    base = Path(tempfile.mkdtemp(prefix="ckpt-spool-perm-", dir="/tmp"))  # reachable by the other user
    try:
        base.chmod(0o755)
        spool, root = base / "spool", base / "root"
        spool.mkdir(mode=0o755)
        root.mkdir()
        root.chmod(0o777)
        script = (
            "import torch, ckpt\n"
            f"with ckpt.Checkpointer({str(root)!r}, model=torch.nn.Linear(2, 2), interval=None, spool={str(spool)!r}) as cp:\n"
            "    cp.step_done()\n"
            "    cp.save(blocking=True)\n"
            "    print('committed', cp.last_commit.step)\n"
        )
        with agent(spool, tmp_path / "agent.log"):
            r = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", sys.executable, "-c", script],
                env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(base)}, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
        assert r.returncode == 0 and "committed 1" in r.stdout, r.stdout + r.stderr
        assert "this user cannot create" in r.stderr and "writing to" in r.stderr
        assert (root / "step-0000000001" / "manifest.json").exists()
        assert not list(spool.glob("jobs/*/step-*"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_agent_refuses_requests_that_name_paths_outside_the_spool(tmp_path):
    spool, root, secret = tmp_path / "spool", tmp_path / "root", tmp_path / "secret"
    secret.write_text("not for the root")
    step_dir = spool / "jobs" / "0123456789abcdef" / "step-0000000001"
    manifest = {"step": 1, "world_size": 1, "created": 0.0, "files": {str(secret): {"size": 16, "checksum": "xxh3_64:" + "0" * 16, "rank": 0}}, "format": "ckpt", "format_version": 2}
    doc = {"root": str(root), "storage_options": {}, "rel": "step-0000000001", "step": 1, "save_id": "s", "rank": 0, "world": 1, "files": [str(secret)], "manifest": manifest, "started": 0.0}
    request = step_dir / ".requests" / "rank-00000.json"
    request.parent.mkdir(parents=True)
    request.write_text(json.dumps(doc))
    Agent(Config(spool=str(spool), metrics_port=-1)).uploads.upload(str(request), Request.from_doc(doc))
    status = read_json(status_of(str(request)))
    assert status["state"] == "failed" and "not plain file names" in status["why"]
    assert not root.exists()
    Agent(Config(spool=str(spool), metrics_port=-1, allowed_roots=["s3://ours/"])).uploads.upload(str(request), Request.from_doc({**doc, "files": ["__0_0.distcp"], "manifest": {**manifest, "files": {"__0_0.distcp": manifest["files"][str(secret)]}}}))
    assert "allowed_roots" in read_json(status_of(str(request)))["why"]


def test_allowed_roots_compare_whole_path_components_after_resolving_local_paths(tmp_path):
    from ckpt.agent.config import within

    allowed = tmp_path / "allowed"
    (tmp_path / "elsewhere").mkdir()
    (allowed / "runs").mkdir(parents=True)
    (allowed / "runs" / "link").symlink_to(tmp_path / "elsewhere")
    assert within(str(allowed / "runs" / "a"), str(allowed)) and within(f"file://{allowed}/b", f"{allowed}/")
    for outside in (f"{allowed}/../elsewhere", f"{allowed}-other/x", str(allowed / "runs" / "link" / "x")):
        assert not within(outside, str(allowed)), outside
    assert within("s3://team-a/run", "s3://team-a") and within("s3://team-a", "s3://team-a/")
    for outside in ("s3://team-a-other/run", "s3://team-a/../team-b/run", "gs://team-a/run", "s3://team-b"):
        assert not within(outside, "s3://team-a"), outside
    # The agent itself: a root that only starts with an allowed one's text is refused.
    spool, root = tmp_path / "spool", f"{allowed}/../elsewhere/root"
    manifest = {"step": 1, "world_size": 1, "created": 0.0, "files": {"__0_0.distcp": {"size": 1, "checksum": "xxh3_64:00", "rank": 0}}, "format": "ckpt", "format_version": 2}
    doc = {"root": root, "storage_options": {}, "rel": "step-0000000001", "step": 1, "save_id": "s", "rank": 0, "world": 1, "files": ["__0_0.distcp"], "manifest": manifest, "started": 0.0}
    request = spool / "jobs" / "0123456789abcdef" / "step-0000000001" / ".requests" / "rank-00000.json"
    request.parent.mkdir(parents=True)
    request.write_text(json.dumps(doc))
    (request.parent.parent / "__0_0.distcp").write_bytes(b"x")
    Agent(Config(spool=str(spool), metrics_port=-1, allowed_roots=[str(allowed)])).uploads.upload(str(request), Request.from_doc(doc))
    assert "allowed_roots" in read_json(status_of(str(request)))["why"]
    assert not (tmp_path / "elsewhere" / "root").exists()


def test_only_where_the_store_is_goes_to_the_spool_never_credentials():
    from ckpt.node.spool import public_options

    options = {"endpoint_url": "http://minio:9000", "key": "AKIA", "secret": "s3cr3t", "token": "t", "account_key": "k",
               "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": "x"}, "s3_additional_kwargs": {"SSECustomerKey": "k"}}
    assert public_options(options) == {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}


@pytest.mark.parametrize("beat", ["soon", None, True, [1], float("nan"), "1e12"])
def test_a_heartbeat_that_is_not_a_number_is_no_agent_and_no_error(tmp_path, beat):
    """Every rank asks for its node's agent before the job's first collective: an agent file
    that does not parse as an agent's must say "none", never raise on one rank alone."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "agent.json").write_text(json.dumps({"heartbeat": beat, "budget": 1}))
    assert Spool(str(spool)).agent() is None
    assert Handoff.find(str(spool), Store(str(tmp_path / "root")), 0, None) is None
    (spool / "agent.json").write_text(json.dumps({"heartbeat": time.time(), "budget": 1}))
    assert Spool(str(spool)).agent() is not None  # a live one still counts
