"""The .kfs / .index byte layout (docs/segment-format.md)."""
from __future__ import annotations

import dataclasses
import json
import struct
from array import array
from types import SimpleNamespace

import pytest

from kafscale import _native
from kafscale._native import Pending
from kafscale.metadata.store import SegmentManifest
from kafscale.storage.cache import CachedSegment
from kafscale.storage.partition import producers_of
from kafscale.storage.segment import (
    FOOTER,
    HEADER,
    SegmentFormatError,
    build_segment,
    index_key,
    open_segment,
    parse_index,
    segment_key,
)
from kafscale.storage.wal import Slice


def batches(n: int, per: int = 3, size: int = 100) -> list[bytes]:
    return [_native.build_batch([(1000 + i, b"k", bytes([i % 256]) * size, [])] * per) for i in range(n)]


def test_keys():
    k = segment_key("ns", "orders", 3, 42, 7)
    assert k == "ns/orders/3/segment-00000000000000000042-0000000007.kfs"
    assert index_key(k) == "ns/orders/3/segment-00000000000000000042-0000000007.index"


def test_segment_bytes():
    bs = batches(4)
    payload = bs[0] + bs[1]  # one produce payload may hold several batches
    seg = build_segment([(payload, 100), (bs[2], 106), (bs[3], 109)], created_ms=1234, index_interval=1)
    data = bytes(seg.data)
    magic, version, flags, base, count, created = struct.unpack_from(">IHHqiq", data, 0)
    assert (magic, version, flags, base, count, created) == (0x4B414653, 1, 0, 100, 12, 1234)
    assert data[:4] == b"KAFS" and data[28:32] == b"\0\0\0\0"
    crc, last, end = struct.unpack_from(">IqI", data, len(data) - 16)
    assert data[-4:] == b"END!" and end == 0x454E4421 and last == 111
    assert crc == _native.crc32c(data[32:-16])
    # batches are stored as sent, with base offsets patched in place
    infos = _native.scan_batches(data[32:-16], True)
    assert [b.base_offset for b in infos] == [100, 103, 106, 109]
    cached = CachedSegment.from_built(seg)  # its tables, for the cache
    assert (list(cached.bases), list(cached.positions)) == ([b.base_offset for b in infos],
                                                          [32 + b.position for b in infos])
    hdr, body, last_off = open_segment(data)
    assert (hdr.base_offset, hdr.count, last_off, len(body)) == (100, 12, 111, len(data) - 48)
    # the native writer's layout is the one segment.py parses
    assert (_native.SEGMENT_HEADER_SIZE, _native.SEGMENT_FOOTER_SIZE) == (HEADER.size, FOOTER.size)


def test_a_malformed_payload_builds_no_segment():
    """build_segment copies and patches in native code: a truncated batch, or
    a payload of nothing, is refused, never read or written out of bounds."""
    b = batches(2)
    with pytest.raises(_native.BatchError):
        build_segment([(b[0], 0), (b[1][:-5], 3)], created_ms=0)
    with pytest.raises(_native.BatchError):
        build_segment([(b[0] + b"\0" * 20, 0)], created_ms=0)
    with pytest.raises(SegmentFormatError):
        build_segment([(b"", 0)], created_ms=0)


def _queued(payload: bytes, base: int, released: list[int], producer: tuple[int, int, int, int] | None = None
            ) -> Pending:
    """A batch queued as a node flush takes it: its release (once copied) is counted in `released`."""
    return Pending(memoryview(payload), base, None, lambda: released.append(base), producer)


class _Log(SimpleNamespace):
    producers_of = staticmethod(producers_of)


