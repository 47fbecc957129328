"""Reading a topic straight from its segment objects, with no broker: which
objects hold an offset or time range (from the manifests in etcd, or from an
S3 listing when no etcd is given), how to cut them into slices of about a
given size along index entries, and decoding a slice's records.

Used by the Spark data source (kafscale.spark.source) and the Iceberg
processor; nothing here imports pyspark."""
from __future__ import annotations

import asyncio
import bisect
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from kafscale import _native
from kafscale.config import Config
from kafscale.metadata.store import MetaStore, SegmentManifest
from kafscale.protocol.types import EARLIEST, LATEST
from kafscale.storage.objectstore import ObjectStore, sync_client
from kafscale.storage.segment import (
    FOOTER,
    FOOTER_SIZE,
    HEADER_SIZE,
    first_at_or_after,
    has_index,
    index_key,
    parse_index,
    parse_segment_key,
)
from kafscale.storage.wal import (
    by_partition,
    continuing,
    directory_slices,
    marker_topic_id,
    of_topic,
    read_node_directory,
    shared_prefix,
)

LISTING_READS = 32  # shared segment object directories a listing reads at once


@dataclass(frozen=True)
class StoreOptions:
    """Where the segments are, and optionally the etcd holding their manifests."""
    bucket: str
    namespace: str
    endpoint: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    etcd: str | None = None
    cluster: str = "default"
    etcd_user: str | None = None
    etcd_password: str | None = None

    @classmethod
    def from_config(cls, cfg: Config, use_etcd: bool = True) -> StoreOptions:
        return cls(cfg.bucket, cfg.namespace, cfg.s3_endpoint or None, cfg.s3_region, cfg.s3_access_key or None,
                   cfg.s3_secret_key or None, cfg.etcd if use_etcd else None, cfg.cluster,
                   cfg.etcd_user or None, cfg.etcd_password or None)

    @classmethod
    def from_source_options(cls, options: dict[str, str]) -> StoreOptions:
        o = {k.lower(): v for k, v in options.items()}
        if not o.get("bucket"):
            raise ValueError("option 'bucket' is required")
        return cls(o["bucket"], o.get("namespace", "kafscale"), o.get("endpoint") or None, o.get("region"),
                   o.get("accesskey"), o.get("secretkey"), o.get("etcd") or None, o.get("cluster", "default"),
                   o.get("etcduser") or None, o.get("etcdpassword") or None)

    def as_source_options(self) -> dict[str, str]:
        """The same settings as options of spark.read.format("kafscale")."""
        names = {"bucket": self.bucket, "namespace": self.namespace, "endpoint": self.endpoint,
                 "region": self.region, "accessKey": self.access_key, "secretKey": self.secret_key,
                 "etcd": self.etcd, "cluster": self.cluster, "etcdUser": self.etcd_user,
                 "etcdPassword": self.etcd_password}
        return {k: v for k, v in names.items() if v}

    def store(self) -> ObjectStore:
        return ObjectStore(self.bucket, self.endpoint, self.region, self.access_key, self.secret_key)


@dataclass(frozen=True)
class Segment:
    """One committed segment object of a partition."""
    partition: int
    key: str
    base: int  # its first offset (a listing may take a segment from an offset inside it: that one)
    last: int
    size: int  # whole segment, header and footer included
    min_ts: int = -1  # -1: not known (S3 listing)
    max_ts: int = -1
    pos: int = -1  # -1: an object of its own (.kfs); else a node object's slice starting at this byte

    @property
    def start(self) -> int:
        """Byte position of the segment's header in its object."""
        return max(self.pos, 0)


@dataclass(frozen=True)
class Slice:
    """Records [start, end) of one segment, found in bytes [pos, pos_end) of it."""
    topic: str
    partition: int
    key: str
    pos: int
    pos_end: int
    start: int
    end: int


async def list_segments(opts: StoreOptions, topic: str) -> dict[int, tuple[list[Segment], int, int]]:
    """Per partition: its committed segments in offset order, the log start
    offset and the high watermark."""
    if opts.etcd:
        return await _from_etcd(opts, topic)
    return await _from_listing(opts, topic)


