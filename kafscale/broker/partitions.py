"""The partitions this broker owns: the topic cache (kept current by a
watch on etcd), opening a partition's log when it is first used here
(claiming it in etcd under the broker's lease), handing partitions over when
the membership says another broker should have them, retention, and dropping
everything when the lease is lost. The API classes get partition logs from
here and never open one themselves. With node flushes it also runs the
node's flusher (one object per flush cycle for all partitions), compacts the
partitions' committed slices and forgets node objects compacted away."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from kafscale.broker.access import Access
from kafscale.broker.cluster import Cluster
from kafscale.broker.context import RequestContext
from kafscale.broker.server import Handler
from kafscale.config import Config
from kafscale.metadata import topic_config
from kafscale.metadata.store import (
    CLAIM_BATCH,
    HANDOVER_BATCH,
    SHARED_PARTITIONS,
    TXN_MAX_OPS,
    MetaStore,
    PartitionState,
    SegmentManifest,
    TopicCache,
    TopicExists,
    TopicMeta,
    has_partition,
)
from kafscale.metadata.topic_config import topic_name_error
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.types import TopicPartition
from kafscale.security.acl import Operation, ResourceType
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.partition import LogError, OrphanSweeper, PartitionLog
from kafscale.storage.reader import ReadBudget, SegmentSource
from kafscale.storage.segment import BuiltSegment, topic_marker_key
from kafscale.storage.shared import SHARED_OBJECT_BYTES, SHARED_SEGMENT_BYTES, compact_shared
from kafscale.storage.wal import Collector, NodeFlusher, Turns, WalIndex, in_turns, layout_order, retry, topic_marker

log = logging.getLogger(__name__)

COMPACTION_CHECK_S = 1.0  # how often open partitions are checked for slices due for compaction
# compaction starts before a slice has been in the cache this share of the time the cache keeps it (it may wait
# up to half as long again to start, and reads its slices when it does)
COMPACTION_CACHE_SHARE = 1 / 3
# a partition whose slices stay small (SMALL_SLICES_BYTES) is compacted this many lags after its oldest: at
# 10,000 partitions every one of them is small and costs a compaction each lag (bench/history.md, session 55)
SMALL_LAG_FACTOR = 3
COMPACTION_MEMORY_SEGMENTS = 2  # compactions under way hold at most this many segment.bytes (slices read + built)
# compactions under way at once: compacting a hundred at once queued two hundred PUTs ahead of the node flushes'
# (producers waited for seconds). At 20,000 records/s over 100 partitions nearly every acknowledgement above the
# p99 came while the first compactions ran; the p99's median over six alternating runs was 152 ms with two at once,
# 253 with four (179 over fifteen runs with four; bench/history.md, session 98)
COMPACTIONS_AT_ONCE = 2
# due logs compaction_batches groups in one go: at 10,000 partitions a check starts 2,000, and sorting them and
# grouping them all at once held the log process's event loop for 7-11 ms each second under load (session 85)
BATCHING_TURN = 10 * SHARED_PARTITIONS
# small partitions a check starts together (when that many are due) although the spread would start fewer:
# one shared object for them costs what one for a single partition does (a few slow partitions spread over
# the checks one at a time would cost an object and a transaction each)
SHARED_GATHER = 16
# partitions claimed at once (etcd transactions in flight while a large topic opens, 10,000 at once without it).
# Opening 10,000 new partitions that each still scanned node object directories, the lease refresh took 2-3.6 s
# and the broker lost its lease without this bound; with it, 2-2.8 s and kept. Only the claims wait for a slot:
# the reads that follow share scans (WalIndex); with 32 slots around claim and reads, each few claims waited for
# a scan of their own. New partitions opened in 7.8 s with no bound, 9.2-9.5 s with 256 and 13 s with 32; after a
# SIGKILL they reopened (with reads) in 30-32 s with 256 and 47 s with 32, 27 s before the bound
CLAIMS_AT_ONCE = 256
# claim transactions of up to CLAIM_BATCH partitions each (TopicBatches) in flight at once: reopening 10,000
# partitions made 40,000 etcd calls one partition at a time, which took a third of the log process's time
CLAIM_BATCHES_AT_ONCE = 4
# hand-over transactions of up to HANDOVER_BATCH partitions each in flight at once: a broker with 10,000
# partitions stopped with 10,001 etcd transactions, one a partition
HANDOVER_BATCHES_AT_ONCE = 4
# partitions the retention pass goes through before it lets other work run (1,000 held the log process's
# event loop about 10 ms a turn at 10,000 partitions, under load: bench/history.md, session 91)
RETENTION_TURN = 250
# after this many partitions opened, every object the cyclic collector tracks is frozen (gc.freeze: never
# scanned again), so that open partitions' objects (about 15 each) are not scanned by every middle and full
# collection: at 10,000 partitions the first middle collection after they opened held the log process for
# 83-147 ms, in the middle of the producers' load (bench/history.md, session 85). Freezing takes no time (it joins
# lists); the cost is that cyclic garbage present at that moment is never collected (under load the log process's
# collections found 0-73 unreachable objects each). A closed partition's objects hold no cycle: frozen ones are
# freed when the last reference goes
FREEZE_OPENS = 1000

Claimed = tuple[PartitionState, bytes]
T = TypeVar("T")
R = TypeVar("R")


class TopicBatches(Generic[T, R]):
    """Calls about single partitions, gathered by topic: those of a topic that
    wait while `at_once` batches are under way go together, up to `size` in
    one call of `run(topic, [(partition, item), ...])`, which returns the
    result of each partition it did. A call starts at once when a slot is
    free, so one partition alone waits for nothing. `check` runs for each
    partition as its batch starts (it raises LogError when the partition must
    not go now). A partition its batch did not do, or whose batch failed,
    gets None: its caller does it alone, which tells why."""

    def __init__(self, run: Callable[[str, list[tuple[int, T]]], Awaitable[dict[int, R]]], size: int,
                 at_once: int, check: Callable[[str, int], None] = lambda topic, p: None) -> None:
        self._run, self._size, self._check = run, size, check
        self._queued: dict[str, list[tuple[int, T, asyncio.Future[R | None]]]] = {}
        self._slots = asyncio.Semaphore(at_once)
        self._tasks: set[asyncio.Task[None]] = set()  # the drain and the batches under way

    async def submit(self, topic: str, p: int, item: T) -> R | None:
        """The partition's result, or None when its batch did not do it: do it alone."""
        fut: asyncio.Future[R | None] = asyncio.get_running_loop().create_future()
        if not self._queued:
            self._spawn(self._drain())
        self._queued.setdefault(topic, []).append((p, item, fut))
        return await fut

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        while self._queued:
            await self._slots.acquire()
            topic = next(iter(self._queued))
            queue = self._queued[topic]
            batch, queue[:] = queue[:self._size], queue[self._size:]
            if not queue:
                del self._queued[topic]
            self._spawn(self._batch(topic, batch))

    async def _batch(self, topic: str, batch: list[tuple[int, T, asyncio.Future[R | None]]]) -> None:
        try:
            waiting = []
            for p, item, fut in batch:
                if fut.done():  # its caller gave up meanwhile
                    continue
                try:
                    self._check(topic, p)
                    waiting.append((p, item, fut))
                except LogError as exc:
                    fut.set_exception(exc)
            done: dict[int, R] = {}
            if waiting:
                try:
                    done = await self._run(topic, [(p, item) for p, item, _ in waiting])
                except Exception as exc:  # each is done alone, and reports its own error
                    log.warning("%d partitions of %s together failed: %r", len(waiting), topic, exc)
            for p, _, fut in waiting:
                if not fut.done():
                    fut.set_result(done.get(p))
        finally:
            self._slots.release()


