"""DeepSpeed engines (ZeRO stage 1, 2 and 3, and stage 2 with the optimizer offloaded to the
CPU) saved and restored by ckpt: real engines on DeepSpeed's CPU accelerator, ranks over
gloo (tests/workers/ds_worker.py). The restored weights and Adam moments are bitwise the saved ones,
on the same world size and, for stages 1-3, on another one (2 -> 1, 1 -> 2), with no
conversion step; the offloaded engine is restored on the same world size. A frozen layer
and bf16 weights are restored bitwise too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt.storage.store import step_dir_name
from tests.support.compare import bits_equal
from tests.support.launch import WORKERS, run

pytestmark = pytest.mark.slow

WORKER = WORKERS / "ds_worker.py"


@pytest.fixture(scope="module")
def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built ops go (its CPU Adam): the user's torch extensions cache, so
    a later session finds them built (a copy elsewhere is built again: its build commands name
    their directory). CPU Adam is built here first, with a limit of its own (minutes on a busy
    2-core machine; the jobs' limits are for training), so no job is killed while it builds.
    A build killed before (its lock file left behind) would make every job wait on the lock
    until its own timeout: locks are cleared first (`_no_build_lock_left_over`)."""
    d = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    d.mkdir(parents=True, exist_ok=True)
    for lock in d.rglob("lock"):
        lock.unlink()
    build = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(d)}
    out = subprocess.run([sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return d


@pytest.fixture(autouse=True)
def _no_build_lock_left_over(extensions_dir, monkeypatch):
    # Nothing builds while a job runs (CPU Adam is built): a lock found now is a killed build's.
    for lock in extensions_dir.rglob("lock"):
        lock.unlink()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))


def ds_job(tmp_path: Path, ranks: int, name: str, *args: object) -> list[dict]:
    """Run the worker on `ranks` ranks; its dumps, by rank."""
    log_dir = tmp_path / name
    log_dir.mkdir()
    out = tmp_path / name / "out"
    codes = run(ranks, WORKER, *map(str, args), "--out", str(out), env={"DS_ACCELERATOR": "cpu"}, log_dir=log_dir, timeout=300)
    logs = "\n".join((log_dir / f"rank{r}.log").read_text()[-3000:] for r in range(ranks))
    assert codes == [0] * ranks, f"exit codes {codes}\n{logs}"
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(ranks)]


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for key in ("params", "module", "exp_avg", "exp_avg_sq"):
        for name, tensor in want[key].items():
            assert bits_equal(got[key][name], tensor), f"{what}: {key} {name}"
    assert got["lr"] == want["lr"] and got["global_steps"] == want["global_steps"], what


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_engine_resumes_bitwise_on_the_same_and_on_other_world_sizes(tmp_path, stage):
    root = tmp_path / "root"
    # ZeRO-3's restore gathers a few parameters at a time: here one or two of the model's.
    common = ("--stage", stage, "--every", 5, *(("--gather-bytes", 4096) if stage == 3 else ()))
    # 2 ranks train 5 steps and stop at their step-5 checkpoint.
    first = ds_job(tmp_path, 2, "first", *common, "--root", root, "--steps", 5, "--no-save-on-exit")
    shutil.copytree(root, tmp_path / "copy")
    # The same world size: everything restored is what was saved, bit for bit.
    resumed = ds_job(tmp_path, 2, "resumed", *common, "--root", root, "--steps", 10)
    assert [d["restored_step"] for d in resumed] == [5, 5]
    for rank in range(2):
        assert_same_state(resumed[rank]["start"], first[rank]["end"], f"2 -> 2, rank {rank}")
    # 2 -> 1: the one rank gets the whole state, without a conversion step; it trains on.
    alone = ds_job(tmp_path, 1, "alone", *common, "--root", tmp_path / "copy", "--steps", 10)
    assert alone[0]["restored_step"] == 5 and alone[0]["step"] == 10
    assert_same_state(alone[0]["start"], first[0]["end"], "2 -> 1")
    # 1 -> 2: its step-10 checkpoint, partitioned again over two ranks.
    again = ds_job(tmp_path, 2, "again", *common, "--root", tmp_path / "copy", "--steps", 12)
    assert [d["restored_step"] for d in again] == [10, 10]
    for rank in range(2):
        assert_same_state(again[rank]["start"], alone[0]["end"], f"1 -> 2, rank {rank}")


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_and_bf16_weights_are_restored_bitwise_on_another_world_size(tmp_path, stage):
    """A fine-tune's frozen layer (no optimizer owns it, so ZeRO keeps no fp32 copy of it) is
    saved as the module holds it; the bf16 weights the forward uses are refreshed from the
    restored fp32 masters. The resumed job loads other values for the frozen layer before the
    restore, as a job that reloads a base model from elsewhere might: the checkpoint's win."""
    common = ("--stage", stage, "--bf16", "--every", 4, *(("--gather-bytes", 4096) if stage == 3 else ()))
    first = ds_job(tmp_path, 2, "first", *common, "--frozen-seed", 1, "--root", tmp_path / "root", "--steps", 4, "--no-save-on-exit")
    frozen = ["0.weight", "0.bias"]
    assert all(t.dtype == torch.bfloat16 for n, t in first[0]["end"]["module"].items() if n != "5.calls")  # the counter: int64
    assert all(n not in first[0]["end"]["params"] for n in frozen)  # no fp32 master
    assert all(bits_equal(first[0]["start"]["module"][n], first[0]["end"]["module"][n]) for n in frozen)  # frozen: not trained
    alone = ds_job(tmp_path, 1, "alone", *common, "--frozen-seed", 2, "--root", tmp_path / "root", "--steps", 6)
    assert alone[0]["restored_step"] == 4 and alone[0]["step"] == 6
    assert not any(bits_equal(alone[0]["start"]["before"][n], first[0]["end"]["module"][n]) for n in frozen)
    assert_same_state(alone[0]["start"], first[0]["end"], "2 -> 1")
    assert all(bits_equal(alone[0]["end"]["module"][n], first[0]["end"]["module"][n]) for n in frozen)


