"""Reading one partition's committed batches: from the segment cache when the
segment is there, otherwise from S3 with ranged GETs located through the
segment's index, a read-ahead window at a time.

The log process's PartitionLog and a protocol worker's PartitionView both
read through this class; they differ only in how `segments`, `hw` and
`log_start` are kept up to date."""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from typing import Protocol

from kafscale import _native, metrics
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.storage.cache import CachedSegment
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE, SegmentIndex, index_key, parse_index


class LogError(KafkaError):
    """A partition-log error (offset out of range, fenced, closed, ...)."""


class SegmentSource(Protocol):
    """Where whole recent segments are kept (in-process or shared memory)."""

    def get(self, key: str) -> CachedSegment | None: ...

    def put(self, key: str, seg: CachedSegment) -> None: ...

    def drop_prefix(self, prefix: str) -> None: ...


@dataclass
class _Window:
    """Whole batches of one segment read with one ranged GET: [start, start+len(data))."""
    key: str
    start: int
    seg: CachedSegment  # positions relative to `data`
    last: int  # last offset held
    at_end: bool  # the window reaches the end of the segment body

    @property
    def next_position(self) -> int:
        return self.start + len(self.seg.data)

    def covers(self, offset: int) -> bool:
        return bool(self.seg.bases) and self.seg.bases[0] <= offset <= self.last


