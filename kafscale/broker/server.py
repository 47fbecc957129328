"""The Kafka listener: reads size-prefixed frames, dispatches them to the
Broker's handlers and writes responses in request order.

A connection may pipeline requests: each one runs as its own task (Produce
requests sent back to back as one run, handed to a RunHandler together) and
a writer awaits them in order, so a Produce waiting for S3 does not hold up
the parsing of what follows. Malformed frames close only that connection,
with a log line saying why; nothing a client sends can stop the server."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import socket
import ssl as ssl_mod
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kafscale import _native, metrics
from kafscale.broker.context import RequestContext
from kafscale.metadata.store import unavailable
from kafscale.protocol.codec import DecodeError
from kafscale.protocol.error_response import error_response, unavailable_code
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import HeaderFields, encode_produce_responses, encode_response, request_header_fields
from kafscale.protocol.schemas import API_VERSIONS, APIS, PRODUCE, SASL_AUTHENTICATE, SASL_HANDSHAKE
from kafscale.security.sasl import ANONYMOUS, PROXY_MECHANISM, Lookup, ProxyIdentity, SaslExchange, SaslFailed

log = logging.getLogger(__name__)

_SIZE = struct.Struct(">i")
WRITE_SLICE = 1024 * 1024  # responses are written in slices of this size (see KafkaServer._write)
READ_CHUNK = 256 * 1024  # the most a connection's reader takes from its stream at a time
COALESCE_BYTES = 64 * 1024  # responses up to this size that are ready together are written in one go
PACED_READ_BYTES = 64 * 1024  # a connection's reads are paced (ConnectionLimits.read_pacing_s) while smaller
# the largest frame a connection may send before it authenticated (Kafka's sasl.server.max.receive.size)
UNAUTHENTICATED_MAX_FRAME = 512 * 1024
_conn_ids = itertools.count(1)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client may make a listener hold, and for how long."""
    max_request_bytes: int  # the largest frame
    queued_request_bytes: int  # request bytes held at once across all connections: reading waits beyond it
    in_flight: int  # requests of one connection read and not yet answered: reading it waits beyond it
    read_timeout_s: float  # a frame must arrive whole this soon after its size prefix
    idle_timeout_s: float  # a connection with no request for this long, and none pending, is closed
    write_timeout_s: float  # a client that takes no response bytes for this long is disconnected
    # SO_RCVBUF of a connection (-1: the system's). A connection past `in_flight` is not read, and what its
    # client sends meanwhile waits in this buffer, unseen by the client: the system's grows to megabytes, a few
    # thousand one-record produce requests queued behind the limit. librdkafka holds records back for larger
    # requests only while it cannot write its socket (queue.buffering.backpressure.threshold); Kafka's
    # 100 KiB cut its p99 against a slow listener to a third (bench/history.md, session 71).
    receive_buffer_bytes: int = -1
    # A connection whose reads of Produce requests are small (below PACED_READ_BYTES), come less than twice this
    # apart and find earlier requests still unanswered is read at most once this long after the read before, its
    # socket left unpolled meanwhile (0: never); a client that waits for each answer before it sends again is
    # not. librdkafka sends a request per partition batch: over 10,000 partitions at 2,000 records/s the worker
    # woke about 1,200 times a second for one or two requests, and so did the log process it passed them to;
    # the wake-ups, not the requests, were most of their CPU (bench/history.md, session 88).
    read_pacing_s: float = 0.0

    @classmethod
    def from_config(cls, cfg: Any) -> ConnectionLimits:
        return cls(cfg.max_request_bytes, max(cfg.queued_max_request_bytes, cfg.max_request_bytes),
                   max(cfg.max_in_flight_requests, 1),
                   cfg.request_read_timeout_s, cfg.connections_max_idle_ms / 1000, cfg.response_write_timeout_s,
                   cfg.socket_receive_buffer_bytes, max(min(cfg.read_pacing_ms, cfg.linger_ms), 0) / 1000)


