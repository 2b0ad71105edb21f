"""A restore's optimizer state is made as the first step would make it, without the step.

Each case builds the same model and optimizer twice: one gets its state from DCP's own way
(`_init_optim_state`: a step with zero gradients and learning rate), the other from
`init_state`. The two must hold the same entries, with the same shapes, dtypes, devices and
layouts (FSDP2's DTensors on 2 ranks included), and the parameters must be left as they were.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

import ckpt
from ckpt.capture.optim_init import init_state
from tests.support import launch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    model[1].bias.requires_grad_(False)  # a frozen parameter gets no state either way
    return model


def _layout(value: object) -> object:
    if isinstance(value, torch.Tensor):
        placements = tuple(map(str, getattr(value, "placements", ())))
        local = tuple(value.to_local().shape) if placements else ()
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, placements, local)
    return type(value).__name__


def _states(opt: torch.optim.Optimizer) -> list[dict[str, object]]:
    return [{k: _layout(v) for k, v in opt.state[p].items()} if p in opt.state else {} for g in opt.param_groups for p in g["params"]]


OPTIMIZERS = [
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.1), id="Adam"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, foreach=True), id="Adam-amsgrad-foreach"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1), id="AdamW"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1), foreach=False), id="AdamW-tensor-lr"),
    pytest.param(lambda ps: torch.optim.Adamax(ps), id="Adamax"),
    pytest.param(lambda ps: torch.optim.NAdam(ps, decoupled_weight_decay=True), id="NAdam"),
    pytest.param(lambda ps: torch.optim.RAdam(ps), id="RAdam"),
    pytest.param(lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True), id="RMSprop-centered"),
    pytest.param(lambda ps: torch.optim.Adadelta(ps), id="Adadelta"),
    pytest.param(lambda ps: torch.optim.ASGD(ps), id="ASGD"),
    pytest.param(lambda ps: torch.optim.Rprop(ps), id="Rprop"),
    pytest.param(lambda ps: _QuietAdamW(ps), id="a subclass with other defaults"),
]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_the_state_made_without_a_step_is_laid_out_as_the_steps(make):
    by_step, model = make(_model().parameters()), _model()
    ours = make(model.parameters())
    _init_optim_state(by_step)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert init_state(ours)
    assert _states(ours) == _states(by_step)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no update
    assert all(p.grad is None for p in model.parameters())
    assert ours.param_groups[0]["lr"] == by_step.param_groups[0]["lr"]


class _MyAdamW(torch.optim.AdamW):
    """A subclass may make more state in its own step: left to DCP's."""

    def step(self, closure=None):
        loss = super().step(closure)
        for p in (p for g in self.param_groups for p in g["params"] if p in self.state):
            self.state[p]["seen"] = self.state[p].get("seen", 0) + 1
        return loss


class _GroupedAdam(torch.optim.Adam):
    """A subclass that makes its state its own way in `_init_group`: left to DCP's."""

    def _init_group(self, group, *lists):
        return super()._init_group(group, *lists)


class _CountingSGD(torch.optim.Optimizer):
    """An optimizer of its own: a step count and a momentum in its state, made by its step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                st = self.state[p]
                st["n"] = st.get("n", torch.tensor(0.0)) + 1
                buf = st.setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] / float(st["n"]))


class _QuietAdamW(torch.optim.AdamW):
    """A subclass that only sets other defaults: its step and state are AdamW's."""

    def __init__(self, params, lr=3e-4):
        super().__init__(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize(
    "case",
    ["SGD with momentum", "Adagrad", "a subclass", "a subclass making its state", "state already made", "gradients already there", "a step pre-hook", "step replaced"],
)
def test_other_optimizers_are_left_to_dcps_step(case):
    model = _model()
    opt = {
        "SGD with momentum": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "Adagrad": lambda: torch.optim.Adagrad(model.parameters()),
        "a subclass": lambda: _MyAdamW(model.parameters()),
        "a subclass making its state": lambda: _GroupedAdam(model.parameters()),
    }.get(case, lambda: torch.optim.AdamW(model.parameters()))()
    if case == "state already made":
        _init_optim_state(opt)
    if case == "gradients already there":
        model(torch.randn(2, 6)).sum().backward()
    if case == "a step pre-hook":
        opt.register_step_pre_hook(lambda *_: None)
    if case == "step replaced":
        _wrapped(opt)
    was = _states(opt)
    assert not init_state(opt)
    assert _states(opt) == was


def _save_and_restore(root, make=lambda ps: torch.optim.AdamW(ps), extend=lambda opt: None):
    """A save after a step, then a restore into fresh objects; the optimizer's state saved
    and restored, a dict per parameter."""
    model = _model()
    opt = make(model.parameters())
    extend(opt)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=None, handle_sigterm=False) as cp:
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        cp.save(blocking=True)
    want = [dict(opt.state[p]) for p in model.parameters() if p in opt.state]
    model = _model()
    opt = make(model.parameters())
    extend(opt)
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=None, handle_sigterm=False, save_on_exit=False) as cp:
        assert cp.restored_step == 0
    return want, [dict(opt.state[p]) for p in model.parameters() if p in opt.state]


