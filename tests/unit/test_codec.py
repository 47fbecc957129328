"""The schema-driven codec against bytes real clients send and Kafka specifies."""
from __future__ import annotations

import random
import struct

import pytest

from kafscale.protocol.codec import DecodeError, Message, Writer, parse_schema
from kafscale.protocol.framing import decode_response, encode_request, encode_response, parse_request_header
from kafscale.protocol.schemas import API_VERSIONS, APIS, CREATE_TOPICS, FETCH, METADATA, PRODUCE


def encode(msg: Message, body: dict, v: int) -> bytes:
    return b"".join(bytes(c) for c in msg.encode(body, v).finish())


def test_librdkafka_api_versions_v3_request():
    """Captured from confluent-kafka 2.16 (librdkafka): header v2, compact strings, empty tags."""
    frame = bytes.fromhex("0012000300000001000772646b61666b6100"
                          "17636f6e666c75656e742d6b61666b612d707974686f6e16322e31362e312d72646b61666b612d322e31362e3000")
    hdr, pos = parse_request_header(memoryview(frame))
    assert (hdr.api_key, hdr.api_version, hdr.correlation_id, hdr.client_id, hdr.flexible) == (18, 3, 1, "rdkafka",
                                                                                               True)
    body, end = API_VERSIONS.request.decode(memoryview(frame), 3, pos)
    assert body == {"client_software_name": "confluent-kafka-python",
                    "client_software_version": "2.16.1-rdkafka-2.16.0"}
    assert end == len(frame)


@pytest.mark.parametrize(("api_key", "version", "flexible"), [
    (0, 8, False), (0, 9, True),  # Produce: header v2 from v9
    (18, 2, False), (18, 3, True),  # ApiVersions: from v3
    (0, 99, False), (0, -1, False),  # versions no API has
    (999, 0, False), (-5, 0, False),  # unknown API keys
])
def test_request_headers_are_v2_exactly_where_the_schemas_say(api_key, version, flexible):
    """The native header parser looks header v2 up in a table built from
    the schemas: tagged fields (here one, tag 7 of 2 bytes) are skipped there
    and nowhere else; a client id that is not UTF-8 is replaced, not refused."""
    head = struct.pack(">hhih", api_key, version, 42, 3) + b"c\xffd"
    hdr, pos = parse_request_header(memoryview(head + b"\x01\x07\x02ab" + b"body"))
    assert (hdr.api_key, hdr.api_version, hdr.correlation_id, hdr.client_id) == (api_key, version, 42, "c\ufffdd")
    assert hdr.flexible is flexible
    assert pos == len(head) + (5 if flexible else 0)


@pytest.mark.parametrize("frame", [b"", struct.pack(">hhi", 0, 9, 1), struct.pack(">hhih", 0, 9, 1, 4) + b"abc",
                                   struct.pack(">hhih", 0, 9, 1, -1) + b"\x01\x07\x05ab"])
def test_a_truncated_request_header_is_a_decode_error(frame):
    with pytest.raises(DecodeError):
        parse_request_header(memoryview(frame))


def test_metadata_v12_all_topics_request_from_librdkafka():
    """librdkafka sends null topics and then 3 bytes Kafka ignores."""
    body, end = METADATA.request.decode(memoryview(bytes.fromhex("00000000010000")), 12)
    assert body["topics"] is None and end == 4


def test_api_versions_response_v0_vector():
    hdr = parse_request_header(memoryview(struct.pack(">hhih", 18, 0, 9, -1)))[0]
    chunks = encode_response(hdr, {"error_code": 0, "api_keys": [{"api_key": 0, "min_version": 3,
                                                                  "max_version": 9}]})
    # size 16, correlation id 9, error 0, array of 1: (Produce, 3, 9)
    assert b"".join(chunks) == bytes.fromhex("00000010" "00000009" "0000" "00000001" "0000" "0003" "0009")


def test_api_versions_v3_response_uses_header_v0_and_compact_body():
    hdr = parse_request_header(memoryview(struct.pack(">hhih", 18, 3, 5, -1) + b"\x00"))[0]
    data = b"".join(encode_response(hdr, {"error_code": 0, "api_keys": [{"api_key": 1, "min_version": 4,
                                                                         "max_version": 13}]}))
    # size, correlation id, (no header tags), error, compact array(1 -> 2), key, min, max, key tags, throttle, tags
    assert data[4:] == bytes.fromhex("00000005" "0000" "02" "0001" "0004" "000d" "00" "00000000" "00")


