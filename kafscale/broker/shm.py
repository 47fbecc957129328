"""Shared memory between one node's processes. The supervisor maps it before
it forks, so the log process and every protocol worker see the same pages.

Produce rings: one per worker slot. A worker writes a validated payload into
its ring once and sends the log process a descriptor (absolute position and
length). The log process keeps the payload there until it has been copied
into a segment, then releases it; the ring's tail is the oldest payload not
yet released. A full ring is backpressure: the worker answers a retriable
error instead of buffering more. Positions are absolute byte counts (they
only grow); `pos % size` is the place in the ring. A payload never wraps:
when it does not fit before the end, the worker skips to the start.

Segment cache: the log process writes every committed segment into one ring
of `cache_bytes` and tells the workers where it is; workers slice Fetch
responses straight out of it. Writing at absolute [start, end) destroys what
lay at positions below end - size. A worker pins the lowest position it is
serving (one u64 per worker slot) until the response has been handed to the
socket; the log process never overwrites a pinned position (it skips caching
that segment instead). Both sides publish first and then check the other
side, with sequentially consistent atomics, so one of them always sees the
other (Dekker's handshake).

Every process faults the whole mapping in when it starts (`populate`). A
page touched for the first time costs a fault (and zeroing, for the first
process); a fork does not copy a shared mapping's page tables, so each
process pays again. Before this, the log process copied segments into the
cache at 1-2.5 GiB/s instead of 8 on the bench machine, until every page had
been touched once. Populating also makes a node that lacks the memory fail
at start, not under load."""
from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import struct
import sys
import time
from collections import deque
from collections.abc import Iterable

from kafscale import _native
from kafscale.metadata.store import SegmentManifest
from kafscale.storage.cache import CachedSegment
from kafscale.storage.segment import DEFAULT_INDEX_INTERVAL, BuiltSegment, built_segment

NONE = 2**64 - 1
_RING_HEADER = 64  # head u64 at 0 (worker), tail u64 at 8 (log process)
_HEAD, _TAIL = 0, 8  # _native.RingWriter moves the head at the same offset
_RESERVE = 0  # cache header: end of the newest (being) written segment
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap has no name for it
RATE_WINDOW_S = 10.0  # the cache's write rate (SharedCache.keeps_s) is measured over about this long


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


class SharedArea:
    """The rings and the cache of one node, in one anonymous shared mapping."""

    def __init__(self, slots: int, ring_bytes: int, cache_bytes: int) -> None:
        self.slots = slots
        self.ring_bytes = _align(ring_bytes)
        self.cache_header = _align(64 + 8 * slots)
        self.cache_bytes = cache_bytes
        ring_total = slots * (_RING_HEADER + self.ring_bytes)
        self._map = mmap.mmap(-1, ring_total + self.cache_header + max(cache_bytes, 0))
        mem = memoryview(self._map)
        stride = _RING_HEADER + self.ring_bytes
        self.rings = [Ring(mem[i * stride:(i + 1) * stride], self.ring_bytes) for i in range(slots)]
        self.cache_mem = mem[ring_total:]
        for slot in range(slots):
            _native.atomic_store(self.cache_mem, 64 + 8 * slot, NONE)

    def populate(self) -> None:
        """Map every page into this process now rather than at first use."""
        if sys.platform == "linux":
            with contextlib.suppress(OSError):  # kernels before 5.14: pages fault in on first use
                self._map.madvise(_MADV_POPULATE_WRITE)


class Ring:
    def __init__(self, mem: memoryview, size: int) -> None:
        self.header = mem[:_RING_HEADER]
        self.data = mem[_RING_HEADER:_RING_HEADER + size]
        self.size = size
        self.writer = _native.RingWriter(self.header, self.data)  # the worker's end (stage_produce)

    # ---------------------------------------------------------- worker side
    def put(self, payload: memoryview | bytes) -> int | None:
        """Reserve room for payload and copy it in (in one native call); its absolute position, or None when full."""
        return self.writer.put(payload)

    # ------------------------------------------------------ log process side
    def reader(self) -> _native.RingReader:
        """The log process's end of the ring (one only): holds payloads, moves the tail."""
        return _native.RingReader(self.header, self.data)

    def in_use(self) -> int:
        return _native.atomic_load(self.header, _HEAD) - _native.atomic_load(self.header, _TAIL)


# Where a committed segment sits in the shared cache, as one bytes object: its
# position and size, then the first offset of each batch, then the byte
# position of each batch (8-byte integers): what a worker is sent to read a
# segment from the cache (messages.PartitionChanged, PartitionSnapshot). Bytes
# are no objects of Python's cyclic collector. The log process makes one only
# when a worker needs it (SharedCache.ref), from the object's entries.
CacheRef = bytes
_REF = struct.Struct("=qq")

