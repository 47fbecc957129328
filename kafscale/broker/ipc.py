"""The channel between a node's protocol workers and its log process over a
Unix stream socket: a 4-byte length, then a pickled envelope around one of
the message objects of messages.py. Only descriptors and small control
messages travel here; produce payloads stay in the shared rings. Calls are
answered in whatever order they finish; events are one-way."""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_CALL, _REPLY, _EVENT = 0, 1, 2

OnCall = Callable[[Any], Awaitable[Any]]  # a call message -> its reply
OnEvent = Callable[[Any], None]


class RemoteError(Exception):
    """The other side raised while handling a call."""


class ChannelClosed(ConnectionError):
    pass


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_call: OnCall | None = None, on_event: OnEvent | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self._on_call = on_call
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []  # messages sent since the loop last ran: written together
        self.closed = False

    def _send(self, msg: tuple[Any, ...]) -> None:
        """Queue a message; the messages sent in one pass of the event loop go
        out in one write (a node flush acknowledges and announces many
        partitions at once: one system call, not one per message)."""
        self.send_encoded(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_encoded(self, data: bytes) -> None:
        """Queue a message pickled already (an event for many channels: encode_event)."""
        if self.closed:
            raise ChannelClosed("channel closed")
        if not self._out:
            asyncio.get_running_loop().call_soon(self._write)
        self._out += (_LEN.pack(len(data)), data)

    def _write(self) -> None:
        out, self._out = self._out, []
        if not self.closed:
            self._writer.write(b"".join(out))

    def call(self, message: Any) -> asyncio.Future[Any]:
        """Send a call now (so calls keep their order) and return the future reply."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = next(self._ids)
        self._send((_CALL, call_id, message))
        self._waiting[call_id] = fut
        return fut

    @staticmethod
    def encode_event(message: Any) -> bytes:
        """An event pickled once, for send_encoded on many channels."""
        return pickle.dumps((_EVENT, message), protocol=pickle.HIGHEST_PROTOCOL)

    async def serve(self) -> None:
        """Read until the peer closes; then fail whatever still waits on a reply."""
        try:
            while True:
                head = await self._reader.readexactly(4)
                msg = pickle.loads(await self._reader.readexactly(_LEN.unpack(head)[0]))
                if msg[0] == _REPLY:
                    fut = self._waiting.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(RemoteError(msg[3]))
                elif msg[0] == _CALL:
                    task = asyncio.create_task(self._answer(msg[1], msg[2]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif self._on_event is not None:
                    self._on_event(msg[1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.close()

    async def _answer(self, call_id: int, message: Any) -> None:
        assert self._on_call is not None
        try:
            reply = (_REPLY, call_id, True, await self._on_call(message))
        except Exception as exc:
            log.exception("%s call failed", type(message).__name__)
            reply = (_REPLY, call_id, False, f"{type(exc).__name__}: {exc}")
        if not self.closed:
            self._send(reply)

    def close(self) -> None:
        if self.closed:
            return
        self._write()
        self.closed = True
        self._writer.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ChannelClosed("log process went away"))
                fut.exception()
        self._waiting.clear()
