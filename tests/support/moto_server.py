"""The moto S3 server the tests run (`python -m tests.support.moto_server`, moto.server's own
arguments), with S3's conditional writes made atomic as S3's are: moto checks If-None-Match and
If-Match, then writes, with nothing in between held, so two racing conditional PUTs of one key
could both succeed on its threaded server (seen: two jobs racing for a free lease both took
it). Here each object write runs under one lock, which makes the check and the write one step;
nothing else of moto changes."""

from __future__ import annotations

import functools
import threading

from moto.s3.responses import S3Response
from moto.server import main

_WRITES = threading.Lock()


def _atomic(method):
    @functools.wraps(method)
    def under_lock(self, *args, **kwargs):
        with _WRITES:
            return method(self, *args, **kwargs)

    return under_lock


S3Response.put_object = _atomic(S3Response.put_object)  # PUT, with If-None-Match / If-Match
S3Response._key_response_post = _atomic(S3Response._key_response_post)  # CompleteMultipartUpload, If-None-Match

if __name__ == "__main__":
    main()
