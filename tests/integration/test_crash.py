"""Durability: a broker killed with SIGKILL loses nothing it acknowledged."""
from __future__ import annotations

import threading
import time

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


def test_leftover_of_a_crashed_owner_is_ignored(make_broker, topic_name, stack):
    """A crash between S3 upload and etcd commit leaves an object at the next
    base offset under the dead owner's epoch; the next owner writes under its
    own epoch, and readers follow the manifests in etcd."""

    from kafscale.storage.segment import segment_key
    from tests.integration.clients import Rec, confluent_produce

    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    first = [Rec(b"k", f"a{i}".encode()) for i in range(10)]
    assert confluent_produce(b.bootstrap, topic_name, first) == list(range(10))
    b.kill()
    s3 = stack.s3_client()
    leftover = segment_key(b.cluster, topic_name, 0, 10, 1)  # epoch 1: the killed broker's
    s3.put_object(Bucket=stack.bucket, Key=leftover, Body=b"uncommitted junk")
    b.start()
    second = [Rec(b"k", f"b{i}".encode()) for i in range(10)]
    assert confluent_produce(b.bootstrap, topic_name, second) == list(range(10, 20))
    got = confluent_consume(b.bootstrap, topic_name, 20)
    assert [r for _, r in got] == first + second
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=stack.bucket, Prefix=f"{b.cluster}/")["Contents"]]
    assert leftover in keys and segment_key(b.cluster, topic_name, 0, 10, 2) in keys


def test_objects_uploaded_but_never_committed_are_swept(make_broker, topic_name, stack):
    """An owner that dies between uploading a segment and committing it leaves
    objects no manifest names. The next owner deletes those of older epochs;
    committed segments stay."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    confluent_produce(b.bootstrap, topic_name, [Rec(b"k", b"committed")])
    prefix = f"{b.cluster}/{topic_name}/0/"
    committed = s3_keys(stack, prefix)
    assert len(committed) == 2  # the segment and its index
    b.kill()
    # what the dead owner (epoch 1) uploaded for its next flush, base offset 1, without committing it
    s3 = stack.s3_client()
    orphans = [f"{prefix}segment-{1:020d}-{1:010d}.kfs", f"{prefix}segment-{1:020d}-{1:010d}.index"]
    for key in orphans:
        s3.put_object(Bucket=stack.bucket, Key=key, Body=b"never committed")
    b.start()
    confluent_produce(b.bootstrap, topic_name, [Rec(b"k", b"after restart")])  # the new owner opens the log
    wait_for(lambda: not set(orphans) & set(s3_keys(stack, prefix)), 20, "the orphans to be deleted")
    assert set(committed) <= set(s3_keys(stack, prefix))
    assert [r.value for _, r in confluent_consume(b.bootstrap, topic_name, 2)] == [b"committed", b"after restart"]
