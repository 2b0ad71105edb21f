"""Restart on a different world size and continue exactly: the same global batches in the
same order, only uncommitted steps redone, and a restart event that says what happened."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.cli import ckpt_cli
from tests.support.elastic import global_batches, job


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_restart_on_another_world_size_replays_the_same_global_batches(tmp_path, before, after):
    ref_logs = tmp_path / "ref"
    assert job(2, tmp_path / "ref-root", ref_logs, "--steps", "12", "--final", str(tmp_path / "ref.pt")) == [0, 0]
    reference = global_batches(ref_logs)
    assert sorted(reference) == list(range(1, 13))
    # 12 steps x 8 samples over a 40-sample dataset: the run crosses two epoch boundaries
    assert sum(len(b) for b in reference.values()) == 96

    root = tmp_path / "root"
    die = ("--die-at", "8") if before == 2 else ()
    first = job(before, root, tmp_path / "first", "--steps", "12" if before == 2 else "7", *die)
    assert any(first) if before == 2 else first == [0]
    second = job(after, root, tmp_path / "second", "--steps", "12", "--final", str(tmp_path / "resumed.pt"))
    assert second == [0] * after

    # Checkpoints every 3 steps: the 2-rank job dies past step 6; the 1-rank job stops cleanly
    # at step 7 and saves on its way out.
    committed = 6 if before == 2 else 7
    one, two = global_batches(tmp_path / "first"), global_batches(tmp_path / "second")
    # The second job starts right after the last commit and runs to the end...
    assert sorted(two) == list(range(committed + 1, 13))
    # ...and every global batch is the reference's, sample for sample, on either world size.
    for step, batch in [*one.items(), *two.items()]:
        if before == 2 and step == 8 and batch is one.get(8):
            assert batch < reference[8]  # rank 1 died inside step 8: only rank 0's half was read
        else:
            assert batch == reference[step], f"step {step}: {sorted(batch)} != {sorted(reference[step])}"
    # Only the uncommitted steps were redone.
    assert sorted(set(one) & set(two)) == [s for s in sorted(one) if s > committed]

    # The loss landscape is the same: weights match the uninterrupted run up to summation order.
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    for k in ref:
        torch.testing.assert_close(resumed[k], ref[k], rtol=1e-4, atol=1e-5)

    out = ckpt_cli("events", str(root), "--json")
    assert out.returncode == 0, out.stderr
    restarts = [e for e in json.loads(out.stdout)["events"] if e["kind"] == "restart"]
    assert len(restarts) == 1
    ev = restarts[0]
    assert (ev["world_size_before"], ev["world_size"], ev["step"]) == (before, after, committed)
    if before == 2:
        # rank 0 saw its peer vanish (a collective failed), or was killed before it could say
        assert ev["cause"].startswith(("error: RuntimeError", "unknown")), ev["cause"]
        assert ev["steps_lost"] == 2  # steps 7 and 8 were done by rank 0, past the commit at 6
    else:
        assert ev["cause"] == "exited" and ev["steps_lost"] == 0
    table = ckpt_cli("events", str(root))
    assert f"{before} -> {after}" in table.stdout and "1 restarts" in table.stdout


def test_rng_policy_survivors_keep_their_streams_and_new_ranks_derive_theirs(tmp_path):
    root = tmp_path / "root"
    assert job(1, root, tmp_path / "one", "--steps", "4", "--rng-out", str(tmp_path / "one")) == [0]
    assert job(2, root, tmp_path / "two", "--steps", "4", "--rng-out", str(tmp_path / "two")) == [0, 0]
    assert job(2, root, tmp_path / "again", "--steps", "4", "--rng-out", str(tmp_path / "again")) == [0, 0]

    def read(name: str) -> dict:
        return json.loads((tmp_path / name).read_text())

    # rank 0 existed when step 4 was saved: it continues its own streams exactly
    assert read("two.enter.rank0.json") == read("one.exit.rank0.json")
    # rank 1 is new: its streams come from (step, rank), the same on every restore...
    assert read("two.enter.rank1.json") == read("again.enter.rank1.json")
    # ...and they are its own, not a copy of rank 0's
    r0, r1 = read("two.enter.rank0.json"), read("two.enter.rank1.json")
    assert all(r0[k] != r1[k] for k in ("torch", "numpy", "python"))


@pytest.mark.parametrize(
    ("after", "workers"), [(2, 2), (1, 0)], ids=["same-world-2-workers", "2to1-global-cursor"]
)
def test_stateful_dataloader_resumes_exactly(tmp_path, after, workers):
    """torchdata's StatefulDataLoader knows what its workers prefetched: at the same world size
    its own state is restored (exact with worker processes); on another world size its
    per-rank state cannot apply, and the ElasticSampler's global cursor takes over."""
    loader = ("--loader", "stateful", "--workers", str(workers))
    assert job(2, tmp_path / "ref-root", tmp_path / "ref", "--steps", "12", *loader) == [0, 0]
    reference = global_batches(tmp_path / "ref")

    root = tmp_path / "root"
    assert any(job(2, root, tmp_path / "first", "--steps", "12", "--die-at", "8", *loader))
    assert job(after, root, tmp_path / "second", "--steps", "12", *loader) == [0] * after
    two = global_batches(tmp_path / "second")
    assert sorted(two) == list(range(7, 13))
    for step, batch in two.items():
        assert batch == reference[step], f"step {step}: {sorted(batch)} != {sorted(reference[step])}"
    log0 = (tmp_path / "second" / "rank0.log").read_text()
    dropped = "per-rank state is dropped and the global data position rules" in log0
    assert dropped == (after != 2)
