"""Load: a root holding 1,000 checkpoints (listing and restoring the newest stay fast, on a
local root and on the moto S3 server), a state of 10,000 tensors, and 8 ranks on loopback.
Times are printed and written to `<tmp>/load-figures.json`; what is asserted is a ratio to the
same operation on a root of 10 checkpoints, measured in the same run (absolute times on a
shared machine mean little)."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import botocore.config
import pytest
import torch

import ckpt
from ckpt.cli import main as cli
from tests.support.compare import assert_bitwise_equal
from tests.support.jobs import rank_logs
from tests.support.launch import WORKERS, run
from tests.support.toy_model import build, optimizer

FIGURES: dict = {}


def save_many(root: Path, n: int, real: int | None = None) -> None:
    """A root of `n` checkpoints, steps 1 to `n`. With `real`, only the first and the last
    `real` are saved by training (the step counter moved on to where a run of `n` steps would
    be); the others are copies of step 1's files whose manifests name their own step, which
    is all a listing and a restore of the newest read of them."""
    model = build("plain", 1)
    opt, _ = optimizer(model)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=1),
                           keep=ckpt.Keep(last=n + 1), handle_sigterm=False) as cp:
        for i in range(n if real is None else 1 + real):
            if real is not None and i == 1:
                cp.wait()
                cp._step = n - real  # as if steps 2 to n - real had run, and been saved (below)
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    if real is None:
        return
    first = root / "step-0000000001"
    for step in range(2, n - real + 1):
        copy = root / f"step-{step:010d}"
        shutil.copytree(first, copy)
        doc = json.loads((copy / "manifest.json").read_text())
        doc["step"] = doc["counters"]["step"] = step
        (copy / "manifest.json").write_text(json.dumps(doc))


def upload(root: Path, endpoint: str, url: str) -> None:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=endpoint, config=botocore.config.Config(max_pool_connections=16))
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: s3.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(root)}"), files))


def spread(root: Path, gap_s: float) -> None:
    """Date the checkpoints `gap_s` apart, as a long run commits them (saved here in a minute):
    each manifest's `created`, and its file's modification time."""
    now = time.time()
    dirs = sorted(root.glob("step-*"))
    for i, d in enumerate(dirs):
        when = now - (len(dirs) - 1 - i) * gap_s
        m = d / "manifest.json"
        doc = json.loads(m.read_text())
        doc["created"] = when
        m.write_text(json.dumps(doc))
        os.utime(m, (when, when))


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Two local roots, of 10 and of 1,000 checkpoints (10 and 4 of them saved by training,
    `save_many`), dated 10 minutes apart."""
    d = tmp_path_factory.mktemp("load")
    save_many(d / "r1000", 1000, real=3)
    save_many(d / "r10", 10)
    for r in ("r10", "r1000"):
        spread(d / r, 600.0)
    return {10: d / "r10", 1000: d / "r1000"}


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def restore_latest(url: str, options: dict | None, step: int) -> None:
    model = build("plain", 1)
    opt, _ = optimizer(model)
    with ckpt.Checkpointer(url, model=model, optimizer=opt, storage_options=options, interval=None,
                           save_on_exit=False, handle_sigterm=False) as cp:
        assert cp.restored_step == step


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_ls_and_restore_latest_stay_fast_with_1000_checkpoints(roots, where, request, tmp_path, capsys):
    urls, options = {n: str(p) for n, p in roots.items()}, None
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        base = request.getfixturevalue("s3_root")
        options = request.getfixturevalue("s3_options")
        for n, p in roots.items():
            urls[n] = f"{base}/{n}"
            upload(p, endpoint, urls[n])
    flags = [f"--storage-option={k}={v}" for k, v in (options or {}).items()]
    got = {}
    for n in (10, 1000):
        got[f"ls_{n}_s"] = timed(lambda n=n: cli.main(["ls", urls[n], *flags]))
        got[f"restore_latest_{n}_s"] = timed(lambda n=n: restore_latest(urls[n], options, n))
    out = capsys.readouterr().out
    assert sum(line.startswith("1000 ") and "committed" in line for line in out.splitlines()) == 3, out[-500:]
    FIGURES[where] = {k: round(v, 3) for k, v in got.items()}
    (tmp_path / "load-figures.json").write_text(json.dumps(FIGURES, indent=2))
    print(f"\n{where}: {FIGURES[where]}")
    # Listing grows with the root (every manifest is read, an object store's 16 at a time),
    # never quadratically. Restoring the newest reads the listing and the manifests written
    # within CLOCK_SKEW_S of the newest good one: locally, where the files carry the dates
    # of a long run, a few; on S3 every object here was uploaded within a minute, so it reads
    # them all, and must still cost no more than a listing does.
    assert got["ls_1000_s"] < 150 * got["ls_10_s"] + 1.0, got
    if where == "local":
        assert got["restore_latest_1000_s"] < 3 * got["restore_latest_10_s"] + 0.2, got
    else:
        assert got["restore_latest_1000_s"] < 1.5 * got["ls_1000_s"] + 1.0, got


