"""A protocol worker: one of N pre-forked processes sharing the Kafka port
through SO_REUSEPORT.

It answers ApiVersions itself, validates produce payloads in native code
and writes them once into its shared-memory ring (the log process gets a
descriptor), and serves Fetch itself: from the shared segment cache without
copying, or from S3 with read-ahead. Every other request is passed to the log
process as raw bytes and its answer sent back unchanged."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kafscale import _native, metrics
from kafscale.broker import messages
from kafscale.broker.context import RequestContext
from kafscale.broker.fetch_sessions import ChangeLog, FetchSessions
from kafscale.broker.ipc import Channel, ChannelClosed, RemoteError
from kafscale.broker.server import (
    ON_SENT,
    SESSION,
    ConnectionLimits,
    KafkaServer,
    ProtocolViolation,
    RunRespond,
    SaslSettings,
    failed_answer,
    malformed_body,
    run_frames,
    run_on_sent,
)
from kafscale.broker.shm import CacheReader, CacheRef, Ring, SharedArea, ref_position
from kafscale.config import Config
from kafscale.metadata.store import SegmentManifest
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import FetchPartition, ProduceAnswer, encode_produce_responses, fetch_partitions
from kafscale.security.acl import AclBinding, Authorizer, Operation, ResourceType
from kafscale.storage.cache import CachedSegment
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.reader import LogError, LogReader, ReadBudget

log = logging.getLogger(__name__)
VIEWS_AT_ONCE = 1000  # partition views a Fetch opens at once (Worker._open_views)


def _unanswered(_result: Any) -> None:
    """The reply to an acks=0 produce: nobody waits for it."""


T = TypeVar("T")


class _ViewCache:
    """A partition view's window onto the shared cache (SegmentSource)."""

    def __init__(self, reader: CacheReader) -> None:
        self.reader = reader
        self.refs: dict[str, CacheRef] = {}

    def get(self, m: SegmentManifest) -> CachedSegment | None:
        ref = self.refs.get(m.ref)
        return None if ref is None else self._pinned(m.ref, ref, self.reader.acquire(ref))

    def read(self, m: SegmentManifest, offset: int, max_bytes: int) -> tuple[memoryview, bool] | None:
        ref = self.refs.get(m.ref)
        return None if ref is None else self._pinned(m.ref, ref, self.reader.read(ref, offset, max_bytes))

    def _pinned(self, key: str, ref: CacheRef, got: T | None) -> T | None:
        """What the reader gave for `ref`: None (overwritten) forgets `key`;
        else the segment stays pinned until the response reading it is sent."""
        if got is None:
            del self.refs[key]
        else:
            ON_SENT.get().append(lambda: self.reader.release(ref_position(ref)))
        return got

    def holds(self, m: SegmentManifest) -> bool:
        return m.ref in self.refs

    def put(self, m: SegmentManifest, seg: CachedSegment) -> None:
        """Only the log process writes the shared cache."""


class PartitionView(LogReader):
    """What a worker knows of a partition its node owns: committed segments,
    watermarks and cache locations, kept current by the log process's events."""

    def __init__(self, store: ObjectStore, cache: CacheReader, readahead: int, budget: ReadBudget,
                 state: messages.PartitionSnapshot) -> None:
        self.topic = state.topic
        self.view_cache = _ViewCache(cache)
        super().__init__(store, self.view_cache, readahead, budget)
        self.set_segments(list(state.segments))
        self.view_cache.refs.update(state.cached)
        self.hw, self.log_start = state.hw, state.log_start

    def apply(self, hw: int, log_start: int, m: SegmentManifest | None, ref: CacheRef | None) -> None:
        if m is not None:
            for replaced in self.add_segment(m):
                self.view_cache.refs.pop(replaced.ref, None)
            if ref is not None:
                self.view_cache.refs[m.ref] = ref
        self.hw = hw
        if log_start != self.log_start:
            self.log_start = log_start
            gone = sum(1 for m in self.segments if m.last < log_start)
            for m in self.segments[:gone]:
                self.view_cache.refs.pop(m.ref, None)
            self.drop_segments(gone)


# What answers a queued produce call: the log process's response body, None (acks=0), or what it failed with.
Reply = Callable[["dict[str, Any] | BaseException | None"], None]


