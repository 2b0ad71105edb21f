"""A full disk, for real: a small tmpfs mounted as the local root or as the node agent's
spool, filled by a filler file until a save does not fit. The failing save says the disk is
full, leaves nothing a restore would pick, the previous checkpoint stays intact, and once the
filler is gone the next save commits.

Mounting a tmpfs needs root (CI runs the suite as root); elsewhere these tests are skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name
from tests.support.compare import assert_bitwise_equal
from tests.support.disk import fill, tmpfs

MB = 1 << 20


def keep_full(disk: Path, stop: threading.Event) -> None:
    """Fill `disk` and take back any room that appears on it, until `stop`."""
    with open(disk / "keeper", "wb", buffering=0) as f:
        while not stop.is_set():
            st = os.statvfs(disk)
            if st.f_bavail:
                with contextlib.suppress(OSError):  # another writer took some first
                    f.write(b"\0" * (st.f_bavail * st.f_frsize))
            time.sleep(0.005)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """About 1 MiB of weights in 16 tensors; with Adam's moments a checkpoint is ~3 MiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(16)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 128)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def restored_weights(root: Path, step_no: int) -> dict[str, torch.Tensor]:
    """Step `step_no`'s weights, restored by a new job (once the one that saved it is gone)."""
    model, opt = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False, restore=step_no) as cp:
        assert cp.restored_step == step_no
    return weights(model)


def states(root: Path) -> dict[int, str]:
    return {e.step: e.state for e in catalog.scan(Store(str(root)), deep=True)}


