"""The requests of one S3 root (`S3Client`), each retried with exponential backoff and jitter
when it failed for a transient reason, and only then (`ckpt.storage.s3_retry`): small GETs,
conditional PUTs, HEADs and deletes; the streams of `ckpt.storage.s3_read` and
`ckpt.storage.s3_write` send theirs through it too.

Requests go through s3fs's async client on fsspec's I/O loop, but on a client of our own whose
botocore and s3fs retries are off, so that `Transfer.attempts` is the only retry policy:
stacked, botocore's and s3fs's retries would multiply it, and botocore's legacy mode alone
spends up to 15 s on a server that always answers 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from botocore.exceptions import ClientError
from fsspec.asyn import sync
from s3fs import S3FileSystem

from ckpt.errors import NotFound, StorageError
from ckpt.storage.backend import endpoint_of
from ckpt.storage.layout import MiB
from ckpt.storage.s3_retry import (
    GaveUp,
    ShortRead,
    botocore_error,
    describe,
    is_code,
    part_of,
    tried,
)
from ckpt.storage.transfer import Transfer

T = TypeVar("T")

# A process's S3 file systems, one per set of options. A new one makes a botocore client on
# its first request, which costs 80-300 ms (moto on loopback; more across a network): paid
# by every Store, twice, and so by every Checkpointer entered and every `ckpt` command.
_FILE_SYSTEMS: dict[tuple[Any, ...], S3FileSystem] = {}
_FILE_SYSTEMS_LOCK = threading.Lock()


def _unlock_file_systems() -> None:
    """In a forked child: a lock held at the fork (by another thread) is never released."""
    global _FILE_SYSTEMS_LOCK
    _FILE_SYSTEMS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_unlock_file_systems)


def file_system(cls: type[S3FileSystem], options: dict[str, Any], transfer: Transfer | None = None) -> S3FileSystem:
    """The process's `cls(**options)` (with `transfer`, a RetriedFS's), made on first use.
    Keyed by the process too: a forked child makes its own, on its own event loop."""
    key = (os.getpid(), cls, repr(sorted(options.items())), repr(transfer))
    with _FILE_SYSTEMS_LOCK:
        fs = _FILE_SYSTEMS.get(key)
        if fs is None:
            fs = cls(**{**options, "skip_instance_cache": True})
            if transfer is not None:
                fs.transfer = transfer  # type: ignore[attr-defined]
            _FILE_SYSTEMS[key] = fs
    return fs


_MISSING = object()  # a GET found no such object


class RetriedFS(S3FileSystem):
    """The root's S3 file system (listings, heads, small reads, deletes): each request tried
    as `transfer` says, with ckpt's own backoff, and nothing else retrying around it (s3fs's
    loop times botocore's would hold a hung store for half an hour, and botocore's jitter
    draws from `random`'s global generator: the training loop's, which a resume continues)."""

    retries = 1
    transfer = Transfer()  # set per instance by `file_system`

    async def _call_s3(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        params = {k: v for d in (*args, kwargs) for k, v in d.items()}  # s3fs passes some as dicts
        part = request_part(endpoint_of(self.storage_options), params)
        try:
            return await tried(self.transfer, f"S3 {method}", lambda: super(RetriedFS, self)._call_s3(method, *args, **kwargs), part)
        except GaveUp as e:
            if e.told:  # a throttle counted, the deadline: never a FileNotFoundError; say why
                raise OSError(f"{describe(e.error)}{e.why}") from e.error
            raise e.error from e.error.__cause__  # as s3fs raised it: FileNotFoundError stays one


def request_part(endpoint: str, params: dict[str, Any]) -> str:
    """The part of the store (`part_of`) a request with these parameters goes to: its key's
    directory, its listing prefix's, or its first deleted key's."""
    deleted = (params.get("Delete") or {}).get("Objects") or [{}]
    return part_of(endpoint, params.get("Bucket", ""), params.get("Key") or params.get("Prefix") or deleted[0].get("Key", ""))


_DELETE_BATCH = 1000  # keys per DeleteObjects request: S3's limit
RESERVED = 4  # pooled connections the transfers never take: the lease's, listings', commits'


class S3Client:
    """The requests of one S3 root, each retried as `config` says."""

    def __init__(self, fs: RetriedFS, config: Transfer) -> None:
        # The root's own file system and its botocore client (`S3Backend.connect`): a second
        # client would cost every process (a trainer, its writer, a `ckpt` command) 0.1-0.2
        # CPU-s more to set up. Its requests bypass RetriedFS's retries (`once`): `retry` is theirs.
        self.fs = fs
        self.config = config
        self.endpoint = endpoint_of(fs.storage_options)

    def once(self, method: str, **kwargs: Any) -> Awaitable[Any]:
        """One S3 request, not retried here (the caller retries it, through `retry`)."""
        return S3FileSystem._call_s3(self.fs, method, **kwargs)

    def slot(self) -> asyncio.Semaphore:
        """What a transfer's request (a part, a ranged GET) holds while it uses a connection:
        at most the pool less RESERVED of them, so that a small request never queues behind
        them for a connection (aiohttp's wait for one has no timeout). On the I/O loop only;
        one per file system, which the Stores of one set of options share."""
        sem = getattr(self.fs, "_ckpt_slots", None)
        if sem is None:
            pool = int(self.fs.config_kwargs.get("max_pool_connections") or 10)
            sem = self.fs._ckpt_slots = asyncio.Semaphore(max(1, pool - RESERVED))  # type: ignore[attr-defined]
        return sem

    def part(self, bucket: str, key: str = "") -> str:
        """The part of the store a request to `key` goes to (`ckpt.storage.s3_retry.part_of`)."""
        return part_of(self.endpoint, bucket, key)

    async def retry(self, what: str, part: str, request: Callable[[], Awaitable[T]]) -> T:
        """`request()` (to `part`), sent again after a transient failure, as `config` says;
        a StorageError that says `what` failed otherwise."""
        try:
            return await tried(self.config, what, request, part)
        except GaveUp as e:
            raise StorageError(f"{what}: {describe(e.error)}{e.why}") from e.error

    def call(self, what: str, method: str, **kwargs: Any) -> Any:
        """One S3 request with retries, from synchronous code."""
        return self.run(self.retry, what, request_part(self.endpoint, kwargs), lambda: self.once(method, **kwargs))

    def put_if(self, path: str, where: str, data: bytes, **condition: str) -> str | None:
        """One PUT of `data` to `path` under a condition (`IfNoneMatch="*"`: only if absent;
        `IfMatch=etag`: only if unchanged); the new object's ETag, or None when the store
        refused it because the condition did not hold (412, or 409 when another conditional
        write raced this one). A retried request may be refused because its own first
        attempt landed: the caller reads back to tell."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            resp = self.call(f"writing {where}", "put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except StorageError as e:
            if is_code(e.__cause__, "PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return None
            raise
        return str(resp["ETag"])

    def bucket_exists(self, bucket: str, where: str) -> bool:
        """Whether `bucket` exists (HEAD, retried): False only when the store says so (404); a
        store that cannot be reached is a StorageError that says so. A HEAD refused (403: a
        policy that allows listing under a prefix only) counts as there: what is done under
        the prefix then says whether it is."""
        try:
            self.call(f"checking {where}", "head_bucket", Bucket=bucket)
        except StorageError as e:
            if is_code(e.__cause__, "404", "NoSuchBucket", "NotFound"):
                return False
            if is_code(e.__cause__, "403", "AccessDenied", "Forbidden"):
                return True
            raise
        return True

    def delete(self, paths: list[str], where: str) -> None:
        """Delete the objects `paths` ("bucket/key", taken literally), 1000 per request. A key
        the store did not delete is an error: DeleteObjects answers 200 and lists it apart
        (s3fs ignores that list)."""
        for i in range(0, len(paths), _DELETE_BATCH):
            by_bucket: dict[str, list[dict[str, str]]] = {}
            for path in paths[i : i + _DELETE_BATCH]:
                bucket, key, _ = self.fs.split_path(path)
                by_bucket.setdefault(bucket, []).append({"Key": key})
            for bucket, objects in by_bucket.items():
                resp = self.call(where, "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
                failed = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if failed:
                    first = failed[0]
                    raise StorageError(
                        f"{where}: {len(failed)} of {len(objects)} objects were not deleted "
                        f"({first.get('Key')}: {first.get('Code')} {first.get('Message', '')})".rstrip()
                    )

    def get_tagged(self, path: str, where: str) -> tuple[bytes, str] | None:
        """The object `path` and its ETag, read in one GET (so they belong together); None
        if there is no such object."""
        got = self._get_whole(path, where, None)
        return None if got is _MISSING else got  # type: ignore[return-value]

    def get_small(self, path: str, where: str, limit: int = 8 * MiB) -> bytes | None:
        """The object `path` in one GET when it holds at most `limit` bytes (a manifest,
        `.metadata`, an event: a reader's HEAD first would double the round trips); None when
        it is larger (read it with `reader`). NotFound if there is no such object."""
        got = self._get_whole(path, where, limit)
        if got is _MISSING:
            raise NotFound(f"{where} does not exist")
        return None if got is None else got[0]  # type: ignore[index]

    def _get_whole(self, path: str, where: str, limit: int | None) -> tuple[bytes, str] | object | None:
        """One GET of the whole object and its ETag, retried (_MISSING: no such object); with
        `limit`, a ranged GET of its first `limit` bytes, and None when the object is larger."""
        bucket, key, _ = self.fs.split_path(path)
        ranged = {"Range": f"bytes=0-{limit - 1}"} if limit is not None else {}

        async def once() -> tuple[bytes, str] | object | None:
            try:
                resp = await self.once("get_object", Bucket=bucket, Key=key, **ranged)
            except FileNotFoundError as e:
                if is_code(e, "NoSuchKey") or not isinstance(botocore_error(e), ClientError):
                    return _MISSING  # not an exception: fsspec's sync raises one that is returned
                raise  # no such bucket: never "no such object"
            except OSError as e:
                if ranged and is_code(e, "InvalidRange", "416"):
                    return b"", ""  # an empty object has no byte 0
                raise
            try:
                total = int(resp["ContentRange"].rsplit("/", 1)[1]) if resp.get("ContentRange") else resp["ContentLength"]
                if limit is not None and total > limit:
                    return None
                data = await resp["Body"].read()
            finally:
                resp["Body"].close()
            if len(data) != total:
                raise ShortRead(f"{len(data)} of {total} bytes")
            return data, resp["ETag"]

        return self.run(self.retry, f"reading {where}", self.part(bucket, key), once)

    def run(self, coro: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a coroutine on fsspec's I/O loop and wait for it."""
        return sync(self.fs.loop, coro, *args, **kwargs)

    def start(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on fsspec's I/O loop; its result is for later."""
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)  # type: ignore[arg-type]