class _RunReplies:
    """The replies to a run's produce calls (Worker.produce_run), answered
    together once the last one that wants an answer has its reply: the
    responses framed in one piece (an error code for a call the log process
    failed), or the ProtocolViolation one of them got (the connection closes)."""

    __slots__ = ("frames", "left", "replies", "requests", "respond")

    def __init__(self, frames: memoryview, requests: list[tuple[Any, ...]], respond: RunRespond) -> None:
        self.frames = frames
        self.requests = requests
        self.respond = respond
        self.replies: list[ProduceAnswer | BaseException | None] = [None] * len(requests)
        self.left = sum(1 for r in requests if r[3] != 0)

    def answer(self, i: int, reply: ProduceAnswer | BaseException | None) -> None:
        self.replies[i] = reply
        self.left -= 1
        self.answer_if_done()

    def answer_if_done(self) -> None:
        if self.left:
            return
        try:
            answers = []
            for request, reply, frame in zip(self.requests, self.replies, run_frames(self.frames, len(self.requests)),
                                             strict=True):
                if request[3] == 0:  # acks=0: no answer
                    continue
                if isinstance(reply, list):
                    answers.append((request[0], request[1], reply))
                elif isinstance(reply, Exception) and not isinstance(reply, ProtocolViolation):
                    if (answer := failed_answer(frame, reply)) is not None:
                        answers.append(answer)
                else:
                    raise reply if isinstance(reply, BaseException) else ProtocolViolation("a produce got no reply")
            self.respond(encode_produce_responses(answers))
        except BaseException as exc:
            self.respond(exc)


