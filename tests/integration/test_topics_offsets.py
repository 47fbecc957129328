"""Topics (create/delete/auto-create), ListOffsets, Fetch semantics, reads
straight from S3, and the segments CLI."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import aetcd
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kafscale import _native
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import CREATE_TOPICS, FETCH, LIST_OFFSETS, METADATA, PRODUCE
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic, sample_records
from tests.integration.rawclient import RawClient
from tests.integration.test_groups import wait_for


def s3_keys(stack, prefix: str) -> list[str]:
    return [o["Key"] for o in stack.s3_client().list_objects_v2(Bucket=stack.bucket, Prefix=prefix).get("Contents", [])]


def etcd_keys(stack, prefix: str) -> list[bytes]:
    async def run() -> list[bytes]:
        host, port = stack.etcd_endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port)) as c:
            return [kv.key for kv in await c.get_prefix(prefix.encode())]
    return asyncio.run(run())


def etcd_requests(stack, method: str) -> int:
    """How many requests of one gRPC method (Range, Txn, ...) etcd has handled, from its own /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://{stack.etcd_endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{") and f'grpc_method="{method}"' in line)


def create_raw(c: RawClient, name: str, partitions: int = 1, rf: int = -1, configs=(), validate_only=False):
    body = {"topics": [{"name": name, "num_partitions": partitions, "replication_factor": rf, "assignments": [],
                        "configs": [{"name": k, "value": v} for k, v in configs]}],
            "timeout_ms": 5000, "validate_only": validate_only}
    return c.request(CREATE_TOPICS.key, 7, body)["topics"][0]


def test_create_topic_errors(make_broker, topic_name):
    b = make_broker()
    c = RawClient(b.bootstrap)
    assert create_raw(c, "bad/name")["error_code"] == ErrorCode.INVALID_TOPIC_EXCEPTION
    assert create_raw(c, "x" * 250)["error_code"] == ErrorCode.INVALID_TOPIC_EXCEPTION
    assert create_raw(c, topic_name, partitions=0)["error_code"] == ErrorCode.INVALID_PARTITIONS
    assert create_raw(c, topic_name, rf=0)["error_code"] == ErrorCode.INVALID_REPLICATION_FACTOR
    assert create_raw(c, topic_name, configs=[("no.such.config", "1")])["error_code"] == ErrorCode.INVALID_CONFIG
    assert create_raw(c, topic_name, validate_only=True)["error_code"] == 0
    r = create_raw(c, topic_name, partitions=3, configs=[("retention.ms", "60000")])
    assert r["error_code"] == 0 and r["num_partitions"] == 3 and r["topic_id"] != bytes(16)
    assert create_raw(c, topic_name)["error_code"] == ErrorCode.TOPIC_ALREADY_EXISTS
    c.close()
    md = AdminClient({"bootstrap.servers": b.bootstrap}).list_topics(timeout=10)
    assert len(md.topics[topic_name].partitions) == 3


def test_delete_topic_removes_objects_and_keys(make_broker, topic_name, stack):
    """Its segments and keys at once; the node objects and shared segment objects
    that held its records once they hold nothing else."""
    b = make_broker(compaction_lag_ms=300)
    create_topic(b.bootstrap, topic_name, partitions=2)
    confluent_produce(b.bootstrap, topic_name, sample_records(20, "a"), partition=0)
    confluent_produce(b.bootstrap, topic_name, sample_records(20, "b"), partition=1)
    assert etcd_keys(stack, f"/kafscale/{b.cluster}/wal/")  # in node objects first
    wait_for(lambda: len(etcd_keys(stack, f"/kafscale/{b.cluster}/segments/{topic_name}/")) == 2, 30,
             "compaction into a segment per partition")
    confluent_produce(b.bootstrap, topic_name, sample_records(5, "c"), partition=0)  # and some not compacted
    assert any(topic_name.encode() in k for k in etcd_keys(stack, f"/kafscale/{b.cluster}/"))
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    admin.delete_topics([topic_name])[topic_name].result(30)
    assert s3_keys(stack, f"{b.cluster}/{topic_name}/") == []
    assert not any(topic_name.encode() in k for k in etcd_keys(stack, f"/kafscale/{b.cluster}/"))
    for area in ("wal", "shared"):  # node objects, and a shared object the two partitions' segments went to
        wait_for(lambda a=area: not etcd_keys(stack, f"/kafscale/{b.cluster}/{a}/"), 30, f"the {area} objects to be "
                 "forgotten")
    assert topic_name not in admin.list_topics(timeout=10).topics
    # the name can be reused and starts again at offset 0 with only new data
    create_topic(b.bootstrap, topic_name)
    fresh = [Rec(b"new", b"life")]
    assert confluent_produce(b.bootstrap, topic_name, fresh) == [0]
    assert confluent_consume(b.bootstrap, topic_name, 1) == [(0, fresh[0])]


