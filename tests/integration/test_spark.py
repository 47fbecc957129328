"""The Spark data source and `kafscale replay`, reading segments that a real
broker wrote to a real SeaweedFS, with Spark in local mode."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY
from kafscale.storage import scan
from tests.conftest import BrokerProcess
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic, sample_records
from tests.integration.s3log import S3RequestLog
from tests.integration.test_groups import wait_for
from tests.integration.test_topics_offsets import etcd_keys

pyspark = pytest.importorskip("pyspark")

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
T0 = 1_700_000_000_000
# records here carry T0-based (2023) timestamps: their topics keep them whatever their age
KEEP = {"retention.ms": "-1"}


def compacting_broker(stack, path, compaction_lag_ms: int) -> Iterator[BrokerProcess]:
    b = BrokerProcess(stack, path, f"m{uuid.uuid4().hex[:10]}", auto_create_topics="true", default_partitions=1,
                      compaction_lag_ms=compaction_lag_ms).start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def broker(stack, tmp_path_factory) -> Iterator[BrokerProcess]:
    """Compacting half a second after a flush: a reader without etcd finds compacted segments only."""
    yield from compacting_broker(stack, tmp_path_factory.mktemp("broker"), 500)


@pytest.fixture
def late_broker(stack, tmp_path) -> Iterator[BrokerProcess]:
    """Compacting 5 s after a flush: a produce that takes longer than half a
    second on a busy machine is still compacted in one piece."""
    yield from compacting_broker(stack, tmp_path, 5000)


@pytest.fixture(scope="module")
def s3log(stack) -> Iterator[S3RequestLog]:
    log = S3RequestLog(stack.s3_port)
    yield log
    log.close()


def source(spark, broker, topic: str, endpoint: str, etcd: bool = True, **options: object):
    opts = {"topic": topic, "bucket": broker.stack.bucket, "namespace": broker.cluster, "endpoint": endpoint,
            "accessKey": DEV_ACCESS_KEY, "secretKey": DEV_SECRET_KEY, **{k: str(v) for k, v in options.items()}}
    if etcd:
        opts.update(etcd=broker.stack.etcd_endpoint, cluster=broker.cluster)
    return spark.read.format("kafscale").options(**opts).load()


def compacted(broker) -> None:
    """Wait until every node object slice is compacted into segments (none is named in etcd)."""
    wait_for(lambda: not etcd_keys(broker.stack, f"/kafscale/{broker.cluster}/wal/"), 30, "compaction")


def rows_by_position(df) -> dict[tuple[int, int], tuple]:
    out = {}
    for r in df.collect():
        ts = int(r.timestamp.replace(tzinfo=UTC).timestamp() * 1000)
        headers = tuple((h.key, bytes(h.value)) for h in r.headers)
        key = None if r.key is None else bytes(r.key)
        value = None if r.value is None else bytes(r.value)
        assert (r.partition, r.offset) not in out, f"duplicate row at {r.partition}/{r.offset}"
        out[(r.partition, r.offset)] = (r.topic, key, value, ts, r.timestampType, headers)
    return out


def test_reads_every_record_with_mixed_codecs(spark, broker, topic_name):
    """Every record produced through the broker comes back from the segments
    with its key, value, offset, timestamp and headers, whatever the codec,
    planned from etcd or from an S3 listing (the two partitions' small
    segments share objects)."""
    create_topic(broker.bootstrap, topic_name, partitions=2, config=KEEP)
    want: dict[tuple[int, int], tuple] = {}
    for i, codec in enumerate(CODECS):
        for p in range(2):
            recs = [Rec(r.key, r.value if r.value is None else r.value * 20, r.headers)
                    for r in sample_records(300, f"{codec}{p}")]
            ts = [T0 + i * 10_000 + j for j in range(len(recs))]
            offsets = confluent_produce(broker.bootstrap, topic_name, recs, codec=codec, partition=p, timestamps=ts,
                                        **{"batch.num.messages": 100})
            for o, r, t in zip(offsets, recs, ts, strict=True):
                want[(p, o)] = (topic_name, r.key, r.value, t, 0, r.headers)
    endpoint = broker.stack.s3_endpoint
    fresh = source(spark, broker, topic_name, endpoint)  # as acknowledged: mostly node object slices
    assert fresh.columns == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType", "headers"]
    assert rows_by_position(fresh) == want
    # once compacted: segments, found in etcd or (without etcd) by listing S3
    compacted(broker)
    whole = source(spark, broker, topic_name, endpoint)
    assert rows_by_position(whole) == want
    listed = source(spark, broker, topic_name, endpoint, etcd=False)
    assert rows_by_position(listed) == want
    codecs_seen = set()
    from kafscale import _native

    for seg in committed_segments(broker, topic_name):  # own .kfs objects and segments in shared objects
        data = get_object(broker, seg.key)[seg.start:seg.start + seg.size]
        codecs_seen |= {_native.CODEC_NAMES[b.compression] for b in _native.scan_batches(data[32:-16])}
    assert codecs_seen == set(CODECS), "every codec reached the segments"


def test_large_segments_are_read_in_slices_cut_at_index_entries(spark, late_broker, topic_name):
    """A segment bigger than maxBytesPerPartition is read by several tasks,
    each from an index entry (a batch boundary), planned from etcd or from a
    listing; together they return every record once."""
    broker = late_broker
    create_topic(broker.bootstrap, topic_name, config=KEEP)
    recs = [Rec(b"k%d" % i, os.urandom(1024)) for i in range(2500)]  # 2.5 MiB: more than a shared segment holds
    ts = [T0 + i for i in range(len(recs))]
    offsets = confluent_produce(broker.bootstrap, topic_name, recs, timestamps=ts)
    want = {(0, o): (topic_name, r.key, r.value, t, 0, ()) for o, r, t in zip(offsets, recs, ts, strict=True)}
    compacted(broker)
    assert all(s.pos == -1 for s in committed_segments(broker, topic_name)), "segment objects of its own"
    whole = source(spark, broker, topic_name, broker.stack.s3_endpoint)
    for etcd in (True, False):
        sliced = source(spark, broker, topic_name, broker.stack.s3_endpoint, etcd=etcd,
                        maxBytesPerPartition=256 << 10)
        assert sliced.rdd.getNumPartitions() > whole.rdd.getNumPartitions()
        assert rows_by_position(sliced) == want


def committed_segments(broker, topic: str) -> list[scan.Segment]:
    """Every partition's segments, as their manifests in etcd name them."""
    opts = scan.StoreOptions(broker.stack.bucket, broker.cluster, broker.stack.s3_endpoint, None, DEV_ACCESS_KEY,
                             DEV_SECRET_KEY, broker.stack.etcd_endpoint, broker.cluster)
    return [s for segs, _, _ in asyncio.run(scan.list_segments(opts, topic)).values() for s in segs]


