"""The node agent against a hostile spool (issue 37): whoever can write the spool's `jobs/`
(every trainer of the node) may plant a link, a FIFO, a device, a hard link, a directory
where a file belongs, or names of its own; whoever can write a local root may plant links
there. The agent (another user, often a more privileged one) must neither read anything
outside the spool into a root, nor write or delete anything outside the spool and the root.

One table of hostile entries (`KINDS`). Each is planted in a spool of its own, next to an
honest hand-off of another job, and a real `ckpt agent` process serves it: the outside
directory (a 0600 secret, a 0600 victim) is still there byte for byte, no root holds the
secret, the agent says what it refused, and the honest job still commits. Then: a second
agent on a spool refuses to start, and the shipped unit and example config are restrictive.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt.agent.config import Config
from ckpt.format.checksum import checksum
from tests.support.agentd import agent, until
from tests.support.launch import REPO, free_port

STEP = "step-0000000001"
DATA = "__0_0.distcp"
SECRET = b"root-only: " + b"s3cr3t " * 64
HONEST = b"honest bytes " * 32
OLD = time.time() - 700  # older than the agent's orphan age (600 s): pruned, were it its own


@dataclass
class Scene:
    """A spool, the roots its hand-offs name, and a directory outside both that must stay
    as it is: a 0600 secret (never to reach a root), a 0600 victim (never to be written)."""

    tmp: Path

    def __post_init__(self) -> None:
        self.spool, self.roots, self.outside = self.tmp / "spool", self.tmp / "roots", self.tmp / "outside"
        self.others: list[Path] = []  # files of others' that the agent must leave in place (`old_dir`)
        self.outside.mkdir(mode=0o700)
        for name, data in (("secret", SECRET), ("victim", b"the victim's bytes")):
            (self.outside / name).write_bytes(data)
            (self.outside / name).chmod(0o600)

    @property
    def secret(self) -> Path:
        return self.outside / "secret"

    def root(self, case: str) -> Path:
        return self.roots / case

    def job(self, case: str) -> Path:
        """The spool's directory of the case's job (its name: sixteen hex digits)."""
        return self.spool / "jobs" / hashlib.sha256(case.encode()).hexdigest()[:16]

    def hand_off(self, case: str, data: bytes, files: tuple[str, ...] = (DATA,), write: bool = True) -> Path:
        """A rank's hand-off of step 1 (its request, and its file unless `write` is false)
        to the case's root; returns the spool's step directory."""
        step = self.job(case) / STEP
        (step / ".requests").mkdir(parents=True)
        if write:
            (step / DATA).write_bytes(data)
        entry = {"size": len(data), "checksum": checksum(data), "rank": 0}
        manifest = {"step": 1, "world_size": 1, "created": time.time(), "files": dict.fromkeys(files, entry), "format": "ckpt", "format_version": 2}
        doc = {"root": str(self.root(case)), "storage_options": {}, "rel": STEP, "step": 1, "save_id": "00c0ffee00c0ffee", "rank": 0, "world": 1,
               "files": list(files), "manifest": manifest, "started": time.time()}  # fmt: skip
        (step / ".requests" / "rank-00000.json").write_text(json.dumps(doc))
        return step

    def old_dir(self, where: Path) -> Path:
        """A directory of old files the agent would prune were it its own."""
        where.mkdir(parents=True)
        (where / DATA).write_bytes(b"not the agent's to delete")
        self.others.append(where / DATA)
        for p in (where / DATA, where):
            os.utime(p, (OLD, OLD))
        return where

    def snapshot(self) -> dict[str, tuple[int, bytes]]:
        """Every entry under the outside directory: its mode and (a file's) bytes."""
        found = {}
        for p in sorted(self.outside.rglob("*")):
            st = p.lstat()
            found[str(p.relative_to(self.outside))] = (st.st_mode, p.read_bytes() if stat.S_ISREG(st.st_mode) else b"")
        return found


# -- what gets planted --------------------------------------------------------------------------
def spool_file_is_a_link(s: Scene) -> None:
    """The hand-off names a link to the secret, with the secret's checksum."""
    (s.hand_off("case", SECRET, write=False) / DATA).symlink_to(s.secret)


def spool_file_is_a_hard_link(s: Scene) -> None:
    os.link(s.secret, s.hand_off("case", SECRET, write=False) / DATA)


def spool_file_is_a_fifo(s: Scene) -> None:
    os.mkfifo(s.hand_off("case", b"", write=False) / DATA)


def spool_file_is_a_device(s: Scene) -> None:
    """/dev/null's numbers: a device the agent can read (a disk would be another one)."""
    try:
        os.mknod(s.hand_off("case", b"", write=False) / DATA, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("cannot make a device node here")


def spool_file_is_a_directory(s: Scene) -> None:
    (s.hand_off("case", b"x", write=False) / DATA).mkdir()


def request_is_a_link(s: Scene) -> None:
    """The request itself: a link to a request-shaped root-only file outside."""
    request = s.hand_off("case", HONEST) / ".requests" / "rank-00000.json"
    hidden = s.outside / "request.json"
    hidden.write_bytes(request.read_bytes())
    hidden.chmod(0o600)
    request.unlink()
    request.symlink_to(hidden)


def request_is_a_fifo(s: Scene) -> None:
    request = s.hand_off("case", HONEST) / ".requests" / "rank-00000.json"
    request.unlink()
    os.mkfifo(request)


def status_dir_is_a_link(s: Scene) -> None:
    """The agent's status files would land outside."""
    (s.hand_off("case", HONEST) / ".status").symlink_to(s.outside, target_is_directory=True)


def step_dir_is_a_link(s: Scene) -> None:
    s.job("case").mkdir(parents=True)
    (s.job("case") / STEP).symlink_to(s.old_dir(s.outside / "elsewhere"), target_is_directory=True)


def job_dir_is_a_link(s: Scene) -> None:
    s.old_dir(s.outside / "other-job" / STEP)
    (s.spool / "jobs").mkdir(parents=True)
    s.job("case").symlink_to(s.outside / "other-job", target_is_directory=True)


def names_not_the_spools(s: Scene) -> None:
    """Directories named as neither a job nor a step: someone's files, not the agent's."""
    s.old_dir(s.job("case") / "keep-me")
    s.old_dir(s.spool / "jobs" / "not-a-job" / STEP)


def file_name_climbs_out(s: Scene) -> None:
    step = s.hand_off("case", SECRET, files=("../../../../outside/secret",), write=False)
    assert (step / "../../../../outside/secret").resolve() == s.secret.resolve()


def root_file_is_a_link(s: Scene) -> None:
    """The destination in a local root: a link to the victim (written through, it would
    take the hand-off's bytes with a correct checksum)."""
    s.hand_off("case", HONEST)
    (s.root("case") / STEP).mkdir(parents=True)
    (s.root("case") / STEP / DATA).symlink_to(s.outside / "victim")


def root_step_dir_is_a_link(s: Scene) -> None:
    s.hand_off("case", HONEST)
    s.root("case").mkdir(parents=True)
    (s.outside / "dest").mkdir(mode=0o700)
    (s.root("case") / STEP).symlink_to(s.outside / "dest", target_is_directory=True)


def root_markers_dir_is_a_link(s: Scene) -> None:
    s.hand_off("case", HONEST)
    (s.root("case") / STEP).mkdir(parents=True)
    (s.outside / "dest").mkdir(mode=0o700)
    (s.root("case") / STEP / ".durable").symlink_to(s.outside / "dest", target_is_directory=True)


# What the agent does with each: "refused" (the hand-off fails or is passed over, said in
# its log), "left alone" (not pruned, said in its log), "committed" (a link in the root is
# replaced by the agent's own file, never written through).
KINDS: list[tuple[Callable[[Scene], None], str, str]] = [
    (spool_file_is_a_link, "refused", "symbolic link"),
    (spool_file_is_a_hard_link, "refused", "other hard links"),
    (spool_file_is_a_fifo, "refused", "not a regular file"),
    (spool_file_is_a_device, "refused", "not a regular file"),
    (spool_file_is_a_directory, "refused", "not a regular file"),
    (request_is_a_link, "refused", "symbolic link"),
    (request_is_a_fifo, "refused", "not a regular file"),
    (status_dir_is_a_link, "refused", "symbolic link"),
    (step_dir_is_a_link, "left alone", "symbolic link"),
    (job_dir_is_a_link, "left alone", "symbolic link"),
    (names_not_the_spools, "left alone", "not named as"),
    (file_name_climbs_out, "refused", "not plain file names"),
    (root_file_is_a_link, "committed", ""),
    (root_step_dir_is_a_link, "refused", "symbolic link"),
    (root_markers_dir_is_a_link, "refused", "symbolic link"),
]


@pytest.mark.parametrize(("plant", "outcome", "says"), KINDS, ids=[k[0].__name__ for k in KINDS])
def test_a_hostile_spool_entry_reaches_nothing_outside_and_the_agent_serves_on(tmp_path, plant, outcome, says):
    s = Scene(tmp_path)
    plant(s)
    s.hand_off("honest", HONEST)
    before = s.snapshot()
    case = s.root("case") / STEP
    with agent(s.spool, tmp_path / "agent.log") as a:
        until("the honest job to commit", lambda: (s.root("honest") / STEP / "manifest.json").exists(), timeout=30, logs=a.text)
        # Settled: said, committed, or harm done (then the checks below say which).
        until("the agent to settle the case", lambda: says in a.text() or (case / "manifest.json").exists() or s.snapshot() != before or not all(map(Path.exists, s.others)), timeout=30, logs=a.text)
        if outcome != "committed":
            time.sleep(2 * 2.0 + 0.5)  # two more housekeeping passes: prunes, retries
        assert a.proc.poll() is None, a.text()
        assert urlopen_ok(a.port), a.text()
        log = a.text()

    assert s.snapshot() == before, log  # nothing outside read into a root, written or deleted
    assert all(p.is_file() and p.read_bytes() == b"not the agent's to delete" for p in s.others), log
    assert not list(s.outside.rglob(f"*{STEP}*.json")) and not list(s.outside.rglob("*.tmp")), log
    for p in s.roots.rglob("*"):
        assert p.is_symlink() or not p.is_file() or SECRET not in p.read_bytes(), p
    if outcome == "committed":
        assert not (case / DATA).is_symlink() and (case / DATA).read_bytes() == HONEST
        return
    assert not (case / "manifest.json").exists(), log
    assert says in log and "Traceback" not in log, log
    status = s.job("case") / STEP / ".status" / "rank-00000.json"
    if outcome == "refused" and status.is_file() and not status.is_symlink():
        assert json.loads(status.read_text())["state"] == "failed", log
        assert says in json.loads(status.read_text())["why"], log


def urlopen_ok(port: int) -> bool:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).status == 200


# -- one agent per spool ------------------------------------------------------------------------
def test_a_second_agent_on_a_spool_refuses_to_start_and_the_first_ones_commit_survives(tmp_path):
    s = Scene(tmp_path)
    s.hand_off("honest", HONEST)
    committed = s.root("honest") / STEP
    with agent(s.spool, tmp_path / "agent.log") as first:
        until("the first agent to commit", lambda: (committed / "manifest.json").exists(), timeout=30, logs=first.text)
        files = {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()}
        second = subprocess.run(
            [sys.executable, "-m", "ckpt.cli.main", "agent", "--spool", str(s.spool), "--metrics-port", str(free_port())],
            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert "another ckpt agent" in second.stderr and f"pid {first.proc.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and second.stderr.count("\n") == 1, second.stderr
        time.sleep(2.5)
        assert first.proc.poll() is None and json.loads((s.spool / "agent.json").read_text())["pid"] == first.proc.pid
        first.proc.terminate()
        assert first.proc.wait(timeout=30) == 0, first.text()
    assert {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()} == files
    assert (committed / DATA).read_bytes() == HONEST


# -- what is shipped ----------------------------------------------------------------------------
def test_the_shipped_unit_runs_as_its_own_user_and_the_example_config_names_its_roots():
    unit = (REPO / "agents" / "ckpt-agent.service").read_text()
    users = [line.split("=", 1)[1].strip() for line in unit.splitlines() if line.startswith("User=")]
    assert users and users[0] not in ("root", "0"), users
    example = Config.load(["--config", str(REPO / "agents" / "ckpt-agent.toml")])
    assert example.allowed_roots and all("://" in r for r in example.allowed_roots), example.allowed_roots


# -- the ranks' metrics files the agent serves ---------------------------------------------------
METRICS_PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "fifo": lambda path, secret: os.mkfifo(path),
    "link_to_a_root_only_file": lambda path, secret: path.symlink_to(secret),
    "hard_link_to_a_root_only_file": lambda path, secret: os.link(secret, path),
    "over_a_megabyte": lambda path, secret: path.write_text("# " + "x" * (2 << 20) + "\nckpt_up 1\n"),
}


@pytest.mark.parametrize("plant", METRICS_PLANTS)
def test_a_hostile_rank_metrics_file_is_left_out_and_the_scrape_goes_on(tmp_path, plant):
    from ckpt.metrics import RankFiles

    secret = tmp_path / "secret.prom"
    secret.write_text('ckpt_secret{token="s3cr3t"} 1\n')
    secret.chmod(0o600)
    metrics = tmp_path / "spool" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "good.rank-00000.prom").write_text("ckpt_saves 3\n")
    METRICS_PLANTS[plant](metrics / "bad.rank-00001.prom", secret)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(RankFiles(str(metrics), stale_s=600).collect()), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the scrape hangs"
    samples = [(s.name, s.labels) for fam in got for s in fam.samples]
    assert samples == [("ckpt_saves", {"job": "good", "rank": "0"})], samples


def test_a_request_sets_where_the_store_is_never_the_agents_credentials_or_another_endpoint(tmp_path):
    from ckpt.agent.daemon import Agent
    from ckpt.errors import InvalidCheckpoint
    from ckpt.node.spool import Request

    def request(options: dict) -> Request:
        return Request("s3://bucket/run", options, "step-0000000001", 1, "s", 0, 1, [], {}, 0.0)

    config = Config(spool=str(tmp_path / "spool"), allowed_roots=["s3://bucket/"], storage_options={"endpoint_url": "http://127.0.0.1:9000"})
    agent = Agent(config)
    # A trainer's options that are not about where the store is (credentials, a profile, a
    # config file to read) are dropped; the agent's own come last.
    agent.roots.store(request({"key": "AKIA-theirs", "secret": "theirs", "profile": "other", "region_name": "eu-west-1"}))
    [(_, options)] = [json.loads(k) for k in agent.roots._stores]  # what the store was opened with
    assert options == {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9000"}
    for elsewhere in ({"endpoint_url": "http://203.0.113.9"}, {"client_kwargs": {"endpoint_url": "http://203.0.113.9"}}):
        with pytest.raises(InvalidCheckpoint, match="names another endpoint"):
            agent.roots.store(request(elsewhere))
