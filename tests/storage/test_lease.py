"""The root lease: one job writes to a root at a time (ckpt.storage.lease).

Real jobs (tests/workers/lease_worker.py, one process each, or two gloo ranks) on a local
root and on a real S3-protocol server; what is checked is what a user would: the exit status,
the error and its message, the files of the root before and after.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import ckpt
from ckpt.storage import lease
from ckpt.storage.lease import Holder, Lease, judge
from ckpt.storage.lease_keeper import LeaseKeeper, seen_now
from ckpt.storage.store import Store, Tagged
from tests.support.cli import ckpt_cli
from tests.support.launch import REPO, WORKERS, spawn, start
from tests.support.launch import wait as wait_ranks
from tests.support.s3proxy import FaultyProxy

WORKER = WORKERS / "lease_worker.py"
TTL = 30.0  # long enough never to expire by itself during a test that does not wait for it


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("s3_root")  # the AWS environment reaches the server: children inherit it


_RUNNING: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """A failed test leaves no worker behind waiting for a file that will never appear."""
    yield
    while _RUNNING:
        proc = _RUNNING.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


class Job:
    """One run of the worker as job `name` (its CKPT_JOB_ID)."""

    def __init__(self, tmp: Path, name: str, root: str, *args: object, env: dict[str, str] | None = None, label: str = ""):
        label = label or name
        self.events_file = tmp / f"{label}.jsonl"
        self.log_file = tmp / f"{label}.log"
        self.proc = spawn(
            WORKER, "--root", root, "--events", str(self.events_file), *map(str, args),
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_JOB_ID": name, **(env or {})},
            log=self.log_file,
        )  # fmt: skip
        self.pid = self.proc.pid
        _RUNNING.append(self.proc)

    def events(self) -> list[dict]:
        if not self.events_file.exists():
            return []
        return [json.loads(line) for line in self.events_file.read_text().splitlines() if line.strip()]

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events() if e["event"] == kind), None)

    def wait_event(self, kind: str, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while (found := self.event(kind)) is None:
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {kind!r}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {kind!r} within {timeout} s:\n{self.log()}"
            time.sleep(0.05)
        return found

    def wait(self, timeout: float = 90) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.log()}") from None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_file.read_text()[-4000:] if self.log_file.exists() else ""


def finish(job: Job, rc: int = 0) -> None:
    got = job.wait()
    assert got == rc, f"exit {got}, wanted {rc}:\n{job.log()}"


# The temporary a renewal writes and renames over the lease, on a local root (storage.write_atomic).
LEASE_TMP = re.compile(rf"\.{re.escape(lease.LEASE_NAME)}\.[0-9a-f]{{32}}\.tmp")


def files(root: str, steps_only: bool = False) -> dict[str, bytes]:
    """Every file of the root but the lease (its lock, and the temporary of a renewal under
    way, which the holder renames a moment later), with its bytes; with `steps_only`, only
    the checkpoints."""
    store = Store(root)
    try:
        found = store.fs.find(store.root)
    except FileNotFoundError:
        return {}
    out = {}
    for path in found:
        rel = path[len(store.root) + 1 :]
        if rel in (lease.LEASE_NAME, f".{lease.LEASE_NAME}.lock") or LEASE_TMP.fullmatch(rel) or (steps_only and not rel.startswith("step-")):
            continue
        out[rel] = store.fs.cat_file(path)
    return out


def steps(root: str) -> list[str]:
    return sorted({p.split("/")[0] for p in files(root, steps_only=True)})


def cli(*args: str) -> subprocess.CompletedProcess:
    return ckpt_cli(*args, timeout=60)


def holder(root: str) -> Holder | None:
    return lease.read(Store(root))


# -- a second job is refused --------------------------------------------------------------------


def test_a_second_job_on_a_held_root_is_refused_saying_who_holds_it_and_writes_nothing(tmp_path, root):
    a = Job(tmp_path, "job-a", root, "--steps", 3, "--pause-at", 2, "--resume", tmp_path / "go-on", "--ttl", TTL)
    a.wait_event("paused")
    before = files(root)
    assert steps(root) == ["step-0000000001", "step-0000000002"]

    b = Job(tmp_path, "job-b", root, "--steps", 3, "--ttl", TTL)
    finish(b, 3)

    error = b.event("error")
    assert error is not None and error["type"] == "LeaseHeld", b.log()
    assert b.event("entered") is None  # refused on enter, before any restore
    message = error["message"]
    for needed in (
        root,
        "job 'job-a'",
        f"host {socket.gethostname()}",
        f"pid {a.pid}",
        "last renewed",
        "expires at",
        "CKPT_TAKEOVER=1",
        "lease=ckpt.Lease(takeover=True)",
        f"ckpt lease {root} --break",
        "'job-b'",
    ):
        assert needed in message, f"{needed!r} not in {message!r}"
    assert files(root) == before  # nothing read into, nothing written: no event, no debris

    (tmp_path / "go-on").touch()
    finish(a)
    assert a.event("done")["step"] == 3


def test_every_rank_of_a_refused_job_raises_the_same_error_and_none_hangs(tmp_path):
    root = str(tmp_path / "root")
    a = Job(tmp_path, "job-a", root, "--bare", "--go", tmp_path / "go", "--resume", tmp_path / "release", "--ttl", TTL)
    (tmp_path / "go").touch()
    a.wait_event("took")

    events = tmp_path / "b.jsonl"
    ranks = start(2, WORKER, "--root", root, "--events", str(events), "--ttl", str(TTL), env={"CKPT_JOB_ID": "job-b"}, log_dir=tmp_path)
    codes = wait_ranks(ranks, timeout=120)

    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [3, 3], logs
    errors = [json.loads(Path(f"{events}.rank{r}").read_text().splitlines()[-1]) for r in range(2)]
    assert [e["type"] for e in errors] == ["LeaseHeld", "LeaseHeld"]
    assert errors[0]["message"] == errors[1]["message"] and "job 'job-a'" in errors[0]["message"]
    assert files(root) == {}
    (tmp_path / "release").touch()
    finish(a)


# -- who may take it ----------------------------------------------------------------------------


def test_the_same_job_restarting_takes_its_root_at_once_even_while_its_old_process_lives(tmp_path):
    root = str(tmp_path / "root")
    old = Job(tmp_path, "job-x", root, "--steps", 4, "--pause-at", 2, "--resume", tmp_path / "never", "--ttl", 600, label="old")
    old.wait_event("paused")

    began = time.monotonic()
    new = Job(tmp_path, "job-x", root, "--steps", 4, "--ttl", 600, label="new")
    finish(new)

    assert new.event("entered")["restored"] == 2
    assert new.event("done")["step"] == 4
    assert time.monotonic() - began < 60  # not a wait for the ttl (600 s)
    assert "it is held by this same job" in new.log()
    old.kill()


def test_a_sigkilled_holder_on_this_machine_is_replaced_at_once(tmp_path, root):
    a = Job(tmp_path, "job-a", root, "--steps", 4, "--pause-at", 2, "--resume", tmp_path / "never", "--ttl", 600)
    a.wait_event("paused")
    a.kill()  # no clean exit: the lease stays, held by a process that is gone

    assert holder(root).pid == a.pid and holder(root).released is None
    shown = cli("lease", root).stdout  # not "expires in 10 min": the next job takes it at once
    assert f"pid {a.pid}), whose process is gone from this machine" in shown and "the next job here takes it at once" in shown, shown
    assert json.loads(cli("lease", root, "--json").stdout)["holder_alive"] is False
    b = Job(tmp_path, "job-b", root, "--steps", 4, "--ttl", 600)
    finish(b)

    assert b.event("entered")["restored"] == 2
    assert f"its holder, job 'job-a' (host {socket.gethostname()}, pid {a.pid}), is gone from this machine" in b.log()


def stop_between_renewals(job: Job, root: str) -> None:
    """SIGSTOP `job`, not in the middle of a renewal of its lease: on a local root that holds
    the lease's lock, which the next job to take the lease would wait for for ever."""
    import fcntl

    lock = None if root.startswith("s3://") else os.path.join(root, f".{lease.LEASE_NAME}.lock")
    for _ in range(100):
        job.proc.send_signal(signal.SIGSTOP)
        while not all(_stopped(t) for t in Path(f"/proc/{job.pid}/task").iterdir()):
            time.sleep(0.001)  # each thread stops when the kernel gets to it
        if lock is None:
            return
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return  # free (closing the descriptor unlocks it)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        job.proc.send_signal(signal.SIGCONT)  # caught renewing: let it finish, try again
        time.sleep(0.05)
    raise AssertionError(f"the lease's lock stayed held:\n{job.log()}")


