"""A minimal asyncio Kafka client over KafScale's own codec, for the CLI
tools (they speak the Kafka protocol, so they work against any broker)."""
from __future__ import annotations

import asyncio
import struct
from typing import Any

from kafscale.protocol.codec import Message, parse_schema
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import APIS

# The consumer protocol's assignment blob carried in SyncGroup / DescribeGroups.
CONSUMER_ASSIGNMENT = Message(parse_schema("""
version: int16
assigned_partitions: [
  topic: string
  partitions: [int32]
]
user_data: bytes ?
"""), flexible_min=0x7FFF)


class KafkaClient:
    def __init__(self, bootstrap: str, client_id: str = "kafscale-cli") -> None:
        self.host, _, port = bootstrap.rpartition(":")
        self.port = int(port)
        self.client_id = client_id
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._correlation = 0
        self._versions: dict[int, int] = {}

    async def __aenter__(self) -> KafkaClient:
        self._reader, self._writer = await asyncio.open_connection(self.host or "127.0.0.1", self.port)
        resp = await self._call(18, 0, {})
        self._versions = {k["api_key"]: k["max_version"] for k in resp["api_keys"]}
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    async def _call(self, api_key: int, version: int, body: dict[str, Any]) -> dict[str, Any]:
        assert self._reader is not None and self._writer is not None
        self._correlation += 1
        self._writer.write(encode_request(api_key, version, self._correlation, body, self.client_id))
        (size,) = struct.unpack(">i", await self._reader.readexactly(4))
        corr, resp = decode_response(api_key, version, await self._reader.readexactly(size))
        assert corr == self._correlation
        return resp

    async def request(self, api_key: int, body: dict[str, Any]) -> dict[str, Any]:
        """Send at the highest version both sides implement."""
        version = min(self._versions.get(api_key, -1), APIS[api_key].max_version)
        if version < APIS[api_key].min_version:
            raise KafkaError(ErrorCode.UNSUPPORTED_VERSION, APIS[api_key].name)
        return await self._call(api_key, version, body)


def decode_assignment(blob: bytes) -> dict[str, list[int]]:
    if not blob:
        return {}
    body, _ = CONSUMER_ASSIGNMENT.decode(memoryview(blob), 0)
    return {t["topic"]: t["partitions"] for t in body["assigned_partitions"]}
