"""One partition's log: offsets, segment flushes, durability and reads.

Produce path: `append` assigns offsets and queues the batch bytes; the
flusher gathers queued batches for `linger_ms` (or until `segment_bytes`),
builds a .kfs segment, uploads it and its index, commits the manifest and
new high watermark to etcd in one fenced transaction, and only then resolves
the producers' acknowledgements. The high watermark (what Fetch may return) moves
only after that commit, so every acknowledged record is in S3 and etcd.

With node flushes (`node_flush`) the node's NodeFlusher (storage/wal.py)
takes the queued batches of every partition instead (`take`), writes them as
slices of one object and reports the commit (`committed`); `compact` later
rewrites the committed slices into a .kfs segment and moves the partition's
checkpoint (the hw kept in etcd) to its end."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kafscale import _native, faults, metrics
from kafscale._native import Pending
from kafscale.config import Config
from kafscale.metadata.store import Fenced, MetaStore, PartitionState, SegmentManifest
from kafscale.protocol.errors import ErrorCode
from kafscale.storage.cache import CachedSegment
from kafscale.storage.objectstore import ObjectExists, ObjectStore
from kafscale.storage.reader import LogError, LogReader, ReadBudget, SegmentSource
from kafscale.storage.segment import (
    BuiltSegment,
    build_segment,
    has_index,
    index_key,
    key_epoch,
    segment_key,
)
from kafscale.storage.wal import Linger, continuing, retry

if TYPE_CHECKING:
    from kafscale.storage.wal import NodeFlusher, WalIndex

log = logging.getLogger(__name__)

# what a compaction takes: the compacted segments it merges, the slices, and the segment built of both
Compaction = tuple[list[SegmentManifest], list[SegmentManifest], BuiltSegment]

__all__ = ["LogError", "PartitionLog"]

MAX_UPLOADS = 4  # segments of one partition uploading at once
MAX_UNCOMMITTED = 8  # segments of one partition built and not yet committed (bounds its memory)
# slices no longer cached that a compaction reads at once: one at a time, a compaction that fell behind read
# hundreds one GET after another and fell further behind (4 compactions at once: half the store's threads)
COMPACTION_READS_AT_ONCE = 2
MERGE_FAN_IN = 4  # a merge of small segments joins this many of a size: the new one and the k - 1 before it
# committed slices of fewer bytes than this wait for the small lag (compaction_due): a compaction costs a
# partition key update, a segment key and its share of a PUT whatever it holds
SMALL_SLICES_BYTES = 64 << 10


# how many of a producer's last batches are remembered for the duplicate check (Kafka: 5)
PRODUCER_BATCHES = 5
# a producer that wrote nothing for this long is forgotten (Kafka's producer.id.expiration.ms)
PRODUCER_EXPIRY_MS = 24 * 3600 * 1000


class Acknowledger(Protocol):
    """Who waits for appended batches: told of each one (by the token it was
    appended with) once it is durable (exc None) or can never be (exc)."""

    def answer(self, token: Any, exc: LogError | None) -> None: ...


# an append's acknowledger and its token for it (a produce's partition response)
Ack = tuple[Acknowledger, Any]
# a partition's new state written and its owner key deleted in one transaction, if both still hold what this
# owner wrote (the new raw state, else None): (topic, partition, the state it compares, the new state)
HandOver = Callable[[str, int, bytes, PartitionState], Awaitable[bytes | None]]


@dataclass
class _ProducerState:
    epoch: int
    last_ms: int  # when it last wrote here (wall clock ms): state idle past PRODUCER_EXPIRY_MS is dropped
    recent: deque[tuple[int, int, int]] = field(  # first seq, last seq, base offset
        default_factory=lambda: deque(maxlen=PRODUCER_BATCHES))

    @property
    def last_seq(self) -> int:
        return self.recent[-1][1] if self.recent else -1


class PartitionLog(LogReader):
    # Attributes in slots, the ones each partition batch touches first: at 1,000 partitions a log is
    # seldom in the CPU's caches when its next batch comes, and an instance dict's values are one more
    # place to fetch (bench.logproc at 1,000 partitions: 0.89 of the CPU a request; bench/history.md,
    # session 95). Tests patch methods on the class.
    __slots__ = (  # noqa: RUF023 (in the order of use, not sorted)
        "next_offset", "_pending", "_pending_bytes", "node", "closed", "_slice_count", "_slice_bytes", "checkpoint",
        "_inflight", "_on_change", "_drained", "_producers", "fence", "topic", "partition", "epoch", "cfg", "meta",
        "segment_bytes", "_state_raw", "_commit_lock", "_compacting", "_flusher", "_flushes", "_producers_pruned_ms",
        "_claimed_at", "_linger", "_wake", "_upload_slots", "_uncommitted")

    def __init__(self, topic: str, partition: int, cfg: Config, store: ObjectStore, meta: MetaStore,
                 cache: SegmentSource, budget: ReadBudget,
                 on_change: Callable[[PartitionLog, SegmentManifest | None], None],
                 node: tuple[NodeFlusher, WalIndex, bytes] | None = None) -> None:
        """node: with node flushes, the node's flusher, its WalIndex and the topic's id."""
        super().__init__(store, cache, cfg.readahead_bytes, budget)
        self.topic = topic
        self.partition = partition
        self.node = node
        self.checkpoint = 0  # the hw in etcd: with node flushes, the end of the compacted segments
        self.fence = ""  # node flushes: the fence of the flusher it was opened under (its claim names it)
        self._compacting = asyncio.Lock()
        self.cfg = cfg
        self.meta = meta
        self.segment_bytes = cfg.segment_bytes  # the topic's segment.bytes
        self._slice_count = self._slice_bytes = 0  # the committed slices at the tail of the segments
        self.next_offset = 0
        self.epoch = 0
        self._state_raw = b""
        self._pending: list[Pending] = []
        self._inflight: list[Pending] = []  # taken by the flushes under way, in offset order
        self._pending_bytes = 0
        if node is None:  # the partition's own flush loop (node_flush off): not made for each of 10,000 partitions
            self._linger = Linger()
            self._wake = asyncio.Event()
            self._upload_slots = asyncio.Semaphore(MAX_UPLOADS)
            self._uncommitted = asyncio.Semaphore(MAX_UNCOMMITTED)
        self._commit_lock = asyncio.Lock()  # flush commits and retention both move the partition key
        # what a draining close waits on until nothing is queued or being flushed (_drain_done); made
        # then only, not an Event cleared at every append and set at every commit (two calls a
        # partition batch; bench/history.md, session 94)
        self._drained: asyncio.Future[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()  # segments being uploaded or committed
        self._producers: dict[int, _ProducerState] = {}
        self._producers_pruned_ms = 0
        self.closed = False
        self._claimed_at = 0.0  # time.monotonic() of the claim: the slices read after must be from a later scan
        self._on_change = on_change  # a segment committed (with it), the log start moved or the log closed

    # ------------------------------------------------------------------ life
    async def open(self) -> None:
        await self.claim()
        await self.load()

    async def claim(self) -> None:
        """Take the partition with a new epoch (the first half of open)."""
        fence = self.node[0].fence if self.node else ""
        self.claimed(*await self.meta.claim_partition(self.topic, self.partition, self.cfg.node_id, fence))

    def claimed(self, state: PartitionState, raw: bytes) -> None:
        """The partition was claimed with this state (a new epoch): start from it."""
        self.fence = state.fence  # node flushes: only under this fence
        self._claimed_at = time.monotonic()
        self.epoch, self._state_raw = state.epoch, raw
        self.hw = self.next_offset = self.checkpoint = state.hw
        self.log_start = state.log_start

    async def load(self) -> None:
        """Read the claimed partition's segments and slices and start serving (the
        second half of open). The first claim of a partition (epoch 1: its key did
        not exist) reads nothing: nobody wrote to it before."""
        first = self.epoch == 1
        segments = [] if first else [m for m in await self.meta.list_segments(self.topic, self.partition)
                                     if m.last < self.hw]
        if self.node is not None and not first:  # and the slices committed since the checkpoint, in node objects
            _, wal, topic_id = self.node
            tail = continuing(await wal.slices(topic_id, self.partition, self._claimed_at), self.hw,
                              f"{self.topic}/{self.partition}")
            segments += tail
            self.hw = self.next_offset = tail[-1].last + 1 if tail else self.hw
        self.set_segments(segments)
        self._producers = producer_states(self.segments)
        if self.node is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name=f"flush {self.topic}/{self.partition}")
        log.info("opened %s/%d epoch=%d hw=%d segments=%d", self.topic, self.partition, self.epoch, self.hw,
                 len(self.segments))

    async def close(self, code: ErrorCode = ErrorCode.NOT_LEADER_OR_FOLLOWER, drain_s: float = 0) -> None:
        """Stop taking appends; with drain_s, first give queued batches that long
        to become durable. Whatever is left is failed (never acknowledged)."""
        self.closed = True
        flushing = self.node is not None or (self._flusher is not None and not self._flusher.done())
        if drain_s > 0 and flushing and not self._is_idle():  # an idle log makes no task (10,000 at a stop)
            self._drained = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained, drain_s)
        tasks = [t for t in (self._flusher, *self._flushes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_queued(code)
        self.stop_reading()
        self._on_change(self, None)

    def orphans(self, keys: list[str]) -> list[str]:
        """Of the objects listed under this partition, those an earlier owner
        uploaded and never committed: of an older epoch, and no manifest names
        them (OrphanSweeper)."""
        named = {k for m in self.segments for k in (m.key, index_key(m.key))}
        return [k for k in keys if k not in named and (key_epoch(k) or self.epoch) < self.epoch]

    # --------------------------------------------------------------- produce
    def append(self, payload: memoryview, batches: list[_native.BatchInfo], ack: Ack | None,
               release: Callable[[], None] | None = None) -> int:
        """Queue validated batches; returns their base offset. `ack` (None:
        nobody waits, acks=0) is answered once they are durable, or failed.
        `release` is called once the payload bytes are no longer needed (copied
        into a segment, or dropped); not called on LogError."""
        if self.closed:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, "partition log closed")
        first = batches[0]
        idempotent = first.producer_id >= 0
        if idempotent:
            dup = self._check_sequence(first)
            if dup is not None:
                if ack is not None:
                    self._ack_original(dup, ack)
                if release is not None:
                    release()
                return dup
        base = end = self.next_offset
        for b in batches:  # not sum(generator): with ProduceApi._append, 2.5% of a request's instructions
            end += b.last_offset_delta + 1
        self.next_offset = end
        if not self._pending and self.node is None:  # else its own flush loop's linger is not idle already
            self._linger.queued()
        producer = None
        if idempotent:
            last_seq = batches[-1].base_sequence + batches[-1].last_offset_delta
            producer = (first.producer_id, first.producer_epoch, first.base_sequence, last_seq)
            self._producers[first.producer_id].recent.append((first.base_sequence, last_seq, base))
        self._pending.append(Pending(payload, base, None if ack is None else [ack], release, producer))
        self._pending_bytes += len(payload)
        if self.node is not None:
            self.node[0].notify(self, len(payload))
        else:
            self._wake.set()
        return base

    # ---------------------------------------------------------- node flushes
    def has_queued(self) -> bool:
        return bool(self._pending)

    def take(self, limit: int) -> tuple[list[Pending], int]:
        """Queued batches to flush (at least one, then up to limit bytes):
        them and their bytes. The node flusher takes them, or the log's own
        flush loop without node flushes."""
        pending, size = self._pending, self._pending_bytes
        if size <= limit or len(pending) < 2:  # the usual: all of them
            take, self._pending = pending, []
        else:
            size, n = len(pending[0].payload), 1
            while n < len(pending) and size + len(pending[n].payload) <= limit:
                size += len(pending[n].payload)
                n += 1
            take, self._pending = pending[:n], pending[n:]
        self._pending_bytes -= size
        self._inflight += take
        return take, size

    @staticmethod
    def producers_of(items: list[Pending]) -> dict[str, list[Any]]:
        return producers_of(items)

    def committed(self, manifest: SegmentManifest, items: list[Pending]) -> None:
        """The node object holding these batches (a slice of it: manifest) is
        committed (and its slices are in the cache: NodeFlusher puts them all at once)."""
        self.add_segment(manifest)
        if self._slice_count == 1:  # its first (the compaction loop lets go of logs only once they have none)
            self._sliced()
        self.hw = manifest.last + 1
        self._resolve(items)
        self._on_change(self, manifest)
        if self._drained is not None:
            self._drain_done()

    def flush_failed(self) -> None:
        """A node object with our batches failed (fenced): nothing queued here can become durable."""
        if not self.closed:
            self.closed = True
            self._fail_queued(ErrorCode.NOT_LEADER_OR_FOLLOWER)
            self._on_change(self, None)
        self._drain_done(failed=True)

    # The committed node object slices are always the tail of the segments (a
    # compaction replaces the oldest of them); how many there are and their
    # bytes are kept up to date, so the compaction loop's check of every open
    # partition each second costs the same however many slices they hold
    # (walking them took the log process 15 ms and more a check at 1,000
    # partitions, every acknowledgement waiting).
    # The slices are the segments from the checkpoint on (a compacted segment in
    # a shared object has a position too, but lies below the checkpoint); a
    # compaction replaces slices only.
    def set_segments(self, segments: list[SegmentManifest]) -> None:
        super().set_segments(segments)
        self._slice_count = self._slice_bytes = 0
        self._count_slices(itertools.takewhile(self._is_slice, reversed(segments)), 1)
        if self._slice_count:
            self._sliced()

    def _sliced(self) -> None:
        """This log holds committed slices: the compaction loop looks at it (NodeFlusher.sliced)."""
        if self.node is not None:
            self.node[0].sliced[self] = None

    def has_slices(self) -> bool:
        return self._slice_count > 0

    def add_segment(self, m: SegmentManifest) -> list[SegmentManifest]:
        # The usual case, a node object's slice after the others, is LogReader.add_segment's first
        # case without its calls: once a partition at every node commit, it cut a request of 100
        # partition batches by 3-5% of its instructions (bench/instructions.py logproc --spread 100).
        bases = self._bases
        if self._is_slice(m) and (not bases or bases[-1] < m.base):
            self.segments.append(m)
            bases.append(m.base)
            self._slice_count += 1
            self._slice_bytes += m.size
            return []
        first_slice = self.segments[-self._slice_count].base if self._slice_count else m.last + 1
        replaced = super().add_segment(m)
        if self._is_slice(m):
            self._count_slices((m,), 1)
        if replaced:
            self._count_slices((r for r in replaced if r.base >= first_slice), -1)  # not the merged segments
        return replaced

    def drop_segments(self, n: int) -> None:
        self._count_slices(filter(self._is_slice, self.segments[:n]), -1)
        super().drop_segments(n)

    def _is_slice(self, m: SegmentManifest) -> bool:
        return m.pos >= 0 and m.base >= self.checkpoint

    def _count_slices(self, segments: Iterable[SegmentManifest], sign: int) -> None:
        for m in segments:
            self._slice_count += sign
            self._slice_bytes += sign * m.size

    def _slices(self) -> list[SegmentManifest]:
        """The committed node object slices, oldest first."""
        return self.segments[len(self.segments) - self._slice_count:]

    def compaction_due(self, now_ms: int, lag_ms: int, small_lag_ms: int) -> bool:
        """Whether the committed slices should be compacted now: their oldest is
        lag_ms old and they hold SMALL_SLICES_BYTES, or it is small_lag_ms old
        (>= lag_ms), or they hold segment.bytes."""
        if not self._slice_count:
            return False
        age = now_ms - self.oldest_slice_ms()
        n = self._slice_bytes
        return age >= small_lag_ms or self.holds_segment() or (age >= lag_ms and n >= SMALL_SLICES_BYTES)

    def holds_segment(self) -> bool:
        """Whether the committed slices hold a whole segment.bytes (compaction is due at once)."""
        return self._slice_bytes >= self.segment_bytes

    def oldest_slice_ms(self) -> int:
        """When the oldest committed slice was created (0 with none)."""
        return self.segments[-self._slice_count].created_ms if self._slice_count else 0

    def _slices_fit(self) -> bool:
        """All committed slices fit one segment: the next compaction takes them all (the usual case)."""
        return self._slice_bytes <= self.segment_bytes

    def _to_compact(self) -> tuple[list[SegmentManifest], int]:
        """The committed slices the next compaction takes (oldest first, up to segment.bytes) and their bytes."""
        if self._slices_fit():  # all of them: counted, not summed
            return self._slices(), self._slice_bytes
        slices: list[SegmentManifest] = []
        size = 0
        for m in self._slices():
            if slices and size + m.size > self.segment_bytes:
                break
            slices.append(m)
            size += m.size
        return slices, size

    def compaction_bytes(self) -> int:
        """Bytes the next compaction reads (it holds up to twice that while it
        builds the segment: what it read from S3, and the segment)."""
        return self._slice_bytes if self._slices_fit() else self._to_compact()[1]

    def to_merge(self, new_bytes: int, limit: int, most: int) -> list[SegmentManifest]:
        """The compacted segments in shared objects just before the slices that
        a compaction of new_bytes into a shared object takes along, oldest first
        (at most `most`), while everything stays within `limit` bytes and the
        topic's segment.bytes (retention drops whole segments). Going back from
        the newest, a group of MERGE_FAN_IN - 1 at a time, each no larger than
        what is taken so far: a tiered merge, so a partition keeps up to k - 1
        small segments of each size (k = MERGE_FAN_IN) and each record goes
        through about log_k(limit / new_bytes) merges. (Two at a time, a
        binary counter, took it through log2 of that: after 90 s at 1,000
        partitions compaction wrote 1.64-1.65 times the slices' bytes, against
        1.29-1.40 with k = 4, bench/history.md.) A group that would pass
        `limit` is taken as far as it fits, newest first, else the largest
        segments below it would never merge."""
        taken: list[SegmentManifest] = []
        size, limit = new_bytes, min(limit, self.segment_bytes)
        end = len(self.segments) - self._slice_count  # the compacted segments are before it
        while end >= MERGE_FAN_IN - 1 and len(taken) < most:
            group = self.segments[end - MERGE_FAN_IN + 1:end][::-1]  # newest first
            if any(m.pos < 0 or m.size > size or m.last < self.log_start for m in group):
                break
            fit, grown = 0, size
            while fit < len(group) and grown + group[fit].size <= limit:
                grown += group[fit].size
                fit += 1
            if fit == len(group) and len(taken) + fit > most:  # the transaction has no room for the whole group
                break
            fit = min(fit, most - len(taken))
            taken += group[:fit]
            if fit < len(group):
                break
            size = grown  # the whole group was taken
            end -= fit
        return taken[::-1]

    def _compaction_parts(self, merge_limit: int, most_merged: int
                          ) -> tuple[list[SegmentManifest], list[SegmentManifest]]:
        """What the next compaction takes: the compacted segments it merges
        (to_merge; none without merge_limit) and the committed slices."""
        slices, size = self._to_compact()
        merged = self.to_merge(size, merge_limit, most_merged) if merge_limit and slices else []
        return merged, slices

    def uncached(self, merge_limit: int = 0, most_merged: int = 0) -> list[SegmentManifest]:
        """What the next compaction takes (compaction's arguments) that the cache
        no longer holds, merged segments first: it reads them from S3."""
        merged, slices = self._compaction_parts(merge_limit, most_merged)
        return [m for m in merged + slices if not self.cache.holds(m)]

    async def compaction(self, merge_limit: int = 0, most_merged: int = 0,
                         read_slice: Callable[[SegmentManifest], Awaitable[memoryview | None]] | None = None
                         ) -> Compaction | None:
        """The committed slices the next compaction takes (oldest first, up to
        segment.bytes), the compacted segments it merges with them (to_merge;
        none without merge_limit) and the segment built of both; None with
        nothing to do. What the cache no longer holds is read from S3: through
        read_slice if it has it (a shared compaction reads its partitions'
        slices together), else with a GET each."""
        merged, slices = self._compaction_parts(merge_limit, most_merged)
        if not slices or self.closed:
            return None
        taken = merged + slices
        now = int(time.time() * 1000)
        built = self.cache.build(taken, now)
        if built is not None:  # all cached: the usual
            return merged, slices, built
        parts: list[tuple[memoryview | bytes | None, int]] = list(zip(self.cache.batches(taken),
                                                                   [m.base for m in taken], strict=True))
        missed = [i for i, (batches, _) in enumerate(parts) if batches is None]
        if missed:  # the cached ones are copied before the reads' awaits: meanwhile the ring moves on, and
            # a slice it overwrote would have to be read back with a GET of its own
            parts = [(None if batches is None else bytes(batches), base) for batches, base in parts]
            reads = asyncio.Semaphore(COMPACTION_READS_AT_ONCE)

            async def read(i: int) -> None:
                async with reads:
                    data = None if read_slice is None else await read_slice(taken[i])
                    seg = (CachedSegment.from_object(data) if data is not None
                           else await self.whole(taken[i], keep=False))  # one ranged GET
                    parts[i] = (bytes(seg.batches()), taken[i].base)

            await asyncio.gather(*(read(i) for i in missed))
        return merged, slices, build_segment(parts, now)

    @staticmethod
    def compacted_manifest(built: Compaction, key: str, pos: int = -1) -> SegmentManifest:
        """The manifest of a compacted segment (pos >= 0: in a shared object).
        It was created when its oldest slice was: a merged segment's producers
        (recovered from manifests on a new owner) must not expire with the
        oldest record it merges."""
        merged, slices, seg = built
        return SegmentManifest(seg.base_offset, seg.last_offset, seg.count, len(seg.data), seg.min_timestamp,
                               seg.max_timestamp, key, min(m.created_ms for m in slices),
                               {str(pid): [st.epoch, [list(b) for b in st.recent]]
                                for pid, st in producer_states(merged + slices).items()}, pos)

    def compacted_state(self, seg: BuiltSegment) -> PartitionState:
        """The partition's state once this compacted segment is committed: its checkpoint after it."""
        return PartitionState(self.cfg.node_id, self.epoch, seg.last_offset + 1, self.log_start, self.fence)

    def commit_lock(self) -> asyncio.Lock:
        """Held while the partition key moves (commits, retention, release_fence)."""
        return self._commit_lock

    def state_raw(self) -> bytes:
        """The partition key's value as this owner last wrote it (what its commits compare)."""
        return self._state_raw

    def compaction_committed(self, raw: bytes, manifest: SegmentManifest) -> None:
        """A compacted segment's manifest and the checkpoint after it are in
        etcd (raw: the partition key's value now); under the commit lock."""
        self._state_raw = raw
        self.checkpoint = manifest.last + 1

    def serve_compacted(self, manifest: SegmentManifest, built: Compaction) -> None:
        """Serve from a committed compacted segment instead of the slices (and
        merged segments) it replaces, and count what it rewrote. The caller
        put the segment in the cache first (a shared compaction puts all of
        its object's segments at once)."""
        merged = built[0]
        slice_bytes = self._slice_bytes
        self.add_segment(manifest)  # replaces the slices: their bytes are counted down (not summed again)
        node = metrics.node()
        metrics.COMPACTED_BYTES.labels(node, "slices").inc(slice_bytes - self._slice_bytes)
        if merged:
            metrics.COMPACTED_BYTES.labels(node, "merged").inc(sum(m.size for m in merged))
        self._on_change(self, manifest)

    async def compact(self) -> None:
        """Rewrite the committed slices (oldest first, up to segment.bytes) into
        one .kfs segment with its index, commit its manifest and the new
        checkpoint in one fenced transaction, then serve from it."""
        async with self._compacting:
            built = await self.compaction()
            if built is None:
                return
            seg = built[2]
            key = segment_key(self.cfg.namespace, self.topic, self.partition, seg.base_offset, self.epoch)
            manifest = self.compacted_manifest(built, key)
            await self._retry(f"upload of {key}", lambda: asyncio.wait_for(
                self._upload(key, seg.data, seg.index, background=True), self.cfg.s3_timeout_s))
            faults.reached("mid-compaction")
            closed = False

            async def commit() -> None:
                nonlocal closed
                async with self._commit_lock:  # as release_fence: after it, nothing puts our fence back
                    if self.closed:  # handed over or fenced meanwhile: the slices stay for the next owner
                        closed = True
                        return
                    self.compaction_committed(await self._commit(self.compacted_state(seg), manifest), manifest)

            try:
                await self._retry(f"commit of {key}", commit)
            except Fenced:  # a new owner (or the topic was deleted): the segment is nobody's
                log.warning("%s/%d: fenced by a newer owner while compacting", self.topic, self.partition)
                self.flush_failed()
                await self._delete_objects([manifest], "a fenced compaction")
                return
            if closed:
                await self._delete_objects([manifest], "a compaction of a closed log")
                return
            self.cache.put(manifest, CachedSegment.from_built(built[2]))
            self.serve_compacted(manifest, built)

    async def release_fence(self, hand_over: HandOver | None = None) -> bool:
        """Handing over with nothing in flight: clear our fence from the partition's
        state, so that the next owner's claim does not fence the whole node.
        Under the commit lock, after a compaction's commit under way (which
        would put the fence back after ours); a compaction still uploading
        finds the log closed when it takes the lock, and commits nothing.
        With hand_over (MetaStore.hand_over with our broker id, or a call
        that gathers those of several partitions), its owner key goes in the
        same transaction if it is still ours: whether it went (if not, the
        caller releases it on its own). Fenced: the partition is not ours any
        more."""
        async with self._commit_lock:
            new_state = PartitionState(self.cfg.node_id, self.epoch, self.checkpoint, self.log_start, "")
            if hand_over is not None:
                raw = await hand_over(self.topic, self.partition, self._state_raw, new_state)
                if raw is not None:
                    self._state_raw = raw
                    return True
            self._state_raw = await self.meta.set_log_start(self.topic, self.partition, self._state_raw,
                                                            new_state, [])
            return False

    def _ack_original(self, base: int, ack: Ack) -> None:
        """A retried duplicate is acknowledged when its original (the queued
        batch at `base`) is durable: at once if it is committed."""
        if base < self.hw:
            ack[0].answer(ack[1], None)
            return
        for p in self._inflight + self._pending:
            if p.base == base:
                if p.acks is None:  # the original was sent with acks=0
                    p.acks = []
                p.acks.append(ack)
                return
        raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"batch at offset {base} is neither queued nor committed")

    def _check_sequence(self, first: _native.BatchInfo) -> int | None:
        """Idempotent producer bookkeeping: returns the original base offset for
        a retried duplicate, None for the next batch in sequence."""
        now_ms = int(time.time() * 1000)
        if now_ms > self._producers_pruned_ms + 60_000:
            self._producers = {pid: st for pid, st in self._producers.items()
                               if st.last_ms > now_ms - PRODUCER_EXPIRY_MS}
            self._producers_pruned_ms = now_ms
        st = self._producers.get(first.producer_id)
        if st is None or first.producer_epoch > st.epoch:
            self._producers[first.producer_id] = _ProducerState(first.producer_epoch, now_ms)
            return None
        st.last_ms = now_ms
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
        """Cut segments from the queue. Up to MAX_UPLOADS segments upload at
        once; each commits to etcd only after the one before it, so the high
        watermark and the acknowledgements still move in offset order. A
        segment gives its upload slot up when its upload ends, not when it
        commits: one slow PUT (SeaweedFS stalls writes each time it fills a
        volume, for over a second with several PUTs in flight) then holds back
        the commits behind it but not the uploads, up to MAX_UNCOMMITTED
        segments."""
        prev: asyncio.Task[None] | None = None
        while True:
            await self._wake.wait()
            if self._pending_bytes < self.segment_bytes:
                wait = self._linger.wait(self.cfg.linger_ms, not self._flushes)
                if wait > 0:
                    await asyncio.sleep(wait)
            await self._uncommitted.acquire()
            await self._upload_slots.acquire()
            take, _ = self.take(self.segment_bytes)
            self._linger.cut()
            if not self._pending:
                self._wake.clear()
            prev = asyncio.create_task(self._flush(take, prev), name=f"flush {self.topic}/{self.partition}")
            self._flushes.add(prev)
            prev.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._flushes.discard(task)
        self._uncommitted.release()
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not self.closed:  # fenced (or a bug): nothing queued here can become durable
            log.log(logging.WARNING if isinstance(exc, Fenced) else logging.ERROR,
                    "%s/%d: %s; failing %d pending appends", self.topic, self.partition,
                    "fenced by a newer owner" if isinstance(exc, Fenced) else f"flush failed: {exc!r}",
                    len(self._inflight) + len(self._pending), exc_info=not isinstance(exc, Fenced))
            self.closed = True
            if self._flusher is not None:
                self._flusher.cancel()
            for t in self._flushes:
                t.cancel()
            self._fail_queued(ErrorCode.NOT_LEADER_OR_FOLLOWER)
            self._on_change(self, None)
        self._drain_done()

    def _is_idle(self) -> bool:
        """Nothing queued or being flushed (by node objects: taken and not
        answered yet; else by the log's own flush tasks)."""
        return not self._pending and not (self._inflight if self.node is not None else self._flushes)

    def _drain_done(self, failed: bool = False) -> None:
        """End a draining close's wait once the log is idle, or once nothing
        queued can become durable any more (failed)."""
        if self._drained is not None and not self._drained.done() and (failed or self._is_idle()):
            self._drained.set_result(None)

    def _fail_queued(self, code: ErrorCode) -> None:
        """Fail every batch queued or being flushed (none of it can become durable now)."""
        items = self._inflight + self._pending
        self._pending, self._inflight, self._pending_bytes = [], [], 0
        for p in items:
            p.done_with_payload()
            p.answer(LogError(code))

    async def _retry(self, what: str, step: Callable[[], Awaitable[None]]) -> None:
        await retry(f"{self.topic}/{self.partition}: {what}", step)

    async def _flush(self, items: list[Pending], prev: asyncio.Task[None] | None) -> None:
        try:  # holds an upload slot (taken by _flush_loop) until the upload ends
            seg = build_segment([(p.payload, p.base) for p in items], int(time.time() * 1000))
            for p in items:
                p.done_with_payload()
            key = segment_key(self.cfg.namespace, self.topic, self.partition, seg.base_offset, self.epoch)
            metrics.FLUSH_BYTES.labels(metrics.node()).observe(len(seg.data))
            manifest = SegmentManifest(seg.base_offset, seg.last_offset, seg.count, len(seg.data),
                                       seg.min_timestamp, seg.max_timestamp, key, int(time.time() * 1000),
                                       producers_of(items))
            await self._retry(f"upload of {key}", lambda: asyncio.wait_for(self._upload(key, seg.data, seg.index),
                                                                           self.cfg.s3_timeout_s))
        finally:
            self._upload_slots.release()
        if prev is not None:
            await asyncio.wait([prev])  # commit in offset order
            if prev.cancelled() or prev.exception() is not None:
                return  # the log was fenced or closed; our appends were failed with it

        async def commit() -> None:
            async with self._commit_lock:
                new_state = PartitionState(self.cfg.node_id, self.epoch, seg.last_offset + 1, self.log_start)
                self._state_raw = await self._commit(new_state, manifest)
                self.add_segment(manifest)
                self.hw = self.checkpoint = seg.last_offset + 1

        await self._retry(f"commit of {key}", commit)
        self.cache.put(manifest, CachedSegment.from_built(seg))
        self._resolve(items)
        self._on_change(self, manifest)

    def _resolve(self, items: list[Pending]) -> None:
        """These batches are durable: acknowledge them. They are the oldest in
        flight (taken in order, committed in order): the check of both ends
        stands for the whole run, else each is looked for."""
        n = len(items)
        if n and len(self._inflight) >= n and self._inflight[0] is items[0] and self._inflight[n - 1] is items[-1]:
            del self._inflight[:n]
        else:
            done = {id(p) for p in items}
            self._inflight = [p for p in self._inflight if id(p) not in done]
        _native.answer(items, None)

    async def _upload(self, key: str, data: bytearray, index: bytes, background: bool = False) -> None:
        """Write both objects once (the index only if the segment has one). The
        key carries our epoch, which only this process holds, so an existing
        object is our own earlier attempt at this very segment (same bytes)
        whose reply was lost. The two PUTs run concurrently: nothing reads
        either object before the etcd commit. A compaction's are background
        writes (ObjectStore.put): nobody waits for them."""
        async def put(k: str, body: bytes | bytearray) -> None:
            try:
                await self.store.put(k, body, background=background)
            except ObjectExists:
                if await self.store.size(k) != len(body):
                    raise Fenced(f"{k} exists with other content: another writer holds epoch {self.epoch}") from None

        await asyncio.gather(put(key, data), *([put(index_key(key), index)] if has_index(len(data)) else []))

    async def _commit(self, new_state: PartitionState, manifest: SegmentManifest) -> bytes:
        t = time.perf_counter()
        try:
            raw = await self.meta.commit_segment(self.topic, self.partition, self._state_raw, new_state, manifest)
            metrics.ETCD_SECONDS.labels(metrics.node()).observe(time.perf_counter() - t)
            return raw
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
                expired = retention_ms >= 0 and m.newest_ms < now_ms - retention_ms
                if not (expired or (retention_bytes >= 0 and total > retention_bytes)):
                    break
                drop.append(m)
                total -= m.size
            if not drop:
                return 0
            await self._move_log_start(drop[-1].last + 1, drop)
        await self._delete_objects(drop, "retention")
        return len(drop)

    async def delete_records(self, before: int) -> int:
        """DeleteRecords: records before offset `before` (at most the high
        watermark) are gone for readers; segments wholly before it are deleted,
        the one it falls in stays in S3 but is served only from `before` on.
        Returns the new log start offset."""
        async with self._commit_lock:
            if self.closed:
                raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, "partition log closed")
            if before <= self.log_start:
                return self.log_start
            drop = [m for m in self.segments if m.last < before]
            await self._move_log_start(before, drop)
        await self._delete_objects(drop, "DeleteRecords")
        return before

    async def _move_log_start(self, new_start: int, drop: list[SegmentManifest]) -> None:
        """Fenced in etcd: the new log start offset, and the manifests of the dropped segments gone.
        Called with the commit lock held; drop is a prefix of self.segments."""
        new_state = PartitionState(self.cfg.node_id, self.epoch, self.checkpoint, new_start, self.fence)
        self._state_raw = await self.meta.set_log_start(self.topic, self.partition, self._state_raw, new_state,
                                                        [m.base for m in drop])
        self.log_start = new_start
        self.drop_segments(len(drop))
        self._on_change(self, None)

    async def _delete_objects(self, drop: list[SegmentManifest], why: str) -> None:
        """Delete segments no manifest names any more (failures leave only garbage)."""
        for m in drop:
            self.cache.drop(m)
            if m.pos >= 0:  # a node object's slice: the object goes once all its slices are gone (wal.collect)
                continue
            try:
                await asyncio.gather(self.store.delete(m.key),
                                     *([self.store.delete(index_key(m.key))] if has_index(m.size) else []))
            except Exception as exc:
                log.warning("could not delete %s: %r", m.key, exc)
        log.info("%s/%d: %s removed %d segments; log start offset now %d", self.topic, self.partition, why,
                 len(drop), self.log_start)


