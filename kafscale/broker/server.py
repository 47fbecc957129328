"""The Kafka listener: reads size-prefixed frames, dispatches them to the
Broker's handlers and writes responses in request order.

A connection may pipeline requests: each one runs as its own task and a
writer awaits them in order, so a Produce waiting for S3 does not hold up
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kafscale import metrics
from kafscale.broker.context import RequestContext
from kafscale.metadata.store import unavailable
from kafscale.protocol.codec import DecodeError
from kafscale.protocol.error_response import error_response, unavailable_code
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import HeaderFields, encode_response, request_header_fields
from kafscale.protocol.schemas import API_VERSIONS, APIS, PRODUCE, SASL_AUTHENTICATE, SASL_HANDSHAKE
from kafscale.security.sasl import ANONYMOUS, PROXY_MECHANISM, Lookup, ProxyIdentity, SaslExchange, SaslFailed

log = logging.getLogger(__name__)

_SIZE = struct.Struct(">i")
WRITE_SLICE = 1024 * 1024  # responses are written in slices of this size (see KafkaServer._write)
READ_CHUNK = 256 * 1024  # the most a connection's reader takes from its stream at a time
COALESCE_BYTES = 64 * 1024  # responses up to this size that are ready together are written in one go
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

    @classmethod
    def from_config(cls, cfg: Any) -> ConnectionLimits:
        return cls(cfg.max_request_bytes, max(cfg.queued_max_request_bytes, cfg.max_request_bytes),
                   max(cfg.max_in_flight_requests, 1),
                   cfg.request_read_timeout_s, cfg.connections_max_idle_ms / 1000, cfg.response_write_timeout_s)


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
# How a DirectHandler answers: called once with the response body (None: no response) or the exception
# the request failed with.
Respond = Callable[["dict[str, Any] | BaseException | None"], None]
# Answers a request without a task of its own: called as the request is read, it calls respond (then or
# later) or raises. A worker's Produce is one: thousands a second (one per partition batch), a task each
# cost a fifth of the worker's time per request; answering through respond instead of a future each
# (with two smaller trims) took the listener from 23.1 to 21.0 µs a request (bench/README.md, session 33).
DirectHandler = Callable[[RequestContext, dict[str, Any], Respond], None]
# Answers a request this process has no handler for (a worker asks its log process).
Forward = Callable[[RequestContext, memoryview], Awaitable[list[Any] | None]]
# A request read and not yet answered, as the send loop gets it: its response's future and its header,
# and for a direct request what to run if the future is cancelled (answer_directly's done).
_Queued = tuple[asyncio.Future[list[Any] | None], RequestContext, Callable[[], None] | None]


class _Answers:
    """A connection's requests waiting for their responses, in the order they
    came: its reader appends, its send loop takes from the front. The reader
    waits (wait_room) while `limit` are waiting, which is how the in-flight
    limit holds back reading. asyncio.Queue does this with a dozen Python
    calls a request (its full/qsize/wakeup bookkeeping): here a request's
    way through takes two and no coroutine unless one side has to wait."""

    __slots__ = ("_getter", "_putter", "items", "limit")

    def __init__(self, limit: int) -> None:
        self.items: deque[_Queued | None] = deque()  # None: the reader is done, the send loop ends there
        self.limit = limit
        self._getter: asyncio.Future[None] | None = None  # the send loop waits for an item
        self._putter: asyncio.Future[None] | None = None  # the reader waits for room

    def put(self, item: _Queued | None) -> None:
        """Append an item, even past the limit (the end marker always goes in)."""
        self.items.append(item)
        if (waiter := self._getter) is not None:
            self._getter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> _Queued | None:
        """The first item (there is one)."""
        item = self.items.popleft()
        if (waiter := self._putter) is not None and len(self.items) < self.limit:
            self._putter = None
            if not waiter.done():
                waiter.set_result(None)
        return item

    def drain(self) -> list[_Queued | None]:
        """Every item (the send loop ends): a reader waiting for room goes on."""
        items = list(self.items)
        self.items.clear()
        if self._putter is not None and not self._putter.done():
            self._putter.set_result(None)
        return items

    async def wait_room(self) -> None:
        while len(self.items) >= self.limit:
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
    session: Session
    limits: ConnectionLimits
    budget: ByteBudget
    idle: _ReadDeadline
    body: _ReadDeadline
    data: bytes = b""  # bytes read, from pos on not yet returned
    pos: int = 0

    async def next(self) -> memoryview | None:
        """The next frame (None at a clean end, or when the connection was idle
        past its limit), its bytes taken from the listener's budget: the caller
        gives them back when the request is done. Before authentication a frame
        may be UNAUTHENTICATED_MAX_FRAME bytes at most."""
        session = self.session
        while len(self.data) - self.pos < 4:
            try:
                if not await self._read():
                    if len(self.data) > self.pos:
                        raise ProtocolViolation(f"truncated size prefix ({len(self.data) - self.pos} bytes)")
                    return None
            except TimeoutError:
                if session.in_flight == 0:
                    log.info("conn %d from %s: closing after %.0f s idle", session.conn, session.peer,
                             self.limits.idle_timeout_s)
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
        the idle limit: a frame's first bytes); False at its end."""
        with self.idle:
            chunk = await self.reader.read(READ_CHUNK)
        if not chunk:
            return False
        rest = self.data[self.pos:]
        self.data, self.pos = (rest + chunk if rest else chunk), 0
        return True


