"""Node flushes (storage/wal.py) on the in-memory twins of S3 and etcd: node
objects commit in order, those uploaded while an earlier commit is under way
in one transaction; once one fails (its fence taken), no object after it
commits and nothing it or they held is acknowledged."""
from __future__ import annotations

import asyncio
import gc
import json
import math
import time
import weakref
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from kafscale import _native, metrics
from kafscale.broker import partitions
from kafscale.broker.cluster import Cluster, rendezvous
from kafscale.broker.partitions import PartitionRegistry
from kafscale.broker.shm import SharedArea, SharedCache
from kafscale.config import Config
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import MetaStore, SegmentManifest
from kafscale.protocol.errors import ErrorCode
from kafscale.records import decode_records
from kafscale.storage import wal
from kafscale.storage.cache import CachedSegment
from kafscale.storage.memory import MemoryObjectStore
from kafscale.storage.partition import PartitionLog
from kafscale.storage.reader import LogError, ReadBudget
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE, topic_marker_key
from kafscale.storage.wal import Collector, NodeFlusher, Slice, WalIndex, by_partition, topic_marker
from tests.unit.test_partition import TOPIC, DictCache, append, batch, run


class Node:
    """One log process's flusher and two partitions of TOPIC, its commits gated."""

    def __init__(self) -> None:
        self.etcd = MemoryEtcd()
        self.store = MemoryObjectStore()
        self.meta = MetaStore.in_memory("unit", self.etcd)
        self.cfg = Config(node_id=1, namespace="unit", linger_ms=1, node_flush=True)
        self.fenced = asyncio.Event()
        self.commits: list[list[int]] = []  # the seqs of each commit_wal call, in call order
        self.gate = asyncio.Event()  # commits wait for it
        self.gate.set()
        real = self.meta.commit_wal

        async def gated(fence: str, directories: list[tuple[int, bytes]]) -> None:
            self.commits.append([seq for seq, _ in directories])
            await self.gate.wait()
            await real(fence, directories)

        self.meta.commit_wal = gated  # type: ignore[method-assign]

    async def start(self, partitions: int = 2, cache: SharedCache | None = None
                    ) -> tuple[NodeFlusher, list[PartitionLog]]:
        meta = await self.meta.create_topic(TOPIC, partitions, {})

        async def on_fenced(_fence: str) -> None:
            self.fenced.set()

        cache = cache or DictCache()
        flusher = NodeFlusher(self.cfg, self.store, self.meta, cache, lambda _t: meta.id, on_fenced)
        await flusher.start(await self.etcd.lease(60))
        wal = WalIndex(self.meta)
        logs = [PartitionLog(TOPIC, p, self.cfg, self.store, self.meta, cache, ReadBudget(64 << 20),
                             lambda _lg, _m: None, (flusher, wal, meta.id)) for p in range(partitions)]
        for lg in logs:
            await lg.open()
        return flusher, logs

    async def topic_registry(self, partitions: int, cache: SharedCache | None = None,
                             **cfg: object) -> PartitionRegistry:
        """A registry (see registry) of a node configured with cfg, after
        TOPIC is created with `partitions`."""
        self.cfg = Config(node_id=1, namespace="unit", linger_ms=1, node_flush=True, **cfg)  # type: ignore[arg-type]
        await self.meta.create_topic(TOPIC, partitions, {})
        return await self.registry(cache)

    async def registry(self, cache: SharedCache | None = None) -> PartitionRegistry:
        """A partition registry over this node's stores, started on a lease of
        its own, every partition placed on it."""
        reg = PartitionRegistry(self.cfg, self.store, self.meta, cache or DictCache(), Cluster(self.meta, self.cfg))
        reg.cluster.desired_owner = lambda _t, _p: self.cfg.node_id  # type: ignore[method-assign]
        await reg.start(await self.etcd.lease(60))
        return reg

    def uploaded(self) -> int:
        return sum(k.endswith(".kfn") for k in self.store.objects)

    async def until(self, cond) -> None:
        for _ in range(1000):
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("not reached within 5 s")


@pytest.mark.parametrize("commit_bytes, commits", [
    (wal.COMMIT_BYTES, [[1], [2, 3]]),  # the two objects uploaded meanwhile: one transaction
    (100, [[1], [2], [3]]),  # less than two directories (less than one too): each alone, in order
])
def test_objects_uploaded_during_a_slow_commit_commit_together_in_order(
        monkeypatch: pytest.MonkeyPatch, commit_bytes: int, commits: list[list[int]]):
    """Objects uploaded behind a slow commit commit together, in order, while
    their directories fit COMMIT_BYTES (etcd refuses larger requests, and
    retrying one would hold every producer); a larger directory goes alone."""
    async def go():
        n = Node()
        flusher, (p0, p1) = await n.start()
        n.gate.clear()
        first = append(p0, batch(b"a"))
        await n.until(lambda: n.commits == [[1]])
        later = [append(p0, batch(b"b")), append(p1, batch(b"c"))]
        await n.until(lambda: n.uploaded() == 2)
        later.append(append(p1, batch(b"d")))
        await n.until(lambda: n.uploaded() == 3)
        await asyncio.sleep(0.05)
        assert not first.done() and not any(f.done() for f in later), "nothing acknowledged before its commit"
        assert n.commits == [[1]], "objects behind a commit under way wait for it"
        n.gate.set()
        assert await asyncio.gather(first, *later) == [0, 1, 0, 1]
        assert n.commits == commits
        assert len(await n.meta.wal_keys()) == 3 and (p0.hw, p1.hw) == (2, 2)
        await flusher.stop()

    monkeypatch.setattr(wal, "COMMIT_BYTES", commit_bytes)
    run(go())


def test_a_batch_goes_at_once_with_nothing_under_way_and_gathers_for_the_linger_behind_an_object():
    """With no node object uploading or committing, a batch is cut at once,
    also right after the one before (a client waiting for each
    acknowledgement never waits the broker's linger); the batches queued
    behind an object under way gather for linger_ms and go together."""
    async def go():
        n = Node()
        n.cfg = Config(node_id=1, namespace="unit", linger_ms=1_000, node_flush=True)
        flusher, (p0, p1) = await n.start()
        assert await asyncio.wait_for(append(p0, batch(b"a")), 0.5) == 0, "nothing under way: no linger"
        assert await asyncio.wait_for(append(p1, batch(b"b")), 0.5) == 0, "again right after: no linger"
        n.gate.clear()
        first = append(p0, batch(b"c"))
        await n.until(lambda: n.uploaded() == 3)
        later = [append(p0, batch(b"d")), append(p1, batch(b"e"))]
        n.gate.set()
        assert await first == 1
        await asyncio.sleep(0.2)
        assert n.uploaded() == 3 and not any(f.done() for f in later), "queued behind an object: they gather"
        assert await asyncio.wait_for(asyncio.gather(*later), 5) == [2, 1]
        assert n.uploaded() == 4, "the two gathered batches went in one object"
        await flusher.stop()

    run(go())


