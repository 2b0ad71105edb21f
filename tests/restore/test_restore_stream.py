"""Restore streams each data file once, in bounded chunks, through its checksum.

Tensors go straight from the file into their targets (or through a small scratch buffer);
nothing is unpickled before the whole file matched the manifest, so a flipped bit is still
caught although the bytes were already in place, and a checkpoint of any size restores in
a few MiB of host memory beyond its targets. The reader must handle the blobs the writer
makes today and those it will make: `torch.serialization.skip_data` zips filled in later
(their CRCs are wrong) with padding between items.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import io
import json
import os
import pickle
import struct
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import ckpt
from ckpt.errors import InvalidCheckpoint
from ckpt.format import bytes_item, tensor_blob
from ckpt.format.checksum import checksum
from ckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from ckpt.restore.dcp_read import make_reader
from ckpt.restore.planner import SafeLoadPlanner
from ckpt.restore.tensor_stream import Scratch
from ckpt.storage import catalog, verified
from ckpt.storage.store import Store, step_dir_name

DATA = "__0_0.distcp"


# -- helpers ----------------------------------------------------------------------------------
class Holder:
    """Named values saved and restored through `Checkpointer(extra=...)`."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return self.values

    def load_state_dict(self, sd: dict) -> None:
        self.values = dict(sd)


def save(root: Path, values: dict) -> Path:
    """Commit `values` as the checkpoint of step 0 under `root`; returns its directory."""
    with ckpt.Checkpointer(str(root), extra={"h": Holder(values)}, interval=None, save_on_exit=False, handle_sigterm=False) as cp:
        cp.save(blocking=True)
    return root / step_dir_name(0)


def restore(root: Path, like: dict) -> dict:
    """Restore into fresh targets shaped like `like`; returns what came back."""
    h = Holder({k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else v for k, v in like.items()})
    with ckpt.Checkpointer(str(root), extra={"h": h}, interval=None, save_on_exit=False, handle_sigterm=False) as cp:
        assert cp.restored_step == 0
    return h.values


def same_bits(got: object, want: object) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and (got.dtype, got.shape) == (want.dtype, want.shape)
            and bytes(got.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(want.contiguous().reshape(-1).view(torch.uint8).numpy())
        )
    return got == want


def metadata(step: Path):
    return pickle.loads((step / METADATA_NAME).read_bytes())


def item(step: Path, fqn: str):
    """(offset, length) of the item `fqn` in the data file."""
    [info] = [v for k, v in metadata(step).storage_data.items() if k.fqn == fqn]
    return info.offset, info.length


def record_offset(blob: bytes, suffix: str) -> int:
    """Where the data of the zip record named `*suffix` starts in `blob` (read with zipfile,
    independently of the parser under test)."""
    [info] = [i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if i.filename.endswith(suffix)]
    nlen, xlen = struct.unpack_from("<HH", blob, info.header_offset + 26)
    return info.header_offset + 30 + nlen + xlen


def recommit(step: Path, names: tuple[str, ...] = (DATA,)) -> None:
    """Rewrite the manifest so that it vouches for the files as they are now (what someone
    who can write to the bucket could do)."""
    m = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    for name in names:
        data = (step / name).read_bytes()
        m.files[name] = FileEntry(len(data), checksum(data), m.files[name].rank)
    (step / MANIFEST_NAME).write_bytes(m.to_json())


def relayout(step: Path, align: int = 4096) -> None:
    """Rewrite a checkpoint the way the next writer lays it out: every tensor item a
    `skip_data` blob whose storage is filled in afterwards (zip CRCs left wrong), every item
    aligned to `align` bytes with garbage in the gaps; .metadata and manifest to match."""
    md = metadata(step)
    old = (step / DATA).read_bytes()
    out = bytearray()
    for key, info in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset):
        blob = old[info.offset : info.offset + info.length]
        if not isinstance(md.state_dict_metadata[key.fqn], BytesStorageMetadata):
            t = torch.load(io.BytesIO(blob), weights_only=True)
            buf = io.BytesIO()
            with torch.serialization.skip_data():
                torch.save(t, buf)
            blob = bytearray(buf.getvalue())
            at = record_offset(bytes(blob), "/data/0")
            raw = bytes(t.untyped_storage())
            blob[at : at + len(raw)] = raw
            blob = bytes(blob)
        out += os.urandom(-len(out) % align)
        info.offset, info.length = len(out), len(blob)
        out += blob
    out += os.urandom(100)
    (step / DATA).write_bytes(bytes(out))
    (step / METADATA_NAME).write_bytes(pickle.dumps(md))
    recommit(step, (DATA, METADATA_NAME))


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def load_step(step: Path, sd: dict) -> None:
    """dcp.load of `sd` from `step` through ckpt's reader, as the Checkpointer does."""
    store = Store(str(step.parent))
    manifest = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    dcp.load(sd, storage_reader=make_reader(store, step.name, manifest), planner=SafeLoadPlanner())


