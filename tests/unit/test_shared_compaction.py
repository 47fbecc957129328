"""Shared compaction (storage/shared.py) on the in-memory twins of S3 and
etcd: small partitions' compacted segments in one object and one
transaction, read back like any segment by a new owner, left out when handed
over or taken, committed once when a reply is lost, and collected once every
segment in the object is before its partition's log start."""
from __future__ import annotations

import asyncio
import gc
import json
import random

from prometheus_client import REGISTRY

from kafscale import _native, metrics
from kafscale.broker.partitions import compaction_batches
from kafscale.metadata.store import SegmentManifest
from kafscale.storage import scan, wal
from kafscale.storage.cache import CachedSegment
from kafscale.storage.memory import MemoryObjectStore
from kafscale.storage.partition import PartitionLog
from kafscale.storage.reader import ReadBudget
from kafscale.storage.segment import build_segment, segment_key
from kafscale.storage.shared import SliceReads, compact_shared
from kafscale.storage.wal import (
    Collector,
    NodeFlusher,
    SharedRanges,
    _done_rows,
    _floor,
    merged_away,
    node_prefix,
    shared_prefix,
    summary,
    summary_slices,
)
from tests.unit.test_node_flush import Node
from tests.unit.test_partition import TOPIC, DictCache, append, batch, run


async def values(lg: PartitionLog) -> list[bytes | None]:
    """The value of every record the log serves, from its first offset."""
    out, offset = [], lg.log_start
    while offset < lg.hw:
        for chunk in await lg.read(offset, 1 << 20):
            data = bytes(chunk)
            for b in _native.scan_batches(data, True):
                out += [v for _, _, _, v, _ in _native.iter_records(b, data)]
                offset = b.last_offset + 1
    return out


def shared_objects(n: Node) -> list[str]:
    return [k for k in n.store.objects if k.startswith(shared_prefix("unit"))]


def reopen(n: Node, lg: PartitionLog) -> PartitionLog:
    """A new owner of lg's partition, with an empty cache (it reads S3)."""
    return PartitionLog(TOPIC, lg.partition, n.cfg, n.store, n.meta, DictCache(), ReadBudget(64 << 20),
                        lambda _lg, _m: None, lg.node)


async def values_of_new_owner(n: Node, lg: PartitionLog) -> list[bytes | None]:
    """What a new owner of lg's partition (lg closed first) serves, read from S3."""
    await lg.close()
    again = reopen(n, lg)
    await again.open()
    try:
        return await values(again)
    finally:
        await again.close()


def share(n: Node, flusher: NodeFlusher, logs: list[PartitionLog], seq: int = 1) -> asyncio.Future[int]:
    """compact_shared of these logs into shared object seq of the flusher's fence."""
    topic_id = logs[0].node[2]
    return asyncio.ensure_future(compact_shared(logs, n.cfg, n.store, n.meta, flusher.fence, seq,
                                                lambda _t: topic_id, flusher.cache))


async def fill(logs: list[PartitionLog], rounds: int = 2) -> None:
    for r in range(rounds):
        await asyncio.gather(*(append(lg, batch(b"p%d-r%d" % (lg.partition, r))) for lg in logs))


def test_small_partitions_share_one_object_and_one_transaction_and_read_back():
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=5)
        await fill(logs)
        txns = n.etcd.txns
        committed = await share(n, flusher, logs)
        assert committed == 5
        assert len(shared_objects(n)) == 1, "one object for five partitions"
        assert n.etcd.txns == txns + 1, "one transaction for five partitions"
        assert len(await n.meta.wal_keys("shared")) == 1
        for lg in logs:
            assert (lg.checkpoint, lg.hw, lg._slice_count) == (2, 2, 0)
            [m] = await n.meta.list_segments(TOPIC, lg.partition)
            assert m.key == shared_objects(n)[0] and m.pos >= 0 and (m.base, m.last) == (0, 1)
            # in the cache (all five with one put_object), as in the object
            cached, stored = flusher.cache.get(m), CachedSegment.from_object(await n.store.get(
                m.key, m.pos, m.pos + m.size))
            assert bytes(cached.data) == bytes(stored.data)
            assert (list(cached.bases), list(cached.positions)) == (stored.bases, stored.positions)
        for lg in logs:  # a new owner reads the segment from the shared object, at its position
            await lg.close()
            again = reopen(n, lg)
            await again.open()
            assert (again.hw, again._slice_count) == (2, 0)
            assert await values(again) == [b"p%d-r0" % lg.partition, b"p%d-r1" % lg.partition]
            assert await append(again, batch(b"more")) == 2
            await again.close()
        await flusher.stop()

    run(go())


