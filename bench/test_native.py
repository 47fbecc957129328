"""Native hot path micro-benchmarks (pytest-benchmark), on 1 MiB inputs.

    python -m pytest bench/test_native.py --benchmark-columns=mean,ops

Each case records GB/s in extra_info; zlib.crc32 (CRC-32, not CRC32C) on the
same bytes is the in-run baseline. The Produce request and response cases
take the schema codec on the same message as theirs (one partition of one
1 KiB record, v9, as librdkafka sends at many partitions). A node
object's directory takes json.dumps of the same document, and its
slices assemble_segment copying the same batches into one segment."""
from __future__ import annotations

import functools
import json
import pickle
import zlib
from types import SimpleNamespace
from typing import Any

import pytest

from kafscale import _native
from kafscale.broker import messages
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol.framing import encode_request, encode_response, parse_request_header
from kafscale.protocol.schemas import FETCH, PRODUCE
from kafscale.storage.wal import Slice, directory

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


@pytest.mark.parametrize("native", [True, False], ids=["fixed_dicts", "dict_zip_baseline"])
def test_decode_fetch_request_1000_partitions(benchmark, native, monkeypatch):
    """A consumer's Fetch v12 naming 1,000 partitions (librdkafka sends
    every one in every Fetch), decoded by the schema codec: its partitions
    made dicts by _native.fixed_dicts, against dict(zip(names, row)) and an
    update a partition (what it replaced)."""
    if not native:
        def dict_zip(rows: list[tuple[Any, ...]], names: tuple[str, ...], defaults: dict[str, Any]
                     ) -> list[dict[str, Any]]:
            out = []
            for row in rows:
                d = dict(zip(names, row, strict=False))
                d.update(defaults)
                out.append(d)
            return out
        monkeypatch.setattr(_native, "fixed_dicts", dict_zip)
    parts = [{"partition": p, "current_leader_epoch": -1, "fetch_offset": 1_000 + p, "last_fetched_epoch": -1,
              "log_start_offset": -1, "partition_max_bytes": 1 << 20} for p in range(1000)]
    req = {"cluster_id": None, "replica_id": -1, "max_wait_ms": 500, "min_bytes": 1, "max_bytes": 50 << 20,
           "isolation_level": 0, "session_id": 0, "session_epoch": -1,
           "topics": [{"topic": "orders", "partitions": parts}], "forgotten_topics_data": [], "rack_id": ""}
    body = memoryview(b"".join(bytes(c) for c in FETCH.request.encode(req, 12).finish()))
    assert FETCH.request.decode(body, 12)[0]["topics"][0]["partitions"] == parts
    benchmark(FETCH.request.decode, body, 12)
    benchmark.extra_info["us/partition"] = round(benchmark.stats.stats.mean * 1e3, 3)


@pytest.mark.parametrize("native", [True, False], ids=["native", "schema_codec_baseline"])
def test_encode_produce_response(benchmark, native, monkeypatch):
    if not native:
        monkeypatch.setattr(PRODUCE.response, "native_encode", None)
    hdr = parse_request_header(_produce_request()[0])[0]
    body = {"responses": [{"name": "orders", "partition_responses": [
        {"index": 7, "error_code": 0, "base_offset": 1234, "log_append_time_ms": -1, "log_start_offset": 0,
         "record_errors": [], "error_message": None}]}], "throttle_time_ms": 0}
    benchmark(encode_response, hdr, body)


@pytest.mark.parametrize("native", [True, False], ids=["native", "json_dumps_baseline"])
def test_node_directory_1000_slices(benchmark, native):
    """A node object's directory of 1,000 slices (one per partition, as at
    1,000 partitions), against json.dumps of the same document."""
    key, created = "ns/~node/1-0123456789ab/000000000007.kfn", 1_700_000_001_000
    slices = [Slice(SimpleNamespace(topic="orders", partition=p),  # type: ignore[arg-type]
                    SegmentManifest(10 * p, 10 * p + 1, 2, 2_170, 1_700_000_000_000, 1_700_000_000_001, key,
                                    created, {}, 2_170 * p), [])
              for p in range(1000)]
    ids = {"orders": b"\x01" * 16}

    def dumps() -> bytes:
        rows = [[0, s.log.partition, s.manifest.base, s.manifest.last, s.manifest.count, s.manifest.pos,
                 s.manifest.size, s.manifest.min_ts, s.manifest.max_ts] for s in slices]
        return json.dumps({"key": key, "created_ms": created, "topics": [["orders", ids["orders"].hex()]],
                           "slices": rows}, separators=(",", ":")).encode()

    assert directory(key, created, slices, ids) == dumps()
    benchmark(functools.partial(directory, key, created, slices, ids) if native else dumps)


