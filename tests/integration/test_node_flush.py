"""Node flushes (`node_flush`): one object per flush cycle for all of a
broker's partitions, one etcd transaction per object, compaction into
per-partition segments; with real clients, etcd and SeaweedFS."""
from __future__ import annotations

import asyncio
import json
import random
import time

import aetcd
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kafscale import _native, faults
from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY
from kafscale.metadata.etcd_client import EtcdClient
from kafscale.metadata.store import MetaStore
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.scan import StoreOptions, plan, read_slice
from kafscale.storage.segment import index_key, key_epoch, topic_marker_key
from kafscale.storage.wal import Collector, node_prefix, shared_prefix
from tests.integration.clients import create_topic
from tests.integration.s3log import S3RequestLog
from tests.integration.test_groups import wait_for
from tests.integration.test_topics_offsets import etcd_keys, s3_keys, segments_cli

PARTITIONS = 1000


def spread(tag: str, n: int) -> list[tuple[int, bytes]]:
    """n (partition, value) pairs, one per partition in turn."""
    return [(i % PARTITIONS, f"{tag}-{i}".encode()) for i in range(n)]


def produce_confluent(bootstrap: str, topic: str, recs: list[tuple[int, bytes]]) -> dict[bytes, tuple[int, int]]:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    acked: dict[bytes, tuple[int, int]] = {}

    def cb(err, msg) -> None:
        assert err is None, err
        acked[msg.value()] = (msg.partition(), msg.offset())

    for part, value in recs:
        p.produce(topic, value=value, partition=part, on_delivery=cb)
        p.poll(0)
    assert p.flush(120) == 0
    return acked


def produce_kafka_python(bootstrap: str, topic: str, recs: list[tuple[int, bytes]]) -> dict[bytes, tuple[int, int]]:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    futs = [(value, p.send(topic, value=value, partition=part)) for part, value in recs]
    acked = {}
    for value, f in futs:
        md = f.get(timeout=120)
        acked[value] = (md.partition, md.offset)
    p.close()
    return acked


def produce_aiokafka(bootstrap: str, topic: str, recs: list[tuple[int, bytes]]) -> dict[bytes, tuple[int, int]]:
    from aiokafka import AIOKafkaProducer

    async def run() -> dict[bytes, tuple[int, int]]:
        p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await p.start()
        try:
            futs = [(value, await p.send(topic, value=value, partition=part)) for part, value in recs]
            return {value: ((md := await f).partition, md.offset) for value, f in futs}
        finally:
            await p.stop()

    return asyncio.run(run())