def test_batches_of_more_partitions_than_an_object_holds_go_at_once_behind_an_object(
        monkeypatch: pytest.MonkeyPatch):
    """Behind an object under way, MAX_SLICES partitions with batches queued
    are cut at once, object after object, like flush_bytes queued: a request
    naming more partitions than an object holds waited a linger for each of
    its objects after the first. Fewer still gather for the linger."""
    async def go():
        n = Node()
        n.cfg = Config(node_id=1, namespace="unit", linger_ms=2_000, node_flush=True)
        flusher, logs = await n.start(partitions=5)
        n.gate.clear()
        first = append(logs[0], batch(b"a"))
        await n.until(lambda: n.uploaded() == 1)
        full = [append(lg, batch(b"b")) for lg in logs[1:]]  # two objects' worth, in one go
        await asyncio.wait_for(n.until(lambda: n.uploaded() == 3), 1)
        short = append(logs[0], batch(b"c"))
        await asyncio.sleep(0.3)
        assert n.uploaded() == 3, "fewer than MAX_SLICES partitions queued: they gather for the linger"
        n.gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, *full, short), 5) == [0, 0, 0, 0, 0, 1]
        assert n.uploaded() == 4
        await flusher.stop()

    monkeypatch.setattr(wal, "MAX_SLICES", 2)
    run(go())


def test_a_node_object_times_its_stages_from_queued_to_acknowledged():
    """kafscale_node_flush_seconds: per node object, how long its oldest batch
    waited to be cut (the linger, behind an object under way), its upload,
    its commit (here held back) and the whole time from queued to
    acknowledged, which holds the other three."""
    def seen(stage: str) -> tuple[float, float]:
        labels = {"node": metrics.node(), "stage": stage}
        return (REGISTRY.get_sample_value("kafscale_node_flush_seconds_count", labels) or 0.0,
                REGISTRY.get_sample_value("kafscale_node_flush_seconds_sum", labels) or 0.0)

    async def go():
        n = Node()
        n.cfg = Config(node_id=1, namespace="unit", linger_ms=100, node_flush=True)
        flusher, (p0, p1) = await n.start()
        before = {stage: seen(stage) for stage in ("queued", "upload", "commit", "durable")}
        n.gate.clear()
        first = append(p0, batch(b"a"))  # nothing under way: cut at once
        await n.until(lambda: n.commits == [[1]])
        second = append(p1, batch(b"b"))  # behind the first: waits the linger
        await asyncio.sleep(0.05)
        n.gate.set()
        assert await asyncio.gather(first, second) == [0, 0]
        await asyncio.sleep(0)  # the flushes record their last stages as they resume
        after = {stage: seen(stage) for stage in before}
        count = {stage: after[stage][0] - c for stage, (c, _) in before.items()}
        took = {stage: after[stage][1] - s for stage, (_, s) in before.items()}
        assert count == {"queued": 2, "upload": 2, "commit": 2, "durable": 2}, "each stage once per object"
        assert took["queued"] >= 0.1, "the second object's batch waited the linger"
        assert took["commit"] >= 0.05, "the first object's commit was held back"
        assert took["durable"] >= took["queued"] + took["upload"] + took["commit"]
        await flusher.stop()

    run(go())


def test_a_batch_after_a_gap_gathers_for_the_linger_while_an_object_is_under_way():
    """Going at once needs an idle pipeline too: with an object still
    committing, a batch that came after a gap of more than linger_ms is the
    first of a burst, and the ones behind it go along."""
    async def go():
        n = Node()
        n.cfg = Config(node_id=1, namespace="unit", linger_ms=2_000, node_flush=True)
        flusher, (p0, p1) = await n.start()
        n.gate.clear()
        first = append(p0, batch(b"a"))
        await n.until(lambda: n.commits == [[1]])
        await asyncio.sleep(2.1)  # past the linger since that cut, the object still committing
        later = append(p1, batch(b"b"))
        await asyncio.sleep(0.2)
        assert n.uploaded() == 1, "cut at once although an object was under way"
        n.gate.set()
        assert await asyncio.gather(first, later) == [0, 0]
        assert n.uploaded() == 2
        await flusher.stop()

    run(go())


def test_once_a_commit_fails_nothing_after_it_commits_or_is_acknowledged():
    async def go():
        n = Node()
        flusher, (p0, p1) = await n.start()
        n.gate.clear()
        futs = [append(p0, batch(b"a"))]
        await n.until(lambda: n.commits == [[1]])
        futs += [append(p0, batch(b"b")), append(p1, batch(b"c"))]
        await n.until(lambda: n.uploaded() == 2)
        await n.meta.delete_fence(flusher.fence)  # another log process claimed one of our partitions
        n.gate.set()
        results = await asyncio.gather(*futs, return_exceptions=True)
        assert all(isinstance(r, LogError) for r in results), results
        assert await n.meta.wal_keys() == [], "no object committed after the fenced one"
        assert n.commits == [[1]], "the object behind it was never committed"
        await asyncio.wait_for(n.fenced.wait(), 5)
        assert p0.closed and p1.closed
        await flusher.stop()

    run(go())


def test_a_lost_lease_and_a_fenced_object_at_once_keep_offsets_dense():
    """The lease expires (its fence goes with it) while node objects are in
    flight and producers keep writing: drop_all and the fenced flushes'
    re-fence both run. Afterwards one flusher loop runs under one new fence
    and a new owner reads every acknowledged record at its offset, offsets
    dense, each once."""
    from kafscale.broker.cluster import Cluster
    from kafscale.broker.partitions import PartitionRegistry

    async def go():
        n = Node()
        await n.meta.create_topic(TOPIC, 1, {})
        reg = PartitionRegistry(n.cfg, n.store, n.meta, DictCache(), Cluster(n.meta, n.cfg))
        lease = await n.etcd.lease(60)
        await reg.start(lease)
        acked: dict[int, bytes] = {}

        async def produce(tag: str, count: int) -> None:
            for i in range(count):
                value = f"{tag}{i}".encode()
                try:
                    lg = await reg.partition_log(TOPIC, 0)
                    acked[await append(lg, batch(value))] = value
                except LogError:
                    await asyncio.sleep(0.002)  # closed or not open now: a client retries

        writers = [asyncio.create_task(produce(t, 60)) for t in "abc"]
        await n.until(lambda: len(acked) > 20)
        n.gate.clear()  # commits stall: objects pile up behind one
        await asyncio.sleep(0.05)
        old_fence = reg.flusher.fence
        n.etcd.expire(lease)  # the fence goes with the lease; the stalled commit will be fenced
        n.gate.set()
        await reg.drop_all(await n.etcd.lease(60))
        await asyncio.gather(*writers)
        await asyncio.sleep(0.2)  # failure reports of the old fence arrive late: ignored
        assert reg.flusher.fence != old_fence and await n.meta.fences() == {reg.flusher.fence}
        lg = await reg.partition_log(TOPIC, 0)
        await lg.close(drain_s=5)
        await reg.close(drain_s=1)

        again = PartitionRegistry(n.cfg, n.store, n.meta, DictCache(), Cluster(n.meta, n.cfg))
        await again.start(await n.etcd.lease(60))
        reader = await again.partition_log(TOPIC, 0)
        records: list[tuple[int, bytes]] = []
        while (at := records[-1][0] + 1 if records else 0) < reader.hw:
            data = b"".join(bytes(b) for b in await reader.read(at, 1 << 24))
            records += [(rec[0], rec[3]) for b in _native.scan_batches(data, True)
                        for rec in _native.iter_records(b, data) if rec[0] >= at]
            assert records and records[-1][0] >= at, f"nothing served at {at}"
        served = dict(records)
        assert [o for o, _ in records] == list(range(reader.hw)), "offsets dense, each once"
        assert {o: served.get(o) for o in acked} == acked
        await again.close(drain_s=1)

    run(go())