# The entries of an object put in the cache (SharedCache.put_object), in the
# order of their positions: of each segment its position in the object, its
# size, and where its tables (CachedSegment.tables: every batch's base offset,
# then every batch's position from the segment's start, 8-byte integers) start
# and end in the second bytes object, as 8-byte integers in the first
# (_native.pack_entries makes them of (position, size, tables) triples,
# _native.assemble_node of a node object's slices).
Entries = tuple[bytes, bytes]
_QUAD = struct.Struct("=4q")
# An object put in the cache: how far its byte 0 lies from the ring's absolute
# positions (a segment at p in it sits at shift + p), and its entries.
Placed = tuple[int, bytes, bytes]


def ref_position(ref: CacheRef) -> int:
    """Where the segment starts in the cache (an absolute position)."""
    return _REF.unpack_from(ref)[0]


def _cached(data: memoryview, size: int, ref: CacheRef) -> CachedSegment:
    pos, n = _REF.unpack_from(ref)
    off = pos % size
    return CachedSegment.from_tables(data[off:off + n], memoryview(ref)[_REF.size:])


class SharedCache:
    """Log-process side: writes committed segments, answers its own reads.
    Has the SegmentSource interface that PartitionLog reads through.

    What it holds is kept by object (a node object, a shared compacted one,
    or a segment object of its own), each object's entries in two bytes
    objects, not a dict entry a segment: at 20,000 records/s over 1,000 partitions the
    cache held about 450,000 slices, and a lookup in a dict of them (one per
    slice, made at each commit and dropped as the ring moved on) cost a cache
    miss or more each time; making and dropping their entries had 5.8% of
    py-spy's samples of the log process, compaction's lookups 3.6%
    (bench/history.md, session 97)."""

    def __init__(self, area: SharedArea) -> None:
        self.header = area.cache_mem[:area.cache_header]
        self.data = area.cache_mem[area.cache_header:]
        self.size = len(self.data)
        self.slots = area.slots
        self._head = 0
        self.objects: dict[str, Placed] = {}
        self._placed: deque[tuple[int, str, Placed]] = deque()  # (end, key, its place), oldest first
        self.skipped_pinned = 0
        self._marks: deque[tuple[float, int]] = deque()  # (time, head), one a second, over RATE_WINDOW_S

    def _oldest_valid(self) -> int:
        return _native.atomic_load(self.header, _RESERVE) - self.size

    def _pinned_below(self, end: int) -> bool:
        floor = end - self.size
        return any(_native.atomic_load(self.header, 64 + 8 * s) < floor for s in range(self.slots))

    def put(self, m: SegmentManifest, seg: CachedSegment) -> None:
        """Put one segment (read back from S3, or just built): a segment of a
        larger object (a node object's slice, a shared object's segment) goes
        under its ref, so that its object's other entries stay."""
        self.put_object(m.key if m.pos < 0 else m.ref, memoryview(seg.data),
                        _native.pack_entries([(m.start, len(seg.data), seg.tables())]), m.start)

    def put_object(self, key: str, body: memoryview, entries: Entries, at: int = 0) -> None:
        """Write segments of object `key` that lie back to back in body
        (whose byte 0 is the object's byte `at`): a node object's slices or
        a shared object's segments, each entry their position in the object,
        size and tables, in the order of their positions, none empty. One reservation
        and one copy (one check of the workers' pins and one eviction pass
        for all of them, not one each: per slice that was 7 µs, about 7% of
        the log process at 20,000 records/s over 100 partitions). If the
        space they need holds a segment a worker has pinned, none is written
        (compaction then reads them from S3). The object's entries replace
        any it had before."""
        packed, tables = entries
        n = len(packed) // _QUAD.size
        if not n:
            return
        lo = _QUAD.unpack_from(packed)[0]
        last, size, _, _ = _QUAD.unpack_from(packed, len(packed) - _QUAD.size)
        hi = last + size
        total = hi - lo
        if total > self.size:  # more than the cache holds: those that fit alone, one by one (the later ones
            for i in range(0, len(packed), _QUAD.size):  # replace the earlier ones, which they overwrite anyway
                if _QUAD.unpack_from(packed, i)[1] <= self.size:
                    self.put_object(key, body, (packed[i:i + _QUAD.size], tables), at)
            return
        start = self._head
        off = start % self.size
        if off + total > self.size:
            start += self.size - off
        end = start + total
        if self._pinned_below(end):  # a worker is still sending what this would overwrite
            self.skipped_pinned += n
            return
        _native.atomic_store(self.header, _RESERVE, end)
        if self._pinned_below(end):  # a worker pinned it meanwhile: leave its bytes alone
            self.skipped_pinned += n
            return
        self._head = end
        off = start % self.size
        self.data[off:off + total] = body[lo - at:hi - at]
        placed = (start - lo, packed, tables)
        self.objects[key] = placed
        self._placed.append((end, key, placed))
        floor = self._oldest_valid()
        while self._placed[0][0] <= floor:  # wholly overwritten (this one never is: end > floor)
            _, gone, was = self._placed.popleft()
            if self.objects.get(gone) is was:
                del self.objects[gone]
        now = time.monotonic()
        if not self._marks or now - self._marks[-1][0] >= 1:
            self._marks.append((now, end))
            while now - self._marks[0][0] > RATE_WINDOW_S:
                self._marks.popleft()

    def keeps_s(self) -> float:
        """About how long a segment put now stays before later ones overwrite
        it: at the rate the cache was written over the last RATE_WINDOW_S, or
        over the last second or two when that was faster (a load that just
        began: the window's rate still counts the quiet time before it, and
        compaction, which this paces, waited too long for the first slices).
        math.inf while nothing is written."""
        if not self._marks:
            return math.inf
        now = time.monotonic()
        rate = max((self._head - head) / max(now - since, 1e-3)
                   for since, head in (self._marks[0], self._marks[max(len(self._marks) - 2, 0)]))
        return self.size / rate if rate > 0 else math.inf

    def ref(self, m: SegmentManifest) -> CacheRef | None:
        """Where m's segment is cached, if it has not been overwritten since."""
        return _native.cache_ref(self.objects, m, self._oldest_valid())

    def holds(self, m: SegmentManifest) -> bool:
        return _native.cache_holds(self.objects, m, self._oldest_valid())

    def get(self, m: SegmentManifest) -> CachedSegment | None:
        ref = self.ref(m)
        return None if ref is None else _cached(self.data, self.size, ref)

    def read(self, m: SegmentManifest, offset: int, max_bytes: int) -> tuple[memoryview, bool] | None:
        ref = self.ref(m)
        return None if ref is None else _native.cached_slice(self.data, self.size, ref, offset, max_bytes)

    def batches(self, manifests: Iterable[SegmentManifest]) -> list[memoryview | None]:
        """The batches of each cached segment (its header and footer left out;
        None: not cached), as compaction copies them: valid until the next
        put. How far the ring has moved is read once for all of them: a
        compaction takes a partition's slices, about a thousand at 20,000
        records/s over 100 partitions; a lookup each through ref() took 0.91
        µs a slice, one call for them all 0.46 (bench/history.md, session 80)."""
        return _native.cached_batches(self.objects, manifests, self._oldest_valid(), self.data, self.size)

    def build(self, manifests: list[SegmentManifest], created_ms: int) -> BuiltSegment | None:
        """The segment of the batches of these cached segments (each from its
        manifest's base offset on), copied straight out of the ring; None if
        one of them is not cached."""
        assembled = _native.assemble_cached(self.objects, manifests, self._oldest_valid(), self.data, self.size,
                                            created_ms, DEFAULT_INDEX_INTERVAL)
        return None if assembled is None else built_segment(assembled)

    def drop(self, m: SegmentManifest) -> None:
        """Forget m's segment (its manifest is gone: nobody asks for it again):
        one of its own or put alone (put); a segment among others stays
        until its object is overwritten."""
        self.objects.pop(m.key if m.pos < 0 else m.ref, None)

    def drop_prefix(self, prefix: str) -> None:
        """Forget the objects whose keys start with prefix (a deleted topic's
        segments: one of a new topic of its name may get the same key)."""
        for key in [k for k in self.objects if k.startswith(prefix)]:
            del self.objects[key]