class ByteBudget:
    """Request bytes a listener holds: take() waits while the budget is spent
    (the client's socket is then not read: TCP pushes back), give() returns
    them when the request is done. One frame may always be held alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def take(self, n: int) -> None:
        while self.used and self.used + n > self.limit:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

Handler = Callable[[RequestContext, dict[str, Any]], Awaitable[dict[str, Any] | None]]
# How a RunHandler answers a run: called once with the framed responses of its requests that want
# one, back to back (b"": none), or with the exception the run failed with (a ProtocolViolation closes
# the connection after the responses before it).
RunRespond = Callable[["bytes | BaseException"], None]
# Answers a run of Produce requests a connection sent back to back (their frames with their size
# prefixes, and how many), as a group: a worker's Produce is the request it gets most (librdkafka sends
# one per partition batch, thousands a second, dozens in one read of a connection), and per request a
# task, then a future, a queue entry, a header parse and a response frame of its own had been most of a
# worker's time. Called as the run is read, it calls respond (then or later), or raises; it returns the
# ProtocolViolation of the first request in the run that does not decode (the requests before it are
# answered, the connection then closes), or None.
RunHandler = Callable[[RequestContext, memoryview, int, RunRespond], "ProtocolViolation | None"]
# Answers a request this process has no handler for (a worker asks its log process).
Forward = Callable[[RequestContext, memoryview], Awaitable[list[Any] | None]]
# Requests read and not yet answered, as the send loop gets them: their response's future, their header,
# for a run what to run if the future is cancelled (its done), and how many requests they are.
_Queued = tuple[asyncio.Future[list[Any] | None], RequestContext, Callable[[], None] | None, int]


class _Answers:
    """A connection's requests waiting for their responses, in the order they
    came: its reader appends, its send loop takes from the front and says
    when it has written an item's answer (finished). The reader waits
    (wait_room) while `limit` requests are read and not yet answered (an
    item is one request, or a run of them), which is how the in-flight limit
    holds back reading. asyncio.Queue does this with a dozen Python calls an
    item (its full/qsize/wakeup bookkeeping): here an item's way through
    takes three and no coroutine unless one side has to wait."""

    __slots__ = ("_getter", "_putter", "count", "items", "limit")

    def __init__(self, limit: int) -> None:
        self.items: deque[_Queued | None] = deque()  # None: the reader is done, the send loop ends there
        self.count = 0  # the requests of the items, and of the one the send loop is answering
        self.limit = limit
        self._getter: asyncio.Future[None] | None = None  # the send loop waits for an item
        self._putter: asyncio.Future[None] | None = None  # the reader waits for room

    def put(self, item: _Queued | None) -> None:
        """Append an item, even past the limit (the end marker always goes in)."""
        self.items.append(item)
        if item is not None:
            self.count += item[3]
        if (waiter := self._getter) is not None:
            self._getter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> _Queued | None:
        """The first item (there is one)."""
        return self.items.popleft()

    def finished(self, item: _Queued) -> None:
        """The send loop is done with an item it took: its requests leave the count."""
        self.count -= item[3]
        if (waiter := self._putter) is not None and self.count < self.limit:
            self._putter = None
            if not waiter.done():
                waiter.set_result(None)

    def drain(self) -> list[_Queued | None]:
        """Every item (the send loop ends): a reader waiting for room goes on."""
        items = list(self.items)
        self.items.clear()
        self.count = 0
        if self._putter is not None and not self._putter.done():
            self._putter.set_result(None)
        return items

    def room(self) -> int:
        """How many more requests may be read."""
        return self.limit - self.count

    async def wait_room(self) -> None:
        while self.count >= self.limit:
            self._putter = asyncio.get_running_loop().create_future()
            await self._putter

    async def wait_item(self) -> None:
        while not self.items:
            self._getter = asyncio.get_running_loop().create_future()
            await self._getter


# The on_sent list of the request being handled (see RequestContext.on_sent).
ON_SENT: contextvars.ContextVar[list[Callable[[], None]]] = contextvars.ContextVar("on_sent")


class ProtocolViolation(Exception):
    """The client sent something that is not a valid request: close the connection."""


@dataclass(frozen=True)
class SaslSettings:
    """A listener that requires SASL: the mechanisms it offers and where credentials come from."""
    mechanisms: tuple[str, ...]
    lookup: Lookup


@dataclass
class Session:
    """One connection's authentication state."""
    conn: int
    peer: Any
    authenticated: bool
    client_host: str = ""  # "/address", as Kafka's ACLs name hosts; a trusted proxy replaces it
    principal: str = ANONYMOUS
    exchange: SaslExchange | ProxyIdentity | None = None
    proxied: bool = False  # a trusted proxy named the client this connection speaks for
    raw_tokens: bool = False  # after SaslHandshake v0: bare size-prefixed SASL tokens, no Kafka framing
    closing: bool = False  # authentication failed: close once the answer is sent
    in_flight: int = 0  # requests read and not yet answered: the connection is not idle
    # run when the connection ends (the proxy closes this client's upstream connections)
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


