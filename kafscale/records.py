"""Producing and consuming records over the Kafka protocol, for `kafscale
produce`, `kafscale consume` and the console's record browser.

A `Producer` sends acks=all batches to each partition's leader, keyed records
to the partition Kafka's Java client picks (murmur2 of the key), retrying
what a retriable error refused. A `Consumer` fetches from the leaders, from a
start (earliest, latest, an offset, a time) or, with a group, from the
group's committed offsets, as a member of that group (range assignment,
heartbeats, commits, leaving on stop) next to any other client's members."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafscale import _native
from kafscale.client import (
    Cluster,
    KafkaClient,
    decode_assignment,
    decode_subscription,
    encode_assignment,
    encode_subscription,
    offset_fetch_topics,
)
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.types import EARLIEST, LATEST

FETCH_WAIT_MS = 500
PARTITION_FETCH_BYTES = 1 << 20
SEND_ATTEMPTS = 6
SESSION_TIMEOUT_MS, REBALANCE_TIMEOUT_MS, HEARTBEAT_S = 10_000, 30_000, 3.0


@dataclass
class Record:
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


def murmur2(data: bytes) -> int:
    """Kafka's Utils.murmur2 (seed 0x9747b28c), as a signed 32-bit int."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    h = (0x9747B28C ^ len(data)) & mask
    n4 = len(data) // 4
    for i in range(n4):
        k = int.from_bytes(data[i * 4:i * 4 + 4], "little")
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[n4 * 4:]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a keyed record."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def _check(code: int, what: str) -> None:
    if code:
        raise KafkaError(code, what)


async def list_offsets(c: Cluster, wanted: dict[str, list[int]], ts: int) -> dict[tuple[str, int], int]:
    """Each partition's offset for a timestamp (EARLIEST, LATEST or ms), asked of its leader;
    -1 where no record is that recent."""
    by_node: dict[int, tuple[KafkaClient, dict[str, list[int]]]] = {}
    for topic, parts in wanted.items():
        for p in parts:
            node, client = await c.leader(topic, p)
            by_node.setdefault(node, (client, {}))[1].setdefault(topic, []).append(p)
    out = {}
    for client, topics in by_node.values():
        resp = await client.request(schemas.LIST_OFFSETS.key, {"replica_id": -1, "isolation_level": 0, "topics": [
            {"name": t, "partitions": [{"partition_index": p, "timestamp": ts} for p in parts]}
            for t, parts in topics.items()]})
        for t in resp["topics"]:
            for p in t["partitions"]:
                _check(p["error_code"], f"offsets of {t['name']}/{p['partition_index']}")
                out[(t["name"], p["partition_index"])] = p["offset"]
    return out


