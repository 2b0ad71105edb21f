"""An S3 root (ckpt.storage.s3) on a real S3-protocol server (moto): the Stores of a process share
their S3 clients per options, and objects the store refuses to delete fail retention loudly
without anything being taken for committed."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from ckpt.errors import NotFound, StorageError
from ckpt.storage.store import Store, Transfer


def test_the_stores_of_a_process_share_their_s3_clients_per_options(s3_root, s3_options):
    """A new S3 client costs 80-300 ms on its first request: Stores with the same options
    (each Checkpointer entered, each restore) reuse the process's; other options get their own."""
    a, b = Store(s3_root, s3_options), Store(s3_root + "-other", s3_options)
    assert a.fs is b.fs and a.backend.client.fs is b.backend.client.fs
    c = Store(s3_root, s3_options, Transfer(attempts=2))
    assert c.fs is not a.fs and (c.fs.transfer.attempts, a.fs.transfer.attempts) == (2, Transfer().attempts)
    d = Store(s3_root, {**s3_options, "secret": "another"})
    assert d.fs is not a.fs and d.backend.client.fs is not a.backend.client.fs
    b.put_atomic("x", b"each its own root")  # the shared client reaches each Store's own root
    assert Store(s3_root + "-other", s3_options).read_bytes("x") == b"each its own root"
    with pytest.raises(NotFound):
        a.read_bytes("x")


def test_a_child_forked_while_the_s3_clients_lock_is_held_makes_its_own_client(s3_root, s3_options):
    """A lock another thread holds at a fork stays held in the child: its first Store would
    wait for it forever (outside review)."""
    from ckpt.storage import s3_client

    Store(s3_root, s3_options).put_atomic("x", b"before the fork")
    with s3_client._FILE_SYSTEMS_LOCK:  # as another thread making a Store at the fork
        pid = os.fork()
        if pid == 0:  # the child: exits 0 once it has read the object through a client of its own
            code = 1
            try:
                code = 0 if Store(s3_root, s3_options).read_bytes("x") == b"before the fork" else 2
            finally:
                os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited for a lock its parent held at the fork")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_objects_a_store_refuses_to_delete_fail_retention_loudly_and_nothing_is_taken_for_committed(proxy, s3_root, s3_options, caplog):
    """DeleteObjects answers 200 and lists the keys it did not delete (a bucket policy, an
    object lock). Retention says so, naming one; the save that ran it still commits; the
    checkpoint it was deleting has lost its manifest first, so it is never restored with
    files missing; and once the store deletes again, the next retention clears what was left."""
    import torch

    import ckpt

    model = torch.nn.Linear(64, 64)
    options = {**s3_options, "endpoint_url": proxy.url}
    kw = dict(interval=None, save_on_exit=False, handle_sigterm=False, keep=ckpt.Keep(last=1), storage_options=options)
    caplog.set_level(logging.WARNING, logger="ckpt")
    root = Store(s3_root, s3_options)
    with ckpt.Checkpointer(s3_root, model=model, **kw) as cp:
        cp.step_done()
        cp.save(blocking=True)
        proxy.fail("deletes", *["deny"] * 100)
        cp.step_done()
        cp.save(blocking=True)
        assert cp.last_commit.step == 2
        assert "retention skipped: deleting" in caplog.text and "objects were not deleted" in caplog.text
        assert "AccessDenied" in caplog.text
        left = root.scan()
        assert sorted(left) == [1, 2] and not left[1].has_manifest and left[1].files  # debris, not a checkpoint
        proxy.fail("deletes")  # healthy again
        cp.step_done()
        cp.save(blocking=True)
    assert sorted(root.scan()) == [3]
    with ckpt.Checkpointer(s3_root, model=model, **kw) as cp:
        assert cp.restored_step == 3


def test_a_warmed_store_makes_its_client_in_the_background_without_a_request(proxy, s3_root, s3_options):
    """A restoring rank makes its client while rank 0 surveys the root (`Store.warm`): made
    once, on the I/O loop, sending nothing; the first request uses it."""
    store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url})  # a new endpoint: a new file system
    assert store.fs._s3 is None
    store.warm()
    deadline = time.monotonic() + 30
    while store.fs._s3 is None and time.monotonic() < deadline:
        time.sleep(0.01)
    made = store.fs._s3
    assert made is not None and not proxy.requests
    store.put_atomic("x", b"after the warm-up")
    assert store.read_bytes("x") == b"after the warm-up" and store.fs._s3 is made


def test_a_first_request_racing_the_warm_up_shares_its_client(proxy, s3_root, s3_options):
    from aiobotocore.session import AioSession

    made = []
    real = AioSession.create_client

    def create_client(self, *a, **k):  # counts the clients made; each is botocore's own
        made.append(1)
        return real(self, *a, **k)

    AioSession.create_client = create_client
    try:
        store = Store(s3_root, {**s3_options, "endpoint_url": proxy.url})
        store.warm()
        store.put_atomic("x", b"raced")  # at once: s3fs's session lock keeps it to one client
        assert store.read_bytes("x") == b"raced"
    finally:
        AioSession.create_client = real
    assert len(made) == 1


def test_a_client_that_cannot_be_made_fails_the_first_request_and_not_the_warm_up(s3_root, s3_options):
    store = Store(s3_root, {**s3_options, "client_kwargs": {"region_name": "no such region!"}})
    store.warm()  # says nothing: the request after it does
    with pytest.raises(StorageError, match="region_name 'no such region!'"):
        store.read_bytes("x")


def test_warm_in_a_forked_child_of_a_parents_store_leaves_no_coroutine_unawaited(s3_root, s3_options):
    """A parent's S3 Store is not fork-safe: in a child, warm() says nothing and makes no
    coroutine it cannot run (outside review)."""
    import gc
    import warnings

    store = Store(s3_root, s3_options)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                store.warm()
                gc.collect()
            code = 3 if any("never awaited" in str(w.message) for w in seen) else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
