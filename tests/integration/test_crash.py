"""Durability: a broker killed with SIGKILL loses nothing it acknowledged."""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer

from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.test_groups import wait_for
from tests.integration.test_topics_offsets import s3_keys


def test_sigkill_after_acks_loses_nothing(make_broker, topic_name):
    b = make_broker(linger_ms=2)
    create_topic(b.bootstrap, topic_name)
    acked: dict[int, bytes] = {}
    failed = 0
    stop = threading.Event()

    def produce() -> None:
        nonlocal failed
        p = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 1, "retries": 0,
                      "message.timeout.ms": 5000, "compression.type": "lz4"})

        def cb(err, msg) -> None:
            nonlocal failed
            if err is None:
                acked[msg.offset()] = msg.value()
            else:
                failed += 1

        i = 0
        while not stop.is_set():
            p.produce(topic_name, value=f"record-{i}".encode(), key=str(i).encode(), partition=0, on_delivery=cb)
            p.poll(0)
            i += 1
            if i % 50 == 0:
                time.sleep(0.005)
        p.flush(15)

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 30
    while len(acked) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)
    b.kill()  # mid-stream: acked records, and batches in flight that were never acked
    killed_with = dict(acked)
    b.start()
    stop.set()
    t.join()
    assert len(killed_with) >= 2000

    # Every record acked before the kill is there, at the offset it was acked with.
    hw = max(acked) + 1
    got = dict((o, r.value) for o, r in confluent_consume(b.bootstrap, topic_name, hw))
    for offset, value in killed_with.items():
        assert got.get(offset) == value, f"acked offset {offset} lost or changed"
    # Records acked after the restart are there too, and offsets are unique.
    for offset, value in acked.items():
        assert got.get(offset) == value
    assert sorted(got) == list(range(len(got)))


@pytest.mark.parametrize("node_flush", [False, True])
def test_leftover_of_a_crashed_owner_is_ignored_then_swept(make_broker, topic_name, stack, node_flush):
    """A crash between S3 upload and etcd commit (of a segment, or with node
    flushes of a compacted segment) leaves an object at the next base offset
    under the dead owner's epoch; the next owner writes under its own epoch,
    readers follow the manifests in etcd, and the next owner deletes the
    leftover (its writer can never commit it) while committed segments stay."""
    from kafscale.storage.segment import index_key, segment_key

    # shared compaction off: a partition this small would otherwise go into a shared object (whose
    # uncommitted leftovers the orphan sweep deletes: test_node_flush)
    b = make_broker(node_flush=str(node_flush).lower(), compaction_lag_ms=300, shared_compaction="false")
    create_topic(b.bootstrap, topic_name)
    first = [Rec(b"k", f"a{i}".encode()) for i in range(10)]
    assert confluent_produce(b.bootstrap, topic_name, first) == list(range(10))
    first_segment = segment_key(b.cluster, topic_name, 0, 0, 1)
    wait_for(lambda: first_segment in s3_keys(stack, f"{b.cluster}/"), 20, "the first segment")
    b.kill()
    s3 = stack.s3_client()
    leftover = segment_key(b.cluster, topic_name, 0, 10, 1)  # epoch 1: the killed broker's
    s3.put_object(Bucket=stack.bucket, Key=leftover, Body=b"uncommitted junk")
    s3.put_object(Bucket=stack.bucket, Key=index_key(leftover), Body=b"uncommitted junk")
    b.start()
    second = [Rec(b"k", f"b{i}".encode()) for i in range(10)]
    assert confluent_produce(b.bootstrap, topic_name, second) == list(range(10, 20))
    got = confluent_consume(b.bootstrap, topic_name, 20)
    assert [r for _, r in got] == first + second
    committed = [first_segment, segment_key(b.cluster, topic_name, 0, 10, 2)]
    wait_for(lambda: not {leftover, index_key(leftover)} & set(s3_keys(stack, f"{b.cluster}/")), 20,
             "the leftover to be deleted")
    wait_for(lambda: set(committed) <= set(s3_keys(stack, f"{b.cluster}/")), 20, "both segments")
    # segments of a few records have no .index object (segment.has_index)
    assert not {index_key(k) for k in committed} & set(s3_keys(stack, f"{b.cluster}/"))