SESSION: contextvars.ContextVar[Session] = contextvars.ContextVar("session")
_SASL_APIS = (SASL_HANDSHAKE.key, SASL_AUTHENTICATE.key)
_BEFORE_AUTH = (API_VERSIONS.key, *_SASL_APIS)


def _decode(hdr: RequestContext, frame: memoryview, body_at: int) -> dict[str, Any]:
    api = APIS[hdr.api_key]
    try:
        req, end = api.request.decode(frame, hdr.api_version, body_at)
    except DecodeError as exc:
        raise ProtocolViolation(f"malformed {api.name} v{hdr.api_version} body: {exc}") from None
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


def answer_directly(handler: DirectHandler, hdr: RequestContext, frame: memoryview, body_at: int,
                    done: Callable[[], None]) -> asyncio.Future[list[Any] | None]:
    """What call_handler does, with a DirectHandler: the future of the
    framed response (None: no response), counted as _handle counts. done()
    runs when the request is answered (not when the future is cancelled),
    in place of a callback on the future: one loop callback fewer a request.
    A ProtocolViolation the handler raises is answered in order, like one it
    responds with: the connection closes after the responses before it."""
    started = time.perf_counter()
    out: asyncio.Future[list[Any] | None] = asyncio.get_running_loop().create_future()

    def respond(body: dict[str, Any] | BaseException | None) -> None:
        if out.done():  # cancelled: the connection went away
            return
        _count_request(hdr.api_key, started)
        try:
            if isinstance(body, BaseException):
                if isinstance(body, ProtocolViolation) or not isinstance(body, Exception):
                    raise body
                body = _failed(hdr, req, body)
            out.set_result(_framed(hdr, req, body))
        except BaseException as exc:  # as from a _handle task: logged, the connection closed
            out.set_exception(exc)
        done()

    try:
        req = _decode(hdr, frame, body_at)
        handler(hdr, req, respond)
    except Exception as exc:
        respond(exc)
    return out


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
                 direct: dict[int, DirectHandler] | None = None) -> None:
        self.handlers = handlers
        self.direct = direct or {}
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

    async def start(self) -> None:
        tls: dict[str, Any] = {"ssl": self.ssl, "ssl_handshake_timeout": 10} if self.ssl else {}
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_port=self.reuse_port,
                                                  limit=1024 * 1024, **tls)
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]
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
        queue = _Answers(self.limits.in_flight)
        sender = asyncio.create_task(self._send_loop(queue, writer, conn, peer))
        session = Session(conn, peer, authenticated=self.sasl is None,
                          client_host=f"/{peer[0]}" if isinstance(peer, tuple) else "")
        SESSION.set(session)  # request tasks copy this context
        deadlines = (_ReadDeadline(me, self.limits.idle_timeout_s), _ReadDeadline(me, self.limits.read_timeout_s))
        frames = _FrameReader(reader, session, self.limits, self.budget, *deadlines)
        try:
            while not sender.done():
                if len(queue.items) >= queue.limit:
                    await queue.wait_room()
                    continue
                frame = await frames.next()
                if frame is None:
                    break
                done = functools.partial(self._request_done, session, len(frame))
                direct = None
                try:
                    if session.raw_tokens:
                        hdr = RequestContext(SASL_AUTHENTICATE.key, 0, 0, None, False)
                        task = asyncio.create_task(self._raw_token(session, bytes(frame)))
                    else:
                        *wire, body_at = parse_header(frame)
                        if not session.authenticated and wire[0] not in _BEFORE_AUTH:
                            raise ProtocolViolation(f"{APIS[wire[0]].name} request before SASL authentication")
                        hdr = RequestContext(*wire, session.client_host, session.principal, append_order)
                        direct = self.direct.get(hdr.api_key)
                        task = (answer_directly(direct, hdr, frame, body_at, done) if direct is not None
                                else asyncio.create_task(self._handle(hdr, frame, body_at)))
                except BaseException:
                    self.budget.give(len(frame))
                    raise
                session.in_flight += 1  # (a direct request answered at once has taken 1 off already)
                if direct is None:
                    task.add_done_callback(done)
                queue.put((task, hdr, done if direct is not None else None))
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
                task, hdr, _ = current
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


def _count_request(api_key: int, started: float) -> None:
    """Count an answered request and the time since it started (perf_counter)."""
    count, seconds = _request_metrics(api_key)
    count.inc()
    seconds.observe(time.perf_counter() - started)


def _drop(items: list[_Queued | None]) -> None:
    """Requests that will not be answered now: they still release what they hold."""
    for item in items:
        if item is not None:
            fut, hdr, done = item
            fut.cancel()
            if done is not None and fut.cancelled():  # never answered: answer_directly did not run it
                done()
            fut.add_done_callback(lambda _t, h=hdr: run_on_sent(h.on_sent))


def run_on_sent(callbacks: list[Callable[[], None]]) -> None:
    """Run and clear a request's on_sent callbacks (see RequestContext.on_sent)."""
    pending, callbacks[:] = list(callbacks), []
    for cb in pending:
        cb()
