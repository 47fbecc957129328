"""LogReader's read-ahead: windows planned at index boundaries, several
consumers on one partition view, and the per-process memory budget (the
objects come from an in-memory stand-in for S3 whose GETs a test can hold
back or fail, to force one interleaving deterministically)."""
from __future__ import annotations

import asyncio

import pytest

from kafscale import _native
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol.errors import ErrorCode
from kafscale.storage.reader import LogError, LogReader, ReadBudget
from kafscale.storage.segment import FOOTER_SIZE, build_segment, index_key, parse_index


class HeldStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.open = asyncio.Event()
        self.open.set()
        self.gets: list[tuple[str, int | None, int | None]] = []
        self.fail = 0  # fail this many GETs

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        await self.open.wait()
        self.gets.append((key, start, end))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("S3 unavailable")
        data = self.objects[key]
        return data if start is None else data[start:end]


class NoCache:
    def get(self, m: SegmentManifest) -> None:
        return None

    def read(self, m: SegmentManifest, offset: int, max_bytes: int) -> None:
        return None

    def holds(self, m: SegmentManifest) -> bool:
        return False

    def put(self, m: SegmentManifest, seg: object) -> None:
        pass


def segment(store: HeldStore, base: int, n: int, batches: int = 1, value_size: int = 0) -> SegmentManifest:
    """A segment of n records in `batches` batches, indexed every 4 KiB."""
    per = n // batches
    pieces = [(_native.build_batch([(1000 + o, None, b"v%d" % o + bytes(value_size), [])
                                    for o in range(b, b + per)], base_offset=b), b)
              for b in range(base, base + n, per)]
    seg = build_segment(pieces, 0, index_interval=4096)
    key = f"ns/t/0/segment-{base:020d}-0000000001.kfs"
    store.objects[key], store.objects[index_key(key)] = bytes(seg.data), seg.index
    return SegmentManifest(base, seg.last_offset, n, len(seg.data), 1000, 1000 + n, key, 0)


def test_a_reader_at_the_end_does_not_break_another_waiting_for_the_prefetch():
    async def run() -> None:
        store = HeldStore()
        r = LogReader(store, NoCache(), 1 << 20, ReadBudget(64 << 20))  # type: ignore[arg-type]
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


def test_a_segment_of_at_most_64_kib_is_read_whole_without_an_index():
    async def run() -> None:
        store = HeldStore()
        m = segment(store, 0, 20, batches=10)  # 20 small records: no .index object
        del store.objects[index_key(m.key)]
        r = LogReader(store, NoCache(), 1 << 10, ReadBudget(64 << 20))  # type: ignore[arg-type]
        r.set_segments([m])
        r.hw = 20
        got = offsets(await r.read(13, 1 << 20))
        assert got[0] <= 13 and got[-1] == 19
        assert all(k == m.key for k, _, _ in store.gets), "no index read"

    asyncio.run(run())


def offsets(chunks: list) -> list[int]:
    return [o for b in _native.scan_batches(b"".join(bytes(c) for c in chunks))
            for o in range(b.base_offset, b.base_offset + b.last_offset_delta + 1)]


def log_of(store: HeldStore, segments: int, budget: ReadBudget, readahead: int) -> LogReader:
    """A reader over `segments` segments of 40 batches of 2 records of ~1 KiB."""
    r = LogReader(store, NoCache(), readahead, budget)  # type: ignore[arg-type]
    r.set_segments([segment(store, i * 80, 80, batches=40, value_size=1000) for i in range(segments)])
    r.hw = segments * 80
    return r


def test_windows_follow_the_index_and_a_read_continues_into_windows_already_read():
    async def run() -> None:
        store = HeldStore()
        r = log_of(store, 3, ReadBudget(64 << 20), 16 << 10)
        got: list[int] = []
        while len(got) < 240:
            chunks = await r.read(len(got), 1 << 20)
            assert chunks
            got += offsets(chunks)
            await asyncio.sleep(0)  # let the read-ahead land
        assert got == list(range(240))  # every record once, in order, across windows and segments
        index_entries = {k: set(parse_index(v).positions) for k, v in store.objects.items() if k.endswith(".index")}
        ranges = [(k, a, b) for k, a, b in store.gets if k.endswith(".kfs")]
        for key, start, end in ranges:  # ranged GETs start and end on indexed batches (or the body's end)
            assert start in index_entries[index_key(key)]
            assert end in index_entries[index_key(key)] or end == len(store.objects[key]) - FOOTER_SIZE
            assert end - start <= 16 << 10
        assert len(ranges) == len(set(ranges))  # nothing read twice
        assert r.cursors == [] and r.budget.used == 0  # caught up: windows let go

    asyncio.run(run())


