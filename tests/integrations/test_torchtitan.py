"""ckpt under torchtitan (`ckpt.integrations.torchtitan.CheckpointManager`), and each reading
the other's checkpoints. Two gloo processes run torchtitan's loop on CPU over its own parts
(FSDP2, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader;
tests/workers/torchtitan_worker.py) for 16 steps, saving every 3:

- killed after step 11 (or 7) and restarted, each rank ends bit for bit as the uninterrupted
  run: weights, optimizer state, schedule, train state and RNG stream (torchtitan's own
  manager saves no RNG: its resume of a model with dropout would not be exact);
- torchtitan's own CheckpointManager, given a ckpt step directory as `initial_load_path`,
  loads everything ckpt saved there, data position included;
- ckpt's manager, given a step folder torchtitan's own manager wrote, loads it (everything, or
  the model only) and counts on from its step; a hostile one is refused."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

from tests.integrations.resume import (  # noqa: E402
    KILL_IDS,
    KILLS,
    RANKS,
    killed_and_resumed,
    load,
)
from tests.support.jobs import rank_logs  # noqa: E402
from tests.support.launch import WORKERS, run  # noqa: E402

WORKER = WORKERS / "torchtitan_worker.py"


def titan(tmp_path: Path, name: str, *args: str, root: Path | None = None) -> list[int]:
    root = root or tmp_path / name
    return run(RANKS, WORKER, "--root", str(root), "--out", str(tmp_path / name), *args, log_dir=tmp_path, timeout=300)


def assert_same_state(want: dict, got: dict, *, model_only: bool = False) -> None:
    for key, value in want["model"].items():
        assert torch.equal(value, got["model"][key]), key
    if model_only:
        return
    assert want["optim"].keys() == got["optim"].keys()
    for key, value in want["optim"].items():
        assert torch.equal(value, got["optim"][key]) if isinstance(value, torch.Tensor) else value == got["optim"][key], key
    assert want["last_epoch"] == got["last_epoch"] and want["train_state"] == got["train_state"]
    assert want["data"] == got["data"]  # the data loader's position


@pytest.mark.slow
@pytest.mark.parametrize(("die_at", "resumes_at"), KILLS, ids=KILL_IDS)
def test_a_torchtitan_loop_killed_resumes_bit_for_bit(tmp_path, die_at, resumes_at):
    for want, got in killed_and_resumed(WORKER, tmp_path, die_at):
        loaded = torch.load(tmp_path / "resumed.loaded.rank0.pt", weights_only=False)
        assert loaded["train_state"]["step"] == resumes_at  # the last commit before the kill
        assert got["train_state"] == want["train_state"] and got["last_epoch"] == want["last_epoch"]
        assert_same_state(want, got)
        assert torch.equal(want["rng"], got["rng"])


@pytest.mark.slow
def test_each_reads_the_others_checkpoints(tmp_path):
    """ckpt saves step 9 (and dumps its state there); torchtitan's own manager starts from that
    step directory and holds the same state. torchtitan's manager saves step 9 of its own run;
    ckpt's starts from that folder (all of it, then the model only) and holds the same."""
    assert titan(tmp_path, "ours", "--dump-at", "9") == [0, 0], rank_logs(tmp_path)
    step9 = tmp_path / "ours" / "step-0000000009"
    assert titan(tmp_path, "theirs_from_ours", "--manager", "torchtitan", "--initial", str(step9)) == [0, 0], rank_logs(tmp_path)
    for r in range(RANKS):
        want = torch.load(tmp_path / f"ours.at9.rank{r}.pt", weights_only=False)
        assert_same_state(want, torch.load(tmp_path / f"theirs_from_ours.loaded.rank{r}.pt", weights_only=False))

    assert titan(tmp_path, "theirs", "--manager", "torchtitan", "--dump-at", "9") == [0, 0], rank_logs(tmp_path)
    folder = tmp_path / "theirs" / "step-9"
    assert (folder / ".metadata").exists()
    assert titan(tmp_path, "ours_from_theirs", "--initial", str(folder)) == [0, 0], rank_logs(tmp_path)
    assert titan(tmp_path, "model_from_theirs", "--initial", str(folder), "--model-only") == [0, 0], rank_logs(tmp_path)
    for r in range(RANKS):
        want = torch.load(tmp_path / f"theirs.at9.rank{r}.pt", weights_only=False)
        assert_same_state(want, torch.load(tmp_path / f"ours_from_theirs.loaded.rank{r}.pt", weights_only=False))
        assert_same_state(want, torch.load(tmp_path / f"model_from_theirs.loaded.rank{r}.pt", weights_only=False), model_only=True)
    # Counted on from torchtitan's step 9: ckpt's next saves are 12 and 15, and the last, 16.
    assert sorted(p.name for p in (tmp_path / "ours_from_theirs").glob("step-*")) == [f"step-{s:010d}" for s in (12, 15, 16)]
    # ... and resumed from ckpt's own step 16 once it has one: nothing of the folder is read again.
    assert titan(tmp_path, "again", "--initial", str(folder), root=tmp_path / "ours_from_theirs") == [0, 0], rank_logs(tmp_path)
    assert torch.load(tmp_path / "again.loaded.rank0.pt", weights_only=False)["train_state"]["step"] == 16