def test_produce_v9_request_compact_and_records_passthrough():
    records = b"\x00" * 70
    frame = encode_request(0, 9, 77, {"transactional_id": None, "acks": -1, "timeout_ms": 3000, "topic_data": [
        {"name": "t", "partition_data": [{"index": 2, "records": records}]}]}, client_id="c")
    body = frame[4:]
    hdr, pos = parse_request_header(memoryview(body))
    assert hdr.flexible and hdr.correlation_id == 77
    assert body[pos:pos + 8] == bytes.fromhex("00" "ffff" "00000bb8" "02")  # null txn id, acks, timeout, 1 topic
    req, end = PRODUCE.request.decode(memoryview(body), 9, pos)
    assert end == len(body)
    assert bytes(req["topic_data"][0]["partition_data"][0]["records"]) == records


def test_produce_v3_uses_int16_strings_and_int32_bytes():
    data = encode(PRODUCE.request, {"transactional_id": None, "acks": 1, "timeout_ms": 5,
                                    "topic_data": [{"name": "ab", "partition_data": [{"index": 0,
                                                                                      "records": b"xyz"}]}]}, 3)
    assert data == bytes.fromhex("ffff" "0001" "00000005" "00000001" "0002" "6162" "00000001" "00000000"
                                 "00000003" "78797a")


def test_records_list_is_written_without_joining():
    big = [b"a" * 5000, b"b" * 6000]
    resp = {"responses": [{"topic": "t", "topic_id": bytes(16), "partitions": [
        {"partition_index": 0, "error_code": 0, "high_watermark": 1, "records": big}]}]}
    w = FETCH.response.encode(resp, 11)
    chunks = w.finish()
    assert any(c is big[0] for c in chunks) and any(c is big[1] for c in chunks)
    decoded, _ = FETCH.response.decode(memoryview(b"".join(bytes(c) for c in chunks)), 11)
    assert bytes(decoded["responses"][0]["partitions"][0]["records"]) == big[0] + big[1]


def test_tagged_fields_round_trip_and_unknown_tags_skipped():
    msg = Message(parse_schema("""
    a: int32
    b: string 1+ tag=0 default=x
    c: [ 1+
      d: int8
    ]
    """), 1)
    data = encode(msg, {"a": 1, "b": "hello", "c": [{"d": 3}]}, 1)
    assert msg.decode(memoryview(data), 1) == ({"a": 1, "c": [{"d": 3}], "b": "hello"}, len(data))
    # default values of tagged fields are not written
    assert encode(msg, {"a": 1, "b": "x", "c": []}, 1) == bytes.fromhex("00000001" "01" "00")
    # an unknown tag (7) is skipped
    data = bytes.fromhex("00000001" "01" "00" "01" "07" "02" "abcd")
    assert msg.decode(memoryview(data), 1)[0]["b"] == "x"


def test_arrays_of_fixed_layout_decode_as_element_by_element(monkeypatch):
    """An array whose elements are all fixed-size integers is read one struct
    an element; it decodes to what reading each element does, in every Fetch
    request version, and an element with a tagged field (read wrongly by a
    fixed layout) sends the whole array the element-by-element way."""
    from kafscale.protocol import codec

    body = {"replica_id": -1, "max_wait_ms": 500, "min_bytes": 1, "max_bytes": 2**20, "isolation_level": 0,
            "session_id": 0, "session_epoch": -1, "topics": [{"topic": "t", "topic_id": bytes(16), "partitions": [
                {"partition": p, "current_leader_epoch": 3, "fetch_offset": 2**40 + p, "last_fetched_epoch": -1,
                 "log_start_offset": -1, "partition_max_bytes": 2**20} for p in range(300)]}],
            "forgotten_topics_data": [], "rack_id": ""}
    msg = Message(parse_schema("""
    a: [
      b: int32
      c: int64 1+
      d: int8 1+ tag=0 default=5
    ]
    """), 1)
    tagged = bytes.fromhex("04" "00000001" "0000000000000002" "00" "00000003" "0000000000000004" "01" "00" "01" "09"
                           "00000005" "0000000000000006" "00" "00")
    requests = [(FETCH.request, v, b"".join(bytes(c) for c in FETCH.request.generic_encode(body, v).finish()))
                for v in range(FETCH.min_version, FETCH.max_version + 1)] + [(msg, 1, tagged)]
    real, read_fixed = codec._StructCodec.fixed_rows, []

    def fixed_rows(self, r, n):
        rows = real(self, r, n)
        read_fixed.append(rows is not None)
        return rows

    monkeypatch.setattr(codec._StructCodec, "fixed_rows", fixed_rows)
    fast = [m.decode(memoryview(data), v) for m, v, data in requests]
    assert read_fixed == [True] * (len(requests) - 1) + [False]
    assert fast[-1][0] == {"a": [{"b": 1, "c": 2, "d": 5}, {"b": 3, "c": 4, "d": 9}, {"b": 5, "c": 6, "d": 5}]}
    monkeypatch.setattr(codec._StructCodec, "fixed_rows", lambda self, r, n: None)
    assert fast == [m.decode(memoryview(data), v) for m, v, data in requests]
    assert fast[0][0]["topics"][0]["partitions"][299]["fetch_offset"] == 2**40 + 299


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x00", bytes.fromhex("0000000201"), bytes.fromhex("7fffffff")])
def test_truncated_bodies_raise_decode_error(data):
    with pytest.raises(DecodeError):
        METADATA.request.decode(memoryview(data), 1)