def _same(want, got) -> None:
    assert [sorted(w) for w in want] == [sorted(g) for g in got]
    assert all(torch.equal(w[k], g[k]) for w, g in zip(want, got, strict=True) for k in w)


def test_a_restore_takes_no_optimizer_step(tmp_path, monkeypatch):
    steps = []
    real = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):  # the class's own step, counted (a hook would be one more)
        steps.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    want, got = _save_and_restore(tmp_path)
    assert steps == [1]  # the save's training step, and none at the restore
    _same(want, got)


def _ema(opt, *_):
    """State a step hook keeps in the optimizer's state: an EMA of the weights."""
    for p in (p for g in opt.param_groups for p in g["params"] if p.requires_grad):
        st = opt.state[p]
        st["ema"] = p.detach().clone() if "ema" not in st else st["ema"].lerp_(p.detach(), 0.1)


def _wrapped(opt) -> None:
    step = opt.step

    def step_and_ema(*args, **kwargs):
        out = step(*args, **kwargs)
        _ema(opt)
        return out

    opt.step = step_and_ema


@pytest.mark.parametrize(
    "extend",
    [
        pytest.param(lambda opt: opt.register_step_post_hook(_ema), id="its-post-hook"),
        pytest.param(_wrapped, id="step-replaced"),
        pytest.param(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1), id="an-lr-scheduler"),
    ],
)
def test_state_a_step_hook_or_wrapper_keeps_is_restored(tmp_path, extend):
    want, got = _save_and_restore(tmp_path, extend=extend)
    _same(want, got)


