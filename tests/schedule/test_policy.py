"""Retention (`Keep`) and the save interval (`Every`): the pure rules on plain lists, then
retention end to end on a real root."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name


# -- Keep.to_delete on plain lists ------------------------------------------------------------
def test_keep_last_deletes_older_committed_oldest_first():
    assert ckpt.Keep(last=2).to_delete([5, 10, 15, 20]) == [5, 10]
    assert ckpt.Keep(last=4).to_delete([5, 10, 15, 20]) == []
    assert ckpt.Keep(last=10).to_delete([5]) == []


def test_keep_counts_by_commit_order_so_a_run_restarted_from_an_older_step_keeps_its_own():
    # An old run committed 5..20; a new run restored step 5 and has committed 8 since:
    # its checkpoints are the newest although their steps are lower.
    assert ckpt.Keep(last=2).to_delete([5, 10, 15, 20, 8], protect={5, 8}) == [10, 15]
    # and a save in progress above the newest commit's step is not debris
    assert ckpt.Keep(last=1).to_delete([20, 6], incomplete=[8, 3]) == [3, 20]


def test_keep_never_deletes_the_newest_committed():
    for committed in ([7], [3, 7], [1, 2, 3, 4, 5, 6, 7]):
        doomed = ckpt.Keep(last=1).to_delete(committed)
        assert max(committed) not in doomed
        assert doomed == sorted(committed)[:-1]
    # not even when a caller lists it as incomplete too, or other rules would drop it
    assert 20 not in ckpt.Keep(last=1, every_steps=7).to_delete([10, 20], incomplete=[20])


def test_keep_every_steps_keeps_multiples_on_top_of_the_last_n():
    keep = ckpt.Keep(last=1, every_steps=10)
    assert keep.to_delete([5, 10, 15, 20, 25]) == [5, 15]
    keep = ckpt.Keep(last=2, every_steps=100)
    assert keep.to_delete([100, 150, 200, 250, 300, 350]) == [150, 250]


def test_keep_deletes_incomplete_dirs_older_than_the_newest_commit_only():
    keep = ckpt.Keep(last=3)
    # 5 and 15 are debris of crashed saves; 25 is newer than the newest commit: it may be a
    # save still being written, so it stays.
    assert keep.to_delete([10, 20], incomplete=[5, 15, 25]) == [5, 15]
    # An incomplete dir at a multiple of every_steps is not a checkpoint: it goes too.
    assert ckpt.Keep(last=1, every_steps=10).to_delete([25, 30], incomplete=[10]) == [10, 25]


def test_keep_deletes_nothing_while_there_is_no_commit():
    # The first save may be in flight: with no commit, no directory is known to be debris.
    assert ckpt.Keep(last=1).to_delete([], incomplete=[5, 10]) == []
    assert ckpt.Keep(last=1).to_delete([]) == []


def test_keep_never_deletes_a_save_in_flight():
    keep = ckpt.Keep(last=1)
    assert keep.to_delete([10, 20], incomplete=[5, 15], in_flight={15}) == [5, 10]
    assert keep.to_delete([10, 20, 30], in_flight={10, 20}) == []


def test_keep_does_not_modify_its_inputs():
    committed, incomplete, in_flight = [20, 5, 10], [3], {7}
    ckpt.Keep(last=1).to_delete(committed, incomplete, in_flight)
    assert committed == [20, 5, 10] and incomplete == [3] and in_flight == {7}


@pytest.mark.parametrize("kwargs", [{"last": 0}, {"last": -1}, {"every_steps": 0}, {"every_steps": -5}])
def test_keep_rejects_settings_that_would_delete_everything(kwargs):
    with pytest.raises(ValueError):
        ckpt.Keep(**kwargs)


# -- Every -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"steps": 0}, {"steps": -1}, {"seconds": 0}, {"seconds": -1.5}, {"steps": 0, "seconds": 10}],
)
def test_every_rejects_missing_or_non_positive_intervals(kwargs):
    with pytest.raises(ValueError):
        ckpt.Every(**kwargs)


def test_every_steps_is_due_after_that_many_steps_since_the_last_save():
    e = ckpt.Every(steps=5)
    assert not e.due_by_step(4, 0)
    assert e.due_by_step(5, 0)
    assert not e.due_by_step(9, 5)
    assert e.due_by_step(10, 5)
    assert not e.due_by_time(1e9)  # no time rule


def test_every_seconds_is_due_after_that_much_time():
    e = ckpt.Every(seconds=30)
    assert not e.due_by_time(29.9)
    assert e.due_by_time(30.0)
    assert not e.due_by_step(10**6, 0)  # no step rule
    both = ckpt.Every(steps=100, seconds=30)
    assert both.due_by_step(100, 0) and both.due_by_time(31)


# -- retention end to end ---------------------------------------------------------------------
def run(root: Path, steps: int, keep: ckpt.Keep) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=5), keep=keep) as cp:
        for _ in range(cp.step, steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_the_step_a_run_restored_is_kept_while_it_runs_and_retired_when_it_leaves(tmp_path):
    root = tmp_path / "root"
    run(root, 10, ckpt.Keep(last=2))
    assert step_dirs(root) == [step_dir_name(s) for s in (5, 10)]
    # The restored step 10 outlives Keep(last=2) while the run goes on, and goes as it leaves.
    run(root, 25, ckpt.Keep(last=2))
    assert step_dirs(root) == [step_dir_name(s) for s in (20, 25)]


def test_run_with_keep_last_2_leaves_only_the_two_newest_and_clears_stale_debris(tmp_path, caplog):
    root = tmp_path / "root"
    # Debris of an earlier crashed save (older than any commit to come) and a directory
    # newer than anything this run commits (as if another save were still writing it).
    stale = root / step_dir_name(3)
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"half a file")
    newer = root / step_dir_name(1000)
    newer.mkdir()
    (newer / "__0_0.distcp").write_bytes(b"being written")

    caplog.set_level(logging.DEBUG, logger="ckpt")
    run(root, 20, ckpt.Keep(last=2))

    assert step_dirs(root) == [step_dir_name(s) for s in (15, 20, 1000)]
    assert f"retention: deleting {step_dir_name(3)}" in caplog.text
    states = {e.step: e.state for e in catalog.scan(Store(str(root)), deep=True)}
    assert states == {15: "committed", 20: "committed", 1000: "incomplete"}


def test_run_with_keep_every_steps_keeps_the_multiples(tmp_path):
    root = tmp_path / "root"
    run(root, 30, ckpt.Keep(last=2, every_steps=10))
    assert step_dirs(root) == [step_dir_name(s) for s in (10, 20, 25, 30)]
    # and what is kept still restores
    model = torch.nn.Linear(8, 4)
    with ckpt.Checkpointer(str(root), model=model, interval=None, save_on_exit=False, restore=10) as cp:
        assert cp.restored_step == 10


def _manifest_reads(monkeypatch) -> list[str]:
    """The step directories whose manifest is read through a Store from now on."""
    reads: list[str] = []
    real = Store.read_bytes

    def counting(self, rel):
        if rel.endswith("/manifest.json"):
            reads.append(rel.split("/")[0])
        return real(self, rel)

    monkeypatch.setattr(Store, "read_bytes", counting)
    return reads


def test_retention_reads_each_kept_manifest_once_not_at_every_save(tmp_path, monkeypatch):
    reads = _manifest_reads(monkeypatch)
    run(tmp_path / "root", 40, ckpt.Keep(last=100))  # 8 saves, all kept
    assert step_dirs(tmp_path / "root") == [step_dir_name(s) for s in range(5, 41, 5)]
    # Each save's retention lists the root and reads only the manifest it has not seen.
    assert sorted(reads) == [step_dir_name(s) for s in range(5, 41, 5)], reads


def test_scans_read_again_only_what_changed_and_see_a_manifest_rewritten_or_a_step_gone(tmp_path, monkeypatch):
    root = tmp_path / "root"
    run(root, 20, ckpt.Keep(last=100))  # steps 5, 10, 15, 20
    store = Store(str(root))
    reads = _manifest_reads(monkeypatch)
    scans = catalog.Scans()

    def states() -> dict[int, str]:
        got = {e.step: e.state for e in scans.scan(store)}
        assert got == {e.step: e.state for e in catalog.scan(store)}  # always what a full scan says
        return got

    assert states() == {5: "committed", 10: "committed", 15: "committed", 20: "committed"}
    reads.clear()
    assert states() == {5: "committed", 10: "committed", 15: "committed", 20: "committed"}
    assert reads == [step_dir_name(s) for s in (5, 10, 15, 20)]  # the full scans' reads alone

    # A manifest rewritten with the same size (a step number changed) and one cut short.
    m10, m15 = root / step_dir_name(10) / "manifest.json", root / step_dir_name(15) / "manifest.json"
    m10.write_text(m10.read_text().replace('"step": 10', '"step": 11'))
    m15.write_bytes(m15.read_bytes()[:-7])
    (root / step_dir_name(30)).mkdir()  # a save being written
    (root / step_dir_name(30) / "__0_0.distcp").write_bytes(b"half")
    import shutil

    shutil.rmtree(root / step_dir_name(5))
    reads.clear()
    assert states() == {10: "corrupt", 15: "corrupt", 20: "committed", 30: "incomplete"}
    assert sorted(reads[:2]) == [step_dir_name(10), step_dir_name(15)]  # the Scans' reads come first
    # What is not committed is read at every scan; only the committed one is kept.
    reads.clear()
    assert states() == {10: "corrupt", 15: "corrupt", 20: "committed", 30: "incomplete"}
    assert sorted(reads[:2]) == [step_dir_name(10), step_dir_name(15)]


def test_a_local_root_is_listed_as_any_other_store_lists_it(tmp_path):
    """The local scan walks the step directories with os.scandir, not fsspec's walk: it must
    list what the generic walk lists of the same tree (here a copy in fsspec's memory store)."""
    import fsspec

    root = tmp_path / "root"
    run(root, 10, ckpt.Keep(last=100))  # committed steps 5 and 10
    (root / step_dir_name(30) / "nested" / "deeper").mkdir(parents=True)  # a save being written
    (root / step_dir_name(30) / "nested" / "deeper" / "part").write_bytes(b"12345")
    (root / step_dir_name(30) / "__0_0.distcp").write_bytes(b"half")
    (root / step_dir_name(40)).mkdir()  # an empty one
    (root / "lease.json").write_text("{}")  # not a step: neither listed nor walked
    (root / "not-a-step").mkdir()
    (root / "not-a-step" / "x").write_bytes(b"x")

    mem = fsspec.filesystem("memory")
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            mem.makedirs(f"/copy/{rel}", exist_ok=True)
        else:
            mem.pipe_file(f"/copy/{rel}", path.read_bytes())
    local, generic = Store(str(root)).scan(), Store("memory://copy").scan()
    assert sorted(local) == sorted(generic) == [5, 10, 30, 40]
    for step, listing in local.items():
        assert listing.files == generic[step].files, step
    assert local[30].files == {"__0_0.distcp": 4, "nested/deeper/part": 5}
    assert local[40].files == {}
    for step in (5, 10):  # the manifest's write time, which the Scans compare
        assert local[step].manifest_mtime == (root / step_dir_name(step) / "manifest.json").stat().st_mtime
    assert local[30].manifest_mtime is None


def test_a_local_root_that_is_not_there_lists_empty_and_an_unreadable_one_is_an_error(tmp_path):
    assert Store(str(tmp_path / "nowhere")).scan() == {}
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="listing"):  # NotADirectoryError: never "empty"
        Store(str(tmp_path / "afile")).scan()


