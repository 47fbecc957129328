"""Node flushes: one object per flush cycle for every partition a log process
owns, committed in one etcd transaction whatever the partition count.

The NodeFlusher gathers the queued batches of all its partition logs for
`linger_ms` (sooner once `flush_bytes` are queued or MAX_SLICES partitions
have batches queued; at once while no object is under way, see Linger),
builds each partition's part as a complete .kfs segment (a *slice*), writes
the slices back to back with a directory after them as one node object
(If-None-Match), and commits the directory under `wal/{fence}/{seq}` in one
etcd transaction that compares one key: the log process's fence. Producers
are acknowledged after that commit. Up to MAX_UPLOADS objects upload at
once; they commit in order.

A claim of a partition deletes the fence of the log process that owned it
before (etcd's claim transaction), so no later node object of that process
commits; a fenced flusher fails what it held and its partitions are closed
and reopened (`on_fenced`). Slices are compacted later into per-partition
segments (PartitionLog.compact); `WalIndex` reads the directories back for a
partition's new owner, and `collect` forgets node objects whose slices are
all compacted, deleted or expired. The object format is in docs/segment-format.md."""
from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import json
import logging
import struct
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kafscale import _native, faults, metrics
from kafscale.config import Config
from kafscale.metadata.store import Fenced, MetaStore, PartitionState, SegmentManifest, TopicMeta
from kafscale.protocol.types import TopicPartition
from kafscale.storage.objectstore import ObjectExists, ObjectStore
from kafscale.storage.segment import topic_marker_key

if TYPE_CHECKING:
    from kafscale._native import Pending
    from kafscale.broker.partitions import RecentCache
    from kafscale.storage.partition import PartitionLog

log = logging.getLogger(__name__)
T = TypeVar("T")

NODE_MAGIC = 0x4B46534E  # "KFSN"
NODE_TRAILER = struct.Struct(">II")  # directory length, magic
MAX_SLICES = 1000  # partitions in one node object (bounds the directory kept in etcd)
MAX_UPLOADS = 4  # node objects uploading at once
MAX_UNCOMMITTED = 8  # node objects built and not yet committed (bounds their memory); also the most one
# transaction commits
# directory bytes one transaction commits at most (one directory always goes): etcd refuses a request
# over 1.5 MiB, and a directory of MAX_SLICES slices is about 70 KB (300 KB and more when each is of another
# topic with a long name)
COMMIT_BYTES = 1 << 20
# objects in one DeleteObjects request of a collector pass; a pass's requests are spread over the time to the
# next one. SeaweedFS spends about 1 ms of CPU on each object deleted: the 350 node objects a pass forgets at
# 100 partitions took it 0.3-0.4 s of a core at once, with the node flushes' PUTs waiting meanwhile
DELETE_BATCH = 25
COMMITTED_TURN = 64  # slices of committed node objects handed to their logs before other work runs
PARSE_TURN_BYTES = 16 << 10  # directory JSON parsed before other work runs (64 KiB held the loop 5-9 ms here)
# slices of the directories a collector pass checks or counts before other work runs (1.5-4 ms here): a turn
# every 50 directories held the event loop for 79 ms when each held MAX_SLICES slices (10,000 partitions and
# more), and the shared objects' ranges were counted with no turn at all; bench/history.md, session 69
COLLECT_TURN = 1000
# node object summaries a flusher keeps for its broker's collector (NodeFlusher.handed_over) at most: it
# takes them every half compaction_lag_ms (about 60 objects at 20,000 records/s over 1,000 partitions)
HANDED_MAX = 1024
ORPHAN_AGE_S = 600.0  # an object no directory names is an orphan once this old (uploaded, never committed)


def node_prefix(namespace: str) -> str:
    """Where node objects live: '~' is in no topic name, so no topic's prefix holds them."""
    return f"{namespace}/~node/"


def node_key(namespace: str, fence: str, seq: int) -> str:
    return f"{node_prefix(namespace)}{fence}/{seq:012d}.kfn"


def shared_prefix(namespace: str) -> str:
    """Where shared segment objects live (kafscale.storage.shared)."""
    return f"{namespace}/~shared/"


def shared_key(namespace: str, fence: str, seq: int) -> str:
    return f"{shared_prefix(namespace)}{fence}/{seq:012d}.kfn"


@dataclass(slots=True)
class Slice:
    """One partition's part of a node object or of a shared segment object:
    its segment's manifest (naming the object and the slice's position) and,
    in a node object, the batches waiting for it (a shared object's segment
    is compacted from committed slices: none wait for it)."""
    log: PartitionLog
    manifest: SegmentManifest
    items: list[Pending]


_dumps = functools.partial(json.dumps, separators=(",", ":"))


def directory(key: str, created_ms: int, slices: list[Slice], topic_ids: dict[str, bytes]) -> bytes:
    """The object's directory (JSON, also its etcd value; the layout is in
    docs/segment-format.md): its topics once each, then a row per slice
    naming its topic by place. directory_slices reads it back. A row is an
    array, not an object with a key per field: an entry repeated its topic's
    name and id and eleven field names, about 200 bytes a slice against 70,
    and etcd's write-ahead log took every byte of it at every node commit
    (bench/history.md, session 56). The rows are written natively
    (_native.directory_rows; a node flush's by _native.assemble_node)."""
    places: dict[str, int] = {}
    rows = _native.directory_rows(slices, places, _dumps)
    return wrap_rows(key, created_ms, places, rows, topic_ids)