def _stopped(task: Path) -> bool:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
    except FileNotFoundError:  # a thread that ended
        return True


def test_an_expired_lease_is_taken_over_and_its_frozen_holder_commits_nothing_more(tmp_path, root):
    ttl = 6.0  # renewed every 2 s: live for at least 4 s after it stops
    a = Job(tmp_path, "job-a", root, "--steps", 5, "--pause-at", 2, "--resume", tmp_path / "go-on", "--ttl", ttl)
    a.wait_event("paused")
    # Set up (Python, ckpt, the store's client) before a stops, so that it only reads the
    # lease, at once, after the stop: milliseconds of the >= 4 s a stopped holder stays live.
    early = Job(tmp_path, "job-b", root, "--bare", "--go", tmp_path / "go", "--ttl", ttl, label="early")
    early.wait_event("ready")
    stop_between_renewals(a, root)  # alive, but renews nothing: a hung job
    try:
        (tmp_path / "go").touch()
        finish(early, 3)
        refused = early.event("refused")
        assert refused is not None  # alive, and not expired yet
        assert refused["time"] < holder(root).expires, refused

        while time.time() <= holder(root).expires + 0.2:
            time.sleep(0.1)
        b = Job(tmp_path, "job-b", root, "--steps", 5, "--ttl", ttl, "--keep", 2)
        finish(b)
        assert b.event("entered")["restored"] == 2
        assert "it expired: job 'job-a'" in b.log()
        after_b = files(root, steps_only=True)
        # Retention kept the last two (the one restored from retired as b left): 2 and 3 are gone.
        assert steps(root) == ["step-0000000004", "step-0000000005"]
    finally:
        a.proc.send_signal(signal.SIGCONT)
    (tmp_path / "go-on").touch()
    finish(a, 3)

    error = a.event("error")
    assert error["type"] == "SaveFailed", a.log()
    assert "no longer holds the lease" in error["message"] and "job 'job-b'" in error["message"]
    # Its save of step 3 would have landed where nothing is (b's retention removed it): the
    # lease alone stopped it, before it made the directory.
    assert files(root, steps_only=True) == after_b


