"""LogReader's read-ahead when several consumers read one partition view at
once (the objects come from an in-memory stand-in for S3 whose GETs the test
holds back, to force one interleaving deterministically)."""
from __future__ import annotations

import asyncio

from kafscale import _native
from kafscale.metadata.store import SegmentManifest
from kafscale.storage.reader import LogReader
from kafscale.storage.segment import build_segment, index_key


class HeldStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.open = asyncio.Event()
        self.open.set()

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        await self.open.wait()
        data = self.objects[key]
        return data if start is None else data[start:end]


class NoCache:
    def get(self, key: str) -> None:
        return None

    def put(self, key: str, seg: object) -> None:
        pass

    def drop_prefix(self, prefix: str) -> None:
        pass


def segment(store: HeldStore, base: int, n: int) -> SegmentManifest:
    batch = _native.build_batch([(1000 + i, None, b"v%d" % (base + i), []) for i in range(n)], base_offset=base)
    seg = build_segment([(batch, base)], 0)
    key = f"ns/t/0/segment-{base:020d}-0000000001.kfs"
    store.objects[key], store.objects[index_key(key)] = bytes(seg.data), seg.index
    return SegmentManifest(base, seg.last_offset, n, len(seg.data), 1000, 1000 + n, key, 0)


def test_a_reader_at_the_end_does_not_break_another_waiting_for_the_prefetch():
    async def run() -> None:
        store = HeldStore()
        r = LogReader(store, NoCache(), 1 << 20)  # type: ignore[arg-type]
        first, second = segment(store, 0, 10), segment(store, 10, 10)
        r.set_segments([first, second])
        r.hw = 20
        chunks = await r.read(0, first.size - 48)  # segment 1 only; the read-ahead of segment 2 starts
        assert b"".join(bytes(c) for c in chunks)
        store.open.clear()  # hold the read-ahead GET
        behind = asyncio.create_task(r.read(10, 1 << 20))  # a consumer waiting for that read-ahead
        await asyncio.sleep(0.01)
        assert await r.read(20, 1 << 20) == []  # another consumer at the high watermark drops the read-ahead
        store.open.set()
        got = await asyncio.wait_for(behind, 5)
        batches = _native.scan_batches(b"".join(bytes(c) for c in got))
        assert [b.base_offset for b in batches] == [10]

    asyncio.run(run())
