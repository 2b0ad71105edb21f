"""Retention (`Keep`) and the save interval (`Every`): the pure rules on plain lists, then
retention end to end on a real root (the listing it reads: tests/storage/test_catalog.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name
from tests.support.loop import run, step_dirs


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