def test_state_a_global_step_hook_keeps_is_restored(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(_ema)
    try:
        want, got = _save_and_restore(tmp_path)
    finally:
        handle.remove()
    assert all("ema" in w for w in want)
    _same(want, got)


FSDP2 = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from ckpt.capture.optim_init import init_state
    from tests.capture.test_optim_init import _model, _states
    dist.init_process_group("gloo")
    for name, kw in [("AdamW", {"foreach": True}), ("AdamW", {"foreach": False}), ("NAdam", {}), ("RMSprop", {"momentum": 0.9})]:
        got = []
        for make in (_init_optim_state, init_state):
            model = _model()
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            opt = getattr(torch.optim, name)(model.parameters(), **kw)
            make(opt)
            got.append(_states(opt))
        assert got[0] == got[1], (name, kw, got)
        assert "S(0)" in str(got[1]), got[1]  # DTensors, laid out as the parameters
    dist.destroy_process_group()
""")


def test_fsdp2_dtensor_state_is_laid_out_as_the_steps(tmp_path):
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2)
    codes = launch.run(2, script, log_dir=tmp_path)
    assert codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.1), id="Adam"),
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True), id="AdamW-amsgrad"),
        pytest.param(lambda ps: torch.optim.NAdam(ps, lr=0.1), id="NAdam"),
        pytest.param(lambda ps: torch.optim.RMSprop(ps, lr=0.1, centered=True, momentum=0.5), id="RMSprop"),
        pytest.param(lambda ps: _QuietAdamW(ps, lr=0.1), id="a subclass with other defaults"),
        pytest.param(lambda ps: _MyAdamW(ps, lr=0.1), id="a subclass with its own step"),
        pytest.param(lambda ps: _CountingSGD(ps), id="an optimizer of its own"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5), id="SGD-dampening"),
    ],
)
def test_a_save_before_the_first_step_leaves_the_training_as_it_would_have_been(tmp_path, make):
    """DCP's state-dict API made an empty optimizer's state by a step of zeros, which a save
    left in the training (Adam's count one ahead: every later update another). The
    Checkpointer's own step hook (it waits for the staging copies) keeps no state."""

    def train(save: bool) -> list[torch.Tensor]:
        model = _model()
        opt = make(model.parameters())
        with ckpt.Checkpointer(tmp_path / str(save), model=model, optimizer=opt, interval=None, handle_sigterm=False, save_on_exit=False) as cp:
            if save:
                cp.save(blocking=True)
            for i in range(3):
                torch.manual_seed(i)
                model(torch.randn(2, 6)).sum().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False), strict=True))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.1), id="AdamW"),
        pytest.param(lambda ps: _QuietAdamW(ps, lr=0.1), id="a subclass with other defaults"),
        pytest.param(lambda ps: _CountingSGD(ps), id="an optimizer of its own"),
        pytest.param(lambda ps: _MyAdamW(ps, lr=0.1), id="a subclass with its own step"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5), id="SGD-dampening"),
    ],
)
def test_a_checkpoint_saved_before_the_first_step_resumes_as_the_run_would_have_gone_on(tmp_path, make):
    """Saved before any step, restored into fresh objects: the state made without a step
    (its count at 0) resumes as a run that never stopped; an optimizer saved with none
    resumes with none, as the run had it."""

    def train(model, opt, cp=None) -> list[torch.Tensor]:
        for i in range(3):
            torch.manual_seed(i)
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            if cp is not None:
                cp.step_done()
        return [p.detach().clone() for p in model.parameters()]

    kw = dict(interval=None, handle_sigterm=False, save_on_exit=False)
    model = _model()
    opt = make(model.parameters())
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, **kw) as cp:
        cp.save(blocking=True)
    model = _model()
    opt = make(model.parameters())
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, **kw) as cp:
        assert cp.restored_step == 0 and all(float(st["step"]) == 0 for st in opt.state.values())
        assert opt.state if isinstance(opt, torch.optim.AdamW) and not isinstance(opt, _MyAdamW) else not opt.state
        resumed = train(model, opt, cp)
    model = _model()
    assert all(torch.equal(a, b) for a, b in zip(resumed, train(model, make(model.parameters())), strict=True))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), _CountingSGD], ids=["SGD-momentum", "an optimizer of its own"])