def wrap_rows(key: str, created_ms: int, places: dict[str, int], rows: bytes | bytearray,
              topic_ids: dict[str, bytes]) -> bytes:
    """A directory of its rows (directory), their topics in place order."""
    topics = ",".join(f'[{_dumps(t)},"{topic_ids[t].hex()}"]' for t in places)
    return b"".join((f'{{"key":{_dumps(key)},"created_ms":{created_ms},"topics":[{topics}],"slices":['.encode(),
                     rows, b"]}"))


# A directory's slice: topic, topic id hex, partition, base, last, count, pos, size, min_ts, max_ts, producers
DirectorySlice = tuple[str, str, int, int, int, int, int, int, int, int, dict[str, Any]]
_ENTRY_FIELDS = ("topic", "topic_id", "partition", "base", "last", "count", "pos", "size", "min_ts", "max_ts",
                 "producers")


def directory_slices(d: dict[str, Any]) -> list[DirectorySlice]:
    """A parsed directory's slices, in the order they are stored. Directories
    written before rows (an object per slice, without "topics") are read too:
    a broker upgraded while node objects are not compacted yet finds them."""
    topics = d.get("topics")
    if topics is None:
        return [tuple(s[f] for f in _ENTRY_FIELDS) for s in d["slices"]]  # type: ignore[misc]
    return [(*topics[r[0]], *r[1:9], r[9] if len(r) > 9 else {}) for r in d["slices"]]


def layout_order(lg: PartitionLog) -> tuple[str, int]:
    """The order of partitions' slices in a node object, and of the neighbours
    a shared compaction takes: its slices of each node object then lie side
    by side, one ranged GET an object when they must be read back from S3
    (shared.SliceReads)."""
    return lg.topic, lg.partition


# A node object uploaded, waiting for its commit: its directory, its slices, the
# object, its key and its slices' entries for the cache (RecentCache.put_object), its
# summary for this broker's collector (NodeFlusher.handed_over), and the future
# its flush waits on
_Uploaded = tuple[bytes, list[Slice], tuple[memoryview, str, tuple[bytes, bytes]], "Summary",
                  asyncio.Future[None]]


def seal(body: bytearray, dir_raw: bytes) -> bytearray:
    """A node object (or shared segment object): body (its slices back to
    back) with the directory and the trailer appended."""
    body += dir_raw
    body += NODE_TRAILER.pack(len(dir_raw), NODE_MAGIC)
    return body


async def upload(store: ObjectStore, key: str, body: bytearray, timeout_s: float) -> None:
    """Upload an object under a key of our fence (If-None-Match), each attempt
    at most timeout_s, until it is there (retry): one that exists with this
    size is our own earlier attempt whose reply was lost."""
    async def put_once() -> None:
        try:
            await store.put(key, body)
        except ObjectExists:
            if await store.size(key) != len(body):
                raise Fenced(f"{key} exists with other content") from None

    await retry(f"upload of {key}", lambda: asyncio.wait_for(put_once(), timeout_s))


def node_directory(data: bytes | bytearray) -> dict[str, Any]:
    """The directory of a whole node object (from its trailer)."""
    n, magic = NODE_TRAILER.unpack_from(data, len(data) - NODE_TRAILER.size)
    if magic != NODE_MAGIC:
        raise ValueError(f"not a node object (magic {magic:#x})")
    return dict(json.loads(bytes(data[len(data) - NODE_TRAILER.size - n:len(data) - NODE_TRAILER.size])))


async def read_node_directory(store: ObjectStore, key: str, size: int) -> dict[str, Any]:
    """The directory of a node object in S3, with two ranged GETs (trailer, then directory)."""
    n, magic = NODE_TRAILER.unpack(await store.get(key, size - NODE_TRAILER.size, size))
    if magic != NODE_MAGIC:
        raise ValueError(f"{key} is not a node object (magic {magic:#x})")
    return dict(json.loads(await store.get(key, size - NODE_TRAILER.size - n, size - NODE_TRAILER.size)))


def slice_manifests(raw: bytes) -> tuple[str, list[tuple[str, str, int, SegmentManifest]]]:
    """A directory's object key and its slices as (topic, topic id hex, partition, manifest)."""
    d = json.loads(raw)
    key, created = d["key"], d["created_ms"]
    return key, [(topic, tid, p, SegmentManifest(base, last, count, size, min_ts, max_ts, key, created, producers,
                                                 pos))
                 for topic, tid, p, base, last, count, pos, size, min_ts, max_ts, producers in directory_slices(d)]


def by_partition(directories: list[bytes]) -> dict[tuple[str, int], list[SegmentManifest]]:
    """The slices of these directories per (topic id hex, partition), oldest first."""
    out: dict[tuple[str, int], list[SegmentManifest]] = {}
    for raw in directories:
        for _, tid, p, m in slice_manifests(raw)[1]:
            out.setdefault((tid, p), []).append(m)
    for found in out.values():
        found.sort(key=lambda m: m.base)
    return out


def topic_marker(topic: str, topic_id: bytes) -> bytes:
    """The body of a topic's marker object (segment.topic_marker_key)."""
    return json.dumps({"topic": topic, "id": topic_id.hex()}).encode()


