"""Saves after the first lay their files out as the last planned save did (ckpt.save.resave).

What must hold: a resaved file is the file DCP's planned save would have written, byte for
byte, and loads with plain `dcp.load`; a state that changed shape on any rank is planned
afresh on every rank; a resave that fails on one rank fails that save on all of them, and
the next save commits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt.collectives import Group
from ckpt.save.commit import Save, Source, persist
from ckpt.save.resave import Resaver
from ckpt.save.stage import Stager
from ckpt.save.upload import Direct
from ckpt.save.writer_proc import ThreadSink
from ckpt.storage.store import Store
from tests.support import launch
from tests.support.compare import assert_bitwise_equal


def _state(step: int, note: str) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(300, 1000, generator=g), "b": torch.randn(7, generator=g).half()},
        "optim": {"state": {0: {"exp_avg": torch.randn(300, 1000, generator=g), "step": torch.tensor(float(step)), "count": step}}, "lr": 0.1 / step},
        "step": step,  # 255 -> 70000: its pickle grows
        "note": note,
        "hist": list(range(step % 5)),
    }


def _persist(root: Path, step: int, staged: dict, stager: Stager, resaver: Resaver) -> None:
    source = Source(staged, ThreadSink, resaver, stager.arenas, layout=resaver.fitting(staged))
    persist(Save(step, Store(root), Group(None, 0, 1)), source, Direct())


def _empty(like):
    if isinstance(like, dict):
        return {k: _empty(v) for k, v in like.items()}
    if isinstance(like, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in like):
        return [_empty(v) for v in like]  # DCP flattens it; a list of plain values is one item
    return torch.empty_like(like) if isinstance(like, torch.Tensor) else None


def _load(step_dir: Path, like: dict) -> dict:
    got = _empty(like)
    dcp.load(got, checkpoint_id=str(step_dir))
    # DCP loads a non-tensor under the key made a string ("0"), tensors in place (0):
    state = got["optim"]["state"]
    state[0].update(state.pop("0", {}))
    return got


def test_a_resaved_file_is_byte_for_byte_the_file_dcp_plans(tmp_path):
    stager, resaver = Stager(), Resaver()
    _persist(tmp_path / "a", 255, stager.stage(_state(255, "x")), stager, resaver)
    assert resaver.generation == 1 and resaver.layout is not None
    for step, note in [(256, "x"), (70000, "a longer note than before"), (70001, "")]:
        live = _state(step, note)
        staged = stager.stage(live)
        _persist(tmp_path / "a", step, staged, stager, resaver)
        assert resaver.generation == 1  # laid out from the first save's plan, not planned again
        # The same staged state saved by a planner that has seen nothing before:
        _persist(tmp_path / "b", step, staged, stager, Resaver())
        a, b = tmp_path / "a" / f"step-{step:010d}", tmp_path / "b" / f"step-{step:010d}"
        for name in ("__0_0.distcp", ".metadata"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (step, name)
        assert_bitwise_equal(_load(a, live), live, f"step {step}")


def test_an_unchanged_object_is_not_pickled_again_and_a_changed_one_is(tmp_path, monkeypatch):
    import ckpt.save.resave

    saved: list = []
    real = torch.save

    def counting(obj, f, *a, **k):
        saved.append(obj)
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.save.resave.torch, "save", counting)
    stager, resaver = Stager(), Resaver()
    groups = {"lr": 0.1, "betas": (0.9, 0.999), "names": ["w", "b"], "opt": {"eps": 1e-8}}
    live = {**_state(1, "same"), "groups": groups, "numpy": np.float64(2.0)}
    _persist(tmp_path, 1, stager.stage(live), stager, resaver)  # planned by DCP
    for step, lr in [(2, 0.1), (3, 0.1), (4, 0.05), (5, -0.0), (6, 0.0)]:
        groups["lr"], saved[:] = lr, []
        live = {**_state(step, "same"), "groups": groups, "numpy": np.float64(2.0)}
        _persist(tmp_path, step, stager.stage(live), stager, resaver)
        assert resaver.generation == 1
        if step > 2:  # (the first resave pickles every object)
            # Pickled again: what changed since the last save (the step, the state's lr and
            # count, the history, the group's lr from 3 on) and what is not of plain types (a
            # numpy scalar); never the note, the betas, the names, the eps.
            changed = [step, step, 0.1 / step, list(range(step % 5)), np.float64(2.0)] + ([lr] if step > 3 else [])
            assert sorted(map(repr, saved)) == sorted(map(repr, changed)), saved
        _persist(tmp_path / "fresh", step, stager.stage(live), stager, Resaver())
        for name in ("__0_0.distcp", ".metadata"):  # the bytes a fresh plan writes
            assert (tmp_path / f"step-{step:010d}" / name).read_bytes() == (tmp_path / "fresh" / f"step-{step:010d}" / name).read_bytes()
        assert_bitwise_equal(_load(tmp_path / f"step-{step:010d}", live), live, f"step {step}")


@pytest.mark.parametrize("change", ["new key", "new shape", "new dtype", "None to tensor", "list gains a tensor", "list gains a dict"])
def test_a_state_that_changes_shape_is_planned_afresh_and_loads(tmp_path, change):
    stager, resaver = Stager(), Resaver()
    live = _state(1, "x")
    live["opt"], live["names"] = None, ["a", 1, 2.0, None]
    _persist(tmp_path, 1, stager.stage(live), stager, resaver)
    live = _state(2, "x")
    live["opt"], live["names"] = None, ["a", 1, 2.0, None]
    if change == "new key":
        live["model"]["extra"] = torch.arange(5)
    elif change == "new shape":
        live["model"]["b"] = torch.randn(8).half()
    elif change == "new dtype":
        live["model"]["b"] = live["model"]["b"].float()
    elif change == "list gains a tensor":  # a list of plain values is one pickled item; with a tensor, one item each
        live["names"] = ["a", 1, 2.0, torch.ones(3)]
    elif change == "list gains a dict":
        live["names"] = ["a", 1, 2.0, {"k": torch.ones(2)}]
    else:
        live["opt"] = torch.ones(3)
    _persist(tmp_path, 2, stager.stage(live), stager, resaver)
    assert resaver.generation == 2
    assert_bitwise_equal(_load(tmp_path / "step-0000000002", live), live)


def test_two_ranks_resave_replan_when_one_rank_changes_and_fail_together(tmp_path):
    """Rank 1's writer dies in a resave (step 3): the save fails on both ranks and commits
    nothing; rank 1 alone gains a tensor at step 5: both ranks plan step 5 afresh; rank 0
    refuses step 7 (committed by another job): the save fails on both ranks."""
    root = tmp_path / "root"
    codes = launch.run(2, launch.WORKERS / "resave_worker.py", str(root), str(tmp_path), env={"CKPT_FAULT": "writer_process:1:3"},
                       log_dir=tmp_path, timeout=240)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(2))
    assert codes == [0, 0], logs
    committed = sorted(int(p.parent.name[5:]) for p in root.glob("step-*/manifest.json"))
    assert committed == [1, 2, 4, 5, 6, 7], logs  # 7: another job's, as the worker made it
    # Step 7: rank 0 refused to write over it; both ranks' saves failed with its reason.
    assert [p.name for p in (root / "step-0000000007").iterdir()] == ["manifest.json"]
    for r in range(2):
        assert (tmp_path / f"last{r}.txt").read_text() == "6"
        assert "step-0000000007 is already committed; not overwriting it" in (tmp_path / f"rank{r}.log").read_text(), r
    for r in range(2):
        gens = (tmp_path / f"generations{r}.txt").read_text().split()
        # planned at 1; resaved at 2; 3 failed (forgets its layout); planned at 4 and 5 (shape); resaved at 6
        assert gens == ["1", "1", "1", "2", "3", "3"], (r, gens)
    for step in (2, 4, 5, 6):
        want = torch.load(tmp_path / f"want{step}.pt")
        got = {k: torch.empty_like(v) for k, v in want.items()}
        dcp.load(got, checkpoint_id=str(root / f"step-{step:010d}"))  # one process reads both ranks' files
        assert_bitwise_equal(got, want, f"step {step}")
