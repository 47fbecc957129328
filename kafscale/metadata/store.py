"""Cluster metadata in etcd (aetcd), under /kafscale/{cluster}/.

  topics/{name}                  {"id": hex uuid, "partitions": n, "config": {...}}
  partitions/{topic}/{p}         {"owner": broker id, "epoch": n, "hw": n, "log_start": n, "fence": id}
                                 (written by the partition's first claim: none for unused partitions;
                                 with node flushes hw is the end of the compacted segments)
  segments/{topic}/{p}/{base}    manifest of one committed segment (base 20 digits)
  fences/{fence id}              present while the log process that holds this id may commit node
                                 objects (on its lease; a claim of one of its partitions deletes it)
  wal/{fence id}/{seq}           directory of one committed node object (seq 12 digits), until
                                 every partition's slice in it is compacted (kafscale.storage.wal)
  shared/{fence id}/{seq}        directory of one shared segment object: the compacted segments of up
                                 to SHARED_PARTITIONS small partitions (their manifests under segments/
                                 name it), until every one is below its partition's log start or
                                 merged into a later one (kafscale.storage.shared)
  brokers/{id}                   {"host": ..., "port": ...} on the broker's lease
  owners/{topic}/{p}             id of the broker that owns the partition, on its lease
  draining/{id}                  present while an operator drains that broker
  producer_ids                   last allocated producer id
  offsets/{group}/{topic}/{p}    {"offset": n, "metadata": str, "leader_epoch": n, "commit_ms": n}
  groups/{group}                 group state of the last completed rebalance (members, assignments)
  processors/{name}/{topic}/{p}  a processor's next offset (kafscale.processors)
  users/{name}                   SCRAM credentials per mechanism (salted and hashed, kafscale.security.sasl)
  acls/{id}                      one ACL binding (kafscale.security.acl)

Every segment commit is one transaction that compares the partition key
with the exact value this owner last wrote (it carries epoch and watermark),
so an owner that was fenced by a newer epoch can never move the watermark."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

import aetcd
from aetcd.utils import prefix_range_end

from kafscale.metadata.etcd_client import EtcdClient
from kafscale.protocol.types import TopicPartition
from kafscale.security.acl import AclBinding

log = logging.getLogger(__name__)

T = TypeVar("T")


class Fenced(Exception):
    """The partition changed hands (or state) since this owner last wrote it."""


class TopicExists(Exception):
    pass


def unavailable(exc: BaseException) -> bool:
    """Whether exc means etcd (or another server) could not be reached in
    time: worth a retriable error to the client, not a bug."""
    if isinstance(exc, aetcd.exceptions.InvalidArgumentError):  # a request etcd refuses (e.g. too large)
        return False
    return isinstance(exc, OSError | TimeoutError | aetcd.exceptions.ClientError)


@dataclass
class TopicMeta:
    name: str
    id: bytes
    partitions: int
    config: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id.hex(), "partitions": self.partitions, "config": self.config}).encode()

    @classmethod
    def from_json(cls, name: str, raw: bytes) -> TopicMeta:
        d = json.loads(raw)
        return cls(name, bytes.fromhex(d["id"]), d["partitions"], d.get("config", {}))


def has_partition(meta: TopicMeta | None, p: int) -> TypeGuard[TopicMeta]:
    """Whether the topic exists and has partition p."""
    return meta is not None and 0 <= p < meta.partitions


class TopicCache:
    """The topics a broker knows, by name and by id (for requests that name
    topics by id: one lookup each, no etcd read)."""

    def __init__(self) -> None:
        self._by_name: dict[str, TopicMeta] = {}
        self._by_id: dict[bytes, TopicMeta] = {}

    def get(self, name: str) -> TopicMeta | None:
        return self._by_name.get(name)

    def by_id(self, topic_id: bytes) -> TopicMeta | None:
        return self._by_id.get(topic_id)

    def values(self) -> list[TopicMeta]:
        return list(self._by_name.values())

    def put(self, meta: TopicMeta) -> None:
        self.pop(meta.name)
        self._by_name[meta.name] = meta
        self._by_id[meta.id] = meta

    def pop(self, name: str) -> TopicMeta | None:
        meta = self._by_name.pop(name, None)
        if meta is not None:
            self._by_id.pop(meta.id, None)
        return meta


@dataclass(slots=True)
class PartitionState:
    owner: int
    epoch: int
    hw: int
    log_start: int
    fence: str = ""  # the fence id of the owner that may still commit node objects with this partition

    @staticmethod
    def watermarks(state: PartitionState | None) -> tuple[int, int]:
        """(high watermark, log start offset); (0, 0) for a partition never claimed."""
        return (state.hw, state.log_start) if state is not None else (0, 0)

    def to_json(self) -> bytes:
        """Its fields as json.dumps(sort_keys=True) writes them (the same bytes:
        tests/unit/test_partition.py), formatted directly: json.dumps of a dict
        of the fields took 9 µs, a compaction encodes one a partition."""
        return (f'{{"epoch": {self.epoch}, "fence": {json.dumps(self.fence)}, "hw": {self.hw}, '
                f'"log_start": {self.log_start}, "owner": {self.owner}}}').encode()


@dataclass(slots=True)
class SegmentManifest:
    base: int
    last: int
    count: int
    size: int
    min_ts: int
    max_ts: int
    key: str
    created_ms: int
    # idempotent producers that wrote to this segment: producer id -> [epoch,
    # [first sequence, last sequence, base offset] of each of its last batches
    # here (at most 5)]; a new owner rebuilds its duplicate check from these
    producers: dict[str, list[Any]] = field(default_factory=dict)
    # where the segment starts in its object: -1 for a segment object of its own
    # (.kfs), else the byte position of this partition's slice of a node object
    pos: int = -1
    # what names the segment's bytes (the cache key): its object, plus "#pos" in a node object or a
    # shared one; made once (given, or by __post_init__), not at each use: a property making it took
    # 0.24 us a call, and compaction and the log process's commits call it once a slice. A copy with
    # another key or pos (dataclasses.replace) must pass ref="" to have it made again
    ref: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ref:
            self.ref = self.key if self.pos < 0 else f"{self.key}#{self.pos}"

    def fields(self) -> tuple[Any, ...]:
        """Its fields in order: SegmentManifest(*fields()) is a copy (its ref given, not made again)."""
        return (self.base, self.last, self.count, self.size, self.min_ts, self.max_ts, self.key, self.created_ms,
                self.producers, self.pos, self.ref)

    def __reduce__(self) -> tuple[type[SegmentManifest], tuple[Any, ...]]:
        """Pickled as its fields in order, not by name as a slots dataclass
        is: a worker's view of a partition gets its manifests in a snapshot
        (messages.PartitionSnapshot): a list of them took 1.56-1.65 us a
        manifest to pickle and 1.02-1.04 to unpickle by name, 0.67-0.69 and
        0.44-0.45 this way (bench/history.md, session 96)."""
        return SegmentManifest, self.fields()

    def to_json(self) -> bytes:
        """As PartitionState.to_json (16 µs through json.dumps, 2.6 formatted)."""
        producers = json.dumps(self.producers, sort_keys=True) if self.producers else "{}"
        return (f'{{"base": {self.base}, "count": {self.count}, "created_ms": {self.created_ms}, '
                f'"key": {json.dumps(self.key)}, "last": {self.last}, "max_ts": {self.max_ts}, '
                f'"min_ts": {self.min_ts}, "pos": {self.pos}, "producers": {producers}, "size": {self.size}}}'
                ).encode()

    @property
    def start(self) -> int:
        """Byte position of the segment's header in its object."""
        return max(self.pos, 0)

    @property
    def newest_ms(self) -> int:
        """How old the segment's data is, for retention: its largest record
        timestamp, or when it was written if no record carries one."""
        return self.max_ts if self.max_ts >= 0 else self.created_ms


