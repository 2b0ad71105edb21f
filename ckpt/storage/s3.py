"""Moving bytes to and from S3: parallel multipart uploads and reads ahead with ranged GETs
(`ckpt.storage.s3_read`), every request retried with exponential backoff and jitter when it failed
for a transient reason, and only then (`ckpt.storage.s3_retry`).

`Store` uses this for s3:// roots; other fsspec backends keep fsspec's own files. Requests go
through s3fs's async client on fsspec's I/O loop, but on a client of our own whose botocore
and s3fs retries are off, so that `Transfer.attempts` is the only retry policy: stacked,
botocore's and s3fs's retries would multiply it, and botocore's legacy mode alone spends up
to 15 s on a server that always answers 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from botocore.exceptions import ClientError
from fsspec.asyn import sync
from s3fs import S3FileSystem

from ckpt.errors import NotFound, StorageError
from ckpt.storage.s3_read import Reader, Stream
from ckpt.storage.s3_retry import (
    GaveUp,
    ShortRead,
    botocore_error,
    describe,
    is_code,
    tried,
)
from ckpt.storage.store import PUT_MAX, MiB, Transfer

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARTS = 10_000  # S3's limit for one multipart upload
KEEP_FROM = 1 * MiB  # smaller pieces are copied: a reference per tiny header costs more

# A process's S3 file systems, one per set of options. A new one makes a botocore client on
# its first request, which costs 80-300 ms (moto on loopback; more across a network): paid
# by every Store, twice, and so by every Checkpointer entered and every `ckpt` command.
_FILE_SYSTEMS: dict[tuple[Any, ...], S3FileSystem] = {}
_FILE_SYSTEMS_LOCK = threading.Lock()


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
    transfer = Transfer()  # set per instance by Store

    async def _call_s3(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await tried(self.transfer, f"S3 {method}", lambda: super(RetriedFS, self)._call_s3(method, *args, **kwargs))
        except GaveUp as e:
            raise e.error from e.error.__cause__  # as s3fs raised it: FileNotFoundError stays one


class _OneTry(S3FileSystem):
    retries = 1  # s3fs's own loop around each call: one pass (a class attribute survives pickling)


_DELETE_BATCH = 1000  # keys per DeleteObjects request: S3's limit


class S3Transfers:
    """Uploads and reads of the objects of one S3 root."""

    def __init__(self, fs: S3FileSystem, config: Transfer) -> None:
        options = dict(fs.storage_options)
        options["config_kwargs"] = {
            **(options.get("config_kwargs") or {}),
            # IMPORTANT: `retry` below is the only retry policy (see the module docstring).
            "retries": {"mode": "standard", "total_max_attempts": 1},
            "max_pool_connections": max(10, config.concurrency + config.readahead),
            "connect_timeout": config.timeout_s,
            "read_timeout": config.timeout_s,
        }
        self.fs = file_system(_OneTry, options)
        self.config = config

    async def retry(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        """`request()`, sent again after a transient failure, at most `attempts` times; a
        StorageError that says `what` failed otherwise."""
        try:
            return await tried(self.config, what, request)
        except GaveUp as e:
            tries = f" (gave up after {e.attempts} attempts)" if e.attempts > 1 else ""
            raise StorageError(f"{what}: {describe(e.error)}{tries}") from e.error

    def call(self, what: str, method: str, **kwargs: Any) -> Any:
        """One S3 request with retries, from synchronous code."""
        return self.run(self.retry, what, lambda: self.fs._call_s3(method, **kwargs))

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
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, **ranged)
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

        return self.run(self.retry, f"reading {where}", once)

    def run(self, coro: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a coroutine on fsspec's I/O loop and wait for it."""
        return sync(self.fs.loop, coro, *args, **kwargs)

    def start(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on fsspec's I/O loop; its result is for later."""
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def upload(self, path: str, where: str, size: int | None = None) -> Iterator[Upload]:
        """The object `path`, visible once the block exits without error; `where` names it in
        messages; `size`, if known, the bytes that will be written. On any failure nothing is
        left: no object, no incomplete upload."""
        up = Upload(self, path, where, size)
        try:
            yield up
            up.commit()
        except BaseException:
            up.abort()
            raise
        finally:
            up.close()

    def reader(self, path: str, where: str, ranges: list[tuple[int, int]] | None = None, size: int | None = None) -> Reader:
        """The object `path`, to read (and close: a `with` block does); see `Reader`."""
        return Reader(self, path, where, ranges, size)


class Upload(io.RawIOBase):
    """A writable stream that uploads one object in parts of `part_size` bytes, up to
    `concurrency` of them at a time, while the writer goes on; see `Store.open_write`.

    A part is a list of pieces: references to the caller's buffers that own their memory and
    are at least KEEP_FROM long, and copies of everything else. The object becomes visible
    only at `commit`: one PUT for a file of at most two parts (and 5 GiB), else the completion
    of the upload. A multipart upload costs three more requests and its small last part is a
    request of its own, so a file of up to about 100 MB is one PUT, as AWS advises (and as
    s3fs's `pipe_file` sends it). Told the file's `size`, an upload that will need parts sends
    the first as soon as it is full; else full parts are held (`_held`) until the file
    outgrows one PUT. The size told is a hint: the bytes written decide, and a wrong one
    costs requests, never the object's bytes."""

    def __init__(self, t: S3Transfers, path: str, where: str, size: int | None = None) -> None:
        self._t, self._where = t, where
        self._bucket, self._key, _ = t.fs.split_path(path)
        self._one_put = min(2 * t.config.part_size, PUT_MAX)  # the most one PUT carries
        self._multipart = size is not None and size > self._one_put
        self._pieces: list[memoryview | bytearray] = []  # of the part being filled
        self._fill = 0  # bytes in those pieces
        self._held: list[list[memoryview | bytearray]] = []  # full parts, while one PUT may do
        self._size = 0
        self._upload_id: str | None = None
        self._parts = 0  # numbered so far
        self._etags: dict[int, str] = {}  # of the parts uploaded
        self._running: set[concurrent.futures.Future[tuple[int, str]]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()  # the same, as the loop sees them

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"{self._where}: write to a closed upload")
        view = memoryview(data).cast("B")
        size = len(view)
        keep = view.obj is not None and size >= KEEP_FROM
        part = self._t.config.part_size
        multipart = self._multipart or self._size + size > self._one_put
        while view:
            # A full part goes once more bytes follow (one PUT: it is held until commit).
            if self._fill == part:
                self._held.append(self._pieces)
                self._pieces, self._fill = [], 0
                if multipart:
                    self._send_held()
            n = min(len(view), part - self._fill)
            if keep:
                self._pieces.append(view[:n])
            elif self._pieces and isinstance(self._pieces[-1], bytearray):
                self._pieces[-1] += view[:n]
            else:
                self._pieces.append(bytearray(view[:n]))
            self._fill += n
            view = view[n:]
        self._size += size
        if multipart:
            self._send_held()  # what an earlier write left held
        return size

    def _send_held(self) -> None:
        if self._held and self._upload_id is None:
            out = self._t.call(f"writing {self._where}", "create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = out["UploadId"]
        for pieces in self._held:
            self._send_part(pieces)
        self._held = []

    def _send_part(self, pieces: list[memoryview | bytearray]) -> None:
        self._collect(self._t.config.concurrency - 1)
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise StorageError(
                f"writing {self._where}: more than {MAX_PARTS} parts of {self._t.config.part_size} bytes; raise Transfer.part_size"
            )
        self._running.add(self._t.start(self._upload_part(self._parts, pieces)))

    async def _upload_part(
        self, number: int, pieces: list[memoryview | bytearray]
    ) -> tuple[int, str]:
        what = f"writing {self._where} (part {number})"
        out = await self._tracked(self._send(what, "upload_part", pieces, UploadId=self._upload_id, PartNumber=number))
        return number, out["ETag"]

    async def _tracked(self, request: Awaitable[T]) -> T:
        """`request`, awaited in a task that `abort` can stop: one the caller gave up waiting
        for (an interrupt in `run`) must not go on reading its buffers after the block."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await request
        finally:
            self._tasks.discard(task)
            del task  # no cycle through this frame: a cancelled request is freed at once

    async def _send(
        self, what: str, method: str, pieces: list[memoryview | bytearray], **kwargs: Any
    ) -> Any:
        """One request with the pieces as its body, retried (a fresh body per attempt:
        botocore sends from the position it finds)."""
        bodies: list[_Pieces] = []

        def request() -> Awaitable[Any]:
            bodies.append(_Pieces(pieces))
            return self._t.fs._call_s3(
                method, Bucket=self._bucket, Key=self._key, Body=bodies[-1], **kwargs
            )

        try:
            return await self._t.retry(what, request)
        finally:
            # IMPORTANT: let go of the caller's buffers now, not when the last reference to
            # this request (a traceback, a pooled connection) goes: they may be unmapped.
            for body in bodies:
                body.close()
            pieces.clear()

    def _collect(self, limit: int) -> None:
        """Wait until at most `limit` parts are in flight; a failed part raises here."""
        while len(self._running) > limit:
            done, _ = concurrent.futures.wait(
                self._running, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for fut in done:
                self._running.discard(fut)
                number, etag = fut.result()
                self._etags[number] = etag

    def commit(self) -> None:
        what = f"writing {self._where}"
        if self._upload_id is None:
            pieces = [*itertools.chain(*self._held), *self._pieces]
            self._let_go()  # the request's own list is emptied once it is sent, as a part's is
            self._t.run(self._tracked, self._send(what, "put_object", pieces))
            return
        if self._fill:
            self._send_part(self._pieces)
        self._collect(0)
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in sorted(self._etags.items())]
        try:
            self._t.call(
                what, "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                UploadId=self._upload_id, MultipartUpload={"Parts": parts},
            )  # fmt: skip
        except StorageError as e:
            # A retried completion whose first try went through finds no upload any more.
            if not is_code(e.__cause__, "NoSuchUpload") or self._stored_size() != self._size:
                raise
        self._upload_id = None

    def _stored_size(self) -> int | None:
        with contextlib.suppress(StorageError):
            head = self._t.call(f"checking {self._where}", "head_object", Bucket=self._bucket, Key=self._key)
            return int(head["ContentLength"])
        return None

    def abort(self) -> None:
        """Stop every part in flight and abort the upload. Never raises: the caller is
        already failing; an upload that cannot be aborted is logged."""
        for fut in self._running:
            fut.cancel()
        self._running.clear()
        try:
            # IMPORTANT: no part may still be sending, or it could outlive the abort (and
            # keep reading the caller's buffers after the block exits).
            try:
                self._t.run(self._stop_tasks)
            finally:
                self._let_go()
            if self._upload_id is not None:
                self._t.call(
                    f"aborting the upload of {self._where}", "abort_multipart_upload",
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                )  # fmt: skip
                self._upload_id = None
        except Exception as e:
            logger.warning(
                "%s; a lifecycle rule (AbortIncompleteMultipartUpload) removes what is left", e
            )

    def _let_go(self) -> None:
        """Drop every reference to the caller's buffers that the parts not sent hold (a list
        may still be referenced elsewhere: a traceback's frame)."""
        for pieces in self._held:
            pieces.clear()
        self._held.clear()
        self._pieces.clear()

    async def _stop_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Pieces(Stream):
    """A request body over a list of buffers: botocore refuses a memoryview, and this way
    `read` hands out slices, so the bytes reach the socket without a copy here. aiohttp
    sends a file-like body in chunks, which also costs half the CPU of one bytes object
    (measured: 0.43 s against 0.87 s for 256 MiB)."""

    def __init__(self, pieces: list[memoryview | bytearray]) -> None:
        self._pieces = [memoryview(p) for p in pieces]
        self.size = sum(len(p) for p in self._pieces)
        self._index = self._offset = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = min(self.size, self._where_to(offset, whence))
        self._pos, self._index, self._offset = pos, 0, pos
        while self._index < len(self._pieces) and self._offset >= len(self._pieces[self._index]):
            self._offset -= len(self._pieces[self._index])
            self._index += 1
        return pos

    def close(self) -> None:
        self._pieces = []
        super().close()

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        while self._index < len(self._pieces) and self._offset == len(self._pieces[self._index]):
            self._index, self._offset = self._index + 1, 0
        if self._index == len(self._pieces):
            return memoryview(b"")
        if size is None or size < 0:  # everything left: a copy, but botocore reads in chunks
            rest = [self._pieces[self._index][self._offset :], *self._pieces[self._index + 1 :]]
            self.seek(0, io.SEEK_END)
            return memoryview(b"".join(rest))
        piece = self._pieces[self._index]
        end = min(len(piece), self._offset + size)
        out = piece[self._offset : end]
        self._pos += len(out)
        self._offset = end
        return out