def get_object(broker, key: str) -> bytes:
    return broker.stack.s3_client().get_object(Bucket=broker.stack.bucket, Key=key)["Body"].read()


def produce_rounds(broker, topic: str, rounds: int, per_round: int) -> list[list[int]]:
    """Rounds of records, each acknowledged before the next starts (so no
    segment mixes two rounds); round r has timestamps T0 + r * 1e6 + i."""
    out = []
    for r in range(rounds):
        recs = [Rec(f"k{r}-{i}".encode(), f"round {r} record {i}".encode()) for i in range(per_round)]
        out.append(confluent_produce(broker.bootstrap, topic, recs,
                                     timestamps=[T0 + r * 1_000_000 + i for i in range(per_round)]))
    return out


def test_offset_and_time_ranges_read_only_the_needed_objects(spark, broker, topic_name, s3log):
    create_topic(broker.bootstrap, topic_name, config={**KEEP, "segment.bytes": "4096"})  # compacted into several
    rounds = produce_rounds(broker, topic_name, 5, 200)
    compacted(broker)
    segments = committed_segments(broker, topic_name)
    base_of = {seg.key: seg.base for seg in segments}  # a shared object holds one segment of a partition
    assert len(base_of) == len(segments) > 3

    def fetched() -> set[str]:
        return {k.split("/", 1)[1] for k in s3log.gets("")} & base_of.keys()

    def segments_holding(lo: int, hi: int) -> set[str]:
        bases = sorted(base_of.values())
        nxt = {b: (bases[i + 1] if i + 1 < len(bases) else 1 << 62) for i, b in enumerate(bases)}
        return {k for k, b in base_of.items() if b < hi and nxt[b] > lo}

    # offsets: exactly round 2
    lo, hi = rounds[2][0], rounds[2][-1] + 1
    s3log.clear()
    df = source(spark, broker, topic_name, s3log.url,
                startingOffsets=json.dumps({topic_name: {"0": lo}}), endingOffsets=json.dumps({topic_name: {"0": hi}}))
    got = sorted(r.offset for r in df.select("offset").collect())
    assert got == list(range(lo, hi))
    assert fetched() == segments_holding(lo, hi), "only the segments holding the range were read"
    assert len(fetched()) < len(base_of)
    assert not [m for m, p in s3log.requests if "list-type" in p or (m == "GET" and p.rstrip("/").endswith(
        broker.stack.bucket))], "planning from etcd lists nothing"

    # time: from round 1's first timestamp up to (not including) round 3's
    s3log.clear()
    df = source(spark, broker, topic_name, s3log.url, startingTimestamp=T0 + 1_000_000,
                endingTimestamp=T0 + 3_000_000)
    got = sorted(r.offset for r in df.select("offset").collect())
    assert got == rounds[1] + rounds[2]
    # the rounds' segments, plus the first of round 3 where the end time is found
    assert fetched() <= segments_holding(rounds[1][0], rounds[3][0] + 1)
    assert not fetched() & segments_holding(rounds[0][0], rounds[0][-1] + 1), "round 0 was never read"
    assert not fetched() & segments_holding(rounds[4][0], rounds[4][-1] + 1), "round 4 was never read"