def test_every_api_version_round_trips_defaults():
    for api in APIS.values():
        for v in range(api.min_version, api.max_version + 1):
            for msg in (api.request, api.response):
                data = encode(msg, {}, v)
                decoded, end = msg.decode(memoryview(data), v)
                assert end == len(data), (api.name, v)
                assert encode(msg, decoded, v) == data, (api.name, v)


def test_response_decode_helper_round_trip():
    hdr = parse_request_header(memoryview(struct.pack(">hhih", 3, 12, 4, -1) + b"\x00"))[0]
    frame = b"".join(encode_response(hdr, {"brokers": [{"node_id": 1, "host": "h", "port": 1}], "topics": []}))
    corr, body = decode_response(3, 12, frame[4:])
    assert corr == 4 and body["brokers"][0]["host"] == "h"


def test_writer_keeps_small_writes_together():
    w = Writer()
    w.write(b"ab")
    w.write_big(b"cd")
    assert w.finish() == [b"abcd"]


def test_decoded_requests_carry_every_field():
    """Fields a version lacks decode to their defaults, so handlers can read any field."""
    from kafscale.protocol.schemas import OFFSET_COMMIT
    data = encode(OFFSET_COMMIT.request, {"group_id": "g", "topics": [
        {"name": "t", "partitions": [{"partition_index": 0, "committed_offset": 5}]}]}, 2)
    req, _ = OFFSET_COMMIT.request.decode(memoryview(data), 2)
    assert req["group_instance_id"] is None and req["generation_id_or_member_epoch"] == -1
    assert req["topics"][0]["partitions"][0]["committed_leader_epoch"] == -1


def test_negative_length_on_a_non_nullable_field_is_malformed():
    """CreateTopics v4 with topics of length -1 is a malformed request, not a
    None a handler trips over; nullable fields (Metadata topics) still take null."""
    body = struct.pack(">i", -1) + struct.pack(">i", 1000) + b"\x00"  # topics=-1, timeout_ms, validate_only
    with pytest.raises(DecodeError, match="non-nullable array topics"):
        CREATE_TOPICS.request.decode(memoryview(body), 4)
    md, _ = METADATA.request.decode(memoryview(struct.pack(">i", -1) + b"\x01" + b"\x00\x00"), 8)
    assert md["topics"] is None


def test_strict_encoding_refuses_what_would_be_lost():
    """The suite runs with KAFSCALE_STRICT_CODEC=1: a typo'd key or an error
    code the version cannot carry fails loudly instead of going out as 0."""
    from kafscale.protocol import codec
    from kafscale.protocol.schemas import HEARTBEAT

    assert codec.STRICT, "conftest turns strict encoding on"
    with pytest.raises(codec.EncodeError, match="eror_code"):
        HEARTBEAT.response.encode({"eror_code": 27}, 4)
    with pytest.raises(codec.EncodeError, match="version 6 has no error_code"):
        FETCH.response.encode({"error_code": 1, "responses": []}, 6)
    FETCH.response.encode({"error_code": 0, "throttle_time_ms": 0, "responses": []}, 6)  # default: fine
    with pytest.raises(codec.EncodeError, match="base_ofset"):  # natively encoded, checked all the same
        PRODUCE.response.encode({"responses": [{"name": "t", "partition_responses": [{"base_ofset": 3}]}]}, 9)


