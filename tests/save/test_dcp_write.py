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
