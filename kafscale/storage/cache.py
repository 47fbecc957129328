"""In-memory cache of whole segments, least recently used evicted first."""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

from kafscale import _native
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE, BuiltSegment, open_segment


@dataclass
class CachedSegment:
    data: bytes | bytearray  # the whole .kfs object
    bases: list[int]  # first offset of each batch
    positions: list[int]  # byte position of each batch

    @property
    def body_end(self) -> int:
        return len(self.data) - FOOTER_SIZE

    @classmethod
    def from_built(cls, seg: BuiltSegment) -> CachedSegment:
        return cls(seg.data, seg.batch_bases, seg.positions)

    @classmethod
    def from_object(cls, data: bytes) -> CachedSegment:
        _, body, _ = open_segment(data)
        infos = _native.scan_batches(body)
        return cls(data, [b.base_offset for b in infos], [HEADER_SIZE + b.position for b in infos])

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


class SegmentCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._items: OrderedDict[str, CachedSegment] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> CachedSegment | None:
        seg = self._items.get(key)
        if seg is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return seg

    def put(self, key: str, seg: CachedSegment) -> None:
        if key in self._items:
            self.size -= len(self._items.pop(key).data)
        if len(seg.data) > self.capacity:
            return
        self._items[key] = seg
        self.size += len(seg.data)
        while self.size > self.capacity:
            _, old = self._items.popitem(last=False)
            self.size -= len(old.data)

    def drop_prefix(self, prefix: str) -> None:
        for key in [k for k in self._items if k.startswith(prefix)]:
            self.size -= len(self._items.pop(key).data)
