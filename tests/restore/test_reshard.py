"""Restart on fewer or more ranks, or under another wrapping: model and optimizer reshard
through DCP and come back bit for bit (resharding moves data, it computes nothing)."""

from __future__ import annotations

import pytest
import torch

from tests.support.compare import bits_equal
from tests.support.launch import WORKERS, run

WORKER = WORKERS / "reshard_worker.py"


def _job(nprocs: int, tmp_path, phase: str, mode: str, out: str, mesh: str = "") -> dict:
    args = ["--phase", phase, "--mode", mode, "--root", str(tmp_path / "root"), "--out", str(tmp_path / out)]
    if mesh:
        args += ["--mesh", mesh]
    logs = tmp_path / f"logs-{out}"
    logs.mkdir()
    codes = run(nprocs, WORKER, *args, log_dir=logs, timeout=240)
    assert not any(codes), (codes, [(logs / f"rank{r}.log").read_text()[-2000:] for r in range(nprocs)])
    return torch.load(tmp_path / out, weights_only=False)


def _assert_same_state(saved: dict, loaded: dict) -> None:
    assert loaded["restored_step"] == saved["step"]
    assert loaded["plan_is_dcps"], "ckpt's load plan differs from DCP's on some rank"
    assert saved["model"].keys() == loaded["model"].keys()
    for k, v in saved["model"].items():
        assert bits_equal(v, loaded["model"][k]), k
    assert saved["optim"].keys() == loaded["optim"].keys()
    assert loaded["groups"] == saved["groups"]  # the saved lr and weight decay, not the new job's
    for fqn, st in saved["optim"].items():
        for name, v in st.items():
            assert bits_equal(torch.as_tensor(v), torch.as_tensor(loaded["optim"][fqn][name])), (fqn, name)


@pytest.mark.parametrize(
    ("save_ranks", "load_ranks"),
    [(2, 1), (1, 2), (4, 2), (4, 3)],
    ids=["2to1", "1to2", "4to2", "4to3"],
)
def test_fsdp2_checkpoint_restores_bitwise_on_another_world_size(tmp_path, save_ranks, load_ranks):
    saved = _job(save_ranks, tmp_path, "save", "fsdp2", "saved.pt")
    loaded = _job(load_ranks, tmp_path, "load", "fsdp2", "loaded.pt")
    _assert_same_state(saved, loaded)
    # DCP loaded every value into the sharded parameters and optimizer states themselves,
    # and FSDP2's load hooks have nothing to do then: neither is loaded a second time, only
    # the optimizer's hyperparameters are set (rank 0's view).
    assert loaded["model_loaded_again"] == ["optimizer in place"]


def test_ddp_checkpoint_loads_under_fsdp2_and_back(tmp_path):
    saved = _job(2, tmp_path, "save", "ddp", "ddp.pt")
    as_fsdp2 = _job(2, tmp_path, "load", "fsdp2", "fsdp2.pt")
    _assert_same_state(saved, as_fsdp2)
    # and an FSDP2 checkpoint back into DDP, on another root
    root2 = tmp_path / "second"
    root2.mkdir()
    saved2 = _job(2, root2, "save", "fsdp2", "fsdp2-saved.pt")
    as_ddp = _job(2, root2, "load", "ddp", "ddp-loaded.pt")
    _assert_same_state(saved2, as_ddp)


def test_fsdp_x_tp_2d_mesh_checkpoint_loads_into_another_mesh(tmp_path):
    saved = _job(4, tmp_path, "save", "tp2d", "tp-saved.pt", mesh="2x2")
    loaded = _job(2, tmp_path, "load", "tp2d", "tp-loaded.pt", mesh="1x2")
    _assert_same_state(saved, loaded)
    loaded_dp = _job(2, tmp_path, "load", "tp2d", "dp-loaded.pt", mesh="2x1")
    _assert_same_state(saved, loaded_dp)


def test_files_read_at_once_fail_on_the_corrupt_one_and_restore_once_it_is_mended(tmp_path):
    """A rank restoring on fewer ranks reads several files at once, one thread each: a flipped
    bit in any of them fails the restore with that file's checksum mismatch (never the other
    threads' early stop), loads nothing that would be kept, and the same files restore bit
    for bit once mended."""
    saved = _job(2, tmp_path, "save", "fsdp2", "saved.pt")
    [step] = (tmp_path / "root").glob("step-*")
    for bad in ["__1_0.distcp", "__0_0.distcp"]:
        path = step / bad
        data = bytearray(path.read_bytes())
        at = len(data) // 2
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
        logs = tmp_path / f"logs-{bad}"
        logs.mkdir()
        args = ["--phase", "load", "--mode", "fsdp2", "--root", str(tmp_path / "root"), "--out", str(tmp_path / "x.pt")]
        assert run(1, WORKER, *args, log_dir=logs, timeout=240) == [1]
        log = (logs / "rank0.log").read_text()
        assert f"{bad}: checksum mismatch" in log, log[-3000:]
        assert "stopped, another file" not in log, log[-3000:]
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
    _assert_same_state(saved, _job(1, tmp_path, "load", "fsdp2", "loaded.pt"))