def test_auto_create_only_when_enabled(make_broker, topic_name):
    off = make_broker()
    from confluent_kafka import KafkaException, Producer
    p = Producer({"bootstrap.servers": off.bootstrap, "message.timeout.ms": 3000})
    errs = []
    p.produce(topic_name, b"v", on_delivery=lambda err, msg: errs.append(err))
    p.flush(10)
    assert errs and errs[0] is not None, "produce to an unknown topic must fail without auto-create"
    with pytest.raises(KafkaException):
        create_topic(off.bootstrap, "bad name")
    on = make_broker(auto_create_topics="true")
    assert confluent_produce(on.bootstrap, topic_name, [Rec(b"k", b"v")]) == [0]


def test_list_offsets(broker, topic_name):
    create_topic(broker.bootstrap, topic_name)
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 0})
    base = 1_700_000_000_000
    for i in range(10):
        p.produce(topic_name, value=f"v{i}".encode(), partition=0, timestamp=base + i * 1000)
        p.flush(10)  # one batch (and segment) each, so lookups cross segments
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "lo"})
    lo, hi = c.get_watermark_offsets(TopicPartition(topic_name, 0), timeout=10)
    assert (lo, hi) == (0, 10)
    found = c.offsets_for_times([TopicPartition(topic_name, 0, base + 4500)], timeout=10)
    assert found[0].offset == 5
    found = c.offsets_for_times([TopicPartition(topic_name, 0, base + 99_000)], timeout=10)
    assert found[0].offset == -1  # nothing that late: end of log
    c.close()
    raw = RawClient(broker.bootstrap)

    def query(ts: int, version: int = 7) -> dict:
        body = {"replica_id": -1, "topics": [{"name": topic_name, "partitions": [{"partition_index": 0,
                                                                                   "timestamp": ts}]}]}
        return raw.request(LIST_OFFSETS.key, version, body)["topics"][0]["partitions"][0]

    assert query(-3)["offset"] == 9 and query(-3)["timestamp"] == base + 9000  # max timestamp
    assert query(base)["offset"] == 0
    assert query(-2, 0)["old_style_offsets"] == [0]
    raw.close()


def fetch_raw(c: RawClient, topic: str, offset: int, max_wait_ms: int, min_bytes: int = 1,
              partition_max_bytes: int = 1 << 20) -> dict:
    body = {"max_wait_ms": max_wait_ms, "min_bytes": min_bytes, "max_bytes": 1 << 24, "isolation_level": 0,
            "topics": [{"topic": topic, "partitions": [{"partition": 0, "fetch_offset": offset,
                                                         "partition_max_bytes": partition_max_bytes}]}]}
    return c.request(FETCH.key, 11, body)["responses"][0]["partitions"][0]