class Producer:
    def __init__(self, cluster: Cluster, topic: str, codec: int = 0, timeout_ms: int = 30_000) -> None:
        self.cluster, self.topic, self.codec, self.timeout_ms = cluster, topic, codec, timeout_ms
        self._sticky = 0

    async def start(self) -> None:
        await self.cluster.topics([self.topic], auto_create=True)

    async def send(self, records: list[tuple[bytes | None, bytes | None]]) -> list[tuple[int, str]]:
        """Write records (key, value) with acks=all; returns (index, error) for each record not written."""
        n = self.cluster.partitions[self.topic]
        self._sticky = (self._sticky + 1) % n  # keyless records of one call go to one partition
        pending: dict[int, list[int]] = {}
        for i, (key, _value) in enumerate(records):
            pending.setdefault(self._sticky if key is None else partition_for(key, n), []).append(i)
        failed: dict[int, str] = {}
        now = int(time.time() * 1000)
        batches = {p: _native.build_batch([(now, records[i][0], records[i][1], []) for i in idx], self.codec)
                   for p, idx in pending.items()}
        for attempt in range(SEND_ATTEMPTS):
            retry = await self._send_once(batches, pending, failed)
            if not retry:
                break
            batches = {p: batches[p] for p in retry}
            await asyncio.sleep(0.2 * 2 ** attempt)
            await self.cluster.topics([self.topic])
        else:
            for p in batches:
                failed.update({i: failed.get(i, "no leader answered") for i in pending[p]})
        return sorted(failed.items())

    async def _send_once(self, batches: dict[int, bytes], pending: dict[int, list[int]],
                         failed: dict[int, str]) -> list[int]:
        """One Produce per leader; returns the partitions worth another try."""
        by_node: dict[int, list[int]] = {}
        for p in batches:
            by_node.setdefault(self.cluster.leaders.get((self.topic, p), -1), []).append(p)
        retry = by_node.pop(-1, [])
        for node, parts in by_node.items():
            try:
                client = await self.cluster.node(node)
                resp = await client.request(schemas.PRODUCE.key, {
                    "transactional_id": None, "acks": -1, "timeout_ms": self.timeout_ms, "topic_data": [
                        {"name": self.topic, "partition_data": [{"index": p, "records": batches[p]} for p in parts]}]})
            except OSError as exc:
                await self.cluster.drop(node)
                for p in parts:
                    failed.update(dict.fromkeys(pending[p], str(exc)))
                retry += parts
                continue
            for r in resp["responses"][0]["partition_responses"]:
                p, code = r["index"], ErrorCode(r["error_code"])
                if code:
                    why = code.name + (f": {r['error_message']}" if r.get("error_message") else "")
                    failed.update(dict.fromkeys(pending[p], why))
                    if code.retriable:
                        retry.append(p)
                else:
                    for i in pending[p]:
                        failed.pop(i, None)
        return retry


def decode_records(partition: int, buf: bytes, start: int) -> tuple[list[Record], int]:
    """The records at or after `start` in a Fetch response's record batches,
    and the offset after the last whole batch (start when there is none)."""
    out, next_offset = [], start
    for b in _native.scan_batches(buf, True, True):
        next_offset = max(next_offset, b.last_offset + 1)
        if b.is_control:
            continue
        for off, ts, key, value, headers in _native.iter_records(b, buf):
            if off >= start:
                out.append(Record(partition, off, ts, key, value, headers))
    return out, next_offset


@dataclass
class FetchResult:
    records: list[Record]
    next_offset: int
    high_watermark: int
    log_start: int


async def fetch(client: KafkaClient, topic: str, positions: dict[int, int],
                wait_ms: int = FETCH_WAIT_MS) -> dict[int, FetchResult | ErrorCode]:
    """One Fetch of these partitions (all led by `client`'s broker)."""
    resp = await client.request(schemas.FETCH.key, {
        "replica_id": -1, "max_wait_ms": wait_ms, "min_bytes": 1, "max_bytes": 8 * PARTITION_FETCH_BYTES,
        "isolation_level": 0, "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "",
        "topics": [{"topic": topic, "topic_id": bytes(16), "partitions": [
            {"partition": p, "fetch_offset": pos, "partition_max_bytes": PARTITION_FETCH_BYTES}
            for p, pos in positions.items()]}]})
    _check(resp.get("error_code", 0), f"fetch {topic}")
    out: dict[int, FetchResult | ErrorCode] = {}
    for t in resp["responses"]:
        for p in t["partitions"]:
            i = p["partition_index"]
            if p["error_code"]:
                out[i] = ErrorCode(p["error_code"])
                continue
            records, next_offset = decode_records(i, bytes(p["records"] or b""), positions[i])
            out[i] = FetchResult(records, next_offset, p["high_watermark"], p["log_start_offset"])
    return out


@dataclass(frozen=True)
class Start:
    """Where a consumer without a committed offset begins: EARLIEST, LATEST,
    an offset (kind "offset") or the first record at or after a time in ms (kind "time")."""
    kind: str = "latest"
    value: int = 0


