"""The root's one botocore client is shared by the transfers and by the small requests (the
lease's conditional PUTs, HEADs, listings). A restore reads two files at once, each with
`readahead` + 1 ranged GETs in flight: the transfers never take the last connections of the
pool (`S3Client.slot`), so a small request never waits behind them for one (aiohttp's wait for a
connection has no timeout). And `Transfer.timeout_s` bounds every request, whatever the user's
config_kwargs say (outside review of 2db10f1: each test failed before its fix)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.s3 import payload, through

DELAY_S = 3.0


def _while_two_files_are_read(proxy, store, pool: int, request) -> float:
    """The seconds `request()` takes while a restore reads two files, each with its reader's
    readahead + 1 ranged GETs in flight (every one delayed), once `pool` of them are sent."""
    size = (store.transfer.readahead + 2) * store.transfer.read_size
    for name in ("a", "b"):
        store.put_atomic(name, payload(size))
    proxy.delay_s = (DELAY_S, DELAY_S)
    proxy.fail("range", *["delay"] * 100)
    started = time.monotonic()

    def read(name: str) -> None:
        with store.open_read(name, size=size) as f:
            f.read(1)

    threads = [threading.Thread(target=read, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    while proxy.seen["range"] < pool and time.monotonic() - started < DELAY_S / 2:
        time.sleep(0.01)
    time.sleep(0.2)
    t0 = time.monotonic()
    assert request()
    took = time.monotonic() - t0
    for t in threads:
        t.join()
    return took


def _renewal(store):
    """A lease renewal (a conditional PUT), to send later."""
    tag = store.put_if_absent("lease.json", b"{}")
    return lambda: store.put_if_unchanged("lease.json", b'{"renewed": 1}', tag) is not None


@pytest.mark.parametrize("transfer", [{"concurrency": 1, "readahead": 8}, {"concurrency": 4, "readahead": 16}])
def test_a_lease_renewal_is_not_queued_behind_a_restores_reads(proxy, s3_root, s3_options, transfer):
    store = through(proxy, s3_root, s3_options, **transfer)
    pool = store.backend.client.fs.config_kwargs.get("max_pool_connections", 10)
    in_flight = 2 * (transfer["readahead"] + 1)
    took = _while_two_files_are_read(proxy, store, min(pool, in_flight), _renewal(store))
    assert took < 1.0, f"pool {pool}, {in_flight} GETs in flight: the renewal waited {took:.1f} s for a connection"


def test_a_users_max_pool_connections_does_not_starve_the_lease(proxy, s3_root, s3_options):
    """A user's smaller pool is raised to what the transfers and the reserve need."""
    opts = {**s3_options, "config_kwargs": {"max_pool_connections": 10}}
    store = through(proxy, s3_root, opts, concurrency=8, readahead=8)  # Transfer's defaults for both
    took = _while_two_files_are_read(proxy, store, 10, _renewal(store))
    assert took < 1.0, f"pool 10 (the user's), 18 GETs in flight: the renewal waited {took:.1f} s"


def test_a_listing_is_not_queued_behind_a_restores_reads(proxy, s3_root, s3_options):
    """Listings share the pool with the transfers, and are never queued behind them."""
    store = through(proxy, s3_root, s3_options, concurrency=1, readahead=8)
    took = _while_two_files_are_read(proxy, store, 13, lambda: "a" in store.list_dir(""))
    assert took < 1.0, f"the listing waited {took:.1f} s for a connection"


def test_transfer_timeout_bounds_a_commit_put_whatever_config_kwargs_say(proxy, s3_root, s3_options):
    """docs/reliability.md: `Transfer.timeout_s` bounds every request. A user's read_timeout
    may lower it, never raise it (it would hold a stalled commit PUT or lease write for its
    length)."""
    opts = {**s3_options, "config_kwargs": {"read_timeout": 30}}
    store = through(proxy, s3_root, opts, timeout_s=1, attempts=2)
    proxy.stall_s = 6.0
    proxy.fail("put", "stall")
    t0 = time.monotonic()
    store.put_atomic("manifest.json", b"{}")  # the commit's one PUT; its first try stalls
    took = time.monotonic() - t0
    assert took < 4.0, f"a stalled PUT held {took:.1f} s, Transfer.timeout_s is 1 s"


@pytest.mark.parametrize(
    ("config", "read_timeout"),
    [
        ({"read_timeout": 30}, 5.0),  # larger than Transfer.timeout_s: lowered to it
        ({"read_timeout": "2"}, 2.0),  # smaller: the user's
        ({"read_timeout": None}, 5.0),
        ({"read_timeout": "soon"}, None),
        ({"read_timeout": float("nan")}, None),
        ({"read_timeout": -1}, None),
        ({"read_timeout": True}, None),
        ({"max_pool_connections": "many"}, None),
    ],
)
def test_a_users_config_kwargs_are_numbers_above_zero_and_timeouts_at_most_the_transfers(s3_root, s3_options, config, read_timeout):
    from ckpt.errors import StorageError
    from ckpt.storage.store import Store, Transfer

    options = {**s3_options, "config_kwargs": config}
    if read_timeout is None:
        with pytest.raises(StorageError, match=f"opening root .*config_kwargs {next(iter(config))}=.*a number above 0"):
            Store(s3_root, options, Transfer(timeout_s=5))
        return
    store = Store(s3_root, options, Transfer(timeout_s=5))
    assert store.backend.client.fs.config_kwargs["read_timeout"] == read_timeout
