"""What a restore reads once per job rather than once per rank (issue 40): a 2-rank FSDP2 job
on the moto S3 server, behind a proxy that records every request, saves and restarts; the
restart's requests are counted by object, and each rank's bytes read against its own files."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.support.jobs import RANKS, WORKER, dumps, rank_logs
from tests.support.launch import run
from tests.support.s3proxy import FaultyProxy


def test_metadata_is_read_in_part_and_once_per_job_not_once_per_rank(tmp_path, proxy, s3_root, s3_options):
    """On the world size that saved, no rank reads `.metadata` (every rank's part of it grows
    with tensors x ranks): each rank reads its own index, and rank 0 the shared `.index`, once,
    and sends it on. On another world size, each rank reads the indexes of the saving ranks
    whose pieces it loads."""
    options = {**s3_options, "endpoint_url": proxy.url}
    args = ("--mode", "fsdp2", "--root", s3_root, "--steps", 5, "--every", 5, "--storage-options", json.dumps(options))
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "out"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    proxy.requests.clear()
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "again"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    assert [d["restored_step"] for d in dumps(tmp_path / "again")] == [5] * RANKS
    got = Counter(path.rpartition("/")[2] for kind, path in proxy.requests if kind in ("get", "range") and "step-0000000005/" in path)
    assert got[".metadata"] == 0 and got[".index"] == 1, got
    assert all(got[f"__{r}_0.index"] == 1 for r in range(RANKS)), got
    # on more ranks: no .metadata either; `.index` says which saving ranks' pieces each loads
    # (FSDP2's rows: new rank 0 those of saving rank 0, rank 1 of both, rank 2 of rank 1)
    proxy.requests.clear()
    assert run(3, WORKER, *map(str, args), "--steps", "6", "--out", str(tmp_path / "three"), log_dir=tmp_path) == [0] * 3, rank_logs(tmp_path)
    assert [torch.load(f"{tmp_path}/three.rank{r}.pt", weights_only=True)["restored_step"] for r in range(3)] == [5] * 3
    got = Counter(path.rpartition("/")[2] for kind, path in proxy.requests if kind in ("get", "range") and "step-0000000005/" in path)
    assert got[".metadata"] == 0 and got[".index"] == 1 and got["__0_0.index"] == got["__1_0.index"] == 2, got


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_rank_reads_its_own_files_and_no_other_ranks_for_the_values_all_ranks_load(tmp_path, store, request):
    """FSDP2 saves each parameter's optimizer `step` once, in one rank's file or another's
    (DCP's de-duplication); every rank loads them all. Each rank reads its own data file and
    index, rank 0 the shared index too, and nothing else: not `.metadata` (its part of it is in
    its index), nor other ranks' files (those values come from the rank that read them)."""
    if store == "s3":
        proxy = FaultyProxy(request.getfixturevalue("s3_endpoint"))
        request.addfinalizer(proxy.close)
        root = request.getfixturevalue("s3_root")
        extra = ("--storage-options", json.dumps({**request.getfixturevalue("s3_options"), "endpoint_url": proxy.url}))
    else:
        root, extra = str(tmp_path / "root"), ()
    args = ("--mode", "fsdp2", "--root", root, "--steps", 5, "--every", 5, *extra)
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "out"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "again"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    first, again = dumps(tmp_path / "out"), dumps(tmp_path / "again")
    for rank, state in enumerate(again):
        assert state["restored_step"] == 5
        d = json.loads((tmp_path / f"again.rank{rank}.reads.json").read_text())
        own = sum(size for size, r in d["files"].values() if r == rank)  # its data file and its index
        assert own > 0 and d["read_bytes"] == own + (d["files"][".index"][0] if rank == 0 else 0), (rank, d["read_bytes"], own)
    # and the values every rank loads came back: the restart's optimizer state is the saved one
    for before, after in zip(first, again, strict=True):
        for param, state in before["optim"]["state"].items():
            assert torch.equal(state["step"], after["optim"]["state"][param]["step"]), param