def test_a_state_of_10000_tensors_round_trips_bit_for_bit(tmp_path):
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3, i % 7 + 1)) for i in range(5000))
    opt = torch.optim.Adam(params, lr=1e-3)  # 2 moments a parameter once stepped: 15,000 tensors
    sum(p.sum() for p in params).backward()
    opt.step()
    began = time.perf_counter()
    with ckpt.Checkpointer(str(tmp_path), model=params, optimizer=opt, interval=None, handle_sigterm=False) as cp:
        cp.save(blocking=True)
    FIGURES["save_15000_tensors_s"] = round(time.perf_counter() - began, 2)
    want = {"model": {k: v.clone() for k, v in params.state_dict().items()}, "optim": opt.state_dict()}
    fresh = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(3, i % 7 + 1)) for i in range(5000))
    fresh_opt = torch.optim.Adam(fresh, lr=1e-3)
    began = time.perf_counter()
    with ckpt.Checkpointer(str(tmp_path), model=fresh, optimizer=fresh_opt, interval=None, save_on_exit=False, handle_sigterm=False) as cp:
        assert cp.restored_step == 0
    FIGURES["restore_15000_tensors_s"] = round(time.perf_counter() - began, 2)
    assert len(fresh_opt.state_dict()["state"]) == 5000
    assert_bitwise_equal({"model": dict(fresh.state_dict()), "optim": fresh_opt.state_dict()}, want, "state")


@pytest.mark.slow
def test_8_ranks_on_loopback_resume_bit_for_bit(tmp_path):
    """8 FSDP2 ranks on gloo: a run to step 10 and a run resumed from its step-5 checkpoint
    end in the same state."""
    worker = WORKERS / "worker.py"
    common = ("--mode", "fsdp2", "--root", tmp_path / "root", "--every", 5, "--steps", 10)
    began = time.monotonic()
    codes = run(8, worker, *map(str, common), "--out", str(tmp_path / "a"), log_dir=tmp_path, timeout=300)
    assert codes == [0] * 8, rank_logs(tmp_path)
    shutil.rmtree(tmp_path / "root" / "step-0000000010")
    codes = run(8, worker, *map(str, common), "--out", str(tmp_path / "b"), log_dir=tmp_path, timeout=300)
    assert codes == [0] * 8, rank_logs(tmp_path)
    FIGURES["8_ranks_two_runs_s"] = round(time.monotonic() - began, 1)
    a = [torch.load(f"{tmp_path / 'a'}.rank{r}.pt", weights_only=True) for r in range(8)]
    b = [torch.load(f"{tmp_path / 'b'}.rank{r}.pt", weights_only=True) for r in range(8)]
    assert [x["restored_step"] for x in b] == [5] * 8
    for r in range(8):
        for key in ("step", "model", "optim", "sched", "rng"):
            assert_bitwise_equal(b[r][key], a[r][key], f"rank{r}.{key}")
