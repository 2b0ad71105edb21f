"""Shared fixtures: a real S3-protocol server (moto's server mode) on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.launch import free_port

# A suite started in the background of a shell without job control (`make test &`) inherits
# SIGINT ignored, and so would every process it starts: the Ctrl-C tests would see a trainer
# that ignores Ctrl-C. The processes a test starts get the handler a terminal's command has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def _moto_server(log_dir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """A moto S3 server on a free loopback port, up until the block exits; yields its URL."""
    port = free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.moto_server", "-H", "127.0.0.1", "-p", str(port)],  # moto, conditional writes atomic
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """URL of a moto S3 server started for this test session and stopped after it."""
    with _moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def proxy(s3_endpoint):
    """The fault-injecting, request-recording proxy in front of the moto server."""
    from tests.support.s3proxy import FaultyProxy

    p = FaultyProxy(s3_endpoint)
    yield p
    p.close()


@pytest.fixture(scope="session")
def s3_strict_endpoint(tmp_path_factory):
    """URL of a moto S3 server that checks credentials: it issued none, so every request is
    refused (403), as a real store refuses wrong credentials. The other server accepts any."""
    with _moto_server(tmp_path_factory.mktemp("moto-strict"), {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        yield url


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Standard AWS environment pointing at the moto server (child processes inherit it)."""
    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(k, v)
    return {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}


@pytest.fixture
def s3_root(s3_env, s3_endpoint):
    """A fresh bucket; returns the root URL `s3://<bucket>/run`."""
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


@pytest.fixture
def s3_options(s3_endpoint):
    """storage_options that reach the moto server without relying on the environment."""
    return {"endpoint_url": s3_endpoint, "key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"]}


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """The uninterrupted reference job per wrapping (tests/support/jobs.py), run once per session."""
    from tests.support.jobs import reference_runs

    return reference_runs(tmp_path_factory)


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


# The files that take longest, slowest first (`--durations` on the 2-core CI machine). Under
# pytest-xdist (`make test`: `-n 3 --dist loadfile --no-loadscope-reorder`) a file is the unit a
# worker takes, in this order, so no worker starts a file of minutes when the others are done.
# A file not named here follows in collection order; a wrong guess costs time, never a test.
SLOWEST_FIRST = [
    "system/test_deepspeed.py",
    "storage/test_lease.py",
    "system/test_torture.py",
    "system/test_elastic.py",
    "system/test_distributed.py",
    "system/test_load.py",
    "cli/test_tools.py",
    "restore/test_reshard.py",
    "agent/test_agent.py",
    "system/test_security.py",
    "system/test_demo.py",
    "system/test_flaky_store.py",
    "system/test_model_zoo.py",
    "capture/test_frozen.py",
    "system/test_torchrun_elastic.py",
    "cli/test_cli.py",
    "system/test_full_disk.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    if missing := [name for name in SLOWEST_FIRST if not (here / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names files that are not there: {missing}")
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(here).as_posix(), len(rank)))  # stable
