"""Native hot path micro-benchmarks (pytest-benchmark), on 1 MiB inputs.

    python -m pytest bench/test_native.py --benchmark-columns=mean,ops

Each case records GB/s in extra_info; zlib.crc32 (CRC-32, not CRC32C) on the
same bytes is the in-run baseline."""
from __future__ import annotations

import zlib

import pytest

from kafscale import _native

MIB = 1 << 20


def _gbps(benchmark, nbytes: int) -> None:
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.mean / 1e9, 2)


@pytest.mark.parametrize("fn", [_native.crc32c, _native.crc32c_portable, zlib.crc32],
                         ids=["crc32c", "crc32c_table_path", "zlib_crc32_baseline"])
def test_checksum_1mib(benchmark, buf, fn):
    benchmark(fn, buf)
    _gbps(benchmark, len(buf))


def test_validate_batch_1mib(benchmark, batch_1mib):
    benchmark(_native.validate_batches, batch_1mib)
    _gbps(benchmark, len(batch_1mib))


@pytest.mark.parametrize("codec", [3, 4], ids=["lz4", "zstd"])
def test_validate_compressed_batch(benchmark, codec):
    recs = [(1_700_000_000_000 + i, b"key-%d" % i, (b"value %d " % i) * 100, []) for i in range(1000)]
    batch = _native.build_batch(recs, codec=codec)
    benchmark(_native.validate_batches, batch)
    plain = sum(len(r[2]) for r in recs)
    benchmark.extra_info["uncompressed GB/s"] = round(plain / benchmark.stats.stats.mean / 1e9, 2)