def key_part(name: object) -> str:
    """A name as one etcd key segment: '%' and '/' escaped, so that group
    "shared" (offsets/shared/...) no longer prefixes group "shared/prod"
    (offsets/shared%2Fprod/...). Names without either are unchanged."""
    return str(name).replace("%", "%25").replace("/", "%2F")


def name_of(part: bytes | str) -> str:
    """The name one key segment stands for (the inverse of key_part)."""
    text = part.decode() if isinstance(part, bytes) else part
    return text.replace("%2F", "/").replace("%25", "%")


def _topic_partition(key: bytes, base: bytes) -> TopicPartition:
    """The partition a key `{base}{topic}/{p}` is about."""
    topic, _, p = key[len(base):].decode().rpartition("/")
    return TopicPartition(name_of(topic), int(p))


TXN_MAX_OPS = 128  # etcd's default --max-txn-ops (of compares, and of operations each way)
# partitions one claim_partitions call claims: two compares and two puts each, plus one delete per old fence
# named (at most one each) and the topic's compare, all within TXN_MAX_OPS
CLAIM_BATCH = (TXN_MAX_OPS - 1) // 3
# partitions in one shared segment object: its commit compares each partition key, puts it and its
# segment's manifest (two operations each) and the object's directory, and deletes the manifests of the
# segments merged away (storage/shared.py): a third of TXN_MAX_OPS is left to those
SHARED_PARTITIONS = (TXN_MAX_OPS - 1) // 3
# partitions one hand_over_partitions call hands over: two compares and two operations each
HANDOVER_BATCH = TXN_MAX_OPS // 2
SCAN_PAGE = 1000  # keys per etcd range read in MetaStore.scan
SCAN_TURN = 100  # keys MetaStore.scan hands out before it lets other work run
WAL_SCAN_PAGE = 50  # node object directories are larger: fewer per range read
WAL_GETS = 32  # more new directories than this are read by a scan, not one get each
# the largest etcd reply the client takes (gRPC's default, 4 MiB, was less than one page of node object
# directories at 1,000 partitions before directories held rows: about 95 KB each, 50 a page; each
# directory was committed within etcd's 1.5 MiB request limit, so a page is at most 75 MiB)
ETCD_MAX_REPLY_BYTES = 256 << 20
CAS_ATTEMPTS = 50  # a compare-and-swap that keeps losing to other writers gives up after this many tries
# an unconditional write whose outcome etcd left unknown (a timeout, a lost connection) is sent this many times
UNCERTAIN_WRITE_ATTEMPTS = 3


class Contended(RuntimeError):
    """A compare-and-swap kept losing to concurrent writers."""