class LogReader:
    def __init__(self, store: ObjectStore, cache: SegmentSource, readahead_bytes: int) -> None:
        self.store = store
        self.cache = cache
        self.readahead_bytes = readahead_bytes
        self.hw = 0
        self.log_start = 0
        self.segments: list[SegmentManifest] = []
        self._bases: list[int] = []
        self._indexes: dict[str, SegmentIndex] = {}
        self._window: _Window | None = None
        self._next: tuple[str, int, asyncio.Task[_Window]] | None = None

    def set_segments(self, segments: list[SegmentManifest]) -> None:
        self.segments = segments
        self._bases = [m.base for m in segments]

    def add_segment(self, m: SegmentManifest) -> None:
        self.segments.append(m)
        self._bases.append(m.base)

    def drop_segments(self, n: int) -> None:
        for m in self.segments[:n]:
            self._indexes.pop(m.key, None)
        self.segments = self.segments[n:]
        self._bases = self._bases[n:]

    def stop_reading(self) -> None:
        if self._next is not None:
            self._next[2].cancel()
        self._window = self._next = None

    async def read(self, offset: int, max_bytes: int) -> list[memoryview | bytes]:
        """Committed batches from the one holding `offset`, across segments,
        whole batches only, up to max_bytes (but always at least one batch so
        that a record larger than max_bytes still makes progress). Empty at the
        watermark; raises LogError(OFFSET_OUT_OF_RANGE) outside the log."""
        if offset < self.log_start or offset > self.hw:
            raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} outside [{self.log_start}, {self.hw}]")
        out: list[memoryview | bytes] = []
        size = 0
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0 and offset < self.hw:
            raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} precedes every segment")
        while offset < self.hw and i < len(self.segments) and size < max_bytes:
            m = self.segments[i]
            if offset > m.last:
                i += 1
                continue
            try:
                chunk, to_end = await self._read_segment(i, offset, max_bytes - size)
            except Exception:
                if offset < self.log_start:  # removed by retention while we read it
                    raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} was deleted") from None
                raise
            if out and size + len(chunk) > max_bytes:
                break
            out.append(chunk)
            size += len(chunk)
            if not to_end:
                break
            offset, i = m.last + 1, i + 1
        if offset >= self.hw:  # caught up: recent segments come from the cache, so let the windows go
            self.stop_reading()
        return out

    async def _read_segment(self, i: int, offset: int, max_bytes: int) -> tuple[memoryview | bytes, bool]:
        """Batches of segment i from `offset`; and whether they reach its end."""
        m = self.segments[i]
        seg = self.cache.get(m.key)
        if seg is not None:
            metrics.SEGMENT_READS.labels(metrics.node(), "cache").inc()
            return seg.slice_from(offset, max_bytes)
        metrics.SEGMENT_READS.labels(metrics.node(), "s3").inc()
        w = await self._window_for(m, offset)
        chunk, to_window_end = w.seg.slice_from(offset, max_bytes)
        if to_window_end or len(chunk) * 2 >= len(w.seg.data):
            self._prefetch_after(w, i)
        return chunk, to_window_end and w.at_end

    async def _window_for(self, m: SegmentManifest, offset: int) -> _Window:
        w = self._window
        if w is not None and w.key == m.key and w.covers(offset):
            return w
        if self._next is not None and self._next[0] == m.key:
            # Another read of this view (another consumer) may cancel the
            # prefetch while we wait: wait without inheriting its cancellation.
            task = self._next[2]
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None and task.result().covers(offset):
                w = self._window = task.result()
                if self._next is not None and self._next[2] is task:
                    self._next = None
                return w
        idx = await self._index(m)
        self._window = w = await self._fetch_window(m, idx.lookup(offset))
        while not w.covers(offset) and not w.at_end:  # the index step held more than one window
            self._window = w = await self._fetch_window(m, w.next_position)
        return w

    def _prefetch_after(self, w: _Window, i: int) -> None:
        """Start reading the window that follows `w` (in its segment or the next)."""
        if w.at_end:
            if i + 1 >= len(self.segments):
                return
            m, pos = self.segments[i + 1], HEADER_SIZE
        else:
            m, pos = self.segments[i], w.next_position
        key = m.key
        if self._next is not None and self._next[:2] == (key, pos):
            return
        if self._next is not None:
            self._next[2].cancel()
        task = asyncio.create_task(self._fetch_window(m, pos))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._next = (key, pos, task)

    async def _index(self, m: SegmentManifest) -> SegmentIndex:
        idx = self._indexes.get(m.key)
        if idx is None:
            idx = self._indexes[m.key] = parse_index(await self.store.get(index_key(m.key)))
        return idx

    async def _fetch_window(self, m: SegmentManifest, start: int) -> _Window:
        """One ranged GET of whole batches from byte `start` of the segment."""
        body_end = m.size - FOOTER_SIZE
        data = await self.store.get(m.key, start, min(start + self.readahead_bytes, body_end))
        infos = _native.scan_batches(data, partial=True)
        if not infos:  # one batch larger than the window: read exactly to its end
            need = int.from_bytes(data[8:12], "big") + _native.LOG_OVERHEAD
            data = await self.store.get(m.key, start, min(start + need, body_end))
            infos = _native.scan_batches(data, partial=True)
        if not infos:
            raise LogError(ErrorCode.CORRUPT_MESSAGE, f"{m.key}: no whole batch at byte {start}")
        end = infos[-1].position + infos[-1].size
        view = memoryview(data)[:end]
        seg = CachedSegment(view, [b.base_offset for b in infos], [b.position for b in infos], body_end=end)
        return _Window(m.key, start, seg, infos[-1].last_offset, start + end >= body_end)

    async def whole(self, m: SegmentManifest) -> CachedSegment:
        """The whole segment, from the cache or with one GET (then cached)."""
        seg = self.cache.get(m.key)
        if seg is None:
            seg = CachedSegment.from_object(await self.store.get(m.key))
            self.cache.put(m.key, seg)
        return seg

    async def offset_for_timestamp(self, ts: int) -> tuple[int, int]:
        """First offset whose record timestamp is >= ts, with that timestamp;
        (-1, -1) when none."""
        for m in self.segments:
            if m.max_ts < ts or m.last < self.log_start:
                continue
            seg = await self.whole(m)
            body = memoryview(seg.data)[HEADER_SIZE:seg.body_end]
            for b in _native.scan_batches(body):
                if b.max_timestamp < ts:
                    continue
                for off, rts, _, _, _ in _native.iter_records(b, body):
                    if rts >= ts and off >= self.log_start:
                        return off, rts
        return -1, -1

    async def offset_of_max_timestamp(self) -> tuple[int, int]:
        """Offset and timestamp of the record with the largest timestamp (the
        earliest such record on ties); (-1, -1) for an empty log."""
        live = [m for m in self.segments if m.last >= self.log_start]
        if not live:
            return -1, -1
        best = max(m.max_ts for m in live)
        return await self.offset_for_timestamp(best)
