"""Hostile or odd roots (issue 37): whatever sits in a root, no verb deletes, reads or writes
through a link, every look-alike of a step directory is reported as what it is, nothing the
root holds reaches the terminal unescaped, a JSON object of the root is read only up to a
cap, and a full disk still restores.

One table of root entries (`KINDS`), and for each what a user would check after `ckpt ls`,
`ckpt verify`, `ckpt rm --step`, `ckpt gc`, and a job that restores and saves with retention:
the exit code, what is said, the step restored, and that the other root's and the outside
directory's files are all still there, byte for byte. The roots are written by a real
Checkpointer; the CLI runs in this process (`ckpt.cli.main.main`) but for the escaping test,
which runs it as a user does (a subprocess, its log lines too); the full disk is a real tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cli.main import main as cli
from ckpt.storage import catalog, lease
from ckpt.storage.store import Store, step_dir_name
from tests.support.compare import assert_bitwise_equal
from tests.support.disk import fill, tmpfs
from tests.support.launch import REPO

MB = 1 << 20


def train(root: Path | str, steps: int, *, seed: int = 0, keep: ckpt.Keep | None = None, extra: dict | None = None, **kw) -> ckpt.Checkpointer:
    """A one-process job that saves every step up to `steps` (restoring first, by default)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=1),
                           keep=keep or ckpt.Keep(last=100), extra=extra, **kw) as cp:  # fmt: skip
        while cp.step < steps:
            model(torch.randn(2, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    cp.model = model  # type: ignore[attr-defined]
    return cp


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> tuple[Path, Path]:
    """Two roots of committed steps 1-4 (of two different runs): this one, and another's."""
    base = tmp_path_factory.mktemp("templates")
    train(base / "mine", 4, seed=0)
    train(base / "other", 4, seed=1)
    return base / "mine", base / "other"


@dataclass
class Roots:
    mine: Path
    other: Path  # another job's root: nothing of it may change
    outside: Path  # a directory outside any root: nothing of it may change

    def snapshot(self) -> dict[str, object]:
        """Every entry of the other root and of the outside directory: a file's bytes, a
        link's target (never followed)."""
        return {**tree(self.other, "other"), **tree(self.outside, "outside")}


def tree(top: Path, label: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath, name)
            rel = f"{label}/{p.relative_to(top)}"
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
    return out


# -- the table of root entries ------------------------------------------------------------------


def replace(path: Path, make: Callable[[Path], None]) -> None:
    """Put something else where `path` is (a file or a whole directory)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    make(path)


def link_to(target: Callable[[Roots], Path]) -> Callable[[Roots, Path], None]:
    return lambda r, at: replace(at, lambda p: p.symlink_to(target(r)))


def fifo(r: Roots, at: Path) -> None:
    replace(at, lambda p: os.mkfifo(p))


def plain_file(r: Roots, at: Path) -> None:
    replace(at, lambda p: p.write_bytes(b"notes, not a checkpoint"))


def loops(r: Roots, at: Path) -> None:
    (at / "loop").symlink_to("loop")  # a link to itself
    (at / "up").symlink_to(".")  # a directory that holds itself


def outside_copy(r: Roots, at: Path) -> None:
    """The very bytes of the file, moved out of the root and linked back: sizes and checksums
    match, only the link is wrong."""
    shutil.copy(at, r.outside / at.name)
    replace(at, lambda p: p.symlink_to(r.outside / at.name))


def incomplete_copy_of(step: int) -> Callable[[Roots, Path], None]:
    """A copy of step `step`'s directory without its manifest (a save that never finished,
    or so it looks) under another name."""

    def make(r: Roots, at: Path) -> None:
        shutil.copytree(r.mine / step_dir_name(step), at)
        (at / "manifest.json").unlink()

    return make


@dataclass(frozen=True)
class Kind:
    """An entry of a root (`build` puts it at `where`, relative to the root) and what each verb
    must do with it."""

    id: str
    where: str
    build: Callable[[Roots, Path], None]
    stray: str | None = None  # ls reports `where` as not a checkpoint, saying this
    corrupt: str | None = None  # step 4 is corrupt, and ls/verify say this
    rm_step: int = 4  # `ckpt rm --step` of this step ...
    rm_refused: bool = False  # ... is refused (exit 2) and deletes nothing
    restored: int = 4  # the step a restore picks


S4 = step_dir_name(4)
DIGITS = {  # each a Unicode decimal digit class that `\d` or `str.isdigit` accepts
    "arabic-indic": "\u0660",
    "extended-arabic-indic": "\u06f0",
    "devanagari": "\u0966",
    "fullwidth": "\uff10",
    "math-bold": "\U0001d7ce",
}
NOT_A_STEP_NAME = "not step- and ten ASCII digits"

KINDS = [
    Kind("step-dir-links-to-another-roots-step", step_dir_name(1), link_to(lambda r: r.other / step_dir_name(1)),
         stray="symbolic link", rm_step=1, rm_refused=True),
    Kind("step-dir-links-outside", step_dir_name(0), link_to(lambda r: r.outside), stray="symbolic link", rm_step=0, rm_refused=True),
    Kind("step-dir-dangling-link", step_dir_name(6), link_to(lambda r: r.outside / "gone"), stray="symbolic link", rm_step=6, rm_refused=True),
    Kind("step-dir-is-a-file", step_dir_name(6), plain_file, stray="a file", rm_step=6, rm_refused=True),
    Kind("step-dir-is-a-fifo", step_dir_name(6), fifo, stray="FIFO", rm_step=6, rm_refused=True),
    Kind("link-loops-inside-newest-step", S4, loops),
    Kind("manifest-links-to-another-roots", f"{S4}/manifest.json", link_to(lambda r: r.other / S4 / "manifest.json"),
         corrupt="manifest.json is a symbolic link", restored=3),
    Kind("data-file-links-outside", f"{S4}/__0_0.distcp", outside_copy, corrupt="__0_0.distcp is a symbolic link", restored=3),
    Kind("metadata-is-a-fifo", f"{S4}/.metadata", fifo, corrupt=".metadata is a FIFO", restored=3),
    *[Kind(f"step-name-in-{name}-digits", "step-" + chr(ord(zero)) * 9 + chr(ord(zero) + 4), incomplete_copy_of(3), stray=NOT_A_STEP_NAME)
      for name, zero in DIGITS.items()],
    Kind("step-name-with-a-superscript-digit", "step-000000000\u00b2", incomplete_copy_of(3), stray=NOT_A_STEP_NAME),
    Kind("step-name-short", "step-4", incomplete_copy_of(3), stray=NOT_A_STEP_NAME),
    Kind("step-name-eleven-digits", "step-00000000004", incomplete_copy_of(3), stray=NOT_A_STEP_NAME),
    Kind("step-name-with-a-newline", f"{S4}\n", incomplete_copy_of(3), stray=NOT_A_STEP_NAME),
]


def build(kind: Kind, r: Roots) -> Path:
    at = r.mine / kind.where
    kind.build(r, at)
    return at


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def shown(name: str) -> str:
    """A name as the CLI prints it: non-printable characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


class Expect:
    """Every expectation of one test checked, the failures reported together."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def done(self) -> None:
        assert not self.failed, "\n".join(self.failed)


@contextlib.contextmanager
def fresh(templates, tmp_path: Path, kind: Kind, label: str) -> Iterator[tuple[Roots, Path, dict[str, object]]]:
    """Copies of the two roots with `kind` built in; yields them, the built entry, and the
    snapshot of what must not change."""
    mine, other = templates
    r = Roots(tmp_path / label / "mine", tmp_path / label / "other", tmp_path / label / "outside")
    shutil.copytree(mine, r.mine, symlinks=True)
    shutil.copytree(other, r.other, symlinks=True)
    r.outside.mkdir(parents=True)
    (r.outside / "secret.txt").write_bytes(b"not a checkpoint's")
    at = build(kind, r)
    yield r, at, r.snapshot()


@pytest.mark.parametrize("kind", KINDS, ids=[k.id for k in KINDS])
def test_every_verb_on_an_odd_root_entry_leaves_other_files_alone_and_says_what_it_is(templates, tmp_path, capsys, kind):
    expect = Expect()

    def untouched(r: Roots, at: Path, before: dict[str, object], verb: str) -> None:
        expect(r.snapshot() == before, f"{verb}: the other root or the outside directory changed")
        if kind.stray:  # an entry of the root itself, not a checkpoint's: never deleted
            expect(os.path.lexists(at), f"{verb}: {kind.where!r} was deleted")

    # ls: the entry is reported as what it is; the checkpoints are listed as they are.
    with fresh(templates, tmp_path, kind, "ls") as (r, at, before):
        rc, out, err = run_cli(capsys, "ls", str(r.mine))
        expect(rc == 0, f"ls: exit {rc}, {err!r}")
        lines = out.splitlines()
        if kind.stray:
            said = [line for line in lines if shown(kind.where) in line and "not a checkpoint" in line]
            expect(bool(said) and kind.stray in said[0], f"ls: {kind.where!r} not reported as not a checkpoint ({kind.stray}): {out!r}")
        rows = {int(line.split()[0]): line.split()[-1] for line in lines[1:] if line[:1].isdigit() and line.split()[0].isdigit()}
        want = {1: "committed", 2: "committed", 3: "committed", 4: "corrupt" if kind.corrupt else "committed"}
        if kind.id == "step-dir-links-to-another-roots-step":
            del want[1]  # a link, not this root's checkpoint
        expect(rows == want, f"ls: steps {rows}, expected {want}")
        if kind.corrupt:
            rc, out, err = run_cli(capsys, "verify", str(r.mine))
            expect(rc == 1 and kind.corrupt in out, f"verify: exit {rc}, {out!r} lacks {kind.corrupt!r}")
        untouched(r, at, before, "ls")

    # verify: fails only for a corrupt checkpoint; never reads through a link.
    with fresh(templates, tmp_path, kind, "verify") as (r, at, before):
        rc, out, err = run_cli(capsys, "verify", str(r.mine), "--deep")
        expect(rc == (1 if kind.corrupt else 0), f"verify --deep: exit {rc}, {out!r} {err!r}")
        untouched(r, at, before, "verify")

    # rm --step: a step name held by something that is no step directory is refused.
    with fresh(templates, tmp_path, kind, "rm") as (r, at, before):
        rc, out, err = run_cli(capsys, "rm", str(r.mine), "--step", str(kind.rm_step), "--force")
        if kind.rm_refused:
            expect(rc == 2 and "not a step directory" in err and kind.stray in err, f"rm: exit {rc}, {err!r}")
        else:
            expect(rc == 0 and not os.path.lexists(r.mine / step_dir_name(kind.rm_step)), f"rm: exit {rc}, {err!r}")
        untouched(r, at, before, "rm")

    # gc: deletes this root's old checkpoints, never the entry nor anything it links to.
    with fresh(templates, tmp_path, kind, "gc") as (r, at, before):
        rc, out, err = run_cli(capsys, "gc", str(r.mine), "--keep-last", "1")
        expect(rc == 0, f"gc: exit {rc}, {err!r}")
        expect(os.path.isdir(r.mine / step_dir_name(kind.restored)), f"gc: the newest good step {kind.restored} is gone")
        untouched(r, at, before, "gc")

    # A job restores the newest checkpoint that is this root's, saves, and retention deletes
    # the old ones: never through a link.
    with fresh(templates, tmp_path, kind, "restore") as (r, at, before):
        try:
            cp = train(r.mine, kind.restored + 2, keep=ckpt.Keep(last=1))
        except ckpt.errors.CheckpointError as e:
            expect(False, f"restore: {type(e).__name__}: {e}")
        else:
            expect(cp.restored_step == kind.restored, f"restore: restored step {cp.restored_step}, expected {kind.restored}")
            newest = catalog.find(Store(str(r.mine)), None).step
            expect(newest > kind.restored, f"restore: the job's saves did not commit (newest: step {newest})")
        untouched(r, at, before, "retention")
    expect.done()


def test_two_directories_of_one_step_cannot_hide_each_other(templates, tmp_path, capsys):
    """`step-4` and `step-0000000004`, or a step name in other digits: only the ten ASCII
    digits name a step, so the committed one is the step and the other is named for what it
    is; the job that restores it can save next."""
    kind = next(k for k in KINDS if k.id == "step-name-in-arabic-indic-digits")
    with fresh(templates, tmp_path, kind, "both") as (r, at, _):
        (r.mine / "step-4").mkdir()
        store = Store(str(r.mine))
        assert sorted(store.scan()) == [1, 2, 3, 4]
        assert catalog.find(store, None).step == 4
        rc, out, _ = run_cli(capsys, "ls", str(r.mine))
        assert rc == 0 and out.count("not a checkpoint") == 2, out
        cp = train(r.mine, 5)
        assert cp.restored_step == 4 and cp.last_commit.step == 5


# -- text output --------------------------------------------------------------------------------

ESC = "\x1b[31m"


def test_every_text_output_escapes_what_the_root_says(templates, tmp_path):
    """Names from a manifest, a stray entry's name, a tensor key, the lease's holder and an
    event's cause carry terminal escapes and carriage returns: ls, verify, show, diff, lease,
    events and the error line print them escaped, and so do log lines (-v)."""
    mine, other = templates
    root, keyed = tmp_path / "mine", tmp_path / "keyed"
    shutil.copytree(mine, root)
    evil = f"evil{ESC}\rname"
    doc = json.loads((root / S4 / "manifest.json").read_text())
    doc["files"][evil] = {"size": 1, "checksum": "xxh3_64:00", "rank": 0, "block": 0, "blocks": []}
    (root / S4 / "manifest.json").write_text(json.dumps(doc))
    (root / f"step-{ESC}\r").mkdir()
    (root / "events").mkdir(exist_ok=True)
    now = time.time()
    (root / "events" / "failure-x.json").write_text(json.dumps(
        {"kind": "failure", "time": now, "run_id": "x", "step": 3, "world_size": 1, "cause": f"boom{ESC}\r"}))
    holder = lease.Holder(f"job{ESC}\r", f"host{ESC}", 1, "r", now, now, 3600.0)
    (root / "lease.json").write_bytes(holder.to_json())

    class Keyed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer(f"evil{ESC}\r", torch.zeros(2))

    train(keyed, 1, extra={"odd": Keyed()})

    calls = {
        "ls": ["ls", str(root)],
        "verify": ["verify", str(root), "-v"],
        "show corrupt": ["show", str(root), "--step", "4"],  # the error line names the file
        "show keys": ["show", str(keyed)],
        "diff": ["diff", str(keyed), str(mine)],
        "lease": ["lease", str(root)],
        "events": ["events", str(root)],
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {k: subprocess.Popen([sys.executable, "-m", "ckpt.cli.main", *c], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, c in calls.items()}
    said = {k: p.communicate(timeout=120) for k, p in procs.items()}
    for verb, (out, err) in said.items():
        for stream, raw in (("stdout", out), ("stderr", err)):
            assert b"\x1b" not in raw and b"\r" not in raw, f"{verb} wrote a raw escape to {stream}: {raw!r}"
    text = {verb: (out + err).decode() for verb, (out, err) in said.items()}
    assert r"evil\x1b[31m\rname" in text["verify"]
    assert r"step-\x1b[31m\r" in text["ls"]
    assert r"host\x1b[31m" in text["ls"] and r"host\x1b[31m" in text["lease"]
    assert r"evil\x1b[31m" in text["show corrupt"]  # the error line: its whitespace made spaces
    assert r"evil\x1b[31m\r" in text["show keys"]
    assert r"evil\x1b[31m\r" in text["diff"]
    assert r"boom\x1b[31m\r" in text["events"]


# -- what is read before parsing ----------------------------------------------------------------


def pad(path: Path, total: int) -> None:
    """Make a JSON file `total` bytes long with trailing whitespace: still valid JSON."""
    data = path.read_bytes()
    path.write_bytes(data + b" " * (total - len(data)))


def peak_mb(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MB
    finally:
        tracemalloc.stop()


def test_a_huge_manifest_is_refused_by_its_size_before_it_is_read(templates, tmp_path, capsys, caplog):
    mine, _ = templates
    root = tmp_path / "mine"
    shutil.copytree(mine, root)
    pad(root / S4 / "manifest.json", 200 * MB)

    peak = peak_mb(lambda: run_cli(capsys, "verify", str(root)))
    rc, out, _ = run_cli(capsys, "verify", str(root))
    assert rc == 1 and re.search(r"manifest\.json: 209,715,200 bytes, more than the \d+ MiB a manifest may hold", out), out
    assert peak < 16, f"verify held {peak:.0f} MB"

    caplog.set_level(logging.WARNING, logger="ckpt")
    assert train(root, 5).restored_step == 3  # falls back, saying why
    assert "209,715,200 bytes" in caplog.text


def test_a_huge_lease_or_event_is_refused_by_its_size(templates, tmp_path, capsys):
    mine, _ = templates
    root = tmp_path / "mine"
    shutil.copytree(mine, root)
    now = time.time()
    (root / "lease.json").write_bytes(lease.Holder("big", "elsewhere", 1, "r", now, now, 3600.0).to_json())
    pad(root / "lease.json", 50 * MB)
    (root / "events" / "run-big.json").write_text(json.dumps(
        {"kind": "run", "run_id": "big", "world_size": 1, "started": now, "updated": now, "first_step": 0, "last_step": 9}))
    pad(root / "events" / "run-big.json", 50 * MB)

    peak = peak_mb(lambda: run_cli(capsys, "lease", str(root)))
    rc, out, err = run_cli(capsys, "lease", str(root))
    assert rc == 1 and "52,428,800 bytes" in err, (out, err)
    assert peak < 16, f"lease held {peak:.0f} MB"
    peak = peak_mb(lambda: run_cli(capsys, "events", str(root)))
    assert peak < 16, f"events held {peak:.0f} MB"
    with pytest.raises(ckpt.errors.LeaseHeld, match="52,428,800 bytes"):
        train(root, 5)


def test_the_step_name_and_the_cap_hold_on_an_object_store(templates, s3_root):
    """No links on S3, but the same step names and the same cap."""
    import fsspec

    mine, _ = templates
    store = Store(s3_root)
    fs, path = fsspec.core.url_to_fs(s3_root, skip_instance_cache=True, use_listings_cache=False)
    for f in mine.rglob("*"):
        if f.is_file() and f.relative_to(mine).parts[0].startswith("step-"):
            fs.pipe_file(f"{path}/{f.relative_to(mine).as_posix()}", f.read_bytes())
    fs.pipe_file(f"{path}/step-{chr(0x660) * 9}{chr(0x664)}/__0_0.distcp", b"x")
    manifest = (mine / S4 / "manifest.json").read_bytes()
    fs.pipe_file(f"{path}/{S4}/manifest.json", manifest + b" " * (70 * MB))

    assert sorted(store.scan()) == [1, 2, 3, 4]
    entries = {e.step: e for e in catalog.scan(store)}
    assert entries[4].state == catalog.CORRUPT and f"{70 * MB + len(manifest):,} bytes" in entries[4].problem, entries[4].problem
    assert catalog.find(store, None).step == 3


# -- a full disk ---------------------------------------------------------------------------------


def test_a_full_disk_restores_says_saving_will_fail_and_takes_the_lease_at_the_first_save(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ckpt")
    with tmpfs(tmp_path / "disk", 16) as disk:
        root = disk / "root"
        saved = train(root, 2)
        at_2 = {k: v.detach().clone() for k, v in saved.model.state_dict().items()}
        before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.parts[-2].startswith("step-")}
        filler = fill(disk, 0)

        torch.manual_seed(5)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
            assert cp.restored_step == 2
            assert_bitwise_equal({k: v.detach().clone() for k, v in model.state_dict().items()}, at_2, "step 2")
            assert "saving there will fail" in caplog.text
            cp.step_done()
            with pytest.raises(ckpt.SaveFailed, match="space|full"):
                cp.save(blocking=True)
            assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.parts[-2].startswith("step-")} == before

            filler.unlink()  # room again: the lease is taken at this save, which commits
            cp.step_done()
            cp.save(blocking=True)
            assert cp.last_commit.step == 4
            assert lease.read(Store(str(root))).job_id == lease.job_id()
        assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_a_job_that_restored_on_a_full_disk_never_saves_over_a_job_that_took_the_root_meanwhile(tmp_path):
    with tmpfs(tmp_path / "disk", 16) as disk:
        root = disk / "root"
        train(root, 2)
        filler = fill(disk, 0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
            assert cp.restored_step == 2
            filler.unlink()
            # Another job on another machine takes the free root, and lives.
            store = Store(str(root))
            got = store.read_tagged(lease.LEASE_NAME)
            now = time.time()
            theirs = lease.Holder("theirs", "elsewhere", 1, "their-run", now, now, 3600.0)
            assert store.put_if_unchanged(lease.LEASE_NAME, theirs.to_json(), got.tag)
            cp.step_done()
            with pytest.raises(ckpt.SaveFailed, match="theirs"):
                cp.save(blocking=True)
        assert lease.read(store).run_id == "their-run"
        assert sorted(store.scan()) == [1, 2]

