"""Incremental fetch sessions (KIP-227) on a real broker: the protocol flow
byte for byte with a raw client (by topic name and by topic id), and
kafka-python, which uses sessions, consuming a topic of many partitions
through them, with sessions switched off, and through the proxy."""
from __future__ import annotations

import pytest

from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import FETCH, METADATA
from tests.integration.clients import create_topic
from tests.integration.rawclient import RawClient
from tests.integration.test_groups import wait_for
from tests.integration.test_node_flush import produce_confluent
from tests.integration.test_observability import get, samples, total


def produce(bootstrap: str, topic: str, values: dict[int, list[bytes]]) -> None:
    """Each partition's values, in order, acks=all."""
    produce_confluent(bootstrap, topic, [(p, v) for p, vals in values.items() for v in vals])


def fetch(c: RawClient, version: int, session_id: int, epoch: int, topic: str | bytes,
          parts: dict[int, int], forgotten: tuple[int, ...] = ()) -> dict:
    key = "topic_id" if version >= 13 else "topic"
    body = {"max_wait_ms": 0, "min_bytes": 0, "max_bytes": 1 << 20, "session_id": session_id, "session_epoch": epoch,
            "topics": [{key: topic, "partitions": [{"partition": p, "fetch_offset": o, "partition_max_bytes": 1 << 20}
                                                   for p, o in parts.items()]}] if parts else [],
            "forgotten_topics_data": [{key: topic, "partitions": list(forgotten)}] if forgotten else []}
    return c.request(FETCH.key, version, body)


def answered(resp: dict) -> dict[int, tuple[int, int]]:
    """partition -> (high watermark, record bytes) of every partition the answer holds."""
    return {p["partition_index"]: (p["high_watermark"], len(p["records"] or b""))
            for t in resp["responses"] for p in t["partitions"]}


@pytest.mark.parametrize("version", [12, 16])
def test_a_session_answers_only_what_changed_and_refuses_out_of_turn_fetches(broker, topic_name, version):
    create_topic(broker.bootstrap, topic_name, partitions=3)
    produce(broker.bootstrap, topic_name, {0: [b"first"]})
    c = RawClient(broker.bootstrap)
    topic: str | bytes = topic_name
    if version >= 13:
        topic = c.request(METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}]}
                          )["topics"][0]["topic_id"]

    resp = fetch(c, version, 0, 0, topic, {0: 0, 1: 0, 2: 0})  # begins a session: every partition answered
    sid = resp["session_id"]
    assert resp["error_code"] == 0 and sid != 0
    got = answered(resp)
    assert set(got) == {0, 1, 2} and got[0][0] == 1 and got[0][1] > 0 and got[1] == got[2] == (0, 0)

    resp = fetch(c, version, sid, 1, topic, {0: 1})  # partition 0's position moved; nothing new anywhere
    assert (resp["error_code"], resp["session_id"], answered(resp)) == (0, sid, {})

    produce(broker.bootstrap, topic_name, {2: [b"second"]})
    wait_for(lambda: answered(fetch(c, version, 0, -1, topic, {2: 0})).get(2, (0,))[0] == 1, 10,
             "the record on partition 2 (sessionless fetches leave the session alone)")
    resp = fetch(c, version, sid, 2, topic, {})  # names nothing: the session's positions are used
    got = answered(resp)
    assert set(got) == {2} and got[2][0] == 1 and got[2][1] > 0

    assert fetch(c, version, sid, 2, topic, {})["error_code"] == ErrorCode.INVALID_FETCH_SESSION_EPOCH
    assert fetch(c, version, sid ^ 1, 3, topic, {})["error_code"] == ErrorCode.FETCH_SESSION_ID_NOT_FOUND

    resp = fetch(c, version, sid, 3, topic, {2: 1}, forgotten=(1,))  # forgets partition 1
    assert (resp["error_code"], answered(resp)) == (0, {})
    produce(broker.bootstrap, topic_name, {1: [b"third"]})
    wait_for(lambda: answered(fetch(c, version, 0, -1, topic, {1: 0})).get(1, (0,))[0] == 1, 10, "partition 1")
    assert answered(fetch(c, version, sid, 4, topic, {})) == {}, "a forgotten partition is not fetched"

    resp = fetch(c, version, sid, -1, topic, {0: 1})  # a full fetch naming the session ends it
    assert resp["session_id"] == 0 and set(answered(resp)) == {0}
    assert fetch(c, version, sid, 5, topic, {})["error_code"] == ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    c.close()


