"""The model zoo: each kind of state a checkpoint must hold exactly as it was when
`step_done()` returned, one entry of `KINDS` each (tests/system/test_model_zoo.py runs them all,
plain and under FSDP2; a new kind is one entry here).

A kind builds a tiny model (it trains in milliseconds), draws its batches from the global
torch RNG (restored by ckpt, so a wrong RNG restore changes the run) and says how its loss
is computed. Most change state where `optimizer.step()` does not: buffers in forward, an
EMA after the step (issue 37: a save copied those after the loop went on). Under FSDP2 (2
ranks) the model is `fully_shard`ed and every rank draws the same batches: buffers are not
sharded and DCP saves one copy of equal keys, so buffers that differ across ranks
(BatchNorm's statistics without SyncBatchNorm, which needs CUDA) could not come back on
every rank.

Kept free of ckpt imports, like toy_model.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class Specimen:
    """One kind, built: what the training loop and the Checkpointer are given."""

    model: nn.Module
    batch: Callable[[], Any]  # the next batch, from the global torch RNG
    loss: Callable[[nn.Module, Any], torch.Tensor] = lambda model, x: model(x).float().pow(2).mean()
    extra: dict[str, Any] = field(default_factory=dict)  # the Checkpointer's extra=
    after_step: Callable[[], None] = lambda: None  # after optimizer.step(), before step_done()


@dataclass(frozen=True)
class Kind:
    """A kind of model, and what its test checks besides bitwise equality."""

    build: Callable[[str, bool], Specimen]  # (mode, resumed): resumed for the run that restores
    ties: tuple[tuple[str, ...], ...] = ()  # parameters that are one tensor, before and after a restore
    unsaved: tuple[str, ...] = ()  # the model's keys no checkpoint may hold (non-persistent buffers)
    stateless: tuple[str, ...] = ()  # parameters no step has reached by the saves (no optimizer state)


def sharded(model: nn.Module, mode: str, *units: nn.Module) -> nn.Module:
    """The model as `mode` trains it: under FSDP2, `units` and the root fully sharded."""
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def rows(n: int = 4, width: int = 6) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(n, width)


def batchnorm_cnn(mode: str, resumed: bool) -> Specimen:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )
    return Specimen(sharded(model, mode), lambda: torch.randn(4, 3, 6, 6))


def spectral_norm(mode: str, resumed: bool) -> Specimen:
    # Its power iteration updates the buffers _u and _v in every training forward.
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))
    return Specimen(sharded(model, mode), rows())


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).mT


def parametrized(mode: str, resumed: bool) -> Specimen:
    """weight_norm (parametrizations.weight.original0/1) and a parametrization of our own."""
    custom = nn.Linear(6, 6)
    nn.utils.parametrize.register_parametrization(custom, "weight", Symmetric())
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(6, 6)), nn.Tanh(), custom, nn.Linear(6, 2))
    return Specimen(sharded(model, mode), rows())


def gpt2_tied(mode: str, resumed: bool) -> Specimen:
    """transformers' GPT-2 from a tiny config (no download): lm_head is wte, dropout draws RNG."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    return Specimen(
        sharded(model, mode, *model.transformer.h),
        lambda: torch.randint(0, 64, (2, 16)),
        loss=lambda model, ids: model(input_ids=ids, labels=ids).loss,
    )


def compiled(when: Callable[[bool], bool]) -> Callable[[str, bool], Specimen]:
    """torch.compile'd in the runs where `when(resumed)`: its state dict says `_orig_mod.`.
    aot_eager functionalizes BatchNorm's buffer updates as inductor does, bitwise as eager,
    in a second where inductor takes 20 s of C++ compiling on a CPU."""

    def build(mode: str, resumed: bool) -> Specimen:
        model = sharded(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)), mode)
        return Specimen(torch.compile(model, backend="aot_eager") if when(resumed) else model, rows())

    return build