def test_the_check_before_a_commit_renews_a_lease_whose_renewals_failed_so_no_job_finds_it_expired(tmp_path, root):
    """A store that stalled made every renewal fail until the lease expired: any job could take
    the root now. The check before the next commit renews it (a conditional write) rather than
    only reading it, so a job that looks after it finds the root held; one that took the root
    in between makes the check fail."""
    store = Store(root)
    keeper = LeaseKeeper.take(store, Lease(ttl_s=1.5))
    stalled = ckpt.StorageError("the store stalled")
    try:
        keeper.renew = lambda: (_ for _ in ()).throw(stalled)  # what the renewal thread calls
        while time.time() <= holder(root).expires + 0.1:
            time.sleep(0.05)
        assert holder(root).expires < time.time()  # expired: any job may take it

        keeper.check()
        held = holder(root)
        assert held.run_id == keeper.mine.run_id and held.expires > time.time() + 0.5, held
        another = dataclasses.replace(lease.this_process(60.0), job_id="job-b", run_id="run-b", host="elsewhere")
        assert not judge(held, another, time.time(), takeover=False, alive=None).take

        # Expired again, and taken meanwhile by another job: the check says so.
        while time.time() <= holder(root).expires + 0.1:
            time.sleep(0.05)
        assert store.put_if_unchanged(lease.LEASE_NAME, another.to_json(), store.read_tagged(lease.LEASE_NAME).tag)
        with pytest.raises(ckpt.LeaseHeld, match="job 'job-b'"):
            keeper.check()
    finally:
        keeper.close(release=False)


