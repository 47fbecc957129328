"""The log process's service to its workers, over a Unix socket.

Calls: `hello` (the worker's ring slot; answered with the ACLs), `produce` (a
Produce whose payloads are ring descriptors), `view` (open a partition for
Fetch: its segments, watermarks and cached segments), `user` (a SASL user's
stored credentials) and `frame` (any other request, raw). Events to every
worker: `changed` whenever a partition log commits a segment, moves its start
offset or closes; `acls` when the ACLs change."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import weakref
from typing import Any

from kafscale.broker.broker import Broker
from kafscale.broker.ipc import Channel
from kafscale.broker.produce_api import Accepted
from kafscale.broker.server import ProtocolViolation, call_handler, parse_header
from kafscale.broker.shm import RingTracker, SharedArea, SharedCache
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import RequestHeader
from kafscale.protocol.schemas import PRODUCE
from kafscale.security.acl import AclBinding
from kafscale.storage.partition import LogError, PartitionLog

log = logging.getLogger(__name__)


class LogService:
    def __init__(self, broker: Broker, area: SharedArea, cache: SharedCache) -> None:
        self.broker = broker
        self.cache = cache
        self.trackers = [RingTracker(r) for r in area.rings]
        self.channels: set[Channel] = set()
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.base_events.Server | None = None
        # (worker, client connection) -> the lock its appends take, in the order it sent them
        self._append_orders: weakref.WeakValueDictionary[tuple[int, int], asyncio.Lock] = (
            weakref.WeakValueDictionary())
        broker.partitions.on_change = self._changed
        broker.access.on_acls = self._acls_changed

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._connected, path, limit=64 * 1024 * 1024)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for ch in list(self.channels):
            ch.close()
        if self._conn_tasks:  # they end on EOF; cancelling them makes asyncio log errors
            await asyncio.wait(self._conn_tasks, timeout=5)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def on_call(kind: str, args: tuple[Any, ...]) -> Any:
            if kind == "produce":
                return await self._produce(id(ch), *args)
            if kind == "frame":
                return await self._frame(*args)
            if kind == "view":
                return await self._view(*args)
            if kind == "user":
                return await self.broker.meta.get_user(*args)
            if kind == "hello":
                self.channels.add(ch)
                return [a.to_json() for a in self.broker.access.authz.acls]
            raise ValueError(f"unknown call {kind}")

        ch = Channel(reader, writer, on_call=on_call)
        task = asyncio.current_task()
        assert task is not None
        self._conn_tasks.add(task)
        try:
            await ch.serve()
        finally:
            self.channels.discard(ch)
            self._conn_tasks.discard(task)

    # ------------------------------------------------------------------ calls
    async def _produce(self, worker: int, conn: int, version: int, client_id: str | None, client_host: str,
                       principal: str, req: dict[str, Any]) -> dict[str, Any] | None:
        """A connection's produces are appended in the order it sent them (calls
        start in arrival order and take its lock first thing); other
        connections' produces do not wait for them, even while this one opens
        partitions."""
        for td in req["topic_data"]:
            for pd in td["partition_data"]:
                pd["records"] = self._accept(pd["records"])
        order = self._append_orders.get((worker, conn))
        if order is None:
            order = self._append_orders[(worker, conn)] = asyncio.Lock()
        hdr = RequestHeader(PRODUCE.key, version, 0, client_id, False, client_host, principal, append_order=order)
        return await self.broker.produce_api.produce(hdr, req)

    def _accept(self, desc: tuple[Any, ...]) -> Accepted | LogError:
        if desc[0] == "error":
            return LogError(ErrorCode(desc[1]), desc[2])
        _, slot, start, n = desc
        tracker = self.trackers[slot]
        return tracker.track(start, n), functools.partial(tracker.release, start)

    async def _frame(self, client_host: str, principal: str, frame: bytes) -> tuple[str, Any]:
        try:
            view = memoryview(frame)
            hdr, body_at = parse_header(view)
            hdr.client_host, hdr.principal = client_host, principal
            chunks = await call_handler(self.broker.handlers, hdr, view, body_at)
        except ProtocolViolation as exc:
            return "violation", str(exc)
        return "response", None if chunks is None else b"".join(chunks)

    async def _view(self, name: str | None, topic_id: bytes | None, p: int) -> dict[str, Any]:
        partitions = self.broker.partitions
        meta = await partitions.topic(name) if name is not None else await partitions.topic_by_id(topic_id or b"")
        if meta is None or not 0 <= p < meta.partitions:
            code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if name is not None else ErrorCode.UNKNOWN_TOPIC_ID
            return {"error": code, "message": f"{name or topic_id!r}/{p}"}
        try:
            lg = await partitions.partition_log(meta.name, p)
        except LogError as exc:
            return {"error": exc.code, "message": str(exc)}
        cached = {m.key: ref for m in lg.segments if (ref := self.cache.ref(m.key)) is not None}
        return {"topic": meta.name, "topic_id": meta.id, "hw": lg.hw, "log_start": lg.log_start,
                "segments": [dataclasses.asdict(m) for m in lg.segments], "cached": cached}

    # ----------------------------------------------------------------- events
    def _acls_changed(self, acls: list[AclBinding]) -> None:
        raw = [a.to_json() for a in acls]
        for ch in list(self.channels):
            if not ch.closed:
                ch.event("acls", raw)

    def _changed(self, lg: PartitionLog, manifest: SegmentManifest | None) -> None:
        ref = self.cache.ref(manifest.key) if manifest is not None else None
        args = (lg.topic, lg.partition, lg.closed, lg.hw, lg.log_start,
                None if manifest is None else dataclasses.asdict(manifest), ref)
        for ch in list(self.channels):
            if not ch.closed:
                ch.event("changed", *args)
