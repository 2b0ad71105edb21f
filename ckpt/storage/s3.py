"""A root on S3 (`S3Backend`): listings through s3fs like any fsspec root, and what S3 does
better through the root's own retried requests (`ckpt.storage.s3_client`): a commit is one PUT,
the lease's writes are conditional PUTs (If-None-Match, If-Match on the ETag), big files go
up in parallel multipart uploads (`ckpt.storage.s3_write`) and come back through ranged GETs
read ahead (`ckpt.storage.s3_read`), a step is deleted 1000 keys per request, and "no such
bucket" is told from "cannot reach the store".
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any, BinaryIO

from ckpt.storage.backend import Tagged
from ckpt.storage.fsspec_backend import FsspecBackend
from ckpt.storage.s3_client import RESERVED, RetriedFS, S3Client, file_system
from ckpt.storage.s3_read import Reader
from ckpt.storage.s3_write import S3Upload, upload
from ckpt.storage.transfer import Transfer


def _positive(config: dict[str, Any], key: str, unset: float) -> float:
    """`config[key]`, a number above 0 (`unset` where it is not set, None or 0)."""
    value = config.get(key)
    if value is None or (value == 0 and type(value) is not bool):
        return unset
    try:
        if type(value) is bool:
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0 < number < math.inf:
        raise ValueError(f"storage_options config_kwargs {key}={value!r}: a number above 0 (or leave it out)")
    return number


class S3Backend(FsspecBackend):
    """A root on S3 (s3:// or s3a://)."""

    fs: RetriedFS

    def __init__(self, fs: RetriedFS, client: S3Client) -> None:
        super().__init__(fs)
        self.client = client  # parallel, retried transfers

    @classmethod
    def connect(cls, root: str, options: dict[str, Any], transfer: Transfer) -> tuple[S3Backend, str]:
        """The backend of the root `root` (an s3:// URL), and the root's path."""
        options = dict(options)
        # IMPORTANT: listings must never come from a cache; another process commits.
        options.setdefault("use_listings_cache", False)
        options.setdefault("skip_instance_cache", True)
        # IMPORTANT: every request, listings too, gives up after Transfer.timeout_s and is
        # tried Transfer.attempts times, by ckpt alone (s3_client.RetriedFS).
        # IMPORTANT: one botocore client for them and for the transfers (`S3Client`). Its pool
        # holds a restore's two files read at once, each `readahead` + 1 GETs in flight, and
        # RESERVED connections more, which the transfers never take (`S3Client.slot`): the
        # lease's, the listings'.
        once = {"mode": "standard", "total_max_attempts": 1}
        pool = max(10, transfer.concurrency + 2 * (transfer.readahead + 1) + RESERVED)
        # IMPORTANT: the user's config_kwargs may lower the timeouts and raise the pool, never
        # the other way: Transfer.timeout_s bounds every request, Transfer.deadline_s assumes it.
        user = dict(options.get("config_kwargs") or {})
        timeouts = {k: min(_positive(user, k, transfer.timeout_s), transfer.timeout_s) for k in ("connect_timeout", "read_timeout")}
        pool = max(pool, int(_positive(user, "max_pool_connections", 1)))
        options["config_kwargs"] = {**user, **timeouts, "max_pool_connections": pool, "retries": once}
        fs = file_system(RetriedFS, options, transfer)
        return cls(fs, S3Client(fs, transfer)), RetriedFS._strip_protocol(root)

    # -- listing ----------------------------------------------------------------------------
    def bucket_exists(self, bucket: str, where: str) -> bool:
        # A HEAD that tells "no such bucket" from "cannot reach the store" (s3fs's exists()
        # answers False to both).
        return self.client.bucket_exists(bucket, where)

    def exists(self, path: str, where: str) -> bool:
        if "/" not in path.strip("/"):  # a bucket: see check_reachable
            self.fs.invalidate_cache()
            return self.bucket_exists(path.strip("/"), where)
        return super().exists(path, where)

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: str, where: str) -> bytes:
        data = self.client.get_small(path, where)
        if data is not None:
            return data
        with self.open_read(path, where, None, None) as f:  # a large file: parallel ranged GETs
            return f.read()

    def read_small(self, path: str, where: str, at_most: int) -> bytes | None:
        return self.client.get_small(path, where, limit=max(at_most, 1))

    def open_read(
        self, path: str, where: str, ranges: list[tuple[int, int]] | None, size: int | None, early: BinaryIO | None = None
    ) -> BinaryIO:  # fmt: skip
        if isinstance(early, Reader):
            return early.within(ranges)  # type: ignore[return-value]
        return Reader(self.client, path, where, ranges, size)  # type: ignore[return-value]

    def open_read_early(self, path: str, where: str, size: int) -> BinaryIO | None:
        return Reader(self.client, path, where, None, size).start()  # type: ignore[return-value]

    def warm(self) -> None:
        # The botocore client (80-300 ms of CPU) made on the I/O loop. The first request
        # waits for it (s3fs's session lock) and, if making it failed, tries again there.
        loop = self.fs.loop  # a forked child's file system raises here, before a coroutine is made
        asyncio.run_coroutine_threadsafe(self.fs.set_session(), loop)

    # -- writing ----------------------------------------------------------------------------
    def open_write(self, path: str, where: str, size: int | None) -> contextlib.AbstractContextManager[S3Upload]:  # type: ignore[override]
        return upload(self.client, path, where, size)

    def put(self, path: str, data: bytes, where: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        # One PUT: atomic on object stores; retried, bounded.
        self.client.call(f"committing {where}", "put_object", Bucket=bucket, Key=key, Body=data)

    # -- conditional writes: If-None-Match, If-Match ----------------------------------------
    def read_tagged(self, path: str, where: str) -> Tagged | None:
        """Read whole, however large: one GET, so that the bytes and the ETag belong together."""
        got = self.client.get_tagged(path, where)
        return None if got is None else Tagged(got[0], got[1], len(got[0]))

    def put_if_absent(self, path: str, data: bytes, where: str) -> str | None:
        tag = self.client.put_if(path, where, data, IfNoneMatch="*")
        return tag or self._reads_back(path, data, where)

    def put_if_unchanged(self, path: str, data: bytes, tag: str, where: str) -> str | None:
        new = self.client.put_if(path, where, data, IfMatch=tag)
        return new or self._reads_back(path, data, where)

    def _reads_back(self, path: str, data: bytes, where: str) -> str | None:
        """After a conditional PUT was refused: did our own earlier attempt land (a reply
        lost, the request retried)? `data` holds a token unique to the write."""
        now = self.read_tagged(path, where)
        return now.tag if now is not None and now.data == data else None

    # -- deleting ---------------------------------------------------------------------------
    def _remove_found(self, base: str, found: dict[str, Any], where: str) -> None:
        self.client.delete(sorted(p for p, d in found.items() if d.get("type") != "directory"), f"deleting {where}")