async def _from_etcd(opts: StoreOptions, topic: str) -> dict[int, tuple[list[Segment], int, int]]:
    meta = MetaStore(opts.etcd or "", opts.cluster, opts.etcd_user, opts.etcd_password)
    await meta.start()
    try:
        tm = await meta.get_topic(topic)
        if tm is None:
            raise ValueError(f"topic {topic!r} does not exist in cluster {opts.cluster!r}")
        # node flushes: the records not compacted yet are slices of node objects, named by their directories
        tails = by_partition([raw for _, raw in await meta.wal_directories()])
        out = {}
        for p in range(tm.partitions):
            hw, start = await meta.watermarks(topic, p)
            manifests = [m for m in await meta.list_segments(topic, p) if m.last < hw]
            manifests += continuing(tails.get((tm.id.hex(), p), []), hw, f"{topic}/{p}")
            segs = [_segment(p, m) for m in manifests if m.last >= start]
            out[p] = (segs, max(start, segs[0].base if segs else start), segs[-1].last + 1 if segs else hw)
        return out
    finally:
        await meta.close()


def _segment(p: int, m: SegmentManifest) -> Segment:
    return Segment(p, m.key, m.base, m.last, m.size, m.min_ts, m.max_ts, m.pos)


async def _from_listing(opts: StoreOptions, topic: str) -> dict[int, tuple[list[Segment], int, int]]:
    """Segments found by listing the bucket: the topic's own .kfs objects and
    its segments in shared segment objects (from their directories).

    Which of them are committed only etcd knows. A listing also finds the
    leftovers of owners that crashed or were fenced between upload and
    commit, and shared segments merged into later ones but not deleted yet;
    with node flushes every segment holding an offset holds the same record
    there (it is compacted from committed records). So the listing walks
    each partition's offsets from the lowest base, taking at each step the
    segment that holds the next offset and reaches furthest (of equals a
    shared one), from that offset on. A .kfs segment's last offset is the
    next higher base offset minus one (no merge ever starts inside one, and a
    leftover .kfs starts at a committed segment's base); at one base the
    .kfs with the highest epoch in its key is taken (a later owner's, when
    node flushes are off and a leftover may hold records never acknowledged).
    Only the newest .kfs footer is read."""
    own: dict[int, dict[int, tuple[int, str, int]]] = {}  # partition: base: (epoch, key, size)
    shared: dict[int, list[Segment]] = {}
    async with opts.store() as store:
        topic_id = await marker_topic_id(store, opts.namespace, topic)
        for obj in await store.list(f"{opts.namespace}/{topic}/"):
            k = parse_segment_key(obj["Key"])
            if k is None or k.kind != "kfs" or not obj["Key"].startswith(f"{opts.namespace}/{topic}/"):
                continue
            cur = own.setdefault(k.partition, {}).get(k.base_offset)
            if cur is None or k.epoch > cur[0]:
                own[k.partition][k.base_offset] = (k.epoch, obj["Key"], int(obj["Size"]))
        for s in await _shared_segments(store, opts.namespace, topic, topic_id):
            shared.setdefault(s.partition, []).append(s)
        out = {}
        for p in own.keys() | shared.keys():
            found = list(shared.get(p, []))  # and the .kfs segments, added below
            bases = sorted({s.base for s in found} | own.get(p, {}).keys())
            for base, (_, key, size) in own.get(p, {}).items():
                later = bisect.bisect_right(bases, base)
                last = bases[later] - 1 if later < len(bases) else FOOTER.unpack(
                    await store.get(key, size - FOOTER_SIZE, size))[1]
                found.append(Segment(p, key, base, last, size))
            out[p] = (segs := _walk(found), bases[0], segs[-1].last + 1)
        return out


def _walk(found: list[Segment]) -> list[Segment]:
    """From the lowest base offset on, the segment holding the next offset
    that reaches furthest (of equals one in a shared object, whose last offset
    is known), read from that offset: in one pass over them sorted by base
    (every segment passed over ends before the offset the walk is at)."""
    found = sorted(found, key=lambda s: s.base)
    segs: list[Segment] = []
    offset, i, best = found[0].base, 0, None
    while True:
        while i < len(found) and found[i].base <= offset:
            s = found[i]
            i += 1
            if s.last >= offset and (best is None or (s.last, s.pos >= 0) > (best.last, best.pos >= 0)):
                best = s
        if best is None:  # a gap, or the end
            if i == len(found):
                return segs
            offset = found[i].base
            continue
        segs.append(best if best.base == offset else replace(best, base=offset))
        offset, best = best.last + 1, None


