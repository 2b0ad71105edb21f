"""The data files are plain DCP (ckpt.save.dcp_write): every dtype and shape reads back with
`torch.distributed.checkpoint.load`, and the writer process and the thread write the same
bytes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests.support.writes import Holder


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(700, 1024, generator=g)  # 2.8 MB: page-aligned in the arena and the file
    return {
        "big": big,
        "view": big[::2, 3:5],  # a strided view of another tensor: staged as its own buffer
        "f16": torch.randn(33, 7, generator=g).half(),
        "bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "i8": torch.randint(-100, 100, (17,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (4, 4, 4), dtype=torch.uint8, generator=g),
        "i64": torch.arange(10, dtype=torch.int64),
        "bool": torch.rand(9, generator=g) > 0.5,
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
    }


def _save(root: Path, monkeypatch, writer: str) -> Path:
    monkeypatch.setenv("CKPT_WRITER", writer)
    with ckpt.Checkpointer(root, extra={"t": Holder(_state())}, interval=None, handle_sigterm=False) as cp:
        cp.step_done()
        cp.save(blocking=True)
        kind = type(cp._slot.sinks.get(cp.store.url)).__name__
    assert kind == {"process": "ProcessSink", "thread": "ThreadSink"}[writer]
    return root / "step-0000000001"


def test_every_dtype_and_shape_reads_back_with_plain_dcp_load(tmp_path, monkeypatch):
    step_dir = _save(tmp_path, monkeypatch, "process")
    want = _state()
    got = {"extra": {"t": {k: torch.zeros_like(v) for k, v in want.items()}}}
    dcp.load(got, checkpoint_id=str(step_dir))  # DCP's own reader: torch.load of each item
    for k, v in want.items():
        assert torch.equal(got["extra"]["t"][k], v), k


def test_the_writer_process_and_the_thread_write_the_same_bytes(tmp_path, monkeypatch):
    a = _save(tmp_path / "process", monkeypatch, "process")
    b = _save(tmp_path / "thread", monkeypatch, "thread")
    assert (a / "__0_0.distcp").read_bytes() == (b / "__0_0.distcp").read_bytes()


def test_the_global_metadata_dcp_sends_every_rank_at_the_end_of_a_save_is_empty(tmp_path, monkeypatch):
    """DCP's save ends by broadcasting rank 0's result, the whole global metadata (3 GB for
    70B over 10,000 ranks), to every rank, which does nothing with it (issue 40). ckpt's
    planner hands DCP one that pickles as an empty Metadata; `.metadata` holds all of it."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from ckpt.save.dcp_write import Planner

    state = {f"w{i}": torch.randn(8, 8) for i in range(50)}
    planner = Planner(enable_plan_caching=True)
    planner.set_up_planner(state, is_coordinator=True)
    _, md = planner.create_global_plan([planner.create_local_plan()])
    assert len(md.state_dict_metadata) == 50
    sent = pickle.dumps(md)  # what the other ranks would receive
    assert len(sent) < 200 and pickle.loads(sent) == Metadata({}), len(sent)
    # The saved `.metadata` is whole: plain DCP reads the checkpoint (above); every key is in it.
    step_dir = _save(tmp_path, monkeypatch, "thread")
    with open(step_dir / ".metadata", "rb") as f:
        saved = pickle.load(f)
    assert type(saved) is Metadata and {f"extra.t.{k}" for k in _state()} <= set(saved.state_dict_metadata), saved.state_dict_metadata.keys()
