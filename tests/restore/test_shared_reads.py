"""What a restore reads once per job rather than once per rank (issue 40): a 2-rank FSDP2 job
on the moto S3 server, behind a proxy that records every request, saves and restarts; the
restart's requests are counted by object."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import RANKS, WORKER, dumps, rank_logs
from tests.support.launch import run
from tests.support.s3proxy import FaultyProxy


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultyProxy(s3_endpoint)
    yield p
    p.close()


def test_metadata_is_read_from_the_store_once_per_restore_not_once_per_rank(tmp_path, proxy, s3_root, s3_options):
    options = {**s3_options, "endpoint_url": proxy.url}
    args = ("--mode", "fsdp2", "--root", s3_root, "--steps", 5, "--every", 5, "--storage-options", json.dumps(options))
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "out"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    proxy.requests.clear()
    assert run(RANKS, WORKER, *map(str, args), "--out", str(tmp_path / "again"), log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    assert [d["restored_step"] for d in dumps(tmp_path / "again")] == [5] * RANKS
    reads = [path for kind, path in proxy.requests if kind in ("get", "range") and path.endswith("step-0000000005/.metadata")]
    assert len(reads) == 1, reads  # rank 0's, checked there and sent to the others (each checks it again)
