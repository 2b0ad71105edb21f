"""Where a save's bytes are written (ckpt.save.writer_proc): a writer process per rank, fed the
arena's segments once, that keeps a layout's fixed pieces, never imports torch, dies with its
trainer, fails only its own save when killed or hung (and a new one takes over), and gives way
to a thread when it cannot take the storage options. Real processes and real files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt.save.filewrite import write_file
from ckpt.storage.store import Store
from tests.support.writes import MB, prefix_pieces


def test_the_writer_process_keeps_a_layouts_fixed_pieces_and_lets_go_of_dead_segments(tmp_path):
    from ckpt.save.arena import Arena
    from ckpt.save.writer_proc import ProcessSink

    store = Store(tmp_path)
    arena = Arena()
    a = arena.empty((2 * MB,), torch.uint8)
    seg_a = next(iter(arena.segments.values()))
    pieces = prefix_pieces(seg_a.id)
    sink = ProcessSink(store)
    try:
        for save in range(2):
            a[:16] = torch.frombuffer(bytearray(f"save {save:11d}".encode()), dtype=torch.uint8)
            want = write_file(store, f"plain-{save}", pieces + [b"obj"], {seg_a.id: seg_a.view}, rank=0)
            got = sink.write(f"fixed-{save}", pieces + [b"obj"], [seg_a], 0, save, fixed=(3, len(pieces)))
            assert got == want and (tmp_path / f"fixed-{save}").read_bytes() == (tmp_path / f"plain-{save}").read_bytes()
        assert sink._prefix_sent == 3
        # a write of its own layout in between (the writer drops the prefix): sent again after
        sink.write("between", [b"x" * 10], [seg_a], 0, 2)
        got = sink.write("again", pieces + [b"obj"], [seg_a], 0, 3, fixed=(3, len(pieces)))
        assert got == want and (tmp_path / "again").read_bytes() == (tmp_path / "plain-1").read_bytes()
        maps = Path(f"/proc/{sink.proc.pid}/maps").read_text()
        assert f"ckpt-arena-{os.getpid()}-{seg_a.id} " in maps
        # a new arena (the state was staged afresh): the old segment is unmapped in the writer
        other = Arena()
        b = other.empty((MB,), torch.uint8)
        b.fill_(5)
        seg_b = next(iter(other.segments.values()))
        got = sink.write("new", [b"x" * 10, (seg_b.id, 0, MB)], [seg_b], 0, 2)
        assert (tmp_path / "new").read_bytes() == b"x" * 10 + b"\5" * MB
        maps = Path(f"/proc/{sink.proc.pid}/maps").read_text()
        assert f"ckpt-arena-{os.getpid()}-{seg_a.id} " not in maps
        assert f"ckpt-arena-{os.getpid()}-{seg_b.id} " in maps
    finally:
        sink.close()


def _train(root: Path, steps: int, every: int) -> tuple[ckpt.Checkpointer, list[int]]:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pids = []
    with ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=every), on_error="log", keep=ckpt.Keep(last=100), handle_sigterm=False) as cp:
        for _ in range(steps):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
            cp.wait()
            if cp._slot.sinks.get(cp.store.url) is not None:
                pids.append(cp._slot.sinks.get(cp.store.url).proc.pid)
    return cp, pids


def test_a_writer_process_killed_mid_save_fails_only_that_save_and_a_new_one_takes_over(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_FAULT", "writer_process:0:4")  # the writer SIGKILLs itself at step 4
    cp, pids = _train(tmp_path, steps=8, every=2)
    committed = sorted(int(p.parent.name[5:]) for p in tmp_path.glob("step-*/manifest.json"))
    assert committed == [2, 6, 8]  # step 4 failed, nothing of it committed
    assert len(set(pids)) == 2  # one writer process, then its replacement
    assert cp.last_commit is not None and cp.last_commit.step == 8


def test_the_writer_process_dies_with_a_killed_trainer(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time, torch, ckpt
        model = torch.nn.Linear(8, 8)
        with ckpt.Checkpointer({str(tmp_path / "root")!r}, model=model, interval=None, handle_sigterm=False) as cp:
            cp.step_done()
            cp.save()  # the writer stalls in this save (CKPT_FAULT below)
            while cp._slot.sinks.get(cp.store.url) is None:
                time.sleep(0.05)
            print(cp._slot.sinks.get(cp.store.url).proc.pid, flush=True)
            time.sleep(60)
        """
    )
    env = {**os.environ, "CKPT_FAULT": "writer_process:*:*:sleep=60"}
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        writer_pid = int(trainer.stdout.readline())
        assert _alive(writer_pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        deadline = time.time() + 10
        while _alive(writer_pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(writer_pid), "the writer process outlived its trainer"
    finally:
        trainer.kill()
    assert not list((tmp_path / "root").glob("step-*/manifest.json"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_writer_process_never_imports_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import sys, ckpt.save.writer_proc; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_a_relative_root_stays_where_it_was_when_the_process_changes_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    model = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer("ckpts", model=model, interval=None, handle_sigterm=False) as cp:
        monkeypatch.chdir(tmp_path / "b")  # before the first save starts the writer
        cp.step_done()
        cp.save(blocking=True)
    assert sorted(p.name for p in (tmp_path / "a/ckpts/step-0000000001").iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert not (tmp_path / "b/ckpts").exists()


def _a_save_the_writer_fails_then_one_that_commits(tmp_path: Path, model: torch.nn.Module, stall: Any, match: str, within_s: float) -> None:
    """Step 1 commits (the writer process starts); `stall(cp)` stops the writer; the save of
    step 2 fails with `match` within `within_s`; step 3 commits with a new writer process."""
    with ckpt.Checkpointer(tmp_path, model=model, interval=None, timeout_s=2, handle_sigterm=False, on_error="log") as cp:
        cp.step_done()
        cp.save(blocking=True)
        assert type(cp._slot.sinks.get(cp.store.url)).__name__ == "ProcessSink"
        stall(cp)
        cp.step_done()
        started = time.monotonic()
        with pytest.raises(ckpt.SaveFailed, match=match):
            cp.on_error = "raise"
            cp.save(blocking=True)
        assert time.monotonic() - started < within_s
        cp.step_done()
        cp.save(blocking=True)
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/manifest.json")) == ["step-0000000001", "step-0000000003"]


def test_a_hung_writer_fails_its_save_within_the_timeout_and_the_next_save_commits(tmp_path):
    # Stopped whole (a writer stuck in a hung store): no answer to the message before the
    # write (its prefix), or no bytes moved.
    _a_save_the_writer_fails_then_one_that_commits(
        tmp_path, torch.nn.Linear(4, 4), lambda cp: os.kill(cp._slot.sinks.get(cp.store.url).proc.pid, signal.SIGSTOP),
        "gave no answer within 2 s|moved no bytes for 2 s", 20,
    )


def test_a_writer_that_moves_no_bytes_fails_its_save_after_timeout_s_not_after_the_whole_writes_deadline(tmp_path, monkeypatch):
    """A writer process whose store stopped taking bytes, while the process itself runs (its
    heartbeat thread too): the save fails once no bytes moved for timeout_s. The whole write's
    deadline (timeout_s + its bytes at 1 MiB/s: 50 s here, hours for a large shard) is only
    the bound for a write that moves, slowly."""
    monkeypatch.setenv("CKPT_FAULT", "writer_process:0:2:sleep=120")  # the writer of step 2 stops before writing
    model = torch.nn.Linear(2048, 6144)  # 48 MB of parameters
    _a_save_the_writer_fails_then_one_that_commits(tmp_path, model, lambda cp: None, "moved no bytes for 2 s", 15)


def test_storage_options_the_writer_process_cannot_take_fall_back_to_a_thread(tmp_path, caplog):
    model = torch.nn.Linear(4, 4)
    options = {"auto_mkdir": True, "unsent": lambda: None}  # a callable cannot be pickled
    with ckpt.Checkpointer(str(tmp_path), model=model, interval=None, storage_options=options, handle_sigterm=False) as cp:
        cp.step_done()
        cp.save(blocking=True)
        assert type(cp._slot.sinks.get(cp.store.url)).__name__ == "ThreadSink"
    assert "cannot start the writer process" in caplog.text
    assert (tmp_path / "step-0000000001/manifest.json").exists()


def test_sigterm_to_the_whole_process_group_still_commits_the_preemption_checkpoint(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time, torch, ckpt
        model = torch.nn.Linear(8, 8)
        with ckpt.Checkpointer({str(tmp_path / "root")!r}, model=model, interval=ckpt.Every(steps=2)) as cp:
            for i in range(1000):
                time.sleep(0.05)
                cp.step_done()
                if cp._slot.sinks.get(cp.store.url) is not None and i == 5:
                    print("ready", flush=True)
        """
    )
    env = {**os.environ, "CKPT_FAULT": "writer_process:*:*:sleep=0.5"}  # every write is slow
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        os.killpg(trainer.pid, signal.SIGTERM)  # what scancel and some pod runtimes do
        assert trainer.wait(timeout=60) == 143
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
    committed = sorted(int(p.parent.name[5:]) for p in (tmp_path / "root").glob("step-*/manifest.json"))
    assert committed and committed[-1] >= 6
