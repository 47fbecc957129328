"""One partition's log: offsets, segment flushes, durability and reads.

Produce path: `append` assigns offsets and queues the batch bytes; the
flusher gathers queued batches for `linger_ms` (or until `segment_bytes`),
builds a .kfs segment, uploads it and its index, commits the manifest and
new high watermark to etcd in one fenced transaction, and only then resolves
the producers' futures. The high watermark (what Fetch may return) moves
only after that commit, so every acknowledged record is in S3 and etcd."""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kafscale import _native
from kafscale.config import Config
from kafscale.metadata.store import Fenced, MetaStore, PartitionState, SegmentManifest
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.storage.cache import CachedSegment, SegmentCache
from kafscale.storage.objectstore import ObjectExists, ObjectStore
from kafscale.storage.segment import (
    FOOTER_SIZE,
    HEADER_SIZE,
    SegmentIndex,
    build_segment,
    index_key,
    parse_index,
    segment_key,
)

log = logging.getLogger(__name__)


class LogError(KafkaError):
    """A partition-log error (offset out of range, fenced, closed, ...)."""


@dataclass
class _Pending:
    payload: memoryview
    base: int
    future: asyncio.Future[int] | None


@dataclass
class _ProducerState:
    epoch: int
    recent: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=5))  # first seq, last seq, base

    @property
    def last_seq(self) -> int:
        return self.recent[-1][1] if self.recent else -1