def test_plain_dcp_reads_the_model_of_a_checkpoint_saved_before_the_first_step_and_no_optimizer_state(tmp_path, make):
    """The optimizer was saved with no state: a plain reader's fresh objects take DCP's step
    and ask for that state, and DCP names the key it lacks; a partial load gets the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = make(model.parameters())
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=None, handle_sigterm=False, save_on_exit=False) as cp:
        cp.save(blocking=True)
    assert not opt.state and all(p.grad is None for p in model.parameters())  # the live one as it was
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    msd, osd = get_state_dict(fresh, make(fresh.parameters()))
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim.state"):
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "step-0000000000")
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "step-0000000000", planner=DefaultLoadPlanner(allow_partial_load=True))
    assert all(torch.equal(msd[k], want[k]) for k in want)


class _DecayingSGD(torch.optim.Optimizer):
    """Weight decay that does not scale with the learning rate (as Adafactor's relative step)."""

    def __init__(self, params, lr=0.1, wd=0.1):
        super().__init__(params, {"lr": lr, "wd": wd})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                self.state[p]["n"] = self.state[p].get("n", 0) + 1
                p.mul_(1 - group["wd"]).add_(p.grad, alpha=-group["lr"])


def test_a_save_before_the_first_step_takes_no_step_on_the_live_optimizer(tmp_path):
    """No step hook runs and no parameter moves (DCP's step of zeros moved those an update
    that ignores the learning rate decays); a SparseAdam, whose step refuses DCP's dense zeros,
    saves too (outside review)."""
    model = _model()
    decaying = _DecayingSGD(list(model[0].parameters()))
    sgd = torch.optim.SGD(list(model[2].parameters()), lr=0.1, momentum=0.9)
    hooked = []
    sgd.register_step_post_hook(lambda *_: hooked.append(1))
    before = [p.detach().clone() for p in model.parameters()]
    with ckpt.Checkpointer(tmp_path / "a", model=model, optimizer=[decaying, sgd], interval=None, handle_sigterm=False, save_on_exit=False) as cp:
        cp.save(blocking=True)
    assert hooked == [] and not decaying.state and not sgd.state
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    sparse = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    with ckpt.Checkpointer(tmp_path / "b", model=emb, optimizer=sparse, interval=None, handle_sigterm=False, save_on_exit=False) as cp:
        cp.save(blocking=True)
    assert sparse.param_groups[0]["lr"] == 0.1 and emb.weight.grad is None and not sparse.state


def test_optimizers_given_in_another_order_get_their_own_state_back(tmp_path):
    """Which optimizer had no state at the save is known by its parameters' names, not by its
    place in the list (outside review of a marker by index)."""
    kw = dict(interval=None, handle_sigterm=False, save_on_exit=False)

    def build():
        model = _model()
        return model, torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)

    model, a, b = build()
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=[a, b], **kw) as cp:
        for i in range(3):  # only a steps: b's layer is not trained yet
            torch.manual_seed(i)
            model(torch.randn(2, 6)).sum().backward()
            a.step()
            a.zero_grad()
            b.zero_grad()
            cp.step_done()
        cp.save(blocking=True)
    saved = a.state[model[0].weight]["momentum_buffer"].clone()
    model, a, b = build()
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=[b, a], **kw) as cp:
        assert cp.restored_step == 3 and not b.state
        assert torch.equal(a.state[model[0].weight]["momentum_buffer"], saved)


SAVED_AT_ZERO = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import ckpt
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from tests.capture.test_optim_init import _model, _CountingSGD
    dist.init_process_group("gloo")
    root, rank = sys.argv[1], dist.get_rank()
    makers = {"SGD-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01),
              "an optimizer of its own": _CountingSGD}

    def built(wrap):
        model = _model()
        if wrap == "ddp":
            return DistributedDataParallel(model)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model

    def trained(wrap, model, opt, cp):
        for i in range(3):
            torch.manual_seed(100 * i + rank)
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        return [p.detach().full_tensor() if wrap == "fsdp2" else p.detach().clone() for p in model.parameters()]

    for wrap in ("fsdp2", "ddp"):
        for name, make in makers.items():
            got = []
            for save in (True, False, "resumed"):  # a save at step 0 and on; no save; resumed from that save
                model = built(wrap)
                opt = make(model.parameters())
                with ckpt.Checkpointer(f"{root}/{wrap}-{name}-{save is not False}", model=model, optimizer=opt, interval=None,
                                       handle_sigterm=False, save_on_exit=False, restore="latest" if save == "resumed" else "none") as cp:
                    if save is True:
                        cp.save(blocking=True)
                    assert not opt.state and all(p.grad is None for p in model.parameters()), (wrap, name, save)
                    assert cp.restored_step == (0 if save == "resumed" else None), (wrap, name, save)
                    got.append(trained(wrap, model, opt, cp))
            assert all(torch.equal(a, b) for run in got[1:] for a, b in zip(got[0], run, strict=True)), (wrap, name)
    dist.destroy_process_group()
""")


def test_on_fsdp2_and_ddp_a_save_before_the_first_step_leaves_an_optimizer_of_another_class_as_it_was(tmp_path):
    script = tmp_path / "saved_at_zero.py"
    script.write_text(SAVED_AT_ZERO)
    codes = launch.run(2, script, str(tmp_path / "roots"), log_dir=tmp_path, timeout=240)
    assert codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
