"""What the S3 tests share: transfer settings small enough that a few MiB make several parts,
random payloads, what the server holds (multipart uploads under way, ETags), reading a stream
in odd pieces, and a Store that reaches the server through the fault-injecting proxy."""

from __future__ import annotations

import dataclasses
import itertools
import os

import boto3

from ckpt.storage.store import MiB, Store, Transfer
from tests.support.s3proxy import FaultyProxy

PART = 5 * MiB  # S3's smallest part, so that a few MiB make several parts


SMALL = Transfer(part_size=PART, concurrency=3, read_size=2 * MiB, readahead=3, backoff_s=0.01)


SECRET = "testing-secret"  # the secret of conftest's s3_options


def bucket_of(root: str) -> str:
    return root.removeprefix("s3://").split("/", 1)[0]


def payload(n: int) -> bytes:
    return os.urandom(n)


def uploads_in_progress(endpoint: str, bucket: str) -> list:
    return (
        boto3.client("s3", endpoint_url=endpoint)
        .list_multipart_uploads(Bucket=bucket)
        .get("Uploads", [])
    )


def etag(endpoint: str, bucket: str, key: str) -> str:
    return (
        boto3.client("s3", endpoint_url=endpoint)
        .head_object(Bucket=bucket, Key=key)["ETag"]
        .strip('"')
    )


def read_in_odd_pieces(f, n: int) -> bytes:
    out = bytearray()
    sizes = itertools.cycle([1, 7, 3 * MiB + 5, 100_000])
    while len(out) < n:
        chunk = f.read(next(sizes))
        assert chunk, "early end of stream"
        out += chunk
    assert f.read(10) == b""
    return bytes(out)


def through(proxy: FaultyProxy, root: str, options: dict, **transfer: object) -> Store:
    return Store(
        root,
        {**options, "endpoint_url": proxy.url},
        transfer=dataclasses.replace(SMALL, **transfer),
    )