async def _cas_attempts(what: str) -> AsyncIterator[int]:
    """Attempt numbers for a compare-and-swap loop, with a growing random
    backoff between them; Contended once they are used up."""
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            await asyncio.sleep(random.uniform(0, min(0.001 * 2 ** attempt, 0.2)))
        yield attempt
    raise Contended(f"{what}: etcd compare-and-swap failed {CAS_ATTEMPTS} times (concurrent writers)")


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """host:port[,host:port...] (an http:// prefix is accepted) as (host, port) pairs."""
    out = []
    for ep in endpoints.split(","):
        host, _, port = ep.strip().removeprefix("http://").partition(":")
        out.append((host or "127.0.0.1", int(port or 2379)))
    return out


class MetaStore:
    def __init__(self, endpoints: str, cluster: str = "default", user: str | None = None,
                 password: str | None = None, tls: tuple[str, str, str] | None = None) -> None:
        """tls: (CA bundle, client certificate, client key) PEM paths to speak
        TLS to etcd (certificate and key may be empty)."""
        self.endpoints = parse_endpoints(endpoints)
        self.prefix = f"/kafscale/{cluster}/"
        self.credentials = {"username": user, "password": password} if user else {}
        self.tls = tls
        self.client: Any = None

    @classmethod
    def from_config(cls, cfg: Any) -> MetaStore:
        return cls(cfg.etcd, cfg.cluster, cfg.etcd_user or None, cfg.etcd_password or None,
                   (cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key) if cfg.etcd_ca else None)

    @classmethod
    def in_memory(cls, cluster: str = "test", etcd: Any = None) -> MetaStore:
        """A store over an in-memory etcd twin (unit tests; see metadata/memory.py)."""
        from kafscale.metadata.memory import MemoryEtcd

        store = cls("memory:0", cluster)
        store.client = etcd or MemoryEtcd()
        return store

    def _client(self, host: str, port: int) -> Any:
        options = {"grpc.max_receive_message_length": ETCD_MAX_REPLY_BYTES}
        if self.tls is None:
            return EtcdClient(host=host, port=port, timeout=10, options=options, **self.credentials)
        from kafscale.metadata.etcd_client import TlsEtcdClient, tls_credentials

        return TlsEtcdClient(host=host, port=port, timeout=10, options=options,
                             credentials=tls_credentials(*self.tls), **self.credentials)

    async def start(self) -> None:
        """Connect to the first endpoint that answers (fail fast if none does)."""
        if self.client is not None:  # in_memory
            return
        error: Exception | None = None
        for host, port in self.endpoints:
            client = self._client(host, port)
            try:
                await client.connect()
                await client.status()
            except Exception as exc:
                error = exc
                await client.close()
                continue
            self.client = client
            return
        assert error is not None
        raise error

    async def ping(self) -> None:
        await self.client.status()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def scan(self, prefix: bytes, keys_only: bool = False, page: int = SCAN_PAGE,
                   start: bytes | None = None, end: bytes | None = None, revision: int = 0,
                   changed_after: int = 0) -> AsyncIterator[Any]:
        """Every key-value under prefix (from start, before end, where given),
        read in pages of `page` keys at one revision (the first page's, or the
        one given): a range that grows (a partition's segment manifests, all the
        offsets) is read in replies of a bounded size (see ETCD_MAX_REPLY_BYTES).
        With changed_after, only the keys written after that revision. Other work runs every SCAN_TURN
        keys: a caller parsing a page of 1,000 partition states held the event
        loop for over 10 ms."""
        start, end = start or prefix, end or prefix_range_end(prefix)
        since = changed_after + 1 if changed_after else 0
        while True:
            kvs, more, revision = await self.client.range_page(start, end, page, revision, keys_only, since)
            for i, kv in enumerate(kvs, 1):
                yield kv
                if i % SCAN_TURN == 0:
                    await asyncio.sleep(0)
            if not more or not kvs:
                return
            start = kvs[-1].key + b"\0"

    def k(self, *parts: object) -> bytes:
        """The key of parts under this cluster's prefix, each part escaped
        (see key_part) so that no name's keys fall under another's prefix."""
        return (self.prefix + "/".join(key_part(p) for p in parts)).encode()

    # ------------------------------------------------------------------ topics
    async def create_topic(self, name: str, partitions: int, config: dict[str, str]) -> TopicMeta:
        """One etcd operation whatever the partition count: a partition's key is
        written when it is first claimed (see claim_partition)."""
        meta = TopicMeta(name, uuid.uuid4().bytes, partitions, config)
        tx = self.client.transactions
        ok, _ = await self.client.transaction(compare=[tx.version(self.k("topics", name)) == 0],
                                              success=[tx.put(self.k("topics", name), meta.to_json())], failure=[])
        if not ok:
            raise TopicExists(name)
        return meta

    async def get_topic(self, name: str) -> TopicMeta | None:
        r = await self.client.get(self.k("topics", name))
        return None if r is None else TopicMeta.from_json(name, r.value)

    async def list_topics(self, revision: int = 0) -> list[TopicMeta]:
        """Every topic (as of revision, where given)."""
        base = self.k("topics", "")
        out = []
        async for kv in self.scan(base, revision=revision):
            out.append(TopicMeta.from_json(name_of(kv.key[len(base):]), kv.value))
        return out

    async def watch_topics(self, start_revision: int) -> AsyncIterator[tuple[str, TopicMeta | None]]:
        """Every change of a topic key from start_revision on: (name, its new
        meta), or (name, None) once deleted. Ends with an exception when etcd
        goes away."""
        base = self.k("topics", "")
        async for ev in await self.client.watch_prefix(base, start_revision=start_revision):
            name = name_of(ev.kv.key[len(base):])
            yield name, None if ev.kind == "DELETE" else TopicMeta.from_json(name, ev.kv.value)

    async def follow(self, read: Callable[[int], Awaitable[None]], watch: Callable[[int], AsyncIterator[T]],
                     apply: Callable[[T], Awaitable[None]], what: str, revision: int = 0) -> None:
        """Keep a copy of some keys current, for ever: read(revision) reads
        them all as of one revision, then apply() takes each change watch()
        reports from the next revision on, so nothing written in between is
        missed (reading, then watching from whatever revision the watch
        starts at, missed what was written in between until the next change).
        When etcd goes away, all is read again a second later. With revision,
        the keys were read as of it already: the first pass only watches."""
        while True:
            try:
                if not revision:
                    revision = await self.revision()
                    await read(revision)
                async for change in watch(revision + 1):
                    await apply(change)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("watching %s failed (%r); reading them again in 1 s", what, exc)
            revision = 0
            await asyncio.sleep(1)

    async def delete_topic(self, name: str) -> None:
        tx = self.client.transactions
        ops = [tx.delete(self.k("topics", name))]
        for area in ("partitions", "segments", "owners"):
            start = self.k(area, name, "")
            ops.append(tx.delete(start, prefix_range_end(start)))
        await self.client.transaction(compare=[], success=ops, failure=[])

    async def update_topic(self, name: str, config: dict[str, str] | None = None,
                           partitions: int | None = None) -> TopicMeta:
        """Replace a topic's config and/or grow its partition count, atomically
        against concurrent updates."""
        tx = self.client.transactions
        async for _ in _cas_attempts(f"update of topic {name}"):
            r = await self.client.get(self.k("topics", name))
            if r is None:
                raise KeyError(name)
            meta = TopicMeta.from_json(name, r.value)
            if config is not None:
                meta.config = config
            if partitions is not None:
                meta.partitions = partitions
            ok, _ = await self.client.transaction(compare=[tx.value(self.k("topics", name)) == r.value],
                                                  success=[tx.put(self.k("topics", name), meta.to_json())],
                                                  failure=[])
            if ok:
                return meta

    async def cluster_configs(self) -> dict[str, str]:
        """The dynamic broker configs every broker applies (IncrementalAlterConfigs)."""
        r = await self.client.get(self.k("config", "brokers"))
        return json.loads(r.value) if r else {}

    async def update_cluster_configs(self, change: Callable[[dict[str, str]], dict[str, str]]) -> dict[str, str]:
        """Replace the dynamic broker configs by change(current), atomically against
        concurrent updates (change may raise to refuse)."""
        tx, key = self.client.transactions, self.k("config", "brokers")
        async for _ in _cas_attempts("update of the dynamic broker configs"):
            r = await self.client.get(key)
            new = change(json.loads(r.value) if r else {})
            compare = [tx.value(key) == r.value] if r else [tx.version(key) == 0]
            ok, _ = await self.client.transaction(compare=compare, success=[tx.put(key, json.dumps(new).encode())],
                                                  failure=[])
            if ok:
                return new

    async def set_log_start(self, topic: str, p: int, expected_raw: bytes, new_state: PartitionState,
                            dropped: list[int]) -> bytes:
        """Advance the log start offset and forget the manifests of deleted segments."""
        tx = self.client.transactions
        return await self._fenced_update(topic, p, expected_raw, new_state,
                                         [tx.delete(self.k("segments", topic, p, f"{b:020d}")) for b in dropped])

    async def _fenced_update(self, topic: str, p: int, expected_raw: bytes, new_state: PartitionState,
                             ops: list[Any], also: tuple[Any, ...] = ()) -> bytes:
        """Write the partition's new state (with `ops`) only if it still holds
        exactly what this owner last wrote (and the compares `also` hold);
        otherwise raise Fenced."""
        tx = self.client.transactions
        key = self.k("partitions", topic, p)
        new_raw = new_state.to_json()
        ok, _ = await self.client.transaction(compare=[tx.value(key) == expected_raw, *also],
                                              success=[*ops, tx.put(key, new_raw)], failure=[])
        if not ok:
            raise Fenced(f"{topic}/{p}")
        return new_raw

    # ------------------------------------------------------------ node objects
    async def create_fence(self, fence: str, lease: Any) -> None:
        await self.client.put(self.k("fences", fence), b"", lease=lease)

    async def delete_fence(self, fence: str) -> None:
        await self.client.delete(self.k("fences", fence))

    async def commit_wal(self, fence: str, directories: list[tuple[int, bytes]]) -> None:
        """Commit node objects (seq, directory) in one transaction, whatever the
        partitions in them, comparing one key (our fence: Fenced once a claim
        deleted it)."""
        tx = self.client.transactions
        ok, _ = await self.client.transaction(
            compare=[tx.version(self.k("fences", fence)) > 0],
            success=[tx.put(self.wal_key(fence, seq), raw) for seq, raw in directories], failure=[])
        if not ok:
            raise Fenced(f"fence {fence} was taken")

    async def commit_shared(self, fence: str, seq: int, directory: bytes,
                            parts: list[tuple[str, int, bytes, bytes, SegmentManifest, list[int]]]) -> bool:
        """Commit a shared segment object in one transaction: for each (topic,
        partition, the value its owner last wrote, its new value, manifest, base
        offsets of the segments it merged away) the partition key is compared
        and moved, the manifest put (over the first merged segment's, at the
        same base) and the others' manifests deleted, and the directory goes
        under shared/{fence}/{seq}. False (nothing written) if any partition key
        holds something else."""
        tx = self.client.transactions
        ops = [tx.put(self.k("shared", fence, f"{seq:012d}"), directory)]
        compare = []
        for topic, p, raw, state, m, gone in parts:
            key = self.k("partitions", topic, p)
            compare.append(tx.value(key) == raw)
            ops += [tx.put(key, state), tx.put(self.k("segments", topic, p, f"{m.base:020d}"), m.to_json())]
            ops += [tx.delete(self.k("segments", topic, p, f"{base:020d}")) for base in gone if base != m.base]
        assert len(parts) <= TXN_MAX_OPS and len(ops) <= TXN_MAX_OPS, "see SHARED_PARTITIONS"
        ok, _ = await self.client.transaction(compare=compare, success=ops, failure=[])
        return bool(ok)

    async def fences(self) -> set[str]:
        """The fence ids of the log processes that may commit node objects now."""
        base = self.k("fences", "")
        return {kv.key[len(base):].decode() async for kv in self.scan(base, keys_only=True)}

    async def wal_directories(self, area: str = "wal") -> list[tuple[bytes, bytes]]:
        """(key, directory) of every committed node object not yet compacted
        away (area "wal"), or of every shared segment object ("shared")."""
        return [(kv.key, kv.value) async for kv in self.scan(self.k(area, ""), page=WAL_SCAN_PAGE)]

    async def wal_directories_of(self, keys: list[bytes], area: str = "wal") -> dict[bytes, bytes]:
        """The committed directories of these keys of one area (those forgotten
        since are left out): one get each when they are few, else a paged scan
        of each fence's keys from the first to the last of them (a thousand
        gets at once held the event loop past a 2 s lease; a fence's seqs are
        zero-padded, so its new directories are one range, where a scan of
        the whole area read every directory already known once more)."""
        if len(keys) > WAL_GETS:
            want, spans = set(keys), {}
            for k in sorted(keys):
                spans.setdefault(k.rpartition(b"/")[0], []).append(k)
            return {kv.key: kv.value for ks in spans.values()
                    async for kv in self.scan(self.k(area, ""), page=WAL_SCAN_PAGE, start=ks[0], end=ks[-1] + b"\0")
                    if kv.key in want}
        got = await asyncio.gather(*(self.client.get(k) for k in keys))
        return {k: bytes(kv.value) for k, kv in zip(keys, got, strict=True) if kv is not None}

    def wal_key(self, fence: str, seq: int) -> bytes:
        """The etcd key of a node object's directory (commit_wal)."""
        return self.k("wal", fence, f"{seq:012d}")

    async def wal_keys(self, area: str = "wal") -> list[bytes]:
        return [kv.key async for kv in self.scan(self.k(area, ""), keys_only=True)]

    async def forget_wal(self, keys: list[bytes]) -> None:
        tx = self.client.transactions
        await self._write_all([tx.delete(k) for k in keys])

    async def revision(self) -> int:
        """etcd's current revision."""
        key = self.k("")
        return (await self.client.range_page(key, key + b"\0", 1, 0, True))[2]

    async def compact_history(self, revision: int) -> None:
        """Drop the versions of keys that were replaced or deleted before
        revision (etcd's compaction: the whole etcd, not one namespace). Done
        already, by another cluster's broker or etcd itself, is done."""
        try:
            await self.client.compact(revision)
        except aetcd.exceptions.ClientError as exc:
            if "required revision has been compacted" not in str(exc):
                raise

    async def set_draining(self, broker_id: int, draining: bool) -> None:
        if draining:
            await self.client.put(self.k("draining", broker_id), b"1")
        else:
            await self.client.delete(self.k("draining", broker_id))

    async def draining(self) -> set[int]:
        base = self.k("draining", "")
        return {int(kv.key[len(base):]) async for kv in self.scan(base, keys_only=True)}

    async def list_brokers(self) -> list[tuple[int, str, int]]:
        base = self.k("brokers", "")
        out = []
        async for kv in self.scan(base):
            d = json.loads(kv.value)
            out.append((int(kv.key[len(base):].decode()), d["host"], d["port"]))
        return sorted(out)

    # -------------------------------------------------------------- partitions
    async def watermarks(self, topic: str, p: int) -> tuple[int, int]:
        """(high watermark, log start offset) of a partition; (0, 0) if never claimed."""
        cur = await self.get_partition(topic, p)
        return PartitionState.watermarks(cur[0] if cur else None)

    async def get_partition(self, topic: str, p: int) -> tuple[PartitionState, bytes] | None:
        r = await self.client.get(self.k("partitions", topic, p))
        if r is None:
            return None
        return PartitionState(**json.loads(r.value)), r.value

    async def claim_partition(self, topic: str, p: int, broker_id: int, fence: str = ""
                              ) -> tuple[PartitionState, bytes]:
        """Take ownership with a new epoch; returns the state and its raw value.
        A partition never claimed has no key yet: the first claim creates it,
        and only while the topic exists (KeyError once it was deleted). The
        fence of the previous owner's log process, if another one's, is
        deleted in the same transaction: none of its node objects commits after."""
        key, topic_key = self.k("partitions", topic, p), self.k("topics", topic)
        tx = self.client.transactions
        async for _ in _cas_attempts(f"claim of {topic}/{p}"):
            cur = await self.client.get(key)
            same, new, old_fence = self._claim(key, cur.value if cur is not None else None, broker_id, fence)
            new_raw = new.to_json()
            ops = [tx.put(key, new_raw), *([tx.delete(self.k("fences", old_fence))] if old_fence else [])]
            ok, _ = await self.client.transaction(compare=[same, tx.version(topic_key) > 0], success=ops, failure=[])
            if ok:
                return new, new_raw
            if await self.client.get(topic_key) is None:
                raise KeyError(f"topic {topic} does not exist")

    def _claim(self, key: bytes, cur: bytes | None, broker_id: int, fence: str) -> tuple[Any, PartitionState, str]:
        """A claim of the partition whose key holds cur (None: no key yet): the
        compare that the key did not move, the state with the next epoch, and
        the previous owner's fence if another log process's ("" if none)."""
        tx = self.client.transactions
        state = PartitionState(**json.loads(cur)) if cur else PartitionState(-1, 0, 0, 0)
        same = tx.value(key) == cur if cur else tx.version(key) == 0
        new = PartitionState(broker_id, state.epoch + 1, state.hw, state.log_start, fence)
        return same, new, state.fence if state.fence != fence else ""

    async def claim_partitions(self, topic: str, parts: list[int], broker_id: int, lease: Any, fence: str = ""
                               ) -> dict[int, tuple[PartitionState, bytes]]:
        """What claim_owner and then claim_partition do, for up to CLAIM_BATCH
        partitions of a topic at once: one transaction reads their owner and
        partition keys, one more owns (on our lease) and claims those nobody
        else owns, if none of their keys moved in between and the topic still
        exists. Returns the claimed ones' new state and raw value: none if the
        second transaction failed, never one another broker owns. The caller
        claims the rest one by one, which tells why."""
        assert len(parts) <= CLAIM_BATCH
        tx = self.client.transactions
        me = str(broker_id).encode()
        keys = [(self.k("owners", topic, p), self.k("partitions", topic, p)) for p in parts]
        _, read = await self.client.transaction(compare=[], success=[tx.get(k) for pk in keys for k in pk], failure=[])
        compare, ops, claimed = [tx.version(self.k("topics", topic)) > 0], [], {}
        old_fences = set()
        for p, (owner_key, key), owner, cur in zip(parts, keys, read[::2], read[1::2], strict=True):
            if owner and owner[0][0] != me:
                continue
            same, new, old_fence = self._claim(key, cur[0][0] if cur else None, broker_id, fence)
            compare += [tx.value(owner_key) == me if owner else tx.version(owner_key) == 0, same]
            claimed[p] = new, new.to_json()
            ops += [tx.put(owner_key, me, lease=lease), tx.put(key, claimed[p][1])]
            if old_fence:
                old_fences.add(old_fence)
        if not claimed:
            return {}
        ops += [tx.delete(self.k("fences", f)) for f in sorted(old_fences)]
        ok, _ = await self.client.transaction(compare=compare, success=ops, failure=[])
        return claimed if ok else {}

    async def commit_segment(self, topic: str, p: int, expected_raw: bytes, new_state: PartitionState,
                             manifest: SegmentManifest) -> bytes:
        """Atomically record a segment and move the high watermark."""
        tx = self.client.transactions
        return await self._fenced_update(topic, p, expected_raw, new_state,
                                         [tx.put(self.k("segments", topic, p, f"{manifest.base:020d}"),
                                                 manifest.to_json())])

    async def segment_counts(self) -> dict[TopicPartition, int]:
        """Committed segments per partition of every topic (keys only, one paged scan)."""
        base = self.k("segments", "")
        out: dict[TopicPartition, int] = {}
        async for kv in self.scan(base, keys_only=True):
            topic, p, _ = kv.key[len(base):].decode().split("/", 2)
            key = TopicPartition(name_of(topic), int(p))
            out[key] = out.get(key, 0) + 1
        return out

    async def segment_bytes(self) -> dict[TopicPartition, int]:
        """Bytes in committed segments per partition of every topic (one paged scan)."""
        base = self.k("segments", "")
        out: dict[TopicPartition, int] = {}
        async for kv in self.scan(base):
            topic, p, _ = kv.key[len(base):].decode().split("/", 2)
            key = TopicPartition(name_of(topic), int(p))
            out[key] = out.get(key, 0) + json.loads(kv.value)["size"]
        return out

    async def _partition_keys(self, revision: int = 0, changed_after: int = 0
                              ) -> AsyncIterator[tuple[TopicPartition, Any]]:
        """(partition, state as JSON) of every partition ever claimed (at
        revision; written after changed_after), in one paged scan."""
        base = self.k("partitions", "")
        async for kv in self.scan(base, revision=revision, changed_after=changed_after):
            yield _topic_partition(kv.key, base), json.loads(kv.value)

    async def partition_states(self) -> dict[TopicPartition, PartitionState]:
        """The state of every partition ever claimed."""
        return {tp: PartitionState(**state) async for tp, state in self._partition_keys()}

    async def partition_marks(self, changed_after: int = 0) -> tuple[dict[str, dict[int, tuple[int, int]]], int]:
        """The high watermark and the log start offset of every partition
        claimed whose state was written after revision changed_after (0: of
        every one ever claimed), by topic and partition, and the revision
        read (the next call's changed_after). Tuples, not PartitionState: the
        collector's pass at 10,000 partitions made 40,000 objects of
        partition_states() at once, and the garbage collector's scan of them
        held the event loop for 40-70 ms."""
        revision = await self.revision()
        marks: dict[str, dict[int, tuple[int, int]]] = {}
        async for (topic, p), state in self._partition_keys(revision, changed_after):
            marks.setdefault(topic, {})[p] = state["hw"], state["log_start"]
        return marks, revision

    async def list_segments(self, topic: str, p: int) -> list[SegmentManifest]:
        out = [SegmentManifest(**json.loads(kv.value))
               async for kv in self.scan(self.k("segments", topic, p, ""))]
        out.sort(key=lambda m: m.base)
        return out

    # ---------------------------------------------------------------- offsets
    async def _write_all(self, ops: list[Any]) -> None:
        """Unconditional writes, one transaction per TXN_MAX_OPS operations
        (etcd refuses larger ones): all-or-nothing within each.

        A transaction whose outcome is unknown (the client's deadline passed
        or the connection dropped: etcd may still apply it) is sent again
        until etcd answers, up to UNCERTAIN_WRITE_ATTEMPTS times. The writes
        are idempotent, and the copy sent again is proposed after the first,
        so once this returns no earlier copy can land later.
        Without it a timed-out OffsetCommit was answered with an error, the
        client's next commit of the same partition was written, and then the
        first one could still be applied over it: the committed offset went
        back."""
        for i in range(0, len(ops), TXN_MAX_OPS):
            chunk = ops[i:i + TXN_MAX_OPS]
            for attempt in range(1, UNCERTAIN_WRITE_ATTEMPTS + 1):
                try:
                    await self.client.transaction(compare=[], success=chunk, failure=[])
                    break
                except (aetcd.exceptions.ConnectionTimeoutError, aetcd.exceptions.ConnectionFailedError) as exc:
                    if attempt == UNCERTAIN_WRITE_ATTEMPTS:
                        raise
                    log.warning("etcd write of %d keys: outcome unknown (%r), sending it again", len(chunk), exc)

    async def commit_offsets(self, group: str, offsets: dict[TopicPartition, dict[str, Any]]) -> None:
        """Write a group's committed offsets: atomically up to TXN_MAX_OPS
        partitions (a commit of more is written in that many per transaction)."""
        tx = self.client.transactions
        await self._write_all([tx.put(self.k("offsets", group, t, p), json.dumps(v).encode())
                               for (t, p), v in offsets.items()])

    async def fetch_offsets(self, group: str) -> dict[TopicPartition, dict[str, Any]]:
        base = self.k("offsets", group, "")
        out = {}
        async for kv in self.scan(base):
            out[_topic_partition(kv.key, base)] = json.loads(kv.value)
        return out

    async def forget_offsets(self, group: str, partitions: list[TopicPartition]) -> None:
        """Delete a group's committed offsets of these partitions."""
        tx = self.client.transactions
        await self._write_all([tx.delete(self.k("offsets", group, t, p)) for t, p in partitions])

    async def delete_offsets(self, group: str, topic: str | None = None) -> None:
        start = self.k("offsets", group, "") if topic is None else self.k("offsets", group, topic, "")
        await self.client.delete_range(start, prefix_range_end(start))

    # ----------------------------------------------------------------- groups
    # ------------------------------------------------------------ processors
    async def save_checkpoint(self, processor: str, topic: str, offsets: dict[int, int]) -> None:
        """A processor's next offset per partition of topic, in one transaction."""
        tx = self.client.transactions
        await self._write_all([tx.put(self.k("processors", processor, topic, p), str(o).encode())
                               for p, o in offsets.items()])

    async def load_checkpoint(self, processor: str, topic: str) -> dict[int, int]:
        prefix = self.k("processors", processor, topic, "")
        return {int(kv.key[len(prefix):]): int(kv.value) async for kv in self.scan(prefix)}

    async def save_group(self, group: str, state: dict[str, Any]) -> None:
        await self.client.put(self.k("groups", group), json.dumps(state).encode())

    async def delete_group(self, group: str) -> None:
        await self.client.delete(self.k("groups", group))
        await self.delete_offsets(group)

    async def group_names_with_offsets(self) -> set[str]:
        base = self.k("offsets", "")
        return {name_of(kv.key[len(base):].decode().split("/", 1)[0])
                async for kv in self.scan(base, keys_only=True)}

    # ------------------------------------------------------------- producers
    async def next_producer_id(self) -> int:
        key = self.k("producer_ids")
        tx = self.client.transactions
        async for _ in _cas_attempts("producer id allocation"):
            r = await self.client.get(key)
            cur = int(r.value) if r is not None else 0
            cmp = tx.value(key) == r.value if r is not None else tx.version(key) == 0
            ok, _ = await self.client.transaction(compare=[cmp], success=[tx.put(key, str(cur + 1).encode())],
                                                  failure=[])
            if ok:
                return cur + 1

    # ----------------------------------------------------------- ownership
    async def claim_owner(self, topic: str, p: int, broker_id: int, lease: Any) -> bool:
        """Own a partition on our lease: if nobody owns it, or we do (e.g. under
        the lease of our previous process)."""
        key, me = self.k("owners", topic, p), str(broker_id).encode()
        tx = self.client.transactions
        for cmp in (tx.version(key) == 0, tx.value(key) == me):
            ok, _ = await self.client.transaction(compare=[cmp], success=[tx.put(key, me, lease=lease)], failure=[])
            if ok:
                return True
        return False

    async def hand_over(self, topic: str, p: int, expected_raw: bytes, new_state: PartitionState,
                        broker_id: int) -> bytes | None:
        """Write the partition's new state (our fence cleared) and give up its
        ownership in one transaction, if both keys still hold what we wrote:
        the state written, or None (then take the two steps apart,
        set_log_start and release_owner, to learn which key moved). Before
        it, a partition handed over took two transactions."""
        return (await self.hand_over_partitions(topic, [(p, expected_raw, new_state)], broker_id)).get(p)

    async def hand_over_partitions(self, topic: str, parts: list[tuple[int, bytes, PartitionState]],
                                   broker_id: int) -> dict[int, bytes]:
        """What hand_over does, for up to HANDOVER_BATCH partitions of a topic
        (each with the state it compares and its new state) in one
        transaction: the new states written, or none when any key moved (then
        hand each over alone). A stopping broker with 10,000 partitions made a
        transaction a partition."""
        assert len(parts) <= HANDOVER_BATCH
        tx, me = self.client.transactions, str(broker_id).encode()
        compare, ops, written = [], [], {}
        for p, expected_raw, new_state in parts:
            key, owner = self.k("partitions", topic, p), self.k("owners", topic, p)
            written[p] = new_state.to_json()
            compare += [tx.value(key) == expected_raw, tx.value(owner) == me]
            ops += [tx.put(key, written[p]), tx.delete(owner)]
        ok, _ = await self.client.transaction(compare=compare, success=ops, failure=[])
        return written if ok else {}

    async def release_owner(self, topic: str, p: int, broker_id: int) -> None:
        key = self.k("owners", topic, p)
        tx = self.client.transactions
        await self.client.transaction(compare=[tx.value(key) == str(broker_id).encode()],
                                      success=[tx.delete(key)], failure=[])

    async def owners(self, revision: int = 0) -> dict[TopicPartition, int]:
        """The owner of each claimed partition (as of revision, where given)."""
        base = self.k("owners", "")
        return {_topic_partition(kv.key, base): int(kv.value) async for kv in self.scan(base, revision=revision)}

    async def watch_owners(self, start_revision: int) -> AsyncIterator[tuple[TopicPartition, int | None]]:
        """Every change of a partition's owner from start_revision on: (the
        partition, its new owner), or (the partition, None) once released."""
        base = self.k("owners", "")
        async for ev in await self.client.watch_prefix(base, start_revision=start_revision):
            yield _topic_partition(ev.kv.key, base), None if ev.kind == "DELETE" else int(ev.kv.value)

    async def claimed_partitions(self) -> set[TopicPartition]:
        """Every partition ever claimed (it has a state key): no other holds records."""
        base = self.k("partitions", "")
        return {_topic_partition(kv.key, base) async for kv in self.scan(base, keys_only=True)}

    async def owner_of(self, topic: str, p: int) -> int | None:
        r = await self.client.get(self.k("owners", topic, p))
        return None if r is None else int(r.value)

    async def load_group(self, group: str) -> dict[str, Any] | None:
        r = await self.client.get(self.k("groups", group))
        return None if r is None else json.loads(r.value)

    # --------------------------------------------------------------- security
    async def put_user(self, name: str, credentials: dict[str, Any]) -> None:
        await self.client.put(self.k("users", name), json.dumps(credentials).encode())

    async def get_user(self, name: str) -> dict[str, Any] | None:
        r = await self.client.get(self.k("users", name))
        return None if r is None else json.loads(r.value)

    async def delete_user(self, name: str) -> bool:
        return bool(await self.client.delete(self.k("users", name)))

    async def list_users(self) -> list[str]:
        base = self.k("users", "")
        return sorted([name_of(kv.key[len(base):]) async for kv in self.scan(base, keys_only=True)])

    async def put_acls(self, acls: list[AclBinding]) -> None:
        tx = self.client.transactions
        await self._write_all([tx.put(self.k("acls", a.id), a.to_json()) for a in acls])

    async def delete_acls(self, acls: list[AclBinding]) -> None:
        tx = self.client.transactions
        await self._write_all([tx.delete(self.k("acls", a.id)) for a in acls])

    async def list_acls(self) -> list[AclBinding]:
        return sorted([AclBinding.from_json(kv.value) async for kv in self.scan(self.k("acls", ""))])

    # ---------------------------------------------------------------- brokers
    async def register_broker(self, broker_id: int, host: str, port: int, ttl: int) -> Any:
        lease = await self.client.lease(ttl)
        await self.client.put(self.k("brokers", broker_id), json.dumps({"host": host, "port": port}).encode(),
                              lease=lease)
        return lease
