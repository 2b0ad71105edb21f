"""frozen="skip": a fine-tune's frozen base (parameters that do not require grad) is in no
checkpoint, the job loads it itself, and everything else resumes exactly: under FSDP2 and
FSDP1 on 2 ranks (bitwise against an uninterrupted run, and 2 -> 1 into a plain module), a
plain module switching between "save" and "skip" across a restart, and a parameter frozen or
unfrozen between saves (a value a checkpoint holds is always restored, frozen or not).
DeepSpeed's frozen parameters: tests/system/test_deepspeed.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.capture.state import TrainingState
from ckpt.storage.store import step_dir_name
from tests.support.compare import assert_bitwise_equal, bits_equal
from tests.support.jobs import assert_same_training_state, dumps, rank_logs, train
from tests.support.launch import run_worker
from tests.support.toy_model import build

FROZEN = ("0.weight", "0.bias")


def keys_saved(root: Path, step: int) -> set[str]:
    """The keys DCP wrote in a checkpoint (its .metadata: a test's own files)."""
    return set(dcp.FileSystemReader(str(root / step_dir_name(step))).read_metadata().state_dict_metadata)


def base(seed: int) -> dict[str, torch.Tensor]:
    """The frozen layer's values as a job that loads base `seed` has them."""
    model = build("plain", 1, frozen_seed=seed)
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in FROZEN}


@pytest.mark.parametrize("mode", ["fsdp2", "fsdp1"])
def test_a_skip_checkpoint_holds_no_frozen_parameter_and_resumes_bitwise_and_on_one_rank(tmp_path, mode):
    common = ("--mode", mode, "--every", 2, "--frozen", "skip", "--frozen-seed", 1)
    for name in ("ref", "first", "resumed", "alone"):
        (tmp_path / name).mkdir()
    train(tmp_path / "ref", *common, "--root", tmp_path / "ref-root", "--steps", 8, "--out", tmp_path / "ref" / "out")
    train(tmp_path / "first", *common, "--root", tmp_path / "root", "--steps", 4, "--no-save-on-exit", "--out", tmp_path / "first" / "out")
    saved = keys_saved(tmp_path / "root", 4)
    assert not {f"model.{n}" for n in FROZEN} & saved, sorted(saved)
    assert {"model.2.weight", "model.4.bias", "optim.state.2.weight.exp_avg"} <= saved
    assert not any(k.startswith("optim.state.0.") for k in saved)  # no step ever gave them state
    shutil.copytree(tmp_path / "root", tmp_path / "copy")

    # The same world size, the same base: the run goes on exactly as if never stopped.
    train(tmp_path / "resumed", *common, "--root", tmp_path / "root", "--steps", 8, "--out", tmp_path / "resumed" / "out")
    resumed, ref = dumps(tmp_path / "resumed" / "out"), dumps(tmp_path / "ref" / "out")
    assert [d["restored_step"] for d in resumed] == [4, 4]
    assert_same_training_state(resumed, ref)

    # 2 -> 1, into a plain module whose job loaded another base: the trained state is the
    # checkpoint's, the frozen layer what the job loaded (the checkpoint has none of it).
    log_dir = tmp_path / "alone"
    run_worker(1, "--mode", "plain", "--frozen", "skip", "--frozen-seed", "2", "--root", str(tmp_path / "copy"),
               "--steps", "4", "--out", str(log_dir / "out"), log_dir=log_dir)  # fmt: skip
    alone = torch.load(log_dir / "out.rank0.pt", weights_only=True)
    first = dumps(tmp_path / "first" / "out")[0]
    assert alone["restored_step"] == 4
    want = {k: v for k, v in first["model"].items() if k not in FROZEN}
    assert_bitwise_equal({k: v for k, v in alone["model"].items() if k not in FROZEN}, want, "trained")
    assert_bitwise_equal({k: alone["model"][k] for k in FROZEN}, base(2), "frozen")
    assert_bitwise_equal(alone["optim"]["state"], first["optim"]["state"], "optimizer state")
    logs = rank_logs(log_dir)
    assert "this checkpoint holds no value for 2 frozen parameter(s) (0.bias, 0.weight): they keep the values they have" in logs, logs
    assert "do not ask for" not in logs


def _train(model, opt, cp, steps: int) -> None:
    for _ in range(cp.step, steps):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cp.step_done()


