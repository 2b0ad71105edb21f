"""One conformance suite for every backend a root can be on (ckpt.storage.backend): local disk,
S3 (a moto server on loopback) and another fsspec filesystem (memory://) do the same things
through `Store`, each its own way."""

from __future__ import annotations

import uuid

import pytest

from ckpt.errors import InvalidCheckpoint, NotFound
from ckpt.storage.store import Store


@pytest.fixture(params=["local", "s3", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "root"))
    if request.param == "memory":
        return Store(f"memory://ckpt-{uuid.uuid4().hex[:12]}/root")
    return Store(request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options"))


def test_every_backend_reads_back_what_it_wrote_and_lists_it_under_its_step(store):
    store.check_reachable()
    assert store.survey() == ({}, [])
    store.makedirs("step-0000000001")
    with store.open_write("step-0000000001/data", size=5) as f:
        f.write(b"bytes")
    store.put_atomic("step-0000000001/manifest.json", b"{}")
    assert store.read_bytes("step-0000000001/data") == b"bytes"
    assert store.read_small("step-0000000001/data", 5) == b"bytes" and store.read_small("step-0000000001/data", 4) is None
    with store.open_read("step-0000000001/data", [(1, 3)], 5) as f:
        f.seek(1)
        assert f.read(2) == b"yt"
    assert store.list_step(1).files == {"data": 5, "manifest.json": 2} and store.list_step(2) is None
    assert list(store.scan()) == [1] and store.scan()[1].has_manifest
    assert store.exists("step-0000000001/data") and not store.exists("step-0000000001/other")


def test_a_missing_file_is_not_found_and_an_oversized_json_file_is_refused_unread_on_every_backend(store):
    with pytest.raises(NotFound, match="does not exist"):
        store.read_bytes("step-0000000001/data")
    with pytest.raises(NotFound, match="does not exist"), store.open_read("step-0000000001/data"):
        pass
    store.put_atomic("events/big.json", b" " * (2 << 20))
    with pytest.raises(InvalidCheckpoint, match="2,097,152 bytes, more than the 1 MiB"):
        store.read_bytes("events/big.json")
    assert store.list_dir("events") == ["big.json"] and store.list_dir("nowhere") == []
    store.remove("events/big.json")
    store.remove("events/big.json")  # gone already: nothing to do
    assert store.list_dir("events") == []


def test_every_backend_creates_a_file_once_and_replaces_only_the_version_that_was_read(store):
    assert store.read_tagged("lease.json") is None
    assert store.put_if_absent("lease.json", b"first") is not None
    assert store.put_if_absent("lease.json", b"second") is None
    read = store.read_tagged("lease.json")
    assert read.data == b"first" and read.size == 5
    assert store.put_if_unchanged("lease.json", b"third", read.tag) is not None
    assert store.put_if_unchanged("lease.json", b"fourth", read.tag) is None  # not the version read
    assert store.read_bytes("lease.json") == b"third"


def test_every_backend_deletes_a_whole_step_and_nothing_else(store):
    for step in (1, 2):
        store.put_atomic(f"step-000000000{step}/sub/data", b"x")
        store.put_atomic(f"step-000000000{step}/manifest.json", b"{}")
    store.remove_step(1)
    store.remove_step(1)  # gone already: nothing to do
    assert list(store.scan()) == [2] and store.list_step(1) is None
