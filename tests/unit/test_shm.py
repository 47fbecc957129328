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
from kafscale.metadata.store import SegmentManifest
from kafscale.storage.cache import CachedSegment
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE, build_segment


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


def seg(key: str, pos: int = -1) -> SegmentManifest:
    """The manifest of a segment object of its own (pos -1) or of the segment at pos in object `key`."""
    return SegmentManifest(0, 0, 1, 0, 0, 0, key, 0, {}, pos)


def test_cache_serves_until_overwritten_and_never_overwrites_a_pinned_segment():
    area = SharedArea(2, 64, 1000)
    cache = SharedCache(area)
    reader = CacheReader(area, 1)
    a, b, c = seg("a"), seg("b"), seg("c")
    cache.put(a, segment(1, 400))
    cache.put(b, segment(2, 400))
    ref_a = cache.ref(a)
    assert ref_a is not None
    got = reader.acquire(ref_a)  # pinned: as if being sent to a client
    assert got is not None and bytes(got.data) == bytes([1]) * 400
    cache.put(c, segment(3, 400))  # would wrap over "a": skipped while "a" is pinned
    assert not cache.holds(c) and cache.skipped_pinned == 1
    assert bytes(got.data) == bytes([1]) * 400
    reader.release(ref_position(ref_a))
    cache.put(c, segment(3, 400))
    assert cache.holds(c) and not cache.holds(a) and "a" not in cache.objects, "wholly overwritten: forgotten"
    assert reader.acquire(ref_a) is None  # overwritten: the worker reads S3 instead
    got = cache.get(b)
    assert got is not None and bytes(got.data) == bytes([2]) * 400
    cache.drop(b)
    assert cache.get(b) is None


def test_a_cached_segments_batches_are_its_bytes_between_header_and_footer_until_overwritten():
    cache = SharedCache(SharedArea(1, 64, 1000))
    data = bytes([7]) * HEADER_SIZE + bytes(range(100)) + bytes([9]) * FOOTER_SIZE
    a, b, c = seg("a"), seg("b"), seg("c")
    cache.put(a, CachedSegment(data, [0], [HEADER_SIZE]))
    got, missing = cache.batches([a, b])
    assert got is not None and bytes(got) == bytes(range(100)) and missing is None
    cache.put(b, segment(2, 600))
    cache.put(c, segment(3, 600))  # wraps over "a"
    assert cache.batches([a, b]) == [None, None] and cache.batches([c])[0] is not None


def put_object(cache: SharedCache, key: str, *segments: tuple[int, int]) -> list[SegmentManifest]:
    """A node object `key` of segments (tag, size), back to back, into the cache: their manifests."""
    body, entries = bytearray(), []
    for tag, n in segments:
        entries.append((len(body), n, segment(tag, n).tables()))
        body += bytes([tag]) * n
    cache.put_object(key, memoryview(body), _native.pack_entries(entries))
    return [seg(key, pos) for pos, _, _ in entries]


