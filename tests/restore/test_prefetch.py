"""A restore pulls its own local files into the page cache while it plans, and stops pulling
as its reader starts: real files and the kernel's page cache, no stand-ins."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format.manifest import METADATA_NAME, FileEntry, Manifest
from ckpt.node.handoff import Tiered
from ckpt.restore import dcp_read, prefetch
from ckpt.restore import load as restore
from ckpt.restore.prefetch import Prefetch, to_warm
from ckpt.storage.store import Store, step_dir_name

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the prefetch uses Linux's sendfile to /dev/null")


def resident(path: Path) -> float:
    """The fraction of the file's pages in the page cache (mmap and mincore; mapping reads
    nothing in)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if at in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(at, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(at, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


def evicted(path: Path) -> Path:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def a_file(path: Path, mib: int) -> Path:
    path.write_bytes(os.urandom(mib << 20))
    return evicted(path)


def cold_files(tmp_path: Path, names: tuple[str, ...], mib: int) -> list[Path]:
    """Files of `mib` MiB none of whose pages is in the page cache, made sure of: under a
    loaded CI machine's writeback an eviction can leave some (once in ~30 full runs the
    prefetch found all three files of a test in memory), so it is asked again, a few times."""
    files = [a_file(tmp_path / n, mib) for n in names]
    if resident(files[0]) > 0.5:
        pytest.skip("this filesystem keeps a file's pages in memory whatever is asked (tmpfs?): nothing to pull in")
    for _ in range(5):
        left = [resident(f) for f in files]
        if not any(left):
            return files
        time.sleep(0.2)
        for f in files:
            evicted(f)
    pytest.fail(f"the page cache keeps pages of these files after fsync and POSIX_FADV_DONTNEED: {left}")


@linux
def test_a_prefetch_pulls_its_files_into_the_page_cache_in_order_up_to_its_limit(tmp_path):
    files = cold_files(tmp_path, ("a", "b", "c"), 4)
    first, second, third = files
    with Prefetch([str(first), str(second), str(third)], chunk=8 << 20, limit=6 << 20) as p:
        p.join(60)
    # one chunk per file: none was in memory before
    assert p.pulled == p.covered == 6 << 20, (p.pulled, p.covered, [resident(f) for f in files])
    assert resident(first) == 1.0
    assert resident(second) >= 0.5  # the limit falls in its middle (the kernel's readahead may take the rest)
    assert resident(third) == 0.0


@linux
def test_a_stopped_prefetch_pulls_nothing_more_and_a_missing_file_is_passed_over(tmp_path):
    gate = tmp_path / "gate"
    os.mkfifo(gate)  # opening it for reading blocks until a writer comes: the test decides when
    data = a_file(tmp_path / "data", 2)
    p = Prefetch([str(tmp_path / "missing"), str(gate), str(data)])
    p.stop()
    while p._thread.is_alive():  # let the thread on if it waits at the gate (it reads its end of file)
        try:
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:  # ENXIO: no reader yet (or the thread stopped before the gate)
            assert e.errno == errno.ENXIO
            time.sleep(0.01)
    p.join(60)
    assert p.covered == 0
    assert not p._thread.is_alive()

    p = Prefetch([str(tmp_path / "missing"), str(data)])
    p.join(60)
    assert p.covered == 2 << 20


@linux
def test_chunks_already_in_the_page_cache_are_not_pulled_again(tmp_path):
    cold, warm = a_file(tmp_path / "cold", 4), tmp_path / "warm"
    warm.write_bytes(os.urandom(4 << 20))
    warm.read_bytes()  # in the page cache, as on a restart on the node that saved it
    if resident(cold) > 0.5:
        pytest.skip("this filesystem keeps a file's pages in memory whatever is asked (tmpfs?)")
    fd = os.open(warm, os.O_RDONLY)
    try:
        if not prefetch._cached(fd, 0, 4 << 20):
            pytest.skip("this kernel or filesystem takes no RWF_NOWAIT reads: the page cache cannot be asked")
    finally:
        os.close(fd)
    with Prefetch([str(warm), str(cold)], chunk=1 << 20) as p:
        p.join(60)
    assert p.covered == 8 << 20
    assert 0 < p.pulled <= 4 << 20  # of the cold one only (the kernel's readahead may pull the rest of it)
    assert resident(cold) == 1.0


def manifest(world: int, indexes: bool = False) -> Manifest:
    files = {METADATA_NAME: FileEntry(10, "xxh3_64:0", -1)}
    files.update({f"__{r}_0.distcp": FileEntry(10, "xxh3_64:0", r) for r in range(world)})
    files.update({f"__{r}_0.index": FileEntry(5, "xxh3_64:0", r) for r in range(world) if indexes})
    return Manifest(step=3, world_size=world, created=0.0, files=files)


def test_a_rank_warms_metadata_and_its_own_files_and_on_another_world_size_only_metadata(tmp_path):
    store, rel = Store(str(tmp_path / "root")), step_dir_name(3)
    base = f"{tmp_path}/root/{rel}"
    assert to_warm(store, None, rel, manifest(2), 1, 2) == ([f"{base}/{METADATA_NAME}", f"{base}/__1_0.distcp"], [])
    assert to_warm(store, None, rel, manifest(2), 0, 1) == ([f"{base}/{METADATA_NAME}"], [])
    spool = Store(str(tmp_path / "spool"))
    tiered = Tiered(store, spool, {"__1_0.distcp"})
    assert to_warm(store, tiered, rel, manifest(2), 1, 2) == ([f"{base}/{METADATA_NAME}", f"{tmp_path}/spool/{rel}/__1_0.distcp"], [])


def test_from_an_object_store_a_rank_opens_its_own_data_files_early_on_the_world_size_that_saved(s3_root, monkeypatch):
    store, rel = Store(s3_root), step_dir_name(3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert to_warm(store, None, rel, manifest(2), 1, 2) == ([], [(f"{rel}/__1_0.distcp", 10)])
    # Its index first: read as the rank plans, before any data.
    assert to_warm(store, None, rel, manifest(2, indexes=True), 1, 2) == ([], [(f"{rel}/__1_0.index", 5), (f"{rel}/__1_0.distcp", 10)])
    assert to_warm(store, None, rel, manifest(2), 1, 4) == ([], [])  # another world size: its plan picks
    # More ranks on the node than cores: receiving early would take CPU the planning needs.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0)) + 1))
    assert to_warm(store, None, rel, manifest(2), 1, 2) == ([], [])


@pytest.mark.parametrize(("restore", "local", "warmed"), [("latest", "1", 1), (3, "1", 1), ("none", "1", 0), ("latest", "many", 0)])
def test_a_restoring_rank_starts_its_stores_client_as_it_enters_where_it_has_a_core(tmp_path, monkeypatch, restore, local, warmed):
    """`Store.warm` (the client made while rank 0 surveys the root), as the Checkpointer
    enters to restore; not for a fresh start, nor where the node's ranks outnumber its cores."""
    calls: list[Store] = []
    real = Store.warm
    monkeypatch.setattr(Store, "warm", lambda self: (calls.append(self), real(self)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0)) + 1) if local == "many" else local)
    model = torch.nn.Linear(4, 2)
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False)
    with ckpt.Checkpointer(str(tmp_path), model=model, restore="none", **kw) as cp:
        cp.step_done()
        cp.step_done()
        cp.step_done()
        cp.save(blocking=True)
    calls.clear()
    with ckpt.Checkpointer(str(tmp_path), model=model, restore=restore, **kw) as cp:
        assert cp.restored_step == (None if restore == "none" else 3)
    assert len(calls) == warmed and all(s is cp.store for s in calls)


