"""Would a tensorstore-backed writer beat ckpt's storage path? Side by side, one process.

    .venv/bin/python bench/tensorstore_engine.py [--sizes-mb 100,400] [--repeats 3]

Writes the same random bytes as one file, durably, through: a plain `open`/`write`/`fsync`
(the floor, local only); ckpt's `Store.open_write` (local: O_DIRECT-free buffered write and
fsync; S3: parallel multipart in 64 MiB parts, and with one part as large as the file, one
PUT); and a tensorstore kvstore (`file` and `s3` drivers), whose write of a value is one
PUT. S3 is a moto server this script starts on a free loopback port. Prints each path's best
time and its ratio to ckpt's, and writes bench/results/tensorstore-engine.json (replaced).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: ckpt and tests.support

from ckpt.storage.store import Store, Transfer  # noqa: E402
from tests.support.launch import free_port  # noqa: E402


@contextlib.contextmanager
def moto() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/moto-api/", timeout=1)
                break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def best(fn: Callable[[], None], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def measure(mb: int, work: Path, endpoint: str, bucket: str, repeats: int) -> list[dict]:
    """Every path's best time writing `mb` MB once."""
    import numpy as np
    import tensorstore as ts

    data = np.random.default_rng(0).integers(0, 255, mb << 20, dtype=np.uint8).tobytes()
    local, s3 = Store(work / "ckpt"), Store(f"s3://{bucket}/ckpt", {"endpoint_url": endpoint})
    s3_one = Store(f"s3://{bucket}/ckpt1", {"endpoint_url": endpoint}, Transfer(part_size=max(64 << 20, 2 * len(data))))
    ts_file = ts.KvStore.open({"driver": "file", "path": str(work / "ts") + "/"}).result()
    ts_s3 = ts.KvStore.open({"driver": "s3", "bucket": bucket, "endpoint": endpoint, "aws_region": "us-east-1", "path": "ts/"}).result()

    def write(store: Store) -> Callable[[], None]:
        def go() -> None:
            with store.open_write("f.bin") as f:
                f.write(data)
        return go

    def raw() -> None:
        with open(work / "raw.bin", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    paths = {
        ("local", "raw write+fsync"): raw,
        ("local", "ckpt"): write(local),
        ("local", "tensorstore file"): lambda: ts_file.write("f.bin", data).result(),
        ("s3", "ckpt (multipart)"): write(s3),
        ("s3", "ckpt (one PUT)"): write(s3_one),
        ("s3", "tensorstore s3 (one PUT)"): lambda: ts_s3.write("f.bin", data).result(),
    }
    return [{"mb": mb, "store": where, "path": name, "seconds": best(fn, repeats)} for (where, name), fn in paths.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="100,400")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    results: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="ckpt-ts-bench-"))
    try:
        with moto() as endpoint:
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            for mb in map(int, args.sizes_mb.split(",")):
                results += measure(mb, work, endpoint, bucket, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'MB':>5} {'store':6} {'path':26} {'best s':>8} {'vs ckpt':>8}")
    for r in results:
        ref = next(x["seconds"] for x in results if x["mb"] == r["mb"] and x["store"] == r["store"] and x["path"].startswith("ckpt"))
        print(f"{r['mb']:>5} {r['store']:6} {r['path']:26} {r['seconds']:8.3f} {r['seconds'] / ref:7.2f}x")
    out = Path(args.out or HERE / "results" / "tensorstore-engine.json")
    out.write_text(json.dumps({"results": results, "repeats": args.repeats}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
