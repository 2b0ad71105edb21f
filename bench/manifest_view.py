"""What a restore's manifest costs at 10,000 ranks (issue 40): rank 0 parses it, and tells each
rank its part (`ckpt.restore.view`): the time of each, and the bytes a rank receives, against
what every rank received and parsed before (the whole manifest).

A synthetic manifest of W ranks, each with one data file of 98 MB (70B on 10,000 GPUs) checked
in 2 MiB blocks (xxh3) and its index, and `.metadata` and `.index`: the sizes ckpt writes.

    .venv/bin/python bench/manifest_view.py                 # 10,000 ranks: bench/results/manifest-view.json
    .venv/bin/python bench/manifest_view.py --ranks 16000
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from pathlib import Path

from ckpt.format.manifest import FileEntry, Manifest
from ckpt.restore.view import parts

REPO = Path(__file__).resolve().parents[1]


def _manifest(world: int, per_rank: int, block: int) -> Manifest:
    rng = random.Random(0)
    blocks = -(-per_rank // block)
    files = {}
    for r in range(world):
        files[f"__{r}_0.distcp"] = FileEntry(per_rank, f"xxh3_64-blocks:{rng.getrandbits(64):016x}", r, block, tuple(f"xxh3_64:{rng.getrandbits(64):016x}" for _ in range(blocks)))
        files[f"__{r}_0.index"] = FileEntry(230_000, f"xxh3_64:{rng.getrandbits(64):016x}", r)
    files[".metadata"] = FileEntry(3_000_000_000, f"xxh3_64:{rng.getrandbits(64):016x}", -1)
    files[".index"] = FileEntry(330_000, f"xxh3_64:{rng.getrandbits(64):016x}", -1)
    return Manifest(step=1, world_size=world, created=1.0, files=files)


def _best(fn, n: int = 3) -> tuple[float, object]:  # noqa: ANN001
    best, out = float("inf"), None
    for _ in range(n):
        began = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - began)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "manifest-view.json"))
    args = ap.parse_args()
    doc = _manifest(args.ranks, 98_000_000, 2 << 20).to_json()
    parse_s, manifest = _best(lambda: Manifest.from_json(doc))
    # The parts, each pickled and framed for the scatter (`view.parts`; `ckpt.prepare` makes them
    # while the job sets up, the restore's rank 0 otherwise).
    parts_s, (common, framed) = _best(lambda: parts(manifest, args.ranks))  # type: ignore[misc]
    common_bytes = len(pickle.dumps(common))
    result = {
        "ranks": args.ranks,
        "manifest_bytes": len(doc),
        "rank0_parse_s": parse_s,
        "rank0_tell_s": parts_s,  # the parts, each pickled and framed for the scatter
        "a_rank_receives_bytes": common_bytes + framed[0].numel(),  # every rank's frame as long as the longest
        "before_a_rank_received_bytes": len(doc),
        "before_a_rank_parsed_s": parse_s,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.ranks} ranks: manifest {len(doc) / 1e6:.1f} MB, rank 0 parses it in {parse_s:.3f} s and tells the parts in "
        f"{parts_s:.3f} s; a rank receives {result['a_rank_receives_bytes']:,} bytes (before: {len(doc):,}, and parsed them)"
    )


if __name__ == "__main__":
    main()