class RecentCache(SegmentSource, Protocol):
    """The cache committed segments go in, which compaction reads slices from."""

    def keeps_s(self) -> float:
        """About how long a segment put now stays in the cache (math.inf: for good)."""
        ...

    def batches(self, manifests: Iterable[SegmentManifest]) -> list[memoryview | None]:
        """Each cached segment's batches (header and footer left out), for
        compaction to copy before its next await (None: not cached)."""
        ...

    def build(self, manifests: list[SegmentManifest], created_ms: int) -> BuiltSegment | None:
        """The segment of the batches of these cached segments, each from its
        manifest's base offset on (build_segment); None if one of them is
        not cached."""
        ...

    def drop(self, m: SegmentManifest) -> None:
        """Forget m's segment: its manifest is gone."""
        ...

    def drop_prefix(self, prefix: str) -> None:
        """Forget every segment whose object key starts with prefix."""
        ...

    def put_object(self, key: str, body: memoryview, entries: tuple[bytes, bytes], at: int = 0) -> None:
        """Put segments of object `key` that lie back to back in body (its
        byte 0 the object's byte `at`), their entries (shm.Entries: each
        one's position in the object, size and tables) packed: a node
        object's slices, committed together, or a shared object's segments."""
        ...


class PartitionRegistry:
    def __init__(self, cfg: Config, store: ObjectStore, meta: MetaStore, cache: RecentCache,
                 cluster: Cluster) -> None:
        self.cfg = cfg
        self.store = store
        self.meta = meta
        self.cache = cache
        self.cluster = cluster
        self.read_budget = ReadBudget(cfg.readahead_memory_bytes)
        self._on_change: Callable[[PartitionLog, SegmentManifest | None], None] = lambda lg, m: None
        self.logs: dict[TopicPartition, PartitionLog] = {}
        # open logs placed on this broker under membership generation _placed_at (hand_over_misplaced)
        self._placed_here: dict[PartitionLog, None] = {}
        self._placed_at = -1
        self._opening: dict[TopicPartition, asyncio.Future[PartitionLog]] = {}
        self._open_tasks: set[asyncio.Future[PartitionLog]] = set()  # open_soon's, referenced until done
        self._opened_unfrozen = 0  # partitions opened since the collector's generations were last frozen
        self._claim_slots = asyncio.Semaphore(CLAIMS_AT_ONCE)
        self._claims: TopicBatches[None, Claimed] = TopicBatches(self._claim_batch, CLAIM_BATCH,
                                                                 CLAIM_BATCHES_AT_ONCE, self._may_open)
        self._hand_overs: TopicBatches[tuple[bytes, PartitionState], bytes] = TopicBatches(
            self._hand_over_batch, HANDOVER_BATCH, HANDOVER_BATCHES_AT_ONCE)
        self.topics = TopicCache()
        self.lease: Any = None  # our etcd lease: partition ownership hangs on it
        self.closing = False  # shutting down: no partition is opened any more
        self.defaults = topic_config.Defaults(cfg)  # re-read by refresh_defaults
        self.flusher = NodeFlusher(cfg, store, meta, cache, self._topic_id, self._fenced) if cfg.node_flush else None
        self.wal = WalIndex(meta)
        self._shared_seqs = itertools.count(1)  # shared objects of this process (named under the fence as well)
        self.sweeper = OrphanSweeper(store, cfg.namespace)
        self._markers: dict[bytes, tuple[str, asyncio.Task[None]]] = {}  # topic id -> name, its marker's write
        self._refencing = False  # taking a new fence: no partition opens
        self._refence_lock = asyncio.Lock()

    def _topic_id(self, name: str) -> bytes | None:
        meta = self.topics.get(name)
        return meta.id if meta is not None else None

    @property
    def on_change(self) -> Callable[[PartitionLog, SegmentManifest | None], None]:
        """Told when a partition log commits a segment, moves its start or closes."""
        return self._on_change

    @on_change.setter
    def on_change(self, fn: Callable[[PartitionLog, SegmentManifest | None], None]) -> None:
        """Set before any log opens: each log calls it directly (through a
        lambda that looked it up, an extra call a slice committed)."""
        if self.logs or self._opening:
            raise RuntimeError("on_change is set before partition logs open")
        self._on_change = fn

    async def start(self, lease: Any) -> None:
        self.lease = lease
        if self.flusher is not None:
            await self.flusher.start(lease)

    async def _fenced(self, fence: str) -> None:
        """A node object of `fence` was fenced (another log process claimed one
        of our partitions) or failed: close every partition (their queued
        batches are failed, clients retry and reopen them) and flush under a
        new fence. Nothing if we left that fence already."""
        if self.flusher is None or self.closing:
            return
        async with self._refence_lock:
            if fence == self.flusher.fence:
                log.warning("node flush fenced: closing %d partitions, continuing under a new fence", len(self.logs))
                await self._refence(self.lease)

    async def _refence(self, lease: Any) -> None:
        """Close every partition and take a new fence on lease; no partition
        opens meanwhile (it would be opened under the fence being left)."""
        assert self.flusher is not None
        self._refencing = True
        try:
            await asyncio.gather(*self._opening.values(), return_exceptions=True)
            logs, self.logs = list(self.logs.values()), {}
            await asyncio.gather(*(lg.close() for lg in logs))
            self.lease = lease
            await self.flusher.stop()
            await self.flusher.start(lease)
        finally:
            self._refencing = False

    async def refresh_defaults(self) -> None:
        """Adopt the dynamic broker configs another broker may have changed."""
        dynamic = await self.meta.cluster_configs()
        if dynamic != self.defaults.dynamic:
            self.defaults.dynamic = dynamic
            for (name, _), lg in self.logs.items():
                meta = self.topics.get(name)
                if meta is not None:
                    self._configure(lg, meta)

    # ----------------------------------------------------------------- topics
    async def topic(self, name: str, auto_create: bool = False) -> TopicMeta | None:
        meta = self.topics.get(name)
        if meta is None:
            meta = await self.meta.get_topic(name)
            if meta is None and auto_create and self.cfg.auto_create_topics and topic_name_error(name) is None:
                try:
                    meta = await self.meta.create_topic(name, self.defaults.partitions, {})
                    log.info("auto-created topic %s", name)
                except TopicExists:
                    meta = await self.meta.get_topic(name)
            if meta is not None:
                self.topics.put(meta)
        return meta

    async def topic_by_id(self, topic_id: bytes) -> TopicMeta | None:
        """From the topic cache, which the topic watch keeps current: a request
        naming thousands of ids costs no etcd reads."""
        return self.topics.by_id(topic_id)

    async def apply_topic_meta(self, meta: TopicMeta) -> None:
        """Adopt a topic's new configuration in the cache and its open logs."""
        self.topics.put(meta)
        for (name, _), lg in self.logs.items():
            if name == meta.name:
                self._configure(lg, meta)

    def _configure(self, lg: PartitionLog, meta: TopicMeta) -> None:
        lg.segment_bytes = topic_config.value(meta.config, "segment.bytes", self.defaults)

    async def forget_topic(self, name: str) -> None:
        """Close a deleted topic's open logs and drop it from the cache."""
        for key in [k for k in self.logs if k[0] == name]:
            await self.logs.pop(key).close(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        for topic_id in [i for i, (n, _) in self._markers.items() if n == name]:
            self._markers.pop(topic_id)[1].cancel()
        self.topics.pop(name)

    async def drop_topic(self, name: str) -> None:
        """Delete a topic's etcd keys and then its objects. Its marker goes
        first, while etcd still names this topic: once the keys are gone the
        name may be created again, and the new topic's marker must stay."""
        await self.forget_topic(name)
        marker = topic_marker_key(self.cfg.namespace, name)
        await self.store.delete(marker)
        await self.meta.delete_topic(name)
        prefix = f"{self.cfg.namespace}/{name}/"
        self.cache.drop_prefix(prefix)
        keys = [o["Key"] for o in await self.store.list(prefix) if o["Key"] != marker]
        await self.store.delete_many(keys)
        log.info("deleted topic %s (%d objects and its marker)", name, len(keys))

    # ------------------------------------------------------------------- logs
    async def partition_log(self, topic: str, p: int) -> PartitionLog:
        lg = self.open_log(topic, p)
        if lg is not None:
            return lg
        key = TopicPartition(topic, p)
        pending = self._opening.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        self._may_open(topic, p)
        fut: asyncio.Future[PartitionLog] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut

        def fail(err: LogError) -> LogError:
            """Those who joined this open get err (retrieved here: waiters re-raise it)."""
            fut.set_exception(err)
            fut.exception()
            return err

        try:
            lg = await self._open(topic, p)
            self.logs[key] = lg
            fut.set_result(lg)
            self._opened_unfrozen += 1
            if self._opened_unfrozen >= FREEZE_OPENS:
                self._opened_unfrozen = 0
                gc.freeze()
            return lg
        except LogError as exc:
            fail(exc)
            raise
        except KeyError as exc:  # the topic was deleted meanwhile
            raise fail(LogError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, str(exc))) from exc
        except Exception as exc:  # etcd unreachable or similar: clients retry on this code
            log.warning("cannot open %s/%d: %r", topic, p, exc)
            raise fail(LogError(ErrorCode.LEADER_NOT_AVAILABLE, f"partition {topic}/{p} is not available: {exc}")
                       ) from exc
        except asyncio.CancelledError:  # the opener gave up: those who joined it get an error to retry on
            fail(LogError(ErrorCode.LEADER_NOT_AVAILABLE, f"opening {topic}/{p} was cancelled"))
            raise
        finally:
            del self._opening[key]

    async def _claim_batch(self, topic: str, parts: list[tuple[int, None]]) -> dict[int, Claimed]:
        fence = self.flusher.fence if self.flusher is not None else ""
        return await self.meta.claim_partitions(topic, [p for p, _ in parts], self.cfg.node_id, self.lease, fence)

    async def _hand_over_batch(self, topic: str, parts: list[tuple[int, tuple[bytes, PartitionState]]]
                               ) -> dict[int, bytes]:
        """The hand-overs of partitions of a topic in one transaction; when a
        key of one of them moved, each alone, which tells which."""
        states = [(p, raw, state) for p, (raw, state) in parts]
        done = await self.meta.hand_over_partitions(topic, states, self.cfg.node_id)
        if not done and len(states) > 1:
            alone = await asyncio.gather(*(self.meta.hand_over(topic, *s, self.cfg.node_id) for s in states))
            done = {p: raw for (p, _, _), raw in zip(states, alone, strict=True) if raw is not None}
        return done

    async def _hand_over(self, topic: str, p: int, expected_raw: bytes, new_state: PartitionState) -> bytes | None:
        """PartitionLog.release_fence's hand-over, in one transaction with those
        of the topic's other partitions handed over meanwhile."""
        return await self._hand_overs.submit(topic, p, (expected_raw, new_state))

    def _may_open(self, topic: str, p: int) -> None:
        if self.closing:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"broker {self.cfg.node_id} is shutting down")
        if self._refencing:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"broker {self.cfg.node_id} is taking a new fence")
        desired = self.cluster.desired_owner(topic, p)
        if desired != self.cfg.node_id:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"{topic}/{p} belongs on broker {desired}")

    async def _open(self, topic: str, p: int) -> PartitionLog:
        """Claim the partition on our lease (when a claim slot is free) and open its log."""
        meta = self.topics.get(topic) or await self.topic(topic)
        if meta is None:
            raise KeyError(topic)
        self._mark(meta)
        node = (self.flusher, self.wal, meta.id) if self.flusher is not None else None
        lg = PartitionLog(topic, p, self.cfg, self.store, self.meta, self.cache, self.read_budget,
                          self._on_change, node)
        self._configure(lg, meta)
        claimed = await self._claims.submit(topic, p, None)
        if claimed is not None:
            lg.claimed(*claimed)
        else:
            async with self._claim_slots:
                self._may_open(topic, p)  # still, after waiting for a slot
                if not await self.meta.claim_owner(topic, p, self.cfg.node_id, self.lease):
                    owner = await self.meta.owner_of(topic, p)
                    raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"{topic}/{p} is still owned by broker {owner}")
                await lg.claim()
        await lg.load()
        self.sweeper.sweep(lg, meta.partitions)
        return lg

    def _mark(self, meta: TopicMeta) -> None:
        """Write the topic's marker (its id) when this broker opens its first
        log of it: a reader without etcd then reads no shared segment that a
        deleted topic of the same name left. Once per topic id, in the
        background until it lands (an open does not wait for S3: reading a
        partition needs no write); forgetting the topic stops it."""
        if meta.id not in self._markers:
            body = topic_marker(meta.name, meta.id)
            key = topic_marker_key(self.cfg.namespace, meta.name)
            self._markers[meta.id] = meta.name, asyncio.create_task(
                retry(f"writing {key}", lambda: self.store.put(key, body, if_none_match=False)),
                name=f"marker of {meta.name}")

    async def release_partition(self, topic: str, p: int, lg: PartitionLog, drain_s: float = 10) -> None:
        self.logs.pop((topic, p), None)
        await lg.close(drain_s=drain_s)
        if self.flusher is not None:
            try:  # no node object in flight may still hold its batches when another broker claims it
                async with asyncio.timeout(drain_s):  # no task a partition (wait_for's), 10,000 at a stop
                    await self.flusher.settled(lg)
                    if await lg.release_fence(self._hand_over):
                        return  # the owner key went with the fence
            except Exception as exc:  # still ours until our lease expires, or the next owner's claim fences us
                log.warning("%s/%d: not handed over (%r)", topic, p, exc)
                return
        await self.meta.release_owner(topic, p, self.cfg.node_id)

    def open_soon(self, topic: str, p: int) -> None:
        """Start opening a partition that is neither open nor opening, without
        waiting for it; whoever needs it awaits partition_log, which joins the
        open under way (a failed open is reported there, and tried again).
        One this broker may not open now (it is shutting down, or the
        partition belongs elsewhere) starts nothing: partition_log refuses it.
        A task per refused partition and request, each only to raise, flooded
        the event loop while a stopping broker's producers retried 100
        partitions: its stop waited seconds behind them."""
        if self.is_open(topic, p) or TopicPartition(topic, p) in self._opening:
            return
        try:
            self._may_open(topic, p)
        except LogError:
            return
        task = asyncio.ensure_future(self.partition_log(topic, p))
        self._open_tasks.add(task)
        task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Future[PartitionLog]) -> None:
        self._open_tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: partition_log's next caller reports it

    def open_log(self, topic: str, p: int) -> PartitionLog | None:
        """The partition's log if it is open here (partition_log opens it)."""
        lg = self.logs.get((topic, p))
        return lg if lg is not None and not lg.closed else None

    def is_open(self, topic: str, p: int) -> bool:
        return self.open_log(topic, p) is not None

    def log_bytes(self, topic: str, p: int, committed: dict[TopicPartition, int]) -> int:
        """Bytes of a partition's log: its segments and slices when open here, else
        what `committed` (the manifests in etcd) says."""
        lg = self.logs.get(TopicPartition(topic, p))
        return sum(m.size for m in lg.segments) if lg is not None else committed.get(TopicPartition(topic, p), 0)

    def high_watermark(self, topic: str, p: int) -> int | None:
        """The high watermark of a partition open here, else None."""
        lg = self.logs.get((topic, p))
        return None if lg is None else lg.hw

    async def hand_over_misplaced(self) -> None:
        """Release (after flushing) the partitions another broker should have
        now. A log found placed here stays so until the membership changes,
        so a pass asks only about the others (asking about every open log each
        pass was an eighth of the CPU of a log process with 10,000 idle
        partitions, a third once the compaction check and the collector no
        longer walked them all)."""
        if self._placed_at != self.cluster.generation:
            self._placed_here, self._placed_at = {}, self.cluster.generation
        elif len(self._placed_here) > len(self.logs):  # closed ones linger: keep the open ones
            self._placed_here = {lg: None for lg in self.logs.values() if lg in self._placed_here}
        placed = self._placed_here
        async for logs in in_turns([item for item in self.logs.items() if item[1] not in placed]):
            going = []
            for (topic, p), lg in logs:
                desired = self.cluster.desired_owner(topic, p)
                if desired == self.cfg.node_id:
                    placed[lg] = None
                elif self.logs.get((topic, p)) is lg:
                    log.info("handing %s/%d over to broker %d", topic, p, desired)
                    going.append(((topic, p), lg))
            await self._release_all(going)  # together: their hand-overs share transactions

    async def _release_all(self, logs: list[tuple[TopicPartition, PartitionLog]], drain_s: float = 10) -> None:
        results = await asyncio.gather(*(self.release_partition(t, p, lg, drain_s) for (t, p), lg in logs),
                                       return_exceptions=True)
        for exc in results:
            if isinstance(exc, BaseException):
                log.warning("handing a partition over failed (its lease expiry hands it over): %r", exc)

    async def drop_all(self, new_lease: Any) -> None:
        """Our lease expired (we were paused or cut off): whatever we owned may
        have a new owner already. Close it all; commits would be fenced anyway."""
        log.warning("etcd lease lost: dropping %d partitions", len(self.logs))
        if self.flusher is not None:  # our fence went with the lease
            async with self._refence_lock:
                await self._refence(new_lease)
            return
        logs, self.logs = list(self.logs.values()), {}
        await asyncio.gather(*(lg.close() for lg in logs))
        self.lease = new_lease

    async def close(self, drain_s: float = 10) -> None:
        """Flush what producers are waiting on (up to drain_s) and release the
        partitions so other brokers take over at once. From the first moment
        no partition is opened here any more (requests get
        NOT_LEADER_OR_FOLLOWER), so what is handed over stays handed over."""
        self.closing = True
        await asyncio.gather(*self._opening.values(), return_exceptions=True)  # opened or failed: then released
        await self._release_all(list(self.logs.items()), drain_s)
        await self.sweeper.close()
        for _, task in self._markers.values():  # one still retrying: the next broker to open the topic writes it
            task.cancel()
        if self.flusher is not None:
            await self.flusher.stop()

    # ------------------------------------------------------ background loops
    async def watch_topics(self) -> None:
        """Keep the topic cache current with what any broker changes in etcd
        (partitions added, configs altered, topics deleted). After an etcd
        outage the cache is read afresh, then watched again (MetaStore.follow)."""
        async def read(revision: int) -> None:
            for meta in await self.meta.list_topics(revision):
                await self.apply_topic_meta(meta)

        async def apply(change: tuple[str, TopicMeta | None]) -> None:
            name, meta = change
            if meta is not None:
                await self.apply_topic_meta(meta)
            else:
                await self.forget_topic(name)

        await self.meta.follow(read, self.meta.watch_topics, apply, "topics")

    async def compaction_loop(self) -> None:
        """Node flushes: compact the partitions whose slices are due, oldest
        first, a few compactions at a time, their starts spread out: each
        second starts the due ones' share of half the compaction lag, evenly
        over the second. Partitions opened together fall due together, and
        compacting all at once held every producer's acknowledgement for up to
        400 ms every compaction_lag_ms (100 partitions). Of the partitions
        started together, those whose segments stay small share objects
        (kafscale.storage.shared): one PUT and one transaction for up to
        SHARED_PARTITIONS of them. A partition with few bytes of slices waits
        longer, and the lag is shorter while the cache keeps slices for less
        than three times the configured one (the method compaction_lags).
        A compaction that leaves its partition with a whole segment.bytes of
        slices still waiting (and moved its checkpoint: a failed one waits
        for the next check) checks again at once: one segment a check held
        a partition written faster than segment.bytes a second (16 MiB/s)
        ever further behind, until its slices left the cache and compaction
        read each back with a GET (bench/history.md, session 64)."""
        limit = COMPACTION_MEMORY_SEGMENTS * self.cfg.segment_bytes
        free = [limit]
        freed = asyncio.Condition()
        slots = asyncio.Semaphore(COMPACTIONS_AT_ONCE)
        running: dict[PartitionLog, asyncio.Task[None]] = {}
        assert self.flusher is not None
        sliced = self.flusher.sliced
        behind = asyncio.Event()  # a compaction left a whole segment of slices waiting: check again now

        async def pause(seconds: float) -> None:
            """Until the next check: `seconds`, or less once a compaction is behind."""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(behind.wait(), seconds)
            behind.clear()

        async def compact(logs: list[PartitionLog], shared: bool) -> None:
            """Holds a slot; waits while the memory compactions hold would not fit in `limit` (one always may)."""
            checkpoints = [lg.checkpoint for lg in logs]
            try:
                need = min(2 * sum(compaction_bytes(lg, shared) for lg in logs), limit)
                async with freed:
                    await freed.wait_for(lambda: free[0] >= need)
                    free[0] -= need
                try:
                    await self.compact(logs, shared)
                except Exception as exc:
                    log.warning("compaction of %s failed (tried again later): %r",
                                ", ".join(f"{lg.topic}/{lg.partition}" for lg in logs), exc)
                finally:
                    async with freed:
                        free[0] += need
                        freed.notify_all()
            finally:
                slots.release()
                for lg in logs:
                    del running[lg]
                if any(lg.checkpoint > before and lg.holds_segment() and not lg.closed  # not when it failed
                       for lg, before in zip(logs, checkpoints, strict=True)):
                    behind.set()

        try:
            while True:
                now_ms, (lag_ms, small_lag_ms) = int(time.time() * 1000), self.compaction_lags()
                spread = max(lag_ms / 2000 / COMPACTION_CHECK_S, 1)  # checks to start the due ones in
                due = []
                async for logs in in_turns(list(sliced)):
                    for lg in logs:
                        if lg.closed or not lg.has_slices() or self.logs.get((lg.topic, lg.partition)) is not lg:
                            sliced.pop(lg, None)
                        elif lg not in running and lg.compaction_due(now_ms, lag_ms, small_lag_ms):
                            due.append(lg)
                if not due:
                    await pause(COMPACTION_CHECK_S)
                    continue
                due.sort(key=PartitionLog.oldest_slice_ms)
                await asyncio.sleep(0)
                start = starting(due, spread, self.cfg.shared_compaction)
                if self.cfg.shared_compaction:  # a turn's small ones share objects with their neighbours
                    start.sort(key=layout_order)
                batches = []
                async for logs in in_turns(start, BATCHING_TURN):
                    batches += compaction_batches(logs, self.cfg.shared_compaction)
                for logs, shared in batches:
                    await slots.acquire()
                    if logs := [lg for lg in logs if not lg.closed]:
                        task = asyncio.create_task(compact(logs, shared),
                                                   name=f"compact {logs[0].topic}/{logs[0].partition}")
                        running.update((lg, task) for lg in logs)
                    else:
                        slots.release()
                    await pause(COMPACTION_CHECK_S / len(batches))
        finally:  # the running ones finish (one of a log closed meanwhile commits nothing): one cancelled
            # in its commit left the partition key unknown, and the partition's hand-over then failed
            if running:
                await asyncio.wait(set(running.values()))

    async def compact(self, logs: list[PartitionLog], shared: bool) -> None:
        """One compaction of compaction_batches: these logs' committed slices
        into a shared object, or the one log's into a segment of its own."""
        if shared:
            assert self.flusher is not None
            await compact_shared(logs, self.cfg, self.store, self.meta, self.flusher.fence, next(self._shared_seqs),
                                 self.flusher.topic_id, self.cache)
        else:
            await logs[0].compact()

    def compaction_lags(self) -> tuple[int, int]:
        """How old slices are compacted: compaction_lag_ms, or sooner while the
        cache keeps them for less than 1 / COMPACTION_CACHE_SHARE times that
        (at least a check apart); and how old a partition's slices of fewer
        than SMALL_SLICES_BYTES are compacted: SMALL_LAG_FACTOR times
        compaction_lag_ms, as long as the cache keeps them (at least the
        first). Compaction then reads its slices from memory: at 20,000
        records/s over 100 partitions, 256 MiB held about 6 s of slices and
        compacted segments, and compaction read each slice back with a GET
        of its own (61,401 GETs against 1,113 PUTs)."""
        keeps_ms = self.cache.keeps_s() * 1000 * COMPACTION_CACHE_SHARE
        lag = int(min(self.cfg.compaction_lag_ms, max(keeps_ms, COMPACTION_CHECK_S * 1000)))
        return lag, int(max(lag, min(SMALL_LAG_FACTOR * self.cfg.compaction_lag_ms, keeps_ms)))

    async def collection_loop(self) -> None:
        """Every half compaction_lag_ms, forget the node objects whose slices are
        all compacted (or expired, or of deleted topics) and delete them: on
        one broker of the cluster, the one placement picks for it (every
        broker's pass would read and parse every directory)."""
        every_s = self.cfg.compaction_lag_ms / 2000
        collector = Collector(self.meta, self.store, self.cfg.namespace, spread_s=every_s,
                              delete_delay_s=self.cfg.delete_delay_ms / 1000)
        while True:
            await asyncio.sleep(every_s)
            handed = self.flusher.handed_over() if self.flusher is not None else {}  # taken even if not used
            if not self.cluster.collects():
                continue
            try:
                n = await collector.run(handed)
                if n:
                    log.info("forgot %d node objects (every slice compacted)", n)
            except Exception as exc:
                log.warning("collecting node objects failed: %r", exc)

    async def retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.retention_check_ms / 1000)
            try:
                await self.enforce_retention()
            except Exception as exc:
                log.warning("retention pass failed: %r", exc)

    async def enforce_retention(self) -> int:
        """Apply every topic's retention.ms / retention.bytes to its partitions
        placed on this broker that were ever claimed, RETENTION_TURN of them at
        a time. One never claimed holds no records: opening every partition
        placed here claimed all 10,000 of a topic nobody wrote to a minute
        after it was created, and held the event loop 50 ms a pass."""
        removed = 0
        now_ms = int(time.time() * 1000)
        claimed = await self.meta.claimed_partitions()
        turns = Turns(RETENTION_TURN)
        for meta in await self.meta.list_topics():
            self.topics.put(meta)
            ms = topic_config.value(meta.config, "retention.ms", self.defaults)
            size = topic_config.value(meta.config, "retention.bytes", self.defaults)
            if ms < 0 and size < 0:
                continue
            for p in range(meta.partitions):
                await turns.did()
                if (meta.name, p) in claimed and self.cluster.desired_owner(meta.name, p) == self.cfg.node_id:
                    lg = await self.partition_log(meta.name, p)
                    removed += await lg.apply_retention(ms, size, now_ms)
        return removed


