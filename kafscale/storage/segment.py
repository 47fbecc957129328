"""The .kfs segment and .index formats (byte layout in docs/segment-format.md).

Segment:  header(32) | RecordBatch v2 bytes, offsets assigned | footer(16)
  header: magic "KAFS" u32, version u16, flags u16, base offset i64,
          message count i32, created ms i64, reserved 4 bytes
  footer: CRC32C of all batch bytes u32, last offset i64, magic "END!" u32
Index:    header(16) | entries of (offset i64, position i32)
  header: magic "IDX\\0" u32, version u16, entry count i32,
          interval i32, reserved 2 bytes
An index entry names the first offset of a batch and that batch's byte
position in the .kfs object; one entry is written for the first batch and
then for the first batch that starts `interval` or more bytes after the
previous entry. All integers are big-endian."""
from __future__ import annotations

import bisect
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kafscale import _native

# a segment's header and footer are written natively (_native.assemble_segment and assemble_node)
SEGMENT_MAGIC = _native.SEGMENT_MAGIC  # "KAFS"
FOOTER_MAGIC = _native.SEGMENT_FOOTER_MAGIC  # "END!"
FORMAT_VERSION = _native.SEGMENT_VERSION
INDEX_MAGIC = 0x49445800  # "IDX\0"
HEADER = struct.Struct(">IHHqiq4x")
FOOTER = struct.Struct(">IqI")
INDEX_HEADER = struct.Struct(">IHii2x")
INDEX_ENTRY = struct.Struct(">qi")
HEADER_SIZE = HEADER.size  # 32, _native.SEGMENT_HEADER_SIZE
FOOTER_SIZE = FOOTER.size  # 16, _native.SEGMENT_FOOTER_SIZE
DEFAULT_INDEX_INTERVAL = 64 * 1024


class SegmentFormatError(ValueError):
    pass


def segment_key(namespace: str, topic: str, partition: int, base_offset: int, epoch: int) -> str:
    """Object key of a segment. The owner epoch in the name means two owners of
    a partition (an old one fenced by a new one) never write the same key."""
    return f"{namespace}/{topic}/{partition}/segment-{base_offset:020d}-{epoch:010d}.kfs"


def topic_marker_key(namespace: str, topic: str) -> str:
    """The object naming the topic's current incarnation: JSON {"topic", "id"}
    (id: hex UUID). A reader without etcd tells by it which segments in shared
    objects are this topic's and which a deleted topic of the same name left."""
    return f"{namespace}/{topic}/topic.json"


def index_key(segment: str) -> str:
    return segment[: -len(".kfs")] + ".index"


def has_index(size: int, pos: int = -1) -> bool:
    """Whether a segment of `size` bytes has a .index object: only one whose
    batches take more than DEFAULT_INDEX_INTERVAL bytes, and never a slice of
    a node object (pos >= 0: at most flush_bytes). A smaller one's index would
    name only its first batch, so it is read whole instead (with many small
    partitions, their compactions then PUT one object each, not two)."""
    return pos < 0 and size - HEADER_SIZE - FOOTER_SIZE > DEFAULT_INDEX_INTERVAL


# partition, base offset and owner epoch in the key of a segment or its index
SEGMENT_KEY = re.compile(r"/(\d+)/segment-(\d{20})-(\d{10})\.(kfs|index)$")


class SegmentKey(NamedTuple):
    partition: int
    base_offset: int
    epoch: int
    kind: str  # "kfs" (the segment) or "index"


def parse_segment_key(key: str) -> SegmentKey | None:
    """What a segment or index object's key says (None: not such a key)."""
    m = SEGMENT_KEY.search(key)
    return None if m is None else SegmentKey(int(m[1]), int(m[2]), int(m[3]), m[4])


def key_epoch(key: str) -> int | None:
    """The owner epoch a segment or index key was written under (None: not such a key)."""
    parsed = parse_segment_key(key)
    return None if parsed is None else parsed.epoch


def first_at_or_after(body: bytes | memoryview, ts: int, min_offset: int = 0) -> tuple[int, int] | None:
    """(offset, timestamp) of the first record at or after min_offset whose
    timestamp is >= ts, among the record batches in body; None if there is none."""
    for b in _native.scan_batches(body):
        if b.max_timestamp < ts:
            continue
        for off, rts, _, _, _ in _native.iter_records(b, body):
            if rts >= ts and off >= min_offset:
                return off, rts
    return None