def test_a_step_directory_deleted_while_the_root_is_listed_is_left_out(tmp_path, monkeypatch):
    import shutil

    from ckpt.storage import store as storage
    for step in (1, 2):
        (tmp_path / step_dir_name(step) / "sub").mkdir(parents=True)
        (tmp_path / step_dir_name(step) / "f").write_bytes(b"ab")
    real = storage.os.scandir

    def deleting(path):  # another process's retention deletes step 2 as it is reached
        if str(path).endswith(step_dir_name(2)) or str(path).endswith(f"{step_dir_name(1)}/sub"):
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(storage.os, "scandir", deleting)
    listed = Store(str(tmp_path)).scan()
    assert sorted(listed) == [1] and listed[1].files == {"f": 2}  # step 1 lost only its empty subdirectory


def _train_with_slow_store(tmp_path, monkeypatch, if_busy: str):
    import time

    import torch

    monkeypatch.setenv("CKPT_FAULT", "before_manifest:*:*:sleep=0.3")  # every save commits slowly
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=1), if_busy=if_busy, keep=ckpt.Keep(last=100)) as cp:
        started = time.perf_counter()
        for _ in range(10):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        loop_s = time.perf_counter() - started
    return cp, loop_s, sorted(int(p.name[5:]) for p in tmp_path.glob("step-*/manifest.json") for p in [p.parent])