class _ReadDeadline:
    """A time limit on a connection's reads of one kind, without a timer per
    read (an asyncio.timeout costs about 9 µs: two a frame were 7% of a worker
    at 2,000 requests/s). Every read of the kind lasts at most `seconds`, so a
    read's deadline is never earlier than the one the timer is set for:
    starting a read only notes its deadline, and the timer, when it fires,
    sets itself again for the deadline of the read under way, or cancels the
    reading task if that read is past its end. The read then raises
    TimeoutError, as under asyncio.timeout."""

    def __init__(self, task: asyncio.Task[Any], seconds: float) -> None:
        self._task = task
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._due: float | None = None  # the deadline of the read under way
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    def __enter__(self) -> None:
        self._due = self._loop.time() + self._seconds
        if self._timer is None:
            self._timer = self._loop.call_at(self._due, self._fire)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._due = None
        if self._expired:
            self._expired = False
            if exc_type is asyncio.CancelledError and self._task.uncancel() == 0:  # ours, not a shutdown
                raise TimeoutError from exc

    def _fire(self) -> None:
        self._timer = None
        if self._due is None:  # no read under way: the next one sets the timer
            return
        if self._loop.time() < self._due:
            self._timer = self._loop.call_at(self._due, self._fire)
            return
        self._expired = True
        self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass(slots=True)
class _FrameReader:
    """Splits a connection's bytes into request frames. A read takes what the
    stream holds (READ_CHUNK at most) and every complete frame in it is then
    returned without another read or deadline: a worker gets Produce
    requests many at a time (librdkafka sends one per partition batch), and a
    readexactly and a deadline for the size prefix and again for the body of
    each were a sixth of the listener's time per request under cProfile."""

    reader: asyncio.StreamReader
    transport: asyncio.BaseTransport  # the reader's (paused while a read waits for its pace)
    session: Session
    limits: ConnectionLimits
    budget: ByteBudget
    idle: _ReadDeadline
    body: _ReadDeadline
    data: bytes = b""  # bytes read, from pos on not yet returned
    pos: int = 0
    read_at: float = 0.0  # time.monotonic() when the last read returned
    busy: bool = False  # the last read was small and came within two paces of the one before
    paced_until: float = 0.0  # the next read waits until then (set when a run of Produce requests took all read)

    async def fill(self) -> bool:
        """Read until a frame's size prefix is here (False at a clean end, or
        when the connection was idle past its limit)."""
        session = self.session
        while len(self.data) - self.pos < 4:
            try:
                if not await self._read():
                    if len(self.data) > self.pos:
                        raise ProtocolViolation(f"truncated size prefix ({len(self.data) - self.pos} bytes)")
                    return False
            except TimeoutError:
                if session.in_flight == 0:
                    log.info("conn %d from %s: closing after %.0f s idle", session.conn, session.peer,
                             self.limits.idle_timeout_s)
                    return False
        return True

    def produce_run(self, max_frames: int) -> tuple[bytes, int] | None:
        """The complete Produce frames read and not yet returned, from the next
        one on (their size prefixes included, copied out), and how many: at
        most max_frames, up to the first other frame; None if the next one
        is not such a frame. Their bytes are not taken from the budget."""
        count, end = _native.produce_run(self.data, self.pos, self.limits.max_request_bytes, max_frames,
                                         PRODUCE.min_version, PRODUCE.max_version)
        if not count:
            return None
        run, self.pos = self.data[self.pos:end], end
        if self.busy and end == len(self.data) and self.session.in_flight:  # pipelining, not request-response
            self.paced_until = self.read_at + self.limits.read_pacing_s
        return run, count

    async def next(self) -> memoryview | None:
        """The next frame (None at a clean end, or when the connection was idle
        past its limit), its bytes taken from the listener's budget: the caller
        gives them back when the request is done. Before authentication a frame
        may be UNAUTHENTICATED_MAX_FRAME bytes at most."""
        session = self.session
        if not await self.fill():
            return None
        (size,) = _SIZE.unpack_from(self.data, self.pos)
        min_size = 1 if session.raw_tokens else 8
        max_size = self.limits.max_request_bytes if session.authenticated else UNAUTHENTICATED_MAX_FRAME
        if size < min_size or size > max_size:
            raise ProtocolViolation(f"frame size {size} outside [{min_size}, {max_size}]"
                                    + ("" if session.authenticated else " before authentication"))
        await self.budget.take(size)
        start = self.pos + 4
        end = start + size
        if end <= len(self.data):
            self.pos = end
            return memoryview(self.data[start:end])  # a copy: a request never holds the bytes read with it
        head = self.data[start:]
        self.data, self.pos = b"", 0
        try:
            with self.body:
                return memoryview(head + await self.reader.readexactly(size - len(head)))
        except BaseException as exc:
            self.budget.give(size)
            if isinstance(exc, TimeoutError):
                raise ProtocolViolation(f"frame of {size} bytes not received within "
                                        f"{self.limits.read_timeout_s:.0f} s") from None
            if isinstance(exc, asyncio.IncompleteReadError):
                raise ProtocolViolation(f"truncated frame: {len(head) + len(exc.partial)} of {size} bytes"
                                        ) from None
            raise

    async def _read(self) -> bool:
        """Add what the stream holds next to the bytes not yet returned (under
        the idle limit: a frame's first bytes); False at its end. A busy
        connection's read after a run of Produce requests first waits for
        its pace (ConnectionLimits.read_pacing_s), its socket not polled."""
        if self.paced_until:
            await self._pace()
        with self.idle:
            chunk = await self.reader.read(READ_CHUNK)
        if not chunk:
            return False
        now = time.monotonic()
        self.busy = len(chunk) < PACED_READ_BYTES and now - self.read_at < 2 * self.limits.read_pacing_s
        self.read_at = now
        rest = self.data[self.pos:]
        self.data, self.pos = (rest + chunk if rest else chunk), 0
        return True

    async def _pace(self) -> None:
        """Wait until paced_until with the transport not reading (unless the
        stream paused it for its own buffer's sake): what the client sends
        meanwhile waits in the socket and is then read in one go."""
        wait, self.paced_until = self.paced_until - time.monotonic(), 0.0
        transport = self.transport
        if wait > 0 and isinstance(transport, asyncio.ReadTransport) and transport.is_reading():
            transport.pause_reading()
            try:
                await asyncio.sleep(wait)
            finally:
                transport.resume_reading()


