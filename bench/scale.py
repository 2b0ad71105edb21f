"""What a save and a restore cost per rank and per job as the job grows (issue 40).

For each world size, N processes on loopback (gloo) train a stack of FSDP2-sharded linear layers
one step, save it with ckpt, and restore it on the same world size in a new job, and (N >= 4)
on N/2 ranks in another. The root is a
moto S3 server behind a proxy that records every request (`--store s3`, the default) or a local
directory (`--store local`). Per rank it records the bytes its restore read from the store
(`ckpt_read_bytes`), the bytes of its own files, the time of the save and of the restore, and
the collectives each took (calls by kind and tensor bytes, counted in torch.distributed); per
job, the store's requests of each phase by kind and by file (data, index, `.metadata`,
manifest, other), and the sizes of `.metadata`, `.index` and the manifest.

It then fits each count and time as a + b·N on the world sizes below the largest and says how
far that line is from what the largest one measured. Counts are exact functions of the layout;
times on this 2-core machine grow with N because N processes share 2 cores (a rank's CPU time,
also reported, is what its own work costs). Rank 0 also times the restricted unpickler and
pickling on `.metadata`, and the index decoder on `.index` and its own index (the rates
`ckpt.schedule.scale_model` uses).

Last, `ckpt plan`'s model of the times: the machine's own parameters are calibrated on the
world sizes below the largest (a rank's CPU-seconds in a save and a restore, their mean over
ranks; the store's round trip and bandwidth, timed before the runs; a rank's CPU per piece of
state, from a model of 4x the tensors at the smallest size), and the model's save and restore
times at every size, the largest among them, are set against the measured ones (`model_times`).
Each size's checkpoint is restored once more begun by `ckpt.prepare` (`restore_prepared`: the
ranks' stores and clients and rank 0's survey made before the group and the model, and waited
for), and its CPU after entering calibrates and checks the model's `Scale(prepared=True)`.
The machine's busy CPU-seconds in each window (every process) say whether something else ran.

    .venv/bin/python bench/scale.py                       # 2, 4, 8, 16 ranks on S3: bench/results/scale.json
    .venv/bin/python bench/scale.py --ranks 2,4,8 --store local
    CKPT_BENCH_PROFILE=/tmp/p .venv/bin/python bench/scale.py --ranks 2   # each restore's cProfile: /tmp/p.rankN
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_LEAVES = ("broadcast", "all_reduce", "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all", "barrier", "send", "recv")
_OBJECTS = ("broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list")


def _count_collectives(seen: Counter) -> None:
    """Count torch.distributed's collectives: calls by name (an object collective once, not
    its inner ones) and the bytes of the tensors the inner ones move (`seen["bytes"]`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    depth = [0]

    def wrap(name: str, real):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if depth[0] == 0:
                seen[name] += 1
            if name in _LEAVES:
                for a in (*args, *kwargs.values()):
                    ts = a if isinstance(a, list) else [a]
                    seen["bytes"] += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name in (*_LEAVES, *_OBJECTS):
        real = getattr(c10d, name)
        setattr(c10d, name, wrap(name, real))
        setattr(dist, name, getattr(c10d, name))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(REPO))
    import ckpt

    if os.environ.get("CKPT_BENCH_EARLY_READS") == "0":  # bench/early_reads.py: the restore as before them
        import ckpt.restore.prefetch

        ckpt.restore.prefetch._EARLY_FILES = 0
    if os.environ.get("CKPT_BENCH_WARM_CLIENT") == "0":  # bench/early_reads.py --feature warm-client: the client made at the first request
        import ckpt.storage.store

        ckpt.storage.store.Store.warm = lambda self: None
    options = json.loads(args.options) if args.options else None
    prepared = args.phase == "restore" and os.environ.get("CKPT_BENCH_PREPARE") == "1"
    if prepared:  # bench/early_reads.py --feature prepare: begun first thing, as a job would
        ckpt.prepare(args.root, storage_options=options)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if prepared:  # a job's set-up at scale (its process group, its model) outlasts it: waited for
        from ckpt import early

        assert early._pending is not None and early._pending.done.wait(120)
        dist.barrier()
    out: dict = {"rank": rank, "world": world}
    seen: Counter = Counter()
    _count_collectives(seen)
    kw = dict(interval=None, handle_sigterm=False, storage_options=options)
    if args.phase == "save":
        model(torch.randn(4, args.width)).sum().backward()
        opt.step()
        with ckpt.Checkpointer(args.root, model=model, optimizer=opt, restore="none", **kw) as cp:
            # A job's first save starts the rank's writer process (its Python, its S3 client):
            # timed apart; the save measured is the next, as every save after it.
            began, cpu = time.perf_counter(), _cpu_s()
            cp.save(blocking=True)
            out["first_save_s"], out["first_save_cpu_s"] = time.perf_counter() - began, _cpu_s() - cpu
            took, staged, cpus, machines = [], [], [], []
            for _ in range(_STEADY_SAVES):  # the median of a few: one save here is a few 10 ms ticks of CPU
                model(torch.randn(4, args.width)).sum().backward()
                opt.step()
                cp.step_done()
                if rank == 0:  # the store's requests before it are the earlier saves' (`_requests`)
                    _mark(cp.store)
                dist.barrier()
                seen.clear()
                began, cpu, machine = time.perf_counter(), _cpu_s(), _machine_cpu_s()
                cp.save()  # returns once staged
                staged.append(time.perf_counter() - began)
                cp.wait()
                took.append(time.perf_counter() - began)
                cpus.append(_cpu_s() - cpu)
                machines.append(_machine_cpu_s() - machine)
            out["save_s"] = sorted(took)[len(took) // 2]
            out["phases_s"] = {"staging": sorted(staged)[len(staged) // 2]}  # the rest: written and committed behind the loop
            out["save_cpu_s"] = sum(cpus) / len(cpus)
            out["machine_cpu_s"] = sum(machines) / len(machines)
            out["collectives"] = dict(seen)
    else:
        ckpt.Checkpointer  # noqa: B018  imported as a training script does at its top, before the clock
        phases = _time_restore_phases()
        seen.clear()
        profile = os.environ.get("CKPT_BENCH_PROFILE")
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        began, cpu, machine = time.perf_counter(), _cpu_s(), _machine_cpu_s()
        cp = ckpt.Checkpointer(args.root, model=model, optimizer=opt, save_on_exit=False, **kw)
        phases["connect"] = time.perf_counter() - began  # the store's client imported, the root checked
        with cp:
            if profile:
                prof.disable()
                prof.dump_stats(f"{profile}.rank{rank}")
            out["restore_s"] = time.perf_counter() - began
            out["phases_s"] = {**phases, "other": out["restore_s"] - sum(phases.values())}
            out["restore_cpu_s"] = _cpu_s() - cpu
            out["machine_cpu_s"] = _machine_cpu_s() - machine
            out["collectives"] = dict(seen)
            out["read_bytes"] = cp.metrics.registry.get_sample_value("ckpt_read_bytes_total") or 0.0
            manifest = cp.last_commit
            out["own_file_bytes"] = sum(e.size for e in manifest.files.values() if e.rank == rank)
            out["sizes"] = {n: e.size for n, e in manifest.files.items() if not n.startswith("__")}
            out["own_index_bytes"] = sum(e.size for n, e in manifest.files.items() if e.rank == rank and n.endswith(".index"))
            out["files"] = len(manifest.files)
            out["file_sizes"] = {n: e.size for n, e in manifest.files.items()}
            if rank == 0 and args.phase == "restore":  # two GETs more, taken off the restore's count (`_BENCH_GETS`)
                rel = f"step-{manifest.step:010d}"
                out["sizes"]["manifest.json"] = len(cp.store.read_bytes(f"{rel}/manifest.json"))
                indexes = [cp.store.read_bytes(f"{rel}/{name}") for name in (".index", "__0_0.index")]
                out["rates"] = _rates(cp.store.read_bytes(f"{rel}/.metadata"), indexes)
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _time_restore_phases() -> dict[str, float]:
    """Seconds of a restore's phases on this rank, as they pass (wrapping the functions
    `ckpt.restore.load` calls): the job's lease taken (rank 0's requests; every rank learns the
    outcome), rank 0's survey and pick (`plan`: the others wait for it
    there), the template of the rank's state, the manifest checked and each rank told its part
    (`manifest`: rank 0 parses, the others wait), the metadata of what it loads (its index and
    `.index`), DCP's planning and reading (`read`), and applying it."""
    import torch.distributed.checkpoint as dcp

    from ckpt import lifecycle
    from ckpt.capture.state import TrainingState
    from ckpt.restore import load

    took: dict[str, float] = {}

    def timed(owner: object, name: str, phase: str) -> None:
        real = getattr(owner, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            began = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                took[phase] = took.get(phase, 0.0) + time.perf_counter() - began

        setattr(owner, name, call)

    for owner, name, phase in ((lifecycle, "take_for_job", "lease"), (load, "restore_plan", "plan"), (TrainingState, "template", "template"), (load, "checked_manifest", "manifest"),
                               (load, "tell", "manifest"), (load, "metadata_of", "metadata"), (dcp, "load", "read"),
                               (TrainingState, "apply", "apply")):  # fmt: skip
        timed(owner, name, phase)
    return took


def _cpu_s() -> float:
    """CPU-seconds of this rank: every thread of its process and of the processes it started
    (the writer process a save starts), read from /proc (Linux)."""
    tick, total, pids = os.sysconf("SC_CLK_TCK"), 0.0, [os.getpid()]
    while pids:
        pid = pids.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a child that just ended
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids += map(int, (task / "children").read_text().split())
    return total


def _machine_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy (every process, every core), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _rates(blob: bytes, indexes: list[bytes]) -> dict[str, float]:
    """Bytes per second of ckpt's restricted unpickler and of pickling, on this `.metadata`,
    and of the index decoder on `.index` and rank 0's index (read at every restore)."""
    import pickle

    from ckpt.format.dcp_metadata import load_metadata
    from ckpt.format.index_file import decode_index

    began = time.perf_counter()
    md = load_metadata(blob)
    unpickle = time.perf_counter() - began
    began = time.perf_counter()
    pickle.dumps(md)
    pickled = time.perf_counter() - began
    began = time.perf_counter()
    for index in indexes:
        decode_index(index, "index")
    decoded = time.perf_counter() - began
    return {"unpickle_bytes_per_s": len(blob) / unpickle, "pickle_bytes_per_s": len(blob) / pickled,
            "index_decode_bytes_per_s": sum(map(len, indexes)) / decoded}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compiled(work: Path) -> dict[str, str]:
    """The environment of a rank: ckpt's bytecode compiled once, in `work` (by the first call),
    as an installed ckpt's is (pip compiles it), even where this machine says not to write
    it; else every rank would count compiling ckpt's modules as its own CPU at each start."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    if not (work / "pycache").exists():
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "ckpt")], env=env, check=True)
    return env


def _job(n: int, phase: str, root: str, out: Path, args: argparse.Namespace, options: str, env: dict[str, str] | None = None) -> list[dict]:
    port = _free_port()
    procs = []
    extra = env or {}
    for rank in range(n):
        env = _compiled(out.parent) | extra | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
        argv = [sys.executable, __file__, "--worker", phase, "--root", root, "--out", str(out), "--layers", str(args.layers),
                "--width", str(args.width), "--options", options]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{out}.{phase}.rank{rank}.log", "w")))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        tail = Path(f"{out}.{phase}.rank{codes.index(next(c for c in codes if c))}.log").read_text()[-3000:]
        raise SystemExit(f"{phase} on {n} ranks failed: {codes}; a failed rank's log ends:\n{tail}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(n)]


def _kind_of(path: str) -> str:
    name = path.rpartition("/")[2]
    if name.endswith(".distcp"):
        return "data"
    if name.endswith(".index"):
        return "index"
    return {".metadata": "metadata", "manifest.json": "manifest"}.get(name, "other")


def _requests(seen: list[tuple[str, str]], phase: str) -> dict[str, int]:
    """Requests by kind and by file: "get.data", "part.data", "put.manifest", ... (less the
    bench's own reads after a restore)."""
    marks = [i for i, (_, path) in enumerate(seen) if path.endswith(_SECOND_SAVE)]
    seen = seen[marks[-1] + 1 :] if marks else seen
    got = Counter(f"{kind}.{_kind_of(path)}" for kind, path in seen)
    if phase == "restore":
        got.subtract(_BENCH_GETS)
    return {k: v for k, v in got.items() if v}


def _mark(store) -> None:  # noqa: ANN001
    """The HEAD that marks where a timed save's requests begin (`_requests`), of an object
    that exists: s3fs follows a HEAD that finds nothing with a listing, the save's then."""
    if not store.exists(_SECOND_SAVE):
        store.put_atomic(_SECOND_SAVE, b"")
        store.exists(_SECOND_SAVE)


_SECOND_SAVE = "bench-a-save-begins"  # a HEAD rank 0 sends before each save after the first
_STEADY_SAVES = 5  # timed after the first: the median time of each rank, its mean CPU
_BENCH_GETS = Counter({"range.manifest": 1, "range.metadata": 1, "range.index": 2})  # rank 0's, for the sizes and `_rates`


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares a + b·x."""
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys, strict=True))
    den = n * sxx - sx * sx
    b = (n * sxy - sx * sy) / den if den else 0.0
    return (sy - b * sx) / n, b


@contextlib.contextmanager
def _store(kind: str, work: Path):
    """The root's base URL, its storage options (JSON) and the recording proxy (None: local)."""
    if kind == "local":
        yield str(work), "", None
        return
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    from persist import S3_KEY, S3_SECRET, moto_server, s3fs_for

    from tests.support.s3proxy import FaultyProxy

    with moto_server(work) as endpoint:
        bucket = f"scale-{uuid.uuid4().hex[:12]}"
        s3fs_for(endpoint).mkdir(bucket)
        proxy = FaultyProxy(endpoint)
        try:
            yield f"s3://{bucket}", json.dumps({"endpoint_url": proxy.url, "key": S3_KEY, "secret": S3_SECRET}), proxy
        finally:
            proxy.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--store", choices=["s3", "local"], default="s3")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--probe", type=int, default=4, help="the tensors' multiple of the model that calibrates a rank's CPU per piece (same bytes)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    p.add_argument("--worker", choices=["save", "restore", "reshard"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--options", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.phase = args.worker
        _worker(args)
        return
    if args.probe < 2:
        p.error("--probe must be >= 2 (the multiple of the tensors that calibrates a rank's CPU per piece)")
    rows = []
    loadavg = [Path("/proc/loadavg").read_text().split()[:3]]
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as d, _store(args.store, Path(d)) as (base, options, proxy):
        store = _time_store(f"{base}/probe", options)
        sizes = list(map(int, args.ranks.split(",")))
        # The store's bandwidth with as many processes as each job has writers, apart from it.
        sys.path.insert(0, str(REPO / "bench"))
        import store_streams

        total = 3 * 4 * args.layers * (args.width**2 + args.width)  # the weights and Adam's two moments, fp32
        store["streams"] = {n: store_streams.measure(f"{base}/streams{n}", options, n, total, Path(d, f"streams{n}"), _compiled(Path(d))) for n in sizes}
        # Untimed: the first job compiles what the ranks import into the bytecode cache
        # (`_compiled`: its own, in which torch's and the store client's are not yet).
        for phase in ("save", "restore"):
            _job(sizes[0], phase, f"{base}/warm-up", Path(d, "warm-up"), args, options)
        probe = _probe(sizes[0], f"{base}/probe-tensors", Path(d, "probe"), args, options)
        for n in sizes:
            root, out = f"{base}/root{n}", Path(d, f"out{n}")
            row: dict = {"ranks": n}
            for phase in ("save", "restore"):
                if proxy is not None:
                    proxy.requests.clear()
                ranks = _job(n, phase, root, out, args, options)
                row[phase] = {
                    "s_max": max(r[f"{phase}_s"] for r in ranks),
                    "cpu_s_max": max(r[f"{phase}_cpu_s"] for r in ranks),
                    "cpu_s_mean": sum(r[f"{phase}_cpu_s"] for r in ranks) / n,
                    "machine_cpu_s": ranks[0]["machine_cpu_s"],  # every process, over rank 0's window
                    "collectives_rank0": ranks[0]["collectives"],
                    "collectives_max_calls": max(sum(v for k, v in r["collectives"].items() if k != "bytes") for r in ranks),
                    "requests": _requests(proxy.requests, phase) if proxy is not None else {},
                    "per_rank": ranks,
                    "phases_rank0_s": ranks[0]["phases_s"],  # rank 0's own phases, and each phase's longest on any rank
                    "phases_max_s": {k: max(r["phases_s"].get(k, 0.0) for r in ranks) for k in ranks[0]["phases_s"]},
                }
                if phase == "save":  # the job's first save, which started each rank's writer process
                    row[phase]["first_s_max"] = max(r["first_save_s"] for r in ranks)
                    row[phase]["first_cpu_s_mean"] = sum(r["first_save_cpu_s"] for r in ranks) / n
            # And the same restore begun by `ckpt.prepare` before the group and the model (waited for).
            prepared = _job(n, "restore", root, Path(d, f"prepared{n}"), args, options, {"CKPT_BENCH_PREPARE": "1"})
            row["restore_prepared"] = {
                "s_max": max(r["restore_s"] for r in prepared),
                "cpu_s_max": max(r["restore_cpu_s"] for r in prepared),
                "cpu_s_mean": sum(r["restore_cpu_s"] for r in prepared) / n,
                "machine_cpu_s": prepared[0]["machine_cpu_s"],
                "phases_max_s": {k: max(r["phases_s"].get(k, 0.0) for r in prepared) for k in prepared[0]["phases_s"]},
            }
            if n >= 4:  # and on half as many ranks (each loads the rows of about 2 saving ranks)
                if proxy is not None:
                    proxy.requests.clear()
                half = _job(n // 2, "reshard", root, Path(d, f"reshard{n}"), args, options)
                data = sum(v for k, v in half[0]["file_sizes"].items() if k.endswith(".distcp"))
                row["reshard"] = {
                    "ranks": n // 2,
                    "s_max": max(r["restore_s"] for r in half),
                    "read_bytes_max": max(r["read_bytes"] for r in half),
                    "data_bytes_per_rank": data / (n // 2),
                    "requests": _requests(proxy.requests, "reshard") if proxy is not None else {},
                }
            restored = row["restore"]["per_rank"]
            beyond = [r["read_bytes"] - r["own_file_bytes"] for r in restored]
            row.update(
                sizes=restored[0]["sizes"],
                files=restored[0]["files"],
                own_file_bytes_max=max(r["own_file_bytes"] for r in restored),
                read_bytes_max=max(r["read_bytes"] for r in restored),
                read_beyond_own_max=max(beyond),
                loaded_bytes_max=max(r["own_file_bytes"] - r["own_index_bytes"] for r in restored),
                own_index_bytes_max=max(r["own_index_bytes"] for r in restored),
                rates=restored[0]["rates"],
            )
            rows.append(row)
            req = row["restore"]["requests"]
            print(
                f"{n:3d} ranks: .metadata {row['sizes'].get('.metadata', 0) / 1e3:7.1f} KB, .index {row['sizes'].get('.index', 0) / 1e3:5.1f} KB; "
                f"busiest rank read {row['read_bytes_max'] / 1e6:6.2f} MB, beyond its own files {row['read_beyond_own_max'] / 1e3:6.1f} KB; "
                f"restore {row['restore']['s_max']:.2f} s ({row['restore']['cpu_s_max']:.2f} CPU-s on the busiest rank), "
                f"begun by prepare {row['restore_prepared']['s_max']:.2f} s ({row['restore_prepared']['cpu_s_max']:.2f}), save {row['save']['s_max']:.2f} s; "
                f"collectives per rank: save {row['save']['collectives_max_calls']}, restore {row['restore']['collectives_max_calls']}"
                + (f"; restore GETs {sum(v for k, v in req.items() if k.startswith(('get', 'range', 'head')))}" if req else ""),
                flush=True,
            )
            for ph in ("save", "restore"):
                print(f"     {ph} phases, rank 0 (longest on any rank): "
                      + ", ".join(f"{k} {v:.3f} ({row[ph]['phases_max_s'][k]:.3f})" for k, v in row[ph]["phases_rank0_s"].items()) + " s")  # fmt: skip
            if "reshard" in row:
                rs = row["reshard"]
                got = Counter({k.partition(".")[2]: v for k, v in rs["requests"].items() if k.startswith(("get.", "range."))})
                print(
                    f"     on {rs['ranks']} ranks: busiest rank read {rs['read_bytes_max'] / 1e6:6.2f} MB (the data files / {rs['ranks']}: "
                    f"{rs['data_bytes_per_rank'] / 1e6:.2f} MB), restore {rs['s_max']:.2f} s"
                    + (f"; GETs of .metadata {got['metadata']}, of indexes {got['index']}" if rs["requests"] else ""),
                    flush=True,
                )
    loadavg.append(Path("/proc/loadavg").read_text().split()[:3])
    fits = _fits(rows)
    model = _model_check(rows[-1], args)
    calibration = _calibrate(rows[:-1] if len(rows) > 1 else rows, store, probe, args)
    times = _model_times(rows, calibration, args)
    for line in fits["lines"] + model["lines"] + calibration["lines"] + times["lines"]:
        print(line)
    rates = rows[-1]["rates"]
    print(f"rates on rank 0 of {rows[-1]['ranks']}: restricted unpickler {rates['unpickle_bytes_per_s'] / 1e6:.1f} MB/s, "
          f"pickling {rates['pickle_bytes_per_s'] / 1e6:.1f} MB/s, index decoder {rates['index_decode_bytes_per_s'] / 1e6:.1f} MB/s; "
          f"load average before the runs {' '.join(loadavg[0])}, after {' '.join(loadavg[1])}")  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "root", "options")}
    doc = {"config": config, "loadavg": loadavg, "rows": rows, "fits": fits["table"], "model": model["table"],
           "calibration": calibration["table"], "probe": probe, "model_times": times["table"]}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"[scale] results: {args.out}")


def _model_check(row: dict, args: argparse.Namespace) -> dict:
    """`ckpt plan`'s model (`ckpt.schedule.scale_model`) of the largest job, against it."""
    sys.path.insert(0, str(REPO))
    from ckpt.schedule.scale_model import Scale, at_scale

    n = row["ranks"]
    data = sum(r["own_file_bytes"] - r["own_index_bytes"] for r in row["restore"]["per_rank"])
    got = at_scale(data, Scale(world=n, nodes=1, tensors=2 * args.layers, read_size=32 << 20))
    pairs = {
        ".metadata bytes": (got.metadata_bytes, row["sizes"].get(".metadata", 0)),
        ".index bytes": (got.shared_index_bytes, row["sizes"].get(".index", 0)),
        "a rank's index bytes (largest)": (got.index_bytes, row["own_index_bytes_max"]),
        "store requests, save": (got.save_requests, sum(row["save"]["requests"].values())),
        "store requests, restore": (got.restore_requests, sum(row["restore"]["requests"].values())),
    }
    table = {k: {"predicted": p, "measured": m, "error": (p - m) / m if m else 0.0} for k, (p, m) in pairs.items()}
    lines = [f"ckpt plan's model at {n} ranks:"] + [
        f"  {k:45s} predicted {v['predicted']:12.1f}, measured {v['measured']:12.1f} ({v['error']:+.1%})" for k, v in table.items()
    ]
    return {"table": table, "lines": lines}


def _time_store(root: str, options: str) -> dict[str, float]:
    """This store's round trip (the median of 20 small GETs, and of 20 HEADs, one after
    another) and bandwidth (32 MiB in 4 files at once written, then read: the median of 3), timed before the runs."""
    sys.path.insert(0, str(REPO))
    from ckpt.storage.store import Store

    store = Store(root, json.loads(options) if options else None)
    store.makedirs("")
    with store.open_write("small.bin") as f:
        f.write(b"x" * 1024)
    store.read_bytes("small.bin")  # the client made, the connection open

    def median_s(fn) -> float:  # noqa: ANN001
        took = []
        for _ in range(20):
            began = time.perf_counter()
            fn()
            took.append(time.perf_counter() - began)
        return sorted(took)[len(took) // 2]

    got = {"get_s": median_s(lambda: store.read_bytes("small.bin")), "head_s": median_s(lambda: store.exists("small.bin"))}
    blob = os.urandom(_BANDWIDTH_BYTES // _BANDWIDTH_STREAMS)

    def write(i: int) -> None:
        with store.open_write(f"large{i}.bin", size=len(blob)) as f:
            f.write(blob)

    streams = range(_BANDWIDTH_STREAMS)
    wrote, read = [], []
    with concurrent.futures.ThreadPoolExecutor(_BANDWIDTH_STREAMS) as pool:
        for _ in range(3):  # the median of 3: one is a second or less on a shared machine
            began = time.perf_counter()
            list(pool.map(write, streams))
            wrote.append(_BANDWIDTH_BYTES / (time.perf_counter() - began))
            began = time.perf_counter()
            list(pool.map(lambda i: store.read_bytes(f"large{i}.bin"), streams))
            read.append(_BANDWIDTH_BYTES / (time.perf_counter() - began))
    got["write_bytes_per_s"], got["read_bytes_per_s"] = sorted(wrote)[1], sorted(read)[1]
    return got


# The node's bandwidth to the store: 32 MiB in 4 files at once, as a node's ranks write theirs
# (one stream alone, on this machine's S3 server, gets about half of it).
_BANDWIDTH_BYTES = 32 << 20
_BANDWIDTH_STREAMS = 4


def _probe(n: int, root: str, out: Path, args: argparse.Namespace, options: str) -> dict[str, float]:
    """Saves and restores on `n` ranks of this model and of one of `args.probe` times the
    tensors and the same bytes (the layers times it, their width over its square root), one
    after the other, `_PROBE_RUNS` times: the median of each one's mean CPU-seconds per rank,
    whose difference is a rank's CPU per piece of state (a restore's CPU is mostly a fresh
    process's, and varies by more than the pieces add in one run)."""
    wide = argparse.Namespace(**{**vars(args), "layers": args.layers * args.probe, "width": round(args.width / args.probe**0.5)})
    got: dict[str, float] = {"layers": wide.layers, "width": wide.width}
    seen: dict[str, list[float]] = {}
    for run in range(_PROBE_RUNS):
        for name, model in (("base", args), ("wide", wide)):
            for phase in ("save", "restore"):
                ranks = _job(n, phase, f"{root}-{name}{run}", out, model, options)
                seen.setdefault(f"{name}_{phase}", []).append(sum(r[f"{phase}_cpu_s"] for r in ranks) / n)
    for k, v in seen.items():
        got[f"{k}_cpu_s_mean"] = sorted(v)[len(v) // 2]
    return got


_PROBE_RUNS = 3


def _calibrate(rows: list[dict], store: dict[str, float], probe: dict[str, float], args: argparse.Namespace) -> dict:
    """This machine's parameters of `ckpt plan`'s model, from the world sizes in `rows` (those
    below the largest): a rank's CPU-seconds in a save and a restore (the mean over ranks: what
    N ranks ask of cores they share; a save's fitted as a + b·bytes over the sizes, its
    checksums and copies growing with the bytes a rank writes; and the busiest rank's, which a
    job waits for where each rank has a core), the store's round trip and bandwidth, and a
    rank's CPU per piece of state (`_probe`)."""
    pieces = 2 * args.layers * 3  # a weight and a bias per layer, each with Adam's two moments
    table = {
        "sizes": [r["ranks"] for r in rows],
        "request_latency_s": store["get_s"],
        "head_s": store["head_s"],
        "write_bytes_per_s": store["write_bytes_per_s"],
        "read_bytes_per_s": store["read_bytes_per_s"],
        # By world size: what as many processes got from the store at once (`store_streams`).
        "streams": {n: {k: v[k] for k in ("write_bytes_per_s", "read_bytes_per_s")} for n, v in store.get("streams", {}).items()},
    }
    for phase in ("save", "restore"):
        table[f"{phase}_cpu_s"] = sum(r[phase]["cpu_s_mean"] for r in rows) / len(rows)
        table[f"{phase}_cpu_s_busiest"] = sum(r[phase]["cpu_s_max"] for r in rows) / len(rows)
        extra = probe[f"wide_{phase}_cpu_s_mean"] - probe[f"base_{phase}_cpu_s_mean"]
        table[f"{phase}_cpu_per_piece_s"] = max(0.0, extra / ((args.probe - 1) * pieces))
        # Rank 0's more (a save's commit, a restore's lease and survey): the busiest less the mean.
        table[f"{phase}_cpu_rank0_s"] = max(0.0, table[f"{phase}_cpu_s_busiest"] - table[f"{phase}_cpu_s"])
    # A restore begun by `ckpt.prepare`: a rank's CPU after entering, and rank 0's more.
    prepared = [r["restore_prepared"] for r in rows if "restore_prepared" in r]
    if prepared:
        table["restore_prepared_cpu_s"] = sum(p["cpu_s_mean"] for p in prepared) / len(prepared)
        busiest = sum(p["cpu_s_max"] for p in prepared) / len(prepared)
        table["restore_prepared_cpu_rank0_s"] = max(0.0, busiest - table["restore_prepared_cpu_s"])
    written = [_data_per_rank(r) for r in rows]
    cpu = [r["save"]["cpu_s_mean"] for r in rows]
    fixed, per_byte = _fit(written, cpu) if len(rows) > 1 else (table["save_cpu_s"], 0.0)
    if per_byte < 0:  # no cost per byte seen: the mean, fixed
        fixed, per_byte = table["save_cpu_s"], 0.0
    elif fixed < 0:  # no fixed cost seen: a line through 0
        fixed, per_byte = 0.0, sum(x * y for x, y in zip(written, cpu, strict=True)) / sum(x * x for x in written)
    table["save_cpu_s_fixed"], table["save_cpu_per_byte_s"] = fixed, per_byte
    lines = [
        "calibrated on " + ",".join(map(str, table["sizes"])) + " ranks and the store:",
        f"  a rank's CPU, save {table['save_cpu_s_fixed']:.3f} s + {table['save_cpu_per_byte_s'] * 1e9:.2f} ns a byte it writes, "
        f"restore {table['restore_cpu_s']:.2f} s (mean over ranks; "
        f"the busiest rank {table['save_cpu_s_busiest']:.2f} / {table['restore_cpu_s_busiest']:.2f} s); "
        f"per piece of state {table['save_cpu_per_piece_s'] * 1e3:.2f} / {table['restore_cpu_per_piece_s'] * 1e3:.2f} ms "
        f"({args.probe}x the tensors on {rows[0]['ranks']} ranks, the median of {_PROBE_RUNS} runs)",
        f"  the store: a small GET {table['request_latency_s'] * 1e3:.1f} ms, a HEAD {table['head_s'] * 1e3:.1f} ms; "
        f"writes {table['write_bytes_per_s'] / 1e6:.0f} MB/s, reads {table['read_bytes_per_s'] / 1e6:.0f} MB/s (4 threads of one process); "
        + ", ".join(f"{n} processes {v['write_bytes_per_s'] / 1e6:.0f} / {v['read_bytes_per_s'] / 1e6:.0f} MB/s" for n, v in table["streams"].items()),
    ]
    return {"table": table, "lines": lines}


def _data_per_rank(row: dict) -> float:
    """The mean bytes of a rank's data file at this size."""
    return sum(r["own_file_bytes"] - r["own_index_bytes"] for r in row["restore"]["per_rank"]) / row["ranks"]


def _model_times(rows: list[dict], calibration: dict, args: argparse.Namespace) -> dict:
    """`ckpt plan`'s save and restore times at each size, with this machine's parameters
    (one node of `os.cpu_count()` cores), against the measured ones (the slowest rank's); and
    with the CPU constants `ckpt plan` ships."""
    sys.path.insert(0, str(REPO))
    from ckpt.schedule.scale_model import Scale, at_scale

    cal = calibration["table"]
    table, lines = {}, [f"ckpt plan's model of the times, this machine's parameters ({os.cpu_count()} cores), the largest not calibrated on:"]
    for row in rows:
        n = row["ranks"]
        data = sum(r["own_file_bytes"] - r["own_index_bytes"] for r in row["restore"]["per_rank"])
        scale = Scale(world=n, nodes=1, tensors=2 * args.layers, cores_per_node=os.cpu_count() or 1, kept=1,
                      save_cpu_s=cal["save_cpu_s_fixed"], save_cpu_per_byte_s=cal["save_cpu_per_byte_s"], restore_cpu_s=cal["restore_cpu_s"],
                      rank0_cpu_s=(cal["save_cpu_rank0_s"], cal["restore_cpu_rank0_s"]), request_latency=cal["request_latency_s"],
                      write_bandwidth=cal["streams"].get(n, cal)["write_bytes_per_s"], read_bandwidth=cal["streams"].get(n, cal)["read_bytes_per_s"])  # fmt: skip
        got = at_scale(data, scale)
        # And as `ckpt plan` ships it: its own CPU constants (the busiest rank's, from an earlier
        # run), this machine's cores, round trip and bandwidths.
        bare = dataclasses.replace(scale, save_cpu_s=None, save_cpu_per_byte_s=None, restore_cpu_s=None, rank0_cpu_s=None)
        shipped = at_scale(data, bare)
        entry = {"calibrated_on": n in cal["sizes"]}
        for phase, predicted in (("save", shipped.save_s), ("restore", shipped.restore_s)):
            entry[f"{phase}_shipped"] = {"predicted_s": predicted, "error": (predicted - row[phase]["s_max"]) / row[phase]["s_max"]}
        for phase, predicted in (("save", got.save_s), ("restore", got.restore_s)):
            measured = row[phase]["s_max"]
            cores_s = (os.cpu_count() or 1) * measured
            ranks_busy = row[phase]["cpu_s_mean"] * n / cores_s
            others_busy = max(0.0, row[phase]["machine_cpu_s"] / cores_s - ranks_busy)  # the store, the bench, anyone else
            entry[phase] = {"predicted_s": predicted, "measured_s": measured, "error": (predicted - measured) / measured,
                            "cores_busy_ranks": ranks_busy, "cores_busy_others": others_busy}  # fmt: skip
        if "restore_prepared" in row and "restore_prepared_cpu_s" in cal:  # begun by `ckpt.prepare`
            early = at_scale(data, dataclasses.replace(scale, prepared=True, restore_cpu_s=cal["restore_prepared_cpu_s"],
                                                       rank0_cpu_s=(cal["save_cpu_rank0_s"], cal["restore_prepared_cpu_rank0_s"])))  # fmt: skip
            early_shipped = at_scale(data, dataclasses.replace(bare, prepared=True))
            measured = row["restore_prepared"]["s_max"]
            entry["restore_prepared"] = {"predicted_s": early.restore_s, "measured_s": measured, "error": (early.restore_s - measured) / measured,
                                         "shipped_s": early_shipped.restore_s, "shipped_error": (early_shipped.restore_s - measured) / measured}  # fmt: skip
        entry["terms"] = {k: getattr(got, k) for k in ("save_cpu_s", "save_round_trips_s", "save_bytes_s", "save_metadata_s",
                                                        "restore_cpu_s", "restore_round_trips_s", "restore_survey_s", "restore_bytes_s",
                                                        "restore_metadata_s")}  # fmt: skip
        table[n] = entry
        lines.append(
            f"  {n:3d} ranks{'' if entry['calibrated_on'] else ' (check)'}: "
            + "; ".join(f"{ph} predicted {entry[ph]['predicted_s']:.2f} s, measured {entry[ph]['measured_s']:.2f} s ({entry[ph]['error']:+.1%}; "
                        f"cores busy: ranks {entry[ph]['cores_busy_ranks']:.0%}, others {entry[ph]['cores_busy_others']:.0%}; "
                        f"as shipped {entry[f'{ph}_shipped']['predicted_s']:.2f} s, {entry[f'{ph}_shipped']['error']:+.1%})"
                        for ph in ("save", "restore"))  # fmt: skip
            + ("; begun by prepare: predicted {predicted_s:.2f} s, measured {measured_s:.2f} s ({error:+.1%}; as shipped {shipped_s:.2f} s, {shipped_error:+.1%})".format(**entry["restore_prepared"])
               if "restore_prepared" in entry else "")  # fmt: skip
        )
    return {"table": table, "lines": lines}


def _fits(rows: list[dict]) -> dict:
    """Each count as a + b·ranks, fitted below the largest world size, and its error there."""
    if len(rows) < 3:
        return {"table": {}, "lines": []}
    *fit_rows, last = rows
    xs = [r["ranks"] for r in fit_rows]
    series = {
        ".metadata bytes": lambda r: r["sizes"].get(".metadata", 0),
        ".index bytes": lambda r: r["sizes"].get(".index", 0),
        "manifest bytes": lambda r: r["sizes"].get("manifest.json", 0),
        "busiest rank's read beyond its own files": lambda r: r["read_beyond_own_max"],
        "a rank's index bytes": lambda r: r["own_index_bytes_max"],
        "collective calls per rank, save": lambda r: r["save"]["collectives_max_calls"],
        "collective calls per rank, restore": lambda r: r["restore"]["collectives_max_calls"],
        "store requests, save": lambda r: sum(r["save"]["requests"].values()),
        "store requests, restore": lambda r: sum(r["restore"]["requests"].values()),
        "save seconds (this machine, 2 cores)": lambda r: r["save"]["s_max"],
        "restore seconds (this machine, 2 cores)": lambda r: r["restore"]["s_max"],
        "restore CPU-seconds, busiest rank": lambda r: r["restore"]["cpu_s_max"],
    }
    table, lines = {}, ["fit on " + ",".join(map(str, xs)) + f" ranks, checked at {last['ranks']}:"]
    for name, get in series.items():
        a, b = _fit(xs, [float(get(r)) for r in fit_rows])
        want, got = a + b * last["ranks"], float(get(last))
        err = (want - got) / got if got else 0.0
        table[name] = {"a": a, "per_rank": b, "predicted": want, "measured": got, "error": err}
        lines.append(f"  {name:45s} {a:12.1f} + {b:10.1f}·N   predicted {want:12.1f}, measured {got:12.1f} ({err:+.1%})")
    return {"table": table, "lines": lines}


if __name__ == "__main__":
    main()
