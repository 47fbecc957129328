"""The listener (KafkaServer with in-process handlers, over real sockets):
its read time limits (an idle connection is closed, one that sends a
frame's size and stalls is closed, and connections that keep sending, or wait
for an answer, are not, however long they last), frames split however their
bytes arrive, and runs of Produce requests answered by a run handler, in
order with the others."""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import REGISTRY

from kafscale import metrics
from kafscale.broker.context import RequestContext
from kafscale.broker.server import (
    ConnectionLimits,
    KafkaServer,
    ProtocolViolation,
    RunRespond,
    failed_answer,
    parse_header,
    run_frames,
)
from kafscale.protocol.codec import Reader
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import decode_response, encode_produce_responses, encode_request
from kafscale.protocol.schemas import METADATA, PRODUCE

LIMIT_S = 0.4  # both the idle and the read limit


async def _server(slow_s: float = 0, receive_buffer_bytes: int = -1) -> KafkaServer:
    async def metadata(hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(slow_s)
        return {"throttle_time_ms": 0, "brokers": [], "cluster_id": "c", "controller_id": -1, "topics": []}

    limits = ConnectionLimits(1 << 20, 1 << 20, 10, read_timeout_s=LIMIT_S, idle_timeout_s=LIMIT_S,
                              write_timeout_s=5, receive_buffer_bytes=receive_buffer_bytes)
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


async def _budget_given_back(server: KafkaServer) -> None:
    """Once the connections' tasks end, every request's bytes are back in the listener's budget."""
    for _ in range(100):
        if not server.budget.used:
            break
        await asyncio.sleep(0.05)
    assert server.budget.used == 0


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


def test_a_connection_gets_the_configured_receive_buffer() -> None:
    """Client connections get socket_receive_buffer_bytes as their SO_RCVBUF
    (what a client can send past a connection that is not read); -1 leaves
    the system's own, which grows with the traffic."""
    async def run(receive_buffer: int) -> int:
        server = await _server(receive_buffer_bytes=receive_buffer)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request(1))
            assert await _answer(reader) == 1  # the connection is being served
            (accepted,) = server._conns.values()
            size = accepted.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            writer.close()
            return size
        finally:
            await server.close()

    assert 64 << 10 <= asyncio.run(run(64 << 10)) <= 128 << 10  # Linux reports twice what was set
    with socket.socket() as s:
        default = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert asyncio.run(run(-1)) == default


def test_a_frame_that_stops_after_its_size_is_closed_at_the_read_limit() -> None:
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_request(1))
        assert await _answer(reader) == 1
        writer.write(_request(2)[:10])  # the size and part of the header, then nothing
        assert await _closed_after(reader) < LIMIT_S + 1

    _on_a_connection(check)


def test_frames_are_split_however_the_bytes_arrive() -> None:
    """Many frames in one write, frames split inside their size prefix or
    body, and one frame far larger than a read: each is answered, in order."""
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"".join(_request(i) for i in range(200)))
        assert [await _answer(reader) for _ in range(200)] == list(range(200))
        data = b"".join(_request(i) for i in range(200, 210))
        for cut in (2, 7, 31, 40, 41, 95, len(data)):  # inside a prefix, a header, at frame ends
            writer.write(data[:cut])
            data = data[cut:]
            await writer.drain()
            await asyncio.sleep(0.01)
        assert [await _answer(reader) for _ in range(10)] == list(range(200, 210))
        big = encode_request(METADATA.key, 1, 999, {"topics": [{"name": "t" * 200}] * 3000})  # 600 KiB
        writer.write(_request(998) + big[:100])
        await asyncio.sleep(0.01)
        writer.write(big[100:] + _request(1000))
        assert [await _answer(reader) for _ in range(3)] == [998, 999, 1000]

    _on_a_connection(check)


def test_a_connection_waiting_for_an_answer_is_not_idle() -> None:
    async def check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_request(7))
        assert await asyncio.wait_for(_answer(reader), 10) == 7

    _on_a_connection(check, slow_s=3 * LIMIT_S)


def _produce(correlation_id: int, name: str, acks: int = -1) -> bytes:
    return encode_request(PRODUCE.key, 9, correlation_id, {
        "transactional_id": None, "acks": acks, "timeout_ms": 1000,
        "topic_data": [{"name": name, "partition_data": [{"index": 0, "records": b""}]}]})


