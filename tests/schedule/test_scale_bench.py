"""bench/scale.py's own arithmetic, which calibrates `ckpt plan`'s model: no negative CPU priced,
and a timed save's requests counted without the bench's own (outside review of 4195ea5)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from tests.support.s3 import through

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_scale", REPO / "bench" / "scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(ranks: int, written: float, save_cpu: float) -> dict:
    rank = {"own_file_bytes": written + 1000, "own_index_bytes": 1000}
    return {"ranks": ranks, "save": {"cpu_s_mean": save_cpu, "cpu_s_max": save_cpu}, "restore": {"cpu_s_mean": 0.5, "cpu_s_max": 0.6, "per_rank": [rank] * ranks}}


@pytest.mark.parametrize(
    ("cpus", "fixed", "per_byte"),
    [
        ((0.06, 0.04, 0.03), None, None),  # a fixed part and a part per byte: the fit's line
        ((0.08, 0.035, 0.012), 0.0, None),  # the line's fixed part below 0: a line through 0
        ((0.03, 0.04, 0.05), 0.04, 0.0),  # CPU growing as the bytes shrink: their mean, fixed
    ],
)
def test_the_calibration_never_prices_a_negative_cpu_time(cpus, fixed, per_byte):
    bench = _bench()
    rows = [_row(n, 40e6 / n, c) for n, c in zip((2, 4, 8), cpus, strict=True)]
    store = {"get_s": 0.004, "head_s": 0.004, "write_bytes_per_s": 1.5e8, "read_bytes_per_s": 3e8}
    probe = {"base_save_cpu_s_mean": 0.1, "wide_save_cpu_s_mean": 0.1, "base_restore_cpu_s_mean": 0.5, "wide_restore_cpu_s_mean": 0.6}
    cal = bench._calibrate(rows, store, probe, argparse.Namespace(layers=24, probe=4))["table"]
    assert cal["save_cpu_s_fixed"] >= 0 and cal["save_cpu_per_byte_s"] >= 0, cal
    if fixed is not None:
        assert cal["save_cpu_s_fixed"] == pytest.approx(fixed)
    if per_byte is not None:
        assert cal["save_cpu_per_byte_s"] == pytest.approx(per_byte)
    if fixed is None:  # the plain fit
        assert cal["save_cpu_s_fixed"] > 0 and cal["save_cpu_per_byte_s"] > 0


def test_the_mark_before_a_timed_save_sends_no_request_counted_as_the_saves(proxy, s3_root, s3_options):
    """`_requests` counts what follows the last mark: a HEAD of an object that is not there
    is followed by s3fs's listing, which would count as the save's."""
    bench = _bench()
    store = through(proxy, s3_root, s3_options)
    store.put_atomic("x", b"1")
    for _ in range(2):  # the first mark and each after it
        proxy.requests.clear()
        bench._mark(store)
        assert bench._requests(proxy.requests, "save") == {}


def test_the_stores_bandwidth_as_n_processes_see_it_is_measured_on_the_store(s3_root, s3_options, tmp_path):
    """bench/store_streams.py: N processes write and read their objects at once, through Stores."""
    import json
    import os
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import store_streams

    from ckpt.storage.store import Store

    got = store_streams.measure(s3_root, json.dumps(s3_options), 2, 2 << 20, tmp_path / "streams", dict(os.environ))
    assert got["write_bytes_per_s"] > 0 and got["read_bytes_per_s"] > 0 and len(got["write_rounds"]) == store_streams.ROUNDS
    assert [len(Store(s3_root, s3_options).read_bytes(f"stream{i}.bin")) for i in range(2)] == [1 << 20] * 2