def run_cli(broker, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **broker.stack.broker_env(), KAFSCALE_CLUSTER=broker.cluster,
               KAFSCALE_NAMESPACE=broker.cluster)
    return subprocess.run([sys.executable, "-m", "kafscale.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_replay_to_files_and_back_into_a_topic(broker, topic_name, tmp_path):
    create_topic(broker.bootstrap, topic_name, config=KEEP)
    rounds = produce_rounds(broker, topic_name, 3, 100)
    out = tmp_path / "out"
    when = datetime.fromtimestamp((T0 + 1_000_000) / 1000, UTC).isoformat().replace("+00:00", "Z")
    r = run_cli(broker, "replay", "--topic", topic_name, "--from", when, "--out", str(out), "--format", "json",
                "--as-text")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(200 records)" in r.stdout
    rows = [json.loads(line) for f in sorted(out.glob("part-*.json")) for line in f.read_text().splitlines()]
    assert sorted(x["offset"] for x in rows) == rounds[1] + rounds[2]
    assert {x["value"] for x in rows} == {f"round {r} record {i}" for r in (1, 2) for i in range(100)}

    target = f"{topic_name}-copy"
    create_topic(broker.bootstrap, target, config=KEEP)
    r = run_cli(broker, "replay", "--topic", topic_name, "--to", str(rounds[1][-1] + 1), "--to-topic", target,
                "--bootstrap", broker.bootstrap)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "produced 200 records" in r.stdout
    copied = confluent_consume(broker.bootstrap, target, 200)
    assert [rec.value for _, rec in copied] == [f"round {r} record {i}".encode() for r in (0, 1) for i in range(100)]


def test_replay_rejects_a_bad_range(broker):
    r = run_cli(broker, "replay", "--topic", "x", "--from", "yesterday", "--out", "/tmp/never")
    assert r.returncode == 2
    assert "not earliest, latest, an offset or an ISO-8601 time" in r.stderr
