"""A small asyncio Kafka client over KafScale's own codec, for the command
line tools and the console (they speak the Kafka protocol, so they work
against any broker and go through the same checks and ACLs as any client).

`KafkaClient` is one connection (with SASL PLAIN or SCRAM when given
credentials); `Cluster` finds the brokers from metadata and sends a
partition's requests to its leader and a group's to its coordinator."""
from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

from scramp import ScramClient, ScramException

from kafscale.protocol.codec import Message, parse_schema
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import (
    APIS,
    FETCH,
    FIND_COORDINATOR,
    METADATA,
    OFFSET_COMMIT,
    OFFSET_FETCH,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
)

# The consumer protocol's assignment and subscription blobs carried in
# JoinGroup, SyncGroup and DescribeGroups (version 0, which every client reads).
CONSUMER_ASSIGNMENT = Message(parse_schema("""
version: int16
assigned_partitions: [
  topic: string
  partitions: [int32]
]
user_data: bytes ?
"""), flexible_min=0x7FFF)
CONSUMER_SUBSCRIPTION = Message(parse_schema("""
version: int16
topics: [string]
user_data: bytes ?
"""), flexible_min=0x7FFF)
SASL_PREFERENCE = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
# the last version of each API that names topics (later ones name them by topic id only)
BY_NAME = {FETCH.key: 12, OFFSET_COMMIT.key: 9, OFFSET_FETCH.key: 9}
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str


class KafkaClient:
    def __init__(self, bootstrap: str, client_id: str = "kafscale-cli", credentials: Credentials | None = None) -> None:
        self.host, _, port = bootstrap.rpartition(":")
        self.port = int(port)
        self.client_id = client_id
        self.credentials = credentials
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._correlation = 0
        self._versions: dict[int, int] = {}
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> KafkaClient:
        await self._connect()
        if self.credentials is not None:
            await self._authenticate(self.credentials)
        return self

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host or "127.0.0.1", self.port), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise OSError(f"cannot connect to {self.host}:{self.port}: timed out") from None
        except OSError as exc:
            raise OSError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        resp = await self._call(18, 0, {})
        self._versions = {k["api_key"]: k["max_version"] for k in resp["api_keys"]}

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _call(self, api_key: int, version: int, body: dict[str, Any]) -> dict[str, Any]:
        if self._reader is None or self._writer is None:
            raise OSError(f"connection to {self.host}:{self.port} is closed")
        async with self._lock:  # one request at a time: responses come back in order
            self._correlation += 1
            self._writer.write(encode_request(api_key, version, self._correlation, body, self.client_id))
            try:
                (size,) = struct.unpack(">i", await asyncio.wait_for(self._reader.readexactly(4), REQUEST_TIMEOUT_S))
                frame = await asyncio.wait_for(self._reader.readexactly(size), REQUEST_TIMEOUT_S)
            except asyncio.IncompleteReadError:
                raise OSError(f"{self.host}:{self.port} closed the connection") from None
            except TimeoutError:
                raise OSError(f"{self.host}:{self.port} did not answer in {REQUEST_TIMEOUT_S:.0f} s") from None
            corr, resp = decode_response(api_key, version, frame)
        if corr != self._correlation:
            raise OSError(f"{self.host}:{self.port} answered request {corr}, not {self._correlation}")
        return resp

    async def request(self, api_key: int, body: dict[str, Any], max_version: int | None = None) -> dict[str, Any]:
        """Send at the highest version both sides implement (and at most max_version);
        APIs that name topics by id from some version are sent at the last one by name."""
        version = min(self._versions.get(api_key, -1), APIS[api_key].max_version, BY_NAME.get(api_key, 1 << 15),
                      APIS[api_key].max_version if max_version is None else max_version)
        if version < APIS[api_key].min_version:
            raise KafkaError(ErrorCode.UNSUPPORTED_VERSION, APIS[api_key].name)
        return await self._call(api_key, version, body)

    async def _authenticate(self, creds: Credentials) -> None:
        """SaslHandshake then SaslAuthenticate: SCRAM where the broker offers it, else PLAIN.
        A broker closes the connection after refusing a mechanism: the second try reconnects."""
        mechanism = SASL_PREFERENCE[0]
        resp = await self.request(SASL_HANDSHAKE.key, {"mechanism": mechanism})
        if resp["error_code"] == ErrorCode.UNSUPPORTED_SASL_MECHANISM:
            offered = [m for m in SASL_PREFERENCE if m in resp["mechanisms"]]
            if not offered:
                raise KafkaError(ErrorCode.UNSUPPORTED_SASL_MECHANISM,
                                 f"the broker offers {', '.join(resp['mechanisms']) or 'no mechanism'}")
            mechanism = offered[0]
            await self.close()
            await self._connect()
            resp = await self.request(SASL_HANDSHAKE.key, {"mechanism": mechanism})
        if resp["error_code"]:
            raise KafkaError(resp["error_code"], f"SASL {mechanism}")
        if mechanism == "PLAIN":
            await self._sasl_step(b"\0" + creds.user.encode() + b"\0" + creds.password.encode())
            return
        await scram_exchange(mechanism, creds, self._sasl_step)

    async def _sasl_step(self, token: bytes) -> bytes:
        resp = await self.request(SASL_AUTHENTICATE.key, {"auth_bytes": token})
        if resp["error_code"]:
            raise KafkaError(resp["error_code"], resp["error_message"])
        return bytes(resp["auth_bytes"])