class PartitionApi:
    """Base of the API classes that work on topics and partitions: each is
    given the config, etcd, this registry and the access checks, and names in
    ROUTES the method that answers each of its API keys."""

    ROUTES: dict[int, str] = {}

    def __init__(self, cfg: Config, meta: MetaStore, partitions: PartitionRegistry, access: Access) -> None:
        self.cfg = cfg
        self.meta = meta
        self.partitions = partitions
        self.access = access
        self.handlers: dict[int, Handler] = {key: getattr(self, name) for key, name in self.ROUTES.items()}

    def partition_refusal(self, hdr: RequestContext, op: Operation, topic: str, meta: TopicMeta | None,
                          p: int) -> ErrorCode:
        """Why this client may not do op on partition p of topic (NONE: it may)."""
        if not self.access.allowed(hdr, op, ResourceType.TOPIC, topic):
            return ErrorCode.TOPIC_AUTHORIZATION_FAILED
        if not has_partition(meta, p):
            return ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        return ErrorCode.NONE

    def assignment_error(self, replicas: list[list[int]]) -> str | None:
        """Why a manual replica assignment is refused (None: accepted). Every
        replica list must name live brokers; the placement itself is not
        applied: a partition is owned by the live broker the cluster's hashing
        picks, and S3 holds its one copy."""
        live = set(self.partitions.cluster.brokers)
        for i, ids in enumerate(replicas):
            unknown = sorted(set(ids) - live)
            if not ids or unknown:
                return f"replica list {i} ({ids}) must name live brokers ({sorted(live)})"
        return None