@pytest.mark.parametrize("schema, why", [
    ("a: int8\na: int16", "defined twice"),
    ("a: string 3-5 ?2", "outside its versions"),
    ("a: int8 0-3 tag=0", "non-flexible"),
    ("a: [ 1+\n]", "no fields"),
])
def test_schema_invariants_are_checked_at_load(schema, why):
    with pytest.raises(ValueError, match=why):
        Message(parse_schema(schema), 4)


def test_error_codes_are_in_numeric_order_and_know_which_are_retriable():
    from kafscale.protocol.errors import ErrorCode

    assert list(ErrorCode) == sorted(ErrorCode)
    assert ErrorCode.NOT_LEADER_OR_FOLLOWER.retriable and ErrorCode.REQUEST_TIMED_OUT.retriable
    assert not ErrorCode.TOPIC_AUTHORIZATION_FAILED.retriable and not ErrorCode.INVALID_RECORD.retriable


def test_a_nullable_struct_carries_a_marker_byte():
    """Kafka writes -1 before a null struct and 1 before a present one (DescribeTopicPartitions' cursor)."""
    from kafscale.protocol.schemas import DESCRIBE_TOPIC_PARTITIONS as DTP

    null = encode(DTP.request, {"topics": [{"name": "a"}], "response_partition_limit": 10, "cursor": None}, 0)
    assert null == bytes.fromhex("02" "0261" "00" "0000000a" "ff" "00")
    present = {"topics": [], "response_partition_limit": 5, "cursor": {"topic_name": "b", "partition_index": 7}}
    data = encode(DTP.request, present, 0)
    assert data == bytes.fromhex("01" "00000005" "01" "0262" "00000007" "00" "00")
    assert DTP.request.decode(memoryview(data), 0) == (present, len(data))


def _produce_bodies() -> list[dict]:
    return [
        {"transactional_id": None, "acks": -1, "timeout_ms": 30000,
         "topic_data": [{"name": "orders", "partition_data": [{"index": 7, "records": b"\x01" * 70}]}]},
        {"transactional_id": "tx-\u00e9", "acks": 0, "timeout_ms": 0,
         "topic_data": [{"name": "a", "partition_data": [{"index": 0, "records": None},
                                                         {"index": 2**31 - 1, "records": b""}]},
                        {"name": "b\u4e2d", "partition_data": []}]},
        {"transactional_id": "", "acks": 1, "timeout_ms": -5, "topic_data": []},
    ]