def test_fetch_long_poll_and_limits(broker, topic_name):
    create_topic(broker.bootstrap, topic_name)
    c = RawClient(broker.bootstrap, timeout=30)
    t0 = time.monotonic()
    r = fetch_raw(c, topic_name, 0, max_wait_ms=1500)
    waited = time.monotonic() - t0
    assert r["error_code"] == 0 and r["high_watermark"] == 0 and len(r["records"]) == 0
    assert waited >= 1.4, "an empty fetch waits for max_wait_ms"

    # a waiting fetch is woken by a produce instead of sleeping out max_wait_ms
    result = {}
    t = threading.Thread(target=lambda: result.update(fetch_raw(c, topic_name, 0, max_wait_ms=20_000)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", b"wake up")])
    t.join(30)
    assert time.monotonic() - t0 < 15 and result["high_watermark"] == 1
    batches = _native.scan_batches(bytes(result["records"]))
    assert batches[0].base_offset == 0

    # partition_max_bytes: whole batches only, but always at least one
    for i in range(5):
        confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", bytes([65 + i]) * 1000)])
    r = fetch_raw(c, topic_name, 1, 0, partition_max_bytes=10)
    assert [b.base_offset for b in _native.scan_batches(bytes(r["records"]))] == [1]
    r = fetch_raw(c, topic_name, 1, 0, partition_max_bytes=1 << 20)
    assert [b.base_offset for b in _native.scan_batches(bytes(r["records"]))] == [1, 2, 3, 4, 5]
    # out of range
    assert fetch_raw(c, topic_name, 99, 0)["error_code"] == ErrorCode.OFFSET_OUT_OF_RANGE
    c.close()


def test_reads_from_s3_with_no_cache(make_broker, topic_name):
    """cache_bytes=0: every Fetch is an index lookup plus a ranged S3 GET."""
    b = make_broker(cache_bytes=0, linger_ms=30)
    create_topic(b.bootstrap, topic_name)
    sent = [Rec(f"k{i}".encode(), os.urandom(2000)) for i in range(3000)]  # ~6 MB, several 64 KiB index steps
    offsets = confluent_produce(b.bootstrap, topic_name, sent, "none")
    got = confluent_consume(b.bootstrap, topic_name, len(sent))
    assert [o for o, _ in got] == offsets and [r for _, r in got] == sent
    # start in the middle of a big segment: the index narrows the ranged read
    mid = confluent_consume(b.bootstrap, topic_name, 100, start=2500)
    assert [o for o, _ in mid] == list(range(2500, 2600)) and [r for _, r in mid] == sent[2500:2600]


def test_pipelined_produces_append_in_send_order(make_broker, topic_name):
    """Produces pipelined on one connection are appended in the order sent, even
    when the first one has to wait for the partition to be opened (as in Kafka,
    which handles a connection's requests one at a time)."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    c = RawClient(b.bootstrap)
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    for corr, n in enumerate(sizes):
        batch = _native.build_batch([(1000, f"{corr}-{i}".encode(), b"v", []) for i in range(n)])
        body = {"acks": -1, "timeout_ms": 10000,
                "topic_data": [{"name": topic_name, "partition_data": [{"index": 0, "records": batch}]}]}
        c.send_bytes(encode_request(PRODUCE.key, 9, corr, body))
        time.sleep(0.002)  # spread them over the broker's topic and partition lookups
    bases = []
    for corr in range(len(sizes)):
        frame = c.read_frame()
        assert frame is not None
        got_corr, resp = decode_response(PRODUCE.key, 9, frame)
        assert got_corr == corr
        bases.append(resp["responses"][0]["partition_responses"][0]["base_offset"])
    c.close()
    assert bases == [sum(sizes[:i]) for i in range(len(sizes))]


def test_produces_sent_at_once_are_answered_each_in_order(make_broker, topic_name):
    """Produces a connection sends at once reach the log process together
    (one call from the worker): each is still answered on its own, in order,
    with its own offsets or error; acks=0 ones get no response, and a
    request with a shorter timeout_ms in between changes nothing."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name, partitions=2)
    c = RawClient(b.bootstrap)
    plan = [(0, -1, 10000), (1, -1, 10000), (0, 0, 10000), (7, -1, 10000), (0, 1, 500), (1, -1, 10000),
            (0, -1, 10000)]  # (partition, acks, timeout_ms); partition 7 does not exist
    frames = b""
    for corr, (p, acks, timeout_ms) in enumerate(plan):
        batch = _native.build_batch([(1000, f"{corr}".encode(), b"v", [])])
        body = {"acks": acks, "timeout_ms": timeout_ms,
                "topic_data": [{"name": topic_name, "partition_data": [{"index": p, "records": batch}]}]}
        frames += encode_request(PRODUCE.key, 9, corr, body)
    c.send_bytes(frames)
    got = {}
    for _ in range(len(plan) - 1):  # every one but the acks=0 one
        frame = c.read_frame()
        assert frame is not None
        corr, resp = decode_response(PRODUCE.key, 9, frame)
        r = resp["responses"][0]["partition_responses"][0]
        got[corr] = (r["error_code"], r["base_offset"])
    c.close()
    assert list(got) == [0, 1, 3, 4, 5, 6], "answered in the order sent, the acks=0 one not at all"
    assert got[3][0] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    assert {k: v for k, v in got.items() if k != 3} == {0: (0, 0), 1: (0, 0), 4: (0, 2), 5: (0, 1), 6: (0, 3)}


def test_restart_serves_from_s3(make_broker, topic_name):
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    sent = sample_records(200, "restart")
    offsets = confluent_produce(b.bootstrap, topic_name, sent, "gzip")
    b.stop()
    b.start()
    got = confluent_consume(b.bootstrap, topic_name, len(sent))
    assert [o for o, _ in got] == offsets and [r for _, r in got] == sent


def segments_cli(b, *args: str) -> str:
    """The output of `kafscale segments ARGS` against broker b's bucket."""
    r = subprocess.run([sys.executable, "-m", "kafscale.cli", "segments", *args], env=b.env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_segments_cli(make_broker, topic_name):
    """`kafscale segments ls|dump` show a record in its node object slice, then
    in the .kfs segment it is compacted into (shared compaction off; the test
    below shows segments in a shared object)."""
    b = make_broker(compaction_lag_ms=1000, shared_compaction="false")
    create_topic(b.bootstrap, topic_name)
    big = b"compressible " * 50  # librdkafka sends batches that do not shrink uncompressed
    confluent_produce(b.bootstrap, topic_name, [Rec(b"key-1", b"value-1", (("h", b"x"),)), Rec(None, big)], "zstd")

    def segments(*args: str) -> str:
        return segments_cli(b, *args)

    def dumped(key: str) -> None:
        out = segments("dump", "--key", key)
        assert 'offset=0' in out and 'key="key-1" value="value-1" headers=h="x"' in out
        assert 'offset=1' in out and 'key=null value="compressible compressible' in out
        assert "codec zstd" in out

    keys = [line.split()[-1] for line in segments("ls", "--topic", topic_name).splitlines()[1:]]
    if keys[0].endswith(".kfn#0"):  # not compacted yet: a slice of a node object
        dumped(keys[0])
        deadline = time.monotonic() + 30
        while not keys[0].endswith(".kfs"):
            assert time.monotonic() < deadline, "the slice was not compacted"
            time.sleep(0.5)
            keys = [line.split()[-1] for line in segments("ls", "--topic", topic_name).splitlines()[1:]]
    assert keys[0].endswith("segment-00000000000000000000-0000000001.kfs")
    dumped(keys[0])


def test_segments_cli_shows_small_partitions_compacted_into_one_shared_object(make_broker, topic_name):
    """Four partitions written in one Produce request fall due for compaction
    together: their segments share one object, which `segments ls` lists
    (KEY#POS per partition) and `segments dump` decodes."""
    b = make_broker(compaction_lag_ms=1000)
    create_topic(b.bootstrap, topic_name, partitions=4)
    p = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 200})
    for part in range(4):
        p.produce(topic_name, value=b"in partition %d" % part, partition=part)
    assert p.flush(30) == 0
    deadline = time.monotonic() + 30
    while len(keys := [line.split()[-1] for line in segments_cli(b, "ls", "--topic", topic_name).splitlines()[1:]
                       if "/~shared/" in line]) < 4:
        assert time.monotonic() < deadline, "the partitions were not compacted into a shared object"
        time.sleep(0.5)
    assert len({k.partition("#")[0] for k in keys}) == 1, keys
    dumped = {segments_cli(b, "dump", "--key", k).split('value="')[1].split('"')[0] for k in keys}
    assert dumped == {f"in partition {part}" for part in range(4)}
    assert [confluent_consume(b.bootstrap, topic_name, 1, partition=part)[0][1].value for part in range(4)] == [
        b"in partition %d" % part for part in range(4)]


def test_topics_of_ten_thousand_partitions(broker, topic_name, stack):
    """CreateTopics, CreatePartitions and DeleteTopics take one etcd operation
    whatever the partition count (partition keys are written by their first
    claim): 10,000 partitions are created, listed, grown, used and deleted."""
    from confluent_kafka.admin import NewPartitions

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic_name, num_partitions=9_000)])[topic_name].result(60)
    admin.create_partitions([NewPartitions(topic_name, 10_000)])[topic_name].result(60)
    md = admin.list_topics(topic_name, timeout=30)
    assert len(md.topics[topic_name].partitions) == 10_000
    for p in (0, 9_999):
        assert confluent_produce(broker.bootstrap, topic_name, [Rec(None, b"p%d" % p)], partition=p) == [0]
    assert len(etcd_keys(stack, f"/kafscale/{broker.cluster}/partitions/{topic_name}/")) == 2  # only those used
    # one OffsetCommit of 1,000 partitions (etcd takes at most 128 operations per transaction)
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"{topic_name}-wide"})
    c.commit(offsets=[TopicPartition(topic_name, p, p) for p in range(1_000)], asynchronous=False)
    assert [tp.offset for tp in c.committed([TopicPartition(topic_name, p) for p in range(1_000)], 30)] == list(
        range(1_000))
    c.close()
    admin.delete_topics([topic_name])[topic_name].result(60)
    assert etcd_keys(stack, f"/kafscale/{broker.cluster}/partitions/{topic_name}/") == []
    assert topic_name not in admin.list_topics(timeout=10).topics


