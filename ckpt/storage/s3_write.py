"""Writing one S3 object (`S3Upload`): parts of `Transfer.part_size` bytes uploaded while the
writer goes on, up to `concurrency` at a time, the caller's big buffers sent by reference
rather than copied; the object visible only once the upload completes, and nothing left of it
on any failure (`upload`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import itertools
import logging
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from ckpt.errors import StorageError
from ckpt.storage.layout import MiB
from ckpt.storage.s3_client import S3Client
from ckpt.storage.s3_read import Stream
from ckpt.storage.s3_retry import is_code
from ckpt.storage.transfer import PUT_MAX

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARTS = 10_000  # S3's limit for one multipart upload
KEEP_FROM = 1 * MiB  # smaller pieces are copied: a reference per tiny header costs more


@contextlib.contextmanager
def upload(client: S3Client, path: str, where: str, size: int | None = None) -> Iterator[S3Upload]:
    """The object `path`, visible once the block exits without error; `where` names it in
    messages; `size`, if known, the bytes that will be written. On any failure nothing is
    left: no object, no incomplete upload."""
    up = S3Upload(client, path, where, size)
    try:
        yield up
        up.commit()
    except BaseException:
        up.abort()
        raise
    finally:
        up.close()


class S3Upload(io.RawIOBase):
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

    def __init__(self, t: S3Client, path: str, where: str, size: int | None = None) -> None:
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

        async def request() -> Any:
            async with self._t.slot():
                bodies.append(_Pieces(pieces))
                return await self._t.once(
                    method, Bucket=self._bucket, Key=self._key, Body=bodies[-1], **kwargs
                )

        try:
            return await self._t.retry(what, self._t.part(self._bucket, self._key), request)
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
