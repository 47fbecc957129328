"""Inputs shared by the native benchmarks and the gates."""
from __future__ import annotations

import os

import pytest

from kafscale import _native

MIB = 1 << 20


@pytest.fixture(scope="module")
def buf() -> bytes:
    return os.urandom(MIB)


@pytest.fixture(scope="module")
def batch_1mib() -> bytes:
    """One uncompressed RecordBatch of ~1 MiB: 1000 records of 1 KiB."""
    return _native.build_batch([(1_700_000_000_000 + i, b"key-%d" % i, os.urandom(1024), []) for i in range(1000)])
