"""Capture reuses DCP's state dicts between saves only while they are still the right answer.

Each check compares what a save captures with a fresh `get_state_dict` of the same objects
at the same moment: values, structure and optimizer hyperparameters.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckpt.capture.state import TrainingState
from tests.support.compare import assert_bitwise_equal


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched, TrainingState.of(model, opt, sched, None, None)


def _step(model, opt, sched) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _fresh(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _check(state: TrainingState, model, opt) -> dict:
    got = state.capture({"step": 0}, 0)
    want = _fresh(model, opt)
    assert_bitwise_equal({k: got[k] for k in want}, want, "capture")
    return got


def test_a_reused_capture_equals_a_fresh_one_as_training_and_the_lr_schedule_go_on():
    model, opt, sched, state = _setup()
    _step(model, opt, sched)
    first = _check(state, model, opt)
    for _ in range(3):
        _step(model, opt, sched)
        again = _check(state, model, opt)
        assert again["model"] is first["model"]  # reused, not recomputed
        assert again["optim"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


def test_a_replaced_parameter_or_a_new_optimizer_state_entry_is_captured_anew():
    model, opt, sched, state = _setup()
    _check(state, model, opt)  # before any step (DCP creates the optimizer state)
    _step(model, opt, sched)
    second = _check(state, model, opt)
    opt.state[model[0].weight]["extra"] = torch.ones(3)  # an optimizer state entry appears
    assert _check(state, model, opt)["model"] is not second["model"]
    model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # a new storage
    third = _check(state, model, opt)
    assert torch.equal(third["model"]["0.weight"], torch.full_like(model[0].weight, 7.0))


def test_a_model_with_unknown_state_dict_hooks_is_always_captured_anew():
    model, opt, sched, state = _setup()
    model[0].register_state_dict_pre_hook(lambda *a, **k: None)
    _step(model, opt, sched)
    first = _check(state, model, opt)
    _step(model, opt, sched)
    assert _check(state, model, opt)["model"] is not first["model"]


class Scaled(torch.nn.Linear):
    """A module whose state dict is not its tensors as they are (a quantized module, say)."""

    scale = 1.0

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"] * self.scale


def test_a_module_that_makes_its_own_state_dict_is_always_captured_anew():
    model = torch.nn.Sequential(Scaled(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState.of(model, opt, None, None, None)
    state.capture({"step": 0}, 0)
    model[0].scale = 0.5  # changes the state dict, not a single tensor
    got = state.capture({"step": 0}, 0)
    assert torch.equal(got["model"]["0.weight"], model[0].weight.detach() * 0.5)


def test_a_tensor_changed_in_place_in_shape_stride_or_dtype_is_captured_anew():
    model, opt, sched, state = _setup()
    _step(model, opt, sched)
    _check(state, model, opt)
    w = model[2].weight  # 4 x 16: a transpose keeps the storage, changes shape and strides
    w.data = w.data.t()
    _check(state, model, opt)
    v = model[1].running_var  # the same storage read as another dtype of the same size
    v.data = v.data.view(torch.int32)
    assert _check(state, model, opt)["model"]["1.running_var"].dtype == torch.int32
    opt.state[model[0].weight]["exp_avg"].resize_(2, 2)  # an optimizer state tensor, in place
    _check(state, model, opt)
    opt.state[model[0].weight]["note"] = 1  # a new non-tensor value, then a changed one
    _check(state, model, opt)
    opt.state[model[0].weight]["note"] = 2
    assert _check(state, model, opt)["optim"]["state"]["0.weight"]["note"] == 2


def test_only_parameters_and_optimizer_state_are_copied_after_the_loop_goes_on():
    model, opt, sched, state = _setup()
    _step(model, opt, sched)
    defer = state.deferrable()  # asked before capture, as a save does: it reads capture's walk
    got = state.capture({"step": 0}, 0)
    assert defer(("model", "0.weight"), got["model"]["0.weight"])
    assert defer(("optim", "state", "0.weight", "exp_avg"), got["optim"]["state"]["0.weight"]["exp_avg"])
    # BatchNorm's statistics change in forward: copied at once, before the loop goes on
    assert not defer(("model", "1.running_mean"), got["model"]["1.running_mean"])
    assert not defer(("extra", "x"), torch.ones(2))


# -- restore: the model's half of set_state_dict is skipped only when it would copy each
# tensor onto itself ----------------------------------------------------------------------


class _CountingLoad(torch.nn.Linear):
    """A module whose loading does more than copy (here: counts)."""

    loads = 0

    def _load_from_state_dict(self, *args, **kwargs):
        type(self).loads += 1
        super()._load_from_state_dict(*args, **kwargs)


def _restore_through_checkpointer(tmp_path, model, monkeypatch, opt=None) -> list[bool | str]:
    """Save `model` (trained a step), train it on and change its learning rate, restore it
    in place with a new Checkpointer; the restored values, optimizer state and optimizer
    hyperparameters must be the saved ones. Returns, per set_state_dict call of the
    restore, whether it was given the model's values, and "optimizer in place" where only
    the optimizer's hyperparameters were set (its state was loaded in place)."""
    import ckpt
    import ckpt.capture.state

    opt = opt or torch.optim.AdamW(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        cp.step_done()
        cp.save(blocking=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    train()
    opt.param_groups[0]["lr"] = 0.05
    if "betas" in opt.param_groups[0]:
        opt.param_groups[0]["betas"] = (0.5, 0.5)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    calls: list[bool | str] = []
    real, real_groups = ckpt.capture.state.set_state_dict, ckpt.capture.state._load_hyperparameters

    def spy(model, optimizers, *, model_state_dict, optim_state_dict):
        calls.append(bool(model_state_dict))
        return real(model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict)

    def spy_groups(optimizers, groups):
        calls.append("optimizer in place")
        return real_groups(optimizers, groups)

    monkeypatch.setattr(ckpt.capture.state, "set_state_dict", spy)
    monkeypatch.setattr(ckpt.capture.state, "_load_hyperparameters", spy_groups)
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        assert cp.restored_step == 1
    assert_bitwise_equal(model.state_dict(), saved, "model")
    assert_bitwise_equal({(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items()}, saved_opt, "optimizer")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == saved_groups
    assert opt.param_groups[0]["params"] == list(model.parameters())
    return calls


def test_a_restore_loaded_into_the_live_tensors_does_not_load_the_model_again(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert _restore_through_checkpointer(tmp_path, model, monkeypatch) == ["optimizer in place"]


class _CountingOptimizer(torch.optim.AdamW):
    """An optimizer whose loading does more than DCP's in-place copy (here: counts)."""

    loads = 0

    def load_state_dict(self, state_dict):
        type(self).loads += 1
        super().load_state_dict(state_dict)


def test_an_optimizer_that_does_more_on_load_than_copy_is_loaded_through_it(tmp_path, monkeypatch):
    """The optimizer's half of set_state_dict is skipped only when it would copy each state
    tensor onto itself and set the groups' values: an overridden `load_state_dict`, a load
    hook, or a state value that is no tensor (loaded as a value, not in place) goes through
    the optimizer's own loading."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    m = model()
    _CountingOptimizer.loads = 0
    calls = _restore_through_checkpointer(tmp_path / "override", m, monkeypatch, _CountingOptimizer(m.parameters(), lr=0.1))
    assert calls == [False] and _CountingOptimizer.loads == 1

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    seen = []
    opt.register_load_state_dict_post_hook(lambda o: seen.append(o))
    assert _restore_through_checkpointer(tmp_path / "hook", m, monkeypatch, opt) == [False]
    assert seen == [opt]

    m = model()  # SGD with momentum 0 keeps a momentum_buffer of None: a value, not a tensor
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    assert _restore_through_checkpointer(tmp_path / "sgd", m, monkeypatch, sgd) == [False]


def test_a_model_that_does_more_on_load_than_copy_is_loaded_through_it(tmp_path, monkeypatch):
    """An overridden `_load_from_state_dict` (ours, or BatchNorm's), or a load hook, must run
    on restore: the model's values go through `load_state_dict`."""
    torch.manual_seed(0)
    _CountingLoad.loads = 0
    counting = torch.nn.Sequential(_CountingLoad(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert _restore_through_checkpointer(tmp_path / "override", counting, monkeypatch) == [True]
    assert _CountingLoad.loads == 1

    hooked = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    seen = []
    hooked[2].register_load_state_dict_post_hook(lambda module, keys: seen.append(module))
    assert _restore_through_checkpointer(tmp_path / "hook", hooked, monkeypatch) == [True]
    assert seen == [hooked[2]]

    bn = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    assert _restore_through_checkpointer(tmp_path / "batchnorm", bn, monkeypatch) == [True]


class _LazyEma:
    """An EMA whose shadow weights appear at its first update, as many do."""

    def __init__(self) -> None:
        self.shadow: dict[str, torch.Tensor] = {}
        self.decay = 0.99

    def state_dict(self) -> dict:
        return {"shadow": dict(self.shadow), "decay": self.decay}

    def load_state_dict(self, sd: dict) -> None:
        self.shadow, self.decay = dict(sd["shadow"]), sd["decay"]


def test_values_saved_that_the_fresh_objects_do_not_ask_for_are_named_not_dropped_silently(tmp_path, caplog):
    import logging

    import ckpt

    model = torch.nn.Linear(2, 2)
    ema = _LazyEma()
    with ckpt.Checkpointer(str(tmp_path), model=model, extra={"ema": ema}, interval=None) as cp:
        ema.shadow["w"] = torch.ones(3)
        cp.save(blocking=True)
    caplog.set_level(logging.WARNING, logger="ckpt")
    fresh = _LazyEma()
    with ckpt.Checkpointer(str(tmp_path), model=torch.nn.Linear(2, 2), extra={"ema": fresh}, interval=None) as cp:
        assert cp.restored_step == 0
    assert "holds values that this job's objects do not ask for, left unrestored: extra.ema.shadow.w" in caplog.text
    caplog.clear()
    ready = _LazyEma()
    ready.shadow["w"] = torch.zeros(3)  # built before the restore: restored, nothing to say
    with ckpt.Checkpointer(str(tmp_path), model=torch.nn.Linear(2, 2), extra={"ema": ready}, interval=None):
        pass
    assert torch.equal(ready.shadow["w"], torch.ones(3)) and "left unrestored" not in caplog.text


def test_a_checkpoint_without_the_cuda_rng_stream_this_process_has_restores_and_leaves_it(tmp_path, monkeypatch, caplog):
    """A rank saves its current CUDA device's stream, if CUDA is in use. A checkpoint saved
    where it was not (the model was still on the CPU) lacks it; a restarted process that has
    one restores everything else and leaves that stream as it is, rather than failing the
    restore with no fallback ("Missing key"). One that an earlier ckpt saved with a stream per
    device index restores too, saying that its CUDA stream is not restored."""
    import logging

    import ckpt
    import ckpt.capture.state as capture

    real = capture.rng_state
    stands_for_cuda = torch.arange(16, dtype=torch.uint8)  # a CUDA generator's state, here on the CPU
    caplog.set_level(logging.WARNING, logger="ckpt")
    for name, saved_with in (("no-cuda", {}), ("by-index", {"cuda": {"0": stands_for_cuda + 1}})):
        monkeypatch.setattr(capture, "rng_state", lambda extra=saved_with: {**real(), **extra})
        with ckpt.Checkpointer(str(tmp_path / name), model=torch.nn.Linear(2, 2), interval=None) as cp:
            torch.manual_seed(5)
            cp.save(blocking=True)
            after_save = torch.rand(3)
        monkeypatch.setattr(capture, "rng_state", lambda: {**real(), capture.CUDA_RNG: stands_for_cuda.clone()})
        torch.manual_seed(99)
        caplog.clear()
        with ckpt.Checkpointer(str(tmp_path / name), model=torch.nn.Linear(2, 2), interval=None) as cp:
            assert cp.restored_step == 0
            assert torch.equal(torch.rand(3), after_save)  # the CPU stream is the saved one
        assert ("CUDA RNG streams by device index" in caplog.text) == (name == "by-index"), caplog.text