def producers_of(items: list[Pending]) -> dict[str, list[Any]]:
    """The idempotent producers' last batches among items, for a manifest."""
    out: dict[str, list[Any]] = {}
    for p in items:
        if p.producer is not None:
            pid, epoch, first_seq, last_seq = p.producer
            entry = out.setdefault(str(pid), [epoch, []])
            if epoch > entry[0]:
                entry[:] = [epoch, []]
            entry[1] = [*entry[1], [first_seq, last_seq, p.base]][-PRODUCER_BATCHES:]
    return out


def producer_states(segments: list[SegmentManifest]) -> dict[int, _ProducerState]:
    """Each producer's epoch and last batches, from the manifests of the
    committed segments (oldest first): what an owner had in memory."""
    states: dict[int, _ProducerState] = {}
    expired = int(time.time() * 1000) - PRODUCER_EXPIRY_MS
    for m in segments:
        if not m.producers or m.created_ms < expired:  # most have none: no call for them
            continue
        for pid, (epoch, batches) in m.producers.items():
            st = states.get(int(pid))
            if st is None or epoch > st.epoch:
                st = states[int(pid)] = _ProducerState(epoch, m.created_ms)
            st.last_ms = m.created_ms
            st.recent.extend(tuple(b) for b in batches)
    return states