def consume_all(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> dict[int, list[tuple[int, bytes]]]:
    """Every partition read from offset 0 to its high watermark by librdkafka:
    partition -> [(offset, value)] in the order served."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "node-flush-reader", "enable.auto.commit": False})
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: dict[int, list[tuple[int, bytes]]] = {}
    done = {p: 0 for p in ends}
    deadline = time.monotonic() + 120
    try:
        while any(done[p] < ends[p] for p in ends):
            assert time.monotonic() < deadline, "not everything was served"
            for m in c.consume(1000, 0.5):
                assert m.error() is None, m.error()
                out.setdefault(m.partition(), []).append((m.offset(), m.value()))
                done[m.partition()] = m.offset() + 1
    finally:
        c.close()
    return out


def wal_directories(stack, cluster: str, area: str = "wal") -> list[bytes]:
    """The directories of the node objects (area "wal") or shared segment objects ("shared") in etcd."""
    async def run() -> list[bytes]:
        host, port = stack.etcd_endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port)) as c:
            return [kv.value for kv in await c.get_prefix(f"/kafscale/{cluster}/{area}/".encode())]
    return asyncio.run(run())


def unnamed_shared_objects(stack, cluster: str) -> list[str]:
    """The shared segment objects no directory names (uploaded, never committed)."""
    named = {json.loads(raw)["key"] for raw in wal_directories(stack, cluster, "shared")}
    return [k for k in s3_keys(stack, shared_prefix(cluster)) if k not in named]


def count_keys(stack, cluster: str, area: str) -> int:
    return len(etcd_keys(stack, f"/kafscale/{cluster}/{area}/"))


def unnamed_objects(stack, cluster: str, topic: str, partitions: int) -> list[tuple[str, int, int]]:
    """The topic's segment objects no manifest names (uploaded, never committed), each with
    its epoch and its partition's owner epoch now."""
    async def run() -> tuple[set[str], dict[str, int]]:
        meta = MetaStore(stack.etcd_endpoint, cluster=cluster)
        await meta.start()
        try:
            named, epochs = set(), {}
            for p in range(partitions):
                named |= {k for m in await meta.list_segments(topic, p) for k in (m.key, index_key(m.key))}
                state = await meta.get_partition(topic, p)
                epochs[f"{cluster}/{topic}/{p}/"] = state[0].epoch if state else 0
            return named, epochs
        finally:
            await meta.close()

    named, epochs = asyncio.run(run())
    return [(k, key_epoch(k) or 0, epochs[k.rsplit("/", 1)[0] + "/"])
            for k in s3_keys(stack, f"{cluster}/{topic}/") if k not in named and k != topic_marker_key(cluster, topic)]


def spark_read(stack, cluster: str, topic: str, starting: str | None = None, etcd: bool = True
               ) -> dict[bytes, tuple[int, int]]:
    """What the broker-less reader under the Spark source finds (from
    startingOffsets; planned from etcd or from a bucket listing): value ->
    (partition, offset). A record found twice fails."""
    opts = StoreOptions(bucket=stack.bucket, namespace=cluster, endpoint=stack.s3_endpoint,
                        access_key=DEV_ACCESS_KEY, secret_key=DEV_SECRET_KEY,
                        etcd=stack.etcd_endpoint if etcd else None, cluster=cluster)
    out = {}
    for sl in asyncio.run(plan(opts, topic, starting)):
        data = read_slice(opts, sl)
        for batch in _native.scan_batches(data, True):
            for rec in _native.iter_records(batch, data):
                if sl.start <= rec[0] < sl.end:
                    assert rec[3] not in out, f"{rec[3]!r} read twice"
                    out[rec[3]] = (sl.partition, rec[0])
    return out


def test_three_clients_on_a_thousand_partitions_one_object_per_flush(make_broker, stack, topic_name):
    b = make_broker(node_flush="true", compaction_lag_ms=600_000)
    create_topic(b.bootstrap, topic_name, partitions=PARTITIONS)
    puts_before = stack.server_counts()["puts"]
    acked = {**produce_confluent(b.bootstrap, topic_name, spread("librdkafka", 2 * PARTITIONS)),
             **produce_kafka_python(b.bootstrap, topic_name, spread("kafka-python", PARTITIONS)),
             **produce_aiokafka(b.bootstrap, topic_name, spread("aiokafka", PARTITIONS))}
    assert len(acked) == 4 * PARTITIONS
    # one object per flush cycle, with a slice of each partition that had batches, and no index object:
    # one PUT per object, where a flush of each partition took two (its segment and index): 4x fewer here;
    # and one for the topic's marker
    puts = stack.server_counts()["puts"] - puts_before - 1
    directories = wal_directories(stack, b.cluster)
    slices = sum(len(json.loads(d)["slices"]) for d in directories)
    assert puts == len(directories) and 4 * puts <= 2 * slices, (puts, len(directories), slices)
    assert count_keys(stack, b.cluster, "segments") == 0  # nothing compacted yet
    served = consume_all(b.bootstrap, topic_name)
    # byte for byte, at the acknowledged offsets, in offset order, each once
    assert {v: (p, o) for p, recs in served.items() for o, v in recs} == acked
    for recs in served.values():
        assert [o for o, _ in recs] == list(range(len(recs)))


def test_compaction_rewrites_slices_into_segments_and_forgets_node_objects(make_broker, stack, topic_name):
    b = make_broker(node_flush="true", compaction_lag_ms=500, delete_delay_ms=2000)
    partitions = 20
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    recs = [(i % partitions, f"v{i}".encode()) for i in range(2000)]
    acked = {}
    for chunk in range(0, len(recs), 200):  # several flush cycles
        acked.update(produce_confluent(b.bootstrap, topic_name, recs[chunk:chunk + 200]))
    deadline = time.monotonic() + 60
    while count_keys(stack, b.cluster, "wal"):
        assert time.monotonic() < deadline, "node objects were not compacted away"
        time.sleep(0.5)
    segments = count_keys(stack, b.cluster, "segments")
    assert partitions <= segments <= 4 * partitions  # compacted per partition, not per flush
    # small partitions falling due together share an object (and a transaction)
    shared = [json.loads(d) for d in wal_directories(stack, b.cluster, "shared")]
    assert 0 < len(shared) < sum(len(d["slices"]) for d in shared) <= segments, shared
    served = consume_all(b.bootstrap, topic_name, partitions)
    assert {v: (p, o) for p, recs in served.items() for o, v in recs} == acked
    # the broker-less reader under the Spark source reads the compacted segments: every acknowledged record
    assert spark_read(stack, b.cluster, topic_name) == acked
    deadline = time.monotonic() + 30  # the objects go delete_delay_ms after their directories
    while s3_keys(stack, node_prefix(b.cluster)):
        assert time.monotonic() < deadline, "compacted node objects were not deleted"
        time.sleep(1)


@pytest.mark.parametrize("partitions", [1, 10])
def test_slow_partitions_merge_their_small_segments_so_keys_do_not_grow_with_time(make_broker, stack, topic_name,
                                                                                  partitions):
    """Twelve rounds of one record per partition, each compacted before the
    next: without merging each partition would keep twelve segments (twelve
    etcd keys, growing for as long as data is kept); merged four of a size at
    a time, it keeps three (twelve is 30 in base 4), also when it is the only
    partition due (one partition).
    Every record is served and read by the Spark source's reader exactly once,
    from etcd and from a bucket listing that still holds merged objects, and
    the shared objects left are the ones live segments name."""
    b = make_broker(compaction_lag_ms=300)
    rounds = 12
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    acked: dict[bytes, tuple[int, int]] = {}
    for r in range(rounds):
        acked.update(produce_confluent(b.bootstrap, topic_name, [(p, b"p%d-r%d" % (p, r)) for p in range(partitions)]))
        wait_for(lambda: not count_keys(stack, b.cluster, "wal"), 30, f"round {r} compacted")
    segments = count_keys(stack, b.cluster, "segments")
    assert partitions <= segments <= 4 * partitions, segments  # 12 rounds: 3 each when all are merged alike
    served = consume_all(b.bootstrap, topic_name, partitions)
    assert {v: (p, o) for p, recs in served.items() for o, v in recs} == acked
    assert spark_read(stack, b.cluster, topic_name) == acked
    assert spark_read(stack, b.cluster, topic_name, etcd=False) == acked

    def only_live_objects_named() -> bool:
        """The shared objects left are those the live segments name (every one
        is in a shared object: none is a .kfs of its own, never merged)."""
        live = {json.loads(m)["key"] for m in wal_directories(stack, b.cluster, f"segments/{topic_name}")}
        return {json.loads(d)["key"] for d in wal_directories(stack, b.cluster, "shared")} == live
    wait_for(only_live_objects_named, 30, "the merged shared objects to be forgotten")


def test_etcd_history_is_compacted_so_node_object_directories_do_not_fill_etcd(make_broker, stack, topic_name):
    """Every node object's directory is put into etcd and deleted again
    once compacted; etcd keeps every version until its history is compacted,
    and refuses every write once its database reaches its quota. The
    collecting broker compacts the history every etcd_compaction_ms, up to the
    revision of its previous pass: reads at a revision from before are
    refused, and the broker goes on taking and serving records."""
    async def read_at(revision: int) -> int:
        """Read at revision (0: the newest); the revision read."""
        host, port = stack.etcd_endpoint.split(":")
        async with EtcdClient(host=host, port=int(port)) as c:
            return (await c.range_page(b"a", b"b", 1, revision, True))[2]

    def compacted_past(rev: int) -> bool:
        try:
            asyncio.run(read_at(rev))
        except aetcd.exceptions.ClientError as exc:
            assert "compacted" in str(exc), exc
            return True
        return False

    before = asyncio.run(read_at(0))
    b = make_broker(compaction_lag_ms=300, etcd_compaction_ms=1000)
    partitions = 10
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    acked = produce_confluent(b.bootstrap, topic_name, [(i % partitions, b"a%d" % i) for i in range(500)])
    wait_for(lambda: compacted_past(before), 30, "etcd's history compacted")
    acked.update(produce_confluent(b.bootstrap, topic_name, [(i % partitions, b"b%d" % i) for i in range(500)]))
    served = consume_all(b.bootstrap, topic_name, partitions)
    assert {v: (p, o) for p, recs in served.items() for o, v in recs} == acked


def test_a_bucket_listing_reads_nothing_of_a_deleted_topic_of_the_same_name(make_broker, stack, topic_name):
    """A topic deleted and created again under the same name: the first
    one's shared segments stay in their objects for a while (a grace period
    after the collector forgets them, or as long as another topic's segments
    in the same object live). The bucket listing and `kafscale segments ls`
    show only the topic's current segments, told apart by the id in its
    marker object."""
    b = make_broker(compaction_lag_ms=300)
    other, partitions = f"{topic_name}-other", 4
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    for name in (topic_name, other):
        create_topic(b.bootstrap, name, partitions=partitions)
    old = produce_confluent(b.bootstrap, topic_name, [(p, b"old-%d-%d" % (p, i)) for p in range(partitions)
                                                      for i in range(3)])
    kept = produce_confluent(b.bootstrap, other, [(p, b"other-%d" % p) for p in range(partitions)])
    wait_for(lambda: not count_keys(stack, b.cluster, "wal"), 30, "the first topic compacted")
    assert spark_read(stack, b.cluster, topic_name, etcd=False) == old
    admin.delete_topics([topic_name])[topic_name].result(60)
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    new = produce_confluent(b.bootstrap, topic_name, [(p, b"new-%d" % p) for p in range(partitions)])
    wait_for(lambda: not count_keys(stack, b.cluster, "wal"), 30, "the second topic compacted")
    assert spark_read(stack, b.cluster, topic_name) == new
    assert spark_read(stack, b.cluster, topic_name, etcd=False) == new
    assert spark_read(stack, b.cluster, other, etcd=False) == kept
    # each partition's one record (in its segment, and in its node object until that is deleted); the first
    # topic had three a partition
    listed = [line.split() for line in segments_cli(b, "ls", "--topic", topic_name).splitlines()[1:]]
    assert {int(part) for part, *_ in listed} == set(range(partitions)), listed
    assert {(base, count) for _, base, count, *_ in listed} == {("0", "1")}, listed


def test_the_spark_reader_starts_inside_the_first_slice_of_a_node_object(make_broker, stack, topic_name):
    """A partition's slice at byte 0 of its node object, read from an offset inside it:
    read whole like any slice (a slice has no index object)."""
    b = make_broker(compaction_lag_ms=600_000)
    create_topic(b.bootstrap, topic_name)
    acked = produce_confluent(b.bootstrap, topic_name, [(0, b"r%d" % i) for i in range(10)])
    assert sorted(o for _, o in acked.values()) == list(range(10))
    starting = json.dumps({topic_name: {"0": 5}})
    assert spark_read(stack, b.cluster, topic_name, starting) == {v: po for v, po in acked.items() if po[1] >= 5}


@pytest.mark.parametrize("when", ["mid-produce", *faults.POINTS])
def test_sigkill_keeps_every_acknowledged_record(make_broker, stack, topic_name, when):
    """SIGKILL of the whole broker from outside while producing (mid-produce),
    or by the log process itself at a crash point of the node flush or of
    compaction (kafscale/faults.py), on the n-th time it gets there: after a
    restart every acknowledged record is served at its acknowledged offset,
    each record once, offsets in order; the Spark reader reads what is served."""
    partitions = 50
    nth = random.randint(2, 6) if when == "mid-compaction" else random.randint(20, 60)  # flushes: ~100/s
    crash = {} if when == "mid-produce" else {"crash_at": f"{when}:{nth}"}
    b = make_broker(node_flush="true", compaction_lag_ms=1000, **crash)
    create_topic(b.bootstrap, topic_name, partitions=partitions)
    p = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 5, "retries": 0,
                  "message.timeout.ms": 5000})
    acked: dict[bytes, tuple[int, int]] = {}

    def cb(err, msg) -> None:
        if err is None:
            acked[msg.value()] = (msg.partition(), msg.offset())

    deadline = time.monotonic() + 60
    i = 0
    while b.proc.poll() is None:
        assert time.monotonic() < deadline, f"the broker never reached {when}"
        p.produce(topic_name, value=b"r%d" % i, partition=i % partitions, on_delivery=cb)
        p.poll(0)
        i += 1
        if when == "mid-produce" and i == 4000:
            b.kill()
        if i % 50 == 0:
            time.sleep(0.01)
    p.flush(30)
    assert acked
    if when == "mid-compaction":  # the compaction's segment (or shared object) is in S3, and nothing names it
        assert unnamed_objects(stack, b.cluster, topic_name, partitions) or unnamed_shared_objects(stack, b.cluster)
    else:  # timed by produce, the crash leaves records in flight (compaction, timed by the lag, may not)
        assert len(acked) < i
    b.config.pop("crash_at", None)
    b.start()
    served = consume_all(b.bootstrap, topic_name, partitions)
    got = {v: (part, o) for part, recs in served.items() for o, v in recs}
    assert {v: got.get(v) for v in acked} == acked  # every acknowledged record, at its offset
    assert sum(len(recs) for recs in served.values()) == len(got)  # each record once
    for recs in served.values():
        offsets = [o for o, _ in recs]
        assert offsets == sorted(set(offsets))  # offsets unique, in order
    assert spark_read(stack, b.cluster, topic_name) == got
    # the restarted broker, claiming every partition, deletes what earlier owners never committed
    deadline = time.monotonic() + 30
    while left := [o for o in unnamed_objects(stack, b.cluster, topic_name, partitions) if o[1] < o[2]]:
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


