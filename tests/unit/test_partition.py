"""The durability path of one partition (storage/partition.py) on the
in-memory twins of S3 and etcd: acknowledged only once in S3 and committed,
S3 and etcd failures retried without loss, a fenced owner acknowledging
nothing more, a lost commit reply not committing twice, idempotent producer
retries deduplicated across owners, orphans swept, retention moving the log
start before deleting objects."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pickle
import random
import struct

import pytest

from kafscale import _native
from kafscale.broker import messages
from kafscale.broker.produce_api import Acks, Deadlines
from kafscale.config import Config
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import MetaStore, PartitionState, SegmentManifest
from kafscale.protocol.errors import ErrorCode
from kafscale.storage import partition
from kafscale.storage.cache import CachedSegment
from kafscale.storage.memory import MemoryObjectStore
from kafscale.storage.partition import SWEEP_GATHER_S, OrphanSweeper, PartitionLog
from kafscale.storage.reader import LogError, ReadBudget
from kafscale.storage.segment import build_segment, index_key, segment_key

TOPIC = "orders"


class DictCache:
    def __init__(self) -> None:
        self.segments: dict[str, object] = {}
        self.keeps = math.inf  # what keeps_s answers

    def keeps_s(self):
        return self.keeps

    def get(self, m):
        return self.segments.get(m.ref)

    def read(self, m, offset, max_bytes):
        seg = self.segments.get(m.ref)
        return None if seg is None else seg.slice_from(offset, max_bytes)

    def holds(self, m):
        return m.ref in self.segments

    def batches(self, manifests):
        return [None if (seg := self.segments.get(m.ref)) is None else seg.batches() for m in manifests]

    def build(self, manifests, created_ms):
        cached = [self.segments.get(m.ref) for m in manifests]
        if any(seg is None for seg in cached):
            return None
        return build_segment([(seg.batches(), m.base) for seg, m in zip(cached, manifests, strict=True)], created_ms)

    def put(self, m, seg):
        self.segments[m.ref] = seg

    def put_object(self, key, body, entries, at=0):
        packed, tables = entries
        for pos, n, start, end in struct.iter_unpack("=4q", packed):
            self.segments[f"{key}#{pos}"] = CachedSegment.from_tables(body[pos - at:pos - at + n],
                                                                      memoryview(tables)[start:end])

    def drop(self, m):
        self.segments.pop(m.ref, None)

    def drop_prefix(self, prefix):
        self.segments = {k: v for k, v in self.segments.items() if not k.startswith(prefix)}


def batch(*values: bytes, ts: int = 1_700_000_000_000, producer: tuple[int, int, int] | None = None) -> memoryview:
    """A RecordBatch; producer (id, epoch, first sequence) makes it idempotent."""
    data = bytearray(_native.build_batch([(ts, None, v, []) for v in values]))
    if producer is not None:
        struct.pack_into(">qhi", data, 43, *producer)
        struct.pack_into(">I", data, 17, _native.crc32c(bytes(data[21:])))
    return memoryview(bytes(data))


class Cluster:
    """One etcd and one bucket shared by the owners a test opens."""

    def __init__(self, partitions: int = 1) -> None:
        self.etcd = MemoryEtcd()
        self.store = MemoryObjectStore()
        self.meta = MetaStore.in_memory("unit", self.etcd)
        self.changes: list[object] = []
        self.partitions = partitions
        self.sweeper = OrphanSweeper(self.store, "unit")  # one per node in a broker; shared here

    async def open(self, node_id: int = 1, partition: int = 0, **cfg: object) -> PartitionLog:
        if await self.meta.get_topic(TOPIC) is None:
            await self.meta.create_topic(TOPIC, self.partitions, {})
        config = Config(node_id=node_id, namespace="unit", **{"linger_ms": 1, **cfg})
        lg = PartitionLog(TOPIC, partition, config, self.store, self.meta, DictCache(), ReadBudget(64 << 20),
                          lambda _lg, m: self.changes.append(m))
        await lg.open()
        self.sweeper.sweep(lg, self.partitions)
        return lg

    async def hw(self) -> int:
        state = await self.meta.get_partition(TOPIC, 0)
        return state[0].hw if state else 0


class FutureAck:
    """An append's acknowledger: a future done once the batch is durable."""

    def __init__(self) -> None:
        self.durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def answer(self, _token: object, exc: LogError | None) -> None:
        if exc is not None:
            self.durable.set_exception(exc)
        else:
            self.durable.set_result(None)