@pytest.fixture
def count_torch_load(monkeypatch):
    """Every torch.load call from here on, by what it was given."""
    calls: list = []
    real = torch.load

    def spy(f, *args, **kwargs):
        calls.append(f)
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def many_values() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(40, dtype=torch.float32)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "bf16_empty": torch.zeros(3, 0, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
        "scalar": torch.tensor(3.5),
        "i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "i16": torch.randint(-1000, 1000, (4, 2), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**30), 2**30, (6,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-(2**60), 2**60, (3, 1, 2), generator=g),
        "u8": torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "u16": torch.randint(0, 60000, (5,), generator=g).to(torch.uint16),
        "big": torch.randn(700, 500, generator=g),  # 1.4 MB: several read chunks
        "slice_of_bigger": base[10:30],  # saved with its whole storage
        "transposed": torch.randn(5, 3, generator=g).t(),  # not contiguous: not streamed
        "count": 5,
        "name": "hello",
        "nested": [1, {"a": 2.5}],
    }


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["as_written", "skip_data_blobs_with_padding"])
def test_every_dtype_and_shape_comes_back_bit_for_bit(tmp_path, layout):
    values = many_values()
    step = save(tmp_path / "root", values)
    if layout != "as_written":
        relayout(step)
    got = restore(tmp_path / "root", values)
    for k, v in values.items():
        assert same_bits(got[k], v), k


def test_tensors_stream_into_their_targets_without_torch_load(tmp_path, count_torch_load, monkeypatch):
    values = {k: v for k, v in many_values().items() if isinstance(v, torch.Tensor) and k != "transposed"}
    step = save(tmp_path / "root", values)
    relayout(step)
    monkeypatch.setattr(verified, "READ_CHUNK", 4096)  # many chunks per tensor
    monkeypatch.setattr(Scratch, "_HOST_CHUNK", 4096)
    targets = {k: torch.full_like(v, 7) for k, v in values.items()}
    count_torch_load.clear()
    load_step(step, {"extra": {"h": targets}})
    for k, v in values.items():
        assert same_bits(targets[k], v), k
    assert count_torch_load == []


# -- sub-ranges of a saved chunk (resharding), at the reader's level ----------------------------
class Into:
    """A minimal load planner: fixed targets by name."""

    def __init__(self, targets: dict) -> None:
        self.targets = targets
        self.committed: list[str] = []

    def resolve_tensor(self, req):
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req, tensor) -> None:
        assert tensor.data_ptr() == self.targets[req.dest_index.fqn].data_ptr()
        self.committed.append(req.dest_index.fqn)

    def load_bytes(self, req, value) -> None:
        raise AssertionError("no bytes asked for")


def read(step: Path, asks: dict, targets: dict) -> Into:
    """Read `asks` (target name -> (storage_offsets, lengths) of the saved tensor w) into
    `targets`, through the reader alone."""
    store = Store(str(step.parent))
    reader = make_reader(store, step.name, Manifest.from_json((step / MANIFEST_NAME).read_bytes()))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    [key] = [k for k in md.storage_data if k.fqn == "extra.h.w"]
    items = [
        ReadItem(LoadItemType.TENSOR, MetadataIndex(name), torch.Size([0] * len(o)), key, torch.Size(o), torch.Size(n))
        for name, (o, n) in asks.items()
    ]
    planner = Into(targets)
    reader.read_data(LoadPlan(items), planner).wait()
    return planner


@pytest.fixture(scope="module")
def saved_w(tmp_path_factory):
    w = torch.arange(8 * 6 * 5, dtype=torch.float32).reshape(8, 6, 5)
    step = save(tmp_path_factory.mktemp("w") / "root", {"w": w})
    return step, w


def test_dim0_slices_read_straight_into_contiguous_targets(saved_w, count_torch_load):
    step, w = saved_w
    targets = {"top": torch.zeros(3, 6, 5), "bottom": torch.zeros(2, 6, 5), "row": torch.zeros(1, 6, 5)}
    planner = read(step, {"top": ([0, 0, 0], [3, 6, 5]), "bottom": ([6, 0, 0], [2, 6, 5]), "row": ([4, 0, 0], [1, 6, 5])}, targets)
    assert torch.equal(targets["top"], w[:3]) and torch.equal(targets["bottom"], w[6:]) and torch.equal(targets["row"], w[4:5])
    assert sorted(planner.committed) == ["bottom", "row", "top"]
    assert count_torch_load == []


