"""What real clients legally send must not lose or reorder acknowledged data:
each test here reproduces a defect a real client found."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.integration.clients import confluent_consume, create_topic
from tests.integration.foreign import build_go, node, run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def sarama_produce(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go("sarama_produce", tmp_path_factory.mktemp("go"))


def test_sarama_batches_survive_retention_and_are_found_by_time(make_broker, topic_name, sarama_produce):
    """Sarama leaves RecordBatch.MaxTimestamp at -1: the broker must store the
    records' largest timestamp, so retention (1 minute here) keeps the batch and
    ListOffsets by time finds it."""
    b = make_broker(retention_check_ms=200)
    create_topic(b.bootstrap, topic_name, config={"retention.ms": "60000"})
    before = int(time.time() * 1000) - 1000
    assert run(sarama_produce, b.bootstrap, topic_name, "50").strip() == "acked 50"
    time.sleep(1.5)  # several retention passes
    got = confluent_consume(b.bootstrap, topic_name, 50, timeout=30)
    assert [o for o, _ in got] == list(range(50))
    assert [r.value for _, r in got] == [b"sarama-%d" % i for i in range(50)]
    assert "retention removed" not in b.log()
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "by-time"})
    try:
        [tp] = c.offsets_for_times([TopicPartition(topic_name, 0, before)], timeout=10)
        assert tp.offset == 0
        [tp] = c.offsets_for_times([TopicPartition(topic_name, 0, -3)], timeout=10)  # max timestamp (KIP-734)
        assert 0 <= tp.offset < 50
    finally:
        c.close()


def test_two_platformatic_idempotent_producers_keep_all_records(make_broker, topic_name):
    """@platformatic/kafka sends InitProducerId with producer id 0, epoch 0 and
    no transactional id: each producer must get an id of its own, or the second
    one's batches pass for retries of the first one's and are dropped."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    assert node("platformatic_idempotent.mjs", b.bootstrap, topic_name, "200").strip() == "acked 400"
    got = confluent_consume(b.bootstrap, topic_name, 400, timeout=30)
    assert len(got) == 400
    values = sorted(r.value for _, r in got)
    assert values == sorted(f"p{i}-{k}".encode() for i in range(2) for k in range(200))
