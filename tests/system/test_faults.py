"""Crashes and corruption, with real processes and real files.

A rank SIGKILLed in the middle of a background save (CKPT_FAULT, see ckpt/_faults.py) must
leave the previous checkpoint as the one a restart resumes from, bit for bit; a checkpoint
that is complete but corrupt must be detected before anything of it is used (nothing
unverified is ever unpickled), passed over with a log line that says why, and never written
into again. The multi-rank tests run tests/workers/worker.py under FSDP2 on 2 gloo ranks and compare
the final state with an uninterrupted run; the single-process tests run the Checkpointer in
this process, where the detection and fallback logic is the same.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.save import commit
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name
from tests.support import launch
from tests.support.cli import ckpt_cli
from tests.support.compare import assert_bitwise_equal as assert_same
from tests.support.jobs import states
from tests.support.pickles import malicious_pickle

WORKER = launch.WORKERS / "worker.py"
MODE = "fsdp2"
STEPS, EVERY = 20, 5
# The Checkpointer's collective timeout in the worker: a rank whose peer died must give up
# within this bound even if gloo did not notice the dead socket at once.
RANK_TIMEOUT_S = "10"
# How long a job with a killed rank may take to die on its own; past it the test fails.
DIE_WITHIN_S = 60


# -- helpers ----------------------------------------------------------------------------------
def sd(step: int) -> str:
    return step_dir_name(step)


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of every step directory under root: relative path -> (content, mtime_ns).
    (The job's history under events/ grows with each run; it is not a checkpoint.)"""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.glob("step-*/**/*"))
        if p.is_file()
    }


def flip_byte(path: Path) -> None:
    """Flip one bit in the middle of the file, in place; the size stays the same."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    with open(path, "r+b") as f:
        f.write(data)


def load_out(prefix: Path, rank: int) -> dict:
    return torch.load(f"{prefix}.rank{rank}.pt", weights_only=False)


def assert_matches_reference(out: Path, reference_out: Path, *, restored_step: int) -> None:
    """The job's final state on every rank equals the uninterrupted run's, bit for bit."""
    for rank in range(2):
        got, want = load_out(out, rank), load_out(reference_out, rank)
        assert got["restored_step"] == restored_step, f"rank {rank} resumed from {got['restored_step']}"
        for k in ("restored_step", "preempted"):
            got.pop(k, None)
            want.pop(k, None)
        assert got["step"] == STEPS
        assert_same(got, want, f"rank{rank}")


def worker_args(root: Path, *extra: str) -> list[str]:
    return ["--mode", MODE, "--root", str(root), "--steps", str(STEPS), "--every", str(EVERY),
            "--timeout", RANK_TIMEOUT_S, *extra]


def run_job_with_fault(fault: str, root: Path, log_dir: Path) -> list[int]:
    """Start the 2-rank job with CKPT_FAULT set; return the exit codes once every rank is
    gone. A rank still alive after DIE_WITHIN_S fails the test (a dead peer must never hang
    the job); whatever is left is killed either way."""
    procs = launch.start(2, WORKER, *worker_args(root), env={"CKPT_FAULT": fault}, log_dir=log_dir)
    try:
        return launch.wait(procs, timeout=DIE_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank was still running {DIE_WITHIN_S} s after its peer was killed ({fault})")
    finally:
        launch.kill_all(procs)  # whatever is left, with what it started


def resume_job(root: Path, out: Path, log_dir: Path, *extra: str) -> str:
    """Run the 2-rank job to the end without faults; return rank 0's log of this run."""
    log0 = log_dir / "rank0.log"
    before = log0.read_text() if log0.exists() else ""
    launch.run_worker(2, *worker_args(root, "--out", str(out), *extra), log_dir=log_dir, timeout=120)
    return log0.read_text()[len(before):]