def test_one_live_broker_collects_node_objects():
    meta = MetaStore.in_memory("unit", MemoryEtcd())
    live = {1: ("h", 1), 2: ("h", 2), 3: ("h", 3)}
    clusters = [Cluster(meta, Config(node_id=b, namespace="unit")) for b in live]
    for c in clusters:
        c.brokers = dict(live)
    collecting = [c.me for c in clusters if c.collects()]
    assert len(collecting) == 1
    for c in clusters:  # the collector leaves: another broker takes over
        c.brokers = {b: a for b, a in live.items() if b != collecting[0]}
    assert len([c for c in clusters if c.me != collecting[0] and c.collects()]) == 1


def test_placement_follows_membership_changes():
    meta = MetaStore.in_memory("unit", MemoryEtcd())
    c = Cluster(meta, Config(node_id=1, namespace="unit"))
    c.brokers = {1: ("h", 1), 2: ("h", 2)}
    before = {p: c.desired_owner("t", p) for p in range(200)}
    assert before == {p: rendezvous(f"p|t|{p}", [1, 2]) for p in range(200)} and set(before.values()) == {1, 2}
    c.brokers = {1: ("h", 1), 2: ("h", 2), 3: ("h", 3)}  # a broker joins: remembered placements are dropped
    after = {p: c.desired_owner("t", p) for p in range(200)}
    assert after == {p: rendezvous(f"p|t|{p}", [1, 2, 3]) for p in range(200)} and 3 in after.values()


def test_the_balancer_asks_about_each_open_log_once_a_membership_and_hands_over_when_it_changes():
    async def go():
        n = Node()
        await n.meta.create_topic(TOPIC, 8, {})
        reg = PartitionRegistry(n.cfg, n.store, n.meta, DictCache(), Cluster(n.meta, n.cfg))
        await reg.start(await n.etcd.lease(60))
        logs = [await reg.partition_log(TOPIC, p) for p in range(8)]
        asked, real = [], reg.cluster.desired_owner

        def desired_owner(topic: str, p: int) -> int:
            asked.append(p)
            return real(topic, p)

        reg.cluster.desired_owner = desired_owner  # type: ignore[method-assign]
        await reg.hand_over_misplaced()
        assert sorted(asked) == list(range(8)) and len(reg.logs) == 8, "alone: every partition stays"
        asked.clear()
        await reg.hand_over_misplaced()
        assert asked == [], "placed here under this membership already"
        reg.cluster.brokers = {1: ("h", 1), 2: ("h", 2)}  # a broker joins
        await reg.hand_over_misplaced()
        moved = {p for p in range(8) if rendezvous(f"p|{TOPIC}|{p}", [1, 2]) == 2}
        assert sorted(asked) == list(range(8)) and moved
        assert {p for _, p in reg.logs} == set(range(8)) - moved and all(logs[p].closed for p in moved)
        await reg.close(drain_s=1)

    run(go())


def test_the_collector_keeps_an_object_of_a_partition_claimed_during_its_pass():
    """A partition claimed for the first time, and a node object committed for
    it, while a collection pass runs: the pass must not take the missing state
    it might have read before the claim for a deleted topic's."""
    async def go():
        n = Node()
        meta = await n.meta.create_topic(TOPIC, 2, {})

        async def on_fenced(_fence: str) -> None:
            n.fenced.set()

        cache = DictCache()
        flusher = NodeFlusher(n.cfg, n.store, n.meta, cache, lambda _t: meta.id, on_fenced)
        await flusher.start(await n.etcd.lease(60))
        p1 = PartitionLog(TOPIC, 1, n.cfg, n.store, n.meta, cache, ReadBudget(64 << 20),
                          lambda _lg, _m: None, (flusher, WalIndex(n.meta), meta.id))
        real_keys, claimed = n.meta.wal_keys, []

        async def claim_then_keys(area: str = "wal") -> list[bytes]:
            if not claimed:  # during the pass: the first claim of partition 1, and an acked record
                claimed.append(True)
                await p1.open()
                await append(p1, batch(b"new"))
            return await real_keys(area)

        n.meta.wal_keys = claim_then_keys  # type: ignore[method-assign]
        assert await Collector(n.meta, n.store, "unit").run() == 0, "the object of partition 1 is live"
        assert len(await real_keys()) == 1
        await flusher.stop()

    run(go())


def test_the_flusher_hands_its_collector_the_summaries_of_what_it_committed(monkeypatch):
    """The node objects a flusher committed are handed to this broker's
    collector as the summaries it would parse from their directories, once
    each; a pass given them reads no directory of them back from etcd. Those
    nobody takes are kept up to HANDED_MAX, the newest."""
    async def go():
        n = Node()
        meta = await n.meta.create_topic(TOPIC, 4, {})
        other = await n.meta.create_topic("other", 2, {})
        ids = {TOPIC: meta.id, "other": other.id}

        async def on_fenced(_fence: str) -> None:
            n.fenced.set()

        cache = DictCache()
        flusher = NodeFlusher(n.cfg, n.store, n.meta, cache, ids.get, on_fenced)
        await flusher.start(await n.etcd.lease(60))
        logs = [PartitionLog(t, p, n.cfg, n.store, n.meta, cache, ReadBudget(64 << 20), lambda _lg, _m: None,
                             (flusher, WalIndex(n.meta), ids[t])) for t, p in ((TOPIC, 3), ("other", 1), (TOPIC, 0))]
        for lg in logs:
            await lg.open()
        for i in range(3):
            await asyncio.gather(*(append(lg, batch(bytes([97 + i]) * (i + 1))) for lg in logs[i:]))
        directories = dict(await n.meta.wal_directories())
        handed = flusher.handed_over()
        assert len(directories) >= 2 and handed == {k: wal._summary(raw, False) for k, raw in directories.items()}
        assert flusher.handed_over() == {}, "each once"
        asked: list[bytes] = []
        real = n.meta.wal_directories_of

        async def wal_directories_of(keys: list[bytes], area: str = "wal") -> dict[bytes, bytes]:
            asked.extend(keys)
            return await real(keys, area)

        n.meta.wal_directories_of = wal_directories_of  # type: ignore[method-assign]
        assert await Collector(n.meta, n.store, "unit").run(handed) == 0, "nothing compacted yet"
        assert asked == []
        monkeypatch.setattr(wal, "HANDED_MAX", 1)
        for i in range(2):
            await append(logs[0], batch(b"late %d" % i))
        newest = max(k for k, _ in await n.meta.wal_directories())
        assert list(flusher.handed_over()) == [newest]
        await flusher.stop()

    run(go())


def test_a_pass_deletes_its_objects_in_small_requests_spread_over_the_time_to_the_next(monkeypatch):
    """The objects a collector pass forgets go in DELETE_BATCH-key requests,
    evenly over the time to the next pass (one request for all of them took
    SeaweedFS a core for 0.3-0.4 s at 350 objects); a failed request leaves
    its objects to the orphan sweep and the others still go."""
    async def go():
        store = MemoryObjectStore()
        keys = [f"node/{i}" for i in range(3 * wal.DELETE_BATCH + 3)]
        for k in keys:
            await store.put(k, b"x")
        requests: list[list[str]] = []
        slept: list[float] = []
        real_delete_many = store.delete_many

        async def delete_many(batch: list[str]) -> None:
            requests.append(list(batch))
            if len(requests) == 2:
                raise OSError("the store refused")
            await real_delete_many(batch)

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        store.delete_many = delete_many  # type: ignore[method-assign]
        monkeypatch.setattr(wal.asyncio, "sleep", sleep)
        await wal._delete(store, keys, 8.0)
        assert [len(r) for r in requests] == [wal.DELETE_BATCH] * 3 + [3]
        assert [k for r in requests for k in r] == keys
        assert slept == [2.0, 2.0, 2.0], "four requests over 8 s: the first at once, then one every 2 s"
        assert sorted(o["Key"] for o in await store.list("node/")) == sorted(requests[1]), "left for the sweep"

    run(go())


