"""A rank's part of `.metadata` (issue 40): what the index files hold (`ckpt.format.dcp_index`)
and when their union stands in for `.metadata` (`ckpt.restore.partial.uncovered`): every piece
this rank loads, whole, or else the whole `.metadata` is read. Real DCP metadata classes, from
a real save; the restores that use them are in test_shared_reads.py and tests/system."""

from __future__ import annotations

import json
import re

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckpt
from ckpt.format.dcp_index import SHARE_MAX, index_name, merged, shared_part, shared_refs
from ckpt.format.dcp_metadata import load_metadata
from ckpt.format.index_file import decode_index
from ckpt.format.manifest import SHARED_INDEX
from ckpt.restore.partial import first_reads, uncovered
from ckpt.storage.catalog import find
from ckpt.storage.store import Store
from tests.support.jobs import RANKS, WORKER, rank_logs
from tests.support.launch import WORKERS, run


def _tensor(size: tuple[int, ...], *chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> TensorStorageMetadata:
    props = TensorProperties(dtype=torch.float32)
    return TensorStorageMetadata(props, torch.Size(size), [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _md(entries: dict, lengths: dict[str, int] | None = None) -> Metadata:
    storage = {}
    for fqn, entry in entries.items():
        chunks = entry.chunks if isinstance(entry, TensorStorageMetadata) else [None]
        for i, chunk in enumerate(chunks):
            index = MetadataIndex(fqn, chunk.offsets if chunk is not None else None, i)
            storage[index] = _StorageInfo(f"__{i}_0.distcp", 0, (lengths or {}).get(fqn, 100))
    return Metadata(entries, storage_data=storage)


HALF = ((0, 0), (2, 4))
OTHER_HALF = ((2, 0), (2, 4))
WHOLE = ((0, 0), (4, 4))

# (what the index holds, what this rank loads) -> why not covered ("" : covered)
COVER_CASES = {
    "the whole tensor": ({"w": _tensor((4, 4), WHOLE)}, {"w": torch.zeros(4, 4)}, ""),
    "both halves": ({"w": _tensor((4, 4), HALF, OTHER_HALF)}, {"w": torch.zeros(4, 4)}, ""),
    "one half of it": ({"w": _tensor((4, 4), HALF)}, {"w": torch.zeros(4, 4)}, "w: a piece at (0, 0) is not whole in the index"),
    "a key it lacks": ({}, {"w": torch.zeros(4, 4)}, "w: not in the index"),
    "another size": ({"w": _tensor((4, 2), ((0, 0), (4, 2)))}, {"w": torch.zeros(4, 4)}, "w: another kind or size in the index"),
    "a tensor for a value": ({"n": _tensor((1,), ((0,), (1,)))}, {"n": 3}, "n: a tensor in the index"),
    "a value for a tensor": ({"w": BytesStorageMetadata()}, {"w": torch.zeros(4, 4)}, "w: another kind or size in the index"),
    "a value": ({"n": BytesStorageMetadata()}, {"n": 3}, ""),
    "a scalar": ({"step": _tensor((), ((), ()))}, {"step": torch.tensor(5.0)}, ""),
    "nested keys, flattened as DCP does": ({"optim.lr": BytesStorageMetadata()}, {"optim": {"lr": 0.1}}, ""),
}


def test_the_index_stands_in_for_metadata_only_where_it_holds_every_piece_this_rank_loads():
    for case, (entries, state, why) in COVER_CASES.items():
        assert uncovered(_md(entries), state) == why, case


def test_shared_items_are_the_short_values_held_once_and_not_a_ranks_own():
    md = _md(
        {
            "optim.state.w.step": _tensor((), ((), ())),  # a replicated scalar, saved once: shared
            "optim.param_groups": BytesStorageMetadata(),  # a pickled value: shared
            "rng.rank_3.torch": BytesStorageMetadata(),  # rank 3's own: not shared
            "extra.stream.rank_12": BytesStorageMetadata(),  # likewise
            "model.w": _tensor((4, 4), HALF, OTHER_HALF),  # sharded: not shared
            "model.big": _tensor((SHARE_MAX,), ((0,), (SHARE_MAX,))),  # held once but long: not shared
        },
        {"model.big": SHARE_MAX + 1},
    )
    part = shared_part(md)
    assert sorted(part.state_dict_metadata) == ["optim.param_groups", "optim.state.w.step"]
    assert len(shared_refs(md)) == len(shared_refs(part)) == 1  # both at offset 0 of __0_0.distcp, length 100: one item
    assert shared_refs(md) == shared_refs(part)
    assert merged(part, _md({"model.w": _tensor((4, 4), HALF)})).state_dict_metadata.keys() == {"optim.param_groups", "optim.state.w.step", "model.w"}
    assert index_name("__12_0.distcp") == "__12_0.index"


def test_a_job_of_ranks_writes_each_ranks_index_and_the_shared_one_and_a_restore_reads_them_first(tmp_path):
    root = tmp_path / "root"
    args = ("--mode", "fsdp2", "--root", str(root), "--steps", "4", "--every", "2")  # step 4: the layout saved again
    assert run(RANKS, WORKER, *args, log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    entry = find(Store(str(root)), None)
    manifest, step = entry.manifest, root / entry.dir
    assert {".metadata", SHARED_INDEX, "__0_0.distcp", "__0_0.index", "__1_0.distcp", "__1_0.index"} <= set(manifest.files)
    assert [manifest.files[f"__{r}_0.index"].rank for r in range(RANKS)] == list(range(RANKS)) and manifest.files[SHARED_INDEX].rank == -1
    full = load_metadata((step / ".metadata").read_bytes())
    shared = decode_index((step / SHARED_INDEX).read_bytes(), SHARED_INDEX)
    assert shared_refs(full) == shared_refs(shared) and shared.storage_data.items() <= full.storage_data.items()
    for r in range(RANKS):
        own = decode_index((step / f"__{r}_0.index").read_bytes(), f"__{r}_0.index")
        # every entry of .metadata about rank r's file, and nothing else
        mine = {i: info for i, info in full.storage_data.items() if info.relative_path == f"__{r}_0.distcp"}
        assert own.storage_data == mine
        for fqn, entry in own.state_dict_metadata.items():
            whole = full.state_dict_metadata[fqn]
            if isinstance(entry, TensorStorageMetadata):
                assert entry.size == whole.size and entry.properties == whole.properties
                assert all(c in whole.chunks for c in entry.chunks)
    assert manifest.indexed_for(RANKS) and manifest.indexed_for(RANKS + 1) and not manifest.indexed_for(1)
    assert first_reads(manifest, 0, RANKS) == [SHARED_INDEX, "__0_0.index", "__0_0.distcp"]
    assert first_reads(manifest, 1, RANKS) == ["__1_0.index", "__1_0.distcp"]
    assert first_reads(manifest, 0, RANKS + 1) == [SHARED_INDEX] and first_reads(manifest, 2, RANKS + 1) == []
    assert first_reads(manifest, 0, 1) == [".metadata"]


def test_one_process_writes_no_index_it_would_never_read(tmp_path):
    model = torch.nn.Linear(8, 4)
    with ckpt.Checkpointer(str(tmp_path), model=model, interval=None, handle_sigterm=False) as cp:
        cp.save(blocking=True)
    manifest = find(Store(str(tmp_path)), None).manifest
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp"]


def test_a_rank_that_cannot_read_its_index_sends_every_rank_to_metadata_and_none_is_left_waiting(tmp_path):
    """A store error on one rank alone (its index unreadable): every rank gets None from
    `partial_metadata` (all read `.metadata`), none raises, none hangs in a collective."""
    root = tmp_path / "root"
    args = ("--mode", "fsdp2", "--root", str(root), "--steps", "2", "--every", "2")
    assert run(RANKS, WORKER, *args, log_dir=tmp_path) == [0] * RANKS, rank_logs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert run(RANKS, WORKERS / "partial_worker.py", str(root), str(out), log_dir=out, timeout=120) == [0] * RANKS, rank_logs(out)
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert all(isinstance(s["intact"], list) and s["intact"] for s in seen), seen
    assert [s["rank 1's index unreadable"] for s in seen] == [None, None], seen


def _two_fsdp2_layers(out_features: int) -> str:
    """A worker's start: two linear layers, each and both fully sharded, and AdamW."""
    return f"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import ckpt
import ckpt.restore.shared_items as si
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, {out_features}))
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
"""


# out_features 1 on 3 ranks: ranks 1 and 2 hold equal empty shards of the last weight and bias,
# which DCP saves once (one copy of equal pieces): the other's index must still know those keys.
UNEVEN = _two_fsdp2_layers(1) + """
with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
    if cp.restored_step is None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        cp.save(blocking=True)
    m = cp.last_commit
    own = sum(e.size for e in m.files.values() if e.rank == dist.get_rank())
    # one write: another thread's line on stderr (the same file) never lands inside this one
    sys.stdout.write("READ " + json.dumps([cp.restored_step, cp.metrics.read._value.get(), own, m.files[".index"].size, sorted(m.files)]) + "\\n")
    sys.stdout.flush()
"""


def test_an_empty_shard_keeps_the_index_path_and_restores_bit_for_bit(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    root = tmp_path / "root"
    assert run(3, script, str(root), log_dir=tmp_path) == [0] * 3, rank_logs(tmp_path)
    assert run(3, script, str(root), log_dir=tmp_path) == [0] * 3, rank_logs(tmp_path)
    told = []
    for r in range(3):
        step, read, own, shared, names = _read_line(tmp_path, r)
        # no .metadata, and no other rank's index: a rank's own holds the key of its empty shard
        assert step == 0 and read == own + (shared if r == 0 else 0), (r, read, own, shared)
        told.append(names)
    # Of the manifest, rank 0 holds it whole; each other rank was told the files written for
    # all and its own alone (ckpt.restore.view), which is all it read.
    assert len(told[0]) == 8, told[0]
    assert told[1:] == [[".index", ".metadata", f"__{r}_0.distcp", f"__{r}_0.index"] for r in (1, 2)], told
    # On 2 ranks, rank 1 loads pieces of saving ranks 1 and 2: it asks rank 0 for their
    # entries (`fetch`), and for no other rank's.
    out = tmp_path / "two"
    out.mkdir()
    assert run(2, script, str(root), log_dir=out) == [0] * 2, rank_logs(out)
    step, read, own, shared, names = _read_line(out, 1)
    assert step == 0 and read > 0 and "__0_0.distcp" not in names and "__2_0.distcp" in names, names


def _read_line(logs, rank: int) -> list:
    return json.loads(re.findall(r"^READ (\[.*\])$", (logs / f"rank{rank}.log").read_text(), re.M)[-1])


def test_a_files_shared_values_are_served_by_a_rank_that_loads_rows_of_that_file():
    """`shared_items.server`: on any world size, the serving rank of saving rank r's file takes
    some of r's rows under FSDP's even split (so it reads that file anyway), for tensors of many
    rows a rank (with a few, the rounding of the split may put them elsewhere: the choice then
    costs a read, never a wrong value)."""
    from ckpt.restore.shared_items import server

    def rows(n: int, world: int, rank: int) -> range:
        per = -(-n // world)
        return range(min(rank * per, n), min((rank + 1) * per, n))

    for saved in range(1, 17):
        for world in range(1, 33):
            assert [server(r, saved, world) for r in range(saved)] == sorted(server(r, saved, world) for r in range(saved))
            for n in (max(saved, world) * 1000, max(saved, world) * 4096 + 3):
                for r in range(saved):
                    mine, theirs = rows(n, saved, r), rows(n, world, server(r, saved, world))
                    assert min(mine.stop, theirs.stop) > max(mine.start, theirs.start), (saved, world, n, r)


SERVER_FAILS = _two_fsdp2_layers(4) + """
if sys.argv[2] == "restore":
    # Each shared item's server sends none: what `_serve` sends of the items it had not read
    # already when it cannot read them (a store's error); here, of all of them.
    si._serve = lambda sharing, needed, read: {}
with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
    if cp.restored_step is None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        cp.save(blocking=True)
    local = [v.to_local() if hasattr(v, "to_local") else v for v in opt.state_dict()["state"][0].values()]
    sys.stdout.write("STATE " + json.dumps([cp.restored_step, [float(t.double().sum()) for t in local]]) + "\\n")
    sys.stdout.flush()
"""


def test_a_shared_item_its_server_could_not_read_is_read_by_the_ranks_that_wait_for_it(tmp_path):
    """The rank that serves a shared value (an optimizer `step` DCP saved in one rank's file)
    sends none of them: the ranks waiting for them read them themselves, though their part of
    the manifest did not list those files: they ask for their entries
    (`ckpt.restore.view.fetch`; outside review of issue 40: they failed with "not listed in
    the manifest" and the restore fell back to the step before)."""
    script = tmp_path / "server_fails.py"
    script.write_text(SERVER_FAILS)
    root = tmp_path / "root"
    saved = tmp_path / "saved"
    saved.mkdir()
    assert run(3, script, str(root), "save", log_dir=saved) == [0] * 3, rank_logs(saved)
    steps = [json.loads(re.findall(r"^STATE (\[.*\])$", (saved / f"rank{r}.log").read_text(), re.M)[-1])[1][0] for r in range(3)]
    for world in (3, 2, 4):
        logs = tmp_path / f"on{world}"
        logs.mkdir()
        assert run(world, script, str(root), "restore", log_dir=logs) == [0] * world, rank_logs(logs)
        for r in range(world):
            step, state = json.loads(re.findall(r"^STATE (\[.*\])$", (logs / f"rank{r}.log").read_text(), re.M)[-1])
            assert step == 0 and state[0] == steps[0], (world, r, step, state)  # the optimizer's step, as saved
