"""A worker's runs of Produce requests in native code: produce_run splits
them off a connection's bytes, stage_produce_run decodes, validates and
copies them into the ring in one call, encode_produce_responses frames their
answers. The schema codec, parse_header, validate_batches and
encode_response are the reference: the same fields, the same refusals with
the same codes, the same bytes, and nothing staged for a request that does
not decode or any after it."""
from __future__ import annotations

import random
import struct

import pytest

from kafscale import _native
from kafscale.broker.context import RequestContext
from kafscale.broker.messages import RejectedPayload
from kafscale.broker.server import ProtocolViolation, parse_header
from kafscale.protocol.codec import DecodeError
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import answer_body, encode_produce_responses, encode_request, encode_response
from kafscale.protocol.schemas import METADATA, PRODUCE

SLOT = 3
MAX_UNCOMPRESSED = 1 << 20
VERSIONS = range(PRODUCE.min_version, PRODUCE.max_version + 1)


def _ring(size: int = 1 << 16) -> tuple[bytearray, bytearray, _native.RingWriter]:
    header, data = bytearray(16), bytearray(size)
    return header, data, _native.RingWriter(header, data)


def _head(header: bytearray) -> int:
    return _native.atomic_load(header, 0)


def _stage(run: bytes, count: int, ring: _native.RingWriter) -> tuple:
    return _native.stage_produce_run(memoryview(run), count, PRODUCE.request.flexible_min, ring, SLOT, True,
                                     MAX_UNCOMPRESSED, RejectedPayload)


def _request(version: int, parts: dict[str, list[tuple[int, bytes | None]]], acks: int = -1,
             correlation_id: int = 7, client_id: str | None = "app-\u00e9") -> bytes:
    """A framed Produce request (size prefix included)."""
    return encode_request(PRODUCE.key, version, correlation_id, {
        "transactional_id": None, "acks": acks, "timeout_ms": 1234, "topic_data": [
            {"name": name, "partition_data": [{"index": i, "records": r} for i, r in ps]}
            for name, ps in parts.items()]}, client_id)


def _batch(*values: bytes, codec: int = 0) -> bytes:
    return _native.build_batch([(1_700_000_000_000 + i, b"k", v, []) for i, v in enumerate(values)], codec=codec)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_partition_is_staged_or_refused_as_the_worker_did(version):
    """Each partition's records land in the ring as sent (a descriptor of
    slot, position and length); what validate_batches refuses, what has no
    records and what exceeds the ring come back as RejectedPayloads with
    their Kafka codes, and nothing of them is staged. The header's fields
    are parse_header's."""
    good, two = _batch(b"a" * 100), _batch(b"b", b"c", codec=4) + _batch(b"d")
    corrupt = bytearray(good)
    corrupt[-1] ^= 1
    huge = _batch(b"x" * 5000)
    run = _request(version, {"orders": [(0, good), (5, None), (6, b""), (7, bytes(corrupt))],
                             "more\u00e9": [(2, two), (9, huge)]}, acks=1)
    header, ring_data, ring = _ring(4096)
    [request], staged, error = _stage(run, 1, ring)
    assert error is None
    correlation_id, v, client_id, acks, timeout_ms, tid, topics = request
    wire = parse_header(memoryview(run)[4:])
    assert (correlation_id, v, client_id) == (wire[2], wire[1], wire[3]) == (7, version, "app-\u00e9")
    assert (acks, timeout_ms, tid) == (1, 1234, None)
    assert staged == len(good) + len(two) == _head(header)
    (orders, (p0, p5, p6, p7)), (more, (p2, p9)) = topics
    assert (orders, more) == ("orders", "more\u00e9")
    assert [p for p, _ in (p0, p5, p6, p7, p2, p9)] == [0, 5, 6, 7, 2, 9]
    assert p0[1] == (SLOT, 0, len(good)) and p2[1] == (SLOT, len(good), len(two))
    assert bytes(ring_data[:len(good)]) == good and bytes(ring_data[len(good):staged]) == two
    assert p5[1] == p6[1] == RejectedPayload(ErrorCode.INVALID_RECORD, "no records")
    with pytest.raises(_native.BatchError) as refused:
        _native.validate_batches(bytes(corrupt))
    assert p7[1] == RejectedPayload(ErrorCode.CORRUPT_MESSAGE, str(refused.value))
    assert p9[1] == RejectedPayload(ErrorCode.MESSAGE_TOO_LARGE, f"{len(huge)} bytes exceed the produce buffer")


def test_a_full_ring_refuses_with_a_code_every_client_retries():
    batch = _batch(b"v" * 600)
    header, _, ring = _ring(1024)
    (first, second), staged, _ = _stage(_request(9, {"t": [(0, batch)]}) + _request(9, {"t": [(1, batch)]}), 2, ring)
    assert staged == len(batch) == _head(header)
    assert first[6] == (("t", ((0, (SLOT, 0, len(batch))),)),)
    assert second[6] == (("t", ((1, RejectedPayload(ErrorCode.NOT_ENOUGH_REPLICAS, _native.RING_FULL)),)),)


def test_a_run_shorter_than_its_count_is_refused_before_anything_is_staged():
    run = _request(9, {"t": [(0, _batch(b"x"))]})
    for broken in (run + run[:-1], run + struct.pack(">i", 4) + bytes(4), run + b"\x00\x00"):
        header, _, ring = _ring()
        with pytest.raises(ValueError):
            _stage(broken, 2, ring)
        assert _head(header) == 0