def test_the_collector_keeps_a_shared_object_until_every_segment_is_before_its_log_start():
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=3)
        await fill(logs)
        await share(n, flusher, logs)
        collector = Collector(n.meta, n.store, "unit")
        assert await collector.run() == 2, "the two node objects are compacted away; the shared one stays"
        assert len(await n.meta.wal_keys("shared")) == 1
        await logs[0].delete_records(2)
        await logs[1].delete_records(2)
        assert await collector.run() == 0, "partition 2's segment is still served"
        assert await values(logs[2]) == [b"p2-r0", b"p2-r1"]
        await logs[2].delete_records(1)
        assert await collector.run() == 0, "partition 2's segment still holds offset 1"
        await logs[2].delete_records(2)
        assert await collector.run() == 1 and await n.meta.wal_keys("shared") == []
        await flusher.stop()

    run(go())


def test_a_collector_pass_lets_other_work_run_every_collect_turn_slices(monkeypatch):
    """A pass lets other work run each time it has checked COLLECT_TURN
    slices of its directories, however few directories hold them (a turn
    every 50 directories held the event loop for 79 ms when each held
    1,000 slices); what it forgets is the same."""
    async def one_pass(turn: int) -> tuple[int, int]:
        """Objects forgotten, and the turns other work got, in a pass over two
        node objects and a shared one of 20 partitions' slices each."""
        monkeypatch.setattr(wal, "COLLECT_TURN", turn)
        n = Node()
        flusher, logs = await n.start(partitions=20)
        await fill(logs)
        await share(n, flusher, logs)
        turns, passing = 0, True

        async def other_work() -> None:
            nonlocal turns
            while passing:
                turns += 1
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(other_work())
        await asyncio.sleep(0)
        turns = 0
        forgotten = await Collector(n.meta, n.store, "unit").run()
        passing = False
        await watcher
        await flusher.stop()
        return forgotten, turns

    async def go():
        (forgotten, turns), (forgotten_at_once, turns_at_once) = await one_pass(10), await one_pass(1 << 30)
        assert forgotten == forgotten_at_once == 2
        assert turns >= turns_at_once + 3, "a turn after each directory of more slices than COLLECT_TURN"

    run(go())


def test_a_collector_pass_reads_the_states_written_since_the_last_and_decides_as_with_all():
    """After its first pass a collector reads only the partition states
    written since its last pass (at 10,000 idle partitions, reading and
    parsing all of them every pass was a quarter of the log process's CPU),
    and frees a node object once the compactions since then took its last
    slices; a deleted topic's states are dropped with it."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=4)
        await fill(logs)
        collector, read, range_page = Collector(n.meta, n.store, "unit"), [], n.etcd.range_page

        async def counted(start: bytes, *args):
            kvs, more, revision = await range_page(start, *args)
            if b"/partitions/" in start:
                read.extend(kv.key.rsplit(b"/", 1)[1] for kv in kvs)
            return kvs, more, revision

        n.etcd.range_page = counted  # type: ignore[method-assign]
        assert await collector.run() == 0 and sorted(read) == [b"0", b"1", b"2", b"3"]
        read.clear()
        assert await collector.run() == 0 and read == [], "no state written since"
        await share(n, flusher, logs[:2])
        read.clear()
        assert await collector.run() == 0, "partitions 2 and 3 still have slices in both node objects"
        assert sorted(read) == [b"0", b"1"]
        # the next pass starts after the slices found done: partitions 0 and 1 of each node object
        assert sorted(collector._done.values()) == [0, 2, 2]  # the shared object's first segment is live
        await share(n, flusher, logs[2:], seq=2)
        read.clear()
        assert await collector.run() == 2 and sorted(read) == [b"2", b"3"]
        assert await n.meta.wal_keys() == [] and sorted(collector._done.values()) == [0, 0]
        for lg in logs:
            await lg.close()
        await n.meta.delete_topic(TOPIC)
        assert await collector.run() == 2, "the deleted topic's shared objects are forgotten"
        assert await n.meta.wal_keys("shared") == [] and collector._marks == {}, "and its states dropped"
        assert collector._done == {}
        await flusher.stop()

    run(go())


def test_a_partition_handed_over_or_taken_meanwhile_is_left_out():
    """Partition 0 is closed (handed over) while the object uploads: its slices
    stay for the next owner. Partition 1 is claimed by another owner: its key
    moved, so the first transaction fails, partition 1 fails like a fenced
    log, and partitions 2 and 3 commit in the second."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=4)
        await fill(logs)
        gate, real_put = asyncio.Event(), n.store.put

        async def put(key: str, *args, **kwargs):
            if key.startswith(shared_prefix("unit")):
                await gate.wait()
            return await real_put(key, *args, **kwargs)

        n.store.put = put  # type: ignore[method-assign]
        task = share(n, flusher, logs)
        await asyncio.sleep(0.01)
        await logs[0].close()
        await logs[0].release_fence()
        await n.meta.claim_partition(TOPIC, 1, 2)
        gate.set()
        assert await task == 2
        assert logs[1].closed, "fenced"
        [raw] = [v for _, v in await n.meta.wal_directories("shared")]
        assert '"partition":0' not in raw.decode() and '"partition":1' not in raw.decode()
        states = await n.meta.partition_states()
        assert [states[(TOPIC, p)].hw for p in range(4)] == [0, 0, 2, 2]
        assert await values_of_new_owner(n, logs[0]) == [b"p0-r0", b"p0-r1"], "from the node objects"
        await flusher.stop()

    run(go())