def test_a_renewal_throttled_past_the_ttl_fails_the_check_before_a_commit_instead_of_blocking_it(s3_endpoint, s3_root, s3_options):
    """The root's lease.json answered nothing but SlowDown: the renewal under way holds the
    lease while it is sent again (up to `Transfer.deadline_s`, 30 s here). The check before a
    commit waits for it up to the lease's ttl (1 s), past which the lease may have expired
    whatever the renewal does, and fails the save with a StorageError that says so. Before,
    it waited for the renewal without end (outside review of issue 40)."""
    proxy = FaultyProxy(s3_endpoint)
    store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url}, ckpt.Transfer(attempts=2, backoff_s=0.05, max_backoff_s=0.1, throttled_s=30.0, deadline_s=30.0))
    keeper = LeaseKeeper.take(store, Lease(ttl_s=1.0))
    try:
        proxy.limit(0.0, under=f"/{s3_root.removeprefix('s3://')}/{lease.LEASE_NAME}")
        while not proxy.throttled_at:  # the next renewal (every ttl/3) is under way
            time.sleep(0.01)
        checked: list[Exception | None] = []
        start = time.monotonic()
        check = threading.Thread(target=lambda: checked.append(_raised(keeper.check)), daemon=True)
        check.start()
        check.join(5.0)

        assert checked, "the check still waits for the renewal"
        assert isinstance(checked[0], ckpt.StorageError) and not isinstance(checked[0], ckpt.LeaseHeld), checked
        assert "its renewal has been under way for over 1 s (the lease's ttl)" in str(checked[0])
        assert 1.0 <= time.monotonic() - start < 3.0
    finally:
        proxy.limit(None)
        keeper.close(release=False)
        proxy.close()


def _raised(call) -> Exception | None:
    try:
        call()
    except Exception as e:  # what a thread's call raised, for the test to look at
        return e
    return None


@pytest.mark.parametrize("unready", [False, True], ids=["", "its-staging-failing-too"])
def test_takeover_takes_a_live_lease_and_the_old_holders_next_save_fails_without_writing(tmp_path, root, unready):
    # on_error="log" would go on past a failed save: one refused for a lost root stops the job,
    # at that save, even when the staging of that save failed as well.
    fault = {"CKPT_FAULT": "prepare:0:3:raise"} if unready else {}
    a = Job(tmp_path, "job-a", root, "--steps", 5, "--pause-at", 2, "--resume", tmp_path / "go-on", "--ttl", TTL, "--on-error", "log", env=fault)
    a.wait_event("paused")

    # Told by the policy on a local root, by the environment on S3.
    how = ["--takeover"] if not root.startswith("s3://") else []
    b = Job(tmp_path, "job-b", root, "--steps", 5, "--ttl", TTL, "--keep", 2, *how, env={} if how else {"CKPT_TAKEOVER": "1"})
    finish(b)
    assert b.event("entered")["restored"] == 2
    assert "taking it over from job 'job-a'" in b.log()
    after_b = files(root, steps_only=True)

    (tmp_path / "go-on").touch()
    finish(a, 3)
    error = a.event("error")
    assert error["type"] == "SaveFailed" and "no longer holds the lease" in error["message"], a.log()
    assert "save of step 3 " in error["message"] and ("ckpt fault: prepare" in error["message"]) == unready, error
    assert files(root, steps_only=True) == after_b
    assert [e["step"] for e in a.events() if e["event"] == "committed"] == [1, 2]


