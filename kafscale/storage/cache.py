"""A whole segment (or a window of one) in memory, sliced into Fetch responses."""
from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kafscale import _native
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE, BuiltSegment, open_segment


@dataclass
class CachedSegment:
    data: bytes | bytearray | memoryview  # the whole .kfs object
    bases: Sequence[int]  # first offset of each batch
    positions: Sequence[int]  # byte position of each batch
    body_end: int = -1  # where the batches end (default: before the footer)

    def __post_init__(self) -> None:
        if self.body_end < 0:
            self.body_end = len(self.data) - FOOTER_SIZE

    @classmethod
    def from_built(cls, seg: BuiltSegment) -> CachedSegment:
        return cls.from_tables(memoryview(seg.data), memoryview(seg.tables))

    @classmethod
    def from_tables(cls, data: memoryview, tables: memoryview) -> CachedSegment:
        """data, with its tables (tables(): base offsets, then positions, 8-byte integers)."""
        half = len(tables) // 2
        return cls(data, tables[:half].cast("q"), tables[half:].cast("q"))

    @classmethod
    def from_object(cls, data: bytes | memoryview) -> CachedSegment:
        _, body, _ = open_segment(data)
        infos = _native.scan_batches(body)
        return cls(data, [b.base_offset for b in infos], [HEADER_SIZE + b.position for b in infos])

    def tables(self) -> bytes:
        """Its tables for a shared-memory cache entry: its batches' base offsets, then their positions."""
        return array("q", self.bases).tobytes() + array("q", self.positions).tobytes()

    def batches(self) -> memoryview:
        """Its batches: the bytes between the header and body_end."""
        return memoryview(self.data)[HEADER_SIZE:self.body_end]

    def slice_from(self, offset: int, max_bytes: int) -> tuple[memoryview, bool]:
        """Whole batches from the one holding `offset`, up to max_bytes (always
        at least one batch, as Kafka does so that big records make progress),
        and whether they reach the end of the segment."""
        i = max(bisect.bisect_right(self.bases, offset) - 1, 0)
        start = self.positions[i]
        ends = [*self.positions[1:], self.body_end]  # end of each batch
        last = max(bisect.bisect_right(ends, start + max_bytes) - 1, i)
        end = ends[last]
        return memoryview(self.data)[start:end], end == self.body_end