def test_a_first_claim_reads_nothing_and_a_later_owner_finds_every_slice():
    """A partition's first claim (epoch 1) reads no segment keys and scans no
    node object directories: nobody wrote to it before (a new 10,000-partition
    topic opened with 10,000 of each). The next owner reads both and continues
    after every acknowledged record."""
    async def go():
        n = Node()
        meta = await n.meta.create_topic(TOPIC, 1, {})
        cache = DictCache()
        flusher = NodeFlusher(n.cfg, n.store, n.meta, cache, lambda _t: meta.id, lambda _f: asyncio.sleep(0))
        await flusher.start(await n.etcd.lease(60))
        wal = WalIndex(n.meta)
        reads = {"segments": 0, "scans": 0}
        real_segments, real_read = n.meta.list_segments, wal._read

        async def list_segments(topic: str, p: int):
            reads["segments"] += 1
            return await real_segments(topic, p)

        async def scan():
            reads["scans"] += 1
            return await real_read()

        n.meta.list_segments = list_segments  # type: ignore[method-assign]
        wal._read = scan  # type: ignore[method-assign]

        def owner() -> PartitionLog:
            return PartitionLog(TOPIC, 0, n.cfg, n.store, n.meta, cache, ReadBudget(64 << 20),
                                lambda _lg, _m: None, (flusher, wal, meta.id))

        first = owner()
        await first.open()
        assert first.epoch == 1 and reads == {"segments": 0, "scans": 0}, "the first owner looked for nothing"
        assert await asyncio.gather(append(first, batch(b"a")), append(first, batch(b"b"))) == [0, 1]
        await first.close()
        again = owner()
        await again.open()
        assert reads == {"segments": 1, "scans": 1}, "the second owner looked"
        assert (again.epoch, again.hw) == (2, 2)
        assert await append(again, batch(b"c")) == 2
        await again.close()
        await flusher.stop()

    run(go())


@pytest.mark.parametrize("shared", [False, True])
def test_due_compactions_start_oldest_first_spread_over_half_the_lag(monkeypatch, shared):
    """Partitions that fall due together are not compacted all at once: each
    check starts the due ones' share of half the compaction lag, evenly
    spread, oldest first. With shared compaction, small ones are gathered
    (up to SHARED_GATHER) into one shared object instead."""
    import time

    from kafscale.broker import partitions as registry

    monkeypatch.setattr(registry, "COMPACTION_CHECK_S", 0.02)

    async def go():
        n = Node()
        reg = await n.topic_registry(10, compaction_lag_ms=200, shared_compaction=shared)
        logs = [await reg.partition_log(TOPIC, p) for p in range(10)]
        if shared:  # in one node object: due at once
            await asyncio.gather(*(append(lg, batch(b"x")) for lg in logs))
        for lg in reversed(logs if not shared else []):  # partition 9's slice is the oldest
            await append(lg, batch(b"x"))
            await asyncio.sleep(0.003)
        started: list[tuple[float, list[int]]] = []
        real_compact = PartitionLog.compact

        async def compact(lg: PartitionLog) -> None:
            started.append((time.monotonic(), [lg.partition]))
            await real_compact(lg)

        monkeypatch.setattr(PartitionLog, "compact", compact)
        real_shared = registry.compact_shared

        async def compact_shared(logs, *args):
            started.append((time.monotonic(), [lg.partition for lg in logs]))
            return await real_shared(logs, *args)

        monkeypatch.setattr(registry, "compact_shared", compact_shared)
        loop = asyncio.create_task(reg.compaction_loop())
        await n.until(lambda: all(lg.oldest_slice_ms() == 0 for lg in logs))
        await n.until(lambda: not reg.flusher.sliced)  # a check drops the logs with no slices left
        await append(logs[3], batch(b"y"))
        assert list(reg.flusher.sliced) == [logs[3]], "a committed slice brings its log back"
        loop.cancel()
        if shared:  # ten small ones: one shared object
            assert len(started) == 1 and sorted(started[0][1]) == list(range(10)), started
        else:  # oldest first, spread over half the lag (5 checks of 0.02 s): two per check, not ten in the first
            assert [p for _, ps in started for p in ps] == list(range(9, -1, -1)), "oldest first, each once"
            assert len(started) == 10
            assert started[-1][0] - started[0][0] >= 0.06, [round(t - started[0][0], 3) for t, _ in started]
        await reg.close(drain_s=1)

    run(go())


def test_a_check_groups_its_due_partitions_a_turn_at_a_time_into_runs_of_neighbours(monkeypatch):
    """The due partitions a check starts are grouped into shared objects
    BATCHING_TURN at a time (the event loop runs other work between turns),
    each turn of neighbours, whatever order their slices came in."""
    monkeypatch.setattr(partitions, "COMPACTION_CHECK_S", 0.02)
    monkeypatch.setattr(partitions, "BATCHING_TURN", 4)

    async def go():
        n = Node()
        reg = await n.topic_registry(10, compaction_lag_ms=100)
        logs = [await reg.partition_log(TOPIC, p) for p in range(10)]
        await asyncio.gather(*(append(lg, batch(b"x")) for lg in reversed(logs)))
        started: list[list[int]] = []
        real_shared = partitions.compact_shared

        async def compact_shared(logs, *args):
            started.append([lg.partition for lg in logs])
            return await real_shared(logs, *args)

        monkeypatch.setattr(partitions, "compact_shared", compact_shared)
        loop = asyncio.create_task(reg.compaction_loop())
        await n.until(lambda: all(lg.oldest_slice_ms() == 0 for lg in logs))
        loop.cancel()
        assert sorted(started) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], started
        await reg.close(drain_s=1)

    run(go())


def test_a_partition_with_segments_of_slices_waiting_is_compacted_without_waiting_a_check_each(monkeypatch):
    """A compaction takes at most segment.bytes of a partition's slices. One
    that leaves a whole segment.bytes more waiting starts the next at once:
    with one compaction a check (a second), a partition written faster than
    segment.bytes a second fell ever further behind. Here a check is an hour
    apart, so only that brings the slices below a segment's worth."""
    from kafscale.broker import partitions as registry

    monkeypatch.setattr(registry, "COMPACTION_CHECK_S", 3600.0)

    async def go():
        n = Node()
        reg = await n.topic_registry(1, compaction_lag_ms=3_600_000, segment_bytes=4096, shared_compaction=False)
        lg = await reg.partition_log(TOPIC, 0)
        for i in range(20):  # a node object each: about five segments' worth of slices
            await append(lg, batch(bytes([97 + i]) * 1000))
        assert lg.holds_segment() and lg.compaction_bytes() <= 4096
        loop = asyncio.create_task(reg.compaction_loop())
        await n.until(lambda: not lg.holds_segment())
        loop.cancel()
        compacted = lg.segments[:len(lg.segments) - len(lg._slices())]
        assert len(compacted) >= 4, "a compacted segment for each segment's worth"
        values = []
        for m in compacted:
            data = await n.store.get(m.key)
            values += [r.value for r in decode_records(m.base, data[HEADER_SIZE:len(data) - FOOTER_SIZE], 0)[0]]
        assert values == [bytes([97 + i]) * 1000 for i in range(len(values))], "every record once, in order"
        assert lg.checkpoint == len(values) == lg._slices()[0].base

        tried = []

        async def failing(_: PartitionLog) -> None:  # S3 refusing the segment: tried at the next check, not at once
            tried.append(time.monotonic())
            raise OSError("S3 is down")

        monkeypatch.setattr(PartitionLog, "compact", failing)
        for _ in range(8):
            await append(lg, batch(b"y" * 1000))
        loop = asyncio.create_task(reg.compaction_loop())
        await n.until(lambda: tried)
        await asyncio.sleep(0.2)
        loop.cancel()
        assert len(tried) == 1, "a failed compaction waits for the next check"
        await reg.close(drain_s=1)

    run(go())


