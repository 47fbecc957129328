"""The log process's service to its workers, over a Unix socket: it answers
the calls of messages.py (Hello, ProduceCall, Frames, OpenView, GetUser) through
one dispatch table, and sends a worker a list of PartitionChanged whenever
partition logs it has opened a view of (to fetch from them) commit segments
or slices, move their start offsets or close (the changes of one pass of the
event loop together: a node flush changes every partition it holds at once),
and every worker AclsChanged when the ACLs change."""
from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from kafscale import _native
from kafscale.broker import messages
from kafscale.broker.broker import Broker
from kafscale.broker.context import RequestContext
from kafscale.broker.ipc import Channel
from kafscale.broker.produce_api import ProduceRequest
from kafscale.broker.server import ProtocolViolation, call_handler, parse_header
from kafscale.broker.shm import SharedArea, SharedCache
from kafscale.metadata.store import SegmentManifest, has_partition
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import ProduceAnswer
from kafscale.protocol.schemas import OFFSET_COMMIT, PRODUCE
from kafscale.security.acl import AclBinding
from kafscale.storage.partition import LogError, PartitionLog

log = logging.getLogger(__name__)


class LogService:
    def __init__(self, broker: Broker, area: SharedArea, cache: SharedCache) -> None:
        self.broker = broker
        self.cache = cache
        self.trackers = [r.reader() for r in area.rings]
        self.channels: set[Channel] = set()
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.base_events.Server | None = None
        # (worker, client connection) -> the lock its appends take, in the order it sent them
        self._append_orders: weakref.WeakValueDictionary[tuple[int, int], asyncio.Lock] = (
            weakref.WeakValueDictionary())
        # the workers with a view of each partition: only they are sent its changes (a partition
        # no client fetches from, written only, or read by Spark from S3, costs no event)
        self._viewers: dict[tuple[str, int], set[Channel]] = {}
        self._changes: list[tuple[messages.SentChange, set[Channel]]] = []  # not sent yet, and to whom
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
        async def hello(_msg: messages.Hello) -> list[bytes]:
            self.channels.add(ch)
            return [a.to_json() for a in self.broker.access.authz.acls]

        async def get_user(msg: messages.GetUser) -> dict[str, Any] | None:
            return await self.broker.meta.get_user(msg.name)

        calls: dict[type, Any] = {
            messages.Hello: hello, list: lambda msgs: self._produce(id(ch), msgs),  # ProduceCalls
            messages.Frames: self._frames, messages.OpenView: lambda msg: self._view(ch, msg),
            messages.GetUser: get_user}

        async def on_call(msg: Any) -> Any:
            return await calls[type(msg)](msg)

        ch = Channel(reader, writer, on_call=on_call)
        task = asyncio.current_task()
        assert task is not None
        self._conn_tasks.add(task)
        try:
            await ch.serve()
        finally:
            self.channels.discard(ch)
            for viewers in self._viewers.values():
                viewers.discard(ch)
            self._conn_tasks.discard(task)

    # ------------------------------------------------------------------ calls
    async def _produce(self, worker: int, msgs: list[messages.ProduceCall]
                       ) -> list[ProduceAnswer | messages.ProduceFailed | None]:
        """The produce requests one client connection sent in a row, answered
        together. A connection's produces are appended in the order it sent
        them (calls start in arrival order and take its lock first thing);
        other connections' produces do not wait for them, even while this one
        opens partitions."""
        conn, version, client_id, client_host, principal = msgs[0][:5]
        reqs: list[ProduceRequest] = _native.hold_produce(msgs, self.trackers, _refused)
        order = self._append_orders.get((worker, conn))
        if order is None:
            order = self._append_orders[(worker, conn)] = asyncio.Lock()
        hdr = RequestContext(PRODUCE.key, version, 0, client_id, False, client_host, principal, append_order=order)
        return [messages.ProduceFailed(f"{type(r).__name__}: {r}") if isinstance(r, Exception) else r
                for r in await self.broker.produce_api.produce_all(hdr, reqs)]

    async def _frames(self, msg: messages.Frames) -> list[messages.FrameResult]:
        """A connection's forwarded requests, taking effect in the order it
        sent them as on a Kafka broker: each starts once those before it are
        answered. But consecutive OffsetCommits start at once, and each is
        queued for its group's etcd write once the one before it is
        (RequestContext.turn): a consumer committing asynchronously after
        every message has its commits checked together and written a run at
        a time, not one etcd read and one transaction each. A request that
        breaks the protocol ends the run (the worker closes the connection
        after answering those before it)."""
        started: list[asyncio.Task[messages.FrameResult]] = []
        after: Callable[[], Awaitable[None]] | None = None  # the turn after the OffsetCommit before
        refused: list[messages.FrameResult] = []
        for f in msg.frames:
            view = memoryview(f.frame)
            try:
                *wire, body_at = parse_header(view)
            except ProtocolViolation as exc:
                refused.append(messages.FrameResult(violation=str(exc)))
                break
            commit = wire[0] == OFFSET_COMMIT.key
            if started and not (commit and after is not None):
                await asyncio.wait(started)
                if started[-1].result().violation is not None:
                    break
            ready = asyncio.Event()
            hdr = RequestContext(*wire, f.client_host, f.principal, placed=ready.set)
            if commit and after is not None:
                hdr.turn = after
            task = asyncio.create_task(self._answer(hdr, view, body_at))
            task.add_done_callback(lambda _, e=ready: e.set())
            started.append(task)
            after = functools.partial(_after, ready, task) if commit else None
        results = [*await asyncio.gather(*started), *refused]
        violation = "a request before it broke the protocol"
        return results + [messages.FrameResult(violation=violation)] * (len(msg.frames) - len(results))

    async def _answer(self, hdr: RequestContext, frame: memoryview, body_at: int) -> messages.FrameResult:
        try:
            chunks = await call_handler(self.broker.handlers, hdr, frame, body_at)
        except ProtocolViolation as exc:
            return messages.FrameResult(violation=str(exc))
        return messages.FrameResult(None if chunks is None else b"".join(chunks))

    async def _view(self, ch: Channel, msg: messages.OpenView) -> messages.PartitionSnapshot | messages.ViewRefused:
        partitions, p = self.broker.partitions, msg.partition
        meta = (await partitions.topic(msg.topic) if msg.topic is not None
                else await partitions.topic_by_id(msg.topic_id or b""))
        if not has_partition(meta, p):
            code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if msg.topic is not None else ErrorCode.UNKNOWN_TOPIC_ID
            return messages.ViewRefused(code, f"{msg.topic or msg.topic_id!r}/{p}")
        try:
            lg = await partitions.partition_log(meta.name, p)
        except LogError as exc:
            return messages.ViewRefused(exc.code, str(exc))
        cached = {m.ref: ref for m in lg.segments if (ref := self.cache.ref(m)) is not None}
        self._viewers.setdefault((lg.topic, lg.partition), set()).add(ch)  # its changes after this snapshot
        self._send_changes()  # the worker applies the changes before this snapshot first
        return messages.PartitionSnapshot(meta.name, meta.id, lg.hw, lg.log_start, list(lg.segments), cached)

    # ----------------------------------------------------------------- events
    def _acls_changed(self, acls: list[AclBinding]) -> None:
        self._broadcast(messages.AclsChanged([a.to_json() for a in acls]))

    def _changed(self, lg: PartitionLog, manifest: SegmentManifest | None) -> None:
        tp = (lg.topic, lg.partition)
        viewers = self._viewers.pop(tp, None) if lg.closed else self._viewers.get(tp)  # a closed log's views end
        if not viewers:
            return
        ref = self.cache.ref(manifest) if manifest is not None else None
        if not self._changes:
            asyncio.get_running_loop().call_soon(self._send_changes)
        self._changes.append((messages.PartitionChanged.sent(lg.topic, lg.partition, lg.closed, lg.hw, lg.log_start,
                                                             manifest, ref), viewers))

    def _send_changes(self) -> None:
        """Send each worker the changes of the partitions it views, pickled
        once for all the workers that get the same ones."""
        changes, self._changes = self._changes, []
        encoded: dict[tuple[int, ...], bytes] = {}
        for ch in list(self.channels):
            mine = tuple(i for i, (_, viewers) in enumerate(changes) if ch in viewers)
            if mine and not ch.closed:
                if mine not in encoded:
                    encoded[mine] = Channel.encode_event([changes[i][0] for i in mine])
                ch.send_encoded(encoded[mine])

    def _broadcast(self, event: messages.AclsChanged) -> None:
        encoded = Channel.encode_event(event)  # once for every worker
        for ch in list(self.channels):
            if not ch.closed:
                ch.send_encoded(encoded)


def _refused(payload: messages.RejectedPayload) -> LogError:
    """A payload the worker refused, as the partition's error."""
    return LogError(ErrorCode(payload.code), payload.message)


async def _after(ready: asyncio.Event, before: asyncio.Task[messages.FrameResult]) -> None:
    """The turn of an OffsetCommit after another: once that one is placed
    or answered, unless it broke the protocol (then neither takes effect)."""
    await ready.wait()
    if before.done() and (violation := before.result().violation) is not None:
        raise ProtocolViolation(violation)