async def marker_topic_id(store: ObjectStore, namespace: str, topic: str) -> str | None:
    """The topic id (hex) the topic's marker names; None without a marker
    (a topic no broker has opened since markers were written, or deleted)."""
    marker = topic_marker_key(namespace, topic)
    if not [o for o in await store.list(marker) if o["Key"] == marker]:
        return None
    return str(json.loads(await store.get(marker))["id"])


def of_topic(s: DirectorySlice, topic: str, topic_id: str | None) -> bool:
    """Whether a node or shared object's directory slice is of this topic
    (of its id too, where the marker names one)."""
    return s[0] == topic and topic_id in (None, s[1])


async def read_directories(meta: MetaStore, known: dict[bytes, T], parse: Callable[[bytes], T], area: str = "wal"
                           ) -> dict[bytes, T]:
    """The committed directories of an area ("wal": node objects, "shared":
    shared segment objects) now, by key, each as parse makes it: those in
    known are kept as they are (a directory never changes), only the new ones
    are read and parsed."""
    keys = await meta.wal_keys(area)
    new = await meta.wal_directories_of([k for k in keys if k not in known], area)
    out = {k: known[k] for k in keys if k in known}
    turns = Turns(PARSE_TURN_BYTES)  # a hundred directories at a time held the event loop for 10 ms
    for k in keys:
        if k in new:
            out[k] = parse(new[k])
            await turns.did(len(new[k]))
    return out


class Linger:
    """When a flush loop cuts an object (or a segment) of its queued batches:
    at once while nothing cut before is uploading or committing; behind an
    object under way, once the oldest queued batch has waited linger_ms, so
    that the batches behind it go along. With nothing under way there is
    nothing to wait for but more batches, and a client that waits for each
    acknowledgement before it sends again (a lone record, a synchronous
    producer) sends none meanwhile: waiting added the broker's linger to the
    client's own. Cutting every linger_ms from the last cut instead wrote
    about a fifth more objects under steady load at 100 and 1,000
    partitions, and their acknowledgements' p99 rose by a quarter; going at
    once after a gap of linger_ms even with objects under way cut the first
    batch of librdkafka's bursts alone (bench/history.md, session 30); also
    cutting the batches behind an object as soon as it committed wrote 1.3
    to 1.6 times the objects at 100 partitions for no clear gain in the ack
    p99 (session 34)."""

    __slots__ = ("first_at",)

    def __init__(self) -> None:
        self.first_at = 0.0  # time.monotonic() when the oldest queued batch was queued

    def queued(self) -> None:
        """A batch came to an empty queue."""
        self.first_at = time.monotonic()

    def cut(self) -> None:
        """The queued batches were taken (what is left counts from now)."""
        self.first_at = time.monotonic()

    def wait(self, linger_ms: int, idle: bool) -> float:
        """Seconds to wait before the next cut; idle: nothing cut before is
        uploading or committing."""
        return 0.0 if idle else self.first_at + linger_ms / 1000 - time.monotonic()