def test_a_checkpoint_without_the_frozen_parameters_restores_the_rest_and_says_so(tmp_path):
    """An earlier ckpt saved no frozen parameters: its checkpoints restore everything they
    hold, the frozen layer keeps what the job loaded, and the log says which were not there."""
    common = ("--stage", 1, "--every", 2)
    first = ds_job(tmp_path, 1, "first", *common, "--frozen-seed", 1, "--save-no-frozen", "--root", tmp_path / "root", "--steps", 2, "--no-save-on-exit")
    resumed = ds_job(tmp_path, 1, "resumed", *common, "--frozen-seed", 2, "--root", tmp_path / "root", "--steps", 3)
    assert resumed[0]["restored_step"] == 2
    start, saved = resumed[0]["start"], first[0]["end"]
    for name in ("0.weight", "0.bias"):
        assert bits_equal(start["module"][name], start["before"][name]) and not bits_equal(start["module"][name], saved["module"][name])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert all(bits_equal(start[key][n], t) for n, t in saved[key].items()), key
    log = (tmp_path / "resumed" / "rank0.log").read_text()
    assert "this checkpoint holds no value for 2 frozen parameter(s) (0.bias, 0.weight; saved with frozen='skip' or by an earlier ckpt)" in log, log[-3000:]


@pytest.mark.parametrize("stage", [1, 3])
def test_with_frozen_skip_the_frozen_layer_is_in_no_checkpoint_and_a_resume_on_one_rank_keeps_the_base_it_loaded(tmp_path, stage):
    """frozen="skip" (a fine-tune that reloads its base itself): the checkpoint holds the
    trained parameters and their optimizer state only; 2 -> 1, the resumed job's frozen layer
    is the one it loaded (not in the checkpoint: kept, and said at INFO), the rest bitwise."""
    common = ("--stage", stage, "--every", 2, "--frozen", "skip", *(("--gather-bytes", 4096) if stage == 3 else ()))
    first = ds_job(tmp_path, 2, "first", *common, "--frozen-seed", 1, "--root", tmp_path / "root", "--steps", 2, "--no-save-on-exit")
    saved = set(dcp.FileSystemReader(str(tmp_path / "root" / step_dir_name(2))).read_metadata().state_dict_metadata)
    assert "model.2.weight" in saved and not {"model.0.weight", "model.0.bias"} & saved, sorted(saved)
    alone = ds_job(tmp_path, 1, "alone", *common, "--frozen-seed", 2, "--root", tmp_path / "root", "--steps", 3)
    assert alone[0]["restored_step"] == 2 and alone[0]["step"] == 3
    start, end = alone[0]["start"], first[0]["end"]
    for name in ("0.weight", "0.bias"):
        assert bits_equal(start["module"][name], start["before"][name]) and not bits_equal(start["module"][name], end["module"][name])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert end[key] and all(bits_equal(start[key][n], t) for n, t in end[key].items()), key
    log = (tmp_path / "alone" / "rank0.log").read_text()
    assert "holds no value for 2 frozen parameter(s) (0.bias, 0.weight): they keep" in log and "saved with frozen='skip'" not in log, log[-3000:]