def _job(root: Path, frozen: str, seed: int, steps: int, caplog) -> tuple[torch.nn.Module, torch.optim.Optimizer, ckpt.Checkpointer]:
    torch.manual_seed(0)
    model = build("plain", 1, frozen_seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    caplog.clear()
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=2), frozen=frozen,
                           save_on_exit=False, handle_sigterm=False) as cp:  # fmt: skip
        _train(model, opt, cp, steps)
    return model, opt, cp


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_restart_may_switch_between_save_and_skip(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    # Saved with "save", restored with "skip" by a job that loaded another base: what the
    # checkpoint holds is restored, the base too (the run resumes exactly as it was).
    first, _, _ = _job(tmp_path / "a", "save", 1, 2, caplog)
    assert {f"model.{n}" for n in FROZEN} <= keys_saved(tmp_path / "a", 2)
    model, _, cp = _job(tmp_path / "a", "skip", 2, 2, caplog)
    assert cp.restored_step == 2
    assert_bitwise_equal(_values(model), _values(first), "restored")
    assert "frozen parameter" not in caplog.text and "do not ask for" not in caplog.text
    # Saved with "skip", restored with "save": the base keeps the job's values, and it is said.
    first, _, _ = _job(tmp_path / "b", "skip", 1, 2, caplog)
    model, _, cp = _job(tmp_path / "b", "save", 2, 2, caplog)
    assert cp.restored_step == 2
    got, saved = _values(model), _values(first)
    assert_bitwise_equal({n: got[n] for n in FROZEN}, base(2), "frozen")
    assert all(bits_equal(got[n], saved[n]) for n in got if n not in FROZEN)
    assert "holds no value for 2 frozen parameter(s) (0.bias, 0.weight; saved with frozen='skip'" in caplog.text


def test_a_trained_parameter_missing_from_a_checkpoint_still_fails_the_restore(tmp_path, caplog):
    """Only frozen parameters may be absent: a layer trained now and frozen at the save (so
    not in the checkpoint) is a missing key, never silently left as the job initialized it."""
    _job(tmp_path, "skip", 1, 2, caplog)
    model = build("plain", 1)  # the first layer trains now
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ckpt.RestoreFailed, match=r"model\.0\.(weight|bias)"):
        with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, handle_sigterm=False, frozen="skip"):
            pass


def test_freezing_or_unfreezing_between_saves_changes_what_the_next_capture_holds():
    model = build("plain", 1, frozen_seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = TrainingState.of(model, opt, None, None, None, frozen="skip")
    assert not {n for n in FROZEN} & set(state.capture({"step": 0}, 0)["model"])
    assert set(state.capture({"step": 0}, 0)["model"]) == {"2.weight", "2.bias", "4.weight", "4.bias", "5.calls"}  # a buffer: never frozen
    model[0].weight.requires_grad_(True)  # unfrozen: from now on trained, so saved
    assert "0.weight" in state.capture({"step": 0}, 0)["model"]
    model[2].bias.requires_grad_(False)
    assert "2.bias" not in state.capture({"step": 0}, 0)["model"]
    with pytest.raises(ValueError, match="frozen must be 'save'"):
        ckpt.Checkpointer("unused", model=model, frozen="none")


def test_a_layer_unfrozen_mid_run_is_saved_from_then_on_and_restored(tmp_path, caplog):
    """The saves' cached plans and state dicts follow a parameter that starts to train."""
    torch.manual_seed(0)
    model = build("plain", 1, frozen_seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=ckpt.Every(steps=2), frozen="skip",
                           keep=ckpt.Keep(last=5), save_on_exit=False, handle_sigterm=False) as cp:  # fmt: skip
        _train(model, opt, cp, 4)
        cp.wait()
        model[0].requires_grad_(True)
        _train(model, opt, cp, 8)
    assert "model.0.weight" not in keys_saved(tmp_path, 4)
    assert {"model.0.weight", "model.0.bias", "optim.state.0.weight.exp_avg"} <= keys_saved(tmp_path, 8)
    trained = _values(model)
    # A restart whose job freezes that layer again at first (as the run began): the trained
    # values the checkpoint holds are restored, never the job's base silently kept.
    for fresh in (build("plain", 1, seed=7), build("plain", 1, seed=7, frozen_seed=2)):
        with ckpt.Checkpointer(str(tmp_path), model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                               interval=None, frozen="skip", save_on_exit=False, handle_sigterm=False) as cp:  # fmt: skip
            assert cp.restored_step == 8
        assert_bitwise_equal(_values(fresh), trained, "restored")