def test_a_node_objects_slices_are_the_segments_build_segment_makes():
    """assemble_node writes a flush's slices in one native call: each is
    byte for byte the segment build_segment makes of the same batches (less
    its index), its manifest, cache entry and directory row say what it
    holds, its cache tables name every batch, and each payload is released."""
    bs = batches(7)
    parts = [[(bs[0] + bs[1], 40), (bs[2], 46)], [(bs[3], 0)], [(bs[4], 9), (bs[5], 12), (bs[6], 15)]]
    logs = [_Log(topic="b", partition=3), _Log(topic='a"\\', partition=0), _Log(topic="b", partition=1)]
    producer = [None, None, (42, 7, 0, 0)]  # the last slice's first batch an idempotent producer's
    released: list[int] = []
    taken = [(lg, [_queued(p, base, released, producer[i] if j == 0 else None)
                   for j, (p, base) in enumerate(slice_parts)])
             for i, (lg, slice_parts) in enumerate(zip(logs, parts, strict=True))]
    places: dict[str, int] = {}
    body, slices, entries, rows, summary = _native.assemble_node(taken, 1234, "k.kfn", places, SegmentManifest,
                                                                 Slice, json.dumps)
    assert places == {"b": 0, 'a"\\': 1}
    # the collector's summary rows: each slice's topic place, partition, base and last offset, as in its row
    assert summary == array("q", [v for r in json.loads(f"[{rows.decode()}]") for v in r[:4]]).tobytes()
    pos = 0
    packed, tables = entries
    for i, ((lg, items), slice_parts, s, entry, row) in enumerate(zip(
            taken, parts, slices, struct.iter_unpack("=4q", packed), json.loads(f"[{rows.decode()}]"), strict=True)):
        seg = build_segment(slice_parts, created_ms=1234)
        m = s.manifest
        assert s.log is lg and s.items is items and all(p.release is None for p in items)
        assert (m.pos, m.size) == (pos, len(seg.data)) and bytes(body[pos:pos + m.size]) == bytes(seg.data)
        assert (m.base, m.last, m.count, m.min_ts, m.max_ts, m.key, m.created_ms) == (
            seg.base_offset, seg.last_offset, seg.count, seg.min_timestamp, seg.max_timestamp, "k.kfn", 1234)
        assert m.producers == ({} if producer[i] is None else {"42": [7, [[0, 0, items[0].base]]]})
        assert row == [places[lg.topic], lg.partition, m.base, m.last, m.count, m.pos, m.size, m.min_ts, m.max_ts,
                       *([m.producers] if m.producers else [])]
        assert entry[:2] == (m.pos, m.size)
        assert m.ref == dataclasses.replace(m, ref="").ref == f"k.kfn#{pos}"  # the ref SegmentManifest makes
        cached = CachedSegment.from_tables(memoryview(body)[pos:pos + m.size], memoryview(tables)[entry[2]:entry[3]])
        built = CachedSegment.from_built(seg)
        assert (list(cached.bases), list(cached.positions)) == (list(built.bases), list(built.positions))
        pos += m.size
    assert len(body) == pos
    assert sorted(released) == sorted(base for slice_parts in parts for _, base in slice_parts)  # each once
    # a truncated batch (refused, never read past), or none
    for payload, refused in ((bs[0][:-5], _native.BatchError), (b"", ValueError)):
        with pytest.raises(refused):
            _native.assemble_node([(logs[0], [_queued(payload, 0, [])])], 0, "k", {},
                                  SegmentManifest, Slice, json.dumps)


def test_index_bytes_and_lookup():
    bs = batches(10, per=3, size=250)  # ~830 bytes a batch: an entry every 4th batch
    seg = build_segment([(b, i * 3) for i, b in enumerate(bs)], created_ms=0, index_interval=2500)
    idx = seg.index
    magic, version, count, interval = struct.unpack_from(">IHii", idx, 0)
    assert idx[:4] == b"IDX\0" and (magic, version, interval) == (0x49445800, 1, 2500)
    assert len(idx) == 16 + 12 * count
    parsed = parse_index(idx)
    assert parsed.offsets[0] == 0 and parsed.positions[0] == 32
    assert 1 < count < 10  # sparse
    cached = CachedSegment.from_built(seg)
    for off, pos in zip(parsed.offsets, parsed.positions, strict=True):
        assert cached.positions[list(cached.bases).index(off)] == pos
    assert parsed.lookup(0) == 32
    assert parsed.lookup(29) == parsed.positions[-1]
    assert parsed.lookup(parsed.offsets[1] - 1) == 32


def test_corruption_detected():
    seg = build_segment([(batches(1)[0], 0)], created_ms=0)
    data = bytearray(seg.data)
    data[40] ^= 1
    with pytest.raises(SegmentFormatError):
        open_segment(bytes(data))
    with pytest.raises(SegmentFormatError):
        open_segment(b"NOPE" + bytes(seg.data[4:]))
    with pytest.raises(SegmentFormatError):
        parse_index(seg.index[:-1])  # entry count and length disagree


def test_cached_slices_whole_batches():
    bs = batches(5, per=1, size=1000)
    seg = CachedSegment.from_object(bytes(build_segment([(b, i) for i, b in enumerate(bs)], 0).data))
    view, to_end = seg.slice_from(2, 10)  # at least one batch
    assert [b.base_offset for b in _native.scan_batches(bytes(view))] == [2] and not to_end
    view, to_end = seg.slice_from(1, 2 * len(bs[0]) + 5)
    assert [b.base_offset for b in _native.scan_batches(bytes(view))] == [1, 2]
    view, to_end = seg.slice_from(3, 1 << 20)
    assert [b.base_offset for b in _native.scan_batches(bytes(view))] == [3, 4] and to_end