def ema(mode: str, resumed: bool) -> Specimen:
    """An EMA of the weights in extra=: AveragedModel's n_averaged and shadow weights (under
    FSDP2 sharded as the model is: copied before, since FSDP2 modules cannot be deep-copied)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    shadow = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sharded(model, mode)
    sharded(shadow.module, mode)
    return Specimen(model, rows(), extra={"ema": shadow}, after_step=lambda: shadow.update_parameters(model))


class Cached(nn.Module):
    """Non-persistent buffers: a constant mask and a cache each forward rewrites; `mean` is
    saved (a running mean of the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 2)
        self.register_buffer("mask", torch.arange(6) % 2 == 0, persistent=False)
        self.register_buffer("weight_norm", torch.zeros(()), persistent=False)
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight_norm.copy_(self.lin.weight.norm())
            self.mean.lerp_(x.mean(0), 0.1)
        return self.head(self.lin(x) * self.mask)


class Counting(nn.Module):
    """A counter incremented in forward, and a float64 sum of what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.total += x.detach().double().sum()
        return self.lin(x)


class OddBuffers(nn.Module):
    """int32, bool and complex64 buffers, each changed in forward by what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(6, 4), nn.Linear(4, 2)
        self.register_buffer("winners", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("fired", torch.zeros(4, dtype=torch.bool))
        self.register_buffer("phase", torch.ones(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.winners += torch.bincount(h.argmax(-1), minlength=4).int()
            self.fired |= (h > 1).any(0)
            self.phase *= torch.polar(torch.ones(3), h[0, :3])
        return self.head(h.tanh())


class Checkpointed(nn.Module):
    """Gradient checkpointing (non-reentrant) of blocks with dropout: recomputed in backward
    from the RNG state of the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.2), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class Experts(nn.Module):
    """A ModuleDict of experts behind a top-1 router: two samples a batch reach two experts
    at most, so the others have no gradient that step and no optimizer state until one
    reaches them; with these seeds e3 is reached by none of the 8 steps (a dead expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 4)
        self.experts = nn.ModuleDict({f"e{i}": nn.Linear(6, 2) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)
        choice = gate.argmax(-1)
        out = torch.zeros(len(x), 2)
        for i, expert in enumerate(self.experts.values()):
            if (hit := choice == i).any():
                out[hit] = expert(x[hit]) * gate[hit, i : i + 1]
        return out


def module(cls: type[nn.Module], batch_rows: int = 4) -> Callable[[str, bool], Specimen]:
    return lambda mode, resumed: Specimen(sharded(cls(), mode), rows(batch_rows))


def bf16(mode: str, resumed: bool) -> Specimen:
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2)).to(torch.bfloat16)
    return Specimen(sharded(model, mode), lambda: torch.randn(4, 6, dtype=torch.bfloat16))


KINDS: dict[str, Kind] = {
    "batchnorm_cnn": Kind(batchnorm_cnn),
    "spectral_norm": Kind(spectral_norm),
    "parametrized": Kind(parametrized),
    "gpt2_tied": Kind(gpt2_tied, ties=(("lm_head.weight", "transformer.wte.weight"),)),
    "compiled_to_plain": Kind(compiled(lambda resumed: not resumed)),
    "plain_to_compiled": Kind(compiled(lambda resumed: resumed)),
    "ema": Kind(ema),
    "non_persistent_buffers": Kind(module(Cached), unsaved=("mask", "weight_norm")),
    "counter": Kind(module(Counting)),
    "int_bool_complex_buffers": Kind(module(OddBuffers)),
    "bf16": Kind(bf16),
    "gradient_checkpointing": Kind(module(Checkpointed)),
    "experts": Kind(
        module(Experts, batch_rows=2),
        stateless=("experts.e3.weight", "experts.e3.bias"),
    ),
}

# The other ways a save copies the state, each for the kinds whose buffers forward changes.
PATHS: dict[str, dict[str, Any]] = {
    "overlap_off": {"overlap": False},
    "streamed": {"host_memory_budget": 1},  # over any budget: streamed from the live state
}
PATH_KINDS = ("batchnorm_cnn", "counter")


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every run of the zoo (under each mode): case name -> (kind, the Checkpointer's options
    besides the defaults)."""
    runs = {name: (name, {}) for name in KINDS}
    for path, options in PATHS.items():
        runs.update({f"{name}-{path}": (name, options) for name in PATH_KINDS})
    return runs