def _code(answer: bytes) -> int:
    return decode_response(PRODUCE.key, 9, answer)[1]["responses"][0]["partition_responses"][0]["error_code"]


async def _answers(reader: asyncio.StreamReader, n: int) -> list[bytes]:
    answers = []
    for _ in range(n):
        (size,) = struct.unpack(">i", await asyncio.wait_for(reader.readexactly(4), 5))
        answers.append(await reader.readexactly(size))
    return answers


def test_runs_of_produces_are_answered_in_request_order_and_a_failure_is_an_error_code() -> None:
    """Produce requests a connection sends back to back reach the run handler
    together (with the frames that came in pieces as runs of one): their
    answers follow the order of the requests, after a slower one sent before
    them; a run whose handler raises gets an error code for each request
    (none for acks=0) on an open connection; a run answered with a protocol
    violation, or holding a request that does not decode, closes the
    connection after the answers before it. Every request's bytes go back
    to the listener's budget, answered or not."""
    runs: list[int] = []

    def produce_run(hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond
                    ) -> ProtocolViolation | None:
        runs.append(count)
        reqs = [(frame, *PRODUCE.request.decode(frame, 9, parse_header(frame)[-1]))
                for frame in run_frames(frames, count)]
        names = [req["topic_data"][0]["name"] for _, req, _ in reqs]
        if "raises" in names:
            raise RuntimeError("staging failed")
        if names[0] == "violates":  # the first request does not decode: none before it to answer
            respond(b"")
            return ProtocolViolation("a request of the run does not decode")
        if "closing" in names:
            asyncio.get_running_loop().call_soon(respond, ProtocolViolation("the broker is shutting down"))
        elif "never" not in names:
            answers = [failed_answer(frame, RuntimeError("the log process failed")) if name == "fails"
                       else (parse_header(frame)[2], 9, {"responses": [{"name": name, "partition_responses": [
                           {"index": 0, "error_code": 0, "base_offset": 5}]}], "throttle_time_ms": 0})
                       for (frame, req, _), name in zip(reqs, names, strict=True) if req["acks"] != 0]
            asyncio.get_running_loop().call_soon(respond, encode_produce_responses([a for a in answers if a]))
        return None

    async def run() -> None:
        async def metadata(hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(0.2)  # answered after the produces that follow it are
            return {"throttle_time_ms": 0, "brokers": [], "cluster_id": "c", "controller_id": -1, "topics": []}

        limits = ConnectionLimits(1 << 20, 1 << 20, 10, read_timeout_s=5, idle_timeout_s=5, write_timeout_s=5)
        server = KafkaServer({METADATA.key: metadata}, "127.0.0.1", 0, limits, produce_run=produce_run)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request(1) + _produce(2, "t") + _produce(3, "fails") + _produce(4, "t", acks=0)
                         + _produce(5, "t"))
            answers = await _answers(reader, 4)
            assert [struct.unpack_from(">i", a)[0] for a in answers] == [1, 2, 3, 5]
            assert [_code(a) for a in answers[1:]] == [0, ErrorCode.UNKNOWN_SERVER_ERROR, 0]
            assert runs == [4]
            in_pieces = _produce(6, "t")
            for i in range(len(in_pieces)):  # a byte at a time: runs of one
                writer.write(in_pieces[i:i + 1])
                await writer.drain()
            writer.write(_produce(7, "raises") + _produce(8, "t", acks=0) + _produce(9, "t"))
            answers = await _answers(reader, 3)
            assert [struct.unpack_from(">i", a)[0] for a in answers] == [6, 7, 9]
            assert [_code(a) for a in answers] == [0, ErrorCode.UNKNOWN_SERVER_ERROR, ErrorCode.UNKNOWN_SERVER_ERROR]
            assert runs[1:] == [1, 3]
            writer.write(_produce(10, "t") + _request(11) + _produce(12, "closing") + _produce(13, "never"))
            assert [struct.unpack_from(">i", a)[0] for a in await _answers(reader, 2)] == [10, 11]
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the violation closes the connection
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_produce(1, "t"))
            assert struct.unpack_from(">i", (await _answers(reader, 1))[0])[0] == 1
            writer.write(_produce(2, "violates") + _produce(3, "t"))
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            await _budget_given_back(server)
        finally:
            await server.close()

    asyncio.run(run())