def test_a_lost_reply_commits_once():
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=2)
        await fill(logs)
        real, calls = n.meta.commit_shared, []

        async def lost_reply(*args):
            calls.append(args)
            ok = await real(*args)
            if len(calls) == 1:
                raise OSError("connection reset")
            return ok

        n.meta.commit_shared = lost_reply  # type: ignore[method-assign]
        assert await share(n, flusher, logs) == 2
        assert len(calls) == 2 and not any(lg.closed for lg in logs)
        assert [lg.checkpoint for lg in logs] == [2, 2] and len(shared_objects(n)) == 1
        assert await values(logs[1]) == [b"p1-r0", b"p1-r1"]
        await flusher.stop()

    run(go())


def test_a_bucket_listing_chains_shared_segments_with_leftover_kfs_objects(monkeypatch):
    """Without etcd (the Spark source's bucket listing) shared segments are
    found through their objects' directories; where a crash's leftover .kfs
    shares a base offset with a committed shared segment, the one known to
    reach the next base (or, at the end, reaching furthest) is taken."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=3)
        await fill(logs)
        assert await share(n, flusher, logs) == 3  # offsets 0-1 of every partition
        await fill(logs, rounds=1)
        assert await share(n, flusher, logs, seq=2) == 3  # offset 2 (smaller than the first: not merged with it)
        first, second = shared_objects(n)
        # leftovers of a later epoch holding only the base's first record: at base 0 (not the newest) and at
        # base 2 (the newest), of partition 0
        for base in (0, 2):
            seg = build_segment([(batch(b"p0-r%d" % base), base)], 0)
            n.store.objects[segment_key("unit", TOPIC, 0, base, 9)] = bytes(seg.data)
        monkeypatch.setattr(scan.StoreOptions, "store", lambda _self: n.store)
        found = await scan.list_segments(scan.StoreOptions("bucket", "unit"), TOPIC)
        assert sorted(found) == [0, 1, 2]
        for p, (segs, log_start, hw) in found.items():
            assert (log_start, hw) == (0, 3)
            assert [(s.key, s.base, s.last) for s in segs] == [(first, 0, 1), (second, 2, 2)], p
            assert all(s.pos >= 0 and s.size > 0 for s in segs)
        await flusher.stop()

    run(go())


def base4_digit_sum(n: int) -> int:
    return n and n % 4 + base4_digit_sum(n // 4)


def test_slow_partitions_merge_their_small_segments_and_merged_objects_are_collected():
    """Sixteen compactions of one batch per partition leave each partition one
    segment (merged four of a size at a time: after r rounds, as many as the
    digits of r in base 4 add up to), its other manifests deleted in the same
    transactions; every record
    is served once, also by new owners reading S3; the collectors (two
    brokers' in turn: each also sees what the other forgot) forget every
    shared object whose segments were all merged into later ones."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=2)
        collectors = [Collector(n.meta, n.store, "unit") for _ in range(2)]
        for r in range(16):
            await asyncio.gather(*(append(lg, batch(b"p%d-r%d" % (lg.partition, r))) for lg in logs))
            assert await share(n, flusher, logs, seq=r + 1) == 2
            for lg in logs:
                manifests = await n.meta.list_segments(TOPIC, lg.partition)
                assert len(manifests) == base4_digit_sum(r + 1), f"round {r}: {[(m.base, m.last) for m in manifests]}"
                assert [(m.base, m.last) for m in lg.segments] == [(m.base, m.last) for m in manifests]
                assert lg._slice_count == 0 and lg.checkpoint == lg.hw == r + 1
            await collectors[r % 2].run()
            live = {m.key for lg in logs for m in await n.meta.list_segments(TOPIC, lg.partition)}
            named = {json.loads(raw)["key"] for _, raw in await n.meta.wal_directories("shared")}
            assert named == live, f"round {r}: only the objects holding live segments are kept"
        [(m0,)] = [await n.meta.list_segments(TOPIC, 0)]
        assert (m0.base, m0.last, m0.count) == (0, 15, 16)
        for lg in logs:
            want = [b"p%d-r%d" % (lg.partition, r) for r in range(16)]
            assert await values(lg) == want
            assert await values_of_new_owner(n, lg) == want, "a new owner reads the merged segment from S3"
        await flusher.stop()

    run(go())


def test_a_merge_takes_a_group_of_three_whole_or_not_at_all_within_the_transactions_room():
    """Three one-record segments wait for a fourth record's compaction: the
    group of three goes with it only when the transaction has room for all
    three manifests (`most`); a group cut short by the room left would leave
    segments of one size apart."""
    async def go():
        n = Node()
        flusher, [lg] = await n.start(partitions=1)
        for r in range(3):
            await append(lg, batch(b"r%d" % r))
            assert await share(n, flusher, [lg], seq=r + 1) == 1
        assert [m.count for m in lg.segments] == [1, 1, 1], "a group needs three"
        new = lg.segments[-1].size  # what one more record's slice holds
        assert lg.to_merge(new, 1 << 20, 2) == []
        assert lg.to_merge(new, 1 << 20, 3) == lg.segments
        await flusher.stop()

    run(go())


def test_compaction_counts_the_slices_and_merged_segments_it_rewrote():
    """kafscale_compacted_bytes: each compaction adds the bytes of the slices
    it took and of the compacted segments it merged (those it replaced besides
    the slices), so that (slices + merged) / slices is the write
    amplification of merging small segments."""
    def counted(source: str) -> float:
        return REGISTRY.get_sample_value("kafscale_compacted_bytes_total",
                                         {"node": metrics.node(), "source": source}) or 0.0

    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=2)
        want = {"slices": counted("slices"), "merged": counted("merged")}
        for r in range(6):
            await fill(logs, rounds=1)
            slices = {(lg.partition, m.ref): m.size for lg in logs for m in lg._slices()}
            segments = {(lg.partition, m.ref): m.size for lg in logs for m in lg.segments}
            assert await share(n, flusher, logs, seq=r + 1) == 2
            left = {(lg.partition, m.ref) for lg in logs for m in lg.segments}
            want["slices"] += sum(slices.values())
            want["merged"] += sum(size for ref, size in segments.items() if ref not in left and ref not in slices)
            assert {source: counted(source) for source in want} == want, f"round {r}"
        assert want["merged"] > 0, "merges happened"
        await flusher.stop()

    run(go())


