"""The `ckpt` admin CLI, run as a user runs it: a process of its own (`python -m ckpt.cli.main`,
forked from the tests' zygote: tests/support/cli.py) pointed at checkpoints that a real
Checkpointer wrote, on a local root and on an S3-protocol server (moto) on loopback. A test
that needs several independent answers asks for them all at once (`Root.ckpt_all`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch

import ckpt
from ckpt.cli.terminal import human_bytes
from ckpt.storage.store import Store
from tests.support import cli, zygote
from tests.support.launch import free_port

CLI = [sys.executable, "-m", "ckpt.cli.main"]
DATA = "__0_0.distcp"  # the one data file of a single-process save
# Moto accepts any credentials; these are made up so that a leak is unmistakable.
ENV_SECRET = "env-Secret/Value+Nr1"
URL_SECRET = "url-Secret-Value-Nr2"
OPTION_SECRET = "option-Secret-Value-Nr3"


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


@dataclass
class Result:
    rc: int
    out: str
    err: str
    seconds: float


def run_cli(
    calls: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float = 60
) -> list[Result]:
    """Run `ckpt` once per argument list, all at the same time."""
    started = time.monotonic()
    runs = [zygote.Run(cli.MODULE, list(args), dict(env)) for args in calls]
    results = []
    for run in runs:
        r = run.result(timeout)
        results.append(Result(r.returncode, r.stdout, r.stderr, time.monotonic() - started))
    return results


def assert_one_line_error(r: Result, rc: int = 2) -> str:
    """A user's mistake: the exit code, one line on stderr, nothing on stdout. Returns the line."""
    assert r.rc == rc, f"exit {r.rc}, stdout {r.out!r}, stderr {r.err!r}"
    assert "Traceback" not in r.err, r.err
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: "), r.err
    assert r.out == ""
    return lines[0]