def test_zero2_with_the_optimizer_offloaded_resumes_bitwise_and_trains_on_as_deepspeed_does(tmp_path):
    """With the optimizer on the host (offload_optimizer: cpu). The run after the restore
    stays within float32 rounding of an uninterrupted one (DeepSpeed's own save_checkpoint /
    load_checkpoint differs from it in the last bits too, on this CPU build)."""
    common = ("--stage", 2, "--offload", "--every", 5)
    first = ds_job(tmp_path, 2, "first", *common, "--root", tmp_path / "root", "--steps", 5, "--no-save-on-exit")
    resumed = ds_job(tmp_path, 2, "resumed", *common, "--root", tmp_path / "root", "--steps", 10)
    for rank in range(2):
        assert_same_state(resumed[rank]["start"], first[rank]["end"], f"rank {rank}")
    straight = ds_job(tmp_path, 2, "straight", *common, "--root", tmp_path / "straight", "--steps", 10)
    for name, tensor in straight[0]["end"]["params"].items():
        torch.testing.assert_close(resumed[0]["end"]["params"][name], tensor, rtol=1e-4, atol=1e-5)


def test_a_save_in_the_middle_of_gradient_accumulation_is_refused_and_one_per_optimizer_step_resumes(tmp_path):
    """With 2 micro-batches per optimizer step, a loop that counts engine.step() calls would
    save half-way through one: its accumulated gradients are not part of any checkpoint, while
    the data position counts their samples. The save is refused, saying how to count; the
    loop that counts optimizer steps saves on their boundaries and resumes bitwise."""
    common = ("--stage", 1, "--accumulation", 2)
    log_dir = tmp_path / "micro"
    log_dir.mkdir()
    codes = run(1, WORKER, *map(str, common), "--count-micro-steps", "--every", "1", "--steps", "2", "--root", str(tmp_path / "bad"),
                "--out", str(log_dir / "out"), env={"DS_ACCELERATOR": "cpu"}, log_dir=log_dir, timeout=300)  # fmt: skip
    log = (log_dir / "rank0.log").read_text()
    assert codes != [0] and "a save in the middle of gradient accumulation (micro-batch 1 of 2)" in log, log[-3000:]
    assert not list((tmp_path / "bad").glob("step-*/manifest.json"))
    first = ds_job(tmp_path, 1, "first", *common, "--every", 2, "--root", tmp_path / "root", "--steps", 2, "--no-save-on-exit")
    resumed = ds_job(tmp_path, 1, "resumed", *common, "--every", 2, "--root", tmp_path / "root", "--steps", 3)
    assert resumed[0]["restored_step"] == 2 and resumed[0]["step"] == 3
    assert_same_state(resumed[0]["start"], first[0]["end"], "gradient accumulation")
    # 2 ranks of one micro-batch a step, resumed on 1 rank of two (the same global batch):
    # the restored engine starts an optimizer step with its next micro-batch, and saves.
    ds_job(tmp_path, 2, "two", "--stage", 1, "--every", 3, "--root", tmp_path / "elastic", "--steps", 3, "--no-save-on-exit")
    one = ds_job(tmp_path, 1, "one", *common, "--every", 1, "--root", tmp_path / "elastic", "--steps", 4)
    assert one[0]["restored_step"] == 3 and one[0]["step"] == 4
    # A loop whose data ends one micro-batch into an optimizer step leaves cleanly: the save on
    # leaving is passed over, saying so, and the last checkpoint stands.
    ds_job(tmp_path, 1, "trailing", *common, "--every", 2, "--root", tmp_path / "trailing", "--steps", 3, "--trailing-micro", 1)
    log = (tmp_path / "trailing" / "rank0.log").read_text()
    assert "step 3 is not saved on leaving: the loop ended in the middle of gradient accumulation (micro-batch 1 of 2)" in log, log[-3000:]
    assert "the last checkpoint is step 2" in log
    assert sorted(p.parent.name for p in (tmp_path / "trailing").glob("step-*/manifest.json")) == ["step-0000000002"]
