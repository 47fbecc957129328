"""An in-memory twin of the etcd client MetaStore uses, for unit tests.

It implements the calls MetaStore makes (get, put, delete, delete_range,
transaction with version/value compares and gets, paged ranges, leases, prefix
watches) with etcd's semantics: a transaction applies all of its operations
or none, compares see the state at that instant, every write moves the
revision, and keys put with a lease vanish when it is revoked or expires.
MetaStore's own logic (fenced commits, claims, compare-and-swap loops) runs
unchanged on top of it. Integration tests use a real etcd; nothing in the
broker imports this."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aetcd.exceptions import ClientError, InvalidArgumentError

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    version: int
    lease: int
    mod_revision: int = 0  # the revision that last wrote it


@dataclass(frozen=True)
class Event:
    kind: str  # "PUT" or "DELETE"
    kv: KeyValue


@dataclass(frozen=True)
class _Compare:
    target: str  # "version" or "value"
    key: bytes
    op: str
    operand: Any

    def holds(self, kv: KeyValue | None) -> bool:
        actual = (kv.version if kv else 0) if self.target == "version" else (kv.value if kv else None)
        if actual is None:  # a value compare on a missing key fails, as in etcd
            return False
        return {"==": actual == self.operand, "!=": actual != self.operand,
                ">": actual > self.operand, "<": actual < self.operand}[self.op]


class _Target:
    def __init__(self, target: str, key: bytes) -> None:
        self.target, self.key = target, key

    def __eq__(self, other: object) -> _Compare:  # type: ignore[override]
        return _Compare(self.target, self.key, "==", other)

    def __ne__(self, other: object) -> _Compare:  # type: ignore[override]
        return _Compare(self.target, self.key, "!=", other)

    def __gt__(self, other: object) -> _Compare:
        return _Compare(self.target, self.key, ">", other)

    def __lt__(self, other: object) -> _Compare:
        return _Compare(self.target, self.key, "<", other)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class _Op:
    kind: str  # "put", "delete" or "get"
    key: bytes
    value: bytes = b""
    range_end: bytes | None = None
    lease: int = 0


class _Transactions:
    @staticmethod
    def version(key: bytes) -> _Target:
        return _Target("version", key)

    @staticmethod
    def value(key: bytes) -> _Target:
        return _Target("value", key)

    @staticmethod
    def put(key: bytes, value: bytes, lease: Any = None) -> _Op:
        return _Op("put", key, value, lease=_lease_id(lease))

    @staticmethod
    def delete(key: bytes, range_end: bytes | None = None) -> _Op:
        return _Op("delete", key, range_end=range_end)

    @staticmethod
    def get(key: bytes) -> _Op:
        return _Op("get", key)


def _lease_id(lease: Any) -> int:
    return 0 if lease is None else lease.id


@dataclass
class _LeaseReply:
    TTL: int


class Lease:
    def __init__(self, etcd: MemoryEtcd, lease_id: int, ttl: int) -> None:
        self.etcd, self.id, self.ttl = etcd, lease_id, ttl

    async def refresh(self) -> _LeaseReply:
        return _LeaseReply(self.etcd._refresh(self))

    async def remaining_ttl(self) -> int:
        deadline = self.etcd._leases.get(self.id)
        return -1 if deadline is None else max(int(deadline - self.etcd.clock()), 0)

    async def revoke(self) -> None:
        self.etcd.expire(self)


class MemoryEtcd:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.transactions = _Transactions()
        self.revision = 1
        self.compacted = 0  # the revision the history was last compacted at (the twin keeps only its events)
        self._events: list[Event] = []  # every change since `compacted`, for watches from a past revision
        self.txns = 0  # transactions applied (successful or not), like etcd's txn counter
        self._data: dict[bytes, KeyValue] = {}
        self._leases: dict[int, float] = {}  # id -> deadline on clock
        self._lease_ttl: dict[int, int] = {}
        self._watchers: list[tuple[bytes, asyncio.Queue[Event | None]]] = []
        self.down = False  # set: every call raises ConnectionError, as with etcd unreachable

    # ------------------------------------------------------------ connection
    async def connect(self) -> None:
        return None

    async def status(self) -> None:
        self._check()

    async def close(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)
        self._watchers.clear()

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("etcd is down (MemoryEtcd.down)")
        now = self.clock()
        for lease_id in [i for i, deadline in self._leases.items() if deadline <= now]:
            self._drop_lease(lease_id)

    # ----------------------------------------------------------------- reads
    async def get(self, key: bytes) -> KeyValue | None:
        self._check()
        return self._data.get(key)

    async def range_page(self, start: bytes, end: bytes, limit: int, revision: int,
                         keys_only: bool, min_mod_revision: int = 0) -> tuple[list[KeyValue], bool, int]:
        """Pages are read from the current state: the twin keeps no history, so
        the revision is reported but not honoured (MetaStore only passes it back),
        except that one compacted away is refused, as etcd does. As etcd, the
        page is cut to limit after keys written before min_mod_revision are left out."""
        self._check()
        if 0 < revision < self.compacted:
            raise ClientError("etcdserver: mvcc: required revision has been compacted")
        keys = sorted(k for k, kv in self._data.items() if start <= k < end and kv.mod_revision >= min_mod_revision)
        page = [self._data[k] for k in keys[:limit]]
        if keys_only:
            page = [KeyValue(kv.key, b"", kv.version, kv.lease, kv.mod_revision) for kv in page]
        return page, len(keys) > limit, revision or self.revision

    async def compact(self, revision: int, physical: bool = False) -> None:
        """etcd's answers to a compaction: an error for a revision compacted
        already or not reached yet (there is no history to drop)."""
        self._check()
        if revision <= self.compacted:
            raise ClientError("etcdserver: mvcc: required revision has been compacted")
        if revision > self.revision:
            raise ClientError("etcdserver: mvcc: required revision is a future revision")
        self.compacted = revision
        self._events = [ev for ev in self._events if ev.kv.mod_revision >= revision]

    # ---------------------------------------------------------------- writes
    async def put(self, key: bytes, value: bytes, lease: Any = None) -> None:
        self._check()
        self._apply([_Op("put", key, value, lease=_lease_id(lease))])

    async def delete(self, key: bytes) -> bool:
        self._check()
        existed = key in self._data
        self._apply([_Op("delete", key)])
        return existed

    async def delete_range(self, start: bytes, end: bytes) -> None:
        self._check()
        self._apply([_Op("delete", start, range_end=end)])

    async def transaction(self, compare: list[_Compare], success: list[_Op],
                          failure: list[_Op]) -> tuple[bool, list[Any]]:
        self._check()
        if max(len(compare), len(success), len(failure)) > MAX_TXN_OPS:
            raise InvalidArgumentError("etcdserver: too many operations in txn request")
        self.txns += 1
        ok = all(c.holds(self._data.get(c.key)) for c in compare)
        return ok, self._apply(success if ok else failure)

    def _apply(self, ops: list[_Op]) -> list[Any]:
        """Apply ops in order; one reply each, as aetcd's: a get's [(value, metadata)] or [], else None."""
        if any(op.kind != "get" for op in ops):
            self.revision += 1
        replies: list[Any] = []
        for op in ops:
            replies.append(None)
            if op.kind == "get":
                kv = self._data.get(op.key)
                replies[-1] = [(kv.value, kv)] if kv else []
            elif op.kind == "put":
                old = self._data.get(op.key)
                if op.lease and op.lease not in self._leases:
                    raise ValueError(f"lease {op.lease} not found")
                kv = self._data[op.key] = KeyValue(op.key, bytes(op.value), (old.version if old else 0) + 1, op.lease,
                                                    self.revision)
                self._notify(Event("PUT", kv))
            else:
                keys = [k for k in self._data if op.key <= k < op.range_end] if op.range_end else [op.key]
                for k in keys:
                    gone = self._data.pop(k, None)
                    if gone is not None:
                        self._notify(Event("DELETE", KeyValue(k, b"", 0, 0, self.revision)))
        return replies

    # ---------------------------------------------------------------- leases
    async def lease(self, ttl: int) -> Lease:
        self._check()
        lease_id = max(self._leases, default=0) + 1
        self._leases[lease_id], self._lease_ttl[lease_id] = self.clock() + ttl, ttl
        return Lease(self, lease_id, ttl)

    def _refresh(self, lease: Lease) -> int:
        self._check()
        if lease.id not in self._leases:
            return -1
        self._leases[lease.id] = self.clock() + self._lease_ttl[lease.id]
        return self._lease_ttl[lease.id]

    def expire(self, lease: Lease) -> None:
        """The lease ends now (revoked, or its owner stopped refreshing): its keys go."""
        self._drop_lease(lease.id)

    def _drop_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        keys = [k for k, kv in self._data.items() if kv.lease == lease_id]
        if keys:
            self._apply([_Op("delete", k) for k in keys])

    # --------------------------------------------------------------- watches
    async def watch_prefix(self, prefix: bytes, start_revision: int | None = None) -> AsyncIterator[Event]:
        """The changes under prefix from now on, or from start_revision on
        (refused, as by etcd, once compacted away)."""
        self._check()
        if start_revision is not None and start_revision < self.compacted:
            raise ClientError("etcdserver: mvcc: required revision has been compacted")
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        for ev in self._events if start_revision is not None else ():
            if ev.kv.mod_revision >= start_revision and ev.kv.key.startswith(prefix):
                queue.put_nowait(ev)
        self._watchers.append((prefix, queue))

        async def events() -> AsyncIterator[Event]:
            while (ev := await queue.get()) is not None:
                yield ev
            raise ConnectionError("etcd watch ended")

        return events()

    def _notify(self, ev: Event) -> None:
        self._events.append(ev)
        for prefix, q in self._watchers:
            if ev.kv.key.startswith(prefix):
                q.put_nowait(ev)
