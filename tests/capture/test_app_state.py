"""`Checkpointer(app_state=...)`: a state dict saved at the top level, keys as the object names
them, so that a tool reading plain DCP finds its own layout (torchtitan:
tests/integrations/test_torchtitan.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.capture.state import TrainingState


class App:
    """A model's keys at the top level, its optimizer and a counter under names of their own."""

    def __init__(self, seed: int, keys: dict[str, Any] | None = None) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 2)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(4, 3)).sum().backward()
        self.opt.step()
        self.step = seed
        self.keys = keys or {}

    def state_dict(self) -> dict[str, Any]:
        return {**self.model.state_dict(), "optimizer": self.opt.state_dict(), "train_state": {"step": self.step}, **self.keys}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict({k: sd[k] for k in ("weight", "bias")})
        self.opt.load_state_dict(sd["optimizer"])
        self.step = sd["train_state"]["step"]


def test_an_app_state_restores_and_plain_dcp_reads_it_under_its_own_keys(tmp_path):
    saved = App(1)
    with ckpt.Checkpointer(str(tmp_path), app_state=saved, interval=None, lease=None) as cp:
        cp.save(blocking=True)
    fresh = App(2)
    with ckpt.Checkpointer(str(tmp_path), app_state=fresh, interval=None, lease=None, save_on_exit=False) as cp:
        assert cp.restored_step == 0
    assert fresh.step == 1 and torch.equal(fresh.model.weight, saved.model.weight)
    assert torch.equal(fresh.opt.state_dict()["state"][0]["exp_avg"], saved.opt.state_dict()["state"][0]["exp_avg"])
    plain = {"weight": torch.zeros(2, 3), "train_state": {"step": 0}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "step-0000000000"), no_dist=True)
    assert torch.equal(plain["weight"], saved.model.weight) and plain["train_state"]["step"] == 1


@pytest.mark.parametrize("key", ["rng", "counters", "model.weight", "extra"])
def test_an_app_state_key_of_ckpts_own_is_refused_before_anything_is_written(tmp_path, key):
    with pytest.raises(ValueError, match="ckpt's own"):
        with ckpt.Checkpointer(str(tmp_path), app_state=App(1, {key: 1}), interval=None, lease=None) as cp:
            cp.save(blocking=True)
    assert not list(tmp_path.glob("step-*/manifest.json"))


def test_an_app_state_without_load_state_dict_is_refused_at_once(tmp_path):
    with pytest.raises(TypeError, match="app_state"):
        ckpt.Checkpointer(str(tmp_path), app_state=torch.nn.Linear(2, 2).state_dict(), lease=None)


def test_the_keys_an_app_state_leaves_out_on_another_world_size_are_not_asked_for():
    class PerRank(App):
        def skip_on_restore(self, same_world: bool) -> tuple[str, ...]:
            return () if same_world else ("train_state",)

    state = TrainingState.of(None, None, None, None, None, app=PerRank(1))
    assert "train_state" in state.fit_template(state.template(0), 0, 2, 2)
    assert "train_state" not in state.fit_template(state.template(0), 0, 1, 2)
