"""Every kind of corruption, on a local root and on an S3-protocol server (moto on loopback):
`ckpt verify` fails naming the problem, a restore on 2 real ranks falls back to the previous
checkpoint (its tensors, optimizer, scheduler and RNG streams equal to what that step held)
and says why, and nothing unverified is ever unpickled. Where the damage is to a file that
restore does not read (`.metadata`: each rank reads its part of it from its index), or reads
another way (a rank's index: then `.metadata`), it restores step 10 as the intact copy does.

A pristine root with steps 5 and 10 is written once by real 2-rank FSDP2 jobs; each case
copies it, damages step 10, and is checked by the CLI (in this process: the same `main` a
user's `ckpt` runs) and by one 2-rank restore job per backend that restores every case's root
in turn (tests/workers/restore_worker.py), so that the matrix pays for starting ranks twice,
not once per case. On S3 each of those restores is begun by `ckpt.prepare`, whose survey of
the root sees the damage before the model exists: the outcomes are the same.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest

from ckpt.cli import main as cli
from ckpt.storage.store import step_dir_name
from tests.support.jobs import RANKS, assert_same_training_state, dumps, rank_logs, train
from tests.support.launch import WORKERS, run
from tests.support.pickles import malicious_pickle

PREVIOUS, NEWEST = 5, 10
DATA = "__1_0.distcp"  # rank 1's data file of the newest step: rank 1 reads all of it to restore
MARKER = "PWNED"  # what the canary pickle creates, in the case's own directory, if it ever runs


# -- the files of one root, local or on S3 --------------------------------------------------------
@dataclass
class Root:
    url: str
    options: dict  # storage options (S3: endpoint and keys)
    marker: Path  # the canary's file: must never exist

    def __post_init__(self) -> None:
        extra = {"skip_instance_cache": True, "use_listings_cache": False} if self.options else {}
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **extra, **self.options)

    def rel(self, name: str) -> str:
        return f"{self.path}/{step_dir_name(NEWEST)}/{name}"

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self.rel(name))

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.rel(name), data)

    def remove(self, name: str) -> None:
        self.fs.rm(self.rel(name))

    def manifest(self, edit: Callable[[dict], None]) -> None:
        doc = json.loads(self.read("manifest.json"))
        edit(doc)
        self.write("manifest.json", json.dumps(doc).encode())

    def tree(self) -> dict[str, bytes]:
        self.fs.invalidate_cache()
        return {p[len(self.path) + 1 :]: self.fs.cat_file(p) for p in self.fs.find(self.path) if "/step-" in p}

    def cli_args(self) -> list[str]:
        return [f"--storage-option={k}={v}" for k, v in self.options.items()]


# -- the corruptions --------------------------------------------------------------------------------
def flip_bit(r: Root) -> None:
    data = bytearray(r.read(DATA))
    data[len(data) // 2] ^= 0x10  # same size: only a checksum can tell
    r.write(DATA, bytes(data))


def canary_metadata(r: Root) -> None:
    """`.metadata` replaced by a pickle that creates the marker when unpickled, same size."""
    r.write(".metadata", malicious_pickle(r.marker, len(r.read(".metadata"))))


def no_manifest(r: Root) -> None:
    canary_metadata(r)  # a step without a commit: nothing of it may be read
    r.remove("manifest.json")


def broken_manifest(r: Root) -> None:
    canary_metadata(r)
    r.write("manifest.json", r.read("manifest.json")[:-20])


def entry_of(doc: dict, **change: object) -> None:
    doc["files"][DATA].update(change)


def step_5_manifest(r: Root) -> None:
    r.fs.copy(f"{r.path}/{step_dir_name(PREVIOUS)}/manifest.json", r.rel("manifest.json"))


@dataclass
class Case:
    damage: Callable[[Root], None]
    why: str  # what both `ckpt verify` and the restore's log must say about step 10
    verify: tuple[str, ...] = ()  # `ckpt verify` flags needed: --deep where only the bytes tell
    # The step the 2-rank restore resumes: the one before, or step 10 itself where the damage
    # is to a file that restore does not need (`.metadata`: each rank reads its part from its
    # index, `ckpt.restore.partial`), or that it reads another way (an index: `.metadata`).
    restores: int = PREVIOUS


def canary_index(r: Root) -> None:
    """Rank 1's index replaced by a pickle that creates the marker when unpickled, same size."""
    r.write("__1_0.index", malicious_pickle(r.marker, len(r.read("__1_0.index"))))