SESSION: contextvars.ContextVar[Session] = contextvars.ContextVar("session")
_SASL_APIS = (SASL_HANDSHAKE.key, SASL_AUTHENTICATE.key)
_BEFORE_AUTH = (API_VERSIONS.key, *_SASL_APIS)


def malformed_body(api_key: int, version: int, why: object) -> ProtocolViolation:
    """What a request whose body does not decode is: the connection closes, saying why."""
    return ProtocolViolation(f"malformed {APIS[api_key].name} v{version} body: {why}")


def _decode(hdr: RequestContext, frame: memoryview, body_at: int) -> dict[str, Any]:
    api = APIS[hdr.api_key]
    try:
        req, end = api.request.decode(frame, hdr.api_version, body_at)
    except DecodeError as exc:
        raise malformed_body(hdr.api_key, hdr.api_version, exc) from None
    if end != len(frame):
        # Kafka ignores bytes after the body, and librdkafka sends some (a
        # 4-byte array-count placeholder in Metadata v9+ for all topics).
        log.debug("%s v%d: ignoring %d trailing bytes", api.name, hdr.api_version, len(frame) - end)
    return req


def _failed(hdr: RequestContext, req: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """The response to a request whose handler raised exc: the client gets an
    error code, and its connection stays open."""
    api = APIS[hdr.api_key]
    if isinstance(exc, KafkaError):
        log.info("%s v%d failed: %s", api.name, hdr.api_version, exc)
        return error_response(api, hdr.api_version, req, exc.code, str(exc))
    if unavailable(exc):
        code = unavailable_code(hdr.api_key)
        log.warning("%s v%d: answering %s: %r", api.name, hdr.api_version, code.name, exc)
    else:
        code = ErrorCode.UNKNOWN_SERVER_ERROR
        log.error("%s v%d failed; answering %s", api.name, hdr.api_version, code.name, exc_info=exc)
    return error_response(api, hdr.api_version, req, code, f"{type(exc).__name__}: {exc}")


def _framed(hdr: RequestContext, req: dict[str, Any], body: dict[str, Any] | None) -> list[Any] | None:
    if body is None or (hdr.api_key == PRODUCE.key and req.get("acks") == 0):
        return None
    return encode_response(hdr, body)


async def call_handler(handlers: dict[int, Handler], hdr: RequestContext, frame: memoryview, body_at: int
                       ) -> list[Any] | None:
    """Decode a request body, run its handler, encode the response (None: no response)."""
    req = _decode(hdr, frame, body_at)
    try:
        body = await handlers[hdr.api_key](hdr, req)
    except (ProtocolViolation, asyncio.CancelledError):
        raise
    except Exception as exc:
        body = _failed(hdr, req, exc)
    return _framed(hdr, req, body)


def run_frames(run: memoryview, count: int) -> Iterator[memoryview]:
    """The frames of a run (see RunHandler), without their size prefixes."""
    pos = 0
    for _ in range(count):
        (size,) = _SIZE.unpack_from(run, pos)
        yield run[pos + 4:pos + 4 + size]
        pos += 4 + size


def failed_answer(frame: memoryview, exc: Exception) -> tuple[int, int, dict[str, Any]] | None:
    """A Produce request of a run that failed with exc, answered with an error
    code (its connection stays open): (correlation id, version, response
    body) for encode_produce_responses, None for an acks=0 one (no answer).
    ProtocolViolation if the request does not decode."""
    *wire, body_at = parse_header(frame)
    hdr = RequestContext(*wire)
    req = _decode(hdr, frame, body_at)
    return None if req["acks"] == 0 else (hdr.correlation_id, hdr.api_version, _failed(hdr, req, exc))


def parse_header(frame: memoryview) -> HeaderFields:
    """The request header's fields and where the body starts
    (request_header_fields); ProtocolViolation for unknown APIs and
    unsupported versions (except ApiVersions, answered in v0)."""
    try:
        fields = request_header_fields(frame)
    except DecodeError as exc:
        raise ProtocolViolation(f"malformed request header: {exc}") from None
    api_key, api_version, correlation_id = fields[:3]
    api = APIS.get(api_key)
    if api is None:
        raise ProtocolViolation(f"unknown API key {api_key} (correlation id {correlation_id})")
    if not api.supports(api_version) and api_key != API_VERSIONS.key:
        raise ProtocolViolation(f"{api.name} v{api_version} is not supported (v{api.min_version}-v{api.max_version})")
    return fields


class KafkaServer:
    def __init__(self, handlers: dict[int, Handler], host: str, port: int, limits: ConnectionLimits,
                 reuse_port: bool = False, forward: Forward | None = None, ssl: ssl_mod.SSLContext | None = None,
                 sasl: SaslSettings | None = None, proxy_secret: str = "",
                 produce_run: RunHandler | None = None) -> None:
        self.handlers = handlers
        self.produce_run = produce_run
        self.sasl = sasl
        self.proxy_secret = proxy_secret  # set: a proxy knowing it may speak for its clients (ProxyIdentity)
        self._sasl_handlers: dict[int, Handler] = {SASL_HANDSHAKE.key: self.sasl_handshake,
                                                   SASL_AUTHENTICATE.key: self.sasl_authenticate}
        self.ssl = ssl
        self.forward = forward
        self.host = host
        self.port = port
        self.limits = limits
        self.budget = ByteBudget(limits.queued_request_bytes)
        self.reuse_port = reuse_port
        self._server: asyncio.base_events.Server | None = None
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self, listen: bool = True) -> None:
        """Bind the port and, unless `listen` is false (then listen() does), listen on it."""
        tls: dict[str, Any] = {"ssl": self.ssl, "ssl_handshake_timeout": 10} if self.ssl else {}
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_port=self.reuse_port,
                                                  limit=1024 * 1024, start_serving=False, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        if listen:
            await self.listen()

    async def listen(self) -> None:
        """Accept connections on the bound port (with SO_REUSEPORT, a socket
        bound but not listening is given none of them)."""
        assert self._server is not None, "start() binds first"
        await self._server.start_serving()
        log.info("Kafka listener on %s:%d (%s%s)", self.host, self.port, "SASL_" if self.sasl else "",
                 "SSL" if self.ssl else "PLAINTEXT")

    def stop_listening(self) -> None:
        """Accept no new connections; the open ones carry on."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop listening, close every connection (their tasks end on EOF rather
        than by cancellation, which asyncio's stream server logs as an error)."""
        if self._server is not None:
            self._server.close()
        for writer in self._conns.values():
            writer.close()
        if self._conns:
            _, stuck = await asyncio.wait(list(self._conns), timeout=5)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._conns[me] = writer
        conn = next(_conn_ids)
        peer = writer.get_extra_info("peername")
        append_order = asyncio.Lock()
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.limits.receive_buffer_bytes > 0:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.limits.receive_buffer_bytes)
        queue = _Answers(self.limits.in_flight)
        sender = asyncio.create_task(self._send_loop(queue, writer, conn, peer))
        session = Session(conn, peer, authenticated=self.sasl is None,
                          client_host=f"/{peer[0]}" if isinstance(peer, tuple) else "")
        SESSION.set(session)  # request tasks copy this context
        deadlines = (_ReadDeadline(me, self.limits.idle_timeout_s), _ReadDeadline(me, self.limits.read_timeout_s))
        frames = _FrameReader(reader, writer.transport, session, self.limits, self.budget, *deadlines)
        runs = self.produce_run is not None
        try:
            while not sender.done():
                if queue.count >= queue.limit:
                    paused = time.perf_counter()
                    await queue.wait_room()
                    _pause_metric().observe(time.perf_counter() - paused)
                    continue
                if runs and session.authenticated and not session.raw_tokens:
                    if not await frames.fill():
                        break
                    run = frames.produce_run(queue.room())
                    if run is not None:
                        await self.budget.take(len(run[0]))
                        if not self._start_run(session, append_order, queue, *run, len(run[0])):
                            break
                        continue
                frame = await frames.next()
                if frame is None:
                    break
                try:
                    if session.raw_tokens:
                        hdr = RequestContext(SASL_AUTHENTICATE.key, 0, 0, None, False)
                        task = asyncio.create_task(self._raw_token(session, bytes(frame)))
                    else:
                        *wire, body_at = parse_header(frame)
                        if not session.authenticated and wire[0] not in _BEFORE_AUTH:
                            raise ProtocolViolation(f"{APIS[wire[0]].name} request before SASL authentication")
                        if runs and wire[0] == PRODUCE.key:  # one that came in pieces: a run of its own
                            if not self._start_run(session, append_order, queue, _SIZE.pack(len(frame)) + frame,
                                                   1, len(frame)):
                                break
                            continue
                        hdr = RequestContext(*wire, session.client_host, session.principal, append_order)
                        task = asyncio.create_task(self._handle(hdr, frame, body_at))
                except BaseException:
                    self.budget.give(len(frame))
                    raise
                session.in_flight += 1
                task.add_done_callback(functools.partial(self._request_done, session, len(frame)))
                queue.put((task, hdr, None, 1))
                if hdr.api_key in _SASL_APIS:
                    await asyncio.wait([task])  # the next request must see the outcome
                    if session.closing:
                        break
        except ProtocolViolation as exc:
            log.warning("conn %d from %s: closing: %s", conn, peer, exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            sender.cancel()
            raise
        finally:
            for d in deadlines:
                d.close()
            queue.put(None)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(sender, 30)
            _drop(queue.drain())  # read while the send loop ended
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            for cb in session.on_close:
                try:
                    await cb()
                except Exception as exc:
                    log.warning("conn %d from %s: cleanup failed: %r", conn, peer, exc)
            self._conns.pop(me, None)

    def _request_done(self, session: Session, size: int, _task: asyncio.Task[Any] | None = None) -> None:
        session.in_flight -= 1
        self.budget.give(size)

    def _start_run(self, session: Session, append_order: asyncio.Lock, queue: _Answers, run: bytes, count: int,
                   held: int) -> bool:
        """Hand a run of Produce requests (their frames; `held` bytes of the
        budget, given back once they are answered) to the run handler, and
        queue its answer; False if one of them broke the protocol: the
        connection closes after the answers before it."""
        assert self.produce_run is not None
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        out: asyncio.Future[list[Any] | None] = loop.create_future()
        hdr = RequestContext(PRODUCE.key, 0, 0, None, False, session.client_host, session.principal, append_order)
        session.in_flight += count

        def done() -> None:
            session.in_flight -= count
            self.budget.give(held)

        def respond(answers: bytes | BaseException) -> None:
            if out.done():  # cancelled: the connection went away
                return
            _count_request(PRODUCE.key, started, count)
            if isinstance(answers, BaseException):
                out.set_exception(answers)
            else:
                out.set_result([answers] if answers else None)
            done()

        frames = memoryview(run)
        violation = None
        try:
            violation = self.produce_run(hdr, frames, count, respond)
        except ProtocolViolation as exc:
            respond(exc)
        except Exception as exc:  # each request gets an error code, and the connection stays open
            try:
                respond(encode_produce_responses([a for frame in run_frames(frames, count)
                                                  if (a := failed_answer(frame, exc)) is not None]))
            except ProtocolViolation as bad:
                respond(bad)
        queue.put((out, hdr, done, count))
        if violation is None:
            return True
        refused = loop.create_future()
        refused.set_exception(violation)
        queue.put((refused, hdr, None, 0))
        return False

    async def _handle(self, hdr: RequestContext, frame: memoryview, body_at: int) -> list[Any] | None:
        t = time.perf_counter()
        try:
            return await self._dispatch(hdr, frame, body_at)
        finally:
            _count_request(hdr.api_key, t)

    async def _dispatch(self, hdr: RequestContext, frame: memoryview, body_at: int) -> list[Any] | None:
        ON_SENT.set(hdr.on_sent)
        if hdr.api_key == API_VERSIONS.key and not APIS[hdr.api_key].supports(hdr.api_version):
            # Answer in v0 with UNSUPPORTED_VERSION and our ranges; the client retries lower.
            hdr = RequestContext(hdr.api_key, 0, hdr.correlation_id, hdr.client_id, False, on_sent=hdr.on_sent)
            body = await self.handlers[API_VERSIONS.key](hdr, {})
            assert body is not None
            body["error_code"] = ErrorCode.UNSUPPORTED_VERSION
            return encode_response(hdr, body)
        if hdr.api_key in self._sasl_handlers:
            return await call_handler(self._sasl_handlers, hdr, frame, body_at)
        if hdr.api_key not in self.handlers and self.forward is not None:
            return await self.forward(hdr, frame)
        return await call_handler(self.handlers, hdr, frame, body_at)

    # ------------------------------------------------------------------ SASL
    async def sasl_handshake(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        session = SESSION.get()
        offered = list(self.sasl.mechanisms) if self.sasl else []
        if req["mechanism"] == PROXY_MECHANISM and self.proxy_secret and hdr.api_version >= 1:
            if session.exchange is not None or session.proxied or session.principal != ANONYMOUS:
                session.closing = True
                return {"error_code": ErrorCode.ILLEGAL_SASL_STATE, "mechanisms": offered}
            session.exchange = ProxyIdentity(self.proxy_secret)
            return {"error_code": 0, "mechanisms": offered}
        if self.sasl is None or session.authenticated or session.exchange is not None:
            session.closing = True
            return {"error_code": ErrorCode.ILLEGAL_SASL_STATE, "mechanisms": offered}
        if req["mechanism"] not in offered:
            log.info("conn %d from %s: unsupported SASL mechanism %r", session.conn, session.peer, req["mechanism"])
            session.closing = True
            return {"error_code": ErrorCode.UNSUPPORTED_SASL_MECHANISM, "mechanisms": offered}
        session.exchange = SaslExchange(req["mechanism"], self.sasl.lookup)
        session.raw_tokens = hdr.api_version == 0
        return {"error_code": 0, "mechanisms": offered}

    @staticmethod
    async def _sasl_step(session: Session, token: bytes) -> bytes:
        """One token of the session's exchange; the session is authenticated once
        it completes. SaslFailed (logged) marks the connection for closing."""
        assert session.exchange is not None
        exchange = session.exchange
        try:
            answer = await exchange.step(token)
        except SaslFailed as exc:
            log.info("conn %d from %s: %s", session.conn, session.peer, exc)
            session.closing = True
            raise
        if exchange.principal is not None:
            session.principal, session.authenticated, session.raw_tokens = exchange.principal, True, False
            if isinstance(exchange, ProxyIdentity):
                session.client_host, session.proxied = exchange.client_host, True
            log.debug("conn %d from %s: authenticated as %s (%s)", session.conn, session.peer,
                      exchange.principal, exchange.mechanism)
        return answer

    async def _raw_token(self, session: Session, token: bytes) -> list[bytes] | None:
        """One SASL token after a v0 handshake: answered bare; a failure just closes."""
        try:
            answer = await self._sasl_step(session, token)
        except SaslFailed:
            return None
        return [_SIZE.pack(len(answer)), answer]

    async def sasl_authenticate(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        session = SESSION.get()
        proxy_step = isinstance(session.exchange, ProxyIdentity) and not session.proxied
        if session.exchange is None or (session.authenticated and not proxy_step):
            session.closing = True
            return {"error_code": ErrorCode.ILLEGAL_SASL_STATE, "error_message": "no SASL handshake in progress",
                    "auth_bytes": b""}
        try:
            token = await self._sasl_step(session, bytes(req["auth_bytes"]))
        except SaslFailed as exc:
            return {"error_code": ErrorCode.SASL_AUTHENTICATION_FAILED, "error_message": str(exc),
                    "auth_bytes": b""}
        return {"error_code": 0, "error_message": None, "auth_bytes": token, "session_lifetime_ms": 0}

    async def _send_loop(self, queue: _Answers,
                         writer: asyncio.StreamWriter, conn: int, peer: Any) -> None:
        """Answer the connection's requests in the order it sent them. Small
        responses that are ready together (a node flush acknowledges many
        produces at once) are copied into one buffer and written in one go;
        a larger one is written from its own chunks (a Fetch's cached
        segment bytes are not copied)."""
        current: _Queued | None = None
        ready = bytearray()  # small responses not written yet
        try:
            while True:
                if not queue.items:
                    await self._flush(writer, ready)
                    await queue.wait_item()
                current = queue.take()
                if current is None:
                    await self._flush(writer, ready)
                    return
                task, hdr, _, _ = current
                if not task.done():
                    await self._flush(writer, ready)
                try:
                    chunks = await task
                except ProtocolViolation as exc:
                    log.warning("conn %d from %s: closing: %s", conn, peer, exc)
                    await self._flush(writer, ready)
                    writer.close()
                    return
                except Exception:
                    log.exception("conn %d from %s: request failed; closing the connection", conn, peer)
                    await self._flush(writer, ready)
                    writer.close()
                    return
                chunks = chunks or ()
                if sum(map(len, chunks)) <= COALESCE_BYTES:
                    for c in chunks:
                        ready += c
                else:
                    await self._flush(writer, ready)
                    await self._write(writer, chunks)
                if hdr.on_sent:
                    run_on_sent(hdr.on_sent)
                queue.finished(current)
                current = None
                if len(ready) >= COALESCE_BYTES:
                    await self._flush(writer, ready)
        except TimeoutError:
            log.warning("conn %d from %s: closing: the client took no response bytes for %.0f s", conn, peer,
                        self.limits.write_timeout_s)
            writer.close()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            _drop([current, *queue.drain()])

    async def _flush(self, writer: asyncio.StreamWriter, ready: bytearray) -> None:
        """Write (and empty) the buffer of small responses."""
        if ready:
            data = bytes(ready)
            ready.clear()
            await self._write(writer, (data,))

    async def _write(self, writer: asyncio.StreamWriter, chunks: Any) -> None:
        """Write a response in slices of WRITE_SLICE, waiting whenever the
        socket has not taken WRITE_SLICE bytes: the transport copies only what
        the socket did not take, so a client that reads slowly (or never)
        makes the listener hold about one slice, not a whole Fetch response,
        and one that takes nothing for write_timeout_s is disconnected
        (TimeoutError)."""
        transport = writer.transport
        if transport.is_closing():  # the client went away: nothing more is sent (the send loop ends)
            raise ConnectionResetError("connection closed")
        for chunk in chunks:
            view = memoryview(chunk)
            for i in range(0, len(view), WRITE_SLICE):
                writer.write(view[i:i + WRITE_SLICE])
                if transport.get_write_buffer_size() > WRITE_SLICE:
                    await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)


@functools.cache
def _request_metrics(api_key: int) -> tuple[Any, Any]:
    """This process's request counter and latency histogram for one API."""
    name = APIS[api_key].name
    return (metrics.Tally(metrics.REQUESTS.labels(metrics.node(), metrics.process(), name)),
            metrics.HistogramTally(metrics.REQUEST_SECONDS.labels(metrics.node(), name)))


@functools.cache
def _pause_metric() -> metrics.HistogramTally:
    """This process's histogram of the times a connection was not read for its in-flight limit."""
    return metrics.HistogramTally(metrics.CONNECTION_PAUSED_SECONDS.labels(metrics.node(), metrics.process()))


def _count_request(api_key: int, started: float, n: int = 1) -> None:
    """Count n answered requests and the time since they started (perf_counter)."""
    count, seconds = _request_metrics(api_key)
    count.inc(n)
    seconds.observe(time.perf_counter() - started, n)


def _drop(items: list[_Queued | None]) -> None:
    """Requests that will not be answered now: they still release what they hold."""
    for item in items:
        if item is not None:
            fut, hdr, done, _ = item
            if not fut.cancel() and not fut.cancelled():  # answered (or refused) already: nobody reads it now
                fut.exception()
            elif done is not None:  # a run never answered: its respond did not run done
                done()
            fut.add_done_callback(lambda _t, h=hdr: run_on_sent(h.on_sent))


def run_on_sent(callbacks: list[Callable[[], None]]) -> None:
    """Run and clear a request's on_sent callbacks (see RequestContext.on_sent)."""
    pending, callbacks[:] = list(callbacks), []
    for cb in pending:
        cb()
