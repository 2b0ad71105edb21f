"""The staging arena (ckpt.save.arena): its memory stays flat over saves and is renewed when
shapes change, and tensors staged in two arenas are written from the right one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.storage.store import Store
from tests.support.writes import Holder


def test_staging_memory_stays_flat_over_saves_and_is_renewed_when_shapes_change(tmp_path):
    model = torch.nn.Linear(256, 256)
    grow = Holder({})
    with ckpt.Checkpointer(tmp_path, model=model, extra={"grow": grow}, interval=None, keep=ckpt.Keep(last=1), handle_sigterm=False) as cp:
        for _ in range(5):
            cp.step_done()
            cp.save(blocking=True)
        arena = cp._slot.stager.arena
        used, segments = arena.used, set(arena.segments)
        for _ in range(20):
            cp.step_done()
            cp.save(blocking=True)
        assert (arena.used, set(arena.segments)) == (used, segments)  # buffers are reused
        # The layout changes at every save: dead buffers pile up until the arena is renewed.
        seen = set()
        for n in range(1, 40):
            grow.tensors = {"t": torch.zeros(n * 1024 * 1024 // 4)}
            cp.step_done()
            cp.save(blocking=True)
            assert arena.used <= 2 * cp._slot.stager.bytes_staged + (64 << 20) + n * (1 << 20)
            seen.add(frozenset(arena.segments))
        assert len(seen) > 1  # renewed at least once


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_tensors_staged_in_two_arenas_are_written_from_the_right_one(tmp_path, writer):
    # On CUDA a stager has a pageable and a pinned arena; their segments must never be mixed
    # up (they once were: both numbered theirs from 0, and small CPU tensors were saved with
    # the bytes of a pinned segment).
    from ckpt.collectives import Group
    from ckpt.save.arena import Arena
    from ckpt.save.commit import Save, Source, persist
    from ckpt.save.resave import Resaver
    from ckpt.save.upload import Direct
    from ckpt.save.writer_proc import ProcessSink, ThreadSink

    arenas = [Arena(), Arena()]
    want = {f"t{i}": torch.randn(100 + i) for i in range(6)}
    staged = {}
    for i, (k, v) in enumerate(want.items()):
        staged[k] = arenas[i % 2].empty(v.shape, v.dtype)
        staged[k].copy_(v)
    store = Store(tmp_path)
    sink = ProcessSink(store) if writer == "process" else ThreadSink(store)
    try:
        persist(Save(1, store, Group(None, 0, 1)), Source({"extra": staged}, lambda _: sink, Resaver(), arenas), Direct())
    finally:
        sink.close()
    assert len({s for a in arenas for s in a.segments}) == 2
    got = {"extra": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(got, checkpoint_id=str(tmp_path / "step-0000000001"))
    for k, v in want.items():
        assert torch.equal(got["extra"][k], v), k