class PartitionLog:
    def __init__(self, topic: str, partition: int, cfg: Config, store: ObjectStore, meta: MetaStore,
                 cache: SegmentCache, on_commit: Callable[[], None]) -> None:
        self.topic = topic
        self.partition = partition
        self.cfg = cfg
        self.store = store
        self.meta = meta
        self.cache = cache
        self.segment_bytes = cfg.segment_bytes  # the topic's segment.bytes
        self.hw = 0
        self.log_start = 0
        self.next_offset = 0
        self.epoch = 0
        self._state_raw = b""
        self.segments: list[SegmentManifest] = []
        self._bases: list[int] = []
        self._pending: list[_Pending] = []
        self._inflight: list[_Pending] = []  # taken by the flush under way
        self._pending_bytes = 0
        self._first_pending_at = 0.0
        self._wake = asyncio.Event()
        self._commit_lock = asyncio.Lock()  # flush commits and retention both move the partition key
        self._idle = asyncio.Event()  # set while nothing is queued or being flushed
        self._idle.set()
        self._flusher: asyncio.Task[None] | None = None
        self._producers: dict[int, _ProducerState] = {}
        self._indexes: dict[str, SegmentIndex] = {}
        self.closed = False
        self._on_commit = on_commit

    # ------------------------------------------------------------------ life
    async def open(self) -> None:
        state, raw = await self.meta.claim_partition(self.topic, self.partition, self.cfg.node_id)
        self.epoch, self._state_raw = state.epoch, raw
        self.hw = self.next_offset = state.hw
        self.log_start = state.log_start
        self.segments = [m for m in await self.meta.list_segments(self.topic, self.partition) if m.last < self.hw]
        self._bases = [m.base for m in self.segments]
        self._flusher = asyncio.create_task(self._flush_loop(), name=f"flush {self.topic}/{self.partition}")
        log.info("opened %s/%d epoch=%d hw=%d segments=%d", self.topic, self.partition, self.epoch, self.hw,
                 len(self.segments))

    async def close(self, code: ErrorCode = ErrorCode.NOT_LEADER_OR_FOLLOWER, drain_s: float = 0) -> None:
        """Stop taking appends; with drain_s, first give queued batches that long
        to become durable. Whatever is left is failed (never acknowledged)."""
        self.closed = True
        if drain_s > 0 and self._flusher and not self._flusher.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_s)
        if self._flusher:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        self._fail_pending(self._inflight + self._pending, code)
        self._pending, self._inflight = [], []

    # --------------------------------------------------------------- produce
    def append(self, payload: memoryview, batches: list[_native.BatchInfo], want_ack: bool
               ) -> tuple[int, asyncio.Future[int] | None]:
        """Queue validated batches; returns (base offset, future resolved once durable)."""
        if self.closed:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, "partition log closed")
        first = batches[0]
        if first.producer_id >= 0:
            dup = self._check_sequence(first)
            if dup is not None:
                return dup, self._durable_future(dup)
        base = self.next_offset
        self.next_offset += sum(b.last_offset_delta + 1 for b in batches)
        fut = asyncio.get_running_loop().create_future() if want_ack else None
        if not self._pending:
            self._first_pending_at = time.monotonic()
        self._pending.append(_Pending(payload, base, fut))
        self._pending_bytes += len(payload)
        self._idle.clear()
        if first.producer_id >= 0:
            self._producers[first.producer_id].recent.append(
                (first.base_sequence, batches[-1].base_sequence + batches[-1].last_offset_delta, base))
        self._wake.set()
        return base, fut

    def _durable_future(self, base: int) -> asyncio.Future[int]:
        """A future for the queued batch at `base` (resolved at once if committed):
        a retried duplicate is acknowledged only when its original is durable."""
        if base < self.hw:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            fut.set_result(base)
            return fut
        for p in self._inflight + self._pending:
            if p.base == base:
                if p.future is None:  # the original was sent with acks=0
                    p.future = asyncio.get_running_loop().create_future()
                return p.future
        raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"batch at offset {base} is neither queued nor committed")

    def _check_sequence(self, first: _native.BatchInfo) -> int | None:
        """Idempotent producer bookkeeping: returns the original base offset for
        a retried duplicate, None for the next batch in sequence."""
        st = self._producers.get(first.producer_id)
        if st is None or first.producer_epoch > st.epoch:
            self._producers[first.producer_id] = _ProducerState(first.producer_epoch)
            return None
        if first.producer_epoch < st.epoch:
            raise LogError(ErrorCode.INVALID_PRODUCER_EPOCH, "producer epoch is older than the current one")
        for first_seq, _, base in st.recent:
            if first_seq == first.base_sequence:
                return base
        expected = (st.last_seq + 1) & 0x7FFFFFFF
        if st.recent and first.base_sequence != expected:
            raise LogError(ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER,
                           f"sequence {first.base_sequence}, expected {expected}")
        return None

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            if self._pending_bytes < self.segment_bytes:  # linger from the oldest queued batch
                wait = self._first_pending_at + self.cfg.linger_ms / 1000 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            take, size = [], 0
            for p in self._pending:
                if take and size + len(p.payload) > self.segment_bytes:
                    break
                take.append(p)
                size += len(p.payload)
            self._pending = self._pending[len(take):]
            self._pending_bytes -= size
            self._first_pending_at = time.monotonic()
            if not self._pending:
                self._wake.clear()
            self._inflight = take
            try:
                await self._flush(take)
                self._inflight = []
                if not self._pending:
                    self._idle.set()
            except Fenced:
                log.warning("%s/%d: fenced by a newer owner; failing %d pending appends", self.topic,
                            self.partition, len(take) + len(self._pending))
                self._fail_pending(take, ErrorCode.NOT_LEADER_OR_FOLLOWER)
                self.closed = True
                self._fail_pending(self._pending, ErrorCode.NOT_LEADER_OR_FOLLOWER)
                self._pending = []
                return

    def _fail_pending(self, items: list[_Pending], code: ErrorCode) -> None:
        for p in items:
            if p.future is not None and not p.future.done():
                p.future.set_exception(LogError(code))

    async def _flush(self, items: list[_Pending]) -> None:
        seg = build_segment([(p.payload, p.base) for p in items], int(time.time() * 1000))
        key = segment_key(self.cfg.namespace, self.topic, self.partition, seg.base_offset, self.epoch)
        manifest = SegmentManifest(seg.base_offset, seg.last_offset, seg.count, len(seg.data), seg.min_timestamp,
                                   seg.max_timestamp, key, int(time.time() * 1000))
        delay = 0.05
        while True:
            try:
                await self._upload(key, seg.data, seg.index)
                async with self._commit_lock:
                    new_state = PartitionState(self.cfg.node_id, self.epoch, seg.last_offset + 1, self.log_start)
                    self._state_raw = await self._commit(new_state, manifest)
                    self.segments.append(manifest)
                    self._bases.append(manifest.base)
                    self.hw = seg.last_offset + 1
                break
            except Fenced:
                raise
            except Exception as exc:  # S3 or etcd unavailable: keep the data and retry
                log.warning("%s/%d: flush of %s failed (%s); retrying in %.2fs", self.topic, self.partition, key,
                            exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.cache.put(key, CachedSegment.from_built(seg))
        for p in items:
            if p.future is not None and not p.future.done():
                p.future.set_result(p.base)
        self._on_commit()

    async def _upload(self, key: str, data: bytearray, index: bytes) -> None:
        """Write both objects once. The key carries our epoch, which only this
        process holds, so an existing object is our own earlier attempt at this
        very segment (same bytes) whose reply was lost."""
        for k, body in ((key, data), (index_key(key), index)):
            try:
                await self.store.put(k, body)
            except ObjectExists:
                if await self.store.size(k) != len(body):
                    raise Fenced(f"{k} exists with other content: another writer holds epoch {self.epoch}") from None

    async def _commit(self, new_state: PartitionState, manifest: SegmentManifest) -> bytes:
        try:
            return await self.meta.commit_segment(self.topic, self.partition, self._state_raw, new_state, manifest)
        except Fenced:
            cur = await self.meta.get_partition(self.topic, self.partition)
            if cur is not None and cur[1] == new_state.to_json():
                return cur[1]  # an earlier attempt whose reply was lost did commit
            raise

    # ------------------------------------------------------------- retention
    async def apply_retention(self, retention_ms: int, retention_bytes: int, now_ms: int) -> int:
        """Delete the oldest segments whose newest record is older than
        retention_ms, or while the partition holds more than retention_bytes
        (-1 disables either). The log start offset moves in etcd first, then the
        objects are deleted. Returns how many segments went."""
        async with self._commit_lock:
            total = sum(m.size for m in self.segments)
            drop: list[SegmentManifest] = []
            for m in self.segments:
                expired = retention_ms >= 0 and m.max_ts < now_ms - retention_ms
                if not (expired or (retention_bytes >= 0 and total > retention_bytes)):
                    break
                drop.append(m)
                total -= m.size
            if not drop:
                return 0
            new_start = drop[-1].last + 1
            new_state = PartitionState(self.cfg.node_id, self.epoch, self.hw, new_start)
            self._state_raw = await self.meta.set_log_start(self.topic, self.partition, self._state_raw, new_state,
                                                            [m.base for m in drop])
            self.log_start = new_start
            self.segments = self.segments[len(drop):]
            self._bases = self._bases[len(drop):]
        for m in drop:
            self.cache.drop_prefix(m.key)
            self._indexes.pop(m.key, None)
            try:
                await asyncio.gather(self.store.delete(m.key), self.store.delete(index_key(m.key)))
            except Exception as exc:  # no manifest points at it any more: only garbage is left
                log.warning("could not delete %s: %r", m.key, exc)
        log.info("%s/%d: retention removed %d segments; log start offset now %d", self.topic, self.partition,
                 len(drop), new_start)
        return len(drop)

    # ------------------------------------------------------------------ read
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
                chunk, to_end = await self._read_segment(m, offset, max_bytes - size)
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
        return out

    async def _read_segment(self, m: SegmentManifest, offset: int, max_bytes: int) -> tuple[memoryview | bytes, bool]:
        """Batches of one segment from `offset`; and whether they reach its end."""
        if m.key in self.cache or m.size <= self.cfg.cache_bytes // 8:
            return (await self._whole(m)).slice_from(offset, max_bytes)
        return await self._ranged_read(m, offset, max_bytes)

    async def _ranged_read(self, m: SegmentManifest, offset: int, max_bytes: int) -> tuple[bytes, bool]:
        """Read a big, uncached segment with the index and one ranged GET."""
        idx = self._indexes.get(m.key)
        if idx is None:
            idx = parse_index(await self.store.get(index_key(m.key)))
            self._indexes[m.key] = idx
        start = idx.lookup(offset)
        body_end = m.size - FOOTER_SIZE
        want = max(max_bytes, 1024 * 1024)
        data = await self.store.get(m.key, start, min(start + want, body_end))
        while True:
            keep = 0
            first_needed = None
            pos = 0
            while pos + _native.LOG_OVERHEAD <= len(data):
                size = int.from_bytes(data[pos + 8:pos + 12], "big") + _native.LOG_OVERHEAD
                if pos + size > len(data):
                    break
                base = int.from_bytes(data[pos:pos + 8], "big")
                last = base + int.from_bytes(data[pos + 23:pos + 27], "big")
                if last < offset:
                    pos += size
                    continue
                if first_needed is None:
                    first_needed = pos
                elif pos + size - first_needed > max_bytes:
                    break
                pos += size
                keep = pos
            if first_needed is not None:
                return data[first_needed:keep], start + keep == body_end
            # the batch holding `offset` did not fit: read exactly to its end
            size = int.from_bytes(data[pos + 8:pos + 12], "big") + _native.LOG_OVERHEAD
            data = await self.store.get(m.key, start, min(start + pos + size, body_end))

    async def _whole(self, m: SegmentManifest) -> CachedSegment:
        """The whole segment, from the cache or with one GET (then cached)."""
        seg = self.cache.get(m.key)
        if seg is None:
            seg = CachedSegment.from_object(await self.store.get(m.key))
            self.cache.put(m.key, seg)
        return seg

    async def _load(self, m: SegmentManifest) -> tuple[memoryview, list[_native.BatchInfo]]:
        seg = await self._whole(m)
        body = memoryview(seg.data)[HEADER_SIZE:seg.body_end]
        return body, _native.scan_batches(body)

    async def offset_for_timestamp(self, ts: int) -> tuple[int, int]:
        """First offset whose record timestamp is >= ts, with that timestamp;
        (-1, -1) when none."""
        for m in self.segments:
            if m.max_ts < ts or m.last < self.log_start:
                continue
            body, batches = await self._load(m)
            for b in batches:
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