def test_merges_stay_within_the_topics_segment_bytes():
    """Retention drops whole segments: a topic with a small segment.bytes keeps
    segments of at most that size, merged only as far as it allows."""
    async def go():
        n = Node()
        flusher, [lg] = await n.start(partitions=1)
        await append(lg, batch(b"r0"))
        assert await share(n, flusher, [lg]) == 1
        [first] = await n.meta.list_segments(TOPIC, 0)
        lg.segment_bytes = 3 * first.size  # three one-record segments fit, four do not
        for r in range(1, 8):
            await append(lg, batch(b"r%d" % r))
            assert await share(n, flusher, [lg], seq=r + 1) == 1
        manifests = await n.meta.list_segments(TOPIC, 0)
        # each fourth round's group of three is taken as far as it fits: the new record and the two newest
        assert [m.count for m in manifests] == [1, 3, 1, 3], [(m.base, m.last, m.size) for m in manifests]
        assert max(m.size for m in manifests) <= lg.segment_bytes
        assert await values(lg) == [b"r%d" % r for r in range(8)]
        await flusher.stop()

    run(go())


def test_shared_ranges_kept_up_to_date_agree_with_working_them_out_again():
    """Directories of shared objects added and forgotten in any order: what
    the collector's running account calls merged away is what the rule gives
    over the directories it holds at that moment."""
    rng = random.Random(7)
    summaries = [summary(f"k{i}", True, [("t", "ab", rng.randrange(3), base, base + rng.randrange(1, 40))
                                         for base in rng.sample(range(60), 4)]) for i in range(40)]
    held: list = []
    ranges = SharedRanges()

    async def go():
        for step in range(200):
            if held and (rng.random() < 0.4 or len(held) == len(summaries)):
                ranges.remove(held.pop(rng.randrange(len(held))))
            else:
                s = rng.choice([s for s in summaries if s not in held])
                held.append(s)
                ranges.add(s)
            await ranges.update()
            for p in range(3):
                found = [(base, last) for s in held for _, _, q, base, last in summary_slices(s) if q == p]
                want = merged_away(found)
                assert {r for r in set(found) if ranges.is_merged("ab", p, *r)} == want, f"step {step}"

    run(go())