def test_metadata_by_topic_id_costs_no_etcd_read_per_id(broker, topic_name, stack):
    """5,000 topic ids in one Metadata request are resolved from the broker's
    topic cache: etcd serves a handful of reads, not one listing per id."""
    create_topic(broker.bootstrap, topic_name)
    c = RawClient(broker.bootstrap)
    md = c.request(METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}],
                                      "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    known = md["topics"][0]["topic_id"]
    before = etcd_requests(stack, "Range")
    ids = [os.urandom(16) for _ in range(5_000)] + [known]
    md = c.request(METADATA.key, 12, {"topics": [{"name": None, "topic_id": i} for i in ids],
                                      "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    reads = etcd_requests(stack, "Range") - before
    c.close()
    assert [t["error_code"] for t in md["topics"]] == [ErrorCode.UNKNOWN_TOPIC_ID] * 5_000 + [0]
    assert md["topics"][-1]["name"] == topic_name
    assert reads < 50, f"{reads} etcd reads for one Metadata request"


def test_metadata_reads_no_owner_keys(broker, topic_name, stack):
    """Metadata answers leaders from the partition owners the broker follows
    (an etcd watch): naming a one-partition topic beside a 3,000-partition
    one reads no owner key (a scan of every owner is three pages of etcd
    reads), and the large topic's leaders are all this broker."""
    big, small = f"{topic_name}-big", f"{topic_name}-small"
    create_topic(broker.bootstrap, big, partitions=3_000)
    create_topic(broker.bootstrap, small)
    p = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "linger.ms": 5})
    for part in range(3_000):  # one record each: every partition claimed, an owner key each
        p.produce(big, value=b"x", partition=part)
    p.produce(small, value=b"x")
    assert p.flush(120) == 0
    assert len(etcd_keys(stack, f"/kafscale/{broker.cluster}/owners/{big}/")) == 3_000
    c = RawClient(broker.bootstrap)
    req = {"topics": [{"name": small, "topic_id": bytes(16)}], "allow_auto_topic_creation": False,
           "include_topic_authorized_operations": False}
    c.request(METADATA.key, 12, req)  # the topic in the broker's cache
    before = etcd_requests(stack, "Range")
    answers = [c.request(METADATA.key, 12, req) for _ in range(200)]
    whole = c.request(METADATA.key, 12, {**req, "topics": [{"name": big, "topic_id": bytes(16)}]})
    reads = etcd_requests(stack, "Range") - before
    c.close()
    assert all(md["topics"][0]["partitions"][0]["leader_id"] == broker.broker_id for md in answers)
    assert [q["leader_id"] for q in whole["topics"][0]["partitions"]] == [broker.broker_id] * 3_000
    # the count is the whole etcd's: the broker's own passes (the collector every 5 s, compaction of the 3,000
    # partitions just written) read etcd meanwhile, 12 in one run of 21 requests. One read a request would be
    # 201 here, a scan of the owners 3 a request
    assert reads < 30, f"{reads} etcd reads for 201 Metadata requests"