class Turns:
    """Lets other work run each time `size` units of work (slices, bytes) were
    done since it last did: a pass that goes through much in one go holds
    every acknowledgement waiting on the event loop."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.done = 0

    async def did(self, n: int = 1) -> None:
        if self.due(n):
            await asyncio.sleep(0)

    def due(self, n: int = 1) -> bool:
        """did() for a loop that lets other work run itself when this says so
        (`await asyncio.sleep(0)`): no coroutine made and awaited each unit
        (the produce path's loops go through one a partition batch)."""
        self.done += n
        if self.done < self.size:
            return False
        self.done = 0
        return True


async def in_turns(items: list[T], n: int = 1000) -> AsyncIterator[list[T]]:
    """items n at a time, letting the event loop run other work between: a
    broker's periodic passes over every partition or directory (a thousand
    directories parsed, 10,000 partitions checked) held every acknowledgement
    for tens of ms in one go."""
    for i in range(0, len(items), n):
        yield items[i:i + n]
        await asyncio.sleep(0)


def continuing(slices: list[SegmentManifest], hw: int, what: str) -> list[SegmentManifest]:
    """The slices (oldest first) that continue a log whose compacted segments end at hw."""
    out = []
    for m in slices:
        if m.last < hw:
            continue  # compacted already
        if m.base != hw:
            log.error("%s: node object slice %s starts at %d, expected %d: later slices ignored", what, m.ref,
                      m.base, hw)
            break
        out.append(m)
        hw = m.last + 1
    return out


async def committed_watermarks(meta: MetaStore, topics: list[TopicMeta]
                               ) -> dict[TopicPartition, tuple[int, int, int]]:
    """(high watermark, log start offset, slices not compacted yet) of every
    partition of these topics, as committed: its checkpoint in etcd, moved past
    the node object slices that continue it (what a broker that opened it would serve)."""
    states = await meta.partition_states()
    tails = by_partition([raw for _, raw in await meta.wal_directories()])
    out = {}
    for t in topics:
        for p in range(t.partitions):
            hw, start = PartitionState.watermarks(states.get(TopicPartition(t.name, p)))
            tail = continuing(tails.get((t.id.hex(), p), []), hw, f"{t.name}/{p}")
            out[TopicPartition(t.name, p)] = (tail[-1].last + 1 if tail else hw, start, len(tail))
    return out


class NodeFlusher:
    def __init__(self, cfg: Config, store: ObjectStore, meta: MetaStore, cache: RecentCache,
                 topic_id: Callable[[str], bytes | None], on_fenced: Callable[[str], Awaitable[None]]) -> None:
        """cache: where committed slices go (the cache of every log this flusher flushes)."""
        self.cfg = cfg
        self.store = store
        self.meta = meta
        self.cache = cache
        self.topic_id = topic_id
        self.on_fenced = on_fenced
        self.fence = ""
        self.seq = 0
        self.queued: dict[PartitionLog, None] = {}  # logs with batches queued, in the order they queued them
        # logs that got committed slices (the compaction loop looks at these only, and drops those with
        # none left: at 10,000 idle partitions, checking every open log each second cost the log process
        # a sixth of its CPU; bench/history.md)
        self.sliced: dict[PartitionLog, None] = {}
        self.queued_bytes = 0
        self._linger = Linger()
        self._wake = asyncio.Event()
        self._uploads = asyncio.Semaphore(MAX_UPLOADS)
        self._uncommitted = asyncio.Semaphore(MAX_UNCOMMITTED)
        self._flushes: dict[asyncio.Task[None], set[PartitionLog]] = {}  # node objects under way, their logs
        self._uploaded: dict[int, _Uploaded] = {}  # uploaded node objects of this fence waiting for their commit
        self._committed = 0  # the last seq committed under this fence
        self._failed: BaseException | None = None  # a commit of this fence failed: no later one commits
        self._committer: asyncio.Task[None] | None = None
        self._loop: asyncio.Task[None] | None = None
        # the summaries of the node objects committed since the collector last took them (handed_over): the
        # collector of this broker need not read and parse their directories back from etcd (that was two
        # thirds of its time at 20,000 records/s over 1,000 partitions; bench/history.md, session 95)
        self._summaries: dict[bytes, Summary] = {}

    async def start(self, lease: Any) -> None:
        """Take a new fence on our lease: objects of an earlier fence never commit after this."""
        self.fence = f"{self.cfg.node_id}-{uuid.uuid4().hex[:12]}"
        self.seq = self._committed = 0
        self._uploaded, self._failed = {}, None  # what the earlier fence had in flight is over (stop cancelled it)
        await self.meta.create_fence(self.fence, lease)
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="node flush")

    async def stop(self) -> None:
        """Stop flushing; no object commits after this (the fence goes first)."""
        tasks = [t for t in (self._loop, self._committer, *self._flushes) if t is not None]
        self.queued, self.queued_bytes = {}, 0
        self._loop = None
        try:
            await self.meta.delete_fence(self.fence)
        except Exception as exc:  # the lease's expiry deletes it
            log.warning("deleting fence %s failed: %r", self.fence, exc)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def handed_over(self) -> dict[bytes, Summary]:
        """The summaries of the node objects committed since the last call, by directory key."""
        summaries, self._summaries = self._summaries, {}
        return summaries

    def notify(self, lg: PartitionLog, n: int) -> None:
        """A log queued n more bytes."""
        if not self.queued:  # else the flush loop is awake already (_take clears it only with nothing queued)
            self._wake.set()
        if not self.queued_bytes:
            self._linger.queued()
        self.queued[lg] = None
        self.queued_bytes += n

    async def settled(self, lg: PartitionLog) -> None:
        """Wait until no object being flushed holds data of lg (committed or failed)."""
        while holding := [t for t, logs in self._flushes.items() if lg in logs]:
            await asyncio.wait(holding)

    def _take(self) -> list[tuple[PartitionLog, list[Pending]]]:
        """Queued batches of up to MAX_SLICES partitions and about flush_bytes, in queue order."""
        limit, taken, size = self.cfg.flush_bytes, [], 0
        for lg in list(self.queued):
            if len(taken) >= MAX_SLICES or (taken and size >= limit):
                break
            if lg.fence != self.fence:  # opened under an earlier fence: its claim does not fence us
                del self.queued[lg]
                lg.flush_failed()
                continue
            items, n = lg.take(limit - size)
            if not lg.has_queued():
                del self.queued[lg]
            if items:
                taken.append((lg, items))
                size += n
        self.queued_bytes = max(self.queued_bytes - size, 0) if self.queued else 0
        self._linger.cut()
        if not self.queued:
            self._wake.clear()
        return taken

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            # an object's worth of partitions queued goes at once: at 20,000 records/s over 10,000 partitions
            # Sarama's requests (about 900 partitions each, several in flight) queued more than MAX_SLICES, and
            # each object after the first waited a linger (ack p50 516 -> 90 ms, p99 1,488 -> 799 ms: medians of
            # three alternating runs; later single runs with it swung 353-1,532 ms p99; bench/README.md, session 99)
            if self.queued_bytes < self.cfg.flush_bytes and len(self.queued) < MAX_SLICES:
                wait = self._linger.wait(self.cfg.linger_ms, not self._flushes)
                if wait > 0:
                    await asyncio.sleep(wait)
            await self._uncommitted.acquire()
            await self._uploads.acquire()
            queued_at = self._linger.first_at
            taken = self._take()
            if not taken:
                self._uploads.release()
                self._uncommitted.release()
                continue
            self.seq += 1
            task = asyncio.create_task(self._flush(taken, self.seq, queued_at), name=f"node flush {self.seq}")
            self._flushes[task] = {lg for lg, _ in taken}
            task.add_done_callback(functools.partial(self._done, self.fence))

    def _done(self, fence: str, task: asyncio.Task[None]) -> None:
        logs = self._flushes.pop(task)
        self._uncommitted.release()
        exc = None if task.cancelled() else task.exception()
        if exc is not None:  # fenced (or a bug): what it held never commits, nor anything queued after it
            log.log(logging.WARNING if isinstance(exc, Fenced) else logging.ERROR, "node flush failed: %r", exc,
                    exc_info=not isinstance(exc, Fenced))
            for lg in logs:
                lg.flush_failed()
            asyncio.get_running_loop().create_task(self.on_fenced(fence))

    async def _flush(self, taken: list[tuple[PartitionLog, list[Pending]]], seq: int, queued_at: float) -> None:
        """Build and upload node object seq, then wait for its commit (in seq
        order, possibly in one transaction with the objects uploaded while an
        earlier commit was under way). queued_at: time.monotonic() when its
        oldest batch was queued (metrics.NODE_FLUSH_SECONDS)."""
        stage = functools.partial(metrics.NODE_FLUSH_SECONDS.labels, metrics.node())
        created = int(time.time() * 1000)
        key = node_key(self.cfg.namespace, self.fence, seq)
        try:  # holds an upload slot (taken by _run) until the upload ends
            stage("queued").observe(time.monotonic() - queued_at)
            if self._failed is not None:
                raise self._failed
            taken.sort(key=lambda t: layout_order(t[0]))
            places: dict[str, int] = {}
            # slices, their entries for the cache (put_object) and their directory rows, in one native call
            body, slices, cached, rows, summed = _native.assemble_node(taken, created, key, places, SegmentManifest,
                                                                       Slice, _dumps)
            ids: dict[str, bytes] = {}
            for topic in places:
                if (tid := self.topic_id(topic)) is None:
                    raise Fenced(f"topic {topic} was deleted")
                ids[topic] = tid
            dir_raw = wrap_rows(key, created, places, rows, ids)
            summarized: Summary = key, False, tuple((t, tid.hex()) for t, tid in ids.items()), summed
            body = seal(body, dir_raw)
            metrics.FLUSH_BYTES.labels(metrics.node()).observe(len(body))
            faults.reached("before-upload")
            started = time.monotonic()
            await upload(self.store, key, body, self.cfg.s3_timeout_s)
            uploaded_at = time.monotonic()
            stage("upload").observe(uploaded_at - started)
            faults.reached("after-upload")
        except Exception as exc:
            self._fail(exc)
            raise
        finally:
            self._uploads.release()
        if self._failed is not None:
            raise self._failed
        committed = asyncio.get_running_loop().create_future()
        self._uploaded[seq] = (dir_raw, slices, (memoryview(body), key, cached), summarized, committed)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_uploaded(), name="node commit")
        await committed
        acked_at = time.monotonic()
        stage("commit").observe(acked_at - uploaded_at)
        stage("durable").observe(acked_at - queued_at)

    async def _commit_uploaded(self) -> None:
        """Commit the uploaded objects that continue the committed ones, in seq
        order: those uploaded by then in one transaction, then the next ones.
        Producers are acknowledged (the slices handed to their logs) after it;
        a failed commit fails every object of this fence after it too."""
        fence = self.fence
        while self.fence == fence and (first := self._committed + 1) in self._uploaded:
            group, size = [], 0
            while (seq := first + len(group)) in self._uploaded and len(group) < MAX_UNCOMMITTED:
                size += len(self._uploaded[seq][0])
                if group and size > COMMIT_BYTES:
                    break
                group.append((seq, self._uploaded.pop(seq)))
            keys = f"{node_key(self.cfg.namespace, fence, first)}..{group[-1][0]}"

            async def commit(group: list[tuple[int, _Uploaded]] = group
                             ) -> None:
                await faults.delay("before-commit")
                t = time.perf_counter()
                await self.meta.commit_wal(fence, [(seq, raw) for seq, (raw, *_) in group])
                metrics.ETCD_SECONDS.labels(metrics.node()).observe(time.perf_counter() - t)

            try:
                await retry(f"commit of {keys}", commit)
            except Exception as exc:
                for _, (*_, fut) in group:
                    fut.set_exception(exc)
                self._fail(exc)
                return
            faults.reached("after-commit")
            self._committed = group[-1][0]
            for seq, (_, slices, (body, key, cached), summarized, fut) in group:
                self._summaries[self.meta.wal_key(fence, seq)] = summarized
                if len(self._summaries) > HANDED_MAX:  # nobody takes them: the oldest go (read back if needed)
                    del self._summaries[next(iter(self._summaries))]
                try:
                    self.cache.put_object(key, body, cached)
                    for i in range(0, len(slices), COMMITTED_TURN):
                        if i:  # the acknowledgements so far go out first
                            await asyncio.sleep(0)
                        for s in slices[i:i + COMMITTED_TURN]:
                            s.log.committed(s.manifest, s.items)
                except Exception as exc:  # a bug: the flush fails (and the node re-fences), never hangs
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)

    def _fail(self, exc: Exception) -> None:
        """A node object of this fence failed: none after it commits (their
        records would follow a gap); the uploaded ones fail now, later ones
        as they finish."""
        if self._failed is None:
            self._failed = Fenced(f"an earlier node object failed: {exc!r}")
        for *_, fut in self._uploaded.values():
            if not fut.done():
                fut.set_exception(self._failed)
        self._uploaded.clear()