CASES = {
    "data_bit_flip": Case(flip_bit, f"{DATA}: checksum mismatch", ("--deep",)),
    "data_truncated": Case(lambda r: r.write(DATA, r.read(DATA)[:-100]), f"{DATA}: {{size-100}} bytes, manifest says {{size}}"),
    "data_grown": Case(lambda r: r.write(DATA, r.read(DATA) + b"\0" * 7), f"{DATA}: {{size+7}} bytes, manifest says {{size}}"),
    "data_missing": Case(lambda r: r.remove(DATA), f"{DATA}: missing"),
    "metadata_missing": Case(lambda r: r.remove(".metadata"), ".metadata: missing"),
    "metadata_altered": Case(lambda r: r.write(".metadata", bytes(255 - b for b in r.read(".metadata"))), ".metadata: checksum mismatch", restores=NEWEST),
    "metadata_malicious_pickle": Case(canary_metadata, ".metadata: checksum mismatch", restores=NEWEST),
    "shared_index_altered": Case(lambda r: r.write(".index", bytes(255 - b for b in r.read(".index"))), ".index: checksum mismatch", ("--deep",)),
    "index_malicious_pickle": Case(canary_index, "__1_0.index: checksum mismatch", ("--deep",), restores=NEWEST),
    # Without a manifest the step may be a save in progress: only `--step` makes it a failure.
    "manifest_missing": Case(no_manifest, "no manifest", ("--step", str(NEWEST))),
    "manifest_broken_json": Case(broken_manifest, "unreadable manifest"),
    "manifest_wrong_checksum": Case(
        lambda r: r.manifest(lambda d: entry_of(d, checksum="xxh3_64:" + "0" * 16)), f"{DATA}: checksum mismatch", ("--deep",)
    ),
    "manifest_wrong_size": Case(
        lambda r: r.manifest(lambda d: entry_of(d, size=d["files"][DATA]["size"] + 1)), f"{DATA}: {{size}} bytes, manifest says {{size+1}}"
    ),
    "manifest_wrong_world_size": Case(lambda r: r.manifest(lambda d: d.update(world_size=3)), "world size 3"),
    "manifest_of_another_step": Case(step_5_manifest, f"manifest is for step {PREVIOUS}"),
}


# -- the pristine root, each case's copy, verify and one restore job per backend ------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Steps 5 and 10 of a 2-rank FSDP2 job, and the state each rank held at step 5
    (<dir>/ref5.rank<R>.pt)."""
    d = tmp_path_factory.mktemp("pristine")
    train(d, "--mode", "fsdp2", "--root", d / "root", "--steps", PREVIOUS, "--every", PREVIOUS, "--out", d / "ref5")
    train(d, "--mode", "fsdp2", "--root", d / "root", "--steps", NEWEST, "--every", PREVIOUS)
    assert sorted(p.name for p in (d / "root").glob("step-*/manifest.json")) == ["manifest.json"] * 2
    return d


@dataclass
class Outcome:
    rc: int  # of `ckpt verify`
    out: str  # what it printed
    before: dict[str, bytes]  # the root's step files once damaged
    root: Root


def _copy_root(backend: str, pristine: Path, case_dir: Path, endpoint: str | None, bucket: str) -> Root:
    if backend == "local":
        shutil.copytree(pristine / "root", case_dir / "root", ignore=shutil.ignore_patterns("events"))
        return Root(str(case_dir / "root"), {}, case_dir / MARKER)
    from tests.conftest import S3_ENV

    options = {"endpoint_url": endpoint, "key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"]}
    root = Root(f"s3://{bucket}/{case_dir.name}", options, case_dir / MARKER)
    for f in sorted((pristine / "root").glob("step-*/*")):
        root.fs.put_file(str(f), f"{root.path}/{f.parent.name}/{f.name}")
    return root


@pytest.fixture(scope="module")
def matrix(pristine, tmp_path_factory, request):
    """`matrix(backend)`: every case (and "intact", the undamaged control) damaged, verified and
    restored on that backend, once per module: {case: Outcome}, and the restore job's dir."""
    done: dict[str, tuple[dict[str, Outcome], Path]] = {}
    sizes = {"size": (pristine / "root" / step_dir_name(NEWEST) / DATA).stat().st_size}

    def get(backend: str, capsys) -> tuple[dict[str, Outcome], Path]:
        if backend in done:
            return done[backend]
        work = tmp_path_factory.mktemp(f"matrix-{backend}")
        endpoint = bucket = None
        if backend == "s3":
            import boto3

            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
            from tests.conftest import S3_ENV

            creds = {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]}
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds).create_bucket(Bucket=bucket)
        outcomes = {}
        for case in ["intact", *CASES]:
            (work / case).mkdir()
            root = _copy_root(backend, pristine, work / case, endpoint, bucket)
            if case != "intact":
                CASES[case].damage(root)
            flags = CASES[case].verify if case in CASES else ()
            capsys.readouterr()
            rc = cli.main(["verify", root.url, *flags, *root.cli_args()])
            outcomes[case] = Outcome(rc, capsys.readouterr().out, root.tree(), root)
        options = outcomes["intact"].root.options
        cases = json.dumps([[c, o.root.url] for c, o in outcomes.items()])
        # On S3 each restore is begun by `ckpt.prepare` (the survey made before the model):
        # every case must come out as without it.
        env = {"CKPT_TEST_PREPARE": "1"} if backend == "s3" else None
        codes = run(RANKS, WORKERS / "restore_worker.py", str(work / "out"), cases, json.dumps(options), env=env, log_dir=work, timeout=300)
        assert codes == [0] * RANKS, f"exit codes {codes}\n{rank_logs(work)}"
        done[backend] = (outcomes, work)
        return done[backend]

    get.sizes = sizes  # type: ignore[attr-defined]
    return get