def compaction_bytes(lg: PartitionLog, shared: bool) -> int:
    """What a log's next compaction reads: its slices, and in a shared object
    the segments it merges too (if the transaction leaves room for deleting
    their manifests)."""
    n = lg.compaction_bytes()
    if shared and n <= SHARED_SEGMENT_BYTES:
        n += sum(m.size for m in lg.to_merge(n, SHARED_SEGMENT_BYTES, TXN_MAX_OPS))
    return n


def starting(due: list[PartitionLog], spread: float, shared: bool) -> list[PartitionLog]:
    """Of the due logs (oldest first), those a check starts: their share of the
    spread (>= 1: at most all), and with shared compaction more small ones,
    up to SHARED_GATHER in all."""
    start = due[:math.ceil(len(due) / spread)]
    if shared and len(start) < SHARED_GATHER:
        small = (lg for lg in due[len(start):] if compaction_bytes(lg, True) <= SHARED_SEGMENT_BYTES)
        start += itertools.islice(small, SHARED_GATHER - len(start))
    return start


def compaction_batches(due: list[PartitionLog], shared: bool) -> list[tuple[list[PartitionLog], bool]]:
    """The compactions to start for these due logs (oldest first), each with
    whether it is shared: without shared compaction each alone; with it, a
    log whose segment would be larger than SHARED_SEGMENT_BYTES alone, the
    others in shared objects of about equal size, each of at most
    SHARED_PARTITIONS partitions and about SHARED_OBJECT_BYTES (a group of
    one too: its segment is merged later like the others), each a run of
    neighbouring partitions."""
    out: list[tuple[list[PartitionLog], bool]] = []
    small: list[tuple[PartitionLog, int]] = []
    for lg in due:
        n = compaction_bytes(lg, shared)
        if not shared or n > SHARED_SEGMENT_BYTES:
            out.append(([lg], False))
        else:
            small.append((lg, n))
    small.sort(key=lambda t: layout_order(t[0]))  # neighbours share an object
    groups = max(math.ceil(len(small) / SHARED_PARTITIONS),
                 math.ceil(sum(n for _, n in small) / SHARED_OBJECT_BYTES))
    per = math.ceil(len(small) / groups) if small else 0
    group: list[PartitionLog] = []
    size = 0
    for lg, n in small:
        if group and (len(group) == per or size + n > SHARED_OBJECT_BYTES):
            out.append((group, True))
            group, size = [], 0
        group.append(lg)
        size += n
    if group:
        out.append((group, True))
    return out