def append(lg: PartitionLog, payload: memoryview) -> asyncio.Future[int]:
    """Append one batch: the future of its base offset, done once it is durable."""
    ack = FutureAck()
    base = lg.append(payload, _native.scan_batches(payload, True), (ack, None))
    out: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    ack.durable.add_done_callback(
        lambda d: out.set_exception(exc) if (exc := d.exception()) is not None else out.set_result(base))
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_states_and_manifests_are_encoded_as_json_dumps_with_sorted_keys_writes_them():
    """Their to_json formats the fields itself; the bytes must stay those of
    json.dumps(sort_keys=True), which wrote every key stored so far (a commit
    compares a partition key with the exact bytes its owner wrote)."""
    rnd = random.Random(7)

    def sorted_dump(record):  # a manifest's ref is made from its key and position, not stored
        return json.dumps({k: v for k, v in dataclasses.asdict(record).items() if k != "ref"}, sort_keys=True).encode()

    for _ in range(200):
        n = [rnd.choice([-1, 0, rnd.randrange(1 << 62)]) for _ in range(9)]
        text = rnd.choice(["", "a1b2", 'q"u\\ote', "ünï\ncode", "ns/wal/f00d/000000000001"])
        producers = rnd.choice([{}, {"7": [0, [[0, 4, 10]]], "12": [3, [[5, 5, 2], [6, 9, 3]]]}])
        state = PartitionState(n[0], n[1], n[2], n[3], text)
        manifest = SegmentManifest(*n[:6], text, n[6], producers, n[7])
        assert state.to_json() == sorted_dump(state)
        assert manifest.to_json() == sorted_dump(manifest)
        assert PartitionState(**json.loads(state.to_json())) == state
        assert SegmentManifest(**json.loads(manifest.to_json())) == manifest


def test_manifests_and_partition_changes_cross_to_the_workers_whole():
    """A manifest pickles as its fields in order (SegmentManifest.__reduce__),
    and a PartitionChanged crosses as a plain tuple (PartitionChanged.sent,
    then received): every field comes back, the manifest's ref included."""
    rnd = random.Random(11)
    for _ in range(100):
        n = [rnd.choice([-1, 0, rnd.randrange(1 << 62)]) for _ in range(8)]
        producers = rnd.choice([{}, {"7": [0, [[0, 4, 10]]], "12": [3, [[5, 5, 2], [6, 9, 3]]]}])
        manifest = SegmentManifest(*n[:6], rnd.choice(["k", "ns/wal/f00d/000000000001"]), n[6], producers, n[7])
        change = (rnd.choice(["t", "ünï"]), n[0], rnd.random() < 0.5, n[1], n[2], rnd.choice([manifest, None]),
                  rnd.choice([b"ref", None]))
        wire = pickle.dumps([messages.PartitionChanged.sent(*change)], protocol=pickle.HIGHEST_PROTOCOL)
        back = messages.PartitionChanged.received(pickle.loads(wire)[0])
        assert back == messages.PartitionChanged(*change)
        for m in (pickle.loads(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL)), back.manifest):
            if m is not None:
                assert dataclasses.asdict(m) == dataclasses.asdict(manifest)
                assert m.ref == manifest.ref == (manifest.key if manifest.pos < 0 else f"{manifest.key}#{manifest.pos}")
    given = SegmentManifest(0, 0, 1, 10, 0, 0, "obj", 0, {}, 64, ref="entry")  # a ref given stays as given
    assert pickle.loads(pickle.dumps(given)).ref == "entry"
    assert messages.PartitionChanged.received(messages.PartitionChanged.sent("t", 0, False, 1, 0, given, None)
                                              ).manifest.ref == "entry"