class GroupMember:
    """One member of a consumer group ("consumer" protocol, range assignor)."""

    def __init__(self, cluster: Cluster, group: str, topics: list[str]) -> None:
        self.cluster, self.group, self.topics = cluster, group, topics
        self.member_id, self.generation = "", -1
        self.rejoin = asyncio.Event()
        self._coordinator: KafkaClient | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    async def _call(self, api: schemas.Api, body: dict[str, Any]) -> dict[str, Any]:
        if self._coordinator is None:
            self._coordinator = await self.cluster.coordinator(self.group)
        try:
            return await self._coordinator.request(api.key, body)
        except OSError:
            self._coordinator = None
            raise

    async def join(self) -> dict[str, list[int]]:
        """Join (or rejoin) and return this member's assignment."""
        self._stop_heartbeat()
        for _attempt in range(20):
            self.rejoin.clear()
            resp = await self._call(schemas.JOIN_GROUP, {
                "group_id": self.group, "session_timeout_ms": SESSION_TIMEOUT_MS,
                "rebalance_timeout_ms": REBALANCE_TIMEOUT_MS, "member_id": self.member_id,
                "group_instance_id": None, "protocol_type": "consumer", "reason": None,
                "protocols": [{"name": "range", "metadata": encode_subscription(self.topics)}]})
            code = ErrorCode(resp["error_code"])
            if code == ErrorCode.MEMBER_ID_REQUIRED:
                self.member_id = resp["member_id"]
                continue
            if code in (ErrorCode.UNKNOWN_MEMBER_ID, ErrorCode.ILLEGAL_GENERATION):
                self.member_id = ""
                continue
            if code.retriable or code == ErrorCode.REBALANCE_IN_PROGRESS:
                self._coordinator = None
                await asyncio.sleep(0.5)
                continue
            _check(code, f"join group {self.group}")
            self.member_id, self.generation = resp["member_id"], resp["generation_id"]
            assignments = []
            if resp["leader"] == self.member_id:
                assignments = [{"member_id": m, "assignment": encode_assignment(a)}
                               for m, a in (await self._assign(resp["members"])).items()]
            sync = await self._call(schemas.SYNC_GROUP, {
                "group_id": self.group, "generation_id": self.generation, "member_id": self.member_id,
                "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range",
                "assignments": assignments})
            code = ErrorCode(sync["error_code"])
            if code in (ErrorCode.REBALANCE_IN_PROGRESS, ErrorCode.ILLEGAL_GENERATION, ErrorCode.UNKNOWN_MEMBER_ID):
                continue
            _check(code, f"sync group {self.group}")
            self._heartbeat = asyncio.create_task(self._beat())
            return decode_assignment(bytes(sync["assignment"]))
        raise KafkaError(ErrorCode.REBALANCE_IN_PROGRESS, f"group {self.group} did not settle")

    async def _assign(self, members: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
        """Kafka's range assignor: each topic's partitions in contiguous runs over its sorted subscribers."""
        subs = {m["member_id"]: decode_subscription(bytes(m["metadata"])) for m in members}
        counts = {t["name"]: len(t["partitions"]) for t in await self.cluster.topics(
            sorted({t for ts in subs.values() for t in ts}))}
        out: dict[str, dict[str, list[int]]] = {m: {} for m in subs}
        for topic, n in counts.items():
            takers = sorted(m for m, ts in subs.items() if topic in ts)
            per, extra = divmod(n, len(takers))
            for i, m in enumerate(takers):
                first = i * per + min(i, extra)
                out[m][topic] = list(range(first, first + per + (i < extra)))
        return out

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                resp = await self._call(schemas.HEARTBEAT, {"group_id": self.group, "generation_id": self.generation,
                                                            "member_id": self.member_id, "group_instance_id": None})
                code = resp["error_code"]
            except (OSError, KafkaError):
                code = ErrorCode.COORDINATOR_NOT_AVAILABLE
            if code:
                self.rejoin.set()
                return

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None

    async def committed(self, topic: str, parts: list[int]) -> dict[int, int]:
        resp = await self._call(schemas.OFFSET_FETCH, {
            "group_id": self.group, "require_stable": False, "topics": [{"name": topic, "partition_indexes": parts}],
            "groups": [{"group_id": self.group, "topics": [{"name": topic, "partition_indexes": parts}]}]})
        topics = offset_fetch_topics(resp)
        return {p["partition_index"]: p["committed_offset"] for t in topics for p in t["partitions"]
                if p["committed_offset"] >= 0}

    async def commit(self, topic: str, positions: dict[int, int]) -> None:
        resp = await self._call(schemas.OFFSET_COMMIT, {
            "group_id": self.group, "generation_id_or_member_epoch": self.generation, "member_id": self.member_id,
            "group_instance_id": None, "topics": [{"name": topic, "partitions": [
                {"partition_index": p, "committed_offset": off, "committed_metadata": ""}
                for p, off in sorted(positions.items())]}]})
        for p in resp["topics"][0]["partitions"]:
            code = ErrorCode(p["error_code"])
            if code in (ErrorCode.REBALANCE_IN_PROGRESS, ErrorCode.ILLEGAL_GENERATION, ErrorCode.UNKNOWN_MEMBER_ID):
                self.rejoin.set()
            _check(code, f"commit {topic}/{p['partition_index']} for group {self.group}")

    async def leave(self) -> None:
        self._stop_heartbeat()
        if self.member_id:
            await self._call(schemas.LEAVE_GROUP, {"group_id": self.group, "member_id": self.member_id, "members": [
                {"member_id": self.member_id, "group_instance_id": None, "reason": "kafscale consume stopped"}]})


class Consumer:
    def __init__(self, cluster: Cluster, topic: str, start: Start, partitions: list[int] | None = None,
                 group: str | None = None) -> None:
        self.cluster, self.topic, self.start = cluster, topic, start
        self.only = partitions
        self.member = GroupMember(cluster, group, [topic]) if group else None
        self.positions: dict[int, int] = {}

    async def _starting_offsets(self, parts: list[int]) -> dict[int, int]:
        if self.start.kind == "offset":
            return dict.fromkeys(parts, self.start.value)
        ts = {"earliest": EARLIEST, "latest": LATEST}.get(self.start.kind, self.start.value)
        found = await list_offsets(self.cluster, {self.topic: parts}, ts)
        ends = await list_offsets(self.cluster, {self.topic: parts}, LATEST) if self.start.kind == "time" else found
        return {p: found[(self.topic, p)] if found[(self.topic, p)] >= 0 else ends[(self.topic, p)] for p in parts}

    async def _assign(self) -> None:
        """Positions for the partitions this consumer reads now."""
        if self.member is None:
            [t] = await self.cluster.topics([self.topic])
            parts = sorted(p["partition_index"] for p in t["partitions"])
            if self.only is not None:
                unknown = ", ".join(map(str, sorted(set(self.only) - set(parts))))
                if unknown:
                    raise KafkaError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"{self.topic} has no partition {unknown}")
                parts = sorted(self.only)
            self.positions = await self._starting_offsets(parts)
            return
        parts = (await self.member.join()).get(self.topic, [])
        committed = await self.member.committed(self.topic, parts) if parts else {}
        fresh = await self._starting_offsets([p for p in parts if p not in committed]) if parts else {}
        self.positions = {**fresh, **committed}

    async def run(self, emit: Callable[[list[Record]], None], max_records: int | None = None,
                  exit_at_end: bool = False, stop: asyncio.Event | None = None) -> int:
        """Emit records until max_records, the end of every partition (exit_at_end) or `stop`; returns the count."""
        stop = stop or asyncio.Event()
        await self.cluster.topics([self.topic])
        await self._assign()
        count = 0
        try:
            while not stop.is_set() and (max_records is None or count < max_records):
                if self.member is not None and self.member.rejoin.is_set():
                    await self._assign()
                got, at_end = await self._round(emit, None if max_records is None else max_records - count)
                count += got
                if exit_at_end and at_end and (self.member is None or not self.member.rejoin.is_set()):
                    break
                if not self.positions:
                    await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=FETCH_WAIT_MS / 1000)
        finally:
            if self.member is not None:
                await self._commit()
                await self.member.leave()
        return count

    async def _round(self, emit: Callable[[list[Record]], None], room: int | None) -> tuple[int, bool]:
        """One Fetch per leader: emits, advances positions, and commits when in a group."""
        by_node: dict[int, dict[int, int]] = {}
        for p, pos in self.positions.items():
            node, _ = await self.cluster.leader(self.topic, p)
            by_node.setdefault(node, {})[p] = pos
        results = await asyncio.gather(*(self._fetch_node(node, pos) for node, pos in by_node.items()))
        emitted, at_end = 0, True
        for result in results:
            for p, r in sorted(result.items()):
                if isinstance(r, ErrorCode):
                    at_end = False
                    await self._recover(p, r)
                    continue
                records = r.records if room is None else r.records[:max(room - emitted, 0)]
                if records:
                    emit(records)
                    emitted += len(records)
                self.positions[p] = r.records[len(records)].offset if len(records) < len(r.records) else r.next_offset
                at_end = at_end and self.positions[p] >= r.high_watermark
        if emitted and self.member is not None:
            await self._commit()
        return emitted, at_end

    async def _fetch_node(self, node: int, positions: dict[int, int]) -> dict[int, FetchResult | ErrorCode]:
        try:
            return await fetch(await self.cluster.node(node), self.topic, positions)
        except OSError:
            await self.cluster.drop(node)
            return dict.fromkeys(positions, ErrorCode.NOT_LEADER_OR_FOLLOWER)

    async def _recover(self, partition: int, code: ErrorCode) -> None:
        if code == ErrorCode.OFFSET_OUT_OF_RANGE:  # clamp into the partition's log
            lo = (await list_offsets(self.cluster, {self.topic: [partition]}, EARLIEST))[(self.topic, partition)]
            hi = (await list_offsets(self.cluster, {self.topic: [partition]}, LATEST))[(self.topic, partition)]
            self.positions[partition] = min(max(self.positions[partition], lo), hi)
        elif code.retriable:
            await asyncio.sleep(0.2)
            await self.cluster.topics([self.topic])
        else:
            raise KafkaError(code, f"fetch {self.topic}/{partition}")

    async def _commit(self) -> None:
        if self.member is not None and self.positions and self.member.generation >= 0:
            try:
                await self.member.commit(self.topic, self.positions)
            except KafkaError:
                if not self.member.rejoin.is_set():
                    raise