class CacheReader:
    """Worker side: pins and slices segments the log process has cached."""

    def __init__(self, area: SharedArea, slot: int) -> None:
        self.header = area.cache_mem[:area.cache_header]
        self.data = area.cache_mem[area.cache_header:]
        self.size = len(self.data)
        self._pin_at = 64 + 8 * slot
        self._held: list[int] = []  # sorted positions in use by responses not yet sent
        self.hits = self.misses = 0
        _native.atomic_store(self.header, self._pin_at, NONE)

    def acquire(self, ref: CacheRef) -> CachedSegment | None:
        """The segment at `ref`, pinned until release(its position); None if overwritten."""
        return _cached(self.data, self.size, ref) if self._pin(ref) else None

    def read(self, ref: CacheRef, offset: int, max_bytes: int) -> tuple[memoryview, bool] | None:
        """acquire(ref).slice_from(offset, max_bytes), without making the
        segment (_native.cached_slice); pinned the same way."""
        return _native.cached_slice(self.data, self.size, ref, offset, max_bytes) if self._pin(ref) else None

    def _pin(self, ref: CacheRef) -> bool:
        """Pin the segment at `ref` until release(its position); False if it was overwritten."""
        if self.size == 0:
            return False
        pos = ref_position(ref)
        low = min(pos, self._held[0]) if self._held else pos
        _native.atomic_store(self.header, self._pin_at, low)
        if pos < _native.atomic_load(self.header, _RESERVE) - self.size:
            self._publish()
            self.misses += 1
            return False
        bisect.insort(self._held, pos)
        self.hits += 1
        return True

    def release(self, pos: int) -> None:
        del self._held[bisect.bisect_left(self._held, pos)]
        self._publish()

    def _publish(self) -> None:
        _native.atomic_store(self.header, self._pin_at, self._held[0] if self._held else NONE)