def test_if_busy_skip_never_waits_for_a_slow_store_and_counts_what_it_skipped(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    cp, loop_s, committed = _train_with_slow_store(tmp_path, monkeypatch, "skip")
    skipped = [int(m) for m in re.findall(r"step (\d+): a save is due but the last one is still writing; skipped", caplog.text)]
    assert cp.skipped_saves >= 5 and len(skipped) == cp.skipped_saves
    # Every step saved but the skipped ones, and the last on leaving; nothing else written.
    assert committed == sorted((set(range(1, 11)) - set(skipped)) | {10})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{s:010d}" for s in committed]
    # Ten saves that each take 0.3 s to commit: waiting for them would take 3 s.
    assert loop_s < 1.5, loop_s


def test_if_busy_wait_saves_every_due_step(tmp_path, monkeypatch):
    cp, loop_s, committed = _train_with_slow_store(tmp_path, monkeypatch, "wait")
    assert cp.skipped_saves == 0 and committed == list(range(1, 11))


def test_over_the_host_memory_budget_a_save_streams_from_the_live_state_and_says_so(tmp_path, caplog):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    caplog.set_level(logging.WARNING, logger="ckpt")
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=2), host_memory_budget=1000) as cp:
        for _ in range(4):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert caplog.text.count("would exceed the host memory budget") == 1  # said once
    assert cp._slot.stager.bytes_staged == 0  # no host copy was made

    model2 = torch.nn.Linear(64, 64)
    with ckpt.Checkpointer(tmp_path, model=model2, optimizer=torch.optim.AdamW(model2.parameters()), save_on_exit=False) as cp2:
        assert cp2.step == 4
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k])