def test_a_node_objects_slices_go_into_the_cache_back_to_back_or_not_at_all():
    area = SharedArea(1, 64, 1000)
    cache, reader = SharedCache(area), CacheReader(area, 0)
    a = seg("a")
    cache.put(a, segment(1, 300))
    b, c = put_object(cache, "n1", (2, 200), (3, 300))
    assert [ref_position(cache.ref(m) or b"") for m in (a, b, c)] == [0, 300, 500]
    assert cache.ref(seg("n1", 100)) is None and cache.ref(seg("n1", 600)) is None, "no segment starts there"
    for m, tag, n in ((b, 2, 200), (c, 3, 300)):
        got = cache.get(m)
        assert got is not None and bytes(got.data) == bytes([tag]) * n
    ref_a = cache.ref(a)
    assert ref_a is not None and reader.acquire(ref_a) is not None  # pinned: as if being sent to a client
    d, e = put_object(cache, "n2", (4, 100), (5, 200))  # the second would wrap over "a"
    assert not cache.holds(d) and not cache.holds(e) and cache.skipped_pinned == 2, "all or none"
    reader.release(ref_position(ref_a))
    put_object(cache, "n2", (4, 100), (5, 200))
    assert [ref_position(cache.ref(m) or b"") for m in (d, e)] == [1000, 1100] and not cache.holds(a)
    assert cache.holds(b), "the rest of an object partly overwritten stays"
    [d] = put_object(cache, "n2", (9, 100))  # a key again: its new place, and only its new entries
    assert ref_position(cache.ref(d) or b"") == 1300 and not cache.holds(e)
    assert bytes(cache.get(d).data) == bytes([9]) * 100  # type: ignore[union-attr]
    # one slice put again alone (read back from S3): under its ref, the others of its object stay
    cache.put(e, segment(10, 200))
    assert bytes(cache.get(e).data) == bytes([10]) * 200 and cache.holds(d)  # type: ignore[union-attr]
    cache.drop(e)
    assert not cache.holds(e) and cache.holds(d)
    # more than the cache holds together: each that fits goes alone, the later ones over the earlier
    f, g, h = put_object(cache, "n3", (6, 600), (7, 600), (8, 2000))
    assert not cache.holds(h) and not cache.holds(f)
    got = cache.get(g)
    assert got is not None and bytes(got.data) == bytes([7]) * 600
    cache.drop_prefix("n")
    assert list(cache.objects) == []


def test_cache_entries_and_refs_are_no_objects_of_the_cyclic_collector_and_keep_every_batch():
    """The cache holds an entry a slice it has (about 450,000 at 20,000
    records/s over 1,000 partitions), and a worker is sent a ref of each
    slice it views at every node commit: neither may cost the young
    collections anything."""
    area = SharedArea(1, 64, 4096)
    cache, reader = SharedCache(area), CacheReader(area, 0)
    [m] = put_object(cache, "n", (5, 300))
    assert m.key in cache.objects and not any(gc.is_tracked(part) for part in cache.objects[m.key][1:])
    cache.put(seg("x"), segment(1, 100))
    y = seg("y")
    cache.put(y, CachedSegment(bytes(range(200)), [7, 9, 12], [0, 60, 130], body_end=200))
    ref = cache.ref(y)
    assert ref is not None and not gc.is_tracked(ref)
    assert ref_position(ref) == 400
    got = reader.acquire(ref)
    assert got is not None and bytes(got.data) == bytes(range(200))
    assert list(got.bases) == [7, 9, 12] and list(got.positions) == [0, 60, 130]
    assert bytes(got.slice_from(10, 1)[0]) == bytes(range(60, 130))


def test_a_read_of_a_cached_segment_slices_it_as_the_segment_itself_does():
    """SharedCache.read and CacheReader.read (_native.cached_slice, from the
    ref alone) give what slice_from of the cached segment gives, for any
    offset and size; the reader's read pins the segment as acquire does.
    Some segments lie in objects of several (at random places in them)."""
    rnd = random.Random(5)
    area = SharedArea(1, 64, 1 << 13)  # the first segments are overwritten by the last
    cache, reader = SharedCache(area), CacheReader(area, 0)
    for round_ in range(60):
        count = rnd.randint(1, 12)
        sizes = [rnd.randint(1, 90) for _ in range(count)]
        positions = [HEADER_SIZE + sum(sizes[:i]) for i in range(count)]
        bases = sorted(rnd.sample(range(1000), count))
        data = bytes(rnd.randrange(256) for _ in range(HEADER_SIZE + sum(sizes) + FOOTER_SIZE))
        one = CachedSegment(data, bases, positions)
        if rnd.random() < 0.5:
            m = seg(f"s{round_}")
            cache.put(m, one)
        else:  # between two others in a node object
            before, after = rnd.randint(1, 50), rnd.randint(1, 50)
            m = seg(f"s{round_}", before)
            cache.put_object(m.key, memoryview(bytes(before) + data + bytes(after)), _native.pack_entries(
                [(0, before, segment(0, before).tables()), (before, len(data), one.tables()),
                 (before + len(data), after, segment(0, after).tables())]))
        if round_ == 0:
            first, first_ref = m, cache.ref(m)
        whole = cache.get(m)
        assert whole is not None and bytes(whole.data) == data
        for _ in range(40):
            offset, max_bytes = rnd.randint(-5, 1005), rnd.choice([0, 1, rnd.randint(1, 400), 1 << 20])
            chunk, to_end = whole.slice_from(offset, max_bytes)
            expected = (bytes(chunk), to_end)
            got = cache.read(m, offset, max_bytes)
            assert got is not None and (bytes(got[0]), got[1]) == expected, (bases, positions, offset, max_bytes)
            ref = cache.ref(m)
            assert ref is not None
            pinned = reader.read(ref, offset, max_bytes)
            assert pinned is not None and (bytes(pinned[0]), pinned[1]) == expected
            reader.release(ref_position(ref))
    assert cache.read(seg("missing"), 0, 100) is None
    with pytest.raises(ValueError):
        _native.cached_slice(cache.data, cache.size, bytes(20), 0, 100)
    assert not cache.holds(first) and cache.read(first, 0, 100) is None
    assert first_ref is not None and reader.read(first_ref, 0, 100) is None and reader.misses == 1, (
        "overwritten: not pinned, not read")


