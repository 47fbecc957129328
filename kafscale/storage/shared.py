"""Shared compaction: the compacted segments of many small partitions in one
object, committed in one etcd transaction.

Compacting each partition on its own costs a PUT and a transaction per
partition with new data every `compaction_lag_ms`; past a few hundred busy
partitions one broker cannot keep up (about 60 a second, bench/history.md)
and node objects pile up behind the lag. A partition whose compacted segment
stays small (SHARED_SEGMENT_BYTES) is therefore compacted together with up
to SHARED_PARTITIONS others (or alone, when it is the only one due: its
segment is merged later like the others'): each one's segment is built as
usual and the segments go back to back into one *shared segment object*,
laid out like a node object (docs/segment-format.md) under
`~shared/{fence}/{seq}.kfn`. One transaction compares every partition key
with what its owner last wrote, moves each checkpoint past its segment,
puts each segment's manifest (the object's key and the segment's position
in it) and the object's directory under `shared/{fence}/{seq}`. Readers
need nothing new: a manifest with a position is read like a node object's
slice.

A partition that writes little would add a small segment (and an etcd key)
every compaction for as long as its data is kept. Its compaction therefore
also takes the small segments before it that are in shared objects
(PartitionLog.to_merge: three at a time, each no larger than what is taken
so far, up to SHARED_SEGMENT_BYTES), rewrites them with the new slices into
one segment at the first one's base offset, and the same transaction deletes
their other manifests; a partition keeps up to three small segments of each
size, about log4(SHARED_SEGMENT_BYTES / bytes per compaction) sizes. The collector deletes a shared object once
every segment in it is before its partition's log start, of a deleted
topic, or merged into a segment of a later shared object (one of the same
partition covering a larger range).

A partition handed over or closed while its share is built is left out (its
slices stay for the next owner); one whose key moved (a new owner) is left
out and fails like a fenced compaction. If every partition is left out, the
object is deleted."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kafscale import _native, faults, metrics
from kafscale.config import Config
from kafscale.metadata.store import SHARED_PARTITIONS, TXN_MAX_OPS, MetaStore, SegmentManifest
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.partition import Compaction, PartitionLog
from kafscale.storage.wal import Slice, directory, retry, seal, shared_key, upload

if TYPE_CHECKING:
    from kafscale.broker.partitions import RecentCache

log = logging.getLogger(__name__)

SHARED_SEGMENT_BYTES = 1 << 20  # a compaction of at most this many bytes goes into a shared object
SHARED_OBJECT_BYTES = 8 << 20  # a shared object is cut at about this size (or SHARED_PARTITIONS partitions)
RUN_GAP_BYTES = 64 << 10  # slices of one object at most this far apart are read in one GET (SliceReads)
RUN_SPAN_FACTOR = 4  # ... while the GET's range stays within this many times their bytes


class SliceReads:
    """The slices that a shared compaction's partitions take and the cache
    no longer holds, read from S3 in runs: the slices of one object that lie
    at most RUN_GAP_BYTES apart come in one ranged GET, the first time a
    compaction asks for any of them, as long as the range is at most
    RUN_SPAN_FACTOR times their bytes (what a run holds of other slices is
    bounded: the group's compactions take their slices one partition after
    another, so a run's bytes stay until its last slice is read). Node
    objects lay out their slices in partition order and a shared compaction
    takes neighbouring partitions, so its slices of each node object are
    usually one run: one GET an object, where a GET a slice made compaction
    that fell behind the cache (at 1,000 partitions and 20,000 records/s)
    fall further behind, a GET a record. The small segments the compactions
    merge are read the same way: earlier shared compactions of the same
    neighbours laid them out side by side in shared objects (read one GET a
    segment, they made about two thirds of compaction's GETs at 1,000
    partitions and 20,000 records/s: 89-93 a second, 27 without them,
    bench/history.md)."""

    def __init__(self, store: ObjectStore, logs: list[PartitionLog], merge_limit: int = 0,
                 most_merged: int = 0) -> None:
        """merge_limit, most_merged: what the compactions are given (the most
        any of them may merge: one that merges less leaves a run's bytes unread)."""
        self.store = store
        self._logs = logs
        self._merge = merge_limit, most_merged
        self._gathered: asyncio.Future[None] | None = None  # the group's uncached slices listed (at the first miss)
        self._wanted: dict[str, list[SegmentManifest]] = {}  # object key -> its wanted slices, not in runs yet
        self._run_of: dict[str, tuple[str, int, int]] = {}  # slice ref -> its run: object key, start, end
        self._left: dict[tuple[str, int, int], int] = {}  # run -> its slices not read yet
        self._reads: dict[tuple[str, int, int], asyncio.Future[bytes]] = {}

    async def _gather(self) -> None:
        """List the slices the group's compactions will ask for, one partition a
        loop pass, once one of them misses the cache: a group whose slices are
        all cached costs no second pass over them."""
        for lg in self._logs:
            for m in lg.uncached(*self._merge):
                if m.pos >= 0:  # in a node object or a shared one
                    self._wanted.setdefault(m.key, []).append(m)
            await asyncio.sleep(0)

    def _plan(self, key: str) -> None:
        """The runs of an object's wanted slices, when the first of them is asked
        for (at 1,000 partitions a group's backlog is tens of thousands of
        slices: planning them all at once held the event loop)."""
        ms = sorted(self._wanted.pop(key, ()), key=lambda m: m.pos)
        if not ms:
            return
        run, held = [ms[0]], ms[0].size
        for m in ms[1:]:
            if (m.pos - (run[-1].pos + run[-1].size) > RUN_GAP_BYTES
                    or m.pos + m.size - run[0].pos > RUN_SPAN_FACTOR * (held + m.size)):
                self._add(run)
                run, held = [], 0
            run.append(m)
            held += m.size
        self._add(run)

    def _add(self, run: list[SegmentManifest]) -> None:
        span = (run[0].key, run[0].pos, run[-1].pos + run[-1].size)
        self._left[span] = len(run)
        for m in run:
            self._run_of[m.ref] = span

    async def get(self, m: SegmentManifest) -> memoryview | None:
        """The slice's bytes (None: not one of the wanted slices)."""
        if self._gathered is None:
            self._gathered = asyncio.ensure_future(self._gather())
        await self._gathered
        if m.key in self._wanted:
            self._plan(m.key)
        span = self._run_of.pop(m.ref, None)
        if span is None:
            return None
        read = self._reads.get(span)
        if read is None:
            read = self._reads[span] = asyncio.ensure_future(self.store.get(*span))
        self._left[span] -= 1
        if not self._left[span]:  # the last of its slices: the run goes once this one has its bytes
            del self._reads[span], self._left[span]
        data = await read
        return memoryview(data)[m.pos - span[1]:m.pos - span[1] + m.size]


async def compact_shared(logs: list[PartitionLog], cfg: Config, store: ObjectStore, meta: MetaStore, fence: str,
                         seq: int, topic_id: Callable[[str], bytes | None], cache: RecentCache) -> int:
    """Compact the committed slices of these (at most SHARED_PARTITIONS) logs
    into one shared object and commit it, and put its segments in the cache
    (the logs'); returns how many partitions it holds. `fence` and `seq` name
    it (a fence's seqs are never reused)."""
    assert len(logs) <= SHARED_PARTITIONS
    key = shared_key(cfg.namespace, fence, seq)
    created = int(time.time() * 1000)
    shares: list[Slice] = []  # one per partition, with no batches of its own (they are committed already)
    builts: dict[PartitionLog, Compaction] = {}  # each one's compaction: what it merges, its slices, its segment
    ids: dict[str, bytes] = {}
    spare = TXN_MAX_OPS - 1 - 2 * len(logs)  # the transaction's operations left for merged manifests' deletes
    pos = 0
    reads = SliceReads(store, logs, SHARED_SEGMENT_BYTES, spare + 1)
    for lg in logs:
        tid = topic_id(lg.topic)
        built = await lg.compaction(SHARED_SEGMENT_BYTES, spare + 1, reads.get)
        if built is None or tid is None:  # closed meanwhile, or its topic deleted
            continue
        ids[lg.topic] = tid
        spare -= max(len(built[0]) - 1, 0)
        shares.append(Slice(lg, lg.compacted_manifest(built, key, pos), []))
        builts[lg] = built
        pos += len(built[2].data)
        await asyncio.sleep(0)  # one partition's segment at a time: 20 in one go held the event loop for up to 48 ms
    if not shares:
        return 0

    sealed, dir_raw = len(shares), directory(key, created, shares, ids)  # the object's own directory and its rows
    body = seal(bytearray().join([builts[s.log][2].data for s in shares]), dir_raw)
    await upload(store, key, body, cfg.s3_timeout_s)
    faults.reached("mid-compaction")
    committed: list[Slice] = []

    async def commit() -> None:
        """One attempt, under the commit locks of every partition left (taken in
        one order: nothing else takes more than one)."""
        async with contextlib.AsyncExitStack() as locks:
            for s in sorted(shares, key=lambda s: (s.log.topic, s.log.partition)):
                await locks.enter_async_context(s.log.commit_lock())
            shares[:] = [s for s in shares if not s.log.closed]  # handed over: its slices stay for the next owner
            if not shares:
                return
            states = [s.log.compacted_state(builts[s.log][2]).to_json() for s in shares]
            t = time.perf_counter()
            # shares are only ever left out: fewer than sealed means some were handed over or moved
            committing = dir_raw if len(shares) == sealed else directory(key, created, shares, ids)
            ok = await meta.commit_shared(fence, seq, committing,
                                          [(s.log.topic, s.log.partition, s.log.state_raw(), st, s.manifest,
                                            [m.base for m in builts[s.log][0]])
                                           for s, st in zip(shares, states, strict=True)])
            metrics.ETCD_SECONDS.labels(metrics.node()).observe(time.perf_counter() - t)
            if ok:
                now = states
            else:  # a partition key moved (or an earlier attempt committed and its reply was lost)
                got = await asyncio.gather(*(meta.get_partition(s.log.topic, s.log.partition) for s in shares))
                now = [cur[1] if cur is not None else b"" for cur in got]
                if not any(raw == st for raw, st in zip(now, states, strict=True)):
                    moved = [s for s, raw in zip(shares, now, strict=True) if raw != s.log.state_raw()]
                    for s in moved:
                        log.warning("%s/%d: fenced by a newer owner while compacting", s.log.topic, s.log.partition)
                        s.log.flush_failed()
                    shares[:] = [s for s in shares if s not in moved]
                    raise RuntimeError(f"{len(moved)} partitions moved; committing the others")
            for s, raw, st in zip(shares, now, states, strict=True):
                if raw == st:
                    s.log.compaction_committed(raw, s.manifest)
                    committed.append(s)
                else:  # committed, then taken by a new owner
                    s.log.flush_failed()

    await retry(f"commit of {key}", commit)
    if not committed:
        with contextlib.suppress(Exception):  # else the orphan sweep's, once this fence is gone
            await store.delete(key)
        return 0
    # one cache reservation and copy for all (per segment that was an eighth of a compaction's CPU)
    cache.put_object(key, memoryview(body), _native.pack_entries([(s.manifest.pos, len(builts[s.log][2].data),
                                                                   builts[s.log][2].tables) for s in committed]))
    for s in committed:  # one partition at a time, as they were built
        s.log.serve_compacted(s.manifest, builts[s.log])
        await asyncio.sleep(0)
    return len(committed)