@pytest.mark.slow
def test_a_torchtitan_folder_of_another_world_size_starts_every_rank_alike(tmp_path):
    """A folder torchtitan saved on 1 rank, loaded by a 2-rank job: the data loader positions
    are not this job's on any rank (decided from the folder's keys, alike on each), so every
    rank says the data starts over and trains on; the model, optimizer and step are loaded.
    (An outside review found rank 0 raising while rank 1 went on into a collective.)"""
    assert run(1, WORKER, "--root", str(tmp_path / "one"), "--out", str(tmp_path / "one"), "--manager", "torchtitan", "--steps", "9", log_dir=tmp_path) == [0]
    for log in tmp_path.glob("rank*.log"):
        log.unlink()
    assert titan(tmp_path, "two", "--initial", str(tmp_path / "one" / "step-9"), "--steps", "12") == [0, 0], rank_logs(tmp_path)
    for r in range(RANKS):
        assert "the data starts over" in (tmp_path / f"rank{r}.log").read_text()
        assert torch.load(tmp_path / f"two.loaded.rank{r}.pt", weights_only=False)["train_state"]["step"] == 9


@pytest.mark.slow
def test_a_loop_that_never_calls_load_is_not_restored_into_mid_run(tmp_path):
    """save() before any load(): the manager opens without restoring (the root's newest step
    would otherwise overwrite the live state at the first save) and says so."""
    assert titan(tmp_path, "first", "--steps", "6", root=tmp_path / "root") == [0, 0], rank_logs(tmp_path)
    assert titan(tmp_path, "fresh", "--steps", "4") == [0, 0], rank_logs(tmp_path)
    assert titan(tmp_path, "no_load", "--steps", "4", "--no-load", root=tmp_path / "root") == [0, 0], rank_logs(tmp_path)
    assert "save() before load()" in rank_logs(tmp_path)
    for want, got in zip(load(tmp_path, "fresh"), load(tmp_path, "no_load"), strict=True):
        assert_same_state(want, got)


class _Runs:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("a pickle ran code",))


@pytest.mark.slow
def test_a_torchtitan_folder_whose_pickles_run_code_is_refused_and_nothing_runs(tmp_path):
    """A step folder is not ckpt's (no manifest, no checksums): `.metadata` goes through the
    allowlist unpickler and the data loader's pickle must be plain values. A `.metadata` and a
    data loader state that would run code when loaded each make the start fail, saying why,
    and nothing runs."""
    assert titan(tmp_path, "evil_loader", "--manager", "torchtitan", "--steps", "3", "--evil-loader") == [0, 0], rank_logs(tmp_path)
    evil_md = tmp_path / "evil_md"
    shutil.copytree(tmp_path / "evil_loader" / "step-3", evil_md)
    (evil_md / ".metadata").write_bytes(pickle.dumps(_Runs()))
    for folder, why in ((evil_md, "refers to builtins.print"), (tmp_path / "evil_loader" / "step-3", "is not plain values")):
        for log in tmp_path.glob("rank*.log"):
            log.unlink()
        assert titan(tmp_path, "started", "--initial", str(folder), "--steps", "4") == [1, 1]
        logs = rank_logs(tmp_path)
        assert why in logs and "a pickle ran code" not in logs, logs