@pytest.mark.parametrize("codec", [0, 3])
def test_a_wrong_max_timestamp_is_corrected_in_the_staged_copy(codec):
    """Sarama sends maxTimestamp -1: the ring's copy gets the records' largest
    timestamp and a new CRC (as validate_batches and set_max_timestamp), the
    request's own bytes stay as they came."""
    batch = bytearray(_native.build_batch([(1000, b"k", b"a", []), (3000, b"k", b"b", [])], codec=codec))
    fixed = bytes(batch)
    struct.pack_into(">q", batch, 35, -1)
    struct.pack_into(">I", batch, 17, _native.crc32c(bytes(batch[21:])))
    run = _request(9, {"t": [(0, bytes(batch))]})
    _, ring_data, ring = _ring()
    [request], staged, _ = _stage(run, 1, ring)
    assert request[6][0][1][0][1] == (SLOT, 0, len(fixed))
    assert bytes(ring_data[:staged]) == fixed
    assert bytes(batch) in run


def test_produce_run_takes_complete_produce_frames_up_to_anything_else():
    produce = [_request(v, {"t": [(0, _batch(b"x"))]}, correlation_id=v) for v in VERSIONS]
    metadata = encode_request(METADATA.key, 1, 99, {"topics": []})
    old = bytearray(produce[0])
    struct.pack_into(">h", old, 6, 2)  # Produce v2: not a version runs take
    data = b"\x00\x01" + b"".join(produce)
    assert _native.produce_run(data, 2, 1 << 20, 100, PRODUCE.min_version, PRODUCE.max_version) == (
        len(produce), len(data))
    assert _native.produce_run(data, 2, 1 << 20, 3, PRODUCE.min_version, PRODUCE.max_version) == (
        3, 2 + sum(map(len, produce[:3])))
    for stop in (metadata + produce[3], bytes(old) + produce[3], produce[3][:-1],  # the last one incomplete
                 struct.pack(">i", 9) + bytes(9) + produce[3],  # shorter than a header
                 struct.pack(">i", len(produce[0]) + 1) + produce[0][4:] + b"\x00" + produce[3]):  # over the limit
        run = produce[1] + produce[2] + stop
        assert _native.produce_run(run, 0, len(produce[0]) - 4, 100, PRODUCE.min_version, PRODUCE.max_version) == (
            2, len(produce[1]) + len(produce[2])), stop[:12]


@pytest.mark.parametrize("version", [3, 8, 9, 12])
def test_a_request_that_does_not_decode_ends_the_run_and_nothing_of_it_is_staged(version):
    """Truncated and mutated requests in the middle of a run (their size
    prefixes kept): stage_produce_run stops exactly where parse_header or the
    schema codec fail, with that request's version and error, having staged
    the requests before it and nothing else; where all decode, the same
    fields and topics in the same order."""
    rng = random.Random(version)
    first = _request(version, {"a": [(0, _batch(b"x"))]}, correlation_id=1)
    middle = _request(version, {"a": [(0, _batch(b"y")), (1, _batch(b"z"))], "b": [(4, None)]}, correlation_id=2)
    last = _request(version, {"c": [(0, _batch(b"w"))]}, correlation_id=3)
    staged_first = len(_batch(b"x"))

    def check(frame: bytes) -> None:
        header, _, ring = _ring()
        run = first + struct.pack(">i", len(frame)) + frame + last
        requests, staged, error = _stage(run, 3, ring)
        try:
            *wire, body_at = parse_header(memoryview(frame))
            reference, _ = PRODUCE.request.generic_decode(memoryview(frame), version, body_at)
        except (DecodeError, ProtocolViolation):
            assert len(requests) == 1 and error is not None and error[0] == version
            assert staged == _head(header) == staged_first
            return
        assert error is None and len(requests) == 3
        correlation_id, v, client_id, acks, timeout_ms, tid, topics = requests[1]
        assert (correlation_id, v, client_id) == (wire[2], version, wire[3])
        assert (acks, timeout_ms, tid) == (reference["acks"], reference["timeout_ms"], reference["transactional_id"])
        assert [(name, [p for p, _ in parts]) for name, parts in topics] == [
            (t["name"], [p["index"] for p in t["partition_data"]]) for t in reference["topic_data"]]

    body = middle[4:]
    check(body)
    for cut in range(10, len(body)):
        check(body[:cut])
    for _ in range(400):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(8, len(mutated))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        check(bytes(mutated))


@pytest.mark.parametrize("version", VERSIONS)
def test_responses_framed_together_are_encode_response_back_to_back(version):
    bodies = [{"responses": [{"name": "orders", "partition_responses": [
                  {"index": 3, "error_code": 0, "base_offset": 2**40, "log_start_offset": 7}]}], "throttle_time_ms": 0},
              {"responses": [{"name": "b\u4e2d", "partition_responses": [
                  {"index": 9, "error_code": 6, "base_offset": -1, "error_message": "bad \u00e9"}]}],
               "throttle_time_ms": 250}]
    expected = b"".join(bytes(c) for i, body in enumerate(bodies)
                        for c in encode_response(RequestContext(PRODUCE.key, version, 40 + i, None, False), body))
    assert encode_produce_responses([(40 + i, version, body) for i, body in enumerate(bodies)]) == expected
    assert encode_produce_responses([]) == b""
    # a broker's answer (as the log process replies) frames as its response dict does
    answers = [[("orders", [[3, 0, 2**40, 7, None]])], [("b\u4e2d", [[9, 6, -1, -1, "bad \u00e9"]])],
               [("c", [[0, 0, 5, 0, None], [1, 87, -1, -1, "x"]]), ("d", [])], []]
    expected = b"".join(bytes(c) for i, answer in enumerate(answers) for c in encode_response(
        RequestContext(PRODUCE.key, version, 40 + i, None, False), answer_body(answer)))
    assert encode_produce_responses([(40 + i, version, answer) for i, answer in enumerate(answers)]) == expected