class _Log:
    """A partition log as a node flush sees it."""
    __slots__ = ("partition", "topic")

    def __init__(self, partition: int) -> None:
        self.topic, self.partition = "orders", partition


@pytest.mark.parametrize("native", [True, False], ids=["assemble_node", "one_segment_copy_baseline"])
def test_node_object_1000_slices(benchmark, native):
    """A node object of 1,000 slices of one 2-record batch each (as at
    1,000 partitions): the slices, their manifests, cache entries and
    directory rows in one call, against assemble_segment copying the same
    batches into one segment (the copy without the per-slice work)."""
    batch = memoryview(_native.build_batch([(1_700_000_000_000, b"k", b"x" * 1024, [])] * 2))
    taken = [(_Log(p), [_native.Pending(batch, 2 * p, None, None)]) for p in range(1000)]
    parts = [(batch, 2 * p) for p in range(1000)]
    if native:
        benchmark(lambda: _native.assemble_node(taken, 1_700_000_001_000, "k.kfn", {}, SegmentManifest, Slice,
                                                json.dumps))
    else:
        benchmark(_native.assemble_segment, parts, 1_700_000_001_000, 64 << 10)
    benchmark.extra_info["us/slice"] = round(benchmark.stats.stats.mean * 1e3, 2)


@pytest.mark.parametrize("fields", [False, True], ids=["partition_changed", "field_tuples_baseline"])
def test_partition_changes_1000_slices(benchmark, fields):
    """What a node commit of 1,000 slices sends a worker viewing their
    partitions (LogService._send_changes): a messages.PartitionChanged a
    slice with its manifest, made as sent, pickled, unpickled and made
    again as the worker has it, against the same fields as plain tuples
    pickled and unpickled (nothing made of them)."""
    key, ref = "ns/~node/1-0123456789ab/000000000007.kfn", bytes(56)
    manifests = [SegmentManifest(10 * p, 10 * p + 1, 2, 2_170, 1_700_000_000_000, 1_700_000_000_001, key,
                                 1_700_000_001_000, {}, 2_170 * p) for p in range(1000)]

    def values(m: SegmentManifest) -> tuple[Any, ...]:
        return m.base, m.last, m.count, m.size, m.min_ts, m.max_ts, m.key, m.created_ms, m.producers, m.pos, m.ref

    def send() -> list[Any]:
        if fields:
            sent: list[Any] = [("orders", p, False, 10 * p + 2, 0, values(m), ref) for p, m in enumerate(manifests)]
            return pickle.loads(pickle.dumps((2, sent), protocol=pickle.HIGHEST_PROTOCOL))[1]
        sent = [messages.PartitionChanged.sent("orders", p, False, 10 * p + 2, 0, m, ref)
                for p, m in enumerate(manifests)]
        return [messages.PartitionChanged.received(c)
                for c in pickle.loads(pickle.dumps((2, sent), protocol=pickle.HIGHEST_PROTOCOL))[1]]

    assert [c[5] if fields else values(c.manifest) for c in send()] == [values(m) for m in manifests]
    benchmark(send)
    benchmark.extra_info["us/slice"] = round(benchmark.stats.stats.mean * 1e3, 2)


@pytest.mark.parametrize("fused", [True, False], ids=["assemble_cached", "batches_then_build_segment_baseline"])
def test_compaction_of_200_cached_slices(benchmark, fused):
    """A compaction's build of one partition's 200 slices (a 1 KiB record
    each), each in another of 200 node objects of 1,000 slices in the shared
    cache (1,000 partitions): straight out of the ring in one call, against
    a view of each slice's batches (SharedCache.batches) given to
    build_segment, as before session 97."""
    from kafscale.broker.shm import SharedArea, SharedCache
    from kafscale.storage.segment import build_segment

    cache = SharedCache(SharedArea(1, 64, 256 * MIB))
    one = build_segment([(_native.build_batch([(1_700_000_000_000, None, b"x" * 1024, [])]), 0)], 0)
    n = len(one.data)
    body = memoryview(bytes(one.data) * 1000)
    taken = []
    for o in range(200):
        key = f"ns/wal/1-0123456789ab/{o:020d}.kfn"
        cache.put_object(key, body, _native.pack_entries([(p * n, n, one.tables) for p in range(1000)]))
        taken.append(SegmentManifest(o, o, 1, n, 0, 0, key, 0, {}, 500 * n))
    if fused:
        benchmark(cache.build, taken, 0)
    else:
        benchmark(lambda: build_segment(list(zip(cache.batches(taken), [m.base for m in taken], strict=True)), 0))
    benchmark.extra_info["us/slice"] = round(benchmark.stats.stats.mean * 1e6 / len(taken), 2)
