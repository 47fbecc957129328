"""Retention: old segments leave S3 and etcd, the log start offset moves, and
consumers below it get OFFSET_OUT_OF_RANGE and follow auto.offset.reset."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kafscale.protocol.errors import ErrorCode
from kafscale.storage.wal import shared_prefix
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.rawclient import RawClient
from tests.integration.test_groups import wait_for
from tests.integration.test_topics_offsets import etcd_keys, fetch_raw, s3_keys


def produce_segments(bootstrap: str, topic: str, n: int, size: int = 10_000, ts: int | None = None) -> None:
    """n separate flushes (one segment each)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for i in range(n):
        p.produce(topic, value=bytes([i % 256]) * size, key=b"%d" % i, partition=0,
                  timestamp=ts or 0)
        assert p.flush(10) == 0


def wait_for_log_start(bootstrap: str, topic: str, at_least: int, timeout: float = 30) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "retention-probe"})
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            lo, _ = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
            if lo >= at_least:
                return lo
            time.sleep(0.2)
    finally:
        c.close()
    raise AssertionError(f"log start offset did not reach {at_least}")


@pytest.mark.parametrize("node_flush", [False, True])
def test_retention_bytes(make_broker, topic_name, stack, node_flush):
    """With node flushes, slices and the segments compacted from them (one each:
    segment.bytes is about one record, and merges stay within it) go alike."""
    b = make_broker(retention_check_ms=300, node_flush=str(node_flush).lower(), compaction_lag_ms=300,
                    delete_delay_ms=2000)
    create_topic(b.bootstrap, topic_name, config={"retention.bytes": "35000", "segment.bytes": "10000"})
    produce_segments(b.bootstrap, topic_name, 10)  # ~10 KiB each
    # 3 segments (~30 KB) fit in 35 KB, 4 do not; wait for the pass that saw all 10
    # (an earlier pass, while they were still being produced, may have stopped at 6)
    lo = wait_for_log_start(b.bootstrap, topic_name, 7)
    assert lo == 7
    # the log start moves first; the segments below it are deleted right after (with node flushes each
    # is in a shared object of its own, which the collector deletes delete_delay_ms after forgetting it)
    objects = shared_prefix(b.cluster) if node_flush else f"{b.cluster}/{topic_name}/0/"
    wait_for(lambda: len(s3_keys(stack, objects)) == 10 - lo, 30,
             "the segments below the log start to be deleted from S3")
    wait_for(lambda: len(etcd_keys(stack, f"/kafscale/{b.cluster}/segments/{topic_name}/0/")) == 10 - lo, 30,
             "the manifests of the segments below the log start to go")
    # below the log start: OFFSET_OUT_OF_RANGE; a consumer with auto.offset.reset=earliest lands on lo
    c = RawClient(b.bootstrap)
    assert fetch_raw(c, topic_name, 0, 0)["error_code"] == ErrorCode.OFFSET_OUT_OF_RANGE
    assert fetch_raw(c, topic_name, 0, 0)["log_start_offset"] == lo
    c.close()
    consumer = Consumer({"bootstrap.servers": b.bootstrap, "group.id": f"g-{topic_name}",
                         "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(topic_name, 0, 0)])  # explicitly below the log start
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 10 - lo and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            got.append(m.offset())
    consumer.close()
    assert got == list(range(lo, 10))


def test_retention_ms(make_broker, topic_name):
    b = make_broker(retention_check_ms=300)
    create_topic(b.bootstrap, topic_name, config={"retention.ms": "3600000"})
    two_hours_ago = int(time.time() * 1000) - 2 * 3600 * 1000
    produce_segments(b.bootstrap, topic_name, 3, size=100, ts=two_hours_ago)
    confluent_produce(b.bootstrap, topic_name, [Rec(b"fresh", b"stays")])
    assert wait_for_log_start(b.bootstrap, topic_name, 3) == 3
    assert confluent_consume(b.bootstrap, topic_name, 1, start=3) == [(3, Rec(b"fresh", b"stays"))]


def test_retention_opens_no_partition_never_written(make_broker, topic_name, stack):
    """The retention pass reaches the partitions ever claimed and no other: of
    a topic of 1,000 partitions written in partition 0 only, it expires
    partition 0's old records and claims none of the 999 others."""
    b = make_broker(retention_check_ms=300)
    create_topic(b.bootstrap, topic_name, partitions=1000, config={"retention.ms": "3600000"})
    produce_segments(b.bootstrap, topic_name, 3, size=100, ts=int(time.time() * 1000) - 2 * 3600 * 1000)
    assert wait_for_log_start(b.bootstrap, topic_name, 3) == 3
    time.sleep(2)  # several more passes
    for area in ("partitions", "owners"):
        assert etcd_keys(stack, f"/kafscale/{b.cluster}/{area}/{topic_name}/") == [
            f"/kafscale/{b.cluster}/{area}/{topic_name}/0".encode()]