async def retry(what: str, step: Callable[[], Awaitable[None]]) -> None:
    """Run step until it succeeds: S3 or etcd being down keeps the data queued
    (and producers waiting), never drops it. Fenced is final."""
    delay = 0.05
    while True:
        try:
            return await step()
        except Fenced:
            raise
        except Exception as exc:
            log.warning("%s failed (%s); retrying in %.2fs", what,
                        repr(exc) if isinstance(exc, TimeoutError) else exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class WalIndex:
    """The slices of committed node objects per partition, read from etcd by
    scans that partition claims share: a claim waits for a scan that began
    after it, so it sees every node object committed before it. Scans run one
    at a time, each reading only the directories that are new since the last
    one and updating the slices per partition with them (regrouping every
    slice at every scan took a seventh of the log process's time while it
    reopened 10,000 partitions). While one runs, the claims that need a later
    one all wait for the same next scan, which has not begun yet."""

    def __init__(self, meta: MetaStore) -> None:
        self.meta = meta
        self._scan: asyncio.Future[None] | None = None  # the latest scan
        self._began: float | None = 0.0  # when the latest scan began reading; None: not yet
        self._one_at_a_time = asyncio.Lock()
        self._parsed: dict[bytes, list[tuple[str, str, int, SegmentManifest]]] = {}  # wal key -> its slices
        self._slices: dict[tuple[str, int], list[SegmentManifest]] = {}  # (topic id hex, partition) -> oldest first

    async def slices(self, topic_id: bytes, partition: int, claimed_at: float) -> list[SegmentManifest]:
        """The partition's slices (oldest first) from a scan that began after claimed_at (time.monotonic())."""
        if self._scan is None or (self._began is not None and self._began <= claimed_at):
            self._began = None
            self._scan = asyncio.ensure_future(self._read())
        await asyncio.shield(self._scan)
        return list(self._slices.get((topic_id.hex(), partition), []))

    async def _read(self) -> None:
        async with self._one_at_a_time:
            self._began = time.monotonic()
            parsed = await read_directories(self.meta, self._parsed, lambda raw: slice_manifests(raw)[1])
            forgotten = [self._parsed[k] for k in self._parsed.keys() - parsed.keys()]  # compacted since
            gone = {m.key for slices in forgotten for *_, m in slices}
            for tp in {(tid, p) for slices in forgotten for _, tid, p, _ in slices}:
                if kept := [m for m in self._slices[tp] if m.key not in gone]:
                    self._slices[tp] = kept
                else:
                    del self._slices[tp]
            for k in parsed.keys() - self._parsed.keys():
                for _, tid, p, m in parsed[k]:
                    bisect.insort(self._slices.setdefault((tid, p), []), m, key=lambda x: x.base)
            self._parsed = parsed


Summary = tuple[str, bool, tuple[tuple[str, str], ...], bytes]
SUMMARY_ROW = 4  # 8-byte integers a slice in a summary: its topic's place, partition, base and last offset


def summary(key: str, shared: bool, slices: Iterable[tuple[str, str, int, int, int]]) -> Summary:
    """A directory as the collector keeps it: the object's key, whether it is
    a shared segment object, its topics (name, id hex), and per slice of
    (topic, topic id hex, partition, base, last offset) the topic's place
    among them, the partition and the offsets as 8-byte integers. Its slices
    are one bytes object, no objects of Python's cyclic collector: a tuple
    each (one per slice, kept for the compaction lag) were a third of what
    each young collection of the log process went through (bench/history.md)."""
    topics: dict[tuple[str, str], int] = {}
    rows = array("q")
    for topic, tid, p, base, last in slices:
        rows.extend((topics.setdefault((topic, tid), len(topics)), p, base, last))
    return key, shared, tuple(topics), rows.tobytes()


def summary_size(s: Summary) -> int:
    """How many slices a summary holds."""
    return len(s[3]) // (8 * SUMMARY_ROW)


def summary_slices(s: Summary, start: int = 0) -> Iterator[tuple[str, str, int, int, int]]:
    """A summary's slices from the start-th on, as (topic, topic id hex, partition, base, last offset)."""
    rows = memoryview(s[3]).cast("q")
    for i in range(start * SUMMARY_ROW, len(rows), SUMMARY_ROW):
        yield (*s[2][rows[i]], rows[i + 1], rows[i + 2], rows[i + 3])


def _summary(raw: bytes, shared: bool) -> Summary:
    """A directory's summary. A row's first elements are the summary's own
    (its topic's place among the directory's topics, partition, base, last
    offset), so they are taken as they are: a tuple a slice through
    directory_slices and summary cost 1.37 us a slice of a 1,000-row
    directory, this 0.89 (json.loads alone 0.66; bench/history.md, session 91)."""
    d = json.loads(raw)
    topics = d.get("topics")
    if topics is None:  # written before rows: an object per slice
        return summary(d["key"], shared, (s[:5] for s in directory_slices(d)))
    rows = array("q", itertools.chain.from_iterable(r[:SUMMARY_ROW] for r in d["slices"]))
    return d["key"], shared, tuple(map(tuple, topics)), rows.tobytes()


def _floor(marks: dict[int, tuple[int, int]] | None) -> np.ndarray | None:
    """A topic's (high watermark, log start) marks by partition as what a node
    object's slice must end below to be done with (_done_rows): the larger
    of the two, INT64_MAX for a partition without a mark (not claimed: its
    topic is gone); None for a topic gone or not the one the slices name."""
    if marks is None:
        return None
    floor = np.full(max(marks, default=-1) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    floor[np.fromiter(marks, np.int64, len(marks))] = np.fromiter(map(max, marks.values()), np.int64, len(marks))
    return floor


def _done_rows(s: Summary, start: int, floors: list[np.ndarray | None]) -> int:
    """How many of a node object's summarized slices from the start-th on, in
    a row, are done with: each slice's last offset is below its partition's
    floor (_floor, by the summary's topic places; None: all of that topic's
    are done). One array operation for all of them: a call a slice took a
    twentieth of the log process's event-loop thread at 20,000 records/s
    over 1,000 partitions (bench/history.md, session 95)."""
    rows = np.frombuffer(s[3], dtype=np.int64).reshape(-1, SUMMARY_ROW)[start:]
    done = np.ones(len(rows), dtype=bool)
    for place, floor in enumerate(floors):
        if floor is None:
            continue
        mine = slice(None) if len(floors) == 1 else rows[:, 0] == place
        p, last = rows[mine, 1], rows[mine, 3]
        has_mark = p < len(floor)
        below = np.ones(len(p), dtype=bool)
        below[has_mark] = floor[p[has_mark]] > last[has_mark]
        done[mine] = below
    return len(rows) if done.all() else int(done.argmin())


def merged_away(ranges: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """Of one partition's segment ranges (base, last) in shared segment
    objects, those a segment of a larger range covers: a compaction merged
    them into it (a partition's offsets only move forward, so the larger one
    is the later)."""
    out = set()
    reach = -1  # the furthest last offset of the segments with a lower base
    for base, group in itertools.groupby(sorted(ranges, key=lambda r: (r[0], -r[1])), key=lambda r: r[0]):
        lasts = [last for _, last in group]
        out.update((base, last) for last in lasts if last <= reach or last < lasts[0])
        reach = max(reach, lasts[0])
    return out


class SharedRanges:
    """The segment ranges of the shared segment objects a collector has seen,
    per (topic id hex, partition), and which of them are merged away. Kept
    up to date directory by directory: working them out again over every
    directory held the event loop for 100-190 ms every pass at 10,000
    partitions (about 2,000 shared objects of 42 segments each)."""

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, int], dict[tuple[int, int], int]] = {}  # range -> directories naming it
        self._merged: dict[tuple[str, int], set[tuple[int, int]]] = {}
        self._changed: set[tuple[str, int]] = set()

    def add(self, summary: Summary, n: int = 1) -> None:
        for _, tid, p, base, last in summary_slices(summary) if summary[1] else ():
            found = self._ranges.setdefault((tid, p), {})
            if count := found.get((base, last), 0) + n:
                found[(base, last)] = count
            else:
                del found[(base, last)]
                if not found:
                    del self._ranges[(tid, p)]
            self._changed.add((tid, p))

    def remove(self, summary: Summary) -> None:
        self.add(summary, -1)

    async def update(self) -> None:
        """Work out again what is merged away in the partitions whose ranges changed."""
        changed, self._changed = list(self._changed), set()
        async for chunk in in_turns(changed, 200):
            for tp in chunk:
                if merged := merged_away(self._ranges.get(tp, ())):
                    self._merged[tp] = merged
                else:
                    self._merged.pop(tp, None)

    def is_merged(self, tid: str, p: int, base: int, last: int) -> bool:
        return (base, last) in self._merged.get((tid, p), ())


class Collector:
    """Forgets the node objects whose every slice is compacted (below its
    partition's checkpoint), before its log start, or of a deleted topic, and
    the shared segment objects whose every segment is before its log start,
    of a deleted topic or merged into a later one, and deletes them delete_delay_s later; every
    ORPHAN_AGE_S / 2 it also deletes objects no directory names (uploads
    that never committed) once ORPHAN_AGE_S old. A directory never changes,
    so each is read and parsed once (a pass reads the wal/ and shared/ keys
    and only the directories it has not seen)."""

    def __init__(self, meta: MetaStore, store: ObjectStore, namespace: str, orphan_age_s: float = ORPHAN_AGE_S,
                 spread_s: float = 0.0, delete_delay_s: float = Config.delete_delay_ms / 1000) -> None:
        self.meta = meta
        self.store = store
        self.namespace = namespace
        self.orphan_age_s = orphan_age_s
        self.delete_delay_s = delete_delay_s  # a forgotten object goes this long after (reads in flight finish)
        self.spread_s = spread_s  # a pass's deletes go out over this long (the time between passes)
        # wal/ or shared/ key -> the object's key, whether shared, and its slices as
        # (topic, topic id hex, partition, base and last offset)
        self._seen: dict[bytes, Summary] = {}
        # wal/ or shared/ key -> how many of its slices, from the first, a pass found done. They stay
        # done (checkpoints and log starts only move forward, a deleted topic's id never comes back, a
        # merged segment stays merged), so the next pass starts after them (checking from the first
        # slice every pass was a third of the collector's time at 1,000 partitions: bench/history.md)
        self._done: dict[bytes, int] = {}
        self._shared = SharedRanges()
        self._orphans_swept = 0.0
        # every claimed partition's (high watermark, log start) by topic and partition, as of etcd
        # revision _marks_at: a pass reads only the states written since (at 10,000 idle partitions,
        # reading and parsing all of them was a quarter of the log process's CPU; bench/history.md)
        self._marks: dict[str, dict[int, tuple[int, int]]] = {}
        self._marks_at = 0

    async def run(self, handed: dict[bytes, Summary] | None = None) -> int:
        """One pass; returns how many node objects it forgot. The directories
        are read before the topics and partition states: a slice's partition
        was claimed (its state written) before the object was committed, so a
        missing state then means a deleted topic, never a partition claimed
        after the states were read (whose object would be forgotten live).
        handed: summaries of directories known without reading them (this
        broker's node objects: NodeFlusher.handed_over), by key."""
        known = {**self._seen, **handed} if handed else self._seen
        seen = (await read_directories(self.meta, known, functools.partial(_summary, shared=False))
                | await read_directories(self.meta, self._seen, functools.partial(_summary, shared=True), "shared"))
        turns = Turns(COLLECT_TURN)
        for k in self._seen.keys() - seen.keys():  # forgotten by another broker's collector
            self._shared.remove(self._seen[k])
            await turns.did(summary_size(self._seen[k]))
        for k in seen.keys() - self._seen.keys():
            self._shared.add(seen[k])
            await turns.did(summary_size(seen[k]))
        self._seen = seen
        self._done = {k: n for k, n in self._done.items() if k in seen}
        await self._shared.update()
        dead: list[tuple[bytes, str]] = []
        if self._seen:  # nothing to decide otherwise (a cluster without node flushes reads no states)
            topics = {t.name: t.id.hex() for t in await self.meta.list_topics()}
            changed, self._marks_at = await self.meta.partition_marks(self._marks_at)
            for topic, marks in changed.items():
                self._marks.setdefault(topic, {}).update(marks)
            for topic in self._marks.keys() - topics.keys():  # deleted: its partitions' keys are gone
                del self._marks[topic]

            def done(topic: str, tid: str, p: int, base: int, last: int) -> bool:  # a shared object's segment
                mark = self._marks.get(topic, {}).get(p)
                return (topics.get(topic) != tid or mark is None or mark[1] > last
                        or self._shared.is_merged(tid, p, base, last))

            floors: dict[tuple[str, str], np.ndarray | None] = {}  # node objects' slices: _floor, once a pass
            for k, sm in list(self._seen.items()):
                n = start = self._done.get(k, 0)
                if sm[1]:
                    for sl in summary_slices(sm, start):
                        if not done(*sl):
                            break
                        n += 1
                else:
                    for tt in sm[2]:
                        if tt not in floors:
                            floors[tt] = _floor(self._marks.get(tt[0]) if topics.get(tt[0]) == tt[1] else None)
                    n += _done_rows(sm, start, [floors[tt] for tt in sm[2]])
                if n == summary_size(sm):
                    dead.append((k, sm[0]))
                else:
                    self._done[k] = n
                await turns.did(n - start + 1)
        if dead:
            await self.meta.forget_wal([k for k, _ in dead])
            for k, _ in dead:
                self._done.pop(k, None)
                self._shared.remove(forgotten := self._seen.pop(k))
                await turns.did(summary_size(forgotten))
            objects = [key for _, key in dead]
            asyncio.get_running_loop().call_later(self.delete_delay_s, lambda: asyncio.ensure_future(
                _delete(self.store, objects, self.spread_s)))
        if time.monotonic() >= self._orphans_swept + self.orphan_age_s / 2:
            self._orphans_swept = time.monotonic()
            await self._sweep_orphans({sm[0] for sm in self._seen.values()} | {key for _, key in dead})
        return len(dead)

    async def _sweep_orphans(self, named: set[str]) -> None:
        """Delete the objects of fences that are gone which no directory names.
        A live fence's objects are never orphans, so only the gone fences'
        prefixes are listed: listing every node object (most of them a live
        fence's) took the store long enough to hold up the node flushes' PUTs
        (on SeaweedFS, by 130 ms at 600 objects: bench/history.md)."""
        live_fences = await self.meta.fences()
        now = time.time()
        for root in (node_prefix(self.namespace), shared_prefix(self.namespace)):
            for folder in await self.store.folders(root):
                if folder[len(root):-1] not in live_fences:
                    await _delete(self.store, [o["Key"] for o in await self.store.list(folder)
                                               if o["Key"] not in named
                                               and now - o["LastModified"].timestamp() > self.orphan_age_s])


async def _delete(store: ObjectStore, keys: list[str], spread_s: float = 0.0) -> None:
    """Delete objects in requests of DELETE_BATCH, spread evenly over spread_s."""
    batches = [keys[i:i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
    for i, batch in enumerate(batches):
        if i:
            await asyncio.sleep(spread_s / len(batches))
        try:
            await store.delete_many(batch)
        except Exception as exc:  # left for the orphan sweep
            log.warning("could not delete %d node objects: %r", len(batch), exc)