@linux
def test_a_restore_stops_its_prefetch_as_its_reader_starts_and_loads_bit_for_bit(tmp_path, monkeypatch):
    w = torch.randn(512, 1024)
    model = torch.nn.Linear(1024, 512, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False)
    with ckpt.Checkpointer(str(tmp_path), model=model, **kw) as cp:
        cp.save(blocking=True)
    with torch.no_grad():
        model.weight.zero_()
    events: list[tuple[str, object]] = []
    made: list[Prefetch] = []
    real_stop, real_stream, real_metadata = Prefetch.stop, dcp_read._Reader._stream_files, dcp_read._Reader.read_metadata

    class Seen(Prefetch):
        def __init__(self, paths=(), **k):
            events.append(("prefetch", list(paths)))
            super().__init__(paths, **k)
            made.append(self)

        def stop(self):
            events.append(("stop", threading.current_thread() is threading.main_thread()))
            real_stop(self)

    def read_metadata(self, *a, **k):  # DCP's planning starts with it: the prefetch runs on
        events.append(("plan", None))
        return real_metadata(self, *a, **k)

    def stream_files(self, files, planner):  # where the reader's reads of data files start
        events.append(("read", None))
        return real_stream(self, files, planner)

    monkeypatch.setattr(restore, "Prefetch", Seen)
    monkeypatch.setattr(dcp_read._Reader, "_stream_files", stream_files)
    monkeypatch.setattr(dcp_read._Reader, "read_metadata", read_metadata)
    with ckpt.Checkpointer(str(tmp_path), model=model, restore="latest", **kw) as cp:
        assert cp.restored_step == 0
    assert torch.equal(model.weight, w)
    warmed = [e for e in events if e[0] == "prefetch" and e[1]]
    step = tmp_path / step_dir_name(0)
    assert warmed == [("prefetch", [str(step / METADATA_NAME), str(step / "__0_0.distcp")])]
    assert all(os.path.exists(p) for p in warmed[0][1])
    assert events.index(warmed[0]) < events.index(("plan", None)) < events.index(("stop", True)) < events.index(("read", None))
    assert not made[-1]._thread.is_alive()  # leaving the restore waited for it