def test_read_ahead_stays_within_the_budget_and_idle_readers_give_theirs_up():
    async def run() -> None:
        store = HeldStore()
        budget = ReadBudget(48 << 10)
        a, b = log_of(store, 2, budget, 16 << 10), log_of(store, 2, budget, 16 << 10)
        await a.read(0, 1 << 10)
        await asyncio.sleep(0)
        [ca] = a.cursors
        assert budget.used == sum(w.end - w.start for w in ca) <= 48 << 10
        assert len(ca) == 3  # the window being read and two ahead
        await b.read(0, 1 << 10)  # the budget is spent: b gets a window it waits for, none ahead
        assert [len(c) for c in b.cursors] == [1] and budget.used <= (48 << 10) + (16 << 10)
        a.last_read -= 10  # a has gone idle: b's next read-ahead takes a's windows
        await b.read(offsets(await b.read(0, 1 << 10))[-1] + 1, 1 << 10)
        assert not a.cursors and [len(c) for c in b.cursors] == [3] and budget.used <= 48 << 10
        b.stop_reading()
        assert budget.used == 0

    asyncio.run(run())


def test_a_failed_get_fails_that_fetch_and_the_next_one_reads_again():
    async def run() -> None:
        store = HeldStore()
        r = log_of(store, 1, ReadBudget(64 << 20), 16 << 10)
        store.fail = 1
        with pytest.raises(LogError) as failed:
            await r.read(0, 1 << 20)
        assert failed.value.code == ErrorCode.KAFKA_STORAGE_ERROR  # retriable, for that partition only
        assert not r.cursors and r.budget.used == 0
        assert offsets(await r.read(0, 1 << 10))[0] == 0

    asyncio.run(run())


def test_consumers_at_different_offsets_keep_their_own_read_ahead():
    async def run() -> None:
        store = HeldStore()
        r = log_of(store, 3, ReadBudget(64 << 20), 16 << 10)
        at = {"early": 0, "late": 120}
        while at["early"] < 120 or at["late"] < 240:  # two consumers take turns, one fetch of ~4 KiB each
            for name, end in (("early", 120), ("late", 240)):
                if at[name] < end:
                    got = offsets(await r.read(at[name], 4 << 10))
                    assert got[0] == at[name]
                    at[name] = got[-1] + 1
                    await asyncio.sleep(0)
        ranges = [(k, a, b) for k, a, b in store.gets if k.endswith(".kfs")]
        assert len(ranges) == len(set(ranges))  # neither consumer made the other read anything twice
        assert len(r.cursors) <= 1  # the late one reached the end and let its windows go

    asyncio.run(run())


def test_a_segment_added_after_the_others_or_over_slices_keeps_the_list_ordered():
    """add_segment appends a segment that starts after the others (the usual
    case, without a search) and replaces the slices a compacted one covers,
    whatever their order of arrival."""
    def m(base: int, last: int, pos: int = 0) -> SegmentManifest:
        return SegmentManifest(base, last, last - base + 1, 100, 0, 0, f"k{base}-{last}", 0, pos=pos)

    r = LogReader(HeldStore(), NoCache(), 0, ReadBudget(1 << 20))
    for base in (0, 3, 5):
        assert r.add_segment(m(base, base + 1 if base < 5 else 7)) == []
    assert [s.base for s in r.segments] == [0, 3, 5]
    replaced = r.add_segment(m(0, 4, pos=-1))  # compacts the first two slices
    assert [s.key for s in replaced] == ["k0-1", "k3-4"]
    assert [(s.base, s.last) for s in r.segments] == [(0, 4), (5, 7)]
    assert r.add_segment(m(8, 8)) == []
    assert [s.base for s in r.segments] == [0, 5, 8] and r._bases == [0, 5, 8]
