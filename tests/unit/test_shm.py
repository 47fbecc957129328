"""The shared-memory produce ring and segment cache (single process: the
cross-process part is the same memory and the same atomics)."""
from __future__ import annotations

import gc
import math
import random

import pytest

from kafscale import _native
from kafscale.broker import messages, shm
from kafscale.broker.shm import CacheReader, SharedArea, SharedCache, ref_position
from kafscale.storage.cache import CachedSegment
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE


def test_ring_never_overwrites_live_payloads_and_empty_ring_takes_anything():
    area = SharedArea(1, 4096, 0)
    ring = area.rings[0]
    tracker = ring.reader()
    rng = random.Random(7)
    live: list[tuple[int, memoryview, int]] = []  # each payload held: its start, the view the reader gave, its tag
    refused = 0
    for step in range(50_000):
        if live and (rng.random() < 0.5 or len(live) > 20):  # released in any order
            start, view, tag = live.pop(rng.randrange(len(live)))
            assert bytes(view) == bytes([tag]) * len(view), "a live payload was overwritten"
            tracker.release(start)
            continue
        n = rng.randint(1, ring.size)
        tag = step % 251
        start = ring.put(bytes([tag]) * n)  # what a worker does: room reserved and filled in one call
        if start is None:
            assert live, f"an empty ring refused {n} bytes"
            refused += 1
            continue
        live.append((start, tracker.track(start, n), tag))
    assert refused > 0
    for start, _, _ in live:
        tracker.release(start)
    assert ring.in_use() == 0
    assert ring.put(bytes(ring.size + 1)) is None
    assert ring.in_use() == 0


def test_a_ring_holds_any_number_of_payloads_and_its_tail_passes_only_released_ones():
    """The log process's end keeps its payloads in a table that grows: the
    tail stays at the oldest one held, whatever order the rest go in."""
    area = SharedArea(1, 1 << 20, 0)
    ring = area.rings[0]
    tracker = ring.reader()
    starts = [ring.put(bytes([i % 251]) * 50) for i in range(5000)]  # more than the table's first size
    held = [tracker.hold(start, 50) if i % 2 else (tracker.track(start, 50), None) for i, start in enumerate(starts)]
    assert all(bytes(v) == bytes([i % 251]) * 50 for i, (v, _) in enumerate(held))
    order = list(range(1, 5000))
    random.Random(3).shuffle(order)
    for i in order:  # all but the oldest: the tail stays put
        release = held[i][1]
        if release is None:
            tracker.release(starts[i])
        else:
            release()
        assert ring.in_use() == 5000 * 50
    with pytest.raises(KeyError):
        tracker.release(starts[1])  # released already
    tracker.release(starts[0])
    assert ring.in_use() == 0
    with pytest.raises(ValueError):
        tracker.track(ring.size - 10, 20)  # a payload never wraps


def test_a_workers_produce_calls_are_held_in_the_order_their_payloads_were_staged():
    """_native.hold_produce: what the log process makes of a worker's produce
    calls: each request's (acks, timeout_ms, transactional_id, topics), each
    payload held in its slot's ring (a view and its release) or refused."""
    area = SharedArea(2, 1 << 16, 0)
    trackers = [ring.reader() for ring in area.rings]
    starts = [area.rings[i % 2].put(bytes([i]) * (10 + i)) for i in range(4)]
    refused = messages.RejectedPayload(87, "too large")
    calls: list[messages.ProduceCall] = [
        (7, 9, "c", "/h", "User:u", -1, 30_000, None,
         (("a", ((0, (0, starts[0], 10)), (3, refused))), ("b", ((1, (1, starts[1], 11)),)))),
        (7, 9, "c", "/h", "User:u", 1, 5_000, "tx", (("a", ((2, (0, starts[2], 12)), (2, (1, starts[3], 13)))),))]
    reqs = _native.hold_produce(calls, trackers, lambda p: ("refused", p.code, p.message))
    assert [(acks, timeout, tid, [(name, [p for p, _ in parts]) for name, parts in topics])
            for acks, timeout, tid, topics in reqs] == [
        (-1, 30_000, None, [("a", [0, 3]), ("b", [1])]), (1, 5_000, "tx", [("a", [2, 2])])]
    payloads = [payload for *_, topics in reqs for _, parts in topics for _, payload in parts]
    assert payloads[1] == ("refused", 87, "too large")
    held = [payloads[i] for i in (0, 2, 3, 4)]
    assert [bytes(view) for view, _ in held] == [bytes([i]) * (10 + i) for i in range(4)]
    assert [ring.in_use() for ring in area.rings] == [22, 24]
    held[2][1]()  # ring 0's second payload: its tail waits for the first
    assert area.rings[0].in_use() == 22
    for _, release in held[:2]:
        release()
    assert [ring.in_use() for ring in area.rings] == [0, 13]
    with pytest.raises(ValueError):
        _native.hold_produce([(*calls[0][:8], (("a", ((0, (2, 0, 1)),)),))], trackers, lambda p: p)