@dataclass
class BuiltSegment:
    data: bytearray  # the whole .kfs object
    index: bytes  # the whole .index object
    base_offset: int
    last_offset: int
    count: int  # records
    min_timestamp: int
    max_timestamp: int
    tables: bytes  # the first offset of each batch, then its byte position in `data` (CachedSegment.tables)


def build_segment(batches: Sequence[tuple[memoryview | bytes, int]], created_ms: int,
                  index_interval: int = DEFAULT_INDEX_INTERVAL) -> BuiltSegment:
    """Assemble a segment from (batch bytes, assigned base offset) pairs.

    Batches are copied once into the object buffer and their base offsets
    patched in place (the batch CRC does not cover it), in native code."""
    return built_segment(_native.assemble_segment(list(batches), created_ms, index_interval), index_interval)


def built_segment(assembled: tuple[Any, ...], index_interval: int = DEFAULT_INDEX_INTERVAL) -> BuiltSegment:
    """The segment _native.assemble_segment (or assemble_cached) made."""
    data, n, tables, entries, count, min_ts, max_ts, last_offset = assembled
    if not n:
        raise SegmentFormatError("a segment needs at least one batch")
    index = INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_VERSION, len(entries) // INDEX_ENTRY.size, index_interval) + entries
    return BuiltSegment(data, index, struct.unpack_from("=q", tables)[0], last_offset, count, min_ts, max_ts, tables)


@dataclass
class SegmentHeader:
    base_offset: int
    count: int
    created_ms: int
    flags: int


def parse_header(data: bytes | memoryview) -> SegmentHeader:
    if len(data) < HEADER_SIZE:
        raise SegmentFormatError("segment shorter than its header")
    magic, version, flags, base, count, created = HEADER.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC:
        raise SegmentFormatError(f"bad segment magic {magic:#x}")
    if version != FORMAT_VERSION:
        raise SegmentFormatError(f"unsupported segment version {version}")
    return SegmentHeader(base, count, created, flags)


def open_segment(data: bytes | bytearray | memoryview, verify: bool = True
                 ) -> tuple[SegmentHeader, memoryview, int]:
    """Check a whole .kfs object; returns (header, batch bytes, last offset)."""
    header = parse_header(data)
    if len(data) < HEADER_SIZE + FOOTER_SIZE:
        raise SegmentFormatError("segment shorter than header + footer")
    crc, last, magic = FOOTER.unpack_from(data, len(data) - FOOTER_SIZE)
    if magic != FOOTER_MAGIC:
        raise SegmentFormatError(f"bad footer magic {magic:#x}")
    body = memoryview(data)[HEADER_SIZE:len(data) - FOOTER_SIZE]
    if verify and _native.crc32c(body) != crc:
        raise SegmentFormatError("segment CRC32C mismatch")
    return header, body, last


@dataclass
class SegmentIndex:
    interval: int
    offsets: list[int]
    positions: list[int]

    def lookup(self, offset: int) -> int:
        """Byte position of the last indexed batch starting at or before offset."""
        i = bisect.bisect_right(self.offsets, offset) - 1
        return self.positions[max(i, 0)] if self.positions else HEADER_SIZE


def parse_index(data: bytes) -> SegmentIndex:
    if len(data) < INDEX_HEADER.size:
        raise SegmentFormatError("index shorter than its header")
    magic, version, count, interval = INDEX_HEADER.unpack_from(data, 0)
    if magic != INDEX_MAGIC or version != FORMAT_VERSION:
        raise SegmentFormatError("bad index header")
    if len(data) != INDEX_HEADER.size + count * INDEX_ENTRY.size:
        raise SegmentFormatError("index length does not match its entry count")
    offsets, positions = [], []
    for i in range(count):
        off, pos = INDEX_ENTRY.unpack_from(data, INDEX_HEADER.size + i * INDEX_ENTRY.size)
        offsets.append(off)
        positions.append(pos)
    return SegmentIndex(interval, offsets, positions)