@pytest.mark.parametrize("on_error", ["raise", "log"])
def test_a_full_local_root_fails_the_save_clearly_keeps_the_previous_and_saves_again_once_freed(tmp_path, on_error, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    with tmpfs(tmp_path / "disk", 16) as disk:
        root = disk / "root"
        model, opt = make_model()
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=2),
                               keep=ckpt.Keep(last=10), on_error=on_error, save_on_exit=False) as cp:
            step(model, opt)
            cp.step_done()
            step(model, opt)
            cp.step_done()  # step 2: saved
            cp.wait()
            at_2 = weights(model)
            assert states(root) == {2: "committed"}
            kept = {f.name: f.read_bytes() for f in (root / step_dir_name(2)).iterdir()}
            size = sum(map(len, kept.values()))
            filler = fill(disk, size // 2)

            step(model, opt)
            cp.step_done()
            step(model, opt)
            cp.step_done()  # step 4: its save runs out of space in the background
            if on_error == "raise":  # at the next step_done, or when the save at 6 waits for it
                with pytest.raises(ckpt.SaveFailed, match="No space left on device") as err:
                    for _ in range(2):
                        step(model, opt)
                        cp.step_done()
                assert step_dir_name(4) in str(err.value) or "step 4" in str(err.value)
            else:
                cp.wait()  # logged; training goes on
                assert "No space left on device" in caplog.text
            # Nothing a restore would pick, nothing of the failed save left, the previous
            # checkpoint intact.
            assert states(root) == {2: "committed"}
            assert catalog.find(Store(str(root)), None).step == 2
            assert {f.name: f.read_bytes() for f in (root / step_dir_name(2)).iterdir()} == kept

            filler.unlink()  # space returns: the next save commits
            seen = {}
            while cp.step < 8:
                step(model, opt)
                cp.step_done()
                seen[cp.step] = weights(model)
            cp.wait()
        newest = catalog.find(Store(str(root)), None).step
        assert newest in seen and 4 < newest <= 8
        assert_bitwise_equal(restored_weights(root, newest), seen[newest], f"step {newest}")
        assert_bitwise_equal(restored_weights(root, 2), at_2, "step 2")


def held(capfd: pytest.CaptureFixture[str], step_no: int, timeout: float = 60) -> None:
    """Wait until rank 0's writer process says it is held before step `step_no`'s file."""
    said, deadline = "", time.monotonic() + timeout
    while f"ckpt fault: writer_process of rank 0 at step {step_no}:" not in said:
        assert time.monotonic() < deadline, f"the writer never reached step {step_no}: {said[-2000:]}"
        time.sleep(0.05)
        said += capfd.readouterr().err


def test_a_spool_that_runs_out_of_space_mid_write_gives_way_to_the_root_and_the_save_commits(tmp_path, caplog, capfd, monkeypatch):
    """The spool had room when the save chose it (the agent's check passed), but the disk
    filled before the rank's file was written (the writer process is held there while a
    filler takes the room): a real ENOSPC in the middle of the write. The rank writes its
    file to the root instead, saying why; the save commits there, nothing of it is left in
    the spool, the previous checkpoint stays intact. The next save goes to the root though
    the spool has room again, and the one after through the agent."""
    from ckpt.node.spool import Spool
    from tests.support.agentd import agent, until

    monkeypatch.setenv("CKPT_FAULT", "writer_process:0:2:sleep=3")  # step 2's writer waits before it writes
    caplog.set_level(logging.INFO, logger="ckpt")
    root = tmp_path / "root"
    # --keep-spool 0: no committed copy in the spool that the agent could evict to make room.
    with tmpfs(tmp_path / "spool", 16) as spool, agent(spool, tmp_path / "agent.log", "--keep-spool", "0") as a:
        model, opt = make_model()
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, spool=str(spool)) as cp:
            seen: dict[int, dict[str, torch.Tensor]] = {}

            def save(n: int, fill_meanwhile: bool = False) -> None:
                step(model, opt)
                cp.step_done()
                caplog.clear()
                seen[n] = weights(model)
                cp.save()
                if fill_meanwhile:
                    held(capfd, n)  # the room check passed; the writer process waits
                    filler = fill(spool, 0)
                cp.wait()
                if fill_meanwhile:
                    filler.unlink()
                assert cp.last_commit.step == n

            def in_root_only(n: int) -> bool:  # committed there by the rank, nothing in the spool
                return (root / step_dir_name(n) / "manifest.json").exists() and not list(spool.glob(f"jobs/*/{step_dir_name(n)}/*"))

            save(1)
            until("the agent to commit step 1", lambda: (root / step_dir_name(1) / "manifest.json").exists(), logs=a.text)
            until("the agent to drop step 1 from the spool", lambda: not list(spool.glob(f"jobs/*/{step_dir_name(1)}")), logs=a.text)
            at_1 = {f.name: f.read_bytes() for f in (root / step_dir_name(1)).iterdir() if f.is_file()}

            save(2, fill_meanwhile=True)  # no SaveFailed: the root took the file
            assert "cannot take this save" not in caplog.text  # the check passed: the write failed
            assert "the node spool ran out of space writing step 2" in caplog.text and "No space left on device" in caplog.text
            assert in_root_only(2)
            assert {f.name: f.read_bytes() for f in (root / step_dir_name(1)).iterdir() if f.is_file()} == at_1
            assert catalog.find(Store(str(root)), None).step == 2

            save(3)  # the spool has room again, but this one goes to the root
            assert "ran out of space under the last save: this one goes to" in caplog.text and in_root_only(3)

            until("the agent to be alive", lambda: Spool(str(spool)).agent() is not None, logs=a.text)
            save(4)  # and this one through the agent
            assert "cannot take this save" not in caplog.text and "goes to" not in caplog.text
            until("the agent to commit step 4", lambda: "step 4 rank 0 durable" in a.text() and (root / step_dir_name(4) / "manifest.json").exists(), logs=a.text)
    assert catalog.find(Store(str(root)), None).step == 4
    for n in (2, 3, 4):
        assert states(root)[n] == "committed"
        assert_bitwise_equal(restored_weights(root, n), seen[n], f"step {n}")