def test_compaction_reads_its_slices_from_a_cache_that_keeps_them_for_less_than_the_lag(monkeypatch):
    """A cache written faster than it keeps slices for compaction_lag_ms
    brings compaction forward, so that compaction finds its slices there: it
    used to read each one back with a GET of its own."""
    from kafscale.broker import partitions as registry

    monkeypatch.setattr(registry, "COMPACTION_CHECK_S", 0.02)

    async def go():
        n = Node()
        cache = SharedCache(SharedArea(1, 64, 1 << 20))
        # (no shared objects: merging their segments would put bursts the size of the whole cache in it)
        reg = await n.topic_registry(8, cache, compaction_lag_ms=2000, shared_compaction=False)
        logs = [await reg.partition_log(TOPIC, p) for p in range(8)]
        read: list[str] = []
        real_get = n.store.get

        async def get(key: str, start: int | None = None, end: int | None = None) -> bytes:
            read.append(key)
            return await real_get(key, start, end)

        n.store.get = get  # type: ignore[method-assign]
        loop = asyncio.create_task(reg.compaction_loop())
        start = time.monotonic()
        while time.monotonic() - start < 3:  # about 300 KiB/s of slices, and more of what is compacted from them
            await asyncio.gather(*(append(lg, batch(b"x" * 500)) for lg in logs))
            await asyncio.sleep(0.01)
        assert cache.keeps_s() * 1000 < n.cfg.compaction_lag_ms, "the cache keeps slices for less than the lag"
        await n.until(lambda: all(lg.oldest_slice_ms() == 0 for lg in logs))
        loop.cancel()
        assert not [k for k in read if "/~node/" in k], "every slice compacted from the cache"
        await reg.close(drain_s=1)

    run(go())


