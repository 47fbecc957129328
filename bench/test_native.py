"""Native hot path micro-benchmarks (pytest-benchmark), on 1 MiB inputs.

    python -m pytest bench/test_native.py --benchmark-columns=mean,ops

Each case records GB/s in extra_info; zlib.crc32 (CRC-32, not CRC32C) on the
same bytes is the in-run baseline. The Produce request and response cases
take the schema codec on the same message as theirs (one partition of one
1 KiB record, v9, as librdkafka sends at many partitions)."""
from __future__ import annotations

import zlib

import pytest

from kafscale import _native
from kafscale.protocol.framing import encode_request, encode_response, parse_request_header
from kafscale.protocol.schemas import PRODUCE

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


def _produce_request() -> tuple[memoryview, int]:
    batch = _native.build_batch([(1_700_000_000_000, b"k", b"x" * 1024, [])])
    body = {"transactional_id": None, "acks": -1, "timeout_ms": 30000,
            "topic_data": [{"name": "orders", "partition_data": [{"index": 7, "records": batch}]}]}
    frame = memoryview(encode_request(PRODUCE.key, 9, 42, body, "rdkafka"))[4:]
    return frame, parse_request_header(frame)[1]


@pytest.mark.parametrize("decode", [PRODUCE.request.decode, PRODUCE.request.generic_decode],
                         ids=["native", "schema_codec_baseline"])
def test_decode_produce_request(benchmark, decode):
    frame, at = _produce_request()
    benchmark(decode, frame, 9, at)


@pytest.mark.parametrize("native", [True, False], ids=["native", "schema_codec_baseline"])
def test_encode_produce_response(benchmark, native, monkeypatch):
    if not native:
        monkeypatch.setattr(PRODUCE.response, "native_encode", None)
    hdr = parse_request_header(_produce_request()[0])[0]
    body = {"responses": [{"name": "orders", "partition_responses": [
        {"index": 7, "error_code": 0, "base_offset": 1234, "log_append_time_ms": -1, "log_start_offset": 0,
         "record_errors": [], "error_message": None}]}], "throttle_time_ms": 0}
    benchmark(encode_response, hdr, body)