@pytest.mark.parametrize("start_from", ["free", "stale"])
def test_of_two_jobs_racing_for_a_root_exactly_one_takes_it(tmp_path, root, start_from):
    for trial in range(3):
        where = f"{root}/trial{trial}"
        here = tmp_path / f"trial{trial}"
        here.mkdir()
        if start_from == "stale":  # a holder killed on this machine: both may replace it, one does
            dead = Job(here, "job-dead", where, "--bare", "--go", here / "go0", "--resume", here / "never", "--ttl", TTL)
            (here / "go0").touch()
            dead.wait_event("took")
            dead.kill()
        racers = [Job(here, f"job-{n}", where, "--bare", "--go", here / "go", "--resume", here / "release", "--ttl", TTL) for n in "pq"]
        for r in racers:
            r.wait_event("ready")
        (here / "go").touch()
        outcomes = {}
        for r in racers:
            deadline = time.monotonic() + 60
            while not (done := [e for e in r.events() if e["event"] in ("took", "refused")]):
                exited = r.proc.poll() is not None
                assert not (exited and not [e for e in r.events() if e["event"] in ("took", "refused")]), r.log()
                assert time.monotonic() < deadline, r.log()
                time.sleep(0.02)
            outcomes[r] = done[0]
        assert sorted(o["event"] for o in outcomes.values()) == ["refused", "took"], [r.log() for r in racers]
        winner = next(r for r, o in outcomes.items() if o["event"] == "took")
        loser = next(r for r, o in outcomes.items() if o["event"] == "refused")
        assert holder(where).pid == winner.pid
        assert f"pid {winner.pid}" in outcomes[loser]["message"]
        (here / "release").touch()
        finish(winner)
        finish(loser, 3)


# -- leaving ------------------------------------------------------------------------------------


def test_a_clean_exit_releases_the_lease_and_a_failed_one_keeps_it_for_a_restart(tmp_path):
    root = str(tmp_path / "root")
    a = Job(tmp_path, "job-a", root, "--steps", 2, "--ttl", TTL)
    finish(a)
    held = holder(root)
    assert held.job_id == "job-a" and held.released is not None and "left cleanly" in held.released_by
    assert lease.state(held, time.time()) == "free"

    c = Job(tmp_path, "job-c", root, "--steps", 4, "--raise-at", 3, "--ttl", TTL)
    finish(c, 3)
    assert c.event("error")["type"] == "RuntimeError"
    held = holder(root)
    assert (held.job_id, held.pid, held.released) == ("job-c", c.pid, None)
    assert lease.state(held, time.time()) == "held"  # until it expires, or its own restart


def test_lease_none_takes_no_lease(tmp_path):
    import torch

    model = torch.nn.Linear(2, 2)
    with ckpt.Checkpointer(tmp_path / "root", model=model, interval=None, lease=None) as cp:
        cp.step_done()
    assert (tmp_path / "root" / "step-0000000001" / "manifest.json").is_file()
    assert not (tmp_path / "root" / lease.LEASE_NAME).exists()