SWEEP_GATHER_S = 0.5  # partitions claimed until none came for this long are swept together,
SWEEP_GATHER_MAX_S = 30.0  # gathered for at most this long
LIST_PAGE = 1000  # objects per LIST request


class OrphanSweeper:
    """Deletes, in the background, the objects that earlier owners of the
    partitions this node claims uploaded but never committed (they died, or
    were fenced, between upload and commit). Such an object's key carries an
    older epoch and no manifest names it: its writer's commit can never
    succeed any more (commits compare the epoch, which the claim bumped), and
    readers only follow manifests. A first claim (epoch 1) has nothing to
    sweep. Partitions claimed together (a broker taking over another's) are
    swept together once the claims pause: one listing of their topic's objects
    serves them all where it takes fewer requests than one for each of them
    (its size estimated from their segments). A LIST for each of 10,000
    reopened partitions took a quarter of the log process's time while it
    reopened them."""

    def __init__(self, store: ObjectStore, namespace: str) -> None:
        self.store = store
        self.namespace = namespace
        self._due: dict[str, tuple[int, list[PartitionLog]]] = {}  # topic -> (its partition count, logs)
        self._task: asyncio.Task[None] | None = None
        self._claimed = asyncio.Event()  # a partition came due since the last clear

    def sweep(self, lg: PartitionLog, topic_partitions: int) -> None:
        """Sweep a claimed partition's objects soon."""
        if lg.epoch <= 1:
            return
        self._due.setdefault(lg.topic, (topic_partitions, []))[1].append(lg)
        self._claimed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="orphan sweep")

    async def close(self) -> None:
        self._due.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while self._due:
            await self._gather()
            topic = next(iter(self._due))
            partitions, logs = self._due.pop(topic)
            prefix = f"{self.namespace}/{topic}/"
            try:
                per_partition = sum(2 * sum(1 for m in lg.segments if m.pos < 0) + 1 for lg in logs) / len(logs)
                if partitions * per_partition / LIST_PAGE < len(logs):  # objects and their indexes
                    listed: dict[str, list[str]] = {}
                    for o in await self.store.list(prefix):
                        listed.setdefault(o["Key"][len(prefix):].split("/", 1)[0], []).append(o["Key"])
                    for lg in logs:
                        await self._delete(lg, listed.get(str(lg.partition), []))
                else:
                    for lg in logs:
                        await self._delete(lg, [o["Key"] for o in await self.store.list(f"{prefix}{lg.partition}/")])
            except Exception as exc:  # their next owner tries again
                log.warning("%s: sweeping uncommitted objects failed: %r", topic, exc)

    async def _gather(self) -> None:
        """Return once no partition came due for SWEEP_GATHER_S (or SWEEP_GATHER_MAX_S passed)."""
        until = time.monotonic() + SWEEP_GATHER_MAX_S
        while (left := until - time.monotonic()) > 0:
            self._claimed.clear()
            try:
                await asyncio.wait_for(self._claimed.wait(), min(SWEEP_GATHER_S, left))
            except TimeoutError:
                return

    async def _delete(self, lg: PartitionLog, keys: list[str]) -> None:
        if lg.closed:  # handed over meanwhile: its next owner sweeps
            return
        orphans = lg.orphans(keys)
        if orphans:
            await self.store.delete_many(orphans)
            log.info("%s/%d: deleted %d objects no manifest names (uploaded by earlier owners, never committed)",
                     lg.topic, lg.partition, len(orphans))
