#!/usr/bin/env python
"""Would O_DIRECT reads make a local restore cheaper? Two processes at once each read their own
cold file into memory already touched (as a restore reads into the live tensors), in 256 KiB
pieces hashed with xxh3 as ckpt's verified reader does, three ways:

- buffered: `readinto` from the page cache (what ckpt does);
- direct: O_DIRECT requests of `--piece-mb` into a page-aligned buffer, each piece then copied
  into the target (a target is only 64-byte aligned: O_DIRECT cannot fill it directly);
- direct2: the same with a thread reading the next piece into a second buffer meanwhile.

`+busy` runs 60 ms of Python beside the read in each process (the fixed work of a restore).
Prints the wall time of the slower process and the CPU per process, medians over `--reps`.

    .venv/bin/python bench/read_direct.py                     # 96 MB files, 4 MiB pieces
    .venv/bin/python bench/read_direct.py --piece-mb 8 --touched
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import threading
import time

import xxhash

PIECE = 256 << 10  # the verified reader's piece (ckpt.storage.verified.READ_CHUNK)


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def buffered(path: str, target: memoryview) -> None:
    h, n = xxhash.xxh3_64(), 0
    with open(path, "rb", buffering=0) as f:
        while n < len(target):
            got = f.readinto(target[n : n + PIECE])
            h.update(target[n : n + got])
            n += got


def direct(path: str, target: memoryview, bufs: list[memoryview], ahead: bool) -> None:
    h, size = xxhash.xxh3_64(), len(bufs[0])
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    starts = list(range(0, len(target), size))
    filled: queue.Queue[tuple[int, int]] = queue.Queue()
    free = [threading.Semaphore(1), threading.Semaphore(1)]

    def read_all() -> None:
        for i, start in enumerate(starts):
            free[i % 2].acquire()
            filled.put((i % 2, os.preadv(fd, [bufs[i % 2]], start)))

    reader = threading.Thread(target=read_all) if ahead else None
    if reader is not None:
        reader.start()
    for start in starts:
        if reader is not None:
            b, got = filled.get()
        else:
            b, got = 0, os.preadv(fd, [bufs[0]], start)
        for s in range(0, got, PIECE):
            e = min(got, s + PIECE)
            target[start + s : start + e] = bufs[b][s:e]
            h.update(target[start + s : start + e])
        if reader is not None:
            free[b].release()
    if reader is not None:
        reader.join()
    os.close(fd)


def busy(ms: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < ms / 1e3:
        sum(range(1000))


def worker(path: str, mode: str, args: argparse.Namespace, bar: mp.Barrier, out: mp.Queue) -> None:
    size = os.path.getsize(path)
    target = memoryview(bytearray(b"\x01") * size)

    def buffers() -> list[memoryview]:
        bufs = [mmap.mmap(-1, args.piece_mb << 20) for _ in range(2)]
        if args.touched:
            for b in bufs:
                b[:] = b"\x01" * len(b)
        return [memoryview(b) for b in bufs]

    bufs = buffers() if args.touched else []
    evict(path)
    bar.wait()
    cpu, wall = time.process_time(), time.perf_counter()
    side = threading.Thread(target=busy, args=(60,)) if mode.endswith("+busy") else None
    if side is not None:
        side.start()
    how = mode.split("+")[0]
    if how == "buffered":
        buffered(path, target)
    else:
        direct(path, target, bufs or buffers(), ahead=how == "direct2")
    if side is not None:
        side.join()
    out.put((time.perf_counter() - wall, time.process_time() - cpu))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=96)
    p.add_argument("--piece-mb", type=int, default=4, help="bytes per O_DIRECT request, MiB")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--touched", action="store_true", help="the O_DIRECT buffers are touched before the timing (reused ones)")
    p.add_argument("--modes", default="buffered,direct,direct2,buffered+busy,direct2+busy")
    p.add_argument("--dir", default=None, help="where the two files go (default: a temporary directory on /var/tmp)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir or "/var/tmp") as d:
        paths = [os.path.join(d, f"f{i}") for i in range(2)]
        for path in paths:
            with open(path, "wb") as f:
                f.write(os.urandom(args.size_mb << 20))
                f.flush()
                os.fsync(f.fileno())  # else eviction leaves dirty pages: the first reads would be warm
        results: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.reps):
            for mode in args.modes.split(","):
                bar, out = mp.Barrier(2), mp.Queue()
                procs = [mp.Process(target=worker, args=(path, mode, args, bar, out)) for path in paths]
                for proc in procs:
                    proc.start()
                for proc in procs:
                    proc.join()
                got = [out.get() for _ in procs]
                results.setdefault(mode, []).append((max(w for w, _ in got), statistics.mean(c for _, c in got)))
    print(f"{args.size_mb} MB per process, 2 at once, O_DIRECT pieces of {args.piece_mb} MiB ({'touched' if args.touched else 'fresh'} buffers)")
    for mode, runs in results.items():
        walls, cpus = sorted(w for w, _ in runs), sorted(c for _, c in runs)
        print(
            f"  {mode:14s} wall {statistics.median(walls) * 1e3:4.0f} ms {[round(w * 1e3) for w in walls]}"
            f"   CPU per process {statistics.median(cpus) * 1e3:4.0f} ms {[round(c * 1e3) for c in cpus]}"
        )


if __name__ == "__main__":
    main()