def test_acknowledged_only_once_in_s3_and_committed_in_etcd():
    async def go():
        c = Cluster()
        lg = await c.open()
        futs = [append(lg, batch(b"a", b"b")), append(lg, batch(b"c"))]
        assert not any(f.done() for f in futs) and await c.hw() == 0, "nothing acknowledged before the commit"
        assert await asyncio.gather(*futs) == [0, 2]
        assert await c.hw() == 3 and lg.hw == 3
        [m] = await c.meta.list_segments(TOPIC, 0)
        assert (m.base, m.last, m.count) == (0, 2, 3)
        assert m.key in c.store.objects
        assert not any(k.endswith(".index") for k in c.store.objects), "a segment this small has no index"
        data = b"".join(bytes(b) for b in await lg.read(0, 1 << 20))
        values = [v for b in _native.scan_batches(data, True) for *_, v, _ in _native.iter_records(b, data)]
        assert values == [b"a", b"b", b"c"]
        await lg.close()

    run(go())


def test_a_batch_goes_at_once_with_nothing_under_way_and_gathers_for_the_linger_behind_a_segment():
    """With no segment uploading or committing, a batch goes at once, also
    right after the one before; one queued behind a segment under way
    gathers for linger_ms."""
    async def go():
        c = Cluster()
        lg = await c.open(linger_ms=60_000)
        assert await asyncio.wait_for(append(lg, batch(b"a")), 5) == 0, "nothing under way: no linger"
        assert await asyncio.wait_for(append(lg, batch(b"b")), 5) == 1, "again right after: no linger"
        gate, committing = asyncio.Event(), asyncio.Event()
        real = c.meta.commit_segment

        async def gated(*args: object, **kw: object) -> object:
            committing.set()
            await gate.wait()
            return await real(*args, **kw)

        c.meta.commit_segment = gated  # type: ignore[method-assign]
        first = append(lg, batch(b"c"))
        await asyncio.wait_for(committing.wait(), 5)  # its segment is under way
        second = append(lg, batch(b"d"))
        gate.set()
        assert await asyncio.wait_for(first, 5) == 2
        await asyncio.sleep(0.2)
        assert not second.done() and await c.hw() == 3, "queued behind a segment: it gathers for the linger"
        await lg.close()

    run(go())


def test_take_hands_over_at_least_one_batch_then_up_to_the_limit_in_queue_order():
    """What a flush takes of a log's queue: the first batch whatever its
    size, then the next ones that fit the limit, with their bytes; the rest
    stays queued for the next flush."""
    async def go():
        c = Cluster()
        lg = PartitionLog(TOPIC, 0, Config(node_id=1, namespace="unit"), c.store, c.meta, DictCache(),
                          ReadBudget(1 << 20), lambda _lg, _m: None)  # not opened: no flush loop takes meanwhile
        payloads = [batch(b"x" * n) for n in (100, 200, 300, 400)]
        for p in payloads:
            lg.append(p, _native.scan_batches(p, True), None)
        sizes = [len(p) for p in payloads]
        for limit, expect in ((sizes[0] - 1, [0]), (sizes[1] + sizes[2] + 1, [1, 2]), (1 << 20, [3])):
            taken, n = lg.take(limit)
            assert [t.payload for t in taken] == [payloads[i] for i in expect]
            assert n == sum(sizes[i] for i in expect) and lg.has_queued() == (expect != [3])
        assert lg.take(1 << 20) == ([], 0)
        assert [p.base for p in lg._inflight] == [0, 1, 2, 3], "taken, in offset order, until committed"

    run(go())


def test_only_a_segment_of_more_than_64_kib_of_batches_gets_an_index():
    async def go():
        c = Cluster()
        lg = await c.open()
        await append(lg, batch(b"small"))
        await append(lg, batch(bytes(70 << 10)))
        small, big = await c.meta.list_segments(TOPIC, 0)
        assert index_key(small.key) not in c.store.objects
        assert index_key(big.key) in c.store.objects
        await lg.close()

    run(go())