def test_a_segment_built_from_cached_slices_is_the_one_build_segment_makes_of_their_batches():
    """SharedCache.build (_native.assemble_cached, what a compaction does
    when all it takes is cached) copies the slices' batches straight out of
    the ring: the same segment as build_segment of the same batches at the
    same base offsets; None once one of them is not cached."""
    cache = SharedCache(SharedArea(1, 64, 1 << 16))
    parts, manifests, base = [], [], 0
    for i in range(3):  # three node objects, each holding one slice of ours among others
        batches = [_native.build_batch([(1000 + i, None, b"v%d-%d" % (i, j), [])] * (j + 1)) for j in range(i + 1)]
        ours = build_segment([(b, 0) for b in batches], 5)  # its base offsets as a slice's (patched again below)
        other = build_segment([(_native.build_batch([(7, None, b"other", [])]), 0)], 5)
        body = bytes(other.data) + bytes(ours.data)
        cache.put_object(f"n{i}", memoryview(body), _native.pack_entries(
            [(0, len(other.data), other.tables), (len(other.data), len(ours.data), ours.tables)]))
        manifests.append(SegmentManifest(base, base + ours.count - 1, ours.count, len(ours.data), 0, 0, f"n{i}", 0,
                                         {}, len(other.data)))
        parts.append((b"".join(batches), base))
        base += ours.count
    built, expected = cache.build(manifests, 1234), build_segment(parts, 1234)
    assert built is not None
    assert (bytes(built.data), built.index, built.tables) == (bytes(expected.data), expected.index, expected.tables)
    assert (built.base_offset, built.last_offset, built.count) == (0, 9, 10) == (
        expected.base_offset, expected.last_offset, expected.count)
    assert cache.build([manifests[0], seg("n9", 0)], 1234) is None
    del cache.objects["n1"]
    assert cache.build(manifests, 1234) is None


def test_the_cache_says_how_long_it_keeps_a_segment_at_the_rate_it_is_written(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(shm.time, "monotonic", lambda: now[0])
    cache = SharedCache(SharedArea(1, 64, 1000))
    assert cache.keeps_s() == math.inf, "nothing written: nothing is overwritten"
    for i in range(6):  # 100 bytes a second
        cache.put(seg(f"s{i}"), segment(i, 100))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 100)
    now[0] += 10  # nothing more written: what is cached stays longer
    assert cache.keeps_s() == pytest.approx(cache.size / (500 / 15))
    for i in range(12):  # 200 bytes a second: the rate of the last RATE_WINDOW_S counts, not the slower one before
        cache.put(seg(f"t{i}"), segment(i, 200))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 200)
    now[0] += 5  # quiet, then 500 bytes a second: the last second's rate counts, not the window's slower one
    for i in range(3):
        cache.put(seg(f"u{i}"), segment(i, 500))
        now[0] += 1
    now[0] -= 1
    assert cache.keeps_s() == pytest.approx(cache.size / 500)