class Worker:
    def __init__(self, cfg: Config, area: SharedArea, slot: int) -> None:
        self.cfg = cfg
        self.slot = slot
        self.ring: Ring = area.rings[slot]
        self.cache = CacheReader(area, slot)
        self.store = ObjectStore.from_config(cfg)
        self.chan: Channel | None = None
        self.views: dict[tuple[str, int], PartitionView] = {}
        self.read_budget = ReadBudget(cfg.readahead_memory_bytes)
        self.authz = Authorizer(cfg.authorizer, cfg.super_users, cfg.allow_everyone_if_no_acl_found)
        self.topic_ids: dict[bytes, str] = {}
        self._changed = asyncio.Event()
        self._opening = 0  # views being opened: their events may arrive before the view exists
        self._early: list[messages.PartitionChanged] = []
        # produce calls of each client connection not sent yet, with what answers each
        self._produces: dict[int, list[tuple[messages.ProduceCall, Reply]]] = {}
        # requests of each client connection for the log process, not sent yet, with what each waits on
        self._forwards: dict[int, list[tuple[messages.Frame, asyncio.Future[messages.FrameResult]]]] = {}
        # this process's children of the byte counters (a labels() lookup per request cost 4% of a worker)
        self._produce_bytes = metrics.Tally(metrics.PRODUCE_BYTES.labels(metrics.node(), metrics.process()))
        self._fetch_bytes = metrics.Tally(metrics.FETCH_BYTES.labels(metrics.node(), metrics.process()))
        self._fetches = {kind: metrics.Tally(metrics.FETCHES.labels(metrics.node(), metrics.process(), kind))
                         for kind in ("sessionless", "full", "incremental")}
        self.sessions = FetchSessions(cfg.fetch_session_slots)
        self.changes = ChangeLog()  # which views changed, for the sessions' incremental passes
        self.handlers = {
            schemas.API_VERSIONS.key: self.api_versions,
            schemas.FETCH.key: self.fetch,
        }
        self.server: KafkaServer | None = None

    async def start(self, socket_path: str) -> None:
        await self.store.start()
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=64 * 1024 * 1024)
        self.chan = Channel(reader, writer, on_event=self._on_event)
        self._serving = asyncio.create_task(self.chan.serve())
        self._set_acls(await self.chan.call(messages.Hello(self.slot)))
        host, port = self.cfg.listen_addr()
        mechanisms = self.cfg.sasl_mechanism_list()
        sasl = SaslSettings(mechanisms, lambda user: self.chan.call(messages.GetUser(user))) if mechanisms else None
        self.server = KafkaServer(self.handlers, host, port, ConnectionLimits.from_config(self.cfg), reuse_port=True,
                                  forward=self.forward, ssl=self.cfg.server_ssl(), sasl=sasl,
                                  proxy_secret=self.cfg.proxy_secret, produce_run=self.produce_run)
        await self.server.start(listen=False)  # listen(), once every worker of the node is ready

    async def listen(self) -> None:
        assert self.server is not None, "start() first"
        await self.server.listen()

    async def run_until_log_process_exits(self) -> None:
        await self._serving

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.stop_listening()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.chan is not None:
            self.chan.close()
        await self.store.close()

    # --------------------------------------------------------------- events
    def _set_acls(self, raw: list[bytes]) -> None:
        self.authz.update(AclBinding.from_json(a) for a in raw)

    def _on_event(self, event: messages.AclsChanged | list[messages.SentChange]) -> None:
        if isinstance(event, messages.AclsChanged):
            self._set_acls(event.acls)
            self.sessions.revisit()
            return
        logged = len(self.sessions) > 0  # a session's first pass begins at the log's end: nothing before matters
        for sent in event:
            ev = messages.PartitionChanged.received(sent)
            if logged:
                self.changes.add(ev.topic, ev.partition)
            view = self.views.get((ev.topic, ev.partition))
            if view is not None:
                self._apply(view, ev)
            elif self._opening:
                self._early.append(ev)
        self._changed.set()
        self._changed = asyncio.Event()

    def _apply(self, view: PartitionView, ev: messages.PartitionChanged) -> None:
        if ev.closed:
            view.stop_reading()
            self.views.pop((ev.topic, ev.partition), None)
            if not any(t == ev.topic for t, _ in self.views):  # no view names the topic: forget its id
                self.topic_ids = {i: n for i, n in self.topic_ids.items() if n != ev.topic}
        elif ev.manifest is None or ev.manifest.base >= view.hw:  # not already in the view's snapshot
            view.apply(max(ev.hw, view.hw), ev.log_start, ev.manifest, ev.ref)

    # ------------------------------------------------------------- requests
    async def api_versions(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        return schemas.api_versions_response()

    async def forward(self, hdr: RequestContext, frame: memoryview) -> list[Any] | None:
        """Have the log process answer a request. A connection's forwarded
        requests take effect in the order it sent them, as on a Kafka broker:
        pipelined OffsetCommits must not race each other. One call at a time
        per connection, carrying every request queued while the one before
        was under way (LogService._frames keeps their order)."""
        assert self.chan is not None
        conn = SESSION.get().conn
        mine: asyncio.Future[messages.FrameResult] = asyncio.get_running_loop().create_future()
        self._forwards.setdefault(conn, []).append((messages.Frame(hdr.client_host, hdr.principal, bytes(frame)),
                                                    mine))
        async with hdr.append_order:  # taken in the order the requests were queued
            if not mine.done():  # not sent with one before it
                await self._forward_queued(conn)
        try:
            result = mine.result()
        except ChannelClosed:
            raise ProtocolViolation("the broker is shutting down") from None
        if result.violation is not None:
            raise ProtocolViolation(result.violation)
        return None if result.response is None else [result.response]

    async def _forward_queued(self, conn: int) -> None:
        assert self.chan is not None
        queued = self._forwards.pop(conn)
        try:
            self._send_produces(conn)  # after the produces the connection sent before them
            results = await self.chan.call(messages.Frames([f for f, _ in queued]))
        except asyncio.CancelledError:  # the connection closed
            for _, fut in queued:
                fut.cancel()
            raise
        except Exception as exc:
            for _, fut in queued:
                fut.set_exception(exc)
                fut.exception()  # retrieved: a request given up on while it waited leaves no warning
            return
        for (_, fut), result in zip(queued, results, strict=True):
            fut.set_result(result)

    def produce_run(self, hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond
                    ) -> ProtocolViolation | None:
        """A run of Produce requests a connection sent back to back (a
        RunHandler): each payload validated and put in the ring, in one
        native call for the run (_native.stage_produce_run: headers and
        bodies decoded straight into the calls' tuples); the log process does
        the rest, in the order the connection sent them: the calls are queued
        as the run is read. Their responses go out in one piece once each
        request that wants one (acks is not 0) is answered."""
        assert self.chan is not None
        if self.chan.closed:
            raise ProtocolViolation("the broker is shutting down")
        requests, staged, error = _native.stage_produce_run(
            frames, count, schemas.PRODUCE.request.flexible_min, self.ring.writer, self.slot,
            self.cfg.validate_compressed, self.cfg.max_uncompressed_batch_bytes, messages.RejectedPayload)
        self._produce_bytes.inc(staged)
        replies = _RunReplies(frames, requests, respond)
        conn = SESSION.get().conn
        for i, (_, version, client_id, acks, timeout_ms, transactional_id, topics) in enumerate(requests):
            call: messages.ProduceCall = (conn, version, client_id, hdr.client_host, hdr.principal, acks, timeout_ms,
                                          transactional_id, topics)
            self._queue_produce(call, functools.partial(replies.answer, i) if acks else _unanswered)
        replies.answer_if_done()
        return None if error is None else malformed_body(schemas.PRODUCE.key, *error)

    def _queue_produce(self, call: messages.ProduceCall, respond: Reply) -> None:
        """Queue a produce call, answered through respond. The calls a
        connection makes in one pass of the event loop go to the log process
        as one: librdkafka sends a Produce request per partition, ten and more
        at once, and a call each cost the log process a task, a wait and a
        reply each."""
        queued = self._produces.get(call[0])
        if queued is None:
            queued = self._produces[call[0]] = []
            asyncio.get_running_loop().call_soon(self._send_produces, call[0])
        queued.append((call, respond))

    def _send_produces(self, conn: int) -> None:
        """Send a connection's queued produce calls as one; its replies (a list) answer each."""
        queued = self._produces.pop(conn, None)
        if not queued:
            return
        assert self.chan is not None
        try:
            replies = self.chan.call([call for call, _ in queued])
        except ChannelClosed as exc:
            replies = asyncio.get_running_loop().create_future()
            replies.set_exception(exc)

        def answered(replies: asyncio.Future[list[Any]]) -> None:
            exc = replies.exception()
            if isinstance(exc, ChannelClosed):
                exc = ProtocolViolation("the broker is shutting down")
            results = [exc] * len(queued) if exc is not None else replies.result()
            for (_, respond), result in zip(queued, results, strict=True):
                respond(RemoteError(result.message) if isinstance(result, messages.ProduceFailed) else result)

        replies.add_done_callback(answered)

    # ---------------------------------------------------------------- Fetch
    async def fetch(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        """Fetch, with or without an incremental fetch session (fetch_sessions.py):
        an incremental one fetches the partitions of its session it names, those
        whose views changed since its last pass and those still active (behind,
        or answered with an error or records), and answers only those with
        something new."""
        deadline = time.monotonic() + req["max_wait_ms"] / 1000
        try:
            session, topics, incremental = self.sessions.begin(req, hdr.principal, hdr.api_version >= 13)
        except KafkaError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "session_id": 0, "responses": []}
        self._fetches["incremental" if incremental else "full" if session else "sessionless"].inc()
        while True:
            changed = self._changed
            if session is not None and incremental:
                topics = session.due(self.changes)
            elif session is not None:
                session.seen = self.changes.end
            fetched, total, errors = await self._fetch_once(hdr, topics, req.get("max_bytes", 0x7FFFFFFF))
            remaining = deadline - time.monotonic()
            if total >= req["min_bytes"] or errors or remaining <= 0:
                break
            run_on_sent(ON_SENT.get())  # nothing worth sending yet: let the cache reuse what we looked at
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass
        self._fetch_bytes.inc(total)
        responses = []
        for t, name, parts in fetched:
            if session is not None and not (parts := session.answered(t, name, parts, incremental)):
                continue
            responses.append({"topic": t.get("topic", name or ""), "topic_id": t.get("topic_id"),
                              "partitions": fetch_partitions(parts, hdr.api_version)})
        return {"throttle_time_ms": 0, "error_code": 0, "session_id": session.id if session else 0,
                "responses": responses}

    async def _view(self, name: str | None, topic_id: bytes | None, p: int) -> PartitionView:
        if name is None and topic_id is not None:
            name = self.topic_ids.get(topic_id)
        view = self.views.get((name, p)) if name is not None else None
        if view is not None:
            return view
        assert self.chan is not None
        self._opening += 1
        try:
            reply = await self.chan.call(messages.OpenView(name, topic_id, p))
        except ChannelClosed:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, "the broker is shutting down") from None
        finally:
            self._opening -= 1
            early = self._early
            if not self._opening:
                self._early = []
        if isinstance(reply, messages.ViewRefused):
            raise LogError(ErrorCode(reply.code), reply.message)
        name = reply.topic
        self.topic_ids[reply.topic_id] = name
        view = self.views.get((name, p))  # another fetch may have opened it meanwhile
        if view is None:
            view = self.views[(name, p)] = PartitionView(self.store, self.cache, self.cfg.readahead_bytes,
                                                                self.read_budget, reply)
            for ev in early:
                if (ev.topic, ev.partition) == (name, p) and (name, p) in self.views:
                    self._apply(view, ev)
        if (name, p) not in self.views:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"{name}/{p} moved while it was opened")
        return view

    async def _open_views(self, name: str, topic_id: bytes | None, partitions: list[int]
                          ) -> dict[int, BaseException]:
        """Open the views of a Fetch's partitions of a topic that are not open
        here yet, VIEWS_AT_ONCE at a time: one after another, a consumer's first
        Fetch of 10,000 partitions waited for 10,000 round trips to the log
        process. Returns why each that could not be opened was refused (the
        Fetch reports it for that partition without asking again)."""
        missing = [p for p in partitions if (name, p) not in self.views]
        refused: dict[int, BaseException] = {}
        for i in range(0, len(missing), VIEWS_AT_ONCE):
            some = missing[i:i + VIEWS_AT_ONCE]
            opened = await asyncio.gather(*(self._view(name, topic_id, p) for p in some), return_exceptions=True)
            refused.update((p, got) for p, got in zip(some, opened, strict=True) if isinstance(got, BaseException))
        return refused

    def _authorize_read(self, hdr: RequestContext, topic: str) -> None:
        if not self.authz.allows(hdr.principal, hdr.client_host, Operation.READ, ResourceType.TOPIC, topic):
            raise LogError(ErrorCode.TOPIC_AUTHORIZATION_FAILED, f"{hdr.principal} may not read {topic}")

    async def _fetch_once(self, hdr: RequestContext, topics: list[dict[str, Any]], budget: int
                          ) -> tuple[list[tuple[dict[str, Any], str | None, list[FetchPartition]]], int, bool]:
        """One pass over the requested partitions. Per partition only what it
        needs: a consumer of 10,000 partitions sends them all in every Fetch,
        and most have nothing new (no task, view lookup or read for those; the
        topic's read permission checked once; the partitions packed, not
        dicts for the schema's encoder)."""
        total, errors = 0, False
        fetched = []
        by_id = hdr.api_version >= 13
        views = self.views
        for t in topics:
            topic_id = t.get("topic_id") if by_id else None
            name = self.topic_ids.get(topic_id) if by_id else t["topic"]
            allowed = None  # the topic whose reads this client may make
            refused: dict[int, BaseException] | None = None  # once the missing views were opened together
            parts: list[FetchPartition] = []
            for p in t["partitions"]:
                hw = start = -1
                try:
                    if name is not None and allowed != name:  # by name: before anything is opened
                        self._authorize_read(hdr, name)
                        allowed = name
                    if refused is None and allowed is not None:
                        refused = await self._open_views(allowed, topic_id, [q["partition"] for q in t["partitions"]])
                    view = views.get((name, p["partition"])) if name is not None else None
                    if view is None:
                        if refused is not None and p["partition"] in refused:
                            raise refused[p["partition"]]
                        view = await self._view(name, topic_id, p["partition"])
                        if allowed != view.topic:
                            self._authorize_read(hdr, view.topic)
                            allowed = name = view.topic  # by id: the rest by name
                    hw, start = view.hw, view.log_start
                    chunks = None
                    # caught up: read would find nothing. Else the response's max_bytes holds across
                    # partitions: only the first partition with data may exceed it (with one batch), as in Kafka
                    limit = min(p["partition_max_bytes"], budget - total)
                    if (p["fetch_offset"] != hw or view.cursors) and (limit > 0 or total == 0):
                        chunks = await view.read(p["fetch_offset"], max(limit, 1), strict=total > 0)
                        total += sum(len(c) for c in chunks)
                    parts.append((p["partition"], 0, hw, start, chunks))
                except LogError as exc:
                    parts.append((p["partition"], exc.code, hw, start, None))
                    errors = True
            fetched.append((t, name, parts))
        return fetched, total, errors