async def scram_exchange(mechanism: str, creds: Credentials, step: Any) -> None:
    """The client side of SCRAM (RFC 5802), by scramp, the library the broker's side uses."""
    client = ScramClient([mechanism], creds.user, creds.password)
    try:
        client.set_server_first((await step(client.get_client_first().encode())).decode())
        client.set_server_final((await step(client.get_client_final().encode())).decode())
    except ScramException as exc:
        raise KafkaError(ErrorCode.SASL_AUTHENTICATION_FAILED, str(exc)) from None


class Cluster:
    """Connections to the brokers of one cluster, opened on first use.

    `request` goes to the bootstrap connection; `leader(topic, p)` and
    `coordinator(group)` answer the connection a partition's or a group's
    requests must go to, from metadata that `refresh` reloads."""

    def __init__(self, bootstrap: str | list[str], client_id: str = "kafscale-cli",
                 credentials: Credentials | None = None) -> None:
        self.bootstrap = bootstrap.split(",") if isinstance(bootstrap, str) else list(bootstrap)
        self.client_id = client_id
        self.credentials = credentials
        self.brokers: dict[int, str] = {}
        self.leaders: dict[tuple[str, int], int] = {}
        self.partitions: dict[str, int] = {}
        self._main: KafkaClient | None = None
        self._nodes: dict[int, KafkaClient] = {}

    async def __aenter__(self) -> Cluster:
        errors = []
        for address in self.bootstrap:
            client = KafkaClient(address, self.client_id, self.credentials)
            try:
                self._main = await client.__aenter__()
                return self
            except OSError as exc:
                errors.append(str(exc))
        raise OSError("; ".join(errors) or "no bootstrap address")

    async def __aexit__(self, *exc: object) -> None:
        for c in [self._main, *self._nodes.values()]:
            if c is not None:
                await c.close()
        self._nodes.clear()

    async def request(self, api_key: int, body: dict[str, Any], max_version: int | None = None) -> dict[str, Any]:
        assert self._main is not None
        return await self._main.request(api_key, body, max_version)

    async def topics(self, names: list[str] | None, auto_create: bool = False) -> list[dict[str, Any]]:
        """Metadata of these topics (None: all), raising on a topic's error; remembers brokers and leaders."""
        body = {"topics": None if names is None else [{"name": t, "topic_id": bytes(16)} for t in names],
                "allow_auto_topic_creation": auto_create}
        resp = await self.request(METADATA.key, body)
        self.brokers.update({b["node_id"]: f"{b['host']}:{b['port']}" for b in resp["brokers"]})
        for t in resp["topics"]:
            if t["error_code"]:
                raise KafkaError(t["error_code"], f"topic {t['name']}")
            self.partitions[t["name"]] = len(t["partitions"])
            for p in t["partitions"]:
                self.leaders[(t["name"], p["partition_index"])] = p["leader_id"]
        return resp["topics"]

    async def node(self, node_id: int) -> KafkaClient:
        client = self._nodes.get(node_id)
        if client is None:
            if node_id not in self.brokers:
                raise KafkaError(ErrorCode.LEADER_NOT_AVAILABLE, f"broker {node_id} is not in the metadata")
            client = await KafkaClient(self.brokers[node_id], self.client_id, self.credentials).__aenter__()
            self._nodes[node_id] = client
        return client

    async def drop(self, node_id: int) -> None:
        """Forget a broker's connection (it failed): the next use reconnects."""
        client = self._nodes.pop(node_id, None)
        if client is not None:
            await client.close()

    async def leader(self, topic: str, partition: int) -> tuple[int, KafkaClient]:
        if (topic, partition) not in self.leaders:
            await self.topics([topic])
            if not 0 <= partition < self.partitions[topic]:
                raise KafkaError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"{topic} has no partition {partition}")
        node_id = self.leaders.get((topic, partition), -1)
        if node_id < 0:
            raise KafkaError(ErrorCode.LEADER_NOT_AVAILABLE, f"{topic}/{partition} has no leader")
        return node_id, await self.node(node_id)

    async def coordinator(self, group: str) -> KafkaClient:
        resp = await self.request(FIND_COORDINATOR.key, {"key": group, "key_type": 0, "coordinator_keys": [group]})
        c = resp["coordinators"][0] if resp.get("coordinators") else resp
        if c["error_code"]:
            raise KafkaError(c["error_code"], c.get("error_message") or f"coordinator of group {group}")
        self.brokers[c["node_id"]] = f"{c['host']}:{c['port']}"
        return await self.node(c["node_id"])


def offset_fetch_topics(resp: dict[str, Any]) -> list[dict[str, Any]]:
    """The topics of an OffsetFetch response for one group (v8+ nests them under `groups`)."""
    return resp["groups"][0]["topics"] if resp.get("groups") else resp["topics"]


def decode_assignment(blob: bytes) -> dict[str, list[int]]:
    if not blob:
        return {}
    body, _ = CONSUMER_ASSIGNMENT.decode(memoryview(blob), 0)
    return {t["topic"]: t["partitions"] for t in body["assigned_partitions"]}


def encode_assignment(assigned: dict[str, list[int]]) -> bytes:
    return _bytes(CONSUMER_ASSIGNMENT, {"version": 0, "user_data": None, "assigned_partitions": [
        {"topic": t, "partitions": sorted(ps)} for t, ps in sorted(assigned.items())]})


def decode_subscription(blob: bytes) -> list[str]:
    body, _ = CONSUMER_SUBSCRIPTION.decode(memoryview(blob), 0)
    return list(body["topics"])


def encode_subscription(topics: list[str]) -> bytes:
    return _bytes(CONSUMER_SUBSCRIPTION, {"version": 0, "topics": topics, "user_data": None})


def _bytes(message: Message, body: dict[str, Any]) -> bytes:
    return b"".join(bytes(c) for c in message.encode(body, 0).finish())
