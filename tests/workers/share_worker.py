"""Runs on each of 2 gloo ranks (tests/restore/test_shared_items.py): `exchange`, the step of a
restore where the ranks send each other the small values they all load, over a table of cases
(who waits for what, who read what, who failed). Each rank serves one file's single item;
`read` stands for the store (it records what it was asked for, and may fail). Writes what each
rank loaded, read and called to <out>/rank<N>.json."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckpt.collectives import Group
from ckpt.format.manifest import FileEntry, Manifest
from ckpt.restore.shared_items import Sharing, exchange
from tests.support.launch import exit_without_teardown

REFS = [("__0_0.distcp", 0, 5), ("__1_0.distcp", 0, 5)]
STORE = {REFS[0]: b"zero!", REFS[1]: b"one!!"}
# Every rank holds the whole manifest here: `fetch` (what no rank sent) asks rank 0 for nothing.
MANIFEST = Manifest(step=1, world_size=2, created=0.0, files={f"__{r}_0.distcp": FileEntry(5, "xxh3_64:0000000000000000", r) for r in range(2)})

# case: rank -> (waits for item numbers, has read (captured), load ok, read fails, has metadata)
CASES = {
    "served": {0: ((), (0,), True, False, True), 1: ((0,), (), True, False, True)},
    "unread by its server": {0: ((), (), True, False, True), 1: ((0,), (), True, False, True)},
    "its server cannot read it": {0: ((), (), True, True, True), 1: ((0,), (), True, False, True)},
    "its server failed its load": {0: ((), (0,), False, False, True), 1: ((0,), (), True, False, True)},
    "its server holds no metadata": {0: ((), (), False, False, False), 1: ((0,), (), True, False, True)},
    "both wait": {0: ((1,), (0,), True, False, True), 1: ((0,), (1,), True, False, True)},
    "nobody waits": {0: ((), (0,), True, False, True), 1: ((), (1,), True, False, True)},
    "a waiting rank failed its load": {0: ((), (0,), True, False, True), 1: ((0,), (), False, False, True)},
    "a rank that must read it itself cannot": {0: ((), (), True, True, True), 1: ((0,), (), True, True, True)},
}


class Recorder:
    """The planner's one call a shared value makes (`load_bytes`), recorded."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.loaded[req.dest_index.fqn] = value.read().decode()


def item(i: int) -> ReadItem:
    index = MetadataIndex(f"value{i}")
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls: list[str] = []
    real = dist.all_reduce

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append("all_reduce")
        return real(*args, **kwargs)

    dist.all_reduce = counted
    g = Group.new(60)
    seen = {}
    for name, case in CASES.items():
        waits, captured, ok, read_fails, has_metadata = case[rank]
        sharing = Sharing(rank, 2, list(REFS), {"__0_0.distcp": 0, "__1_0.distcp": 1}) if has_metadata else None
        if sharing is not None:
            sharing.pending = {i: [item(i)] for i in waits}
            sharing.captured = {i: STORE[REFS[i]] for i in captured}
        asked: list[list] = []

        def read(refs: list, asked: list = asked, read_fails: bool = read_fails) -> dict:
            asked.append([list(r) for r in refs])
            if read_fails:
                raise OSError("the store is down")
            return {r: STORE[r] for r in refs}

        planner = Recorder()
        calls.clear()
        try:
            exchange(g, sharing, planner, ok, read, MANIFEST)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        seen[name] = {"loaded": planner.loaded, "asked": asked, "error": error, "all_reduces": len(calls),
                      "received": sharing.received_bytes if sharing else 0}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    main()
