"""The in-memory etcd twin the unit tests use honours MetaStore's contract as
the real etcd does: the same calls, run against both, give the same answers
(fenced compares, first-claim creation, paging past one reply, lease expiry,
watches, compacting the history)."""
from __future__ import annotations

import asyncio
import uuid

import aetcd
import pytest

from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import WAL_GETS, Fenced, MetaStore, PartitionState, SegmentManifest, TopicExists


async def contract(meta: MetaStore, expire) -> None:
    topic = "orders"
    start = await meta.revision()
    await meta.create_topic(topic, 2, {})
    changes = meta.watch_topics(start + 1)  # started after the write: reports it (from its revision on)
    assert (await asyncio.wait_for(changes.__anext__(), 10))[0] == topic
    with pytest.raises(TopicExists):
        await meta.create_topic(topic, 2, {})
    assert await meta.get_partition(topic, 0) is None, "no key until the first claim"
    s1, raw1 = await meta.claim_partition(topic, 0, 1)
    s2, raw2 = await meta.claim_partition(topic, 0, 2)
    assert (s1.epoch, s2.epoch, s2.owner) == (1, 2, 2)
    m = SegmentManifest(0, 9, 10, 100, 1, 2, "k", 0)
    with pytest.raises(Fenced):  # the first owner's view is stale
        await meta.commit_segment(topic, 0, raw1, PartitionState(1, 1, 10, 0), m)
    raw = await meta.commit_segment(topic, 0, raw2, PartitionState(2, 2, 10, 0), m)
    assert (await meta.get_partition(topic, 0)) == (PartitionState(2, 2, 10, 0), raw)
    assert [x.last for x in await meta.list_segments(topic, 0)] == [9]
    await meta.commit_offsets("g", {(topic, p): {"offset": p} for p in range(1500)})
    assert len(await meta.fetch_offsets("g")) == 1500, "a scan pages past one reply"
    owners_from = await meta.revision() + 1
    lease = await meta.register_broker(7, "h", 1, ttl=5)
    assert await meta.claim_owner(topic, 1, 7, lease) and not await meta.claim_owner(topic, 1, 8, lease)
    assert (await meta.owners())[(topic, 1)] == 7
    owned = meta.watch_owners(owners_from)
    assert await asyncio.wait_for(owned.__anext__(), 10) == ((topic, 1), 7)
    other = await meta.register_broker(8, "h", 2, ttl=60)
    await meta.create_fence("f8", other)
    await meta.claim_partition(topic, 0, 8, "f8")
    claimed = await meta.claim_partitions(topic, [0, 1], 7, lease, "f7")  # 1: ours already
    assert {p: (s.epoch, s.owner, s.fence) for p, (s, _) in claimed.items()} == {0: (4, 7, "f7"), 1: (1, 7, "f7")}
    assert claimed[0][1] == (await meta.get_partition(topic, 0))[1] and (await meta.owners())[(topic, 0)] == 7
    assert "f8" not in await meta.fences(), "the earlier owner's fence is deleted"
    assert await meta.claim_partitions(topic, [0, 1], 8, other) == {}, "both are owned by broker 7"
    for fence in ("w1", "w2"):  # node object directories of two fences
        await meta.create_fence(fence, other)
        await meta.commit_wal(fence, [(seq, b"%s:%d" % (fence.encode(), seq)) for seq in range(1, 41)])
    keys = await meta.wal_keys()
    await meta.forget_wal([keys[5]])
    want = keys[2:38] + keys[45:75:2]  # too many for a get each: read by ranges, with gaps, in both fences
    assert len(want) > WAL_GETS
    assert await meta.wal_directories_of(want) == {k: v for k, v in await meta.wal_directories() if k in want}
    assert len(await meta.wal_directories_of(want)) == len(want) - 1, "a forgotten one is left out"
    # 40 directories of 150 KB (one of 1,000 partitions' slices is about 95 KB): a page of them is past
    # gRPC's default 4 MiB reply limit; both reads still get them all
    await meta.create_fence("big", other)
    for seq in range(1, 41):
        await meta.commit_wal("big", [(seq, b"%d:" % seq + b"d" * 150_000)])
    big = [k for k in await meta.wal_keys() if b"/big/" in k]
    assert len(big) == 40 > WAL_GETS
    assert sorted(v for k, v in await meta.wal_directories() if k in big) == sorted(
        b"%d:" % seq + b"d" * 150_000 for seq in range(1, 41))
    assert len(await meta.wal_directories_of(big)) == 40
    marks, at = await meta.partition_marks()
    assert set(marks) == {topic} and set(marks[topic]) == {0, 1}
    assert (await meta.partition_marks(at))[0] == {}, "no state written since"
    state, _ = await meta.claim_partition(topic, 1, 9)
    changed, later = await meta.partition_marks(at)
    assert changed == {topic: {1: (state.hw, state.log_start)}} and later > at
    history = await meta.revision()
    await meta.compact_history(history)
    await meta.compact_history(history)  # compacted already (by another cluster's broker or etcd itself): done
    with pytest.raises(aetcd.exceptions.ClientError, match="compacted"):
        await meta.client.range_page(b"a", b"b", 1, history - 1, True)
    with pytest.raises(aetcd.exceptions.ClientError, match="future revision"):
        await meta.compact_history(history + 1_000_000)
    assert await meta.revision() == history, "compacting is no write"
    with pytest.raises(aetcd.exceptions.ClientError, match="compacted"):
        await meta.watch_owners(history - 1).__anext__()
    await expire(lease)
    assert (topic, 1) not in await meta.owners() and 7 not in [b for b, _, _ in await meta.list_brokers()]
    while (change := await asyncio.wait_for(owned.__anext__(), 10)) != ((topic, 1), None):
        assert change[1] is not None or change[0] == (topic, 0), change  # its claims, then both released
    await meta.delete_topic(topic)
    assert await meta.get_topic(topic) is None
    with pytest.raises(KeyError):
        await meta.claim_partition(topic, 0, 3)
    watched_delete = await asyncio.wait_for(changes.__anext__(), 10)
    while watched_delete[1] is not None:
        watched_delete = await asyncio.wait_for(changes.__anext__(), 10)
    assert watched_delete[0] == topic


def test_memory_twin_honours_the_contract():
    async def go():
        etcd = MemoryEtcd()
        meta = MetaStore.in_memory("twin", etcd)

        async def expire(lease):
            etcd.expire(lease)

        await contract(meta, expire)

    asyncio.run(go())


def test_real_etcd_honours_the_same_contract(stack):
    async def go():
        meta = MetaStore(stack.etcd_endpoint, f"twin-{uuid.uuid4().hex[:8]}")
        await meta.start()
        try:
            async def expire(lease):
                await lease.revoke()

            await contract(meta, expire)
        finally:
            await meta.close()

    asyncio.run(go())