def test_the_orphan_sweep_lists_and_deletes_only_gone_fences_objects(stack):
    """Objects of a fence that is gone and that no directory names are
    deleted; a live fence's objects are kept, and its prefix is never listed
    (a LIST of every node object would hold up the store)."""
    namespace = f"sweep{random.randrange(1 << 30)}"
    root = node_prefix(namespace)
    log = S3RequestLog(stack.s3_port)

    async def run() -> tuple[list[str], list[str]]:
        meta = MetaStore(stack.etcd_endpoint, cluster=namespace)
        await meta.start()
        store = ObjectStore(stack.bucket, log.url, access_key=DEV_ACCESS_KEY, secret_key=DEV_SECRET_KEY)
        try:
            await store.start()
            lease = await meta.register_broker(1, "127.0.0.1", 1, ttl=30)
            await meta.create_fence("1-live", lease)
            for key in (f"{root}1-live/000000000001.kfn", f"{root}2-gone/000000000001.kfn",
                        f"{root}2-gone/000000000002.kfn", f"{namespace}/orders/0/00000000000000000000-1.kfs"):
                await store.put(key, b"x")
            await Collector(meta, store, namespace, orphan_age_s=0).run()
            lists = [t for m, t, _, _ in log.timeline if m == "GET" and "list-type=2" in t]
            return sorted(o["Key"] for o in await store.list(f"{namespace}/")), lists
        finally:
            await store.close()
            await meta.close()

    try:
        left, lists = asyncio.run(run())
    finally:
        log.close()
    assert left == [f"{namespace}/orders/0/00000000000000000000-1.kfs", f"{root}1-live/000000000001.kfn"]
    # the fences' prefixes (with a delimiter: not walking the objects), then the gone fence's objects alone,
    # then the fences' prefixes of shared objects
    assert len(lists) == 3 and "delimiter=" in lists[0] and "2-gone" in lists[1] and "delimiter=" in lists[2], lists
