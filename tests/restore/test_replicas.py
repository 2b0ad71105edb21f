"""Replicated state is read from the store once per group of replicas (issue 40): under DDP every
rank loads the whole state, under HSDP the ranks of one shard in each replica load the same
pieces. Each rank reads its part, verified, and the ranks of a group send each other theirs.
Real gloo jobs (tests/workers/worker.py) with a model wide enough that its pieces are not the
small shared values; each rank's bytes read from the store are checked against the files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.jobs import WORKER, rank_logs
from tests.support.launch import run


def _job(tmp_path, ranks: int, mode: str, out: str, *extra: str) -> list[dict]:
    args = ("--mode", mode, "--width", "1024", "--root", str(tmp_path / "root"), "--steps", "5", "--every", "5", *extra)
    codes = run(ranks, WORKER, *args, "--out", str(tmp_path / out), log_dir=tmp_path, timeout=240)
    assert codes == [0] * ranks, rank_logs(tmp_path)
    return [json.loads((tmp_path / f"{out}.rank{r}.reads.json").read_text()) for r in range(ranks)]


def _dumps(out, ranks: int = 2) -> list[dict]:
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(ranks)]


def _same_state(a: dict, b: dict) -> None:
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for param, state in a["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optim"]["state"][param][name]), (param, name)


@pytest.mark.parametrize(("mode", "ranks"), [("ddp", 2), ("hsdp", 4)])
def test_each_replica_reads_its_part_and_receives_the_rest(tmp_path, mode, ranks):
    """On the world size that saved, the replicas of a group read the pieces they all load
    once between them, each about its share: before, a DDP rank read every rank's file, an
    HSDP rank its replica's files too. The restored state is the saved one."""
    _job(tmp_path, ranks, mode, "out")
    reads = _job(tmp_path, ranks, mode, "again")
    files = reads[0]["files"]
    data = sum(size for n, (size, _) in files.items() if n.endswith(".distcp"))
    indexes = sum(size for n, (size, _) in files.items() if "index" in n)
    got = [d["read_bytes"] for d in reads]
    assert all(d["received_bytes"] > 0 for d in reads), reads  # each rank got the others' part
    # the data once, and per rank the indexes and the checksum blocks (1 MiB) its pieces straddle
    assert sum(got) <= data + ranks * (indexes + (2 << 20)), (got, data)
    assert max(got) <= 0.75 * data * (2 if mode == "hsdp" else 1) * 2 / ranks + indexes + (2 << 20), (got, data)
    before, after = _dumps(tmp_path / "out", ranks), _dumps(tmp_path / "again", ranks)
    for a, b in zip(before, after, strict=True):
        assert b["restored_step"] == 5
        _same_state(a, b)


def test_on_more_ranks_the_job_reads_the_state_about_once(tmp_path):
    """A 2-rank DDP checkpoint restored on 3 ranks: the three read it once between them (each
    a third, give or take the checksum blocks its pieces straddle), not three times."""
    _job(tmp_path, 2, "ddp", "out")
    reads = _job(tmp_path, 3, "ddp", "three")
    data = sum(size for n, (size, _) in reads[0]["files"].items() if n.endswith(".distcp"))
    total = sum(d["read_bytes"] for d in reads)
    assert total < 1.5 * data, (total, data, [d["read_bytes"] for d in reads])
    assert all(d["read_bytes"] < 0.6 * data for d in reads), [d["read_bytes"] for d in reads]
    before = _dumps(tmp_path / "out")[0]
    for after in _dumps(tmp_path / "three", 3):
        assert after["restored_step"] == 5
        _same_state(before, after)


def test_a_replica_that_cannot_read_its_part_fails_the_restore_everywhere_without_hanging(tmp_path):
    """Step 10's file of rank 1 is corrupt where a piece rank 1 reads for both lies: rank 1
    cannot send its part, rank 0 reads those pieces itself and fails as rank 1 did (both say
    so), and the job falls back to step 5 on both ranks."""
    _job(tmp_path, 2, "ddp", "out", "--steps", "10")
    victim = tmp_path / "root" / "step-0000000010" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a piece rank 1 reads for its group
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    _job(tmp_path, 2, "ddp", "again", "--steps", "10", "--no-save-on-exit")
    assert [d["restored_step"] for d in _dumps(tmp_path / "again")] == [5, 5]
    said = (tmp_path / "rank0.log").read_text()
    assert "rank 0: " in said and "rank 1: " in said and said.count("__1_0.distcp: checksum mismatch") >= 2, said[-3000:]


def test_pieces_a_rank_loads_a_slice_of_are_streamed_not_sent_whole(tmp_path):
    """A 2-rank DDP checkpoint restored as HSDP on 4 ranks (2 replicas of 2 shards): the
    replicas of a shard load the same half of each saved piece. Sent whole, every rank would
    hold and receive the pieces it loads half of (on 64 shards, 64 times what it needs); each
    streams its own rows instead, and nothing is sent. (Found by an outside review.)"""
    _job(tmp_path, 2, "ddp", "out")
    reads = _job(tmp_path, 4, "hsdp", "hsdp")
    data = sum(size for n, (size, _) in reads[0]["files"].items() if n.endswith(".distcp"))
    assert [d["received_bytes"] for d in reads] == [0] * 4, reads
    # its half of each piece, in the 1 MiB checksum blocks that hold it (pieces of 4 MB here)
    assert all(d["read_bytes"] < 0.8 * data for d in reads), ([d["read_bytes"] for d in reads], data)
    before = _dumps(tmp_path / "out")[0]
    for after in _dumps(tmp_path / "hsdp", 4):
        assert after["restored_step"] == 5
        _same_state(before, after)
