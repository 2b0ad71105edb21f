"""ckpt's index files as JSON (`ckpt.format.index_file`): what a save writes reads back as the
same DCP metadata, an index of an earlier ckpt (a pickle) still reads, and whatever someone who
can write the manifest too puts in one is refused with InvalidCheckpoint, never run nor
half-built into something a restore would crash on or allocate from."""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import InvalidCheckpoint
from ckpt.format.index_file import decode_index, encode_index
from ckpt.restore.partial import uncovered


def _md() -> Metadata:
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 8])), ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 8]))]
    return Metadata(
        {"model.w": TensorStorageMetadata(props, torch.Size([8, 8]), chunks), "optim.param_groups": BytesStorageMetadata(),
         "empty": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([0]), [])},
        planner_data={"ckpt.held_keys": ["model.w", "optim.param_groups"], "ckpt.layout": {"files": ["__0_0.distcp"], "keys": {"model.w": (((4, 2), [0, 8]), (0, 0)), "x": ()}, "ranked": []}},
        storage_data={
            MetadataIndex("model.w", [0, 0]): _StorageInfo("__0_0.distcp", 0, 1000),
            MetadataIndex("model.w", [4, 0]): _StorageInfo("__0_0.distcp", 1000, 1000, []),
            MetadataIndex("optim.param_groups"): _StorageInfo("__0_0.distcp", 2000, 50),
        },
        storage_meta=StorageMeta(),
        version="1.0.0",
    )  # fmt: skip


def test_an_index_reads_back_as_the_metadata_it_was_made_of_and_a_pickled_one_still_reads():
    md = _md()
    blob = encode_index(md)
    for got in (decode_index(blob, ".index"), decode_index(pickle.dumps(md), ".index")):
        assert got.state_dict_metadata == md.state_dict_metadata
        assert got.storage_data == md.storage_data and got.version == md.version
        assert got.planner_data == md.planner_data  # tuples stay tuples, lists lists
        assert type(got.planner_data["ckpt.layout"]["keys"]["model.w"][0][0]) is tuple
    assert len(blob) < len(pickle.dumps(md))


def _doc() -> dict:
    return json.loads(encode_index(_md()))


def _with(change) -> bytes:  # noqa: ANN001
    doc = _doc()
    change(doc)
    return json.dumps(doc).encode()


HOSTILE = {
    "not json": b"{not json",
    "a pickle that runs code": b"\x80\x04cos\nsystem\n(S'true'\ntR.",
    "another format": _with(lambda d: d.update(ckpt_index=2)),
    "keys not a list": _with(lambda d: d.update(keys={"a": 1})),
    "an unknown dtype": _with(lambda d: d["props"][0].__setitem__(0, "os.system")),
    "a dtype named as a layout": _with(lambda d: d["props"][0].__setitem__(0, "torch.strided")),
    "requires_grad a string": _with(lambda d: d["props"][0].__setitem__(2, "yes")),
    "properties of 4 fields": _with(lambda d: d["props"][0].pop()),
    "a properties number out of the table": _with(lambda d: d["keys"][0].__setitem__(2, 9)),
    "a negative key number": _with(lambda d: d["pieces"][0].__setitem__(0, -1)),
    "a key number out of the table": _with(lambda d: d["pieces"][0].__setitem__(0, 99)),
    "a file number out of the table": _with(lambda d: d["pieces"][0].__setitem__(3, 5)),
    "a file number that is a name": _with(lambda d: d["pieces"][0].__setitem__(3, "__0_0.distcp")),
    "a negative size": _with(lambda d: d["keys"][0].__setitem__(3, [-8, 8])),
    "a size of floats": _with(lambda d: d["keys"][0].__setitem__(3, [8.0, 8])),
    "a size that is a number": _with(lambda d: d["keys"][0].__setitem__(3, 8)),
    "a chunk outside the tensor": _with(lambda d: d["keys"][0].__setitem__(4, [[6, 0], [4, 8]])),
    "a chunk bigger than its bytes": _with(lambda d: d["pieces"][0].__setitem__(5, 10)),
    "a huge size": _with(lambda d: d["keys"][0].__setitem__(3, [1 << 70, 8])),
    "a file outside the step": _with(lambda d: d["files"].__setitem__(0, "../../etc/passwd")),
    "an absolute file": _with(lambda d: d["files"].__setitem__(0, "/etc/passwd")),
    "a piece of 6 fields": _with(lambda d: d["pieces"][0].pop()),
    "an offset that is a string": _with(lambda d: d["pieces"][0].__setitem__(4, "0")),
    "a transform that is not a string": _with(lambda d: d["pieces"][1].__setitem__(6, [1])),
    "a transformed (compressed) piece": _with(lambda d: d["pieces"][1].__setitem__(6, ["stream.zstd"])),
    "an entry of an unknown kind": _with(lambda d: d["keys"][1].__setitem__(1, "x")),
    "planner data with a raw dict": _with(lambda d: d.__setitem__("planner", {"a": 1, "b": 2})),
    "a dict key that is a list": _with(lambda d: d.__setitem__("planner", {"d": [[{"t": [[1]]}, 1]]})),
    "a version that is a number": _with(lambda d: d.__setitem__("version", 1)),
    "deeply nested": b'{"ckpt_index":1,"keys":[],"pieces":[],"planner":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_an_index_someone_else_wrote_is_refused_saying_where(name):
    with pytest.raises(InvalidCheckpoint, match=r"__1_0\.index"):
        decode_index(HOSTILE[name], "step-1/__1_0.index")


# An index rewritten (and the manifest to match) to list each element of one tensor as a saved
# piece: its types and ranges are right, and the check of which pieces cover a rank's was
# quadratic in them (an hour for 3 MB, every other rank waiting in a collective). It must
# answer at once: not covered, so the restore reads `.metadata` instead. (Found by an outside
# review.)
def _hostile(side: int) -> bytes:
    chunks = [ChunkStorageMetadata(torch.Size([i, j]), torch.Size([1, 1])) for i in range(side) for j in range(side)]
    md = Metadata(
        {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([side, side]), chunks)},
        storage_data={MetadataIndex("model.w", c.offsets): _StorageInfo("__0_0.distcp", 0, 1000) for c in chunks},
        storage_meta=StorageMeta(),
    )
    return encode_index(md)


def test_an_index_of_a_piece_per_element_is_passed_over_at_once_for_metadata():
    md = decode_index(_hostile(128), "step-1/__0_0.index")  # 16,384 pieces, 0.8 MB
    start = time.monotonic()
    why = uncovered(md, {"model": {"w": torch.zeros(128, 128)}})
    assert time.monotonic() - start < 5, "quadratic in the pieces of one key"
    assert why  # not covered as far as a restore goes: it reads .metadata


def test_a_sharded_tensor_of_many_pieces_is_still_covered():
    side = 64
    chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, side])) for i in range(side)]
    md = Metadata(
        {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([side, side]), chunks)},
        storage_data={MetadataIndex("model.w", c.offsets): _StorageInfo("__0_0.distcp", 0, 1000) for c in chunks},
        storage_meta=StorageMeta(),
    )
    assert uncovered(md, {"model": {"w": torch.zeros(side, side)}}) == ""
    overlapping = Metadata(
        {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 2]),
                                          [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])), ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 2]))])},
        storage_data={}, storage_meta=StorageMeta(),
    )  # fmt: skip
    assert "overlap" in uncovered(overlapping, {"model": {"w": torch.zeros(2, 2)}})