def test_checkpointers_one_after_another_in_one_process_take_the_root_each_time(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv("CKPT_JOB_ID", raising=False)
    model = torch.nn.Linear(2, 2)
    for expect in (None, 1):
        with ckpt.Checkpointer(tmp_path / "root", model=model, interval=None, lease=Lease(ttl_s=TTL)) as cp:
            assert cp.restored_step == expect
            assert holder(str(tmp_path / "root")).pid == os.getpid()
            cp.step_done()
    assert holder(str(tmp_path / "root")).released is not None


def test_a_second_checkpointer_on_the_root_in_one_process_shares_the_jobs_lease(tmp_path, monkeypatch):
    """An evaluation inside the training block (a second Checkpointer on the same root, in the
    same process) shares the job's hold on the root: the training block's saves still commit
    after it left, cleanly or not, and the lease is released only when the last one leaves."""
    import torch

    monkeypatch.delenv("CKPT_JOB_ID", raising=False)
    root = str(tmp_path / "root")
    model = torch.nn.Linear(2, 2)
    with ckpt.Checkpointer(root, model=model, interval=None, lease=Lease(ttl_s=TTL)) as train:
        train.save()
        train.wait()
        taken = holder(root)
        evaluated = torch.nn.Linear(2, 2)
        with ckpt.Checkpointer(root, model=evaluated, interval=None, lease=Lease(ttl_s=TTL)) as ev:
            assert ev.restored_step == 0 and torch.equal(evaluated.weight, model.weight)
        with pytest.raises(RuntimeError, match="an evaluation failed"):
            with ckpt.Checkpointer(root, model=torch.nn.Linear(2, 2), interval=None, lease=Lease(ttl_s=TTL)):
                raise RuntimeError("an evaluation failed")
        now = holder(root)
        assert (now.run_id, now.pid, now.released) == (taken.run_id, os.getpid(), None)  # still the job's own take
        with torch.no_grad():
            model.weight.add_(1.0)
        train.step_done()
        train.save()
        train.wait()
        assert train.last_commit.step == 1  # committed: the lease was never lost
    assert holder(root).run_id == taken.run_id and "left cleanly" in holder(root).released_by
    with ckpt.Checkpointer(root, model=evaluated, interval=None, lease=Lease(ttl_s=TTL)) as ev:
        assert ev.restored_step == 1 and torch.equal(evaluated.weight, model.weight)


# -- the CLI ------------------------------------------------------------------------------------


def test_the_cli_shows_the_holder_and_break_frees_the_root_from_a_live_job(tmp_path, root):
    a = Job(tmp_path, "job-a", root, "--steps", 4, "--pause-at", 2, "--resume", tmp_path / "go-on", "--ttl", TTL)
    a.wait_event("paused")

    shown, as_json, listed = cli("lease", root), cli("lease", root, "--json"), cli("ls", root)
    assert shown.returncode == 0, shown.stderr
    assert f"held by job 'job-a' (host {socket.gethostname()}, pid {a.pid})" in shown.stdout and "expires in" in shown.stdout
    doc = json.loads(as_json.stdout)
    assert doc["state"] == "held" and doc["holder"]["job_id"] == "job-a" and 0 < doc["expires_in_s"] <= TTL and doc["holder_alive"] is True
    assert listed.returncode == 0 and "lease: held by job 'job-a'" in listed.stdout.splitlines()[-1]

    broke = cli("lease", root, "--break")
    assert broke.returncode == 0, broke.stderr
    assert f"broke the lease of job 'job-a' (host {socket.gethostname()}, pid {a.pid})" in broke.stdout
    assert json.loads(cli("lease", root, "--json").stdout)["state"] == "free"
    assert cli("lease", root, "--break").stdout.strip().endswith("no live lease to break")

    before = files(root, steps_only=True)
    (tmp_path / "go-on").touch()
    finish(a, 3)
    error = a.event("error")
    assert error["type"] == "SaveFailed" and "broken by `ckpt lease --break`" in error["message"], a.log()
    assert files(root, steps_only=True) == before


def test_the_cli_says_when_a_root_has_no_lease_and_refuses_a_missing_root(tmp_path):
    (tmp_path / "root").mkdir()
    r = cli("lease", str(tmp_path / "root"))
    assert r.returncode == 0 and r.stdout.strip().endswith("free (no lease)")
    assert "lease:" not in cli("ls", str(tmp_path / "root")).stdout
    missing = cli("lease", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# -- the rules, on plain values -----------------------------------------------------------------


def _holder(**kw: object) -> Holder:
    base = dict(job_id="a", host="h1", pid=100, run_id="r", acquired=0.0, renewed=1000.0, ttl_s=60.0, boot_id="b", pid_ns=7, pid_start=5)
    return Holder(**{**base, **kw})  # type: ignore[arg-type]


def test_who_may_take_a_held_lease():
    me = _holder(job_id="b", host="h2", pid=200, run_id="s", renewed=1010.0)
    live_elsewhere = _holder()
    assert not judge(live_elsewhere, me, 1010.0, takeover=False, alive=None).take
    assert judge(live_elsewhere, me, 1010.0, takeover=True, alive=None).warn
    assert judge(live_elsewhere, me, 1061.0, takeover=False, alive=None).take  # expired: renewed + ttl passed
    assert not judge(live_elsewhere, me, 1059.0, takeover=False, alive=None).take
    assert judge(_holder(job_id="b"), me, 1010.0, takeover=False, alive=None).take  # the same job
    assert judge(_holder(released=1005.0), me, 1010.0, takeover=False, alive=None).take
    here = _holder(host="h2", boot_id="b", pid_ns=7)
    me_here = _holder(job_id="b", host="h2", pid=200, pid_start=9)
    assert judge(here, me_here, 1010.0, takeover=False, alive=False).take  # its process is gone
    assert not judge(here, me_here, 1010.0, takeover=False, alive=True).take
    own = _holder(job_id="old", host="h2", pid=200, pid_start=9)
    assert judge(own, me_here, 1010.0, takeover=False, alive=True).take  # this very process
    reused_pid = _holder(job_id="old", host="h2", pid=200, pid_start=3)
    assert not judge(reused_pid, me_here, 1010.0, takeover=False, alive=True).take


def test_the_job_id_comes_from_the_environment_in_order(monkeypatch, tmp_path):
    for var in lease.JOB_ID_VARS:
        monkeypatch.delenv(var, raising=False)
    fresh = lease.job_id()
    assert fresh.startswith("run-") and lease.job_id() == fresh  # one per process
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert lease.job_id() == "4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: no identity
    assert lease.job_id() == "4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    assert lease.job_id() == "rdzv-7"
    monkeypatch.setenv("CKPT_JOB_ID", "mine")
    assert lease.job_id() == "mine"
    # A refusal says where this job's id came from: a made-up one is never a restart's.
    doc = Holder("job-x", "h", 1, "r", 0.0, 0.0, 60.0).to_json()
    store, other = Store(str(tmp_path / "root")), Tagged(doc, "", len(doc))  # the lease as read
    assert "from CKPT_JOB_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID" in lease.refusal(store, other, lease.this_process(60.0))
    for var in lease.JOB_ID_VARS:
        monkeypatch.delenv(var, raising=False)
    said = lease.refusal(store, other, lease.this_process(60.0))
    assert f"this job's id is {fresh!r}, made up for this process: none of CKPT_JOB_ID" in said


def test_a_bad_ttl_and_an_unreadable_lease_get_clear_errors(tmp_path, monkeypatch):
    for bad in (0, -1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ValueError, match="ttl"):
            Lease(ttl_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease must be"):
        ckpt.Checkpointer(tmp_path / "r", lease=60)  # type: ignore[arg-type]

    monkeypatch.delenv("CKPT_TAKEOVER", raising=False)
    store = Store(tmp_path / "root")
    store.put_atomic(lease.LEASE_NAME, b"{not json")
    with pytest.raises(ckpt.LeaseHeld, match="unreadable.*--break"):
        LeaseKeeper.take(store, Lease(ttl_s=TTL))
    assert store.read_bytes(lease.LEASE_NAME) == b"{not json"  # refused: nothing replaced
    keeper = LeaseKeeper.take(store, Lease(ttl_s=TTL, takeover=True))
    keeper.close(release=True)
    assert holder(str(tmp_path / "root")).released is not None


def test_a_root_that_cannot_be_reached_is_a_storage_error_never_a_free_lease(s3_endpoint, s3_strict_endpoint, s3_options):
    missing_bucket = Store("s3://no-such-bucket-here/run", s3_options)
    refused = Store("s3://bucket/run", {**s3_options, "endpoint_url": s3_strict_endpoint})  # 403 for everything
    for store in (missing_bucket, refused):
        with pytest.raises(ckpt.StorageError):
            LeaseKeeper.take(store, Lease(ttl_s=TTL))
        with pytest.raises(ckpt.StorageError):
            lease.read(store)


def test_a_lease_held_from_another_machine_is_waited_out_and_refused_only_if_it_renews(tmp_path):
    """Nobody here can tell whether a holder on another machine still runs (a crashed job's
    restart often lands on another node): enter waits for its expiry, and takes it unless it
    was renewed meanwhile."""
    import dataclasses
    import threading

    import torch

    from ckpt.storage.lease import LEASE_NAME, this_process

    def foreign(root: Path, ttl: float) -> None:
        now = time.time()
        held = dataclasses.replace(this_process(ttl), job_id="job-elsewhere", host="node-7", boot_id="another-boot", renewed=now, acquired=now)
        root.mkdir(parents=True, exist_ok=True)
        (root / "foreign.tmp").write_bytes(held.to_json())
        os.replace(root / "foreign.tmp", root / LEASE_NAME)  # whole, as its holder would write it

    def enter(root: Path) -> None:
        model = torch.nn.Linear(2, 2)
        with ckpt.Checkpointer(str(root), model=model, interval=None, handle_sigterm=False, lease=ckpt.Lease(ttl_s=30)):
            pass

    quiet = tmp_path / "quiet"
    foreign(quiet, ttl=2.0)
    began = time.monotonic()
    enter(quiet)  # waited out and taken
    assert 1.0 < time.monotonic() - began < 15
    assert "job-elsewhere" not in (quiet / LEASE_NAME).read_text()

    # The holder renews while we wait, for as long as we wait: enter reads a lease that
    # expires within 3 s whenever it starts, waits that out, and finds it renewed.
    alive = tmp_path / "alive"
    entered = threading.Event()

    def renew() -> None:
        while not entered.wait(0.25):
            foreign(alive, ttl=3.0)

    foreign(alive, ttl=3.0)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        with pytest.raises(ckpt.LeaseHeld, match="job-elsewhere"):
            enter(alive)
    finally:
        entered.set()
        renewer.join()
    assert Store(str(alive)).exists(LEASE_NAME)


@pytest.mark.parametrize("before", ["none", "released", "held-live"])
@pytest.mark.parametrize("since", ["nothing", "another-take"])
def test_a_lease_seen_before_a_survey_is_written_over_only_if_nobody_wrote_it_since(root, before, since):
    """`ckpt.prepare` reads the lease before it surveys; the take's first write is
    conditional on that version: `as_seen` where it lands over a quiet lease. Where another
    job wrote the lease meanwhile the take reads it again and goes on as always (here: taken,
    not as seen); where a live holder held it (here, this job's other process), that holder
    could commit without writing it, and the root is not taken as seen either."""
    store = Store(root)
    if before == "released":
        LeaseKeeper.take(store, Lease(ttl_s=TTL)).close(release=True)
    elif before == "held-live":  # a live process of this job (this one), its lease fresh
        store.put_if_absent(lease.LEASE_NAME, lease.this_process(TTL).to_json())
    seen = seen_now(store)
    assert seen is not None and (seen.lease is None) == (before == "none")
    assert seen.quiet == (before != "held-live")
    if since == "another-take":
        LeaseKeeper.take(store, Lease(ttl_s=TTL)).close(release=True)
    keeper = LeaseKeeper.take(store, Lease(ttl_s=TTL), seen)
    try:
        assert keeper.as_seen == (since == "nothing" and before != "held-live")
        assert lease.read(store).job_id == keeper.mine.job_id and lease.read(store).released is None
    finally:
        keeper.close(release=True)