def case_log(work: Path, case: str) -> str:
    """Rank 0's log of the restore of `case`."""
    text = (work / "rank0.log").read_text()
    return text.split(f"=== case {case}\n", 1)[1].split("=== case ", 1)[0]


def expand(why: str, sizes: dict[str, int]) -> str:
    return why.replace("{size-100}", str(sizes["size"] - 100)).replace("{size+7}", str(sizes["size"] + 7)).replace(
        "{size+1}", str(sizes["size"] + 1)
    ).replace("{size}", str(sizes["size"]))


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_an_intact_root_verifies_and_restores_its_newest_step(matrix, backend, capsys):
    """The control: the copying, the CLI and the restore job find nothing wrong with an
    undamaged copy, so every failure below is the damage's doing."""
    outcomes, work = matrix(backend, capsys)
    o = outcomes["intact"]
    assert o.rc == 0, o.out
    assert o.out.splitlines()[-1] == "2 ok, 0 failed (sizes)"
    got = dumps(work / "out.intact")
    assert [g["restored_step"] for g in got] == [NEWEST] * RANKS
    assert f"restoring from {o.root.url}/{step_dir_name(NEWEST)}" in case_log(work, "intact")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_corruption_is_caught_by_verify_and_restore_falls_back_saying_why(matrix, pristine, backend, case, capsys):
    outcomes, work = matrix(backend, capsys)
    o, why = outcomes[case], expand(CASES[case].why, matrix.sizes)
    newest, previous = step_dir_name(NEWEST), step_dir_name(PREVIOUS)

    # ckpt verify: exit 1, the damaged step named with what is wrong, the previous one ok.
    assert o.rc == 1, o.out
    lines = {line.split()[0]: line for line in o.out.splitlines() if line.startswith("step-")}
    assert why in lines[newest] and lines[newest].startswith(f"{newest}  "), o.out
    if "--step" in CASES[case].verify:  # verify was asked about step 10 alone
        assert previous not in lines, o.out
    else:
        assert lines[previous] == f"{previous}  ok", o.out

    # The restore: both ranks at step 5, with exactly what step 5 held, and the log says why;
    # or at step 10, with exactly what the intact copy restored, where what it reads is intact.
    failed = work / f"out.{case}.failed"
    assert not failed.exists(), failed.read_text()
    got = dumps(work / f"out.{case}")
    restores = CASES[case].restores
    assert [g["restored_step"] for g in got] == [restores] * RANKS
    assert_same_training_state(got, dumps(pristine / "ref5") if restores == PREVIOUS else dumps(work / "out.intact"))
    log = case_log(work, case)
    if restores == PREVIOUS:
        said = [line for line in log.splitlines() if newest in line and why in line]
        assert said and any("passing over" in s or "could not restore" in s for s in said), log
    assert f"restored step {restores} in" in log, log
    # On S3 rank 0 restored with the survey `ckpt.prepare` made, whatever it found.
    assert ("the survey made at prepare stands" in log) == (backend == "s3"), log

    # Nothing unverified was unpickled, and the restore changed nothing.
    assert not o.root.marker.exists()
    assert o.root.tree() == o.before


def test_the_canary_is_live(tmp_path):
    """The payload the cases plant does run when unpickled: the matrix's check is not vacuous."""
    import pickle

    marker = tmp_path / MARKER
    pickle.loads(malicious_pickle(marker, 200))
    assert marker.exists()
