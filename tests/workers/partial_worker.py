"""Runs on each of 2 gloo ranks (tests/restore/test_partial.py): `partial_metadata`, the step of
a restore where each rank reads the indexes of the files it loads from and rank 0 sends
`.index`, on a real checkpoint of 2 ranks, as it is and with rank 1's store failing to read
the ranks' indexes (a store error, on that rank alone). Each rank loads one sharded tensor
whole, from both ranks' files. Writes what each rank got to <out>/rank<N>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckpt.collectives import Group
from ckpt.errors import StorageError
from ckpt.format.dcp_metadata import load_metadata
from ckpt.format.manifest import METADATA_NAME
from ckpt.restore.partial import partial_metadata
from ckpt.storage.catalog import find
from ckpt.storage.store import Store
from tests.support.launch import exit_without_teardown


class FailingIndex(Store):
    """The root, whose reads of this rank's index fail as a store that is down would."""

    def read_small(self, rel: str, at_most: int) -> bytes | None:
        if rel.endswith("_0.index"):
            raise StorageError(f"reading {self.display}/{rel}: injected: the store answered 503, five times")
        return super().read_small(rel, at_most)


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = Group.new(60)
    entry = find(Store(root), None)
    full = load_metadata((Path(root) / entry.dir / METADATA_NAME).read_bytes())
    fqn, meta = next((k, m) for k, m in full.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata) and len(m.chunks) > 1)
    state = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)}
    seen = {}
    for case, store in (("intact", Store(root)), ("rank 1's index unreadable", FailingIndex(root) if rank == 1 else Store(root))):
        try:
            parts = partial_metadata(g, store, entry.dir, entry.manifest, state)
            seen[case] = None if parts is None else sorted(parts.mine.state_dict_metadata)[:3]
        except Exception as e:
            seen[case] = f"raised {type(e).__name__}: {e}"
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    main()
