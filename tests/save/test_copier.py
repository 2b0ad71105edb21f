"""A save's staging copies made while its file is written (ckpt.save.copier, filewrite.Gate).

What must hold: the writer never reads an arena range before the copies have reached it
(a file written while they go on holds the state of its own step, never the bytes the
buffers held before); it writes what is staged while it waits, so the disk starts on the
first batch; a copy that fails fails the write, which leaves no file; a save that fails
that way fails on every rank and the next one commits.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import SaveFailed
from ckpt.save.filewrite import GATE_FAILED, GATE_OPEN, GATE_WORD, Gate, write_file
from ckpt.save.prefix import Prefixes
from ckpt.save.resave import Resaver
from ckpt.save.stage import Stager
from ckpt.storage.store import Store
from tests.support import launch
from tests.support.compare import assert_bitwise_equal
from tests.support.jobs import states

MB = 1 << 20
PAGE = 4096


def _segment(size: int) -> memoryview:
    import mmap

    return memoryview(mmap.mmap(-1, size))


def _pieces() -> list:
    """A file of headers and arena ranges, as dcp_write lays them out: small ranges first,
    then large ones on pages, one with an unaligned tail (it goes through the prefix's image)."""
    return [
        b"header-0" * 10,
        (0, 100, 3000),  # small, unaligned
        b"\0" * (PAGE - 80 - 3000 % PAGE),
        (0, 1 * MB, 2 * MB),  # on a page
        b"trailer+header" * 3,
        b"\0" * (PAGE - 42),
        (0, 4 * MB, 3 * MB + 123),  # on a page, with a tail
        b"trailer" * 5,
        (0, 8 * MB, 4 * MB),
    ]


def _positions(pieces: list) -> list[tuple[int, tuple[int, int, int]]]:
    out, pos = [], 0
    for p in pieces:
        n = len(p) if isinstance(p, bytes) else p[2]
        if not isinstance(p, bytes):
            out.append((pos, p))
        pos += n
    return out


class _Copies:
    """Copies into the arena in file order, batch by batch, telling a pipe after each: the
    trainer's side, with `new` the bytes each range gets (it held `old` before)."""

    def __init__(self, seg: memoryview, pieces: list, new: bytes, wait_for_file: Path | None = None) -> None:
        self.seg, self.new, self.wait_for_file = seg, new, wait_for_file
        self.ranges = _positions(pieces)
        self.read, self.write = os.pipe()
        self.grew: list[bool] = []
        self.error: BaseException | None = None

    def run(self, fail_after: int | None = None) -> None:
        try:
            for i, (pos, (_, off, n)) in enumerate(self.ranges):
                time.sleep(0.02)  # a writer that reads ahead would find the old bytes
                self.seg[off : off + n] = self.new[off : off + n]
                if fail_after == i:
                    os.write(self.write, GATE_WORD.pack(GATE_FAILED))
                    return
                nxt = self.ranges[i + 1][0] if i + 1 < len(self.ranges) else GATE_OPEN
                os.write(self.write, GATE_WORD.pack(nxt)[:5])  # a word split over two writes
                time.sleep(0.01)
                os.write(self.write, GATE_WORD.pack(nxt)[5:])
                if i == 1 and self.wait_for_file is not None:
                    # The writer has the first two ranges: it must write them before it waits.
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and not (self.wait_for_file.exists() and self.wait_for_file.stat().st_size >= pos + n):
                        time.sleep(0.005)
                    self.grew.append(self.wait_for_file.exists() and self.wait_for_file.stat().st_size >= pos + n)
        except BaseException as e:
            self.error = e
        finally:
            os.close(self.write)


@pytest.mark.parametrize("prefix", [False, True], ids=["pieces", "prefix"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_gated_write_reads_each_range_only_once_it_is_staged_and_writes_while_it_waits(tmp_path, monkeypatch, direct, prefix):
    if prefix and not direct:  # Prefixes.write takes O_DIRECT where the filesystem has it
        monkeypatch.delattr(os, "O_DIRECT")
    seg = _segment(16 * MB)
    old = os.urandom(16 * MB)
    new = os.urandom(16 * MB)
    seg[:] = old
    pieces = _pieces()
    store = Store(tmp_path)
    # The file as it must be: every range with its new bytes, written without a gate.
    want_seg = _segment(16 * MB)
    want_seg[:] = new
    want = write_file(store, "want", pieces, {0: want_seg}, rank=0, direct=direct)
    copies = _Copies(seg, pieces, new, wait_for_file=tmp_path / "got" if direct else None)
    t = threading.Thread(target=copies.run)
    t.start()
    gate = Gate(copies.read)
    try:
        if prefix:
            prefixes = Prefixes()
            prefixes.learn(1, pieces[:-2])
            got = prefixes.write(store, "got", 1, pieces[-2:], {0: seg}, 0, gate)
        else:
            got = write_file(store, "got", pieces, {0: seg}, rank=0, direct=direct, gate=gate)
    finally:
        t.join()
        gate.close()
    assert copies.error is None
    assert got == want
    assert (tmp_path / "got").read_bytes() == (tmp_path / "want").read_bytes()
    if direct:  # O_DIRECT writes land as they are made: the file grew before the copies ended
        assert copies.grew == [True]


@pytest.mark.parametrize("how", ["failed", "ended"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_copy_that_fails_fails_the_write_and_leaves_no_file(tmp_path, direct, how):
    seg = _segment(16 * MB)
    pieces = _pieces()
    copies = _Copies(seg, pieces, os.urandom(16 * MB))
    t = threading.Thread(target=copies.run, kwargs={"fail_after": 1} if how == "failed" else {})
    if how == "ended":  # the trainer died: the pipe ends before every copy is told
        os.write(copies.write, GATE_WORD.pack(_positions(pieces)[1][0]))
        os.close(copies.write)
    else:
        t.start()
    gate = Gate(copies.read)
    try:
        with pytest.raises(SaveFailed, match="failed" if how == "failed" else "ended without finishing"):
            write_file(Store(tmp_path), "f", pieces, {0: seg}, rank=0, direct=direct, gate=gate)
    finally:
        if how == "failed":
            t.join()
        gate.close()
    assert not (tmp_path / "f").exists()


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(6)} | {"b": torch.randn(7, generator=g)},
        "optim": {"state": {0: {"exp_avg": torch.randn(300, 1000, generator=g), "step": torch.tensor(float(step))}}},
        "step": step,
    }


def test_the_copies_come_in_file_order_each_batch_marked_where_the_file_is_staged_to(tmp_path):
    """Layout.copy_order against the file itself: filled with a pattern that names each
    tensor, the file says where each one's bytes lie; every byte of a tensor before a
    batch's mark is copied by that batch or an earlier one, and each copy is made once."""
    from ckpt.collectives import Group
    from ckpt.save.commit import Save, Source, persist
    from ckpt.save.upload import Direct
    from ckpt.save.writer_proc import ThreadSink

    stager, resaver = Stager(), Resaver()

    def write(step: int, staged: dict) -> None:
        source = Source(staged, ThreadSink, resaver, stager.arenas, layout=resaver.fitting(staged))
        persist(Save(step, Store(tmp_path), Group(None, 0, 1)), source, Direct())

    def save(step: int) -> dict:
        staged, copies = stager.prepare(_state(step), defer=lambda path, t: True)
        copies.run()
        write(step, staged)
        return staged

    save(1)
    staged = save(2)
    layout = resaver.layout
    assert layout is not None and layout.generation == 1
    _, copies = stager.prepare(_state(3), defer=lambda path, t: True)
    batches, rest = layout.copy_order(copies.pairs, stager.arenas)
    assert rest == []  # one rank: its file holds every tensor
    assert layout.copy_order(copies.pairs, stager.arenas) == (batches, rest)  # worked out once, the same
    # Each buffer filled with its own index, the file written: where each lies in it.
    for i, (dst, _) in enumerate(copies.pairs):
        dst.reshape(-1).view(torch.uint8).fill_(i + 1)
    write(3, staged)
    data = (tmp_path / "step-0000000003" / layout.name).read_bytes()
    big = [(i, dst) for i, (dst, _) in enumerate(copies.pairs) if dst.numel() * dst.element_size() >= 256 << 10]
    where = {i: data.index(bytes([i + 1]) * dst.numel() * dst.element_size()) for i, dst in big}
    assert len(big) == 7 and len(copies.pairs) == 9
    marks = [mark for mark, _ in batches]
    assert marks == sorted(marks) and marks[-1] == GATE_OPEN and len(batches) >= 3
    index = {id(dst): i for i, (dst, _) in enumerate(copies.pairs)}
    seen: list[int] = []
    for mark, pairs in batches:
        seen += [index[id(dst)] for dst, _ in pairs]
        for i, _ in big:
            if where[i] < mark:
                assert i in seen, (i, where[i], mark)
    assert sorted(seen) == list(range(len(copies.pairs)))


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_save_written_while_its_copies_are_made_holds_its_own_step_and_its_file_grows_before_they_end(tmp_path, monkeypatch, writer):
    """The buffers hold the last save's state when the next save's copies begin: a writer
    that read a range before its copy would commit the old bytes. The copies pause after
    each batch; the file is written meanwhile."""
    monkeypatch.setenv("CKPT_WRITER", writer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()

    grew: list[int] = []
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        for step in range(1, 4):
            train()
            cp.step_done()
            if step == 3:
                monkeypatch.setenv("CKPT_FAULT", "copying:0:*:sleep=0.3")
                saved = {k: v.clone() for k, v in model.state_dict().items()}
                saved_opt = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
            cp.save()
            if step == 3:
                data = tmp_path / "step-0000000003" / "__0_0.distcp"
                while not cp._slot._staged.is_set():
                    grew.append(data.stat().st_size if data.exists() else 0)
                    time.sleep(0.01)
            cp.wait()
            assert cp.last_commit is not None and cp.last_commit.step == step
        monkeypatch.delenv("CKPT_FAULT")
        train()  # the live state moves on: the checkpoint must not
    assert max(grew) >= 4 << 20, grew  # the first batches were on disk while the copies went on
    model2 = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    with ckpt.Checkpointer(str(tmp_path), model=model2, optimizer=opt2, interval=None, save_on_exit=False) as cp:
        assert cp.restored_step == 3
    assert_bitwise_equal(model2.state_dict(), saved, "model")
    assert_bitwise_equal({(i, k): v for i, st in enumerate(opt2.state.values()) for k, v in st.items()}, saved_opt, "optimizer")


def test_a_copy_that_fails_while_the_file_is_written_fails_the_save_on_every_rank_and_the_next_commits(tmp_path):
    """Rank 1's copies fail after their first batch at step 10, its writer under way: both
    ranks' saves of step 10 fail at once (no rank waits for the timeout), training goes on
    (on_error="log"), and the next saves commit."""
    root, log_dir = tmp_path / "root", tmp_path / "logs"
    log_dir.mkdir()
    started = time.monotonic()
    args = ("--mode", "fsdp2", "--root", str(root), "--steps", "20", "--every", "5", "--timeout", "120", "--on-error", "log")
    launch.run_worker(2, *args, env={"CKPT_FAULT": "copying:1:10:raise"},
                      log_dir=log_dir, timeout=300)  # fmt: skip
    took = time.monotonic() - started
    assert states(root) == {5: "committed", 15: "committed", 20: "committed"}
    log0, log1 = ((log_dir / f"rank{r}.log").read_text() for r in range(2))
    assert "commit of step-0000000010 failed: SaveFailed: rank 1: RuntimeError: ckpt fault: copying of rank 1 at step 10" in log0, log0[-3000:]
    assert "a staging copy of step 10 failed" in log1 and "RuntimeError: ckpt fault: copying of rank 1 at step 10" in log1, log1[-3000:]
    assert took < 90, f"the job took {took:.0f} s: a rank waited for the failed one"


def test_a_rank_skips_the_copies_its_file_does_not_hold_and_the_checkpoint_restores_exactly(tmp_path):
    """A replicated model: DCP saves each tensor in one rank's file. After the first save
    (planned by DCP, every copy made), each rank copies only what its own file holds, the
    two together every large tensor once; the checkpoint restores bit for bit on two ranks."""
    root = tmp_path / "root"
    for mode in ("save", "load"):
        codes = launch.run(2, launch.WORKERS / "copier_worker.py", mode, str(root), str(tmp_path), log_dir=tmp_path, timeout=180)
        assert codes == [0, 0], [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
    saved = [torch.load(tmp_path / f"save-rank{r}.pt", weights_only=False) for r in range(2)]
    loaded = [torch.load(tmp_path / f"load-rank{r}.pt", weights_only=False) for r in range(2)]
    total = saved[0]["total"]
    assert total > 12 * MB
    for r in range(2):
        first, *later = saved[r]["copied"]
        assert first >= total, (r, saved[r]["copied"])  # planned by DCP: all of it
        for n in later:
            assert n < 0.75 * total, (r, saved[r]["copied"])  # about its half, not all of it
        assert_bitwise_equal(loaded[r]["state"], saved[r]["state"], f"rank {r}")
    for a, b in zip(saved[0]["copied"][1:], saved[1]["copied"][1:], strict=True):
        assert a + b >= total * 0.99, saved  # every large tensor, by one rank or the other


class _PairOptimizer(torch.optim.SGD):
    """Keeps, per parameter, a tuple of two tensors updated in place each step: DCP does not
    look into a tuple, it pickles it whole after the file's tensors."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                pair = self.state[p].get("pair")
                if pair is None:
                    self.state[p]["pair"] = (p.detach().clone(), p.detach() * 2)
                else:
                    pair[0].copy_(p.detach())
                    pair[1].copy_(p.detach() * 2)
        return loss


def test_a_tuple_of_staged_tensors_pickled_after_the_file_holds_the_values_of_its_own_step(tmp_path):
    """The tuple's tensors are staging copies made in the background: the save must pickle
    them after those copies, not the bytes the buffers held at the last save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = _PairOptimizer(model.parameters(), lr=0.1, momentum=0.9)

    def train() -> None:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()

    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        for _ in range(3):
            train()
            cp.step_done()
            cp.save()
            cp.wait()
        saved = [tuple(t.clone() for t in opt.state[p]["pair"]) for p in model.parameters()]
    model2 = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt2 = _PairOptimizer(model2.parameters(), lr=0.1, momentum=0.9)
    with ckpt.Checkpointer(str(tmp_path), model=model2, optimizer=opt2, interval=None, save_on_exit=False) as cp:
        assert cp.restored_step == 3
    got = [opt2.state[p]["pair"] for p in model2.parameters()]
    assert_bitwise_equal(got, saved, "the tuples")
