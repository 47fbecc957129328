"""Node flushes (storage/wal.py) on the in-memory twins of S3 and etcd: node
objects commit in order, those uploaded while an earlier commit is under way
in one transaction; once one fails (its fence taken), no object after it
commits and nothing it or they held is acknowledged."""
from __future__ import annotations

import asyncio

from kafscale.config import Config
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import MetaStore
from kafscale.storage.memory import MemoryObjectStore
from kafscale.storage.partition import PartitionLog
from kafscale.storage.reader import LogError, ReadBudget
from kafscale.storage.wal import NodeFlusher, WalIndex
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

    async def start(self) -> tuple[NodeFlusher, list[PartitionLog]]:
        meta = await self.meta.create_topic(TOPIC, 2, {})

        async def on_fenced(_fence: str) -> None:
            self.fenced.set()

        flusher = NodeFlusher(self.cfg, self.store, self.meta, lambda _t: meta.id, on_fenced)
        await flusher.start(await self.etcd.lease(60))
        wal = WalIndex(self.meta)
        logs = [PartitionLog(TOPIC, p, self.cfg, self.store, self.meta, DictCache(), ReadBudget(64 << 20),
                             lambda _lg, _m: None, (flusher, wal, meta.id)) for p in range(2)]
        for lg in logs:
            await lg.open()
        return flusher, logs

    def uploaded(self) -> int:
        return sum(k.endswith(".kfn") for k in self.store.objects)

    async def until(self, cond) -> None:
        for _ in range(1000):
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("not reached within 5 s")


def test_objects_uploaded_during_a_slow_commit_commit_together_in_order():
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
        assert n.commits == [[1], [2, 3]], "the two objects uploaded meanwhile: one transaction"
        assert len(await n.meta.wal_keys()) == 3 and (p0.hw, p1.hw) == (2, 2)
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