async def _shared_segments(store: ObjectStore, namespace: str, topic: str, topic_id: str | None
                           ) -> list[Segment]:
    """The topic's segments in every shared segment object in the bucket, as
    their directories (read with two ranged GETs each, LISTING_READS at once)
    name them: those of this topic id where it is known (its marker), so none
    of a deleted topic of the same name."""
    objects = await store.list(shared_prefix(namespace))
    found: list[Segment] = []
    for at in range(0, len(objects), LISTING_READS):
        dirs = await asyncio.gather(*(read_node_directory(store, o["Key"], int(o["Size"]))
                                      for o in objects[at:at + LISTING_READS]))
        for o, d in zip(objects[at:at + LISTING_READS], dirs, strict=True):
            for s in directory_slices(d):
                if of_topic(s, topic, topic_id):
                    _, _, p, base, last, _, pos, size, min_ts, max_ts, _ = s
                    found.append(Segment(p, o["Key"], base, last, size, min_ts, max_ts, pos))
    return found


def parse_offsets(spec: str | None, topic: str, default: int) -> dict[int, int] | int:
    """Kafka's startingOffsets / endingOffsets: "earliest", "latest" or JSON
    {"topic": {"0": 23, "1": -2}}, or one number for every partition. Returns one offset for every partition, or
    a per-partition map (partitions not named take `default`)."""
    if spec is None or spec == "":
        return default
    if spec in ("earliest", "latest"):
        return EARLIEST if spec == "earliest" else LATEST
    if spec.lstrip("-").isdigit():  # one offset for every partition (an extension of Kafka's options)
        return int(spec)
    parsed = json.loads(spec)
    if not isinstance(parsed, dict) or topic not in parsed:
        raise ValueError(f"offsets {spec!r} must be earliest, latest or JSON naming topic {topic!r}")
    return {int(p): int(o) for p, o in parsed[topic].items()}


def _resolve(spec: dict[int, int] | int, p: int, log_start: int, hw: int, default: int) -> int:
    o = spec.get(p, default) if isinstance(spec, dict) else spec
    if o == EARLIEST:
        return log_start
    if o == LATEST:
        return hw
    return min(max(o, log_start), hw)


async def offset_for_time(store: ObjectStore, segs: list[Segment], ts: int, hw: int) -> int:
    """First offset whose record timestamp is >= ts (hw when there is none).
    Reads one segment at most: the first whose newest record is new enough."""
    for s in segs:
        if s.max_ts != -1 and s.max_ts < ts:
            continue
        body = await store.get(s.key, s.start + HEADER_SIZE, s.start + s.size - FOOTER_SIZE)
        found = first_at_or_after(body, ts, s.base)  # s.base: a listing may read a segment from inside it
        if found is not None:
            return found[0]
    return hw


async def plan(opts: StoreOptions, topic: str, starting: str | None = None, ending: str | None = None,
               starting_ts: int | None = None, ending_ts: int | None = None,
               max_slice_bytes: int = 128 << 20) -> list[Slice]:
    """The slices holding records [start, end) of every partition: start from
    startingOffsets or startingTimestamp (default earliest), end (exclusive)
    from endingOffsets or endingTimestamp (default latest)."""
    start_spec = parse_offsets(starting, topic, EARLIEST)
    end_spec = parse_offsets(ending, topic, LATEST)
    slices: list[Slice] = []
    async with opts.store() as store:
        for p, (segs, log_start, hw) in sorted((await list_segments(opts, topic)).items()):
            start = _resolve(start_spec, p, log_start, hw, EARLIEST)
            end = _resolve(end_spec, p, log_start, hw, LATEST)
            if starting_ts is not None:
                start = max(start, await offset_for_time(store, segs, starting_ts, hw))
            if ending_ts is not None:
                end = min(end, await offset_for_time(store, segs, ending_ts, hw))
            for s in segs:
                if s.last < start or s.base >= end:
                    continue
                slices.extend(await _cut(store, topic, s, start, end, max_slice_bytes))
    return slices