def _s3_restore(s3_root, options, transfer, model, w):
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False, storage_options=options, transfer=transfer)
    with torch.no_grad():
        model.weight.zero_()
    with ckpt.Checkpointer(s3_root, model=model, restore="latest", **kw) as cp:
        assert cp.restored_step == 0
        assert cp.store._early == {}  # taken up by the reader, or closed
    assert torch.equal(model.weight, w)


def test_from_s3_a_restore_gets_its_data_file_while_it_plans_and_each_range_once(s3_root, s3_options, proxy, monkeypatch):
    w = torch.randn(256, 1024)  # 1 MiB: 5 ranges of 256 KiB with DCP's headers
    model = torch.nn.Linear(1024, 256, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    options, transfer = {**s3_options, "endpoint_url": proxy.url}, ckpt.Transfer(read_size=256 << 10, readahead=2)
    with ckpt.Checkpointer(s3_root, model=model, interval=None, save_on_exit=False, handle_sigterm=False, storage_options=options, transfer=transfer) as cp:
        cp.save(blocking=True)
    proxy.requests.clear()
    real_metadata, at_plan = dcp_read._Reader.read_metadata, []

    def read_metadata(self, *a, **k):  # DCP's planning starts with it; the reader reads after
        deadline = time.monotonic() + 10
        while not _data_gets(proxy) and time.monotonic() < deadline:
            time.sleep(0.01)
        at_plan.append(len(_data_gets(proxy)))
        return real_metadata(self, *a, **k)

    monkeypatch.setattr(dcp_read._Reader, "read_metadata", read_metadata)
    _s3_restore(s3_root, options, transfer, model, w)
    assert at_plan[0] >= 1  # the data file's GETs went out before the rank planned
    assert len(_data_gets(proxy)) == 5  # and each range once: the reader went on with them


def _data_gets(proxy) -> list[str]:
    return [kind for kind, path in list(proxy.requests) if path.endswith("/__0_0.distcp")]


def test_from_s3_a_restore_that_fails_after_its_early_reads_closes_them_and_falls_back(s3_root, s3_options, proxy):
    """The newest step's data file is cut short: the early stream's bytes are checked as any,
    the restore falls back to the step before, and no early stream is left open."""
    w = torch.randn(64, 1024)
    model = torch.nn.Linear(1024, 64, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False, storage_options={**s3_options, "endpoint_url": proxy.url})
    with ckpt.Checkpointer(s3_root, model=model, **kw) as cp:
        cp.save(blocking=True)
        with torch.no_grad():
            model.weight.add_(1)
        cp.step_done()
        cp.save(blocking=True)
        fs, newest = cp.store.fs, cp.store.path(step_dir_name(1), "__0_0.distcp")
    fs.pipe_file(newest, fs.cat_file(newest)[:-100])
    with torch.no_grad():
        model.weight.zero_()
    with ckpt.Checkpointer(s3_root, model=model, restore="latest", **kw) as cp:
        assert cp.restored_step == 0
        assert cp.store._early == {}
    assert torch.equal(model.weight, w)


def test_from_s3_early_gets_that_failed_while_the_rank_planned_are_sent_again_as_it_reads(s3_root, s3_options, proxy, monkeypatch):
    """The store answers 500 to every data GET from the moment the manifest is told until the
    rank has planned: the early GETs give up, and the reader sends them again rather than take
    their failure (without early reads no GET went out in that time: step 1 restored)."""
    w = torch.randn(256, 1024)
    model = torch.nn.Linear(1024, 256, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    options = {**s3_options, "endpoint_url": proxy.url}
    transfer = ckpt.Transfer(read_size=256 << 10, readahead=2, attempts=2, backoff_s=0.01, max_backoff_s=0.02)
    with ckpt.Checkpointer(s3_root, model=model, interval=None, save_on_exit=False, handle_sigterm=False, storage_options=options, transfer=transfer) as cp:
        cp.save(blocking=True)
    down, gave_up = threading.Event(), []
    real_decide, real_init, real_metadata = proxy._decide, Prefetch.__init__, dcp_read._Reader.read_metadata

    def decide(req):
        action = real_decide(req)
        data = req.command == "GET" and req.path.split("?")[0].endswith(".distcp")
        return "500" if action is None and data and down.is_set() else action

    def init(self, *a, **k):  # the outage begins as the manifest is told ...
        down.set()
        real_init(self, *a, **k)

    def read_metadata(self, *a, **k):  # ... and is over once the early GETs gave up
        futures = [f for _, stream in list(self.store._early.values()) for _, _, f in list(stream._ahead)]
        concurrent.futures.wait(futures, timeout=30)
        gave_up.append(sum(f.exception() is not None for f in futures))
        down.clear()
        return real_metadata(self, *a, **k)

    monkeypatch.setattr(proxy, "_decide", decide)
    monkeypatch.setattr(Prefetch, "__init__", init)
    monkeypatch.setattr(dcp_read._Reader, "read_metadata", read_metadata)
    _s3_restore(s3_root, options, transfer, model, w)
    assert gave_up == [2]