def test_s3_and_etcd_failures_are_retried_never_dropped():
    async def go():
        c = Cluster()
        lg = await c.open()
        c.store.fail_next("put", 3)
        assert await append(lg, batch(b"x")) == 0
        assert c.store.requests["put"] >= 4, "three failed PUTs, then the segment (too small for an index)"
        c.etcd.down = True
        fut = append(lg, batch(b"y"))
        await asyncio.sleep(0.3)
        assert not fut.done(), "etcd down: the producer waits"
        c.etcd.down = False
        assert await fut == 1 and await c.hw() == 2
        await lg.close()

    run(go())


def test_a_calls_acks_answer_each_response_once_durable_failed_or_timed_out():
    async def go():
        c = Cluster()
        lg = await c.open()
        acks, deadlines = Acks(), Deadlines()
        durable = [0, 0, 0, 0, None]  # a partition's answer: index, error code, base offset, log start, message
        lg.append(batch(b"a"), _native.scan_batches(batch(b"a")), acks.expect(durable))
        await acks.wait(deadlines, 5)
        assert durable == [0, 0, 0, 0, None], "durable: left as appended"

        c.etcd.down = True  # the next batch cannot become durable: it times out, then fails
        late, failed = Acks(), Acks()
        slow = [0, 0, 1, 0, None]
        lg.append(batch(b"b"), _native.scan_batches(batch(b"b")), late.expect(slow))
        await late.wait(deadlines, 0.2)
        assert slow[1] == ErrorCode.REQUEST_TIMED_OUT and slow[2] == -1
        lost = [0, 0, 2, 0, None]
        lg.append(batch(b"c"), _native.scan_batches(batch(b"c")), failed.expect(lost))
        waiting = asyncio.ensure_future(failed.wait(deadlines, 30))
        await lg.close()
        await asyncio.wait_for(waiting, 5)
        assert lost[1] == ErrorCode.NOT_LEADER_OR_FOLLOWER and lost[2] == -1
        assert slow[1] == ErrorCode.REQUEST_TIMED_OUT, "answered once: the timeout stands"

    run(go())


def test_a_lost_commit_reply_does_not_commit_twice():
    async def go():
        c = Cluster()
        lg = await c.open()
        real = c.meta.commit_segment
        lost = []

        async def commit_then_lose_reply(*args):
            raw = await real(*args)
            if not lost:
                lost.append(raw)
                raise ConnectionError("reply lost")
            return raw

        c.meta.commit_segment = commit_then_lose_reply  # type: ignore[method-assign]
        assert await append(lg, batch(b"once")) == 0
        assert lost and await c.hw() == 1 and len(await c.meta.list_segments(TOPIC, 0)) == 1
        assert await append(lg, batch(b"next")) == 1
        await lg.close()

    run(go())


def test_a_fenced_owner_acknowledges_nothing_and_its_orphans_are_swept():
    async def go():
        c = Cluster()
        old = await c.open(node_id=1)
        await asyncio.sleep(0.1)
        assert c.store.requests["list"] == 0, "a first owner (epoch 1) has nobody's orphans to look for"
        assert await append(old, batch(b"kept")) == 0
        c.store.fail_next("put", 1)  # the next upload takes a retry: the new owner claims meanwhile
        fut = append(old, batch(b"lost"))
        new = await c.open(node_id=2)
        with pytest.raises(LogError) as err:
            await fut
        assert err.value.code == ErrorCode.NOT_LEADER_OR_FOLLOWER and old.closed
        assert await c.hw() == 1, "the old owner's commit was refused"
        await asyncio.sleep(SWEEP_GATHER_S + 0.2)
        await new.close()
        again = await c.open(node_id=3)  # its sweep removes what no manifest names
        await asyncio.sleep(SWEEP_GATHER_S + 0.2)
        assert c.store.requests["list"] == 2, "the later owners each looked"
        named = {m.key for m in await c.meta.list_segments(TOPIC, 0)}
        assert {k for k in c.store.objects if k.endswith(".kfs")} == named
        assert await append(again, batch(b"after")) == 1
        await again.close()

    run(go())