async def _cut(store: ObjectStore, topic: str, s: Segment, start: int, end: int, max_bytes: int) -> list[Slice]:
    """One slice for the part of segment s inside [start, end), or several of
    about max_bytes each cut at index entries (batch boundaries) when it is
    bigger. The index is read only for a segment that needs it."""
    body_end = s.size - FOOTER_SIZE
    lo, hi = max(start, s.base), min(end, s.last + 1)
    if not has_index(s.size, s.pos) or (s.size <= max_bytes and lo == s.base):  # no index: read whole
        return [Slice(topic, s.partition, s.key, s.start + HEADER_SIZE, s.start + body_end, lo, hi)]
    idx = parse_index(await store.get(index_key(s.key)))
    first = max(bisect.bisect_right(idx.offsets, lo) - 1, 0)
    last = max(bisect.bisect_left(idx.offsets, hi) - 1, first)  # the entry at or before the range's last batch
    cuts = [first]
    for i in range(first + 1, last + 1):
        if idx.positions[i] - idx.positions[cuts[-1]] >= max_bytes:
            cuts.append(i)
    out = []
    for n, i in enumerate(cuts):
        pos = idx.positions[i] if idx.positions else HEADER_SIZE
        pos_end = idx.positions[cuts[n + 1]] if n + 1 < len(cuts) else body_end
        a = lo if n == 0 else idx.offsets[i]
        b = hi if n + 1 == len(cuts) else idx.offsets[cuts[n + 1]]
        out.append(Slice(topic, s.partition, s.key, pos, pos_end, a, b))
    return out


@functools.lru_cache(maxsize=4)
def _sync_client(opts: StoreOptions) -> Any:
    """One blocking S3 client per store for the life of the process: a Spark
    Python worker runs many tasks, and making a client costs more than a GET."""
    return sync_client(opts.endpoint, opts.region, opts.access_key, opts.secret_key, attempts=5)


def read_slice(opts: StoreOptions, sl: Slice) -> bytes:
    """The slice's bytes, with one ranged GET, from synchronous code."""
    r = _sync_client(opts).get_object(Bucket=opts.bucket, Key=sl.key, Range=f"bytes={sl.pos}-{sl.pos_end - 1}")
    return r["Body"].read()


ARROW_SCHEMA = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()), ("partition", pa.int32()),
    ("offset", pa.int64()), ("timestamp", pa.timestamp("us", tz="UTC")), ("timestampType", pa.int32()),
    ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
])  # the columns of Spark's Kafka source
DECODE_BYTES = 16 << 20  # batch bytes decoded into one Arrow record batch


def arrow_batches(sl: Slice, data: bytes) -> Iterator[pa.RecordBatch]:
    """The slice's records in [start, end) as Arrow record batches, decoded
    natively (decompressing as needed) about DECODE_BYTES of batches at a time."""
    group: list[_native.BatchInfo] = []
    size = 0
    for b in _native.scan_batches(data, True):
        if b.base_offset + b.last_offset_delta < sl.start or b.base_offset >= sl.end:
            continue
        group.append(b)
        size += b.size
        if size >= DECODE_BYTES:
            yield _to_arrow(sl, _native.decode_columns(data, group, sl.start, sl.end))
            group, size = [], 0
    if group:
        yield _to_arrow(sl, _native.decode_columns(data, group, sl.start, sl.end))


def _binary(n: int, offsets: bytes, data: bytes, valid: bytes, kind: pa.DataType | None = None) -> pa.Array:
    bitmap = None if valid.count(0) == 0 else pa.py_buffer(np.packbits(np.frombuffer(valid, np.uint8),
                                                                      bitorder="little"))
    return pa.Array.from_buffers(kind or pa.binary(), n, [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)])


def _to_arrow(sl: Slice, c: dict[str, Any]) -> pa.RecordBatch:
    n = c["n"]
    nh = len(c["header_value_valid"])
    try:
        hkeys = _binary(nh, c["header_key_offsets"], c["header_key_data"], b"\1" * nh, pa.string())
        hkeys.validate(full=True)
    except pa.ArrowInvalid:  # a header key that is not UTF-8: decode it with replacement characters
        raw = _binary(nh, c["header_key_offsets"], c["header_key_data"], b"\1" * nh).to_pylist()
        hkeys = pa.array([k.decode("utf-8", "replace") for k in raw], pa.string())
    headers = pa.ListArray.from_arrays(
        pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(c["header_offsets"])]),
        pa.StructArray.from_arrays([hkeys, _binary(nh, c["header_value_offsets"], c["header_value_data"],
                                                   c["header_value_valid"])], names=["key", "value"]))
    ts_us = np.frombuffer(c["timestamp"], np.int64) * 1000
    return pa.RecordBatch.from_arrays([
        _binary(n, c["key_offsets"], c["key_data"], c["key_valid"]),
        _binary(n, c["value_offsets"], c["value_data"], c["value_valid"]),
        pa.array([sl.topic] * n, pa.string()),
        pa.array(np.full(n, sl.partition, np.int32)),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(c["offset"])]),
        pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n, [None, pa.py_buffer(ts_us)]),
        pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(c["timestamp_type"])]),
        headers,
    ], schema=ARROW_SCHEMA)
