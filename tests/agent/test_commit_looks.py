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


def _job(tmp_path, s3_root: str, options: dict, one_node: bool = False) -> list[int]:
    env = {"CKPT_SPOOL": str(tmp_path / "node0")} if one_node else {"TEST_SPOOL_OF_RANK": str(tmp_path / "node{rank}")}
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


def test_the_ranks_of_one_node_list_the_markers_once_and_the_commit_is_known_without_reading_the_manifest(tmp_path, proxy, s3_root, s3_options):
    """Two ranks on one node (one spool, one agent), rank 0's upload slower: rank 1 is durable
    first and does not list the markers; rank 0, the node's last, lists once and commits, and
    records the commit beside the markers. Rank 1's look at the commit reads that record (a
    few bytes: `committed_as_requested` reads the manifest, one entry per file and tens of MB
    at 10,000 ranks, only without it). Before: each rank listed, ten LIST pages each at
    10,000 ranks."""
    options = {**s3_options, "endpoint_url": proxy.url}
    with agent(tmp_path / "node0", tmp_path / "agent0.log", env={"CKPT_FAULT": "agent_upload:0:5:sleep=2"}) as a0:
        assert _job(tmp_path, s3_root, options, one_node=True) == [0] * RANKS, rank_logs(tmp_path)
        until("the node to commit step 5", lambda: "committed" in a0.text(), logs=a0.text)
    assert _durable_lists(proxy) == 1, proxy.listed
    assert any(k == "put" and p.endswith(".committed") for k, p in proxy.requests)


def test_a_party_knows_the_commit_from_its_record_without_the_manifest_and_from_the_manifest_without_the_record(tmp_path):
    from ckpt.node.durable import DURABLE_DIR, committed_as_requested, committed_name, files_digest
    from ckpt.node.spool import Request
    from ckpt.storage.store import Store

    store = Store(str(tmp_path))
    request = Request(root=str(tmp_path), storage_options={}, rel="step-5", step=5, save_id="s1", rank=1, world=2, files=["a"], manifest={"files": {"a": {"checksum": "x"}}}, started=0.0)
    assert committed_as_requested(store, request) is None
    (tmp_path / "step-5" / DURABLE_DIR).mkdir(parents=True)
    (tmp_path / "step-5" / "manifest.json").write_text('{"files": {"a": {"checksum": "y"}}}')  # another save's
    assert committed_as_requested(store, request) is False
    (tmp_path / "step-5" / "manifest.json").write_text('{"files": {"a": {"checksum": "x"}}}')
    assert committed_as_requested(store, request) is True  # no record: the manifest says
    (tmp_path / "step-5" / "manifest.json").write_text('{"files": {"a": {"checksum": "y"}}}')  # another save's
    record = tmp_path / "step-5" / DURABLE_DIR / committed_name("s1")
    record.write_bytes(files_digest({"a": {"checksum": "y"}}))  # the save's name over other files
    assert committed_as_requested(store, request) is False  # vouches for nothing: the manifest says
    (tmp_path / "step-5" / "manifest.json").unlink()
    record.write_bytes(files_digest(request.manifest["files"]))
    assert committed_as_requested(store, request) is True  # the record alone: the manifest not read



def _draft_of_two_ranks(step: int = 5):
    from ckpt.format.manifest import FileEntry, Manifest

    files = {
        "__0_0.distcp": FileEntry(10, "xxh3_64:00000000000000a0", 0),
        "__1_0.distcp": FileEntry(20, "xxh3_64:00000000000000b1", 1),
        ".metadata": FileEntry(30, "xxh3_64:00000000000000c2", -1),
    }
    return Manifest(step=step, world_size=2, created=1.0, files=files)


def _forged(draft):  # another manifest put in the draft's place: rank 0's file swapped
    from ckpt.format.manifest import FileEntry

    return draft.narrowed({**draft.files, "__0_0.distcp": FileEntry(10, "xxh3_64:00000000000000ff", 0)}).to_json()


# What is in the draft's place when the last rank is durable, and what the commit does.
DRAFTS = [
    ("rank 0's draft", lambda d: d.to_json(), "committed"),
    ("another draft put in its place", _forged, "not the draft"),
    ("the draft cut short", lambda d: d.to_json()[:-5], "not the draft"),
    ("another step's draft, its checksum in the request", None, "of another step"),
    ("no draft", lambda d: None, "NotFound"),
]


@pytest.mark.parametrize("what,content,outcome", DRAFTS, ids=[d[0] for d in DRAFTS])
def test_each_request_lists_its_own_files_and_the_commit_writes_rank_0s_draft_and_no_other(tmp_path, what, content, outcome):
    """A request names rank 0's draft of the manifest in the root by its checksum, and lists
    the rank's own files alone (the whole list is tens of MB at 10,000 ranks); whoever finds
    every rank durable commits that draft, and nothing else that is in its place."""
    from ckpt.errors import InvalidCheckpoint, NotFound
    from ckpt.format.manifest import Manifest
    from ckpt.node.durable import (
        DURABLE_DIR,
        commit_if_complete,
        draft_name,
        mark_durable,
        write_draft,
    )
    from ckpt.node.spool import Request
    from ckpt.storage.store import Store

    store, rel = Store(str(tmp_path)), "step-0000000005"
    draft = _draft_of_two_ranks()
    ref = write_draft(store, rel, "s1", draft)
    mine = draft.narrowed({"__1_0.distcp": draft.files["__1_0.distcp"]})
    if content is None:  # a draft of step 6 whose checksum the request carries
        ref = write_draft(store, rel, "s1", _draft_of_two_ranks(step=6))
    else:
        data = content(draft)
        path = tmp_path / rel / DURABLE_DIR / draft_name("s1")
        path.unlink()
        if data is not None:
            path.write_bytes(data)
    request = Request(
        root=str(tmp_path), storage_options={}, rel=rel, step=5, save_id="s1", rank=1, world=2, files=["__1_0.distcp"],
        manifest=json.loads(mine.to_json()), started=0.0, draft=ref,
    )  # fmt: skip
    assert set(request.manifest["files"]) == {"__1_0.distcp"}
    for rank, names in ((0, ["__0_0.distcp", ".metadata"]), (1, ["__1_0.distcp"])):
        mark_durable(store, rel, "s1", rank, {n: draft.files[n].checksum for n in names})
    if outcome == "committed":
        assert commit_if_complete(store, request) == "committed"
        committed = Manifest.from_json((tmp_path / rel / "manifest.json").read_bytes(), "the commit")
        assert committed.files == draft.files and committed.created == draft.created  # as drafted (its persist time: the commit's)
        assert commit_if_complete(store, request) == "found"  # by the record
        return
    with pytest.raises(NotFound if outcome == "NotFound" else InvalidCheckpoint, match=None if outcome == "NotFound" else outcome):
        commit_if_complete(store, request)
    assert not (tmp_path / rel / "manifest.json").exists()