@pytest.fixture(autouse=True)
def _no_inherited_fault(monkeypatch):
    monkeypatch.delenv("CKPT_FAULT", raising=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run: its root (steps 5, 10, 15, 20) and its final state."""
    d = tmp_path_factory.mktemp("reference")
    launch.run_worker(2, *worker_args(d / "root", "--out", str(d / "out")), log_dir=d, timeout=120)
    assert states(d / "root") == {5: "committed", 10: "committed", 15: "committed", 20: "committed"}
    return d


# -- a rank killed during a save --------------------------------------------------------------
def crash_then_resume(tmp_path: Path, reference: Path, fault: str, killed_rank: int) -> tuple[Path, str]:
    root, log_dir = tmp_path / "root", tmp_path / "logs"
    log_dir.mkdir()
    codes = run_job_with_fault(fault, root, log_dir)
    assert codes[killed_rank] == -signal.SIGKILL, f"exit codes {codes}: the fault did not fire"
    assert codes[1 - killed_rank] != 0, f"exit codes {codes}: the surviving rank carried on alone"
    return root, log_dir


def test_rank_killed_while_writing_data_resumes_from_previous_checkpoint(tmp_path, reference):
    root, log_dir = crash_then_resume(tmp_path, reference, "write_item:1:10", killed_rank=1)

    # The step-10 save died half-way: no manifest, rank 1's file partial, so not a checkpoint.
    step10 = root / sd(10)
    assert step10.is_dir()
    names = {p.name for p in step10.iterdir()}
    assert "manifest.json" not in names
    assert ".metadata" not in names  # rank 0 never got rank 1's results to finish with
    partial = step10 / "__1_0.distcp"
    assert not partial.exists() or partial.stat().st_size < (reference / "root" / sd(10) / partial.name).stat().st_size
    assert states(root) == {5: "committed", 10: "incomplete"}
    assert catalog.find(Store(str(root)), None).step == 5

    log = resume_job(root, tmp_path / "out", log_dir)
    assert f"passing over {root}/{sd(10)}: no manifest" in log
    assert f"restoring from {root}/{sd(5)}" in log
    assert f"restoring from {root}/{sd(10)}" not in log
    assert_matches_reference(tmp_path / "out", reference / "out", restored_step=5)
    # The resumed run cleared the debris and wrote step 10 afresh, fully verifiable.
    assert states(root, deep=True) == {s: "committed" for s in (5, 10, 15, 20)}


def test_kill_between_data_and_manifest_keeps_previous_checkpoint(tmp_path, reference):
    root, log_dir = crash_then_resume(tmp_path, reference, "before_manifest:0:10", killed_rank=0)

    # Every data file and .metadata of step 10 is durable, but without the manifest it is
    # not a checkpoint.
    names = {p.name for p in (root / sd(10)).iterdir()}
    want = {p.name for p in (reference / "root" / sd(10)).iterdir()} - {"manifest.json"}
    assert names == want
    assert states(root) == {5: "committed", 10: "incomplete"}

    log = resume_job(root, tmp_path / "out", log_dir)
    assert f"passing over {root}/{sd(10)}: no manifest" in log
    assert f"restoring from {root}/{sd(5)}" in log
    assert f"restoring from {root}/{sd(10)}" not in log
    assert "removing debris of an unfinished save at " + sd(10) in log
    assert_matches_reference(tmp_path / "out", reference / "out", restored_step=5)
    assert states(root, deep=True) == {s: "committed" for s in (5, 10, 15, 20)}


def test_kill_right_after_the_manifest_resumes_from_the_new_checkpoint(tmp_path, reference):
    root, log_dir = crash_then_resume(tmp_path, reference, "after_manifest:1:10", killed_rank=1)

    assert states(root, deep=True) == {5: "committed", 10: "committed"}
    log = resume_job(root, tmp_path / "out", log_dir)
    assert f"restoring from {root}/{sd(10)}" in log
    assert_matches_reference(tmp_path / "out", reference / "out", restored_step=10)


def test_corrupt_data_file_makes_both_ranks_fall_back_together(tmp_path, reference):
    """A bit flip in the data file rank 1 wrote for the newest checkpoint (same size, so only its
    checksum gives it away): both ranks agree to fall back to step 15, end exactly where the
    uninterrupted run ended, and the corrupt directory is left as it was."""
    root, log_dir = tmp_path / "root", tmp_path / "logs"
    log_dir.mkdir()
    shutil.copytree(reference / "root", root)
    flip_byte(root / sd(20) / "__1_0.distcp")
    before = tree(root / sd(20))
    assert states(root)[20] == "committed"  # sizes match: only the checksum can tell

    # Train 15 -> 20 again without saving, so the test does not depend on what a save at
    # an existing corrupt step does (see test_resume_never_writes_into_a_corrupt_committed_step).
    log = resume_job(root, tmp_path / "out", log_dir, "--every", "1000", "--no-save-on-exit")
    assert f"could not restore {sd(20)}" in log
    assert f"{root}/{sd(20)}/__1_0.distcp: checksum mismatch" in log
    # Each rank's reason once, under its own rank (each loads alone: DCP calls it rank 0).
    assert f"rank 1: {root}/{sd(20)}/__1_0.distcp: checksum mismatch" in log
    assert "rank 1: rank 0:" not in log and "rank 0: rank 0:" not in log
    assert f"restoring from {root}/{sd(20)}" in log  # it was tried first ...
    assert_matches_reference(tmp_path / "out", reference / "out", restored_step=15)  # ... then 15
    rank1_log = (log_dir / "rank1.log").read_text()
    assert f"could not restore {sd(20)}" in rank1_log
    assert tree(root / sd(20)) == before


@pytest.mark.parametrize("point", ["staging", "prepare"])
def test_a_rank_whose_staging_copy_fails_fails_the_save_on_every_rank_at_once(tmp_path, point):
    """Rank 1's save of step 10 fails before it has anything to write: its copy into the
    staging buffers raises in the background save (a device error, say), or on the training
    thread its host buffers cannot be set up (no shared memory left). No rank waits for it
    in a collective until the timeout (120 s here), the save fails on both ranks, training
    goes on (on_error="log") and the next saves commit."""
    root, log_dir = tmp_path / "root", tmp_path / "logs"
    log_dir.mkdir()
    started = time.monotonic()
    launch.run_worker(2, *worker_args(root, "--timeout", "120", "--on-error", "log"), env={"CKPT_FAULT": f"{point}:1:10:raise"},
                      log_dir=log_dir, timeout=300)  # fmt: skip
    took = time.monotonic() - started
    assert states(root) == {5: "committed", 15: "committed", 20: "committed"}
    log0, log1 = ((log_dir / f"rank{r}.log").read_text() for r in range(2))
    assert "save of step 10 " in log0 and "another rank could not stage its state" in log0, log0[-3000:]
    assert f"RuntimeError: ckpt fault: {point} of rank 1 at step 10" in log1, log1[-3000:]
    assert took < 90, f"the job took {took:.0f} s: a rank waited for the failed one"


def test_a_rank_whose_state_cannot_be_captured_stops_the_job_on_every_rank_at_once(tmp_path):
    """Rank 1's state cannot be captured at step 10 (a state_dict() that raises): an error in
    the job, not a save that failed, so even with on_error="log" it ends the job, on both
    ranks at once: rank 1 with its own error, rank 0 with a SaveFailed saying why. Nothing
    waits for the timeout, and step 5 is the checkpoint a restart finds."""
    root, log_dir = tmp_path / "root", tmp_path / "logs"
    log_dir.mkdir()
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"worker exit codes \[1, 1\]"):
        launch.run_worker(2, *worker_args(root, "--timeout", "120", "--on-error", "log"), env={"CKPT_FAULT": "capture:1:10:raise"},
                          log_dir=log_dir, timeout=300)  # fmt: skip
    took = time.monotonic() - started
    assert states(root) == {5: "committed"}
    log0, log1 = ((log_dir / f"rank{r}.log").read_text() for r in range(2))
    assert "SaveFailed: save of step 10 failed: another rank could not capture its state" in log0, log0[-3000:]
    assert "RuntimeError: ckpt fault: capture of rank 1 at step 10" in log1, log1[-3000:]
    assert took < 90, f"the job took {took:.0f} s: a rank waited for the failed one"


# -- corruption, single process ---------------------------------------------------------------
def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(root: Path, until: int, *, seed: int = 0, **kwargs) -> tuple[ckpt.Checkpointer, torch.nn.Module, dict]:
    """Train in this process with a Checkpointer saving every 5 steps; returns it, the model
    and the weights after each step."""
    model, opt = make_model(seed)
    kwargs.setdefault("interval", ckpt.Every(steps=5))
    kwargs.setdefault("keep", ckpt.Keep(last=100))
    seen = {}
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, **kwargs) as cp:
        for _ in range(cp.step, until):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
            seen[cp.step] = weights(model)
    return cp, model, seen


def restore(root: Path, **kwargs) -> tuple[ckpt.Checkpointer, torch.nn.Module]:
    """Enter and leave a Checkpointer on a freshly initialised model, saving nothing."""
    model, opt = make_model(seed=99)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False, **kwargs) as cp:
        pass
    return cp, model


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A root with steps 5 and 10 committed, and the weights at each."""
    root = tmp_path_factory.mktemp("two") / "root"
    _, _, seen = train(root, 10)
    assert states(root, deep=True) == {5: "committed", 10: "committed"}
    return root, seen


@pytest.fixture
def root_5_10(tmp_path, two_checkpoints):
    src, seen = two_checkpoints
    root = tmp_path / "root"
    shutil.copytree(src, root)
    return root, seen


def _bit_flip_in_data(step: Path) -> None:
    flip_byte(step / "__0_0.distcp")


def _truncated_data(step: Path) -> None:
    f = step / "__0_0.distcp"
    os.truncate(f, f.stat().st_size // 2)


def _deleted_manifest(step: Path) -> None:
    (step / "manifest.json").unlink()


def _garbage_metadata(step: Path) -> None:
    f = step / ".metadata"
    f.write_bytes(os.urandom(f.stat().st_size))


def _manifest_of_step_5(step: Path) -> None:
    shutil.copyfile(step.parent / sd(5) / "manifest.json", step / "manifest.json")


CORRUPTIONS = {
    # name: (how, what the log must say)
    "bit_flip_in_data_file": (_bit_flip_in_data, "__0_0.distcp: checksum mismatch"),
    "truncated_data_file": (_truncated_data, "__0_0.distcp: {half} bytes, manifest says {full}"),
    "deleted_manifest": (_deleted_manifest, "no manifest"),
    "garbage_metadata_same_size": (_garbage_metadata, ".metadata: checksum mismatch"),
    "manifest_from_another_step": (_manifest_of_step_5, "manifest is for step 5"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_to_previous_and_says_why(root_5_10, corruption, caplog):
    root, seen = root_5_10
    how, why = CORRUPTIONS[corruption]
    full = (root / sd(10) / "__0_0.distcp").stat().st_size
    how(root / sd(10))
    why = why.format(half=full // 2, full=full)
    before = tree(root)

    caplog.set_level(logging.INFO, logger="ckpt")
    cp, model = restore(root)

    assert cp.step == 5 and cp.restored_step == 5
    assert_same(weights(model), seen[5], "weights")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(sd(10) in m and why in m for m in warnings), warnings
    assert tree(root) == before  # a restore reads; it never repairs or deletes


def test_tampered_metadata_is_never_unpickled(root_5_10, tmp_path, caplog):
    root, seen = root_5_10
    meta = root / sd(10) / ".metadata"
    size = meta.stat().st_size

    # The payload is live: unpickled, it does create its marker.
    probe = tmp_path / "probe-marker"
    pickle.loads(malicious_pickle(probe, size))
    assert probe.exists()

    marker = tmp_path / "PWNED"
    meta.write_bytes(malicious_pickle(marker, size))
    assert meta.stat().st_size == size
    # Checking a checkpoint reads the pickle's bytes and checksum only.
    assert states(root, deep=True) == {5: "committed", 10: "corrupt"}
    good, passed_over = catalog.restore_candidates(Store(str(root)))
    assert [e.step for e in good] == [5] and [e.step for e in passed_over] == [10]

    caplog.set_level(logging.INFO, logger="ckpt")
    cp, model = restore(root)
    assert cp.restored_step == 5
    assert_same(weights(model), seen[5], "weights")
    assert f"{sd(10)}/.metadata: checksum mismatch" in caplog.text
    caplog.clear()
    with pytest.raises(ckpt.RestoreFailed, match="checksum mismatch"):
        restore(root, restore=10)  # asking for that step by number: refused, not unpickled
    assert "falling back" not in caplog.text  # a step asked for is that step or nothing
    assert not marker.exists()

    # Plain DCP, which trusts the file, would have run it: the test is not vacuous.
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(str(root / sd(10))).read_metadata()
    except Exception:
        pass
    assert marker.exists()


def test_a_step_asked_for_that_does_not_load_fails_the_restore_without_falling_back(root_5_10, caplog):
    root, _ = root_5_10
    flip_byte(root / sd(10) / "__0_0.distcp")  # seen only when loading
    before = tree(root)
    caplog.set_level(logging.INFO, logger="ckpt")
    with pytest.raises(ckpt.RestoreFailed, match=rf"{sd(10)} could not be restored \(.*checksum mismatch.*restore='latest'"):
        restore(root, restore=10)
    assert "falling back" not in caplog.text  # that step or nothing
    assert tree(root) == before
    assert restore(root)[0].restored_step == 5  # 'latest' falls back


def test_every_checkpoint_corrupt_raises_restore_failed_and_touches_nothing(root_5_10, tmp_path):
    """Step 10's data is bit-flipped (seen only when loading), step 5's .metadata is a
    malicious pickle (never even checked by the listing, which stops at step 10)."""
    root, _ = root_5_10
    flip_byte(root / sd(10) / "__0_0.distcp")
    meta5 = root / sd(5) / ".metadata"
    marker = tmp_path / "PWNED"
    meta5.write_bytes(malicious_pickle(marker, meta5.stat().st_size))
    before = tree(root)

    with pytest.raises(ckpt.RestoreFailed) as err:
        restore(root)
    msg = str(err.value)
    assert f"{sd(10)}: " in msg and f"{sd(5)}: " in msg and "checksum mismatch" in msg
    assert "restore='none'" in msg  # says how to start fresh on purpose
    assert tree(root) == before
    assert not marker.exists()
    # The failed start is in the job's history, for `ckpt events` and for the next run.
    from ckpt.events import read_all
    from ckpt.schedule.coordinator import failed

    deadline = time.monotonic() + 30  # written in the background: the error was not held up for it
    while True:
        runs, events = read_all(Store(str(root)))
        done = any(e.kind == "failure" for e in events) and any((r.ended or "").startswith("failed to start") for r in runs)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (failure,) = [e for e in events if e.kind == "failure"]
    assert failure.phase == "start" and failure.cause.startswith("failed to start: RestoreFailed: ")
    (ended,) = [r.ended for r in runs if r.ended.startswith("failed to start")]
    assert ended == failure.cause and not failed(ended)  # not a machine failure (MTBF)
    table = ckpt_cli("events", root, check=True).stdout
    assert "failed to start" in table and "RestoreFailed" in table

    model, _ = make_model(seed=99)
    init = weights(model)
    cp, model = restore(root, restore="none")
    assert cp.step == 0 and cp.restored_step is None
    assert_same(weights(model), init, "weights")
    assert tree(root) == before
    assert not marker.exists()


@pytest.mark.parametrize("corruption", ["truncated_data_file", "manifest_from_another_step"])
def test_every_checkpoint_visibly_corrupt_raises_restore_failed_not_a_fresh_start(root_5_10, corruption):
    """The same when the listing alone shows every committed checkpoint to be corrupt (a size
    that does not match the manifest, a manifest of another step): no candidate is left, and
    that must not read as "no checkpoint yet, start from step 0"."""
    root, _ = root_5_10
    how, _ = CORRUPTIONS[corruption]
    how(root / sd(10))
    _truncated_data(root / sd(5))
    before = tree(root)

    with pytest.raises(ckpt.RestoreFailed) as err:
        restore(root)
    msg = str(err.value)
    assert f"{sd(10)}: " in msg and f"{sd(5)}: " in msg and "manifest says" in msg
    assert tree(root) == before


def test_a_root_with_only_unfinished_saves_starts_fresh(tmp_path, two_checkpoints):
    """No manifest anywhere: nothing was ever committed, so step 0 is the right start."""
    src, _ = two_checkpoints
    root = tmp_path / "root"
    shutil.copytree(src, root)
    for step in (5, 10):
        (root / sd(step) / "manifest.json").unlink()
    cp, _ = restore(root)
    assert cp.step == 0 and cp.restored_step is None


# -- an existing step directory is never written into ----------------------------------------
def test_resume_never_writes_into_a_corrupt_committed_step_and_saves_at_the_next_one(root_5_10, caplog):
    """Step 10 is committed but corrupt; the job resumes from 5 and reaches step 10 again.
    Its save there leaves the committed directory untouched (kept for a post-mortem) and moves
    to step 11, with a warning, instead of failing the job into a crash loop."""
    root, seen = root_5_10
    flip_byte(root / sd(10) / "__0_0.distcp")
    before = tree(root / sd(10))

    caplog.set_level(logging.INFO, logger="ckpt")
    cp, model, seen_now = train(root, 13, save_on_exit=False)
    assert cp.restored_step == 5 and cp.step == 13
    assert "could not restore " + sd(10) in caplog.text  # it did resume from 5
    assert sd(10) + " is taken (a checkpoint passed over at restore" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("ckpt")]
    assert tree(root / sd(10)) == before
    assert states(root, deep=True) == {5: "committed", 10: "corrupt", 11: "committed"}

    cp, restored = restore(root)
    assert cp.restored_step == 11
    assert_same(weights(restored), seen_now[11], "weights")


def test_leftover_incomplete_step_dir_is_removed_and_rewritten_fresh(tmp_path, two_checkpoints, caplog):
    src, _ = two_checkpoints
    root = tmp_path / "root"
    shutil.copytree(src, root)
    # Step 10 as a crashed save left it: a half-written data file, a stray file, no manifest.
    (root / sd(10) / "manifest.json").unlink()
    _truncated_data(root / sd(10))
    (root / sd(10) / "stray.tmp").write_bytes(b"left by a dead writer")

    caplog.set_level(logging.INFO, logger="ckpt")
    cp, model, seen = train(root, 10)
    assert cp.restored_step == 5
    assert "removing debris of an unfinished save at " + sd(10) in caplog.text
    names = {p.name for p in (root / sd(10)).iterdir()}
    assert names == {"manifest.json", ".metadata", "__0_0.distcp"}
    assert states(root, deep=True) == {5: "committed", 10: "committed"}
    cp, restored = restore(root)
    assert cp.restored_step == 10
    assert_same(weights(restored), seen[10], "weights")


def test_fresh_start_over_an_old_run_never_writes_into_its_checkpoints(root_5_10, caplog):
    """restore="none" over a root that holds committed steps: training starts from step 0,
    and its saves at steps the root already holds move to the next step rather than mix into
    them; the old checkpoints stay byte for byte."""
    root, _ = root_5_10
    before = tree(root)

    caplog.set_level(logging.INFO, logger="ckpt")
    cp, _, _ = train(root, 15, restore="none", seed=7)
    assert cp.restored_step is None and cp.step == 15
    assert "restore='none' but" in caplog.text
    assert sd(5) + " is taken (a checkpoint passed over at restore" in caplog.text
    # Step 5's save moved to 6; the interval counts from there (11), and leaving saves 15.
    new_steps = {6, 11, 15}
    assert {k: v for k, v in tree(root).items() if not any(k.startswith(sd(n)) for n in new_steps)} == before
    assert states(root, deep=True) == {5: "committed", 6: "committed", 10: "committed", 11: "committed", 15: "committed"}


def test_metadata_rewritten_with_a_matching_manifest_is_still_never_run(root_5_10, tmp_path, caplog):
    """Someone with write access replaces .metadata by a pickle that runs code AND fixes its
    size and checksum in the manifest: the checksum matches, yet nothing runs. .metadata is
    read through an allowlist of DCP's own types; restore falls back, verify --deep fails."""
    import json
    import pickle

    from ckpt.format.checksum import checksum

    root, seen = root_5_10
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    blob = pickle.dumps(Payload())
    manifest_path = root / sd(10) / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    (root / sd(10) / ".metadata").write_bytes(blob)
    doc["files"][".metadata"].update(size=len(blob), checksum=checksum(blob))
    manifest_path.write_text(json.dumps(doc))

    caplog.set_level(logging.WARNING, logger="ckpt")
    cp, restored = restore(root)
    assert cp.restored_step == 5
    assert "never holds: refused, nothing in it was run" in caplog.text
    deep = ckpt_cli("verify", root, "--deep")
    assert deep.returncode == 1 and "never holds" in deep.stdout
    assert not marker.exists()


def test_a_fallback_goes_to_the_newest_commit_before_though_its_manifest_was_written_long_before(tmp_path):
    """Restore reads manifests newest-written first and stops early (catalog.CLOCK_SKEW_S);
    after the chosen one fails to load, the next is picked afresh by commit time, not by when
    its manifest was written (an agent's commit lands late, its `created` stays early)."""
    import json

    from tests.support.toy_model import build, optimizer

    def run(restore_to=None):
        model = build("plain", 1)
        opt, _ = optimizer(model)
        cp = ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=ckpt.Every(steps=1),
                               keep=ckpt.Keep(last=10), handle_sigterm=False, save_on_exit=False)
        with cp:
            for _ in range(cp.step, restore_to or 3):
                model(torch.randn(2, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
        return cp

    run()
    for step, created, written in ((1, 1000.0, 2000.0), (2, 1200.0, 1300.0), (3, 1900.0, 1950.0)):
        m = tmp_path / sd(step) / "manifest.json"
        doc = json.loads(m.read_text())
        doc["created"] = created
        m.write_text(json.dumps(doc))
        os.utime(m, (written, written))
    flip_byte(next((tmp_path / sd(3)).glob("__0_*.distcp")))  # found only when loaded
    assert run(restore_to=3).restored_step == 2


@pytest.mark.parametrize("restore_from", [1, "none"])
def test_a_run_on_a_host_whose_clock_is_behind_dates_its_commits_after_the_root_s_newest(tmp_path, monkeypatch, caplog, restore_from):
    """Run A commits steps 1 and 10. Run B goes on from step 1 (or starts afresh beside A's
    checkpoints) on a host whose clock is an hour behind, and commits step 2. A restore picks
    the newest commit: B's step 2, the run that went on, never A's abandoned step 10, though
    B's clock would date it an hour before that."""
    def run(steps: int, saves: tuple[int, ...], **kw) -> ckpt.Checkpointer:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, save_on_exit=False,
                               handle_sigterm=False, keep=ckpt.Keep(last=10), **kw) as cp:
            while cp.step < steps:
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
                if cp.step in saves:
                    cp.save(blocking=True)
        return cp

    run(10, (1, 10), restore="none")
    real = time.time
    monkeypatch.setattr(commit, "_said_behind", threading.Event())  # once per process: this test's process
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real() - 3600)  # this host's clock, an hour behind
        caplog.set_level(logging.WARNING, logger="ckpt")
        b = run(3, (2, 3), restore=restore_from)
    assert run(3, (), restore="latest").restored_step == 3
    assert b.last_commit.step == 3 and b.last_commit.created > catalog.find(Store(str(tmp_path)), 10).manifest.created
    # Said once, not at every commit until the clock catches up.
    assert caplog.text.count("s behind the newest commit of the root; the commit is dated after that one") == 1


def test_a_model_whose_shapes_changed_fails_the_restore_and_never_falls_back_to_an_older_step(tmp_path, caplog):
    """Step 2 (an embedding of 5 rows), 3 and 4 (grown to 8 rows) are all sound. A job that
    builds the 5-row model again does not match step 4: a fallback to step 2 would resume
    two steps back and let retention delete step 4. It must fail, saying why, touching nothing."""
    root = tmp_path / "root"

    def job(rows: int, steps: int, **kw) -> ckpt.Checkpointer:
        torch.manual_seed(0)
        model = torch.nn.Embedding(rows, 4)
        opt = torch.optim.AdamW(model.parameters())
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=2), **{"keep": ckpt.Keep(last=1), **kw}) as cp:
            for _ in range(cp.step, steps):
                model(torch.tensor([0, 1])).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
        return cp

    job(5, 2)
    job(8, 4, keep=ckpt.Keep(last=3), restore="none")  # step 2 kept; 3 (2 was taken) and 4 saved
    before = tree(root)
    caplog.set_level(logging.INFO, logger="ckpt")
    with pytest.raises(ckpt.RestoreFailed, match=rf"{sd(4)} does not hold what this job has .*Size mismatch.*restore=STEP"):
        job(5, 6)
    assert "falling back" not in caplog.text
    assert tree(root) == before
    assert job(5, 6, restore=2).restored_step == 2  # asked for: the step that matches