@pytest.mark.parametrize("version", range(PRODUCE.min_version, PRODUCE.max_version + 1))
def test_the_native_produce_decoder_decodes_what_the_schema_does(version):
    """Produce requests are decoded natively (kafscale/_native); the schema
    codec is the reference: the same dicts and ends for well-formed bodies,
    and for truncated and mutated ones the same dicts or a DecodeError from both."""
    rng = random.Random(version)

    def both(data: bytes, pos: int = 0):
        out = []
        for decode in (PRODUCE.request.decode, PRODUCE.request.generic_decode):
            try:
                out.append(decode(memoryview(data), version, pos))
            except DecodeError:
                out.append(DecodeError)
        return out

    for body in _produce_bodies():
        data = b"\xaa\xbb" + encode(PRODUCE.request, body, version)
        native, generic = both(data, 2)
        assert native == generic and native[1] == len(data)
        assert native[0]["topic_data"] == body["topic_data"] or body["topic_data"] == []
        for cut in range(2, len(data)):
            native, generic = both(data[:cut], 2)
            assert native == generic, cut
        for _ in range(300):
            mutated = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                mutated[rng.randrange(2, len(mutated))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
            native, generic = both(bytes(mutated), 2)
            assert native == generic, mutated.hex()


def test_the_native_produce_decoder_skips_tagged_fields_as_the_schema_does():
    body = encode(PRODUCE.request, _produce_bodies()[0], 9)
    # the same body with an unknown tagged field (tag 5, 3 bytes) after the top-level fields
    tagged = body[:-1] + bytes([1, 5, 3, 9, 9, 9])
    native = PRODUCE.request.decode(memoryview(tagged), 9)
    assert native == PRODUCE.request.generic_decode(memoryview(tagged), 9)
    assert native[1] == len(tagged)


def _produce_responses() -> list[dict]:
    part = {"index": 3, "error_code": 0, "base_offset": 2**40, "log_append_time_ms": -1, "log_start_offset": 7,
            "record_errors": [], "error_message": None}
    return [
        {"responses": [{"name": "orders", "partition_responses": [part]}], "throttle_time_ms": 0},
        {"responses": [{"name": "b\u4e2d", "partition_responses": [
            {**part, "error_code": 87, "base_offset": -1, "error_message": "bad \u00e9",
             "record_errors": [{"batch_index": 2, "batch_index_error_message": None},
                               {"batch_index": 0, "batch_index_error_message": "x"}]},
            {"index": 9, "error_code": 6, "base_offset": -1}]},  # fields left out: their defaults
            {"name": "c", "partition_responses": []}], "throttle_time_ms": 250},
        {"responses": [], "throttle_time_ms": 0},
        {},
    ]


@pytest.mark.parametrize("version", range(PRODUCE.min_version, PRODUCE.max_version + 1))
def test_the_native_produce_encoder_writes_what_the_schema_does(version):
    for body in _produce_responses():
        native = b"".join(bytes(c) for c in PRODUCE.response.encode(body, version).finish())
        generic = b"".join(bytes(c) for c in PRODUCE.response.generic_encode(body, version).finish())
        assert native == generic, body


def test_packed_metadata_partitions_are_the_schema_encoding_in_every_version():
    """topic_api.metadata_partitions writes exactly what the schema's encoder
    writes for the same partitions as dicts, in every Metadata version."""
    from kafscale.broker.topic_api import metadata_partitions

    leaders = [1, 7, 2**31 - 1, 3, 0] * 50

    def body(parts):
        return {"throttle_time_ms": 0, "brokers": [{"node_id": 1, "host": "h", "port": 9092, "rack": None}],
                "cluster_id": "c", "controller_id": 1, "topics": [
                    {"error_code": 0, "name": "t", "topic_id": bytes(16), "is_internal": False, "partitions": parts}]}

    dicts = [{"error_code": 0, "partition_index": p, "leader_id": leader, "leader_epoch": 0,
              "replica_nodes": [leader], "isr_nodes": [leader], "offline_replicas": []}
             for p, leader in enumerate(leaders)]
    for v in range(METADATA.min_version, METADATA.max_version + 1):
        want = b"".join(bytes(c) for c in METADATA.response.generic_encode(body(dicts), v).finish())
        got = b"".join(bytes(c) for c in METADATA.response.generic_encode(body(metadata_partitions(leaders, v)),
                                                                           v).finish())
        assert got == want, f"version {v}"
        assert METADATA.response.decode(memoryview(got), v)[0]["topics"][0]["partitions"][1]["leader_id"] == 7


def test_packed_fetch_partitions_are_the_schema_encoding_in_every_version():
    """framing.fetch_partitions writes exactly what the schema's encoder
    writes for the same partitions as dicts, in every Fetch version, its
    large records chunks by reference."""
    from kafscale.protocol.framing import fetch_partitions

    big = memoryview(bytes(range(256)) * 20)  # 5,120 bytes: kept by reference
    parts = [(0, 0, 10, 0, None), (1, 0, 2**40, 7, [b"abc"]), (2, 3, -1, -1, None),
             (2**31 - 1, 0, 0, 0, [big, b"x" * 200, big]), (5, 1, 9, 9, [b"y" * 5000])] * 20

    def body(parts):
        return {"throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": [
            {"topic": "t", "topic_id": bytes(16), "partitions": parts}]}

    dicts = [{"partition_index": p, "error_code": err, "high_watermark": hw, "last_stable_offset": hw,
              "log_start_offset": start, "aborted_transactions": None, "preferred_read_replica": -1,
              "records": records or b""} for p, err, hw, start, records in parts]
    for v in range(FETCH.min_version, FETCH.max_version + 1):
        want = b"".join(bytes(c) for c in FETCH.response.generic_encode(body(dicts), v).finish())
        chunks = FETCH.response.generic_encode(body(fetch_partitions(parts, v)), v).finish()
        assert b"".join(bytes(c) for c in chunks) == want, f"version {v}"
        assert sum(c is big for c in chunks) == 40, "records written without copying"
        decoded = FETCH.response.decode(memoryview(want), v)[0]["responses"][0]["partitions"]
        assert decoded[3]["records"] == bytes(big) + b"x" * 200 + bytes(big)
