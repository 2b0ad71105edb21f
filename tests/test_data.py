"""ElasticSampler and the global-batch rule, rank by rank in one process (the sampler does no
communication: every rank computes its share of one global sequence)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ckpt
from ckpt import ElasticSampler, accumulation_steps


def train_steps(world: int, steps: int, *, state=None, n=37, global_batch=12, micro=2, drop_last=False, **kw):
    """Run `steps` optimizer steps on `world` simulated ranks; returns the global batch (as
    a sorted list) of every step and the sampler state at the end."""
    samplers = [
        ElasticSampler(n, seed=3, rank=r, world_size=world, drop_last=drop_last, global_batch=global_batch, **kw)
        for r in range(world)
    ]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    accum = accumulation_steps(global_batch, micro, world)
    iters = [iter(s) for s in samplers]
    out = []
    for _ in range(steps):
        batch = []
        for _ in range(accum):
            for r in range(world):
                for _ in range(micro):
                    try:
                        batch.append(next(iters[r]))
                    except StopIteration:  # epoch over: every rank turns the page together
                        iters[r] = iter(samplers[r])
                        batch.append(next(iters[r]))
        out.append(sorted(batch))
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] | {"world_size": world} for st in states)
    return out, states[0]


def test_global_batches_are_identical_across_world_size_changes_and_epochs():
    reference, _ = train_steps(2, 12)  # 144 samples over a 37-sample dataset: 3+ epochs
    a, st = train_steps(2, 2)
    b, st = train_steps(1, 3, state=st)
    c, st = train_steps(3, 1, state=st, global_batch=12)
    d, st = train_steps(6, 2, state=st)
    e, _ = train_steps(2, 4, state=st)
    assert a + b + c + d + e == reference


def test_every_epoch_is_a_permutation_of_the_dataset_and_differs_by_epoch():
    s = ElasticSampler(50, seed=1)
    e0, e1 = list(s), list(s)
    assert sorted(e0) == sorted(e1) == list(range(50))
    assert e0 != e1 and s.epoch == 2


def test_ranks_split_the_epoch_without_overlap_and_pad_or_drop_the_tail():
    padded = [list(ElasticSampler(10, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert [len(p) for p in padded] == [4, 4, 4]  # 10 + 2 wrapped from the epoch's start
    assert set(sum(padded, [])) == set(range(10))
    dropped = [list(ElasticSampler(10, seed=0, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert [len(d) for d in dropped] == [3, 3, 3] and len(set(sum(dropped, []))) == 9


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_the_whole_epoch_per_rank_and_remaining_what_a_restored_sampler_has_left(drop_last):
    whole = [len(list(ElasticSampler(37, seed=0, rank=r, world_size=3, drop_last=drop_last))) for r in range(3)]
    s = ElasticSampler(37, seed=0, rank=0, world_size=3, drop_last=drop_last)
    assert len(s) == s.remaining == whole[0]
    it = iter(s)
    for _ in range(4):
        next(it)
    assert (len(s), s.remaining) == (whole[0], whole[0] - 4)
    restored = ElasticSampler(37, seed=0, rank=1, world_size=3, drop_last=drop_last)
    restored.load_state_dict(s.state_dict())  # 12 consumed over the 3 ranks
    loader = DataLoader(TensorDataset(torch.arange(37)), batch_size=2, sampler=restored)
    assert len(restored) == whole[1] and len(loader) == -(-whole[1] // 2)  # an epoch, for steps-per-epoch
    assert restored.remaining == whole[1] - 4 == len(list(restored))
    assert len(restored) == restored.remaining == whole[1]  # the next epoch, whole
    # Saved as the epoch's last index went out, on 3 ranks; resumed on 2, whose epoch pads
    # to fewer: nothing is left of it, not less than nothing.
    ended = ElasticSampler(37, seed=0, rank=0, world_size=3, drop_last=drop_last)
    for _ in ended:
        pass
    st = {**ended.state_dict(), "epoch": 0, "consumed": 39 if not drop_last else 36}
    fewer = ElasticSampler(37, seed=0, rank=0, world_size=2 if not drop_last else 5, drop_last=drop_last)
    fewer.load_state_dict(st)
    assert fewer.remaining == 0 == len(list(fewer))


def test_unshuffled_sampler_walks_the_dataset_in_order():
    assert list(ElasticSampler(6, shuffle=False, rank=1, world_size=2)) == [1, 3, 5]


def test_loading_a_sampler_state_of_another_dataset_is_refused():
    st = ElasticSampler(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="dataset_len"):
        ElasticSampler(11, seed=0).load_state_dict(st)
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(10, seed=1).load_state_dict(st)


def test_accumulation_steps_keep_the_global_batch_or_say_why_not():
    assert accumulation_steps(64, 4, 8) == 2
    assert accumulation_steps(64, 4, 4) == 4
    assert accumulation_steps(64, 4, 16) == 1
    with pytest.raises(ValueError, match="cannot be kept on 3 ranks"):
        accumulation_steps(64, 4, 3)


def test_a_plain_dataloader_without_a_position_is_refused():
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    with pytest.raises(TypeError, match="ElasticSampler"):
        ckpt.Checkpointer("unused", dataloader=loader)


def test_dataloader_with_an_elastic_sampler_restores_the_position(tmp_path):
    data = TensorDataset(torch.arange(30))

    def make():
        sampler = ElasticSampler(30, seed=9)
        return sampler, DataLoader(data, batch_size=4, sampler=sampler)

    sampler, loader = make()
    with ckpt.Checkpointer(tmp_path, dataloader=loader, interval=None) as cp:
        it = iter(loader)
        first = [next(it)[0].tolist() for _ in range(3)]
        for _ in range(3):
            cp.step_done()
    rest_reference = [b[0].tolist() for b in it]

    sampler2, loader2 = make()
    with ckpt.Checkpointer(tmp_path, dataloader=loader2, interval=None, save_on_exit=False) as cp:
        assert cp.step == 3 and sampler2.consumed == 12
        rest = [b[0].tolist() for b in loader2]
    assert rest == rest_reference
    assert sorted(sum(first + rest, [])) == list(range(30))


@pytest.mark.parametrize("stateful", [False, True])
def test_a_resumed_run_with_dropout_is_the_run_it_resumes_bit_for_bit(tmp_path, stateful):
    """`iter(loader)` draws its workers' base seed: from torch's global generator, the
    resumed run's draw (after the restore; the first run drew before its first step) would
    shift every random number after it, and dropout would differ."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(root, steps: int) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = TensorDataset(torch.randn(64, 4))
        loader = (
            StatefulDataLoader(data, batch_size=4, shuffle=True)
            if stateful
            else DataLoader(data, batch_size=4, sampler=ElasticSampler(64, seed=0, global_batch=4))
        )
        with ckpt.Checkpointer(root, model=model, optimizer=opt, dataloader=loader, interval=ckpt.Every(steps=5)) as cp:
            it = iter(loader)
            while cp.step < steps:
                try:
                    (x,) = next(it)
                except StopIteration:  # an epoch is 16 steps: the resumed run turns one too
                    it = iter(loader)
                    (x,) = next(it)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                cp.step_done()
        seeds.append(loader.generator.initial_seed())
        return model.state_dict()

    seeds: list[int] = []
    straight = run(tmp_path / "a", 20)
    run(tmp_path / "b", 7)  # saved at 5, and at 7 on the way out
    resumed = run(tmp_path / "b", 20)
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k
    # The loader's own generator is reseeded by the restore: the workers' seeds after a resume
    # are not the fresh run's again (the global generator's draws are not touched by it).
    assert seeds[0] == seeds[1] == 0 and seeds[2] != 0


def test_stateful_dataloader_with_its_own_shuffling_resumes_where_it_stopped(tmp_path):
    """A StatefulDataLoader without an ElasticSampler (its RandomSampler's state holds a
    generator tensor) is saved as it is and, at the same world size, resumes exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.arange(40))

    def make():
        torch.manual_seed(4)
        return StatefulDataLoader(data, batch_size=4, shuffle=True)

    loader = make()
    with ckpt.Checkpointer(tmp_path, dataloader=loader, interval=None) as cp:
        it = iter(loader)
        for _ in range(3):
            next(it)
            cp.step_done()
    want = [b[0].tolist() for b in it]

    loader2 = make()
    with ckpt.Checkpointer(tmp_path, dataloader=loader2, interval=None, save_on_exit=False) as cp:
        assert cp.step == 3
        got = [b[0].tolist() for b in loader2]
    assert got == want