def test_a_partition_of_fifty_thousand_segments_opens(make_broker, topic_name, stack):
    """A partition's manifests are read in pages: 50,000 of them (~13 MB, past
    etcd's 4 MiB reply limit) no longer keep it from opening after a restart."""
    from kafscale.metadata.store import PartitionState, SegmentManifest
    from kafscale.storage.segment import segment_key

    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    b.stop()
    n = 50_000
    prefix = f"/kafscale/{b.cluster}/"

    async def fill() -> None:
        host, port = stack.etcd_endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port)) as c:
            tx = c.transactions
            for start in range(0, n, 100):
                ops = [tx.put(f"{prefix}segments/{topic_name}/0/{i:020d}".encode(), SegmentManifest(
                    i, i, 1, 100, 1000, 1000, segment_key(b.cluster, topic_name, 0, i, 1), 1000).to_json())
                    for i in range(start, min(start + 100, n))]
                await c.transaction(compare=[], success=ops, failure=[])
            await c.put(f"{prefix}partitions/{topic_name}/0".encode(), PartitionState(1, 1, n, 0).to_json())

    asyncio.run(fill())
    b.start()
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "probe"})
    try:
        assert c.get_watermark_offsets(TopicPartition(topic_name, 0), timeout=30) == (0, n)
    finally:
        c.close()
    assert "opened" in b.log() and f"segments={n}" in b.log()