def segment(tag: int, n: int) -> CachedSegment:
    return CachedSegment(bytes([tag]) * n, [0], [0], body_end=n)


def test_cache_serves_until_overwritten_and_never_overwrites_a_pinned_segment():
    area = SharedArea(2, 64, 1000)
    cache = SharedCache(area)
    reader = CacheReader(area, 1)
    cache.put("a", segment(1, 400))
    cache.put("b", segment(2, 400))
    ref_a = cache.refs["a"]
    seg = reader.acquire(ref_a)  # pinned: as if being sent to a client
    assert seg is not None and bytes(seg.data) == bytes([1]) * 400
    cache.put("c", segment(3, 400))  # would wrap over "a": skipped while "a" is pinned
    assert "c" not in cache.refs and cache.skipped_pinned == 1
    assert bytes(seg.data) == bytes([1]) * 400
    reader.release(ref_position(ref_a))
    cache.put("c", segment(3, 400))
    assert "c" in cache.refs and "a" not in cache.refs
    assert reader.acquire(ref_a) is None  # overwritten: the worker reads S3 instead
    got = cache.get("b")
    assert got is not None and bytes(got.data) == bytes([2]) * 400


def test_a_cached_segments_batches_are_its_bytes_between_header_and_footer_until_overwritten():
    cache = SharedCache(SharedArea(1, 64, 1000))
    data = bytes([7]) * HEADER_SIZE + bytes(range(100)) + bytes([9]) * FOOTER_SIZE
    cache.put("a", CachedSegment(data, [0], [HEADER_SIZE]))
    got, missing = cache.batches(["a", "b"])
    assert got is not None and bytes(got) == bytes(range(100)) and missing is None
    cache.put("b", segment(2, 600))
    cache.put("c", segment(3, 600))  # wraps over "a"
    assert cache.batches(["a", "b"]) == [None, None] and cache.batches(["c"])[0] is not None


def put_object(cache: SharedCache, *segments: tuple[str, int, int]) -> None:
    """A node object of segments (key, tag, size), back to back, into the cache."""
    body, entries = bytearray(), []
    for key, tag, n in segments:
        entries.append((key, len(body), n, segment(tag, n).tables()))
        body += bytes([tag]) * n
    cache.put_object(memoryview(body), entries)


def test_a_node_objects_slices_go_into_the_cache_back_to_back_or_not_at_all():
    area = SharedArea(1, 64, 1000)
    cache, reader = SharedCache(area), CacheReader(area, 0)
    cache.put("a", segment(1, 300))
    put_object(cache, ("b", 2, 200), ("empty", 0, 0), ("c", 3, 300))
    assert [ref_position(cache.refs[k]) for k in ("a", "b", "c")] == [0, 300, 500] and "empty" not in cache.refs
    for key, tag, n in (("b", 2, 200), ("c", 3, 300)):
        got = cache.get(key)
        assert got is not None and bytes(got.data) == bytes([tag]) * n
    ref_a = cache.refs["a"]
    assert reader.acquire(ref_a) is not None  # pinned: as if being sent to a client
    put_object(cache, ("d", 4, 100), ("e", 5, 200))  # the second would wrap over "a"
    assert "d" not in cache.refs and "e" not in cache.refs and cache.skipped_pinned == 2, "all or none"
    reader.release(ref_position(ref_a))
    put_object(cache, ("d", 4, 100), ("e", 5, 200))
    assert [ref_position(cache.refs[k]) for k in ("d", "e")] == [1000, 1100] and "a" not in cache.refs
    put_object(cache, ("d", 9, 100))  # a key again: its new place, and the last to be overwritten
    assert list(cache.refs)[-2:] == ["e", "d"] and ref_position(cache.refs["d"]) == 1300
    assert bytes(cache.get("d").data) == bytes([9]) * 100  # type: ignore[union-attr]
    # more than the cache holds together: each that fits goes alone, the later ones over the earlier
    put_object(cache, ("f", 6, 600), ("g", 7, 600), ("h", 8, 2000))
    assert "h" not in cache.refs and "f" not in cache.refs
    got = cache.get("g")
    assert got is not None and bytes(got.data) == bytes([7]) * 600