def test_partitions_claimed_together_are_swept_with_one_listing_of_their_topic(monkeypatch):
    """Where one listing of the topic takes fewer requests than one per partition."""
    async def go():
        c = Cluster(partitions=12)
        logs = [await c.open(node_id=1, partition=p) for p in range(12)]
        for lg in logs:
            assert await append(lg, batch(b"kept")) == 0
            await lg.close()
        orphans = {segment_key("unit", TOPIC, p, 7, 1) for p in range(12)}  # epoch 1's, never committed
        c.store.objects.update(dict.fromkeys(orphans, b"x"))
        c.store.objects[segment_key("unit", TOPIC + "-other", 1, 7, 1)] = b"x"  # another topic: not ours
        named = {m.key for p in range(12) for m in await c.meta.list_segments(TOPIC, p)}
        taken = [await c.open(node_id=2, partition=p) for p in range(6)]  # 36 objects: one listing
        await asyncio.sleep(SWEEP_GATHER_S + 0.2)
        assert c.store.requests["list"] == 1
        assert {k for k in c.store.objects if k.endswith(".kfs")} == (
            named | {segment_key("unit", TOPIC, p, 7, 1) for p in range(6, 12)}
            | {segment_key("unit", TOPIC + "-other", 1, 7, 1)})
        monkeypatch.setattr(partition, "LIST_PAGE", 30)  # now the topic takes 2 requests to list
        one = await c.open(node_id=2, partition=10)  # alone: a listing of its own partition
        await asyncio.sleep(SWEEP_GATHER_S + 0.2)
        assert c.store.requests["list"] == 2 and segment_key("unit", TOPIC, 10, 7, 1) not in c.store.objects
        assert segment_key("unit", TOPIC, 1, 7, 1) not in c.store.objects
        assert segment_key("unit", TOPIC, 11, 7, 1) in c.store.objects, "not claimed: not swept"
        for lg in [*taken, one]:
            await lg.close()

    run(go())


def test_idempotent_retries_get_the_original_offset_even_on_a_new_owner():
    async def go():
        c = Cluster()
        lg = await c.open(node_id=1)
        first = batch(b"p0", producer=(7, 0, 0))
        assert await append(lg, first) == 0
        assert await append(lg, first) == 0, "a retried batch is acknowledged with its first offset"
        assert await append(lg, batch(b"p1", producer=(7, 0, 1))) == 1
        with pytest.raises(LogError) as err:
            lg.append(batch(b"gap", producer=(7, 0, 5)), _native.scan_batches(batch(b"gap", producer=(7, 0, 5))),
                      (FutureAck(), None))
        assert err.value.code == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
        await lg.close()
        moved = await c.open(node_id=2)
        assert await append(moved, first) == 0, "the new owner rebuilt the producer state from the manifests"
        assert await c.hw() == 2
        await moved.close()

    run(go())


def test_retention_moves_the_log_start_then_deletes_objects():
    async def go():
        c = Cluster()
        lg = await c.open()
        for i in range(3):
            await append(lg, batch(b"old-%d" % i, ts=1_000 + i))
        await append(lg, batch(b"new", ts=2_000_000))
        segments = await c.meta.list_segments(TOPIC, 0)
        assert len(segments) == 4
        assert await lg.apply_retention(retention_ms=1_000_000, retention_bytes=-1, now_ms=2_500_000) == 3
        state, _ = await c.meta.get_partition(TOPIC, 0)
        assert (state.log_start, state.hw) == (3, 4)
        assert [m.base for m in await c.meta.list_segments(TOPIC, 0)] == [3]
        assert not any(m.key in c.store.objects for m in segments[:3]) and segments[3].key in c.store.objects
        await lg.close()

    run(go())
