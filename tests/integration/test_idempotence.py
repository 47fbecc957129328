"""Idempotent producers: InitProducerId, retried duplicates, sequence gaps."""
from __future__ import annotations

import struct

from kafscale import _native
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import INIT_PRODUCER_ID, PRODUCE
from tests.integration.clients import confluent_consume, create_topic
from tests.integration.rawclient import RawClient


def idempotent_batch(pid: int, epoch: int, seq: int, value: bytes) -> bytes:
    b = bytearray(_native.build_batch([(1000, b"k", value, [])]))
    struct.pack_into(">qhi", b, 43, pid, epoch, seq)
    struct.pack_into(">I", b, 17, _native.crc32c(bytes(b[21:])))
    return bytes(b)


def produce_body(topic: str, batch: bytes) -> dict:
    return {"acks": -1, "timeout_ms": 10000,
            "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": batch}]}]}


def test_duplicates_are_acked_once_durable_and_stored_once(broker, topic_name):
    create_topic(broker.bootstrap, topic_name)
    c = RawClient(broker.bootstrap)
    init = c.request(INIT_PRODUCER_ID.key, 4, {"transactional_id": None, "transaction_timeout_ms": 1000})
    assert init["error_code"] == 0 and init["producer_id"] > 0
    pid = init["producer_id"]
    assert c.request(INIT_PRODUCER_ID.key, 4, {"transactional_id": None, "transaction_timeout_ms": 1000})[
        "producer_id"] != pid

    # original and its retry pipelined on one connection: both answered with the same offset
    first = idempotent_batch(pid, 0, 0, b"first")
    c.send_bytes(encode_request(PRODUCE.key, 9, 101, produce_body(topic_name, first)) +
                 encode_request(PRODUCE.key, 9, 102, produce_body(topic_name, first)))
    answers = [decode_response(PRODUCE.key, 9, c.read_frame()) for _ in range(2)]
    parts = [a[1]["responses"][0]["partition_responses"][0] for a in answers]
    assert [(p["error_code"], p["base_offset"]) for p in parts] == [(0, 0), (0, 0)]

    second = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, 1, b"second")))
    assert second["responses"][0]["partition_responses"][0]["base_offset"] == 1
    retry = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, 1, b"second")))
    assert retry["responses"][0]["partition_responses"][0]["base_offset"] == 1

    gap = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, 5, b"gap")))
    assert gap["responses"][0]["partition_responses"][0]["error_code"] == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    c.close()
    assert [r.value for _, r in confluent_consume(broker.bootstrap, topic_name, 2)] == [b"first", b"second"]
    assert len(confluent_consume(broker.bootstrap, topic_name, 3, timeout=2)) == 2


def test_transactional_init_is_refused(broker):
    c = RawClient(broker.bootstrap)
    r = c.request(INIT_PRODUCER_ID.key, 4, {"transactional_id": "tx-1", "transaction_timeout_ms": 1000})
    assert r["error_code"] == ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    c.close()


def test_retry_after_an_owner_change_gets_its_original_offset(make_broker, topic_name):
    """A batch committed by an owner that died before acknowledging it is
    retried against the next owner: that owner must know the producer's
    sequences from what was committed, answer the original offset and store
    nothing twice."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    c = RawClient(b.bootstrap)
    pid = c.request(INIT_PRODUCER_ID.key, 4, {"transactional_id": None, "transaction_timeout_ms": 1000})[
        "producer_id"]
    for seq in (0, 1):
        r = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, seq, b"v%d" % seq)))
        assert r["responses"][0]["partition_responses"][0]["base_offset"] == seq
    c.close()
    b.kill()
    b.start()  # a new owner process, with a new epoch
    c = RawClient(b.bootstrap)
    for seq, value, offset in ((1, b"v1", 1), (0, b"v0", 0), (2, b"v2", 2)):  # two retries, then the next batch
        r = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, seq, value)))
        part = r["responses"][0]["partition_responses"][0]
        assert (part["error_code"], part["base_offset"]) == (0, offset), (seq, part)
    gap = c.request(PRODUCE.key, 9, produce_body(topic_name, idempotent_batch(pid, 0, 7, b"gap")))
    assert gap["responses"][0]["partition_responses"][0]["error_code"] == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    c.close()
    assert [r.value for _, r in confluent_consume(b.bootstrap, topic_name, 4, timeout=5)] == [b"v0", b"v1", b"v2"]
