"""Reading one partition's committed batches: from the segment cache when the
segment is there, otherwise from S3 in windows of whole batches (ranged GETs
that start and end on the segment's index entries), with the next windows
read ahead within a per-process memory budget (ReadBudget).

The log process's PartitionLog and a protocol worker's PartitionView both
read through this class; they differ only in how `segments`, `hw` and
`log_start` are kept up to date."""
from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import time
from dataclasses import dataclass
from typing import Protocol

from kafscale import _native, metrics
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.storage.cache import CachedSegment
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.segment import (
    FOOTER_SIZE,
    HEADER_SIZE,
    SegmentIndex,
    first_at_or_after,
    has_index,
    index_key,
    parse_index,
)


class LogError(KafkaError):
    """A partition-log error (offset out of range, fenced, closed, ...)."""


class SegmentSource(Protocol):
    """Where whole recent segments are kept (in-process or shared memory)."""

    def get(self, m: SegmentManifest) -> CachedSegment | None: ...

    def read(self, m: SegmentManifest, offset: int, max_bytes: int) -> tuple[memoryview, bool] | None:
        """get(m).slice_from(offset, max_bytes), or None if it is not cached."""

    def holds(self, m: SegmentManifest) -> bool: ...

    def put(self, m: SegmentManifest, seg: CachedSegment) -> None: ...


MIN_WINDOW = 1024 * 1024  # smallest ranged GET planned when read-ahead memory runs short
AHEAD = 2  # windows read ahead of the one being served
CURSORS = 4  # places in one partition read from at once (consumers at different offsets), each with its windows
CURSOR_IDLE_S = 30.0  # a place not read from for this long is given up (its consumer went away or moved)
IDLE_S = 2.0  # a reader that has not read for this long gives its windows up to busier ones


class ReadBudget:
    """The memory one process may hold in read-ahead windows, across all the
    partitions it reads from S3. A window that a Fetch is waiting for is always
    read (smaller when memory is short); windows ahead of it only while they
    fit, taking the windows of readers that went idle if need be."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._holders: set[LogReader] = set()  # readers holding windows

    def available(self) -> int:
        return self.limit - self.used

    def reserve(self, reader: LogReader, n: int, force: bool) -> bool:
        if self.used + n > self.limit:
            now = time.monotonic()
            for other in sorted(self._holders, key=lambda r: r.last_read):
                if self.used + n <= self.limit or now - other.last_read < IDLE_S:
                    break
                if other is not reader:
                    other.stop_reading()
        if self.used + n > self.limit and not force:
            return False
        self.used += n
        self._holders.add(reader)
        return True

    def release(self, reader: LogReader, n: int) -> None:
        self.used -= n
        if not any(reader.cursors):
            self._holders.discard(reader)


@dataclass(eq=False)
class _Window:
    """Whole batches at bytes [start, end) of one segment, offsets [first, stop),
    read with one ranged GET. Windows start and end where the segment's index
    has an entry, so that windows ahead can be planned before the data arrives."""
    ref: str  # the segment's SegmentManifest.ref
    start: int
    end: int
    first: int
    stop: int
    at_end: bool  # the window reaches the end of the segment body
    data: asyncio.Task[CachedSegment]

    def covers(self, ref: str, offset: int) -> bool:
        return self.ref == ref and self.first <= offset < self.stop


class _Cursor(collections.deque[_Window]):
    """Consecutive windows at one place in a partition being read (by one
    consumer, as far as the broker can tell). Compared by identity."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__
    last_read = 0.0


@functools.cache
def _segment_reads(source: str) -> metrics.Tally:
    """This process's count of Fetch reads of segments from the cache or from
    S3, a Tally: a consumer of 1,000 partitions has a read counted for each
    partition of each Fetch, and an increment of the multiprocess value
    itself (a label lookup, a lock, a pid check, a write) was 9% of a
    worker's samples serving one at 20,000 records/s (bench/history.md,
    session 96)."""
    return metrics.Tally(metrics.SEGMENT_READS.labels(metrics.node(), source))


