"""The listener's read time limits (KafkaServer with an in-process handler,
over real sockets): an idle connection is closed, one that sends a frame's
size and stalls is closed, and connections that keep sending, or wait for an
answer, are not, however long they last."""
from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kafscale.broker.context import RequestContext
from kafscale.broker.server import ConnectionLimits, KafkaServer
from kafscale.protocol.codec import Reader
from kafscale.protocol.framing import encode_request
from kafscale.protocol.schemas import METADATA

LIMIT_S = 0.4  # both the idle and the read limit


async def _server(slow_s: float = 0) -> KafkaServer:
    async def metadata(hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(slow_s)
        return {"throttle_time_ms": 0, "brokers": [], "cluster_id": "c", "controller_id": -1, "topics": []}

    limits = ConnectionLimits(1 << 20, 1 << 20, 10, read_timeout_s=LIMIT_S, idle_timeout_s=LIMIT_S,
                              write_timeout_s=5)
    server = KafkaServer({METADATA.key: metadata}, "127.0.0.1", 0, limits)
    await server.start()
    return server


def _request(correlation_id: int) -> bytes:
    return encode_request(METADATA.key, 1, correlation_id, {"topics": []})


async def _answer(reader: asyncio.StreamReader) -> int:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return Reader(memoryview(await reader.readexactly(size))).prim(struct.Struct(">i"))


async def _closed_after(reader: asyncio.StreamReader) -> float:
    t = time.monotonic()
    assert await asyncio.wait_for(reader.read(1), 10) == b""
    return time.monotonic() - t


def _on_a_connection(check: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                     slow_s: float = 0) -> None:
    """Run check on a connection to a fresh listener."""
    async def run() -> None:
        server = await _server(slow_s)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            await check(reader, writer)
            writer.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_a_connection_that_keeps_sending_outlives_its_limits_and_an_idle_one_does_not() -> None:
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(12):  # 12 x 0.1 s: three times the limits, each request well within them
            await asyncio.sleep(LIMIT_S / 4)
            writer.write(_request(i))
            assert await _answer(reader) == i
        assert LIMIT_S <= await _closed_after(reader) < LIMIT_S + 1  # then idle: closed

    _on_a_connection(check)


def test_a_frame_that_stops_after_its_size_is_closed_at_the_read_limit() -> None:
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_request(1))
        assert await _answer(reader) == 1
        writer.write(_request(2)[:10])  # the size and part of the header, then nothing
        assert await _closed_after(reader) < LIMIT_S + 1

    _on_a_connection(check)


def test_a_connection_waiting_for_an_answer_is_not_idle() -> None:
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_request(7))
        assert await asyncio.wait_for(_answer(reader), 10) == 7

    _on_a_connection(check, slow_s=3 * LIMIT_S)