@pytest.mark.parametrize("chunk", [1 << 20, 64], ids=["one_chunk", "row_by_row"])
def test_other_slices_and_targets_go_through_the_scratch_buffer(saved_w, count_torch_load, monkeypatch, chunk):
    step, w = saved_w
    monkeypatch.setattr(verified, "READ_CHUNK", chunk)
    monkeypatch.setattr(Scratch, "_HOST_CHUNK", chunk)
    strided = torch.zeros(5, 6, 8).transpose(0, 2)  # 8x6x5, not contiguous
    cases = [
        ("cols", [0, 3, 0], torch.zeros(8, 2, 5), w[:, 3:5]),  # a dim-1 slice: not one range of the blob
        ("inner", [2, 1, 3], torch.zeros(3, 4, 2), w[2:5, 1:5, 3:5]),  # a block in the middle
        ("f64", [5, 0, 0], torch.zeros(2, 6, 5, dtype=torch.float64), w[5:7].double()),  # another dtype
        ("strided", [0, 0, 0], strided, w),
    ]
    for name, offsets, target, want in cases:
        read(step, {name: (offsets, list(target.shape))}, {name: target})
        assert torch.equal(target, want), name
    assert count_torch_load == []


def test_equal_small_blobs_are_decoded_once_into_targets_of_their_own(count_torch_load):
    """Every parameter's optimizer `step` is one value saved as a blob of the same bytes."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckpt.restore import tensor_stream

    tensor_stream._small.cache_clear()
    blob = io.BytesIO()
    torch.save(torch.tensor(7.0), blob)
    targets = {f"p{i}": torch.zeros(()) for i in range(5)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(targets, None, False)
    for name in targets:
        index = MetadataIndex(name)
        req = ReadItem(LoadItemType.TENSOR, index, torch.Size([]), index, torch.Size([]), torch.Size([]))
        tensor_stream.load_blob(blob.getvalue(), [req], planner)
    assert len(count_torch_load) == 1
    targets["p0"].add_(1)  # each target its own tensor, none the decoded one
    assert [t.item() for t in targets.values()] == [8.0, 7.0, 7.0, 7.0, 7.0]


def test_overlapping_requests_on_one_item_are_loaded_after_the_check(saved_w, count_torch_load):
    step, w = saved_w
    targets = {"a": torch.zeros(8, 2, 5), "b": torch.zeros(8, 3, 5)}
    planner = read(step, {"a": ([0, 0, 0], [8, 2, 5]), "b": ([0, 2, 0], [8, 3, 5])}, targets)
    assert torch.equal(targets["a"], w[:, :2]) and torch.equal(targets["b"], w[:, 2:5])
    assert sorted(planner.committed) == ["a", "b"]
    assert len(count_torch_load) == 1  # once for the item, after the file's checksum matched


def test_layout_byte_ranges_of_sub_tensors():
    blob = io.BytesIO()
    torch.save(torch.zeros(4, 3, 2), blob)
    lay = tensor_blob.locate(blob.getvalue())
    assert lay is not None and lay.strides == (6, 2, 1)
    s = lay.tensor_start
    assert lay.span([1, 0, 0], [2, 3, 2]) == (s + 6 * 4, s + 18 * 4)
    assert lay.is_contiguous_in_blob([1, 0, 0], [2, 3, 2])
    assert lay.is_contiguous_in_blob([2, 1, 0], [1, 2, 2])  # part of one row
    assert not lay.is_contiguous_in_blob([0, 1, 0], [2, 2, 2])
    assert not lay.is_contiguous_in_blob([0, 0, 1], [4, 3, 1])
    assert lay.fits([3, 0, 0], [1, 3, 2]) and not lay.fits([3, 0, 0], [2, 3, 2]) and not lay.fits([0, 0], [4, 3])
    # part: both at once, remembered per (offsets, lengths) whatever sequence type they come in
    for offsets, lengths in [([1, 0, 0], [2, 3, 2]), ([0, 1, 0], [2, 2, 2]), ([0, 0, 0], [4, 3, 2]), ([2, 1, 0], [1, 0, 2])]:
        want = (*lay.span(offsets, lengths), lay.is_contiguous_in_blob(offsets, lengths))
        assert lay.part(offsets, lengths) == want
        assert lay.part(torch.Size(offsets), tuple(lengths)) == want
    assert lay.part([3, 0, 0], [2, 3, 2]) is None and lay.part([0, 0], [4, 3]) is None


# -- corruption: caught though streamed, and nothing unpickled before ------------------------
def test_a_flipped_bit_in_tensor_data_is_caught_though_it_was_streamed(tmp_path, count_torch_load):
    w = torch.randn(64, 32)
    step = save(tmp_path / "root", {"w": w, "n": 3})
    off, length = item(step, "extra.h.w")
    blob = (step / DATA).read_bytes()[off : off + length]
    flip(step / DATA, off + record_offset(blob, "/data/0") + 1000)
    assert catalog.scan(Store(str(tmp_path / "root")))[0].state == "committed"  # sizes still match

    target = torch.zeros(64, 32)
    count_torch_load.clear()
    with pytest.raises(CheckpointException) as err:
        load_step(step, {"extra": {"h": {"w": target, "n": 0}}})
    assert f"{DATA}: checksum mismatch" in str(err.value)
    assert not torch.equal(target, torch.zeros(64, 32))  # it was streamed in before the check ...
    assert count_torch_load == []  # ... and nothing was decoded

    with pytest.raises(ckpt.RestoreFailed, match="checksum mismatch"):
        restore(tmp_path / "root", {"w": w, "n": 3})


def malicious(marker: Path, size: int) -> bytes:
    """A pickle that creates `marker` when unpickled, padded to `size` bytes."""

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Evil(), protocol=2)
    assert len(blob) <= size
    return blob + b" " * (size - len(blob))


def test_a_flipped_bit_in_a_pickled_value_is_caught_before_it_is_unpickled(tmp_path, count_torch_load, monkeypatch):
    step = save(tmp_path / "root", {"w": torch.randn(8), "name": "hello"})
    off, length = item(step, "extra.h.name")
    flip(step / DATA, off + length // 2)
    seen = []
    monkeypatch.setattr(SafeLoadPlanner, "load_bytes", lambda self, req, value: seen.append(req))
    count_torch_load.clear()
    with pytest.raises(CheckpointException, match="checksum mismatch"):
        load_step(step, {"extra": {"h": {"w": torch.zeros(8), "name": ""}}})
    assert seen == [] and count_torch_load == []


@pytest.mark.parametrize("where", ["pickled_value", "value_pickle_in_its_zip", "tensor_pickle"])
def test_a_malicious_pickle_never_runs(tmp_path, where, monkeypatch):
    """Swapped in with the same size: the checksum refuses it. With the manifest rewritten
    to match: a tensor pickle is not recognised, so it is only ever torch.load'ed with
    weights_only, which refuses it too; a value's pickle is refused by the plain-value
    unpickler (or its zip's CRC), then by torch.load."""
    name = "hello" * 30  # a pickle long enough to hold the payload
    step = save(tmp_path / "root", {"w": torch.randn(8), "name": name})
    marker = tmp_path / "PWNED"
    if where == "pickled_value":
        off, length = item(step, "extra.h.name")
        at, size = off, length  # the whole torch.save'd value: torch.load rejects a bare pickle
    elif where == "value_pickle_in_its_zip":
        off, length = item(step, "extra.h.name")
        blob = (step / DATA).read_bytes()[off : off + length]
        at = off + record_offset(blob, "/data.pkl")
        size = zipfile.ZipFile(io.BytesIO(blob)).getinfo("archive/data.pkl").file_size
        # The zip's CRCs rewritten to match, as a forger would: the plain unpickler, not the
        # zip's check, is what meets the payload.
        old_crc, new_crc = (struct.pack("<I", zipfile.ZipFile(io.BytesIO(blob)).getinfo("archive/data.pkl").CRC), struct.pack("<I", zlib.crc32(malicious(marker, size))))
        assert blob.count(old_crc) >= 2
        fixed = blob.replace(old_crc, new_crc)
        data = bytearray((step / DATA).read_bytes())
        data[off : off + length] = fixed
        (step / DATA).write_bytes(bytes(data))
    else:
        off, length = item(step, "extra.h.w")
        blob = (step / DATA).read_bytes()[off : off + length]
        at = off + record_offset(blob, "/data.pkl")
        size = zipfile.ZipFile(io.BytesIO(blob)).getinfo("archive/data.pkl").file_size
    data = bytearray((step / DATA).read_bytes())
    data[at : at + size] = malicious(marker, size)
    (step / DATA).write_bytes(bytes(data))
    pickle.loads(malicious(tmp_path / "probe", size))
    assert (tmp_path / "probe").exists()  # the payload is live
    if where == "value_pickle_in_its_zip":
        with zipfile.ZipFile(io.BytesIO(data[off : off + length])) as z:
            assert z.testzip() is None and z.read("archive/data.pkl") == malicious(marker, size)
    refused: list[str] = []
    real_find_class = bytes_item._PlainUnpickler.find_class

    def find_class(self, module, name_):
        refused.append(f"{module}.{name_}")
        return real_find_class(self, module, name_)

    monkeypatch.setattr(bytes_item._PlainUnpickler, "find_class", find_class)

    like = {"w": torch.randn(8), "name": name}
    with pytest.raises(ckpt.RestoreFailed, match="checksum mismatch"):
        restore(tmp_path / "root", like)
    assert not marker.exists()

    recommit(step)
    with pytest.raises(ckpt.RestoreFailed) as failed:
        restore(tmp_path / "root", like)
    assert not marker.exists()
    assert "weights only" in str(failed.value).lower() or "weights_only" in str(failed.value), failed.value
    assert refused == (["io.open"] if where == "value_pickle_in_its_zip" else [])


# -- plain values -------------------------------------------------------------------------------
# A DCP bytes item (a hyperparameter, a counter, an RNG state) is a torch.save blob of its own;
# plain ones are unpickled by an unpickler that refuses every global, the rest by torch.load.
PLAIN = {
    "float": 1e-8,
    "betas": (0.9, 0.999),
    "flag": False,
    "none": None,
    "ints": [0, 1, 2**80, -3],
    "text": "h\u00e9llo",
    "nested": {"step": 3, "x": [1.5, "a", (None, True)]},
    "int_keys": {1: 2, 3: [4]},
}
NOT_PLAIN = {
    "set": {1, 2},  # pickled through builtins.set
    "bytes": b"\x00\x01",  # through _codecs.encode
    "ordered": collections.OrderedDict(a=1),
    "tensor_inside": {"t": torch.arange(3)},  # a storage: a persistent id
    "complex": 1 + 2j,
}


def same_value(got: object, want: object) -> bool:
    """Equal, of the same types all the way down (1 == 1.0 == True would pass ==)."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return list(got) == list(want) and all(same_value(got[k], want[k]) for k in want)  # type: ignore[index]
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(map(same_value, got, want))  # type: ignore[arg-type]
    return got == want


@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_value_loads_as_torch_load_would_without_it(name, count_torch_load):
    blob = _blob(PLAIN[name])
    want = torch.load(io.BytesIO(blob), weights_only=True)
    count_torch_load.clear()
    got = bytes_item.load_value(io.BytesIO(blob))
    assert same_value(got, want) and same_value(got, PLAIN[name])
    assert count_torch_load == []


@pytest.mark.parametrize("name", NOT_PLAIN)
def test_any_other_value_is_left_to_torch_load(name, count_torch_load):
    blob = _blob(NOT_PLAIN[name])
    assert bytes_item._plain(blob) is bytes_item._NOT_PLAIN
    count_torch_load.clear()
    got = bytes_item.load_value(blob)
    assert same_value(got, NOT_PLAIN[name])
    assert len(count_torch_load) == 1


def value_blob(pkl: bytes) -> bytes:
    """A zip laid out as torch.save's of a plain value, CRCs right, whose data.pkl is `pkl`."""
    real = zipfile.ZipFile(io.BytesIO(_blob(0)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in real.infolist():
            z.writestr(info.filename, pkl if info.filename.endswith("/data.pkl") else real.read(info))
    return out.getvalue()


def test_a_value_pickle_that_would_call_anything_is_refused_whatever_its_zip_says(tmp_path):
    """A zip as torch.save writes it, CRCs right, whose data.pkl calls open(): the plain
    unpickler refuses its global, torch.load's allowlist refuses it too; nothing runs."""
    marker = tmp_path / "PWNED"
    blob = value_blob(malicious(marker, 200))
    pickle.loads(malicious(tmp_path / "probe", 200))
    assert (tmp_path / "probe").exists()  # the payload is live
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        z.testzip()  # a well-formed zip: the refusal is the unpickler's
    assert bytes_item._plain(blob) is bytes_item._NOT_PLAIN
    with pytest.raises(pickle.UnpicklingError, match="(?i)weights.only"):
        bytes_item.load_value(blob)
    assert not marker.exists()


def test_the_plain_path_refuses_extension_codes_and_persistent_ids_and_a_forged_memo_index_costs_nothing():
    # An extension code stands for a global (copyreg's registry): the C unpickler would call
    # os.getcwd from its cache without asking find_class.
    copyreg.add_extension("os", "getcwd", 240)
    try:
        pickle.loads(pickle.dumps(os.getcwd, protocol=2))  # fills copyreg's cache
        ext = b"\x80\x02\x82\xf0)R."  # EXT1 240, (), REDUCE: os.getcwd()
        assert pickle.loads(ext) == os.getcwd()  # the payload is live
        assert bytes_item._plain(value_blob(ext)) is bytes_item._NOT_PLAIN
    finally:
        copyreg.remove_extension("os", "getcwd", 240)
    persistent = b"\x80\x02X\x01\x00\x00\x000Q."  # BINPERSID "0": a storage
    assert bytes_item._plain(value_blob(persistent)) is bytes_item._NOT_PLAIN
    # LONG_BINPUT 2**24: the C unpickler grows its memo array to twice that (256 MiB).
    bomb = b"\x80\x02Nr" + struct.pack("<I", 1 << 24) + b"."
    tracemalloc.start()
    try:
        assert bytes_item._plain(value_blob(bomb)) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_many_param_groups_come_back_with_their_own_hyperparameters(tmp_path):
    """Hundreds of bytes items, each group's values its own (layer-wise learning rates)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(100)))
    groups = [{"params": list(m.parameters()), "lr": 1e-3 * (i + 1), "betas": (0.9, 0.99 - i / 1e4)} for i, m in enumerate(model)]
    opt = torch.optim.AdamW(groups)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False)
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, **kw) as cp:
        cp.save(blocking=True)
    want = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"], g["betas"] = 0.5, (0.1, 0.2)
    with ckpt.Checkpointer(str(tmp_path), model=model, optimizer=opt, restore="latest", **kw) as cp:
        assert cp.restored_step == 0
    assert all(same_value({k: v for k, v in g.items() if k != "params"}, w) for g, w in zip(opt.param_groups, want, strict=True))


# -- memory -----------------------------------------------------------------------------------
def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_restoring_a_file_much_larger_than_a_chunk_holds_only_a_few_chunks(tmp_path):
    w = torch.randn(64 << 20 >> 2)  # 64 MiB of tensor data, 64 read chunks
    step = save(tmp_path / "root", {"w": w})
    size = (step / DATA).stat().st_size
    assert size > 64 * max(verified.READ_CHUNK, Scratch._HOST_CHUNK)
    target = torch.zeros_like(w)  # touched: its pages are resident before
    sd = {"extra": {"h": {"w": target}}}
    load_step(step, sd)  # warm up (imports, caches)
    target.zero_()

    if not _peak_rss_reset():
        pytest.skip("/proc/self/clear_refs cannot be written here: the peak RSS cannot be measured")
    base = _peak_rss()
    tracemalloc.start()
    try:
        load_step(step, sd)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(target, w)
    assert peak < 4 << 20, f"python allocations peaked at {peak} bytes for a {size}-byte file"
    grew = _peak_rss() - base
    assert grew < size // 4, f"peak RSS grew by {grew} bytes for a {size}-byte file"

    tracemalloc.start()
    try:
        entry = catalog.inspect(Store(str(tmp_path / "root")), Store(str(tmp_path / "root")).scan()[0], deep=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert entry.state == "committed"
    assert peak < 4 << 20, f"verify --deep peaked at {peak} bytes for a {size}-byte file"


def test_verify_file_streams_and_says_what_is_wrong(tmp_path):
    step = save(tmp_path / "root", {"w": torch.randn(1000)})
    store = Store(str(tmp_path / "root"))
    manifest = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    verified.verify_file(store, step.name, DATA, manifest)
    full = (step / DATA).stat().st_size
    flip(step / DATA, full - 10)
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: checksum mismatch \\(corrupt file\\)"):
        verified.verify_file(store, step.name, DATA, manifest)
    os.truncate(step / DATA, full // 2)
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: {full // 2} bytes, manifest says {full}"):
        verified.verify_file(store, step.name, DATA, manifest)
    with pytest.raises(InvalidCheckpoint, match="not listed in the manifest"):
        verified.verify_file(store, step.name, "__9_0.distcp", manifest)


class _CountingFile:
    """A file of the store, counting the bytes read from it."""

    def __init__(self, f, counts: dict, name: str) -> None:
        self._f, self._counts, self._name = f, counts, name

    def _count(self, n: int) -> None:
        self._counts[self._name] = self._counts.get(self._name, 0) + n

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._count(len(data))
        return data

    def readinto(self, buf) -> int:
        got = self._f.readinto(buf) or 0
        self._count(got)
        return got

    def seek(self, *args) -> int:
        return self._f.seek(*args)

    def seekable(self) -> bool:
        return self._f.seekable()


@pytest.fixture
def bytes_read(monkeypatch):
    """Bytes read from each file of any store from here on, by file name."""
    counts: dict[str, int] = {}
    real = Store.open_read

    @contextlib.contextmanager
    def counting(self, rel, ranges=None, size=None):
        with real(self, rel, ranges, size) as f:
            yield _CountingFile(f, counts, os.path.basename(rel))

    monkeypatch.setattr(Store, "open_read", counting)
    return counts


def test_a_restore_reads_and_verifies_only_the_blocks_holding_what_it_loads(tmp_path, bytes_read, monkeypatch):
    """What another rank needs of a large file (a replicated scalar DCP saved once, half of a
    resharded tensor) costs it the blocks holding that, each verified against its own
    checksum before anything in it is decoded; not the whole file."""
    MiB = 1 << 20
    big = torch.randn(12 * MiB // 4)
    values = {"big": big, "a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64), "n": 5}
    step = save(tmp_path / "root", values)
    store = Store(str(tmp_path / "root"))
    manifest = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    entry, size = manifest.files[DATA], (step / DATA).stat().st_size
    assert (entry.block, len(entry.blocks)) == (MiB, -(-size // MiB))
    assert entry.checksum.startswith("xxh3_64-blocks:")
    for k in "ab":  # small tensors are laid out first: they share the first block
        off, length = item(step, f"extra.h.{k}")
        assert off + length <= MiB
    n_at, _ = item(step, "extra.h.n")  # pickles come after the tensors: the last block
    assert n_at // MiB == len(entry.blocks) - 1

    flip(step / DATA, 6 * MiB + 123)  # in `big`, which the first load does not need
    small = {"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64), "n": 0}
    bytes_read.clear()
    load_step(step, {"extra": {"h": small}})
    assert torch.equal(small["a"], values["a"]) and torch.equal(small["b"], values["b"]) and small["n"] == 5
    assert bytes_read[DATA] <= 2 * MiB, f"read {bytes_read[DATA]} of {size} bytes for two small tensors and an int"

    target = {**small, "big": torch.zeros_like(big)}
    with pytest.raises(CheckpointException, match=f"{DATA}: checksum mismatch in bytes {6 * MiB}-{7 * MiB - 1} \\(corrupt file\\)"):
        load_step(step, {"extra": {"h": target}})
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: checksum mismatch in bytes {6 * MiB}-"):
        verified.verify_file(store, step.name, DATA, manifest)  # verify reads all of it

    # A flipped bit in the pickle: its block fails before the pickle is decoded.
    flip(step / DATA, 6 * MiB + 123)
    verified.verify_file(store, step.name, DATA, manifest)
    flip(step / DATA, n_at + 3)
    seen = []
    monkeypatch.setattr(SafeLoadPlanner, "load_bytes", lambda self, req, value: seen.append(req))
    with pytest.raises(CheckpointException, match="checksum mismatch in bytes"):
        load_step(step, {"extra": {"h": {"n": 0}}})
    assert seen == []


def test_a_blocked_file_cut_short_or_grown_is_caught(tmp_path):
    MiB = 1 << 20
    step = save(tmp_path / "root", {"w": torch.randn(9 * MiB // 4)})  # streamed: past WHOLE_READ_MAX
    store = Store(str(tmp_path / "root"))
    manifest = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    full = (step / DATA).stat().st_size
    assert manifest.files[DATA].block == MiB and full > verified.WHOLE_READ_MAX
    with open(step / DATA, "ab") as f:
        f.write(b"x")
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: {full + 1} bytes, manifest says {full}"):
        verified.verify_file(store, step.name, DATA, manifest)
    with open(step / DATA, "ab") as f:  # now enough to fill the short last block
        f.write(b"x" * MiB)
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: longer than the {full} bytes the manifest says"):
        verified.verify_file(store, step.name, DATA, manifest)
    os.truncate(step / DATA, full)
    os.truncate(step / DATA, full - MiB)
    with pytest.raises(InvalidCheckpoint, match=f"{DATA}: {full - MiB} bytes, manifest says {full}"):
        verified.verify_file(store, step.name, DATA, manifest)
    with pytest.raises(CheckpointException, match=f"{DATA}: {full - MiB} bytes, manifest says {full}"):
        load_step(step, {"extra": {"h": {"w": torch.zeros(9 * MiB // 4)}}})


def test_a_small_file_checked_in_one_read_cut_short_or_grown_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(verified, "WHOLE_READ_MAX", 64 << 10)
    step = save(tmp_path / "root", {"w": torch.randn(10)})
    store = Store(str(tmp_path / "root"))
    manifest = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    full = (step / METADATA_NAME).stat().st_size
    assert full <= verified.WHOLE_READ_MAX
    assert verified.verify_file(store, step.name, METADATA_NAME, manifest) == (step / METADATA_NAME).read_bytes()
    with open(step / METADATA_NAME, "ab") as f:
        f.write(b"x")
    with pytest.raises(InvalidCheckpoint, match=f"{METADATA_NAME}: {full + 1} bytes, manifest says {full}"):
        verified.verify_file(store, step.name, METADATA_NAME, manifest)
    with open(step / METADATA_NAME, "ab") as f:
        f.write(b"x" * (64 << 10))
    with pytest.raises(InvalidCheckpoint, match=f"{METADATA_NAME}: longer than the {full} bytes the manifest says"):
        verified.verify_file(store, step.name, METADATA_NAME, manifest)
    os.truncate(step / METADATA_NAME, full - 1)
    with pytest.raises(InvalidCheckpoint, match=f"{METADATA_NAME}: {full - 1} bytes, manifest says {full}"):
        verified.verify_file(store, step.name, METADATA_NAME, manifest)


def test_a_partial_read_verifies_every_block_it_touched_and_nothing_past_the_manifests_size():
    """VerifyingReader on its own, over 3.5 blocks: peeks, mid-block skips and the short last
    block are all checked; a skipped block is not read; bytes past the recorded size fail."""
    from ckpt.format.checksum import Hasher

    B = 1 << 20
    good = os.urandom(3 * B + B // 2)
    hasher = Hasher(B)
    hasher.update(good)
    entry = hasher.entry(0)

    def run(data: bytes, *steps) -> None:
        src = verified.VerifyingReader(io.BytesIO(data), "f", entry, partial=True)  # fmt: skip
        for op, n in steps:
            getattr(src, op)(n)
        src.finish()

    def flipped(at: int) -> bytes:
        bad = bytearray(good)
        bad[at] ^= 1
        return bytes(bad)

    run(flipped(B + 5), ("read", 10), ("skip", 2 * B))  # block 1 is never read: fine
    run(good, ("skip", 3 * B), ("read", B // 2))  # a read ending at the very end
    for data, steps, where in [
        (flipped(B + 5), [("skip", B - 10), ("peek", 100)], "1048576-2097151"),  # a peek into block 1
        (flipped(B + 5), [("skip", B + 1), ("read", 2)], "1048576-2097151"),  # read before the flip, same block
        (flipped(3 * B + 5), [("skip", 3 * B + 100), ("read", 10)], "3145728-3670015"),  # the short last block
    ]:
        with pytest.raises(InvalidCheckpoint, match=f"checksum mismatch in bytes {where}"):
            run(data, *steps)
    with pytest.raises(InvalidCheckpoint, match="longer than the 3670016 bytes"):
        run(good + b"x" * 100, ("skip", 3 * B), ("read", B // 2 + 50))
    with pytest.raises(InvalidCheckpoint, match="3145728 bytes, manifest says 3670016"):
        run(good[: B + B // 2], ("skip", 3 * B + 1), ("read", 10))


def test_a_manifest_whose_block_checksums_do_not_cover_the_file_is_refused(tmp_path):
    step = save(tmp_path / "root", {"w": torch.randn(3 << 20)})
    doc = json.loads((step / MANIFEST_NAME).read_bytes())
    doc["files"][DATA]["blocks"].pop()
    with pytest.raises(InvalidCheckpoint, match=f"unreadable manifest.*{DATA}: .* block checksums for"):
        Manifest.from_json(json.dumps(doc).encode())


# -- the parser ---------------------------------------------------------------------------------
def _blob(t: torch.Tensor, *, skip_data: bool = False) -> bytes:
    buf = io.BytesIO()
    if skip_data:
        with torch.serialization.skip_data():
            torch.save(t, buf)
    else:
        torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("skip_data", [False, True], ids=["torch.save", "skip_data"])
@pytest.mark.parametrize("name", [k for k, v in many_values().items() if isinstance(v, torch.Tensor) and k != "transposed"])
def test_parser_finds_the_storage_of_standard_blobs(name, skip_data):
    t = many_values()[name]
    blob = _blob(t, skip_data=skip_data)
    lay = tensor_blob.locate(blob)
    assert lay is not None
    assert (lay.dtype, lay.size) == (t.dtype, tuple(t.shape))
    assert lay.data_start == record_offset(blob, "/data/0")
    assert lay.storage_bytes == t.untyped_storage().nbytes()
    assert lay.descriptor_ok(blob[lay.data_end :])
    if not skip_data:
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        assert blob[lay.tensor_start : lay.tensor_start + len(raw)] == raw


def _quantized_blob() -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated
        return _blob(torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8))


@pytest.mark.parametrize(
    "blob",
    [
        _blob(torch.randn(4, 3).t()),  # strided
        _blob(torch.randn(3, dtype=torch.complex64).conj()),  # a conj bit rides in the pickle
        _blob(torch.nn.Parameter(torch.ones(2))),  # another rebuild function
        _quantized_blob(),
        _blob({"a": torch.ones(2)}),  # not a tensor
        _blob(torch.ones(3)).replace(b"little", b"bigend"),  # byte order
        _blob(torch.ones(3))[:200],  # cut before the storage
        pickle.dumps(torch.ones(3)),
        b"",
    ],
    ids=["strided", "conj", "parameter", "quantized", "dict", "byteorder", "truncated", "bare_pickle", "empty"],
)
def test_parser_declines_anything_else(blob):
    assert tensor_blob.locate(blob) is None


def test_parser_reads_zip64_headers_of_storages_over_4_gib(tmp_path):
    t = torch.empty(2**32 + 64, dtype=torch.uint8)  # address space only: never touched, no memory used
    path = tmp_path / "big.pt"
    with open(path, "wb") as f, torch.serialization.skip_data():
        torch.save(t, f)  # a sparse file
    with open(path, "rb") as f:
        head = f.read(4096)
        lay = tensor_blob.locate(head)
        assert lay is not None and lay.storage_bytes == 2**32 + 64 and lay.descriptor == 24
        f.seek(lay.data_end)
        assert lay.descriptor_ok(f.read(64))