def test_a_directory_summary_keeps_its_slices_in_one_bytes_object():
    """The collector keeps a summary of every directory for the compaction
    lag (a slice each for every record at 100 partitions): its slices must
    not be one tracked object each."""
    slices = [("t", "ab", p, 10 * p, 10 * p + 9) for p in range(50)] + [("u", "cd", 3, 0, 4)]
    s = summary("wal-key", False, slices)
    assert list(summary_slices(s)) == slices
    tracked = [o for o in gc.get_referents(s) if gc.is_tracked(o)]
    assert tracked == [s[2]] and len(s[2]) == 2  # the topics, (name, id hex) each


def test_a_node_objects_slices_are_done_with_in_a_row_as_checked_one_by_one():
    """The collector decides the slices of a node object summary in one array
    operation (_done_rows): as many in a row are done as a check of each
    (its last offset below its partition's high watermark or log start, its
    partition without a mark, its topic gone) finds, whatever its topics."""
    rng = random.Random(5)
    for step in range(300):
        names = [("t", "ab"), ("u", "cd"), ("v", "ef")][:rng.randint(1, 3)]
        marks = {name: {p: (rng.randrange(60), rng.randrange(30)) for p in range(8) if rng.random() < 0.9}
                 for name, _ in names if rng.random() < 0.9}
        slices = [(*rng.choice(names), rng.randrange(10), base, base + rng.randrange(3))
                  for base in (rng.randrange(70) for _ in range(rng.randint(1, 30)))]
        slices.sort(key=lambda s: rng.random() if rng.random() < 0.2 else 0)
        s = summary("wal-key", False, slices)
        start = rng.randrange(len(slices))

        def done(topic: str, p: int, last: int, marks: dict[str, dict[int, tuple[int, int]]] = marks) -> bool:
            mark = marks.get(topic, {}).get(p)
            return mark is None or max(mark) > last

        want = next((i for i, (t, _, p, _, last) in enumerate(slices[start:]) if not done(t, p, last)),
                    len(slices) - start)
        floors = [_floor(marks.get(name)) for name, _ in s[2]]
        assert _done_rows(s, start, floors) == want, f"step {step}"


