"""The S3 tests' fixtures: a Store on a fresh bucket of the moto server with small transfer
settings, and the fault-injecting proxy in front of the server."""

from __future__ import annotations

import pytest

from ckpt.storage.store import Store
from tests.support.s3 import SMALL
from tests.support.s3proxy import FaultyProxy


@pytest.fixture
def store(s3_root, s3_options):
    return Store(s3_root, s3_options, transfer=SMALL)


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultyProxy(s3_endpoint)
    yield p
    p.close()
