"""`.metadata` is a pickle, and anyone who can write an unsigned root can replace it and
rewrite the manifest's size and xxh3 to match. Read back, it must build DCP's metadata and
nothing else (issue 37).

Every opcode that names, makes or calls something is fed hand-written pickles with dotted and
undotted names, each of which would create a marker file if it ran; then a real checkpoint
whose `.metadata` runs a command before yielding the real metadata goes through a restore and
every CLI verb that reads `.metadata`. What must hold: InvalidCheckpoint (the CLI's one-line
error; a restore falls back to the step before), and the marker file does not exist.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import json
import logging
import pickle
import re
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

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

import ckpt
from ckpt.errors import InvalidCheckpoint, RestoreFailed
from ckpt.format import bytes_item
from ckpt.format.checksum import Hasher, block_size
from ckpt.format.dcp_metadata import load_metadata
from tests.support.cli import start as start_ckpt

DCP = "torch.distributed.checkpoint.metadata"
CLI = [sys.executable, "-m", "ckpt.cli.main"]


# -- hand-written pickles ------------------------------------------------------------------------
def const(value: str | bytes) -> bytes:
    """BINUNICODE or BINBYTES of `value`."""
    raw = value if isinstance(value, bytes) else value.encode()
    return (pickle.BINBYTES if isinstance(value, bytes) else pickle.BINUNICODE) + struct.pack("<I", len(raw)) + raw


def stack_global(module: str, name: str) -> bytes:
    return const(module) + const(name) + pickle.STACK_GLOBAL


def text_global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def protocol4(body: bytes) -> bytes:
    """Protocol 4, under which the C unpickler resolves a dotted name attribute by attribute."""
    return pickle.PROTO + b"\x04" + body + pickle.STOP


def touch(marker: Path) -> bytes:
    """A stock pickle that creates `marker` when loaded without an allowlist."""
    return protocol4(stack_global("os", "system") + const(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE)


def attacks(marker: Path) -> dict[str, tuple[str, str, str | bytes]]:
    """(module, name, argument): each call creates `marker`."""
    return {
        "dotted os.system": (DCP, "os.system", f"touch {marker}"),
        "dotted through torch": (DCP, "torch.os.system", f"touch {marker}"),
        "dotted pickle.loads": (DCP, "torch.serialization.pickle.loads", touch(marker)),
        "os.system": ("os", "system", f"touch {marker}"),
        "builtins.eval": ("builtins", "eval", f"open({str(marker)!r}, 'w').close()"),
    }


# How each opcode gets to the named callable and calls it with the argument.
EXT_CODES = {"EXT1": (pickle.EXT1, "<B", 0xF1), "EXT2": (pickle.EXT2, "<H", 0xF1F1), "EXT4": (pickle.EXT4, "<i", 0xF1F1F1)}
FORMS: dict[str, Callable[[str, str, str | bytes], bytes]] = {
    "GLOBAL": lambda m, n, a: text_global(m, n) + const(a) + pickle.TUPLE1 + pickle.REDUCE,
    "STACK_GLOBAL": lambda m, n, a: stack_global(m, n) + const(a) + pickle.TUPLE1 + pickle.REDUCE,
    "INST": lambda m, n, a: pickle.MARK + const(a) + pickle.INST + f"{m}\n{n}\n".encode(),
    "OBJ": lambda m, n, a: pickle.MARK + stack_global(m, n) + const(a) + pickle.OBJ,
    "NEWOBJ": lambda m, n, a: stack_global(m, n) + const(a) + pickle.TUPLE1 + pickle.NEWOBJ,
    "NEWOBJ_EX": lambda m, n, a: stack_global(m, n) + const(a) + pickle.TUPLE1 + pickle.EMPTY_DICT + pickle.NEWOBJ_EX,
    # An instance's own __setstate__, set by one BUILD, is what the C unpickler's next BUILD calls.
    "BUILD": lambda m, n, a: (
        stack_global(DCP, "Metadata") + pickle.EMPTY_TUPLE + pickle.NEWOBJ
        + pickle.EMPTY_DICT + const("__setstate__") + stack_global(m, n) + pickle.SETITEM + pickle.BUILD
        + const(a) + pickle.BUILD
    ),  # fmt: skip
    **{
        ext: lambda m, n, a, ext=ext: EXT_CODES[ext][0] + struct.pack(EXT_CODES[ext][1], EXT_CODES[ext][2]) + const(a) + pickle.TUPLE1 + pickle.REDUCE
        for ext in EXT_CODES
    },
}
ATTACKS = list(attacks(Path("/x")))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "code from a pickle ran"


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Callable[[str, str, int], None]:
    """Registers an extension code, and loads it once with the stock unpickler as any code in
    the process might: copyreg's cache then answers for it, whatever the name's allowlist says."""
    added: list[tuple[str, str, int]] = []

    def register(module: str, name: str, code: int) -> None:
        copyreg.add_extension(module, name, code)
        added.append((module, name, code))
        ext, fmt, _ = next(e for e in EXT_CODES.values() if e[2] == code)
        pickle.loads(protocol4(ext + struct.pack(fmt, code)))  # the function, not called

    yield register
    for args in added:
        copyreg.remove_extension(*args)


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("form", list(FORMS))
def test_no_opcode_resolves_or_calls_anything_outside_dcp_metadata(form, attack, marker, registered):
    module, name, arg = attacks(marker)[attack]
    if form in EXT_CODES:
        registered(module, name, EXT_CODES[form][2])
    blob = protocol4(FORMS[form](module, name, arg))
    # Each name is refused where it is named (an extension code stands for a name); INST, which
    # names and calls at once, is refused outright.
    refused = f"extension code {EXT_CODES[form][2]}" if form in EXT_CODES else "opcode INST" if form == "INST" else f"{module}.{name}"
    with pytest.raises(InvalidCheckpoint, match=re.escape(refused)):
        load_metadata(blob)
    # The unpickler of plain values (DCP's bytes items) refuses each as well.
    with pytest.raises(pickle.UnpicklingError):
        bytes_item._PlainUnpickler(io.BytesIO(blob)).load()


@pytest.mark.parametrize("persistent", [pickle.PERSID + b"0\n", const("0") + pickle.BINPERSID], ids=["PERSID", "BINPERSID"])
def test_a_persistent_id_is_refused(persistent):
    with pytest.raises(InvalidCheckpoint, match="persistent id"):
        load_metadata(protocol4(persistent))


@pytest.mark.parametrize(
    "module, name",
    [
        (DCP, "os"),  # the modules and functions DCP's metadata module imports
        (DCP, "torch"),
        (DCP, "field"),
        (DCP, "Enum"),
        (DCP, "pickle"),
        (DCP, "Metadata.__init__"),
        (DCP, "__builtins__"),
        ("torch", "load"),
        ("torch", "Tensor"),
        ("torch", "float32.__class__"),
        ("torch.serialization", "pickle"),
        ("torch.distributed.checkpoint.filesystem", "os"),
        ("collections", "OrderedDict"),
    ],
)
def test_module_attributes_that_are_not_dcp_metadata_are_refused(module, name):
    for global_ in (text_global(module, name), stack_global(module, name)):
        with pytest.raises(InvalidCheckpoint, match=re.escape(f"refers to {module}.{name}")):
            load_metadata(protocol4(global_))


def test_reduce_makes_only_what_dcp_pickles_by_reduce():
    # Metadata is made by NEWOBJ and BUILD, never called: called, it takes anything as its fields.
    with pytest.raises(InvalidCheckpoint, match="Metadata"):
        load_metadata(protocol4(stack_global(DCP, "Metadata") + const("x") + pickle.TUPLE1 + pickle.REDUCE))
    # DCP's layout lookup names a layout, nothing else.
    with pytest.raises(InvalidCheckpoint, match="does not parse"):
        load_metadata(protocol4(stack_global("torch.serialization", "_get_layout") + const("torch.float32") + pickle.TUPLE1 + pickle.REDUCE))


def test_build_sets_only_the_fields_of_a_dcp_metadata_instance():
    try:
        # On the class itself (slot state), the C unpickler sets a class attribute for the whole process.
        with pytest.raises(InvalidCheckpoint, match="Metadata"):
            load_metadata(protocol4(stack_global(DCP, "Metadata") + pickle.NONE + pickle.EMPTY_DICT + const("tampered") + pickle.NEWTRUE + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD))
        assert not hasattr(Metadata, "tampered")
    finally:
        if hasattr(Metadata, "tampered"):
            delattr(Metadata, "tampered")
    # On an instance: only its fields.
    index = stack_global(DCP, "MetadataIndex") + pickle.EMPTY_TUPLE + pickle.NEWOBJ
    with pytest.raises(InvalidCheckpoint, match="__setstate__"):
        load_metadata(protocol4(index + pickle.EMPTY_DICT + const("__setstate__") + pickle.NONE + pickle.SETITEM + pickle.BUILD))
    with pytest.raises(InvalidCheckpoint, match="MetadataIndex"):
        load_metadata(protocol4(index + pickle.NONE + pickle.EMPTY_DICT + const("fqn") + const("a") + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD))


def test_the_checkpoint_id_dcps_file_writer_records_as_a_path_reads_as_its_string(tmp_path):
    """Plain DCP (torchtitan's checkpoints) records its writer's path, a PosixPath, in
    `.metadata`: it reads back as the path's string, no path object is made."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    md = load_metadata((tmp_path / ".metadata").read_bytes())
    assert md.storage_meta.checkpoint_id == str(tmp_path) and "w" in md.state_dict_metadata
    path = stack_global("pathlib", "PosixPath")
    # Strings only, a path's length in all: memo references to one long string (or to an
    # earlier path), joined level after level, would make gigabytes of a 2 KB pickle.
    long = const("a" * 4000) + pickle.MEMOIZE
    bomb = long + path + pickle.MARK + pickle.BINGET + b"\x00" + pickle.BINGET + b"\x00" + pickle.TUPLE + pickle.REDUCE
    for body in (
        path + pickle.BININT1 + bytes([1]) + pickle.TUPLE1 + pickle.REDUCE,
        path + stack_global(DCP, "Metadata") + pickle.TUPLE1 + pickle.REDUCE,
        path + pickle.MARK + const("ab") * 2100 + pickle.TUPLE + pickle.REDUCE,
        bomb,
    ):
        with pytest.raises(InvalidCheckpoint, match="holds a PosixPath that is not a path"):
            load_metadata(protocol4(body))
    # Not an object of any class: NEWOBJ and BUILD on it are refused.
    with pytest.raises(InvalidCheckpoint, match="NEWOBJ"):
        load_metadata(protocol4(path + pickle.EMPTY_TUPLE + pickle.NEWOBJ))


def test_a_plain_pickle_of_plain_values_loads_and_any_other_is_refused_unrun(tmp_path):
    assert bytes_item.load_plain_pickle(pickle.dumps({"a": [1, 2.5, "x", None, (True,)]}), "it") == {"a": [1, 2.5, "x", None, (True,)]}
    marker = tmp_path / "ran"
    for blob in (pickle.dumps(Path("/x")), protocol4(stack_global("os", "system") + const(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE), b"not a pickle"):
        with pytest.raises(ValueError, match="the loader's state is not plain values"):
            bytes_item.load_plain_pickle(blob, "the loader's state")
    with pytest.raises(ValueError, match="not a pickle"):
        bytes_item.load_plain_pickle("text", "it")  # type: ignore[arg-type]
    assert not marker.exists()


def test_the_top_must_be_dcp_metadata():
    with pytest.raises(InvalidCheckpoint, match="holds a StorageMeta, not DCP metadata"):
        load_metadata(pickle.dumps(StorageMeta()))
    with pytest.raises(InvalidCheckpoint, match="holds a Size, not DCP metadata"):
        load_metadata(pickle.dumps(torch.Size([1])))
    # A class left as a value, where ckpt's reader sets an attribute on whatever is there.
    with pytest.raises(InvalidCheckpoint, match="storage_meta"):
        load_metadata(pickle.dumps(Metadata({}, storage_meta=StorageMeta)))  # type: ignore[arg-type]


def every_kind_of_metadata() -> Metadata:
    """DCP metadata with every dtype, layout and memory format, sharded (DTensor) and whole
    tensors, bytes items, and every optional field set."""
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    formats = [torch.contiguous_format, torch.channels_last, torch.preserve_format]
    layouts = sorted({v for v in vars(torch).values() if isinstance(v, torch.layout)}, key=str)
    state: dict = {"optim.param_groups.0.lr": BytesStorageMetadata()}
    storage: dict = {MetadataIndex("optim.param_groups.0.lr"): _StorageInfo("__0_0.distcp", 0, 10)}
    for i, dtype in enumerate(dtypes):
        fqn = f"model.w{i}"
        props = TensorProperties(dtype, layouts[i % len(layouts)], bool(i % 2), formats[i % 3], bool(i % 3))
        chunks = [ChunkStorageMetadata(torch.Size([r * 2, 0]), torch.Size([2, 3])) for r in range(1 + i % 3)]
        state[fqn] = TensorStorageMetadata(props, torch.Size([2 * len(chunks), 3]), chunks)
        for r, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", 128 * i, 128, [] if i == 1 else None)
    planner = {k: tuple(k.split(".")) for k in state} | {"x": ("extra", 0, "x")}
    return Metadata(state, planner, storage, StorageMeta("id", "save", "load", ["m"]), "2.1")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_dcp_metadata_of_every_kind_loads_as_it_was_pickled(protocol):
    md = every_kind_of_metadata()
    got = load_metadata(pickle.dumps(md, protocol=protocol))
    assert got == md
    assert [p.properties.memory_format for p in got.state_dict_metadata.values() if isinstance(p, TensorStorageMetadata)][:3] == [
        torch.contiguous_format, torch.channels_last, torch.preserve_format
    ]  # fmt: skip
    # A piece stored transformed (a DCP extension's compression): not read, its decoded size
    # bounded by nothing the metadata says.
    some = next(i for i in md.storage_data if i.fqn == "model.w1")
    md.storage_data[some] = _StorageInfo(md.storage_data[some].relative_path, 128, 128, ["stream.zstd"])
    with pytest.raises(InvalidCheckpoint, match="stored transformed"):
        load_metadata(pickle.dumps(md, protocol=protocol))


# -- a real checkpoint whose `.metadata` runs a command -----------------------------------------
class Notes:
    """Plain values of several kinds, saved as DCP bytes items."""

    def __init__(self) -> None:
        self.values = {"blob": b"\x00\x01", "n": 3, "f": 1.5, "s": "text", "l": [1, (2, 3)], "d": {"a": None}}

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def job(root: Path, steps: int, **kw) -> ckpt.Checkpointer:
    """One process training and saving every step; returns its Checkpointer once closed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    model.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    model.register_buffer("ema", torch.zeros(2, 3, 4, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with ckpt.Checkpointer(
        str(root), model=model, optimizer=opt, scheduler=sched, extra={"notes": Notes()},
        interval=ckpt.Every(steps=1), keep=ckpt.Keep(last=10), **kw,
    ) as cp:  # fmt: skip
        for _ in range(cp.step, steps):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            cp.step_done()
    return cp


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


def plant_metadata(root: Path, step: int, blob: bytes) -> None:
    """`blob` as the step's `.metadata`, the manifest's size and checksum of it rewritten to
    match: what anyone who can write an unsigned root can do."""
    (root / step_dir(step) / ".metadata").write_bytes(blob)
    doc = json.loads((root / step_dir(step) / "manifest.json").read_text())
    hasher = Hasher(block_size(len(blob)))
    hasher.update(blob)
    doc["files"][".metadata"].update(dataclasses.asdict(hasher.entry(doc["files"][".metadata"]["rank"])))
    (root / step_dir(step) / "manifest.json").write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root of two committed steps, saved once for this module; tests copy it."""
    root = tmp_path_factory.mktemp("saved") / "root"
    assert job(root, 2).step == 2
    return root


@pytest.fixture
def planted(saved: Path, tmp_path: Path, marker: Path) -> Path:
    """A copy of `saved` whose step 2 `.metadata` runs `touch MARKER` (a dotted name under DCP's
    metadata module, protocol 4 STACK_GLOBAL), then yields the real metadata; the manifest's size
    and checksum of it rewritten to match."""
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    path = root / step_dir(2) / ".metadata"
    real = path.read_bytes()
    assert real[:2] == pickle.PROTO + b"\x04"
    run = stack_global(DCP, "os.system") + const(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE + pickle.POP
    evil = real[:2] + run + real[2:]
    plant_metadata(root, 2, evil)
    # The payload is live: the stock unpickler runs it and yields the real metadata.
    assert pickle.loads(evil) == pickle.loads(real) and marker.exists()
    marker.unlink()
    return root


def test_every_metadata_a_checkpointer_wrote_loads_as_the_stock_unpickler_loads_it(saved):
    for step in (1, 2):
        blob = (saved / step_dir(step) / ".metadata").read_bytes()
        assert load_metadata(blob) == pickle.loads(blob)


def test_restore_passes_over_a_metadata_that_runs_code_and_resumes_the_step_before(planted, marker, caplog):
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert job(planted, 1, save_on_exit=False).restored_step == 1
    assert not marker.exists()
    assert f"could not restore {step_dir(2)}" in caplog.text and f"refers to {DCP}.os.system" in caplog.text
    # Asked for by its step, it fails and says why.
    with pytest.raises(RestoreFailed, match=rf"{step_dir(2)} could not be restored \(.*refers to {DCP}\.os\.system"):
        job(planted, 2, restore=2, save_on_exit=False)


def test_no_cli_verb_that_reads_metadata_runs_its_code(planted, saved, marker, tmp_path):
    out = tmp_path / "export.pt"
    calls = {
        "show": (["show", str(planted)], 1),
        "verify": (["verify", str(planted), "--deep"], 1),
        "export": (["export", str(planted), "--format", "torch", "--out", str(out)], 1),
        "diff": (["diff", str(planted), str(saved)], 2),
        "load-test": (["load-test", str(planted), "--world-size", "2"], 1),
    }
    runs = {verb: start_ckpt(*args) for verb, (args, _) in calls.items()}
    done = {verb: (r.stdout, r.stderr, r.returncode) for verb, r in ((verb, run.result()) for verb, run in runs.items())}
    assert not marker.exists()
    for verb, (stdout, stderr, rc) in done.items():
        assert rc == calls[verb][1], (verb, rc, stdout, stderr)
        assert "Traceback" not in stderr, (verb, stderr)
        said = stdout if verb == "verify" else stderr
        assert f"refers to {DCP}.os.system" in said, (verb, stdout, stderr)
    assert f"{step_dir(1)}  ok" in done["verify"][0] and f"{step_dir(2)}  CORRUPT" in done["verify"][0]
    assert not out.exists()


@pytest.mark.parametrize("opcode", [pickle.REDUCE, pickle.NEWOBJ, pickle.BUILD, pickle.OBJ], ids=["REDUCE", "NEWOBJ", "BUILD", "OBJ"])
def test_the_plain_value_unpickler_calls_and_builds_nothing_without_a_global(opcode):
    """With every global refused, what these opcodes would call or set is a plain value."""
    callee = (pickle.MARK if opcode == pickle.OBJ else b"") + const("touch x")
    state = pickle.EMPTY_DICT + const("__setstate__") + const("x") + pickle.SETITEM
    with pytest.raises((TypeError, AttributeError)):
        bytes_item._PlainUnpickler(io.BytesIO(protocol4(callee + state + opcode))).load()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_plain_values_load_only_through_the_refusing_unpickler_or_torchs_allowlist(marker):
    """A DCP bytes item is a torch.save zip: one whose data.pkl runs code is refused by both."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", touch(marker))
        z.writestr("archive/version", "3\n")
    with pytest.raises(pickle.UnpicklingError):
        bytes_item.load_value(buf.getvalue())


# -- metadata of the right classes, with the wrong values in them --------------------------------
def _first_tensor(md: Metadata) -> tuple[str, TensorStorageMetadata]:
    return next((k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata) and v.size.numel() > 1)


def _set(obj: object, field: str, value: object) -> None:
    object.__setattr__(obj, field, value)  # frozen dataclasses too: what BUILD can do


def _first_info(md: Metadata) -> _StorageInfo:
    return next(iter(md.storage_data.values()))


# Each changes one field of a real `.metadata` as BUILD may (the unpickler allows the classes,
# not the values): every verb must refuse it with one line, and a restore fall back.
TAMPERED: dict[str, Callable[[Metadata], None]] = {
    "dtype_a_string": lambda md: _set(_first_tensor(md)[1].properties, "dtype", "float32"),
    "size_a_string": lambda md: _set(_first_tensor(md)[1], "size", "abcd"),
    "size_negative": lambda md: _set(_first_tensor(md)[1], "size", torch.Size([-7])),
    "size_of_four_terabytes": lambda md: [_set(t, "size", torch.Size([1 << 40])) or _set(t, "chunks", [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))]) for t in [_first_tensor(md)[1]]],
    "chunks_none": lambda md: _set(_first_tensor(md)[1], "chunks", None),
    "file_outside_the_step": lambda md: _set(_first_info(md), "relative_path", "../../../etc/passwd"),
    "file_absolute": lambda md: _set(_first_info(md), "relative_path", "/etc/passwd"),
    "key_not_a_string": lambda md: md.state_dict_metadata.__setitem__((1, 2), BytesStorageMetadata()),
    "storage_data_a_list": lambda md: _set(md, "storage_data", [1, 2]),
}


@pytest.fixture(params=list(TAMPERED))
def tampered(request: pytest.FixtureRequest, saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    path = root / step_dir(2) / ".metadata"
    md = pickle.loads(path.read_bytes())  # the test's own file, as a writer of the root would
    TAMPERED[request.param](md)
    plant_metadata(root, 2, pickle.dumps(md))
    return root


def test_metadata_with_values_dcp_never_writes_is_refused_by_every_verb_and_restore_falls_back(tampered, tmp_path, capsys, caplog):
    from ckpt.cli.main import main

    for args in (["verify", "--deep"], ["show"], ["load-test", "--world-size", "2"], ["export", "--format", "torch", "--out", str(tmp_path / "x.pt")]):
        assert main([args[0], str(tampered), *args[1:]]) == 1, args  # no traceback: an exception would escape
        said = capsys.readouterr()
        assert "is not DCP metadata as DCP writes it" in said.out + said.err, (args, said)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert job(tampered, 2, save_on_exit=False).restored_step == 1
    assert f"could not restore {step_dir(2)}" in caplog.text


def test_items_placed_over_each_other_are_refused_not_read_whole(saved, tmp_path, caplog):
    """A `.metadata` whose two items of one file overlap (which DCP never writes): the reader
    refused to stream it and read the whole data file into memory instead (a way to make every
    rank hold gigabytes); now the step is refused and the restore falls back. (Found by an
    outside review.)"""
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    md = pickle.loads((root / step_dir(2) / ".metadata").read_bytes())
    a, b = sorted((i for i in md.storage_data.values() if i.length > 16), key=lambda i: i.offset)[:2]
    b.offset = a.offset + 8  # into the middle of the item before it
    plant_metadata(root, 2, pickle.dumps(md))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert job(root, 2, save_on_exit=False).restored_step == 1
    assert f"could not restore {step_dir(2)}" in caplog.text and "overlap" in caplog.text, caplog.text