def _train_auto(root, auto, steps: int, sleep_s: float = 0.02, enough=None):
    """Train up to `steps` steps under the interval policy `auto`; stop sooner once
    `enough()` says so."""
    import time

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=auto, keep=ckpt.Keep(last=1000), handle_sigterm=False, save_on_exit=False) as cp:
        for _ in range(steps):
            if enough is not None and enough():
                break
            time.sleep(sleep_s)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        cp.wait()
    return cp


def test_auto_interval_saves_when_it_pays_and_records_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    # A node failing every 20 s: saves are cheap, so the optimum is about every step. One
    # save that a busy machine slows to 0.2 s puts the next 3 s away (sqrt(2 * 0.2 * 20)):
    # train until three were committed, for up to 40 s.
    def three() -> bool:
        return len(list(tmp_path.glob("step-*/manifest.json"))) >= 3

    cp = _train_auto(tmp_path, ckpt.Auto(node_mtbf_s=20.0, first_after_s=0.1), steps=2000, enough=three)
    manifests = [ckpt.Manifest.from_json(p.read_bytes()) for p in sorted(tmp_path.glob("step-*/manifest.json"))]
    assert len(manifests) >= 3
    assert manifests[0].schedule == {"policy": "auto", "seconds": 0.1}  # before any measurement
    later = manifests[-1].schedule
    assert later["policy"] == "auto" and later["mtbf_s"] == pytest.approx(20.0, rel=0.01)
    # the interval came from the unrounded costs; the manifest keeps them to 0.1 and 1 ms
    def interval(blocking: float, persist: float) -> float:
        return max((2 * max(blocking, 1e-3) * 20.0) ** 0.5, 1.1 * persist)  # a floor of 1 ms on blocking

    lo = interval(later["blocking_s"] - 5e-5, later["persist_s"] - 5e-4)
    hi = interval(later["blocking_s"] + 5e-5, later["persist_s"] + 5e-4)
    assert lo - 5e-4 <= later["seconds"] <= hi + 5e-4, later
    assert "interval: every" in caplog.text and cp.schedule["policy"] == "auto"


def test_auto_interval_learns_a_shorter_mtbf_from_the_jobs_failed_runs(tmp_path):
    import time

    from ckpt.events import RunRecord, write_run
    from ckpt.storage.store import Store

    store = Store(tmp_path)
    now = time.time()
    for i in range(6):  # six earlier runs, each killed after 100 s
        write_run(store, RunRecord(f"old-{i}", 1, now - 1000 + i * 100, now - 900 + i * 100, 0, 10))
    cp = _train_auto(tmp_path, ckpt.Auto(node_mtbf_s=1e6, first_after_s=0.05), steps=10)
    assert cp.schedule["failures_seen"] == 6
    # prior: 1 failure in 1e6 s; seen: 6 more in 600 s -> 7 / (1e6 + 600) per second
    assert cp.schedule["mtbf_s"] == pytest.approx((1e6 + 600) / 7, rel=0.01)