@dataclass
class Root:
    """A checkpoint root: how the CLI is pointed at it, and direct access to its files."""

    url: str
    cli_args: list[str]  # --storage-option ... that reach it
    env: dict[str, str]  # the CLI's environment
    storage_options: dict[str, Any] | None  # for the Checkpointer

    def __post_init__(self) -> None:
        opts = (
            {"skip_instance_cache": True, "use_listings_cache": False}
            if self.url.startswith("s3://")
            else {}
        )
        self.fs, self.path = fsspec.core.url_to_fs(
            self.url, **{**opts, **(self.storage_options or {})}
        )

    def ckpt(self, *args: str) -> Result:
        return self.ckpt_all(args)[0]

    def ckpt_all(self, *calls: Sequence[str]) -> list[Result]:
        """`ckpt COMMAND <root> ARGS...` for each (COMMAND, ARGS...), all at once."""
        return run_cli([[c[0], self.url, *c[1:], *self.cli_args] for c in calls], self.env)

    def files(self) -> dict[str, bytes]:
        """Every file of every checkpoint under the root and its bytes (the job's history under
        events/ grows with every run and is not part of any checkpoint)."""
        self.fs.invalidate_cache()
        found = self.fs.find(self.path) if self.fs.exists(self.path) else []
        files = {p[len(self.path) + 1 :]: p for p in found}
        return {rel: self.fs.cat_file(p) for rel, p in files.items() if rel.startswith("step-")}

    def steps(self) -> set[int]:
        return {int(rel.split("/")[0].removeprefix("step-")) for rel in self.files()}

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(f"{self.path}/{rel}")

    def write(self, rel: str, data: bytes) -> None:
        self.fs.makedirs(f"{self.path}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(f"{self.path}/{rel}", data)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> Root:
    """An empty root. The S3 one is reached through `--storage-option endpoint_url=...` alone:
    AWS_ENDPOINT_URL is removed from the CLI's environment (credentials stay there)."""
    if request.param == "local":
        return Root(str(tmp_path / "run"), [], dict(os.environ), None)
    url = request.getfixturevalue("s3_root")
    endpoint = request.getfixturevalue("s3_endpoint")
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    return Root(
        url, ["--storage-option", f"endpoint_url={endpoint}"], env, {"endpoint_url": endpoint}
    )


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def train(root: Root, steps: int) -> torch.nn.Module:
    """Train `steps` steps with a real Checkpointer saving after every one; keeps them all."""
    model = new_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(
        root.url,
        model=model,
        optimizer=opt,
        interval=ckpt.Every(steps=1),
        keep=ckpt.Keep(last=100),
        storage_options=root.storage_options,
    ) as cp:
        for _ in range(cp.step, steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    assert root.steps() == set(range(1, steps + 1))
    return model


def truncate(root: Root, step: int) -> None:
    root.write(f"{step_dir(step)}/{DATA}", root.read(f"{step_dir(step)}/{DATA}")[:100])


def flip_one_bit(root: Root, step: int) -> None:
    data = bytearray(root.read(f"{step_dir(step)}/{DATA}"))
    data[len(data) // 2] ^= 0x01
    root.write(f"{step_dir(step)}/{DATA}", bytes(data))


def leave_crashed_save(root: Root, step: int, like: int) -> None:
    """A save of `step` that wrote its files and died before the manifest."""
    for rel, data in root.files().items():
        if rel.startswith(step_dir(like) + "/") and not rel.endswith("manifest.json"):
            root.write(f"{step_dir(step)}/{rel.split('/', 1)[1]}", data)


def on_store(root: Root, step: int, *, manifest: bool) -> int:
    """Bytes of a step directory's files, with or without manifest.json."""
    return sum(
        len(data)
        for rel, data in root.files().items()
        if rel.startswith(step_dir(step) + "/") and (manifest or not rel.endswith("manifest.json"))
    )


def table(out: str) -> list[list[str]]:
    """Rows of a table the CLI printed, header first (columns are 2+ spaces apart)."""
    return [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.strip()]


# -- ls -----------------------------------------------------------------------------------------


def test_ls_lists_every_step_with_its_state_world_size_and_size(root):
    train(root, 3)
    truncate(root, 2)
    leave_crashed_save(root, 4, like=3)

    plain, as_json = root.ckpt_all(["ls"], ["ls", "--json"])

    assert plain.rc == as_json.rc == 0, (plain.err, as_json.err)
    docs = json.loads(as_json.out)
    assert [(d["step"], d["state"], d["world_size"]) for d in docs] == [
        (1, "committed", 1),
        (2, "corrupt", 1),
        (3, "committed", 1),
        (4, "incomplete", None),
    ]
    # A committed checkpoint's size is its files without the manifest; an incomplete one's,
    # whatever it left behind.
    assert docs[0]["bytes"] == on_store(root, 1, manifest=False)
    assert docs[2]["bytes"] == on_store(root, 3, manifest=False)
    assert docs[3]["bytes"] == on_store(root, 4, manifest=True) > 0
    assert f"{step_dir(2)}/{DATA}" in docs[1]["problem"]
    assert "manifest" in docs[3]["problem"]
    assert all(d["time"] for d in docs[:3]) and docs[3]["time"] is None

    rows = table(plain.out)
    assert rows[0] == ["STEP", "TIME", "SIZE", "WORLD", "STATE"]
    assert [(r[0], r[2], r[3], r[4]) for r in rows[1:]] == [
        (str(d["step"]), human_bytes(d["bytes"]), str(d["world_size"] or "-"), d["state"])
        for d in docs
    ]
    assert rows[4][1] == "-"  # an incomplete save has no commit time


# -- show ---------------------------------------------------------------------------------------


def test_show_describes_newest_committed_step_or_the_one_asked_for(root):
    model = train(root, 3)
    leave_crashed_save(root, 4, like=3)  # newer, but not a checkpoint

    newest, first_json = root.ckpt_all(["show"], ["show", "--step", "1", "--json"])

    assert newest.rc == first_json.rc == 0, (newest.err, first_json.err)
    assert newest.out.splitlines()[0] == f"{root.url}/{step_dir(3)}"
    assert "step 3, world size 1" in newest.out
    assert 'schedule: {"policy": "every", "steps": 1, "seconds": null}' in newest.out  # why it was saved
    want = {
        f"model.{k}": (str(v.dtype).removeprefix("torch."), list(v.shape))
        for k, v in model.state_dict().items()
    }
    shown = {r[0]: (r[1], r[2]) for r in table(newest.out) if r[0].startswith("model.")}
    assert shown == {k: (dtype, "x".join(map(str, shape))) for k, (dtype, shape) in want.items()}

    doc = json.loads(first_json.out)
    assert doc["root"] == root.url and doc["dir"] == step_dir(1)
    manifest = doc["manifest"]
    assert manifest == json.loads(root.read(f"{step_dir(1)}/manifest.json"))
    assert manifest["step"] == manifest["counters"]["step"] == manifest["world_size"] == 1
    assert {name: f["size"] for name, f in manifest["files"].items()} == {
        name: len(root.read(f"{step_dir(1)}/{name}")) for name in (DATA, ".metadata")
    }
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert {
        k: (t["dtype"], t["shape"]) for k, t in tensors.items() if k.startswith("model.")
    } == want
    assert tensors["model.0.weight"]["bytes"] == 8 * 4 * 4
    # Adam's moments are there too, with their parameter's shape.
    assert any(
        k.startswith("optim.state.") and k.endswith("exp_avg") and t["shape"] == [8, 4]
        for k, t in tensors.items()
    )


# -- verify -------------------------------------------------------------------------------------


def test_verify_catches_a_flipped_bit_only_with_deep(root):
    train(root, 3)
    flip_one_bit(root, 2)  # same size: only a checksum can tell

    sizes, deep = root.ckpt_all(["verify"], ["verify", "--deep"])

    assert sizes.rc == 0, sizes.out + sizes.err
    assert sizes.out.splitlines() == [f"{step_dir(s)}  ok" for s in (1, 2, 3)] + [
        "3 ok, 0 failed (sizes)"
    ]
    assert deep.rc == 1, deep.out + deep.err
    lines = deep.out.splitlines()
    assert lines[0] == f"{step_dir(1)}  ok" and lines[2] == f"{step_dir(3)}  ok"
    assert (
        lines[1]
        == f"{step_dir(2)}  CORRUPT: {root.url}/{step_dir(2)}/{DATA}: checksum mismatch (corrupt file)"
    )
    assert lines[3] == "2 ok, 1 failed (checksums)"


def test_verify_catches_a_truncated_file_without_deep(root):
    train(root, 2)
    size = len(root.read(f"{step_dir(1)}/{DATA}"))
    truncate(root, 1)

    plain, as_json = root.ckpt_all(["verify"], ["verify", "--deep", "--json"])

    assert plain.rc == 1, plain.out + plain.err
    assert plain.out.splitlines() == [
        f"{step_dir(1)}  CORRUPT: {root.url}/{step_dir(1)}/{DATA}: 100 bytes, manifest says {size}",
        f"{step_dir(2)}  ok",
        "1 ok, 1 failed (sizes)",
    ]
    doc = json.loads(as_json.out)
    assert as_json.rc == 1 and doc["ok"] is False and doc["deep"] is True
    assert [(c["step"], c["state"], c["world_size"]) for c in doc["checkpoints"]] == [
        (1, "corrupt", 1),
        (2, "committed", 1),
    ]
    assert "100 bytes" in doc["checkpoints"][0]["problem"]


# -- rm -----------------------------------------------------------------------------------------


def test_rm_deletes_one_step_and_leaves_the_others(root):
    train(root, 3)
    before = root.files()

    r = root.ckpt("rm", "--step", "2")

    assert r.rc == 0, r.err
    assert r.out.strip() == f"deleted {root.url}/{step_dir(2)}"
    after = root.files()
    assert root.steps() == {1, 3}
    assert after == {rel: data for rel, data in before.items() if not rel.startswith(step_dir(2))}


def test_a_file_named_like_a_step_directory_is_no_checkpoint_and_rm_and_gc_leave_it(root):
    train(root, 2)
    root.write(step_dir(9), b"notes, not a checkpoint")
    root.fs.invalidate_cache()

    rm, gc, ls = root.ckpt_all(["rm", "--step", "9", "--force"], ["gc", "--keep-last", "1"], ["ls", "--json"])

    assert "no checkpoint at step 9" in assert_one_line_error(rm)
    assert gc.rc == 0, gc.err
    assert ls.rc == 0, ls.err
    assert 9 not in [c["step"] for c in json.loads(ls.out)]
    assert root.read(step_dir(9)) == b"notes, not a checkpoint"
    assert root.steps() == {2, 9}  # gc kept the newest; the file is listed by its name alone


def test_rm_takes_a_root_named_like_a_glob_pattern_literally(root):
    """fsspec's rm reads `[12]` as a pattern: deleting from `run[12]` must leave `run1` and
    `run2` alone, and delete the step of `run[12]` itself."""
    named, one, two = (dataclasses.replace(root, url=root.url + tail) for tail in ("[12]", "1", "2"))
    for r in (named, one, two):
        train(r, 2)
    others = {r.url: r.files() for r in (one, two)}

    rm = named.ckpt("rm", "--step", "1")

    assert rm.rc == 0, rm.err
    assert named.steps() == {2}
    assert {r.url: r.files() for r in (one, two)} == others


def test_a_step_removed_from_a_store_with_real_directories_is_no_longer_listed():
    """fsspec stores with directories of their own (sftp, hdfs; memory:// here) keep them when
    their files go: the step's directories go too, or it is listed again and again."""
    store = Store(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    store.fs.makedirs(store.path(step_dir(3), "sub"))  # as sftp or hdfs would make them
    for name in ("manifest.json", "__0_0.distcp", "sub/part"):
        store.fs.pipe_file(store.path(step_dir(3), name), b"x")
    store.fs.pipe_file(store.path(step_dir(4), "manifest.json"), b"{}")
    assert sorted(store.scan()) == [3, 4]
    store.remove_step(3)
    assert sorted(store.scan()) == [4] and store.list_step(3) is None


def test_rm_refuses_the_newest_committed_step_without_force(root):
    train(root, 2)
    leave_crashed_save(root, 3, like=2)  # newer, but not committed: step 2 is what a restart uses
    before = root.files()

    refused = root.ckpt("rm", "--step", "2")

    assert "--force" in assert_one_line_error(refused)
    assert root.files() == before

    forced = root.ckpt("rm", "--step", "2", "--force")

    assert forced.rc == 0, forced.err
    assert root.steps() == {1, 3}


# -- gc -----------------------------------------------------------------------------------------


def test_gc_dry_run_deletes_nothing_and_gc_keeps_exactly_the_newest_n(root):
    train(root, 4)
    before = root.files()

    dry = root.ckpt("gc", "--keep-last", "2", "--dry-run")

    assert dry.rc == 0, dry.err
    assert dry.out.splitlines() == [
        f"would delete {root.url}/{step_dir(1)}",
        f"would delete {root.url}/{step_dir(2)}",
        "2 to delete, 2 committed kept",
    ]
    assert root.files() == before

    real = root.ckpt("gc", "--keep-last", "2")

    assert real.rc == 0, real.err
    assert real.out.splitlines()[-1] == "2 deleted, 2 committed kept"
    assert root.files() == {
        rel: data for rel, data in before.items() if rel.startswith((step_dir(3), step_dir(4)))
    }


def test_while_a_job_holds_the_root_gc_and_rm_leave_its_uncommitted_steps_alone(root):
    """An uncommitted directory below the newest commit is debris to a scan, but while a job
    holds the root's lease it may be that job's save in progress (after a restore of an older
    step) or a node agent's upload: gc leaves it, rm refuses it without --force. Once the job
    left (its lease released), gc deletes it."""
    train(root, 3)
    root.fs.rm_file(f"{root.path}/{step_dir(1)}/manifest.json")  # uncommitted, below the newest
    before = root.files()
    with ckpt.Checkpointer(root.url, model=new_model(), interval=None, restore="none", save_on_exit=False, storage_options=root.storage_options):
        gc, rm = root.ckpt_all(["gc", "--keep-last", "5"], ["rm", "--step", "1"])
        assert gc.rc == 0, gc.err
        assert f"left alone (not committed, and a job holds the root: it may be writing it): {root.url}/{step_dir(1)}" in gc.out
        assert "may be writing it now" in assert_one_line_error(rm) and "--force" in rm.err
        assert root.files() == before
    gc = root.ckpt("gc", "--keep-last", "5")
    assert gc.rc == 0 and f"deleted {root.url}/{step_dir(1)}" in gc.out, gc.out + gc.err
    assert root.steps() == {2, 3}


# -- user mistakes and unreachable storage: exit 2, one line, no traceback ------------------------


def test_missing_step_exits_2_with_one_line(root):
    train(root, 1)

    for r in root.ckpt_all(["show", "--step", "7"], ["rm", "--step", "7"]):
        assert "step 7" in assert_one_line_error(r)


def test_show_of_a_root_whose_checkpoints_are_all_corrupt_says_why_each_is(root):
    train(root, 2)
    truncate(root, 1)
    truncate(root, 2)
    (r,) = root.ckpt_all(["show"])
    line = assert_one_line_error(r, rc=1)
    assert "can be used" in line and f"{step_dir(1)}: " in line and f"{step_dir(2)}: " in line


def test_show_of_an_older_checkpoint_because_the_newest_is_corrupt_says_so(root):
    train(root, 2)
    truncate(root, 2)
    (r,) = root.ckpt_all(["show"])
    assert r.rc == 0 and f"{step_dir(1)}" in r.out, r.err
    assert f"ckpt: note: using {step_dir(1)}; newer checkpoints that cannot be used were passed over: {step_dir(2)} (" in r.err, r.err


def test_verify_of_a_root_without_checkpoints_fails_rather_than_passing_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "first-save-crashed" / "step-0000000001").mkdir(parents=True)  # no manifest
    for root in ("empty", "first-save-crashed"):
        (r,) = run_cli([["verify", str(tmp_path / root)]], os.environ)
        assert "no committed checkpoint under" in assert_one_line_error(r) and "nothing to verify" in r.err


def test_nonexistent_local_root_exits_2_with_one_line(tmp_path):
    missing = str(tmp_path / "nothing-here")
    calls = [["ls", missing], ["show", missing]]

    for r in run_cli(calls, os.environ):
        assert missing in assert_one_line_error(r)
    assert not os.path.exists(missing)


def test_unknown_url_scheme_exits_2_with_one_line():
    (r,) = run_cli([["ls", "foo://x"]], os.environ)

    assert "foo" in assert_one_line_error(r)


def test_storage_option_without_equals_exits_2_with_one_line(tmp_path):
    (r,) = run_cli([["ls", str(tmp_path), "--storage-option", "endpoint_url"]], os.environ)

    assert "KEY=VALUE" in assert_one_line_error(r)
    # A nested option that is not an object (JSON), without echoing its value (it may be a secret).
    (r,) = run_cli([["ls", "s3://b/run", "--storage-option", "client_kwargs=aws_secret_access_key=SECRETVALUE"]], os.environ)
    line = assert_one_line_error(r)
    assert "client_kwargs must be an object" in line and "SECRETVALUE" not in line


def test_s3_bucket_that_does_not_exist_exits_2_with_one_line(s3_env):
    for r in run_cli([["ls", "s3://no-such-bucket-for-ckpt/run"], ["ls", "s3://no-such-bucket-for-ckpt"]], os.environ):
        assert "s3://no-such-bucket-for-ckpt" in assert_one_line_error(r) and "does not exist" in r.err


def test_s3_endpoint_nobody_listens_on_exits_2_quickly_and_is_never_a_missing_bucket(s3_env):
    # One attempt: botocore's default retries with backoff would take 10 s to say the same.
    env = {**os.environ, "AWS_MAX_ATTEMPTS": "1"}
    dead = f"http://127.0.0.1:{free_port()}"

    for r in run_cli([["ls", root, "--storage-option", f"endpoint_url={dead}"] for root in ("s3://bucket/run", "s3://bucket")], env):
        line = assert_one_line_error(r)
        assert "s3://bucket" in line and "Could not connect" in line and "does not exist" not in line, line
        assert r.seconds < 20


def test_s3_wrong_credentials_exit_2_and_never_read_as_no_checkpoint(
    s3_env, s3_strict_endpoint, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEYOFTHEPLACE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    opt = ["--storage-option", f"endpoint_url={s3_strict_endpoint}"]

    for r in run_cli(
        [["ls", "s3://bucket/run", *opt], ["show", "s3://bucket/run", *opt]], os.environ
    ):
        line = assert_one_line_error(r)
        assert "PermissionError" in line, line
        assert "s3://bucket/run does not exist" not in line and "no checkpoint" not in line, line
        assert ENV_SECRET not in line


# -- S3 specifics -------------------------------------------------------------------------------


def test_s3_root_is_reached_through_aws_environment_alone(s3_root):
    assert os.environ["AWS_ENDPOINT_URL"]  # and no --storage-option below
    root = Root(s3_root, [], dict(os.environ), None)
    train(root, 2)

    (r,) = run_cli([["ls", s3_root, "--json"]], os.environ)

    assert r.rc == 0, r.err
    assert [(d["step"], d["state"]) for d in json.loads(r.out)] == [
        (1, "committed"),
        (2, "committed"),
    ]


def test_secrets_never_appear_in_output_or_errors(s3_root, s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)  # moto takes any credentials
    root = Root(s3_root, [], dict(os.environ), None)
    train(root, 1)
    bucket_and_prefix = s3_root.removeprefix("s3://")
    in_url = f"s3://AKIAINTHEURL:{URL_SECRET}@{bucket_and_prefix}"
    endpoint = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    options = [
        "--storage-option",
        "key=AKIAINANOPTION",
        "--storage-option",
        f"secret={OPTION_SECRET}",
    ]

    good, url_ls, url_show = run_cli(
        [
            ["show", s3_root, "--json", "-v", *endpoint, *options],
            ["ls", in_url, *endpoint],
            ["show", in_url, "--step", "1", *endpoint],
        ],
        os.environ,
    )

    assert good.rc == 0, good.err
    assert json.loads(good.out)["root"] == s3_root
    for r in (url_ls, url_show):
        assert "s3://***@" in assert_one_line_error(r)
    for r in (good, url_ls, url_show):
        for secret in (ENV_SECRET, URL_SECRET, OPTION_SECRET):
            assert secret not in r.out + r.err


def test_a_long_history_on_s3_is_read_whole_and_a_restart_names_the_run_before(s3_root, s3_options):
    """Sixty runs and their failure events under events/ (read in parallel on an object
    store): `ckpt events` lists them all in order, and a restart's event, written in the
    background, names the newest earlier run and the steps it lost."""
    from types import SimpleNamespace

    from ckpt.events import Event, History, RunRecord, read_all, write_event, write_run
    from ckpt.storage.store import Store

    store = Store(s3_root, s3_options)
    t0 = time.time() - 3600
    for i in range(60):
        write_run(store, RunRecord(f"run-{i:02d}", 2, t0 + i, t0 + i + 0.5, 10 * i, 10 * i + 7, "error: boom"))
        write_event(store, Event("failure", t0 + i + 0.5, f"run-{i:02d}", 10 * i + 7, 2, cause="error: boom"))
    # Objects that are not ours, or hand-edited so that they cannot be placed in time: skipped.
    store.put_atomic("events/junk-time.json", json.dumps({"kind": "failure", "time": "x", "run_id": "j", "step": 1, "world_size": 1}).encode())
    store.put_atomic("events/run-junk.json", json.dumps({"kind": "run", "run_id": "j", "world_size": 1, "started": None, "updated": 1.0, "first_step": 0, "last_step": 0}).encode())
    store.put_atomic("events/not-json.json", b"{")
    runs, events = read_all(store)
    assert [r.run_id for r in runs] == [f"run-{i:02d}" for i in range(60)]
    assert [e.step for e in events] == [10 * i + 7 for i in range(60)]

    history = History(store, 1, enabled=True)
    history.start(593, SimpleNamespace(step=590, world_size=2))
    history.flush()
    ev = history.restart_event
    assert ev is not None and (ev.cause, ev.steps_lost, ev.world_size_before) == ("error: boom", 4, 2)
    history.end(593, "completed", failure=False)

    flags = [f"--storage-option={k}={v}" for k, v in s3_options.items()]
    (r,) = run_cli([["events", s3_root, "--json", *flags]], os.environ)
    assert r.rc == 0, r.err
    kinds = [e["kind"] for e in json.loads(r.out)["events"]]
    assert kinds.count("failure") == 60 and kinds[-1] == "restart"
