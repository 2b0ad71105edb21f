"""`ckpt.prepare`: a restore begun before the model exists (`ckpt/early.py`).

Real single-process jobs on a local root and on the S3 server (the 2-rank path: the S3 half
of tests/system/test_corruption.py restores every damaged root through it). What is checked:
rank 0 restores with the survey made at prepare only where it still stands, and restores
exactly what it would have restored without it in every other case: the checkpoint newer,
deleted or damaged since, the Checkpointer's settings other than prepare's, a prepare that
failed, a root that is a step directory. `restore_plan` is counted (wrapped, not replaced) to
tell whether the survey was made again.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch

import ckpt
from ckpt import early
from ckpt.format.signing import SigningKey
from ckpt.restore import load
from ckpt.storage.store import step_dir_name

KEY = "k" * 32


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("s3_root")


@pytest.fixture
def surveys(monkeypatch) -> list[int]:
    """The surveys rank 0 made (`restore_plan` calls, the prepare's not counted), counted
    from `_prepared` on."""
    counted = _Counted(load.restore_plan)
    monkeypatch.setattr(load, "restore_plan", counted)
    monkeypatch.setattr(early, "_pending", None)
    return counted.calls


class _Counted:
    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append(1)
        return self.real(*args, **kwargs)


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(root: str, to: int, **kw) -> dict[str, torch.Tensor]:
    """Train to step `to` saving every 2 steps (resuming what the root holds); the weights."""
    model, opt = _objects()
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(2), handle_sigterm=False, **kw) as cp:
        for _ in range(cp.step, to):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _prepared(root: str, **kw) -> early.Early:
    ckpt.prepare(root, **kw)
    pending = early._pending
    assert pending is not None and pending.done.wait(60)
    if isinstance(load.restore_plan, _Counted):
        load.restore_plan.calls.clear()
    return pending


def _restore(root: str, **kw) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _objects(seed=1)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False, **kw) as cp:
        return cp.step, model.state_dict()


def test_a_prepared_restore_takes_the_store_over_and_restores_with_its_survey(root, surveys):
    weights = _train(root, 4)
    prepared = _prepared(root)
    assert prepared.plan is not None and prepared.plan.steps == [4] and prepared.plan.manifest is not None
    model, opt = _objects(seed=1)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False) as cp:
        assert cp.store is prepared.store
        assert cp.step == 4 and not surveys
        assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    assert early._pending is None  # taken once


def _newer_since(root: str, prepared: early.Early) -> None:
    """Another run of the job trains on to step 6 after the survey (it takes the lease)."""
    early._pending = None
    _train(root, 6)
    early._pending = prepared


def _newer_without_the_lease(root: str, prepared: early.Early) -> None:
    """A writer that keeps no lease (as a node agent finishing a dead job's save) commits
    step 6 after the survey: the lease is as prepare saw it."""
    early._pending = None
    _train(root, 6, lease=None)
    early._pending = prepared


def _older_step_since(root: str, prepared: early.Early) -> None:
    """A run that went on from step 2 (restore=2, keeping no lease) commits step 3 after the
    survey: the newest commit, at a lower step than the pick (outside review)."""
    early._pending = None
    _train(root, 3, lease=None, restore=2)
    early._pending = prepared


def _rewritten_since(root: str, prepared: early.Early) -> None:
    """Step 4's manifest rewritten in place with other bytes of the same size (a store whose
    times are whole seconds would not show it): the pick read by its bytes."""
    fs, path = fsspec.core.url_to_fs(root)
    name = f"{path}/{step_dir_name(4)}/manifest.json"
    data = fs.cat_file(name)
    fs.pipe_file(name, data.replace(b'"step"', b'"stEp"', 1))


def _deleted_since(root: str, prepared: early.Early) -> None:
    """Step 4 removed behind the lease's back (a user's rm): the survey still names it."""
    fs, path = fsspec.core.url_to_fs(root)
    fs.rm(f"{path}/{step_dir_name(4)}", recursive=True)


def _damaged_since(root: str, prepared: early.Early) -> None:
    """Step 4's data file cut short behind the lease's back."""
    fs, path = fsspec.core.url_to_fs(root)
    name = next(n for n in fs.ls(f"{path}/{step_dir_name(4)}", detail=False) if n.endswith(".distcp"))
    data = fs.cat_file(name)
    fs.pipe_file(name, data[: len(data) // 2])


@pytest.mark.parametrize(
    ("change", "step", "surveyed", "said"),
    [
        (_newer_since, 6, 2, "not used"),
        (_newer_without_the_lease, 6, 2, "changed since ckpt.prepare"),
        (_older_step_since, 3, 2, "changed since ckpt.prepare"),
        (_rewritten_since, 2, 1, "changed since ckpt.prepare"),
        (_deleted_since, 2, 1, "changed since ckpt.prepare"),
        (_damaged_since, 2, 1, "falling back"),
    ],
    ids=["newer-with-the-lease", "newer-without-it", "older-step-newer-commit", "manifest-rewritten", "deleted-without-it", "damaged-without-it"],
)
def test_a_root_changed_after_the_survey_restores_what_it_holds_now(root, surveys, caplog, change, step, surveyed, said):
    """A run that took the lease since, or kept none (its own survey counted): the lease write fails its
    condition and the survey is made anew. A change made without the lease: the survey
    stands; rank 0's second look at the root, made while the ranks read, finds a newer
    checkpoint or the pick's manifest gone, and the restore starts over from a survey made
    then; a pick damaged where no listing shows it fails its read and falls back as always
    (its one survey: the fallback's)."""
    _train(root, 4)
    prepared = _prepared(root)
    change(root, prepared)
    with caplog.at_level(logging.DEBUG, logger="ckpt"):
        got, _ = _restore(root)
    assert got == step
    assert len(surveys) == surveyed
    assert said in caplog.text
    assert ("the survey made at prepare stands" in caplog.text) == (said != "not used")


@pytest.mark.parametrize(
    ("prepare_kw", "restore_kw", "step"),
    [
        ({"restore": 2}, {}, 4),
        ({}, {"restore": 2}, 2),
        ({"timeout_s": 30}, {}, 4),
        ({"signing_key": KEY}, {}, 4),
        ({}, {"lease": None}, 4),
    ],
    ids=["prepared-a-step", "restores-a-step", "other-timeout", "other-key", "no-lease"],
)
def test_a_prepare_with_other_settings_changes_nothing(root, surveys, prepare_kw, restore_kw, step):
    """Its survey is not used (the store neither, where the store's settings differ): the
    Checkpointer restores what it would have without it."""
    _train(root, 4)
    _prepared(root, **prepare_kw)
    got, _ = _restore(root, **restore_kw)
    assert got == step
    assert len(surveys) == 1


def test_a_prepare_for_another_root_is_not_taken(tmp_path, surveys, caplog):
    """Wasted, never wrong, and said (a new user could not tell before: outside review)."""
    _train(str(tmp_path / "a"), 4)
    _train(str(tmp_path / "b"), 2)
    prepared = _prepared(str(tmp_path / "a"))
    with caplog.at_level(logging.INFO, logger="ckpt"):
        got, _ = _restore(str(tmp_path / "b"))
    assert "ckpt.prepare was for" in caplog.text and "not used" in caplog.text
    assert got == 2 and len(surveys) == 1
    assert early._pending is None and prepared.plan.steps == [4]  # dropped, not kept for later


def test_a_signed_restore_uses_a_prepare_with_the_same_key(tmp_path, surveys):
    root = str(tmp_path / "root")
    _train(root, 4, signing_key=KEY)
    _prepared(root, signing_key=KEY)
    got, _ = _restore(root, signing_key=KEY)
    assert got == 4 and not surveys


def test_a_prepare_that_fails_leaves_the_checkpointer_to_say_why(tmp_path, surveys):
    """A root that is a step directory: prepare surveys nothing, and the Checkpointer refuses
    it as it does without prepare."""
    root = tmp_path / "root"
    _train(str(root), 2)
    step = str(root / step_dir_name(2))
    prepared = _prepared(step)
    assert prepared.plan is None and prepared.seen is None
    with pytest.raises(ValueError, match="is a checkpoint"):
        _restore(step)


def test_what_the_survey_says_is_logged_once_when_it_is_used(tmp_path, surveys, caplog):
    """A damaged newest checkpoint: "passing over" is held back at prepare and said once, by
    the Checkpointer that used the survey."""
    root = tmp_path / "root"
    _train(str(root), 4)
    (root / step_dir_name(4) / "manifest.json").write_text("{ not json")
    with caplog.at_level(logging.INFO, logger="ckpt"):
        _prepared(str(root))
        assert not [r for r in caplog.records if "passing over" in r.getMessage()]
        got, _ = _restore(str(root))
    assert got == 2 and not surveys
    assert len([r for r in caplog.records if "passing over" in r.getMessage()]) == 1


def test_the_prepare_thread_holds_back_only_its_own_lines(tmp_path, surveys, caplog, monkeypatch):
    """Another thread's lines are logged as they come while prepare's survey runs (held up
    here inside it), its own are held."""
    _train(str(tmp_path / "root"), 2)
    inside, go = threading.Event(), threading.Event()
    real = early.restore_plan

    def held_up(*args, **kwargs):
        logging.getLogger("ckpt.restore.load").warning("from the survey")
        inside.set()
        assert go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(early, "restore_plan", held_up)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        ckpt.prepare(str(tmp_path / "root"))
        assert inside.wait(60)
        logging.getLogger("ckpt.restore.load").warning("from the main thread")
        go.set()
        assert early._pending.done.wait(60)
    assert "from the main thread" in caplog.text and "from the survey" not in caplog.text
    assert [r.getMessage() for r in early._pending.records] == ["from the survey"]
    early._pending = None


def test_restore_none_prepares_the_store_and_surveys_nothing(tmp_path, surveys):
    root = str(tmp_path / "root")
    _train(root, 2)
    prepared = _prepared(root, restore="none")
    assert prepared.store is not None and prepared.plan is None
    got, _ = _restore(root, restore="none")
    assert got == 0


def test_a_copy_of_the_checkpoint_dir_left_in_place_is_not_what_the_survey_reads(tmp_path, surveys):
    """The survey names the files it checked; a later copy over the newest step (without the
    lease) is read and checked against that manifest, not trusted: it fails and falls back."""
    root = tmp_path / "root"
    _train(str(root), 4)
    _prepared(str(root))
    shutil.rmtree(root / step_dir_name(4))
    shutil.copytree(root / step_dir_name(2), root / step_dir_name(4))
    got, _ = _restore(str(root))
    assert got == 2


def test_a_lease_this_process_holds_already_is_never_taken_as_seen(tmp_path, surveys):
    """A Checkpointer of this process holds the root and commits under it while another,
    prepared meanwhile, enters: the lease is shared, so the survey is made anew (outside
    review: the shared keeper still said "as seen" from its own first take)."""
    root = str(tmp_path / "root")
    _train(root, 2)
    _prepared(root)
    model, opt = _objects()
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(2), handle_sigterm=False) as outer:
        assert outer.step == 2
        _prepared(root)
        for _ in range(2, 4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            outer.step_done()
        outer.wait()
        got, _ = _restore(root)
    assert got == 4 and len(surveys) == 1


def test_a_forked_child_forgets_the_prepare_and_its_held_lines(tmp_path):
    """A DataLoader worker forked while prepare runs: nothing in it waits for a thread it
    does not have, and no filter of it holds the child's lines (outside review)."""
    root = str(tmp_path / "root")
    _train(root, 2)
    prepared = _prepared(root)
    prepared.hold_lines()  # as while its survey runs
    early._pending = prepared
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if nothing of the prepare is left
            held = any(isinstance(f, early._Hold) for name in ("ckpt", "ckpt.restore.load") for f in logging.getLogger(name).filters)
            os._exit(0 if early._pending is None and not held else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert early._pending is prepared  # the parent's is its own still
    finally:
        prepared.release_lines()
        early._pending = None


def test_a_prepare_still_at_work_is_waited_for_no_longer_than_the_timeout(tmp_path, caplog):
    args = early.store_config(str(tmp_path), None, None, 600.0)
    early._pending = stuck = early.Early(args, "latest", None, 1, True)  # its thread never ends
    began = time.monotonic()
    assert early.take(args, 0.2) is None
    assert time.monotonic() - began < 5 and not stuck.done.is_set()
    assert "still runs after" in caplog.text


def test_the_restore_is_said_when_the_log_is_set_up_after_prepare(tmp_path, surveys, caplog):
    """"restoring from" is logged by the restore that uses the survey, at the level set then
    (prepare's thread made no INFO line where INFO was off: outside review)."""
    root = str(tmp_path / "root")
    _train(root, 4)
    caplog.set_level(logging.WARNING, logger="ckpt")
    _prepared(root)
    caplog.set_level(logging.INFO, logger="ckpt")
    got, _ = _restore(root)
    assert got == 4 and not surveys
    assert len([r for r in caplog.records if r.getMessage().startswith("restoring from")]) == 1


def test_prepares_repr_holds_no_storage_secret(tmp_path):
    ckpt.prepare(str(tmp_path), storage_options={"secret": "SUPERSECRETVALUE1"})
    prepared = early._pending
    assert prepared is not None and prepared.done.wait(60)
    assert "SUPERSECRETVALUE1" not in repr(prepared) and "SUPERSECRETVALUE1" not in str(prepared)
    early._pending = None


@pytest.mark.parametrize(
    "bad",
    [{"timeout_s": float("nan")}, {"timeout_s": float("inf")}, {"timeout_s": 0}, {"storage_options": "x"}, {"transfer": "x"}, {"restore": "newest"}],
    ids=["nan", "inf", "zero", "options", "transfer", "restore"],
)
def test_prepare_refuses_what_the_checkpointer_would_at_once(tmp_path, bad):
    with pytest.raises(ValueError):
        ckpt.prepare(str(tmp_path), **bad)
    with pytest.raises(ValueError):
        ckpt.prepare(5)  # type: ignore[arg-type]


def test_a_signed_restore_never_takes_a_survey_made_without_its_key(tmp_path, surveys):
    """Step 2 signed, a newer step 4 not: prepare without the key picks 4; the Checkpointer
    with the key must not (outside review: every other test passed without the key check)."""
    root = str(tmp_path / "root")
    _train(root, 2, signing_key=KEY)
    early._pending = None
    _train(root, 4)
    assert _prepared(root).plan.steps == [4]
    got, _ = _restore(root, signing_key=KEY)
    assert got == 2 and len(surveys) == 1


def test_a_root_with_nothing_to_restore_at_prepare_is_looked_at_again(tmp_path, surveys):
    """Prepare found no checkpoint; one committed since without the lease is restored."""
    root = str(tmp_path / "root")
    Path(root).mkdir()
    prepared = _prepared(root)
    assert prepared.plan is not None and prepared.plan.steps == []
    _newer_without_the_lease(root, prepared)
    got, _ = _restore(root)
    assert got == 6 and len(surveys) == 2  # the writer's, and the one made anew


class _Keeper:
    as_seen = True


@pytest.mark.parametrize(
    ("what", "stands"),
    [("all", True), ("agents", False), ("world", False), ("mode", False), ("key", False), ("no-lease", False), ("not-as-seen", False)],
)
def test_the_survey_stands_only_where_everything_it_depends_on_is_as_prepared(tmp_path, what, stands):
    prepared = _prepared_with_plan(tmp_path)
    keeper = None if what == "no-lease" else _Keeper()
    if what == "not-as-seen":
        keeper.as_seen = False
    got = prepared.survey(
        mode=2 if what == "mode" else "latest",
        key=SigningKey(KEY) if what == "key" else None,
        world=2 if what == "world" else 1,
        lease=keeper,
        agents=what == "agents",
    )
    assert (got is not None) == stands


def _prepared_with_plan(tmp_path) -> early.Early:
    root = str(tmp_path / "root")
    _train(root, 2)
    prepared = _prepared(root)
    early._pending = None
    assert prepared.plan is not None
    return prepared


def test_storage_options_changed_after_prepare_are_other_options(s3_root, s3_options, surveys):
    """The options as they were at prepare: a dict changed in place since makes another
    store, not the prepared one with the old contents (outside review)."""
    opts = dict(s3_options)
    _train(s3_root, 2, storage_options=opts)
    prepared = _prepared(s3_root, storage_options=opts)
    opts["client_kwargs"] = {"region_name": "us-east-1"}
    model, opt = _objects(seed=1)
    with ckpt.Checkpointer(s3_root, model=model, optimizer=opt, interval=None, save_on_exit=False, handle_sigterm=False, storage_options=opts) as cp:
        assert cp.store is not prepared.store and cp.step == 2
    assert len(surveys) == 1


def test_a_root_emptied_while_its_prepared_pick_is_read_never_starts_fresh_from_it(tmp_path, surveys):
    """The pick read into the objects (perhaps in part), then found gone with every other
    checkpoint: the restore fails, saying why, where the cold restore would start fresh; the
    next run starts fresh from an empty root."""
    root = tmp_path / "root"
    _train(str(root), 4)
    _prepared(str(root))
    for step in (2, 4):
        shutil.rmtree(root / step_dir_name(step))
    with pytest.raises(ckpt.RestoreFailed, match="changed while it was read"):
        _restore(str(root))
    got, _ = _restore(str(root))
    assert got == 0


def test_a_step_asked_for_stands_whatever_was_committed_since(tmp_path, surveys, caplog):
    """restore=STEP: only the pick's own manifest is looked at again; a newer commit does not
    make the ranks read it twice (outside review)."""
    root = str(tmp_path / "root")
    _train(root, 4)
    prepared = _prepared(root, restore=2)
    _newer_without_the_lease(root, prepared)
    with caplog.at_level(logging.DEBUG, logger="ckpt"):
        got, _ = _restore(root, restore=2)
    assert got == 2 and len(surveys) == 1  # the writer's own
    assert "the survey made at prepare stands" in caplog.text and "changed since" not in caplog.text