def test_a_cache_entry_is_no_object_of_the_cyclic_collector_and_keeps_every_batch():
    """The log process keeps an entry per cached slice (2,000 new ones a
    second at 100 partitions): each must cost its young collections nothing."""
    area = SharedArea(1, 64, 4096)
    cache, reader = SharedCache(area), CacheReader(area, 0)
    cache.put("x", segment(1, 100))
    cache.put("y", CachedSegment(bytes(range(200)), [7, 9, 12], [0, 60, 130], body_end=200))
    ref = cache.refs["y"]
    assert not gc.is_tracked(ref)
    assert ref_position(ref) == 100
    got = reader.acquire(ref)
    assert got is not None and bytes(got.data) == bytes(range(200))
    assert list(got.bases) == [7, 9, 12] and list(got.positions) == [0, 60, 130]
    assert bytes(got.slice_from(10, 1)[0]) == bytes(range(60, 130))


def test_a_read_of_a_cached_segment_slices_it_as_the_segment_itself_does():
    """SharedCache.read and CacheReader.read (_native.cached_slice, from the
    ref alone) give what slice_from of the cached segment gives, for any
    offset and size; the reader's read pins the segment as acquire does."""
    rnd = random.Random(5)
    area = SharedArea(1, 64, 1 << 13)  # the first segments are overwritten by the last
    cache, reader = SharedCache(area), CacheReader(area, 0)
    for round_ in range(60):
        count = rnd.randint(1, 12)
        sizes = [rnd.randint(1, 90) for _ in range(count)]
        positions = [HEADER_SIZE + sum(sizes[:i]) for i in range(count)]
        bases = sorted(rnd.sample(range(1000), count))
        data = bytes(rnd.randrange(256) for _ in range(HEADER_SIZE + sum(sizes) + FOOTER_SIZE))
        key = f"s{round_}"
        cache.put(key, CachedSegment(data, bases, positions))
        if round_ == 0:
            first = cache.refs[key]
        whole = cache.get(key)
        assert whole is not None
        for _ in range(40):
            offset, max_bytes = rnd.randint(-5, 1005), rnd.choice([0, 1, rnd.randint(1, 400), 1 << 20])
            chunk, to_end = whole.slice_from(offset, max_bytes)
            expected = (bytes(chunk), to_end)
            got = cache.read(key, offset, max_bytes)
            assert got is not None and (bytes(got[0]), got[1]) == expected, (bases, positions, offset, max_bytes)
            pinned = reader.read(cache.refs[key], offset, max_bytes)
            assert pinned is not None and (bytes(pinned[0]), pinned[1]) == expected
            reader.release(ref_position(cache.refs[key]))
    assert cache.read("missing", 0, 100) is None
    with pytest.raises(ValueError):
        _native.cached_slice(cache.data, cache.size, bytes(20), 0, 100)
    assert "s0" not in cache.refs and cache.read("s0", 0, 100) is None
    assert reader.read(first, 0, 100) is None and reader.misses == 1, "overwritten: not pinned, not read"


def test_the_cache_says_how_long_it_keeps_a_segment_at_the_rate_it_is_written(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(shm.time, "monotonic", lambda: now[0])
    cache = SharedCache(SharedArea(1, 64, 1000))
    assert cache.keeps_s() == math.inf, "nothing written: nothing is overwritten"
    for i in range(6):  # 100 bytes a second
        cache.put(f"s{i}", segment(i, 100))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 100)
    now[0] += 10  # nothing more written: what is cached stays longer
    assert cache.keeps_s() == pytest.approx(cache.size / (500 / 15))
    for i in range(12):  # 200 bytes a second: the rate of the last RATE_WINDOW_S counts, not the slower one before
        cache.put(f"t{i}", segment(i, 200))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 200)
    now[0] += 5  # quiet, then 500 bytes a second: the last second's rate counts, not the window's slower one
    for i in range(3):
        cache.put(f"u{i}", segment(i, 500))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 500)
