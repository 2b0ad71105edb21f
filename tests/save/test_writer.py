"""The write path: the staging arena, the writer process, O_DIRECT and the file layout.

Real files on real filesystems (the test's ext4 directory and /dev/shm's tmpfs, which has no
O_DIRECT on older kernels), a real writer process, and files read back by plain
`torch.distributed.checkpoint.load` and `torch.load`.
"""

from __future__ import annotations

import contextlib
import mmap
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
import torch.distributed.checkpoint as dcp
import xxhash

import ckpt
from ckpt.save.filewrite import write_file
from ckpt.storage.store import Store

MB = 1 << 20


def _takes_o_direct(directory: Path) -> bool:
    """Does this filesystem open files with O_DIRECT (tmpfs on older kernels does not)?"""
    probe = directory / ".o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _segment(size: int) -> mmap.mmap:
    seg = mmap.mmap(-1, size)
    block = os.urandom(MB)
    for off in range(0, size, MB):
        seg[off : off + MB] = block[: min(MB, size - off)]
    seg[:16] = b"first-bytes-here"
    return seg


FILESYSTEMS = ["tmp_path"] + (["/dev/shm"] if os.path.isdir("/dev/shm") else [])


@pytest.mark.parametrize("where", FILESYSTEMS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_pieces_land_in_order_with_their_checksum_on_any_filesystem(tmp_path, where, direct):
    root = tmp_path if where == "tmp_path" else Path(where)
    seg = _segment(24 * MB)
    pieces = [
        b"header" * 50,  # unaligned literal, then an aligned arena run: goes through the bounce
        (0, 4096, 3 * MB + 5),
        b"",
        (0, 7, 4000),  # unaligned address
        b"\0" * (4096 - (300 + 3 * MB + 5 + 4000) % 4096),  # pad to a page
        (0, 8192, 18 * MB),  # aligned address and file offset: written without a copy
        (0, 0, 0),
        b"tail",
    ]
    want = b"".join(p if isinstance(p, bytes) else seg[p[1] : p[1] + p[2]] for p in pieces)
    store = Store(root / f"w-{os.getpid()}-{direct}")
    try:
        entry = write_file(store, "step-0000000001/__0_0.distcp", pieces, {0: memoryview(seg)}, rank=3, direct=direct)
        got = Path(store.path("step-0000000001/__0_0.distcp")).read_bytes()
    finally:
        store.fs.rm(store.root, recursive=True)
    assert got == want
    # 22 MB: blocks of 1 MiB, each with its own xxh3-64, the file's checksum that of theirs
    blocks = [xxhash.xxh3_64(want[i : i + MB]).hexdigest() for i in range(0, len(want), MB)]
    whole = xxhash.xxh3_64(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()
    assert (entry.size, entry.rank, entry.block, entry.blocks) == (len(want), 3, MB, tuple(blocks))
    assert entry.checksum == f"xxh3_64-blocks:{whole}"


@pytest.mark.parametrize("limits", [(64 << 10, 3, 16 << 10), (1 << 20, 512, 8 << 20)], ids=["tiny", "small"])
def test_direct_writes_queued_in_batches_land_in_order_whatever_the_batch(tmp_path, monkeypatch, limits):
    """O_DIRECT writes are queued and sent in batches (bytes, pieces), the bounce buffer's
    pages held until their batch is written: with tiny limits every flush path runs."""
    from ckpt.save import filewrite
    batch, iov, bounce = limits
    monkeypatch.setattr(filewrite, "_DIRECT_BATCH", batch)
    monkeypatch.setattr(filewrite, "_IOV_MAX", iov)
    monkeypatch.setattr(filewrite, "_BOUNCE", bounce)
    seg = _segment(16 * MB)
    pieces = _prefix_pieces() + [b"x" * 70000, (0, 8 * MB, 300000), b"y" * 5]  # more than a bounce buffer
    want = b"".join(p if isinstance(p, bytes) else seg[p[1] : p[1] + p[2]] for p in pieces)
    store = Store(tmp_path)
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: nothing to check here")
    direct = []
    finish = filewrite._DirectFile.finish
    monkeypatch.setattr(filewrite._DirectFile, "finish", lambda self: (direct.append(self), finish(self))[1])
    entry = write_file(store, "f", pieces, {0: memoryview(seg)}, rank=0)
    assert len(direct) == 1  # the O_DIRECT path wrote it
    assert (tmp_path / "f").read_bytes() == want
    plain = write_file(store, "g", pieces, {0: memoryview(seg)}, rank=0, direct=False)
    assert entry == plain  # the same checksums as the buffered path's


def _prefix_pieces(seg: int = 0) -> list:
    """Pieces as a layout saved again has them: headers, packed small ranges, page-aligned
    large ones (one with a tail that is not a whole page), padding, an empty piece."""
    pieces: list = [b"H" * 300]
    for i in range(40):  # small tensors: header and trailer around each packed range
        pieces += [(seg, 64 * 1024 + i * 192, 100 + i), b"t" * (50 + i)]
    size = sum(len(p) if isinstance(p, bytes) else p[2] for p in pieces)
    pieces += [b"\0" * (-size % 4096), (seg, 4 * MB, 2 * MB + 700), b"trailer", b""]
    size = sum(len(p) if isinstance(p, bytes) else p[2] for p in pieces)
    pieces += [b"\0" * (-size % 4096), (seg, 8 * MB, 3 * MB), (seg, 12 * MB + 5, 5000), b"end"]
    return pieces


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_layout_written_again_from_its_gathered_prefix_is_the_file_written_piece_by_piece(tmp_path, direct):
    from ckpt.save.prefix import Prefixes

    seg = _segment(16 * MB)
    pieces = _prefix_pieces()
    rest = [b"pickled objects", (0, 9, 33)]
    store = Store(tmp_path)
    prefixes = Prefixes()
    prefixes.learn(7, pieces)
    for save in range(3):  # the arena's bytes change between saves: each write has the new ones
        seg[64 * 1024 : 64 * 1024 + 16] = f"save {save:11d}".encode()
        seg[12 * MB + 5 : 12 * MB + 21] = f"tail {save:11d}".encode()
        plain = write_file(store, f"plain-{save}", pieces + rest, {0: memoryview(seg)}, rank=1, direct=direct)
        got = prefixes.write(store, f"fixed-{save}", 7, rest, {0: memoryview(seg)}, rank=1)
        assert got == plain
        assert (tmp_path / f"fixed-{save}").read_bytes() == (tmp_path / f"plain-{save}").read_bytes()
    # the image holds the literal pieces and the unaligned ranges, not the page-aligned ones
    built = prefixes.get(7, {0: memoryview(seg)})
    assert built is not None and built.nbytes < 64 * 1024
    prefixes.drop()
    seg.close()  # nothing of the prefix holds the segment any more


@pytest.mark.parametrize("where", FILESYSTEMS)
def test_a_whole_file_image_writes_its_bytes_again_and_again_without_the_page_cache(tmp_path, where):
    from ckpt.format.checksum import checksum
    from ckpt.save.prefix import Image

    root = tmp_path if where == "tmp_path" else Path(where)
    data = os.urandom(3 * MB + 1234)  # not a whole number of pages: the tail is written buffered
    image = Image(data, "xxh3_64")
    store = Store(root / f"img-{os.getpid()}")
    try:
        for save in range(3):
            entry = image.write(store, f"step-{save}/.metadata")
            assert Path(store.path(f"step-{save}/.metadata")).read_bytes() == data
            assert (entry.size, entry.checksum, entry.rank) == (len(data), checksum(data), -1)
    finally:
        store.fs.rm(store.root, recursive=True)


def test_the_writer_process_keeps_a_layouts_fixed_pieces_and_lets_go_of_dead_segments(tmp_path):
    from ckpt.save.arena import Arena
    from ckpt.save.writer_proc import ProcessSink

    store = Store(tmp_path)
    arena = Arena()
    a = arena.empty((2 * MB,), torch.uint8)
    seg_a = next(iter(arena.segments.values()))
    pieces = _prefix_pieces(seg_a.id)
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


class Holder:
    """Tensors as an `extra` of the Checkpointer."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(sd)


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


def test_direct_io_writes_aligned_tensors_straight_from_shared_memory(tmp_path, monkeypatch):
    import ckpt.save.filewrite as fw

    seen = []
    finish = fw._DirectFile.finish
    monkeypatch.setattr(fw._DirectFile, "finish", lambda self: (seen.append(self.zero_copy), finish(self))[1])
    seg = _segment(8 * MB)
    head = b"h" * 700
    pieces = [head, b"\0" * (4096 - len(head)), (0, 0, 5 * MB + 100), b"tail"]
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: nothing to check here")
    write_file(Store(tmp_path), "f", pieces, {0: memoryview(seg)}, direct=True)
    assert seen == [5 * MB]


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
