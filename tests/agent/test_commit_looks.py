"""The node agents' commit costs each node O(1) store requests per save (issue 40), not a LIST
of every rank's marker every 2 s while it waits: only the node of rank 0 lists the markers
again; the others look for the manifest alone, less and less often, until `--commit-takeover`.
Two real agents, one per "node" (spool), a rank on each, the root on the moto S3 server behind
a proxy that records every listing."""

from __future__ import annotations

import json

import pytest

from tests.support.agentd import agent, until
from tests.support.jobs import RANKS, WORKER, rank_logs
from tests.support.launch import run
from tests.support.s3proxy import FaultyProxy


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultyProxy(s3_endpoint)
    yield p
    p.close()


def _job(tmp_path, s3_root: str, options: dict) -> list[int]:
    env = {"TEST_SPOOL_OF_RANK": str(tmp_path / "node{rank}")}
    args = ("--mode", "plain", "--root", s3_root, "--steps", 5, "--every", 5, "--no-save-on-exit", "--storage-options", json.dumps(options))
    return run(RANKS, WORKER, *map(str, args), env=env, log_dir=tmp_path, timeout=120)


def _durable_lists(proxy: FaultyProxy) -> int:
    return sum(prefix.endswith("step-0000000005/.durable/") or prefix.endswith("step-0000000005/.durable") for prefix in proxy.listed)


def test_a_node_without_rank_0_waits_for_the_commit_without_listing_the_markers(tmp_path, proxy, s3_root, s3_options):
    """Rank 0's upload stalls (2 s a file): rank 1's node is durable first and waits. It lists the
    markers once, right after its own (the last one to be durable commits); rank 0's node
    lists once and commits. Before: rank 1's node listed every 2 s of the wait."""
    options = {**s3_options, "endpoint_url": proxy.url}
    with (
        agent(tmp_path / "node0", tmp_path / "agent0.log", env={"CKPT_FAULT": "agent_upload:0:5:sleep=2"}) as a0,
        agent(tmp_path / "node1", tmp_path / "agent1.log") as a1,
    ):
        assert _job(tmp_path, s3_root, options) == [0] * RANKS, rank_logs(tmp_path)
        until("rank 0's node to commit step 5", lambda: "committed" in a0.text(), logs=lambda: a0.text() + a1.text())
        assert "committed" not in a1.text()
    assert _durable_lists(proxy) == 2, proxy.listed


def test_when_rank_0s_node_dies_between_its_marker_and_the_commit_another_node_commits(tmp_path, proxy, s3_root, s3_options):
    """Rank 0's agent is killed right after its marker (after a stall that makes rank 1's node
    durable first, its one listing seeing rank 0 missing): rank 1's node lists again once
    `--commit-takeover` has passed, and commits."""
    options = {**s3_options, "endpoint_url": proxy.url}
    fault = {"CKPT_FAULT": "agent_upload:0:5:sleep=1,agent_durable:0:5"}
    with (
        agent(tmp_path / "node0", tmp_path / "agent0.log", env=fault) as a0,
        agent(tmp_path / "node1", tmp_path / "agent1.log", "--commit-takeover", "3") as a1,
    ):
        assert _job(tmp_path, s3_root, options) == [0] * RANKS, rank_logs(tmp_path)
        until("rank 1's node to commit step 5", lambda: "committed" in a1.text(), timeout=60, logs=lambda: a0.text() + a1.text())
        assert a0.proc.poll() is not None and "committed" not in a0.text()