def test_a_spool_that_fills_under_a_runs_first_save_fails_it_and_the_next_goes_to_the_root(tmp_path, caplog):
    """A run's first save is DCP's planned save, whose ranks fail together: the spool filling
    under it fails that save, cleanly. The next one goes to the root and commits (planned by
    DCP again, it would fail the same way in the spool, whose check still passes)."""
    from tests.support.agentd import agent

    caplog.set_level(logging.INFO, logger="ckpt")
    root = tmp_path / "root"
    model, opt = make_model()
    step(model, opt)
    with ckpt.Checkpointer(str(tmp_path / "probe"), model=model, optimizer=opt, interval=None, save_on_exit=False) as probe:
        probe.save(blocking=True)  # what the spool's check will ask room for, and the file's size
        need, size = probe._slot.stager.bytes_staged, probe.last_commit.files["__0_0.distcp"].size
    assert need < size
    with tmpfs(tmp_path / "spool", 16) as spool, agent(spool, tmp_path / "agent.log"):
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, spool=str(spool), on_error="log") as cp:
            cp.step_done()
            fill(spool, (need + size) // 2)  # room for the check, not for the file
            cp.save(blocking=True)
            assert cp.last_commit is None and "No space left on device" in caplog.text
            assert "cannot take this save" not in caplog.text
            assert not list(spool.glob(f"jobs/*/{step_dir_name(1)}/*.distcp")) and not (root / step_dir_name(1) / "manifest.json").exists()
            step(model, opt)
            cp.step_done()
            cp.save(blocking=True)
            at_2 = weights(model)
            assert cp.last_commit is not None and cp.last_commit.step == 2
            assert "ran out of space under the last save: this one goes to" in caplog.text
    assert catalog.find(Store(str(root)), None).step == 2
    assert_bitwise_equal(restored_weights(root, 2), at_2, "step 2")


def many_small() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A model of 4,000 small tensors (a `.metadata` of about 0.9 MB), its optimizer and a
    training step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(500)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train() -> None:
        model(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, train


def test_a_disk_that_fills_at_the_metadata_of_a_save_again_fails_it_and_keeps_the_last(tmp_path):
    """A save of a layout saved before writes its data file, then rank 0 writes `.metadata`
    from the bytes it keeps for it (O_DIRECT). The disk filling right there fails that save
    as cleanly as anywhere else: no partial `.metadata`, the last checkpoint intact."""
    with tmpfs(tmp_path / "disk", 24) as disk:
        root = disk / "root"
        model, opt, train = many_small()

        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None,
                               keep=ckpt.Keep(last=10), save_on_exit=False) as cp:  # fmt: skip
            train()
            cp.step_done()
            cp.save(blocking=True)  # step 1: planned by DCP
            kept = {f.name: f.read_bytes() for f in (root / step_dir_name(1)).iterdir()}
            data = sum(len(v) for k, v in kept.items() if k.endswith(".distcp"))
            assert len(kept[".metadata"]) > 512 * 1024
            # Room for the data file again and a little more, not for .metadata (0.9 MB).
            filler = fill(disk, data + 64 * 1024 + len(kept[".metadata"]) // 2)
            train()
            cp.step_done()
            with pytest.raises(ckpt.SaveFailed, match=r"\.metadata.*No space left on device"):
                cp.save(blocking=True)  # step 2: laid out as step 1 was
            assert {s: v for s, v in states(root).items() if v != "incomplete"} == {1: "committed"}
            # Its data file went too (rank 0 removes a failed save's files): on a full disk it
            # would keep every later save from committing.
            assert not (root / step_dir_name(2)).exists()
            assert {f.name: f.read_bytes() for f in (root / step_dir_name(1)).iterdir()} == kept

            filler.unlink()  # space returns: the next save commits
            train()
            cp.step_done()
            cp.save(blocking=True)
            at_3 = weights(model)
        assert states(root)[3] == "committed"
        for p in model.parameters():
            p.data.zero_()
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
            assert cp.restored_step == 3
        assert_bitwise_equal(weights(model), at_3, "step 3")


def test_a_spool_that_fills_at_the_metadata_fails_that_save_and_the_next_goes_to_the_root(tmp_path, caplog, capfd, monkeypatch):
    """The same, with the node agent's spool filling (while the writer process is held before
    step 2's data file) to leave room for that file but not for rank 0's `.metadata`: that
    save fails cleanly and its file leaves the spool; the next, though the spool has room
    again, goes to the root and commits."""
    from tests.support.agentd import agent, until

    monkeypatch.setenv("CKPT_FAULT", "writer_process:0:2:sleep=3")
    caplog.set_level(logging.INFO, logger="ckpt")
    root = tmp_path / "root"
    model, opt, train = many_small()

    with tmpfs(tmp_path / "spool", 24) as spool, agent(spool, tmp_path / "agent.log", "--keep-spool", "0") as a:
        with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, spool=str(spool),
                               on_error="log", save_on_exit=False) as cp:  # fmt: skip
            train()
            cp.step_done()
            cp.save(blocking=True)  # step 1: planned by DCP, handed off
            until("the agent to commit step 1 and drop it from the spool", lambda: not list(spool.glob(f"jobs/*/{step_dir_name(1)}")), logs=a.text)
            data = sum(f.size for n, f in cp.last_commit.files.items() if n.endswith(".distcp"))
            metadata = cp.last_commit.files[".metadata"].size
            assert metadata > 512 * 1024
            train()
            cp.step_done()
            cp.save()  # step 2: laid out as step 1 was
            held(capfd, 2)  # the room check passed; the writer process waits
            filler = fill(spool, data + 64 * 1024 + metadata // 2)  # room for the data file, not for .metadata
            cp.wait()
            assert cp.last_commit.step == 1 and "No space left on device" in caplog.text
            assert "cannot take this save" not in caplog.text
            assert not list(spool.glob(f"jobs/*/{step_dir_name(2)}/*"))  # the failed save's file is gone
            filler.unlink()
            caplog.clear()
            train()
            cp.step_done()
            cp.save(blocking=True)  # step 3: the root
            at_3 = weights(model)
            assert cp.last_commit.step == 3 and "ran out of space under the last save: this one goes to" in caplog.text
    assert states(root)[3] == "committed" and states(root).get(2) != "committed"
    for p in model.parameters():
        p.data.zero_()
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        assert cp.restored_step == 3
    assert_bitwise_equal(weights(model), at_3, "step 3")


def test_with_two_nodes_the_rank_whose_spool_fills_mid_write_goes_to_the_root_while_the_other_hands_off(tmp_path):
    """Two ranks, each on a "node" of its own with its own agent; rank 0's spool is a real
    tmpfs. Rank 0's writer process is held just before it writes step 10's file (after the
    spool's room check passed), and the tmpfs is filled meanwhile: a real ENOSPC in the
    write. Rank 0 writes its file to the root and marks it durable there; rank 1 hands its
    file to its agent as usual; the checkpoint commits once, with both ranks' files, and
    restores to what the ranks held."""
    from tests.support.agentd import agent, until
    from tests.support.cli import ckpt_cli
    from tests.support.jobs import RANKS, WORKER, assert_same_training_state, dumps, rank_logs
    from tests.support.launch import start, wait

    root, out = tmp_path / "root", tmp_path / "out"
    (tmp_path / "node1").mkdir()
    env = {
        "TEST_SPOOL_OF_RANK": str(tmp_path / "node{rank}"),
        "LOCAL_WORLD_SIZE": "1",  # one rank per "node": the spool's check asks for one rank's room
        "CKPT_FAULT": "writer_process:0:10:sleep=6",
    }
    logs = lambda: rank_logs(tmp_path)  # noqa: E731
    # --keep-spool 0 on node 0: no committed copy there that its agent could evict for room.
    with tmpfs(tmp_path / "node0", 16) as node0, agent(node0, tmp_path / "agent0.log", "--keep-spool", "0"), agent(tmp_path / "node1", tmp_path / "agent1.log") as a1:
        procs = start(RANKS, WORKER, *map(str, ("--mode", "plain", "--root", root, "--steps", 10, "--every", 5, "--step-sleep", 0.5, "--out", out)), env=env, log_dir=tmp_path)
        until("node 0's agent to drop step 5", lambda: not list(node0.glob(f"jobs/*/{step_dir_name(5)}")), logs=logs)
        # The room check passed; the writer process is held before the write.
        until("rank 0's writer to be held", lambda: "ckpt fault: writer_process of rank 0 at step 10:" in (tmp_path / "rank0.log").read_text(), logs=logs)
        # Full, and kept full until the ranks are done: the agent frees a little now and then
        # (its own files), which the small file of this test would otherwise fit into.
        stop = threading.Event()
        keeper = threading.Thread(target=keep_full, args=(node0, stop))
        keeper.start()
        try:
            assert wait(procs) == [0] * RANKS, logs()
        finally:
            stop.set()
            keeper.join()
        until("step 10 to commit", lambda: (root / step_dir_name(10) / "manifest.json").exists(), logs=lambda: logs() + a1.text())
    rank0 = (tmp_path / "rank0.log").read_text()
    assert "the node spool ran out of space writing step 10" in rank0 and "No space left on device" in rank0, rank0[-3000:]
    assert "ran out of space" not in (tmp_path / "rank1.log").read_text()
    assert "step 10 rank 1 durable" in (tmp_path / "agent1.log").read_text()  # rank 1 handed off to its agent
    durable = sorted(p.name.split(".")[1] for p in (root / step_dir_name(10) / ".durable").iterdir())
    assert [d for d in durable if d not in ("committed", "draft")] == ["rank-00000", "rank-00001"]  # and rank 0's draft, the commit's record
    manifest = json.loads((root / step_dir_name(10) / "manifest.json").read_text())
    assert manifest["step"] == 10 and {f["rank"] for f in manifest["files"].values()} >= {0, 1}
    rc = ckpt_cli("verify", root, "--deep")
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert [d["step"] for d in dumps(out)] == [10] * RANKS
    # A restart restores step 10 from the root, exactly what the ranks held.
    again = start(RANKS, WORKER, *map(str, ("--mode", "plain", "--root", root, "--steps", 10, "--every", 5, "--out", tmp_path / "again")), log_dir=tmp_path)
    assert wait(again) == [0] * RANKS, logs()
    assert [d["restored_step"] for d in dumps(tmp_path / "again")] == [10] * RANKS
    assert_same_training_state(dumps(tmp_path / "again"), dumps(out))
