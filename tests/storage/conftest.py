"""The S3 tests' fixture: a Store on a fresh bucket of the moto server with small transfer
settings (the fault-injecting proxy in front of the server is every test's: tests/conftest.py)."""

from __future__ import annotations

import pytest

from ckpt.storage.store import Store
from tests.support.s3 import SMALL


@pytest.fixture
def store(s3_root, s3_options):
    return Store(s3_root, s3_options, transfer=SMALL)