async def browse(cluster: Cluster, topic: str, partition: int, offset: int | None, at_ms: int | None,
                 limit: int) -> dict[str, Any]:
    """Up to `limit` records of one partition from an offset, from a time, or (neither) the newest ones."""
    await cluster.topics([topic])
    node, client = await cluster.leader(topic, partition)
    lo = (await list_offsets(cluster, {topic: [partition]}, EARLIEST))[(topic, partition)]
    hi = (await list_offsets(cluster, {topic: [partition]}, LATEST))[(topic, partition)]
    if at_ms is not None:
        found = (await list_offsets(cluster, {topic: [partition]}, at_ms))[(topic, partition)]
        offset = hi if found < 0 else found
    elif offset is None:
        offset = max(hi - limit, lo)
    position = min(max(offset, lo), hi)
    start, records = position, []
    while len(records) < limit and position < hi:
        r = (await fetch(client, topic, {partition: position}, wait_ms=0))[partition]
        if isinstance(r, ErrorCode):
            raise KafkaError(r, f"fetch {topic}/{partition}")
        records += r.records[:limit - len(records)]
        if r.next_offset <= position:
            break
        position = records[-1].offset + 1 if len(records) == limit else r.next_offset
    return {"topic": topic, "partition": partition, "log_start": lo, "high_watermark": hi, "leader": node,
            "start_offset": start, "next_offset": position, "records": records}