def test_the_in_flight_limit_holds_back_reading() -> None:
    """A connection with max in-flight requests read and not yet answered is
    read no further until answers go out (a run takes no more requests than
    there is room for); then reading goes on, and every answer follows the
    order of the requests. Each such wait is in kafscale_connection_paused_seconds."""
    held: list[tuple[RunRespond, list[int]]] = []

    def produce_run(hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond) -> None:
        held.append((respond, [parse_header(frame)[2] for frame in run_frames(frames, count)]))

    def paused() -> tuple[float, float]:
        labels = {"node": metrics.node(), "process": metrics.process()}
        return tuple(REGISTRY.get_sample_value(f"kafscale_connection_paused_seconds_{what}", labels) or 0.0
                     for what in ("count", "sum"))  # type: ignore[return-value]

    paused_before = paused()

    async def run() -> None:
        limits = ConnectionLimits(1 << 20, 1 << 20, 3, read_timeout_s=5, idle_timeout_s=5, write_timeout_s=5)
        server = KafkaServer({}, "127.0.0.1", 0, limits, produce_run=produce_run)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"".join(encode_request(PRODUCE.key, 9, i, {
                "transactional_id": None, "acks": -1, "timeout_ms": 1000, "topic_data": []}) for i in range(20)))
            answers: list[int] = []
            while len(answers) < 20:
                await asyncio.sleep(0.1)
                assert sum(len(ids) for _, ids in held) == min(3, 20 - len(answers))
                answering, held[:] = list(held), []
                for respond, ids in answering:
                    respond(encode_produce_responses([(i, 9, {"responses": [], "throttle_time_ms": 0}) for i in ids]))
                answers += [await asyncio.wait_for(_answer(reader), 5) for _, ids in answering for _ in ids]
            assert answers == list(range(20))
            count, seconds = paused()
            assert count - paused_before[0] >= 6  # 20 requests, 3 at a time: a wait before each next 3
            assert seconds - paused_before[1] >= (count - paused_before[0]) * 0.05  # answers came every 0.1 s
            writer.close()
            await _budget_given_back(server)
        finally:
            await server.close()

    asyncio.run(run())


def test_a_pipelining_connections_small_produce_requests_are_read_at_its_pace() -> None:
    """With read_pacing_s, a connection that pipelines small Produce requests
    (sends more while earlier ones are unanswered) is read at most once a
    pace, its socket not polled meanwhile: the requests sent during a pause
    reach the run handler as one run, and every answer follows the order of
    the requests. A request after a quiet spell, and a client that waits for
    each answer before it sends again, are read as they come. Without pacing
    each request is a run of its own."""
    pace_s, answer_s = 1.0, 0.1

    async def runs_of(pacing_s: float) -> tuple[list[int], list[float]]:
        runs: list[int] = []

        def produce_run(hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond) -> None:
            runs.append(count)
            ids = [parse_header(frame)[2] for frame in run_frames(frames, count)]
            answers = [(i, 9, {"responses": [], "throttle_time_ms": 0}) for i in ids]
            asyncio.get_running_loop().call_later(answer_s, respond, encode_produce_responses(answers))

        limits = ConnectionLimits(1 << 20, 1 << 20, 100, read_timeout_s=5, idle_timeout_s=5, write_timeout_s=5,
                                  read_pacing_s=pacing_s)
        server = KafkaServer({}, "127.0.0.1", 0, limits, produce_run=produce_run)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for i in range(1, 13):  # 2 while 1 is unanswered: the read after it waits for its pace
                writer.write(_produce(i, "t"))
                await writer.drain()
                await asyncio.sleep(0.05 if i == 1 else 0.01)
            answers = await asyncio.wait_for(_answers(reader, 12), 5 * pace_s)
            assert [struct.unpack_from(">i", a)[0] for a in answers] == list(range(1, 13))
            await asyncio.sleep(2.5 * pace_s)  # quiet
            waits = []
            for i in range(13, 17):  # then each sent once the one before is answered
                sent = time.monotonic()
                writer.write(_produce(i, "t"))
                assert struct.unpack_from(">i", (await _answers(reader, 1))[0])[0] == i
                waits.append(time.monotonic() - sent)
            writer.close()
            await _budget_given_back(server)
            return runs, waits
        finally:
            await server.close()

    runs, waits = asyncio.run(runs_of(pace_s))
    assert runs == [1, 1, 10, 1, 1, 1, 1]
    assert max(waits) < pace_s / 2  # answer_s each, none waited for a pace
    assert asyncio.run(runs_of(0.0))[0] == [1] * 16