class LogReader:
    __slots__ = (  # noqa: RUF023 (as PartitionLog's: in the order of use, not sorted)
        "hw", "log_start", "segments", "_bases", "cache", "store", "readahead_bytes", "budget", "_indexes", "cursors",
        "_loading", "last_read", "__weakref__")

    def __init__(self, store: ObjectStore, cache: SegmentSource, readahead_bytes: int, budget: ReadBudget) -> None:
        self.store = store
        self.cache = cache
        self.readahead_bytes = readahead_bytes
        self.budget = budget
        self.hw = 0
        self.log_start = 0
        self.segments: list[SegmentManifest] = []
        self._bases: list[int] = []
        self._indexes: dict[str, SegmentIndex] = {}
        # one deque of consecutive windows per place being read, least recently read first
        self.cursors: list[_Cursor] = []
        self._loading: dict[str, asyncio.Task[SegmentIndex]] = {}  # indexes being read ahead
        self.last_read = 0.0

    def set_segments(self, segments: list[SegmentManifest]) -> None:
        self.segments = segments
        self._bases = [m.base for m in segments]

    def add_segment(self, m: SegmentManifest) -> list[SegmentManifest]:
        """Add a committed segment after the others; a compacted one replaces the
        node object slices it was built from (returned)."""
        if not self._bases or self._bases[-1] < m.base:  # the usual: after the others, replacing none
            self.segments.append(m)
            self._bases.append(m.base)
            return []
        i = bisect.bisect_left(self._bases, m.base)
        j = bisect.bisect_right(self._bases, m.last)
        replaced = self.segments[i:j]
        self.segments[i:j] = [m]
        self._bases[i:j] = [m.base]
        if self._indexes:  # (a compaction replaces hundreds of slices, which have none)
            for r in replaced:
                self._indexes.pop(r.ref, None)
        return replaced

    def drop_segments(self, n: int) -> None:
        for m in self.segments[:n]:
            self._indexes.pop(m.ref, None)
        self.segments = self.segments[n:]
        self._bases = self._bases[n:]

    def stop_reading(self) -> None:
        while self.cursors:
            self._drop_cursor(self.cursors[0])

    def _drop_cursor(self, cursor: _Cursor) -> None:
        self.cursors.remove(cursor)
        while cursor:
            self._drop(cursor.popleft())

    def _drop(self, w: _Window) -> None:
        w.data.cancel()
        self.budget.release(self, w.end - w.start)

    async def read(self, offset: int, max_bytes: int, strict: bool = False) -> list[memoryview | bytes]:
        """Committed batches from the one holding `offset`, across segments,
        whole batches only, up to max_bytes (but, unless strict, always at
        least one batch so that a record larger than max_bytes still makes
        progress; Kafka grants that to the first partition of a Fetch response
        only). Empty at the watermark; raises LogError(OFFSET_OUT_OF_RANGE)
        outside the log. After the first chunk, only data already at hand is
        added."""
        if offset < self.log_start or offset > self.hw:
            raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} outside [{self.log_start}, {self.hw}]")
        # time.monotonic (the loop's clock): asyncio.get_running_loop() asks the kernel for the pid each
        # call, a read of each partition of a consumer's Fetch (bench/history.md, session 96)
        self.last_read = now = time.monotonic()
        for stale in [c for c in self.cursors if now - c.last_read >= CURSOR_IDLE_S]:
            self._drop_cursor(stale)
        out: list[memoryview | bytes] = []
        size = 0
        cursor = None
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0 and offset < self.hw:
            raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} precedes every segment")
        while offset < self.hw and i < len(self.segments) and size < max_bytes:
            m = self.segments[i]
            if offset > m.last:
                i += 1
                continue
            try:
                got = await self._read_segment(i, offset, max_bytes - size, wait=not out)
            except Exception as exc:
                if offset < self.log_start:  # removed by retention while we read it
                    raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {offset} was deleted") from None
                if isinstance(exc, LogError):
                    raise
                # S3 failed: a retriable error for this partition, not a closed connection
                raise LogError(ErrorCode.KAFKA_STORAGE_ERROR, f"reading {m.key}: {exc!r}") from exc
            if got is None:
                break
            chunk, after, cursor = got
            if (out or strict) and size + len(chunk) > max_bytes:
                break
            out.append(chunk)
            size += len(chunk)
            if after is None:
                break
            offset = after
        if offset >= self.hw and cursor in self.cursors:  # caught up: recent segments come from the cache
            self._drop_cursor(cursor)
        return out

    async def _read_segment(self, i: int, offset: int, max_bytes: int, wait: bool
                            ) -> tuple[memoryview | bytes, int | None, _Cursor | None] | None:
        """Batches of segment i from `offset`; the offset after them when they
        reach the end of what was read at once (the segment, or a window); and
        the cursor they came from (None: the cache). None when not `wait` and
        the data is not at hand yet."""
        m = self.segments[i]
        cached = self.cache.read(m, offset, max_bytes)
        if cached is not None:
            _segment_reads("cache").inc()
            chunk, to_end = cached
            return chunk, m.last + 1 if to_end else None, None
        if not wait and not any(w.covers(m.ref, offset) and w.data.done() for c in self.cursors for w in c):
            return None
        _segment_reads("s3").inc()
        while True:
            cursor, w = await self._window_for(m, offset)
            await asyncio.wait([w.data])  # another read may drop the window: do not inherit its cancellation
            if not w.data.cancelled():
                break
        exc = w.data.exception()
        if exc is not None:
            self.stop_reading()
            raise exc
        chunk, to_end = w.data.result().slice_from(offset, max_bytes)
        if cursor in self.cursors:
            self._read_ahead(cursor)
        return chunk, w.stop if to_end else None, cursor

    def _cursor_at(self, m: SegmentManifest, offset: int) -> tuple[_Cursor, _Window] | None:
        """The cursor whose windows span `offset`, with the windows before the one
        holding it dropped (a cursor read to its end is dropped); the cursor
        becomes the most recently read."""
        for cursor in self.cursors:
            if cursor[0].first <= offset <= cursor[-1].stop:
                while cursor and not cursor[0].covers(m.ref, offset):
                    self._drop(cursor.popleft())
                self.cursors.remove(cursor)
                if not cursor:
                    return None
                self.cursors.append(cursor)
                cursor.last_read = self.last_read
                return cursor, cursor[0]
        return None

    async def _window_for(self, m: SegmentManifest, offset: int) -> tuple[_Cursor, _Window]:
        """The window holding `offset` and its cursor; a new cursor with a
        window planned and started if no cursor reaches `offset`."""
        found = self._cursor_at(m, offset)
        if found is None:
            idx = await self._index_for(m, offset)
            found = self._cursor_at(m, offset)  # another read may have planned it meanwhile
            if found is None:
                return self._demand(m, offset, idx)
        return found

    def _demand(self, m: SegmentManifest, offset: int, idx: SegmentIndex | None
                ) -> tuple[_Cursor, _Window]:
        """A new cursor whose first window a Fetch waits for: read now, smaller
        if memory is short. The least recently read cursor makes room."""
        if len(self.cursors) >= CURSORS:
            self._drop_cursor(self.cursors[0])
        plan = self._plan(m, idx, offset, min(self.readahead_bytes, max(self.budget.available(), MIN_WINDOW)))
        self.budget.reserve(self, plan[1] - plan[0], force=True)
        w = self._open(m, plan)
        cursor = _Cursor([w])
        cursor.last_read = self.last_read
        self.cursors.append(cursor)
        return cursor, w

    def _whole(self, m: SegmentManifest, offset: int) -> bool:
        """Whether one window from the segment's start holds its body (no index needed).
        A slice of a node object, and a segment of at most DEFAULT_INDEX_INTERVAL
        bytes of batches, have no index: they are read whole (node objects are
        at most readahead_bytes)."""
        return not has_index(m.size, m.pos) or (offset == m.base
                                                and m.size - FOOTER_SIZE - HEADER_SIZE <= self.readahead_bytes)

    async def _index_for(self, m: SegmentManifest, offset: int) -> SegmentIndex | None:
        return None if self._whole(m, offset) else await self._index(m)

    @staticmethod
    def _plan(m: SegmentManifest, idx: SegmentIndex | None, offset: int, limit: int) -> tuple[int, int, int, int]:
        """(start, end, first, stop) of the window from the indexed batch at or
        before `offset`, as long as `limit` allows at index boundaries (at least
        one index step); the whole body when there is no index."""
        body_end = m.size - FOOTER_SIZE
        if idx is None:
            return HEADER_SIZE, body_end, m.base, m.last + 1
        j = max(bisect.bisect_right(idx.offsets, offset) - 1, 0)
        start = idx.positions[j]
        k = max(bisect.bisect_right(idx.positions, start + limit) - 1, j + 1)
        if body_end - start <= limit or k >= len(idx.positions):
            return start, body_end, idx.offsets[j], m.last + 1
        return start, idx.positions[k], idx.offsets[j], idx.offsets[k]

    def _open(self, m: SegmentManifest, plan: tuple[int, int, int, int]) -> _Window:
        start, end, first, stop = plan
        task = asyncio.create_task(self._fetch(m, start, end))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return _Window(m.ref, start, end, first, stop, end == m.size - FOOTER_SIZE, task)

    def _read_ahead(self, cursor: _Cursor) -> None:
        """Start the windows after a cursor's last one, up to AHEAD beyond its
        first, while the budget lets them in. A segment whose index is needed
        and not loaded yet gets it loaded first (this continues from there)."""
        while 0 < len(cursor) <= AHEAD and cursor in self.cursors:
            last = cursor[-1]
            i = bisect.bisect_right(self._bases, last.first) - 1 + last.at_end
            if not 0 <= i < len(self.segments):
                return
            m = self.segments[i]
            if self.cache.holds(m):  # recent segments: read from the cache when their turn comes
                return
            offset = m.base if last.at_end else last.stop
            idx = None
            if not self._whole(m, offset):
                idx = self._indexes.get(m.ref)
                if idx is None:
                    self._load_index(m, cursor)
                    return
            plan = self._plan(m, idx, offset, self.readahead_bytes)
            if not self.budget.reserve(self, plan[1] - plan[0], force=False):
                return
            cursor.append(self._open(m, plan))

    def _load_index(self, m: SegmentManifest, cursor: _Cursor) -> None:
        if m.ref in self._loading:
            return
        task = self._loading[m.ref] = asyncio.create_task(self._index(m))

        def loaded(t: asyncio.Task[SegmentIndex]) -> None:
            self._loading.pop(m.ref, None)
            if not t.cancelled() and t.exception() is None:
                self._read_ahead(cursor)

        task.add_done_callback(loaded)

    async def _index(self, m: SegmentManifest) -> SegmentIndex:
        idx = self._indexes.get(m.ref)
        if idx is None:
            idx = self._indexes[m.ref] = parse_index(await self.store.get(index_key(m.key)))
        return idx

    async def _fetch(self, m: SegmentManifest, start: int, end: int) -> CachedSegment:
        """One ranged GET of the whole batches at bytes [start, end) of a segment."""
        data = await self.store.get(m.key, m.start + start, m.start + end)
        infos = _native.scan_batches(data, partial=True)
        if not infos or infos[-1].position + infos[-1].size != len(data):
            raise LogError(ErrorCode.CORRUPT_MESSAGE, f"{m.key}: bytes {start}-{end} are not whole batches")
        return CachedSegment(data, [b.base_offset for b in infos], [b.position for b in infos], body_end=len(data))

    async def whole(self, m: SegmentManifest, keep: bool = True) -> CachedSegment:
        """The whole segment, from the cache or with one GET (then cached, if
        `keep`: a compaction reads what it is about to replace)."""
        seg = self.cache.get(m)
        if seg is None:
            whole = await (self.store.get(m.key) if m.pos < 0 else self.store.get(m.key, m.pos, m.pos + m.size))
            seg = CachedSegment.from_object(whole)
            if keep:
                self.cache.put(m, seg)
        return seg

    async def offset_for_timestamp(self, ts: int) -> tuple[int, int]:
        """First offset whose record timestamp is >= ts, with that timestamp;
        (-1, -1) when none."""
        for m in self.segments:
            if m.max_ts < ts or m.last < self.log_start:
                continue
            seg = await self.whole(m)
            found = first_at_or_after(seg.batches(), ts, self.log_start)
            if found is not None:
                return found
        return -1, -1

    async def offset_of_max_timestamp(self) -> tuple[int, int]:
        """Offset and timestamp of the record with the largest timestamp (the
        earliest such record on ties); (-1, -1) for an empty log."""
        live = [m for m in self.segments if m.last >= self.log_start]
        if not live:
            return -1, -1
        best = max(m.max_ts for m in live)
        return await self.offset_for_timestamp(best)