def test_a_produce_opening_thousands_of_partitions_does_not_hold_up_others(make_broker, topic_name):
    """One Produce to 5,000 partitions not yet open (opened by etcd claims, a
    few dozen partitions to a transaction) and another client's produce to an
    open partition, on the same worker: the second is acknowledged while the
    first is still under way. Opening 1,000 partitions takes about as long as
    one produce round trip, too short to tell one from the other; 5,000 take
    about a second.
    The second client is connected and warm before the big request is sent,
    so what is compared is one produce round trip, not a client's start-up."""
    b = make_broker(workers=1)
    big, small = f"{topic_name}-big", f"{topic_name}-small"
    create_topic(b.bootstrap, big, partitions=5_000)
    create_topic(b.bootstrap, small)
    producer = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 0})
    producer.produce(small, b"warm", partition=0)
    assert producer.flush(30) == 0
    batch = _native.build_batch([(1000, None, b"v", [])])
    body = {"acks": -1, "timeout_ms": 60_000, "topic_data": [
        {"name": big, "partition_data": [{"index": p, "records": batch} for p in range(5_000)]}]}
    done: dict[str, float] = {}

    def produce_big() -> None:
        c = RawClient(b.bootstrap, timeout=120)
        r = c.request(PRODUCE.key, 9, body)
        done["big"] = time.monotonic()
        assert {p["error_code"] for p in r["responses"][0]["partition_responses"]} == {0}
        c.close()

    t = threading.Thread(target=produce_big)
    t.start()
    time.sleep(0.2)  # the big request is being appended
    errors: list[object] = []
    producer.produce(small, b"meanwhile", partition=0, on_delivery=lambda err, _msg: errors.append(err))
    assert producer.flush(60) == 0 and errors == [None]
    done["small"] = time.monotonic()
    t.join()
    assert done["small"] < done["big"], "the small produce waited for the 5,000-partition one"