def test_slices_the_cache_lost_are_read_back_one_get_a_node_object():
    """A shared compaction whose slices the cache no longer holds reads each
    node object's slices of its partitions in one ranged GET, not one GET a
    slice: node objects lay out slices in partition order, so a group of
    neighbouring partitions finds its slices side by side even among the
    slices of many other partitions (each 20 KiB here: a run reaches over
    gaps of up to RUN_GAP_BYTES only)."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=40)
        queued = random.sample(logs, len(logs))  # appended (and queued) in no partition order
        for r in range(3):
            await asyncio.gather(*(append(lg, batch(b"p%d-r%d-" % (lg.partition, r) + b"x" * 20_000))
                                   for lg in queued))
        node_objects = [k for k in n.store.objects if k.startswith(node_prefix("unit"))]
        flusher.cache.segments.clear()  # every slice evicted
        gets = n.store.requests["get"]
        assert await share(n, flusher, logs[10:20]) == 10
        assert n.store.requests["get"] - gets == len(node_objects) < 10
        for lg in logs[10:20]:
            assert await values(lg) == [b"p%d-r%d-" % (lg.partition, r) + b"x" * 20_000 for r in range(3)]
        await flusher.stop()

    run(go())


def test_merged_segments_the_cache_lost_are_read_back_one_get_a_shared_object():
    """The small segments a shared compaction merges, no longer cached, are
    read like its slices: each earlier shared object's segments of the
    group's partitions in one ranged GET (they lie side by side), not one
    GET a segment."""
    async def go():
        n = Node()
        flusher, logs = await n.start(partitions=10)
        for r in range(4):  # the fourth compaction merges the three segments before it
            await asyncio.gather(*(append(lg, batch(b"p%d-r%d" % (lg.partition, r))) for lg in logs))
            if r == 3:
                flusher.cache.segments.clear()  # every slice and segment evicted
                node_objects = {m.key for lg in logs for m in lg.uncached()}
                gets = n.store.requests["get"]
            assert await share(n, flusher, logs, seq=r + 1) == 10
        assert n.store.requests["get"] - gets == len(node_objects) + 3, "a GET a node object, a shared object"
        for lg in logs:
            assert [(m.base, m.last) for m in lg.segments] == [(0, 3)], "merged into one"
            assert await values(lg) == [b"p%d-r%d" % (lg.partition, r) for r in range(4)]
        await flusher.stop()

    run(go())


def test_shared_compactions_take_neighbouring_partitions():
    """However the due partitions are ordered, each shared compaction takes a
    run of neighbours (whose slices lie side by side in node objects)."""
    class Small:  # a due log whose compaction is small and merges nothing
        def __init__(self, p: int) -> None:
            self.topic, self.partition = TOPIC, p

        def compaction_bytes(self) -> int:
            return 1000

        def to_merge(self, *_: int) -> list[object]:
            return []

    batches = compaction_batches([Small(p) for p in random.sample(range(100), 100)], True)  # type: ignore[misc]
    groups = [[lg.partition for lg in logs] for logs, shared in batches if shared]
    assert len(groups) == len(batches) > 1
    assert sorted(p for g in groups for p in g) == list(range(100))
    assert all(g == list(range(g[0], g[0] + len(g))) for g in groups)


def test_slice_reads_join_slices_into_runs_within_their_limits():
    """Slices of one object are read together while the gaps between them
    are at most RUN_GAP_BYTES and the range at most RUN_SPAN_FACTOR times
    their bytes; each gets exactly its own bytes, and a slice not planned
    gets None (its compaction reads it alone)."""
    async def go():
        store = MemoryObjectStore()
        body = bytes(random.getrandbits(8) for _ in range(300_000))
        await store.put("node", body)
        await store.put("other", body)

        def sl(key: str, pos: int, size: int) -> SegmentManifest:
            return SegmentManifest(pos, pos, 1, size, 0, 0, key, 0, {}, pos)

        together = [sl("node", 0, 1000), sl("node", 1000, 1000), sl("node", 3000, 2000)]  # 4,000 B in 5,000
        sparse = sl("node", 20_000, 100)  # with the three: 4,100 B in 20,100, past four times their bytes
        far = sl("node", 200_000, 50_000)  # more than RUN_GAP_BYTES on
        elsewhere = sl("other", 0, 10)
        class Log:  # a partition of the group, these slices not cached
            def uncached(self, *_: int) -> list[SegmentManifest]:
                return [far, *together, sparse, elsewhere]

        reads = SliceReads(store, [Log()])  # type: ignore[list-item]
        got = [await reads.get(m) for m in [*together, sparse, far, elsewhere]]
        assert [bytes(g) for g in got] == [body[m.pos:m.pos + m.size]
                                           for m in [*together, sparse, far, elsewhere]]
        assert store.requests["get"] == 4, "the three together in one GET, each of the others alone"
        assert await reads.get(sl("node", 5000, 10)) is None

    run(go())