def test_a_compaction_keeps_what_it_read_from_the_cache_while_later_segments_overwrite_it():
    """A slice taken from the shared cache is a view of its ring. Compaction
    awaits the GETs of the slices the cache lacks while committed segments
    go on being written into the ring: the compacted segment must hold the
    cached slice's records, not what overwrote its bytes meanwhile (the same
    sizes, so that they parse as batches too), and the cached slice is not
    read back from S3 (with the ring behind compaction, a GET each made it
    fall further behind)."""
    async def go():
        n = Node()
        cache = SharedCache(SharedArea(1, 64, 64 << 10))
        flusher, (lg, _) = await n.start(cache=cache)
        for v in (b"a", b"b"):
            await append(lg, batch(v * 1000))
        first, second = lg._slices()
        assert first.key != second.key, "two node objects"
        del cache.objects[second.key]  # as when a worker pinned the ring while it was committed: compaction GETs it
        real_get = n.store.get

        gets = []

        async def get(key: str, start: int | None = None, end: int | None = None) -> bytes:
            gets.append(start)
            other = CachedSegment.from_object(await real_get(key, start, end))
            other.data = bytes(other.data).replace(b"b" * 1000, b"z" * 1000)  # batches of the same size
            for i in range(cache.size // len(other.data) + 1):  # the ring goes round once meanwhile
                cache.put(SegmentManifest(0, 0, 1, 0, 0, 0, f"other-{i}", 0), other)
            return await real_get(key, start, end)

        n.store.get = get  # type: ignore[method-assign]
        await lg.compact()
        [compacted] = lg.segments
        data = await real_get(compacted.key)
        records, _ = decode_records(0, data[HEADER_SIZE:len(data) - FOOTER_SIZE], 0)
        assert [(r.offset, r.value) for r in records] == [(0, b"a" * 1000), (1, b"b" * 1000)]
        assert gets == [second.pos], "only the slice the cache did not hold"
        await lg.close()
        await flusher.stop()

    run(go())


def test_a_compaction_reads_the_slices_no_longer_cached_a_few_at_a_time():
    """One GET after another, a compaction that fell behind the cache read
    hundreds of slices in turn and fell further behind."""
    from kafscale.storage import partition

    async def go():
        n = Node()
        flusher, (lg, _) = await n.start(cache=SharedCache(SharedArea(1, 64, 0)))  # caches nothing
        for i in range(6):
            await append(lg, batch(b"v%d" % i))
        reading, most = [0], [0]
        real_get = n.store.get

        async def get(key: str, start: int | None = None, end: int | None = None) -> bytes:
            reading[0] += 1
            most[0] = max(most[0], reading[0])
            await asyncio.sleep(0.01)
            reading[0] -= 1
            return await real_get(key, start, end)

        n.store.get = get  # type: ignore[method-assign]
        await lg.compact()
        assert most[0] == partition.COMPACTION_READS_AT_ONCE
        [compacted] = lg.segments
        data = await real_get(compacted.key)
        records, _ = decode_records(0, data[HEADER_SIZE:len(data) - FOOTER_SIZE], 0)
        assert [r.value for r in records] == [b"v%d" % i for i in range(6)], "in offset order"
        await lg.close()
        await flusher.stop()

    run(go())


def test_the_slices_counted_are_always_the_tail_of_the_segments():
    """The compaction check reads the committed slices' count, bytes and
    oldest from counters, not a walk: through appends, a compaction, more
    appends, DeleteRecords and a reopen they equal what a walk finds."""
    def walked(lg: PartitionLog) -> tuple[int, int, int]:
        tail = [m for m in lg.segments if m.pos >= 0 and m.base >= lg.checkpoint]
        return len(tail), sum(m.size for m in tail), tail[0].created_ms if tail else 0

    def counted(lg: PartitionLog) -> tuple[int, int, int]:
        return lg._slice_count, lg._slice_bytes, lg.oldest_slice_ms()

    async def go():
        n = Node()
        flusher, (lg, _) = await n.start()
        for i in range(3):
            await append(lg, batch(b"a%d" % i))
        assert counted(lg) == walked(lg) and lg._slice_count == 3
        lag = n.cfg.compaction_lag_ms
        assert lg.compaction_due(lg.oldest_slice_ms() + lag, lag, lag)
        assert not lg.compaction_due(lg.oldest_slice_ms() + lag - 1, lag, lag)
        await lg.compact()
        assert counted(lg) == walked(lg) == (0, 0, 0) and not lg.compaction_due(2**62, lag, lag)
        for i in range(2):
            await append(lg, batch(b"b%d" % i))
        assert counted(lg) == walked(lg) and lg._slice_count == 2
        await lg.delete_records(4)  # the compacted segment and the first slice go
        assert counted(lg) == walked(lg) and lg._slice_count == 1
        await lg.close()
        again = PartitionLog(TOPIC, 0, n.cfg, n.store, n.meta, lg.cache, ReadBudget(64 << 20),
                             lambda _lg, _m: None, lg.node)
        await again.open()
        assert counted(again) == walked(again) and again._slice_count >= 1
        await again.close()
        await flusher.stop()

    run(go())


def test_a_partition_with_few_bytes_of_slices_waits_the_small_lag():
    """Slices of fewer than SMALL_SLICES_BYTES are due once the oldest is
    small_lag_ms old, more once it is lag_ms old; the registry's small lag
    is SMALL_LAG_FACTOR configured lags while the cache keeps slices that
    long, shorter while it does not, and never shorter than the lag."""
    from kafscale.broker.partitions import COMPACTION_CACHE_SHARE, SMALL_LAG_FACTOR
    from kafscale.storage.partition import SMALL_SLICES_BYTES

    async def go():
        n = Node()
        reg = await n.topic_registry(1, compaction_lag_ms=2000)
        lg = await reg.partition_log(TOPIC, 0)
        await append(lg, batch(b"x"))
        t0 = lg.oldest_slice_ms()
        assert not lg.compaction_due(t0 + 999, 1000, 3000) and not lg.compaction_due(t0 + 2999, 1000, 3000)
        assert lg.compaction_due(t0 + 3000, 1000, 3000)
        await append(lg, batch(b"y" * SMALL_SLICES_BYTES))
        assert not lg.compaction_due(t0 + 999, 1000, 3000) and lg.compaction_due(t0 + 1000, 1000, 3000)

        assert reg.cache.keeps == math.inf and reg.compaction_lags() == (2000, SMALL_LAG_FACTOR * 2000)
        reg.cache.keeps = 4 / COMPACTION_CACHE_SHARE  # compaction may wait 4 s for slices in the cache
        assert reg.compaction_lags() == (2000, 4000)
        reg.cache.keeps = 1.5 / COMPACTION_CACHE_SHARE
        assert reg.compaction_lags() == (1500, 1500)
        await reg.close(drain_s=1)

    run(go())


@pytest.mark.parametrize("closed_during", ["upload", "commit"])
def test_a_compaction_under_way_at_a_hand_over_does_not_put_the_fence_back(closed_during):
    """A partition handed over while its compaction uploads or commits: the
    fence is cleared, and stays cleared (a compaction committing after the
    clear put the fence back, and the next owner's claim then fenced every
    partition of the node). Closed during the upload, the release does not
    wait for it, and the compaction commits nothing and deletes its segment;
    closed during the commit, the commit lands first."""
    async def go():
        n = Node()
        flusher, (lg, _) = await n.start()
        await append(lg, batch(b"a"))
        gate, real_put, real_commit = asyncio.Event(), n.store.put, n.meta.commit_segment

        async def put(key: str, *args, **kwargs):
            if key.endswith(".kfs") and closed_during == "upload":  # the compacted segment
                await gate.wait()
            return await real_put(key, *args, **kwargs)

        async def commit_segment(*args, **kwargs):
            if closed_during == "commit":
                await gate.wait()
            return await real_commit(*args, **kwargs)

        n.store.put = put  # type: ignore[method-assign]
        n.meta.commit_segment = commit_segment  # type: ignore[method-assign]
        compaction = asyncio.create_task(lg.compact())
        await asyncio.sleep(0.01)
        await lg.close()
        release = asyncio.create_task(lg.release_fence())
        await asyncio.sleep(0.01)
        assert release.done() == (closed_during == "upload"), "the release waits for a commit, not an upload"
        gate.set()
        await asyncio.gather(compaction, release)
        state = (await n.meta.partition_states())[(TOPIC, 0)]
        compacted = closed_during == "commit"
        assert (state.fence, state.hw) == ("", 1 if compacted else 0)
        assert any(k.endswith(".kfs") for k in n.store.objects) == compacted
        await flusher.stop()

    run(go())


def test_a_hand_over_is_one_transaction_a_partition_and_takes_nothing_that_moved():
    """A partition handed over clears our fence and drops its owner key in
    one transaction. One whose owner key another broker holds keeps that key
    and still has our fence cleared; one claimed by another broker since is
    left alone (its new owner's state stays)."""
    async def go():
        n = Node()
        reg = await n.topic_registry(6)
        logs = [await reg.partition_log(TOPIC, p) for p in range(6)]
        before = n.etcd.txns
        for p in range(4):
            await reg.release_partition(TOPIC, p, logs[p], drain_s=1)
        assert n.etcd.txns - before == 4
        await n.etcd.put(n.meta.k("owners", TOPIC, 4), b"2")
        claimed, _ = await n.meta.claim_partition(TOPIC, 5, 2)
        for p in (4, 5):
            await reg.release_partition(TOPIC, p, logs[p], drain_s=1)
        states = await n.meta.partition_states()
        assert [await n.meta.owner_of(TOPIC, p) for p in range(6)] == [None] * 4 + [2, 1]
        assert [states[(TOPIC, p)].fence for p in range(5)] == [""] * 5 and states[(TOPIC, 5)] == claimed
        await reg.close(drain_s=1)

    run(go())


def test_partitions_handed_over_together_share_transactions():
    """A stopping broker hands its partitions over HANDOVER_BATCH to a
    transaction (10,000 partitions took 10,001 transactions). In a batch in
    which one partition's owner key moved, the others are handed over alone
    and that one keeps its new owner, with our fence cleared."""
    from kafscale.metadata.store import HANDOVER_BATCH

    async def go():
        for moved in (None, 150):
            n = Node()
            reg = await n.topic_registry(300)
            for p in range(300):
                await reg.partition_log(TOPIC, p)
            if moved is not None:
                await n.etcd.put(n.meta.k("owners", TOPIC, moved), b"2")
            before = n.etcd.txns
            await reg.close(drain_s=1)
            took = n.etcd.txns - before
            # a batch of one for the first release, then full ones, four at a time (one more the flusher's)
            assert took <= 2 + -(-300 // HANDOVER_BATCH) + (HANDOVER_BATCH + 2 if moved else 0), took
            states = await n.meta.partition_states()
            assert {states[(TOPIC, p)].fence for p in range(300)} == {""}
            assert [await n.meta.owner_of(TOPIC, p) for p in range(300)] == [
                2 if p == moved else None for p in range(300)]

    run(go())


def test_a_rebalance_hands_the_misplaced_partitions_over_together():
    """Partitions another broker should have now are handed over in shared
    transactions too (one after another, they took one each)."""
    from kafscale.metadata.store import HANDOVER_BATCH

    async def go():
        n = Node()
        reg = await n.topic_registry(300)
        for p in range(300):
            await reg.partition_log(TOPIC, p)
        reg.cluster.desired_owner = lambda _t, p: 2 if p % 2 else 1  # type: ignore[method-assign]
        before = n.etcd.txns
        await reg.hand_over_misplaced()
        assert n.etcd.txns - before <= 1 + -(-150 // HANDOVER_BATCH), n.etcd.txns - before
        assert {p for _, p in reg.logs} == set(range(0, 300, 2))
        assert [await n.meta.owner_of(TOPIC, p) for p in range(300)] == [None if p % 2 else 1 for p in range(300)]
        await reg.close(drain_s=1)

    run(go())


def test_partitions_opened_all_at_once_are_claimed_in_batches_a_few_at_a_time(monkeypatch):
    """A first produce to a large topic opens every partition at once; their
    claims go CLAIM_BATCH to a transaction, a few transactions at a time (10,000
    single claims at once queued the broker's lease refresh past its TTL). One
    another broker owns is left out of its batch and refused on its own; an
    earlier owner's fence is deleted, once."""
    from kafscale.broker import partitions as registry
    from kafscale.metadata.store import CLAIM_BATCH

    monkeypatch.setattr(registry, "CLAIM_BATCHES_AT_ONCE", 2)

    async def go():
        n = Node()
        await n.meta.create_topic(TOPIC, 200, {})
        other = await n.etcd.lease(60)
        assert await n.meta.claim_owner(TOPIC, 7, 99, other)
        await n.meta.create_fence("old", other)
        await n.meta.claim_partition(TOPIC, 9, 99, "old")  # owned once by a process since gone
        reg = await n.registry()
        in_flight, peak, sizes = [0], [0], []
        real = n.meta.claim_partitions

        async def claim_partitions(topic, parts, *args):
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            sizes.append(len(parts))
            try:
                await asyncio.sleep(0.005)
                return await real(topic, parts, *args)
            finally:
                in_flight[0] -= 1

        n.meta.claim_partitions = claim_partitions  # type: ignore[method-assign]
        txns = n.etcd.txns
        for p in range(200):
            reg.open_soon(TOPIC, p)
        logs = await asyncio.gather(*(reg.partition_log(TOPIC, p) for p in range(200)), return_exceptions=True)
        assert peak[0] == 2, f"{peak[0]} batches at once"
        assert sorted(sizes, reverse=True) == [CLAIM_BATCH] * (200 // CLAIM_BATCH) + [200 % CLAIM_BATCH]
        refused = logs.pop(7)
        assert isinstance(refused, LogError) and "owned by broker 99" in str(refused)
        assert [lg.epoch for lg in logs] == [1] * 8 + [2] + [1] * 190
        assert len({lg.fence for lg in logs}) == 1 and logs[0].fence == reg.flusher.fence
        assert await n.etcd.get(n.meta.k("fences", "old")) is None
        owners = await n.meta.owners()
        assert sum(o == n.cfg.node_id for o in owners.values()) == 199 and owners[(TOPIC, 7)] == 99
        # a read and a claim per batch, and partition 7's own attempts (two owner compares and the owner's read)
        assert n.etcd.txns - txns == 2 * len(sizes) + 2
        await reg.close(drain_s=1)

    run(go())


def test_a_batch_of_claims_claims_nothing_if_a_key_moved_after_it_was_read():
    """claim_partitions reads the keys, then claims in one transaction comparing
    what it read: another claim in between fails the whole batch, and the
    caller claims each alone."""
    async def go():
        etcd = MemoryEtcd()
        meta = MetaStore.in_memory("unit", etcd)
        await meta.create_topic(TOPIC, 3, {})
        lease = await etcd.lease(60)
        real = etcd.transaction

        async def racing(compare, success, failure):
            if compare:  # the claim, after the read: another broker claims partition 1 first
                etcd.transaction = real
                await meta.claim_partition(TOPIC, 1, 9)
            return await real(compare, success, failure)

        etcd.transaction = racing
        assert await meta.claim_partitions(TOPIC, [0, 1, 2], 1, lease, "f") == {}
        assert await meta.get_partition(TOPIC, 0) is None and (await meta.get_partition(TOPIC, 1))[0].owner == 9
        assert await meta.owners() == {}
        claimed = await meta.claim_partitions(TOPIC, [0, 1, 2], 1, lease, "f")
        assert {p: s.epoch for p, (s, _) in claimed.items()} == {0: 1, 1: 2, 2: 1}
        assert {p: raw for p, (_, raw) in claimed.items()} == {p: (await meta.get_partition(TOPIC, p))[1]
                                                                for p in range(3)}

    run(go())


def test_the_wal_index_follows_the_directories_committed_and_forgotten_between_scans():
    """Each scan reads only the directories new since the last one and drops the
    forgotten ones' slices: a partition's slices are always those of the
    directories committed now, oldest first, as reading all of them gives."""
    async def go():
        etcd = MemoryEtcd()
        meta = MetaStore.in_memory("unit", etcd)
        await meta.create_fence("f", await etcd.lease(60))
        wal, tid, committed = WalIndex(meta), b"\x01" * 16, {}

        async def commit(seq: int, bases: dict[int, int]) -> None:  # partition -> the base of its slice
            committed[seq] = json.dumps({"key": f"obj{seq}", "created_ms": 0, "slices": [
                {"topic": TOPIC, "topic_id": tid.hex(), "partition": p, "base": b, "last": b, "count": 1,
                 "size": 1, "min_ts": 0, "max_ts": 0, "producers": {}, "pos": 0} for p, b in bases.items()]}).encode()
            await meta.commit_wal("f", [(seq, committed[seq])])

        async def forget(seq: int) -> None:
            del committed[seq]
            await meta.forget_wal([k for k in await meta.wal_keys() if k.endswith(b"%012d" % seq)])

        async def agrees() -> None:
            want = by_partition(list(committed.values()))
            for p in range(3):
                got = await wal.slices(tid, p, time.monotonic())
                assert [(m.key, m.base) for m in got] == [(m.key, m.base) for m in want.get((tid.hex(), p), [])]

        await commit(1, {0: 0, 1: 0})
        await commit(2, {0: 1, 2: 0})
        await agrees()
        await commit(4, {0: 3})
        await commit(3, {0: 2, 1: 1})  # read in the same scan as 4: still oldest first
        await forget(1)
        await agrees()
        await forget(2)
        await forget(3)
        await commit(5, {2: 1})
        await agrees()
        assert [m.base for m in await wal.slices(tid, 0, time.monotonic())] == [3]
        assert await wal.slices(tid, 1, time.monotonic()) == []

    run(go())


def test_new_directories_are_read_by_the_range_of_their_keys_not_the_whole_area():
    """A collector pass reads the directories committed since the last: with
    more than a get each would take, only the range from the first new key to
    the last of each fence, not every directory still there."""
    async def go():
        etcd = MemoryEtcd()
        meta = MetaStore.in_memory("unit", etcd)
        lease = await etcd.lease(60)
        for fence in ("a", "b"):
            await meta.create_fence(fence, lease)
            for first in range(1, 201, 50):
                await meta.commit_wal(fence, [(seq, b"%d" % seq) for seq in range(first, first + 50)])
        read = []
        range_page = etcd.range_page

        async def counted(*args):
            kvs, more, revision = await range_page(*args)
            read.extend(kv.key for kv in kvs)
            return kvs, more, revision

        etcd.range_page = counted
        keys = await meta.wal_keys()
        want = keys[160:200] + keys[390:400]  # a's newest 40, b's newest 10
        read.clear()
        got = await meta.wal_directories_of(want)
        assert sorted(got) == sorted(want) and all(got[k] == k.rsplit(b"/", 1)[1].lstrip(b"0") for k in want)
        assert sorted(read) == sorted(want)

    run(go())


def test_claims_during_a_wal_scan_share_the_next_one():
    """A claim waits for a scan that began after it; the claims that come while
    one scan runs all wait for the same next one, not one each."""
    async def go():
        etcd = MemoryEtcd()
        meta = MetaStore.in_memory("unit", etcd)
        wal, gate, scans = WalIndex(meta), asyncio.Event(), []
        real = meta.wal_keys

        async def wal_keys(area: str = "wal") -> list[bytes]:
            scans.append(time.monotonic())
            await gate.wait()
            return await real(area)

        meta.wal_keys = wal_keys  # type: ignore[method-assign]
        first = asyncio.create_task(wal.slices(b"\x01" * 16, 0, time.monotonic()))
        await asyncio.sleep(0.01)
        later = []
        for p in range(5):  # one after another, each after the previous one asked for a scan
            later.append(asyncio.create_task(wal.slices(b"\x01" * 16, p, time.monotonic())))
            await asyncio.sleep(0.002)
        assert len(scans) == 1, "the next scan waits for the one under way"
        gate.set()
        await asyncio.gather(first, *later)
        assert len(scans) == 2, "the five claims made during the first scan shared the second"

    run(go())


def test_an_opener_cancelled_while_claiming_fails_those_who_joined_it():
    """The first opener of a partition cancelled while its claim waits in a
    batch: a request that joined that open gets a retriable error at once (it
    waited forever before), and the next request opens the partition."""
    async def go():
        n = Node()
        await n.meta.create_topic(TOPIC, 1, {})
        reg = await n.registry()
        gate, real = asyncio.Event(), n.meta.claim_partitions

        async def claim_partitions(*args):
            await gate.wait()
            return await real(*args)

        n.meta.claim_partitions = claim_partitions  # type: ignore[method-assign]
        first = asyncio.create_task(reg.partition_log(TOPIC, 0))
        await asyncio.sleep(0.01)
        joined = asyncio.create_task(reg.partition_log(TOPIC, 0))
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(LogError) as refused:
            await asyncio.wait_for(joined, 1)
        assert refused.value.code == ErrorCode.LEADER_NOT_AVAILABLE
        gate.set()
        lg = await asyncio.wait_for(reg.partition_log(TOPIC, 0), 5)
        assert lg.epoch >= 1 and reg.is_open(TOPIC, 0)
        await reg.close(drain_s=1)

    run(go())


def test_opened_partitions_are_frozen_and_freed_without_the_collector_once_closed(monkeypatch):
    """Every FREEZE_OPENS opens the collector's generations are frozen: the
    open partitions' objects are not scanned again. A closed partition's
    frozen objects still go when its last reference does (no cycle holds
    them: a frozen one would never be collected), written to or not."""
    monkeypatch.setattr(partitions, "FREEZE_OPENS", 4)

    async def go():
        n = Node()
        reg = await n.topic_registry(5, compaction_lag_ms=100)
        compaction = asyncio.create_task(reg.compaction_loop())
        gc.disable()
        try:
            logs = [await reg.partition_log(TOPIC, p) for p in range(4)]
            tracked = {id(o) for o in gc.get_objects()}
            assert not any(id(lg) in tracked for lg in logs), "frozen"
            await asyncio.gather(*(append(lg, batch(b"v")) for lg in logs[:2]))
            gone = [weakref.ref(lg) for lg in logs]
            for p, lg in enumerate(logs):
                await reg.release_partition(TOPIC, p, lg, drain_s=1)
            del logs, lg
            # the flush and compaction loops' locals hold the logs of their last object and compaction until
            # their next one
            await append(await reg.partition_log(TOPIC, 4), batch(b"w"))
            await n.until(lambda: not reg.flusher.sliced)
            assert [r() for r in gone] == [None] * 4
        finally:
            gc.unfreeze()
            gc.enable()
            compaction.cancel()
        await reg.close(drain_s=1)

    run(go())


def test_a_topic_marker_names_the_topic_open_here_and_a_recreated_topic_keeps_its_own():
    """The first partition a broker opens writes the topic's marker (its
    id), once, in the background until it lands (opening does not wait).
    A topic created again under the same name while the deletion still
    removes objects (another broker opened it in between) keeps its new
    marker."""
    async def go():
        n = Node()
        marker = topic_marker_key("unit", TOPIC)
        first = await n.meta.create_topic(TOPIC, 2, {})
        reg = await n.registry()
        puts = n.store.requests["put"]
        n.store.fail_next("put")
        await reg.partition_log(TOPIC, 0)  # opened while its marker's first write fails
        await reg.partition_log(TOPIC, 1)
        await n.until(lambda: marker in n.store.objects)
        assert json.loads(n.store.objects[marker]) == {"topic": TOPIC, "id": first.id.hex()}
        assert n.store.requests["put"] - puts == 2, "the failed write, then one for the topic on this broker"

        delete_topic = n.meta.delete_topic
        recreated = []

        async def deleted_then_recreated(name: str) -> None:
            await delete_topic(name)
            again = await n.meta.create_topic(name, 1, {})
            await n.store.put(marker, topic_marker(name, again.id), if_none_match=False)  # another broker's open
            recreated.append(again)

        n.meta.delete_topic = deleted_then_recreated  # type: ignore[method-assign]
        await reg.drop_topic(TOPIC)
        assert json.loads(n.store.objects[marker])["id"] == recreated[0].id.hex()
        await reg.close(drain_s=1)

    run(go())


def test_a_directory_reads_back_as_the_slices_it_lists() -> None:
    """A directory (written row by row, not by json.dumps) is JSON that
    reads back as exactly the slices it lists: topic names that need
    escaping, idempotent producers, a slice with no timestamps. A directory
    written before rows, an object per slice, reads back the same."""
    topics = {"orders": b"\x01" * 16, 'we"ird\\name\u00e9': b"\x02" * 16}
    slices, expected = [], []
    for i in range(6):
        topic = list(topics)[i % 2]
        m = SegmentManifest(100 * i, 100 * i + 9, 10, 700, -1 if i == 3 else 1_700_000_000_000 + i,
                            -1 if i == 3 else 1_700_000_000_500, "ns/wal/1-f/000000000007", 1_700_000_001_000,
                            {"42": [1, [[0, 9, 100 * i]]]} if i % 3 == 0 else {}, 700 * i)
        slices.append(Slice(SimpleNamespace(topic=topic, partition=i), m, []))  # type: ignore[arg-type]
        expected.append((topic, topics[topic].hex(), i, m))
    raw = wal.directory("ns/wal/1-f/000000000007", 1_700_000_001_000, slices, topics)
    assert json.loads(raw)["created_ms"] == 1_700_000_001_000
    assert wal.slice_manifests(raw) == ("ns/wal/1-f/000000000007", expected)
    before_rows = json.dumps({"key": "ns/wal/1-f/000000000007", "created_ms": 1_700_000_001_000, "slices": [
        {"topic": t, "topic_id": tid, "partition": p, "base": m.base, "last": m.last, "count": m.count,
         "pos": m.pos, "size": m.size, "min_ts": m.min_ts, "max_ts": m.max_ts, "producers": m.producers}
        for t, tid, p, m in expected]}).encode()
    assert wal.slice_manifests(before_rows) == ("ns/wal/1-f/000000000007", expected)
    assert len(raw) < len(before_rows) / 2
    # the collector's summary of either, its rows taken from the directory's as they are
    summary = wal.summary("ns/wal/1-f/000000000007", False, [(t, tid, p, m.base, m.last) for t, tid, p, m in expected])
    assert wal._summary(raw, False) == wal._summary(before_rows, False) == summary
