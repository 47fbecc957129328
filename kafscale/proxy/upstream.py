"""Pipelined connections from the proxy to brokers: many requests in flight
on one connection, answers matched by correlation id. The proxy opens one per
client connection and broker, so that a client's requests reach a broker in
the order it sent them and never wait behind another client's long poll."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl as ssl_mod
import struct
from typing import Any

from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import SASL_AUTHENTICATE, SASL_HANDSHAKE
from kafscale.security.sasl import PROXY_MECHANISM


class UpstreamError(ConnectionError):
    pass


class Upstream:
    def __init__(self, host: str, port: int, ssl: ssl_mod.SSLContext | None = None,
                 identity: bytes | None = None) -> None:
        """identity: a ProxyIdentity token naming the client this connection
        speaks for, sent first on every (re)connection."""
        self.host, self.port = host, port
        self.ssl = ssl
        self.identity = identity
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, tuple[asyncio.Future[dict[str, Any]], int, int]] = {}
        self._ids = itertools.count(1)
        self._reading: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self._reading is not None and not self._reading.done()

    async def _connect(self) -> None:
        async with self._lock:
            if self.alive:
                return
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl), 5)
            self._reading = asyncio.create_task(self._read_loop())
            if self.identity is not None:
                await self._speak_for_client(self.identity)

    async def _speak_for_client(self, token: bytes) -> None:
        shake = await self._call(SASL_HANDSHAKE.key, 1, {"mechanism": PROXY_MECHANISM}, 5)
        auth = await self._call(SASL_AUTHENTICATE.key, 2, {"auth_bytes": token}, 5)
        if shake["error_code"] or auth["error_code"]:
            await self.close()
            raise UpstreamError(f"{self.host}:{self.port} refused this proxy's client identity (error "
                                f"{shake['error_code'] or auth['error_code']}): is proxy_secret the same on both?")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                (size,) = struct.unpack(">i", await self._reader.readexactly(4))
                frame = await self._reader.readexactly(size)
                (corr,) = struct.unpack_from(">i", frame)
                entry = self._waiting.pop(corr, None)
                if entry is None:
                    continue
                fut, api_key, version = entry
                if not fut.done():
                    try:
                        fut.set_result(decode_response(api_key, version, frame)[1])
                    except Exception as exc:
                        fut.set_exception(UpstreamError(f"bad response from {self.host}:{self.port}: {exc}"))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for fut, _, _ in self._waiting.values():
                if not fut.done():
                    fut.set_exception(UpstreamError(f"connection to {self.host}:{self.port} lost"))
            self._waiting.clear()
            if self._writer is not None:
                self._writer.close()

    async def request(self, api_key: int, version: int, body: dict[str, Any], expect_reply: bool = True,
                      client_id: str | None = "kafscale-proxy", timeout_s: float = 30) -> dict[str, Any] | None:
        """Send a request and wait up to timeout_s for its answer. A broker that
        does not answer in time (paused, or cut off) loses this connection:
        UpstreamError, and the next request connects afresh."""
        try:
            await self._connect()
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot reach {self.host}:{self.port}: {exc}") from exc
        if not expect_reply:  # acks=0 produce: the broker sends nothing back
            assert self._writer is not None
            self._writer.write(encode_request(api_key, version, next(self._ids) & 0x7FFFFFFF, body,
                                              client_id=client_id))
            return None
        return await self._call(api_key, version, body, timeout_s, client_id)

    async def _call(self, api_key: int, version: int, body: dict[str, Any], timeout_s: float,
                    client_id: str | None = "kafscale-proxy") -> dict[str, Any]:
        assert self._writer is not None
        corr = next(self._ids) & 0x7FFFFFFF
        frame = encode_request(api_key, version, corr, body, client_id=client_id)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[corr] = (fut, api_key, version)
        self._writer.write(frame)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._waiting.pop(corr, None)
            await self.close()
            raise UpstreamError(f"{self.host}:{self.port} did not answer within {timeout_s:.0f}s") from None

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(BaseException):
                await self._reading