class KafkaPythonReader:
    """kafka-python (which uses fetch sessions) reading every partition of a topic from the start."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                      auto_offset_reset="earliest")
        self.consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        self.consumer.seek_to_beginning()
        self.got: dict[int, list[tuple[int, bytes]]] = {}

    def read(self, n: int) -> dict[int, list[tuple[int, bytes]]]:
        """Everything read so far, once that is n records."""
        def polled() -> bool:
            for tp, msgs in self.consumer.poll(timeout_ms=500).items():
                self.got.setdefault(tp.partition, []).extend((m.offset, m.value) for m in msgs)
            return sum(map(len, self.got.values())) >= n

        wait_for(polled, 60, f"{n} records")
        return self.got


def fetch_kinds(b) -> dict[str, float]:
    smp = samples(get(f"http://{b.config['admin_listen']}/metrics")[1])
    return {k: total(smp, "kafscale_fetch_requests_total", kind=k) for k in ("sessionless", "full", "incremental")}


@pytest.mark.parametrize("slots", [1000, 0])
def test_kafka_python_consumes_many_partitions_through_a_session(make_broker, topic_name, slots):
    """Every record once, in order, whether the broker keeps sessions or not;
    with sessions, the records written after the first read come through
    incremental fetches."""
    partitions = 200
    b = make_broker(fetch_session_slots=slots)
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    sent = {p: [b"%d-%d" % (p, i) for i in range(3)] for p in range(partitions)}
    produce(b.bootstrap, topic_name, sent)
    reader = KafkaPythonReader(b.bootstrap, topic_name, partitions)
    try:
        reader.read(3 * partitions)
        more = {p: [b"%d-more" % p] for p in range(0, partitions, 20)}
        produce(b.bootstrap, topic_name, more)
        got = reader.read(3 * partitions + len(more))
    finally:
        reader.consumer.close()
    assert got == {p: list(enumerate(sent[p] + more.get(p, []))) for p in range(partitions)}
    kinds: dict[str, float] = {}

    def counted() -> bool:  # the workers' counters reach the metrics files within 0.1 s
        kinds.update(fetch_kinds(b))
        return kinds["incremental" if slots else "sessionless"] > 0

    wait_for(counted, 10, "the Fetch requests counted")
    if slots:
        assert kinds["full"] >= 1 and kinds["sessionless"] == 0, kinds
    else:  # asked for a session every time, answered without one every time
        assert kinds["full"] == kinds["incremental"] == 0, kinds


def test_kafka_python_through_the_proxy_fetches_without_sessions(make_cluster, topic_name):
    """The proxy answers without a session and asks each broker for its share
    without one: a session of a broker would only know part of the client's
    partitions."""
    *brokers, proxy = make_cluster(2, proxy=True)
    create_topic(proxy.bootstrap, topic_name, partitions=8)
    sent = {p: [b"%d-%d" % (p, i) for i in range(3)] for p in range(8)}
    produce(proxy.bootstrap, topic_name, sent)
    reader = KafkaPythonReader(proxy.bootstrap, topic_name, 8)
    try:
        got = reader.read(24)
    finally:
        reader.consumer.close()
    assert got == {p: list(enumerate(vals)) for p, vals in sent.items()}
    kinds: list[dict[str, float]] = []

    def counted() -> bool:
        kinds[:] = [fetch_kinds(b) for b in brokers]
        return sum(k["sessionless"] for k in kinds) > 0

    wait_for(counted, 10, "the brokers' Fetch requests counted")
    assert all(k["full"] == k["incremental"] == 0 for k in kinds), kinds
