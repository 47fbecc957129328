"""`kafscale proxy`: one Kafka endpoint in front of any number of brokers.

Clients bootstrap to the proxy and see a single broker (the proxy) in
Metadata and FindCoordinator. The proxy learns the live brokers and the
partition owners from etcd (the same placement the brokers compute), splits
Produce / Fetch / ListOffsets / OffsetForLeaderEpoch by owning broker and
merges the answers, sends group requests to the group's coordinator, and
anything else to any live broker. Brokers can restart or scale behind it
while clients stay connected to the proxy."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kafscale.broker.cluster import Cluster
from kafscale.broker.context import RequestContext
from kafscale.broker.server import SESSION, Handler
from kafscale.config import Config
from kafscale.lifecycle import stop_on_signals
from kafscale.metadata.store import MetaStore
from kafscale.protocol import schemas
from kafscale.protocol.error_response import error_response
from kafscale.protocol.errors import ErrorCode
from kafscale.proxy.upstream import Upstream, UpstreamError
from kafscale.security.sasl import ProxyIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionedApi:
    """Where the topic/partition lists sit in a request and its response."""
    topics: str
    topic_key: str
    parts: str
    part_key: str
    resp_topics: str
    resp_parts: str


PARTITIONED = {
    schemas.PRODUCE.key: PartitionedApi("topic_data", "name", "partition_data", "index", "responses",
                                        "partition_responses"),
    schemas.FETCH.key: PartitionedApi("topics", "topic", "partitions", "partition", "responses", "partitions"),
    schemas.LIST_OFFSETS.key: PartitionedApi("topics", "name", "partitions", "partition_index", "topics",
                                             "partitions"),
    schemas.OFFSET_FOR_LEADER_EPOCH.key: PartitionedApi("topics", "topic", "partitions", "partition", "topics",
                                                        "partitions"),
    schemas.DELETE_RECORDS.key: PartitionedApi("topics", "name", "partitions", "partition_index", "topics",
                                               "partitions"),
}
GROUP_KEYED = {schemas.JOIN_GROUP.key, schemas.SYNC_GROUP.key, schemas.HEARTBEAT.key, schemas.LEAVE_GROUP.key,
               schemas.OFFSET_COMMIT.key, schemas.OFFSET_DELETE.key}


class Proxy:
    def __init__(self, cfg: Config, meta: MetaStore, node_id: int = 0) -> None:
        self.cfg = cfg
        self.meta = meta
        self.node_id = node_id
        self.cluster = Cluster(meta, cfg, member=False)
        self.topic_names: dict[bytes, str] = {}
        # client connection -> broker -> upstream connection (0: requests outside a client connection)
        self.upstreams: dict[int, dict[int, Upstream]] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._refresh_now: asyncio.Task[None] | None = None  # a refresh after a broker failed
        self.handlers: dict[int, Handler] = {
            key: self._forward_any for key in schemas.APIS}
        self.handlers.update({key: self._partitioned for key in PARTITIONED})
        self.handlers.update({key: self._group_keyed for key in GROUP_KEYED})
        self.handlers.update({
            schemas.API_VERSIONS.key: self.api_versions,
            schemas.METADATA.key: self._metadata,
            schemas.FIND_COORDINATOR.key: self._find_coordinator,
            schemas.OFFSET_FETCH.key: self._offset_fetch,
            schemas.DESCRIBE_GROUPS.key: self._per_group("groups", "groups", "group_id"),
            schemas.DELETE_GROUPS.key: self._per_group("groups_names", "results", "group_id"),
            schemas.LIST_GROUPS.key: self._list_groups,
            schemas.DESCRIBE_CLUSTER.key: self._describe_cluster,
        })

    # ------------------------------------------------------------ membership
    async def start(self) -> None:
        """Membership and topics are read every second; the partition owners
        are followed (Cluster.follow_owners)."""
        await self.refresh()
        await self.cluster.follow_owners()
        self._refresh_task = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._refresh_task:
            self._refresh_task.cancel()
        self.cluster.close()
        for conn in list(self.upstreams):
            await self._close_upstreams(conn)

    async def refresh(self) -> None:
        await self.cluster.refresh()
        self.topic_names = {t.id: t.name for t in await self.meta.list_topics()}
        # A broker whose lease expired (dead or paused) answers nothing more:
        # fail what waits on it now, so that a Produce spanning many brokers is
        # answered (NOT_LEADER_OR_FOLLOWER for its partitions, which the client
        # retries at their new owner) instead of waiting out its timeout.
        for mine in self.upstreams.values():
            for broker in [b for b in mine if b not in self.cluster.brokers]:
                await mine.pop(broker).close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(1)
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("proxy refresh failed: %r", exc)

    async def _upstream(self, broker: int) -> Upstream:
        """The calling client connection's own connection to `broker`."""
        if broker not in self.cluster.brokers:
            raise UpstreamError(f"broker {broker} is not live")
        host, port = self.cluster.brokers[broker]
        session = SESSION.get(None)
        conn = session.conn if session is not None else 0
        mine = self.upstreams.get(conn)
        if mine is None:
            mine = self.upstreams[conn] = {}
            if session is not None:
                session.on_close.append(lambda: self._close_upstreams(conn))
        u = mine.get(broker)
        if u is None or (u.host, u.port) != (host, port):
            if u is not None:  # the broker came back elsewhere
                await u.close()
            identity = None  # with proxy_secret, the broker authorizes as the client, from the client's address
            if self.cfg.proxy_secret and session is not None:
                identity = ProxyIdentity.token(self.cfg.proxy_secret, session.principal, session.client_host)
            u = mine[broker] = Upstream(host, port, self.cfg.broker_ssl(), identity)
        return u

    async def _close_upstreams(self, conn: int) -> None:
        for u in self.upstreams.pop(conn, {}).values():
            await u.close()

    def _timeout_s(self, hdr: RequestContext, body: dict[str, Any]) -> float:
        """How long a broker may take: what the request itself may wait, plus
        proxy_upstream_timeout_s."""
        wait_ms = {schemas.FETCH.key: body.get("max_wait_ms", 0), schemas.PRODUCE.key: body.get("timeout_ms", 0),
                   schemas.JOIN_GROUP.key: body.get("rebalance_timeout_ms", body.get("session_timeout_ms", 0)),
                   schemas.SYNC_GROUP.key: 60_000}.get(hdr.api_key, 0)
        return max(wait_ms, 0) / 1000 + self.cfg.proxy_upstream_timeout_s

    def _owner(self, topic: str, p: int) -> int:
        return self.cluster.leader(topic, p)

    async def _send_any(self, hdr: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        """Send to a live broker; one that fails (dead but its lease not yet
        expired) is skipped for the next. Every broker failing raises the last
        error, which the client gets as a retriable error code."""
        error: UpstreamError = UpstreamError("no live brokers")
        for broker in sorted(self.cluster.brokers):
            try:
                resp = await self._send(broker, hdr, body)
                assert resp is not None
                return resp
            except UpstreamError as exc:
                log.info("proxy: broker %d failed (%s); trying another", broker, exc)
                self._refresh_soon()
                error = exc
        raise error

    def _refresh_soon(self) -> None:
        if self._refresh_now is None or self._refresh_now.done():
            self._refresh_now = asyncio.create_task(self.refresh())
            self._refresh_now.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _send(self, broker: int, hdr: RequestContext, body: dict[str, Any], expect_reply: bool = True
                    ) -> dict[str, Any] | None:
        upstream = await self._upstream(broker)
        return await upstream.request(hdr.api_key, hdr.api_version, body, expect_reply, hdr.client_id,
                                      self._timeout_s(hdr, body))

    # -------------------------------------------------------------- handlers
    async def api_versions(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        return schemas.api_versions_response()

    def _me(self) -> dict[str, Any]:
        host, port = self.cfg.advertised_addr()
        return {"node_id": self.node_id, "host": host, "port": port, "rack": None}

    async def _forward_any(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any] | None:
        return await self._send_any(hdr, req)

    async def _metadata(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        resp = await self._send_any(hdr, req)
        resp["brokers"], resp["controller_id"] = [self._me()], self.node_id
        for t in resp["topics"]:
            for p in t["partitions"]:
                p["leader_id"], p["replica_nodes"], p["isr_nodes"] = self.node_id, [self.node_id], [self.node_id]
        return resp

    async def _describe_cluster(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        resp = await self._send_any(hdr, req)
        me = self._me()
        resp["brokers"] = [{"broker_id": me["node_id"], "host": me["host"], "port": me["port"], "rack": None}]
        resp["controller_id"] = self.node_id
        return resp

    async def _find_coordinator(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        resp = await self._send_any(hdr, req)
        me = self._me()
        for c in [resp, *resp.get("coordinators", [])]:
            if c.get("error_code", 0) == 0:
                c["node_id"], c["host"], c["port"] = me["node_id"], me["host"], me["port"]
        return resp

    async def _partitioned(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any] | None:
        spec = PARTITIONED[hdr.api_key]
        by_broker: dict[int, dict[int, dict[str, Any]]] = {}  # broker -> request topic entry -> its share
        for t in req[spec.topics]:
            name = t.get(spec.topic_key) or self.topic_names.get(t.get("topic_id", b""), "")
            for p in t[spec.parts]:
                share = by_broker.setdefault(self._owner(name, p[spec.part_key]), {})
                share.setdefault(id(t), {**t, spec.parts: []})[spec.parts].append(p)
        expect_reply = not (hdr.api_key == schemas.PRODUCE.key and req["acks"] == 0)
        if hdr.api_key == schemas.FETCH.key:  # no fetch sessions through the proxy: each broker sees a share
            req = {**req, "session_id": 0, "session_epoch": -1, "forgotten_topics_data": []}
        sub = {b: {**req, spec.topics: list(ts.values())} for b, ts in by_broker.items()}
        results = await asyncio.gather(*(self._send(b, hdr, body, expect_reply) for b, body in sub.items()),
                                       return_exceptions=True)
        if not expect_reply:
            return None
        merged: dict[Any, dict[str, Any]] = {}
        out: dict[str, Any] = {}
        for (broker, body), resp in zip(sub.items(), results, strict=True):
            if isinstance(resp, BaseException):  # that broker is gone: clients retry after a metadata refresh
                log.info("proxy: broker %d failed (%s); answering NOT_LEADER_OR_FOLLOWER", broker, resp)
                resp = error_response(schemas.APIS[hdr.api_key], hdr.api_version, body,
                                      ErrorCode.NOT_LEADER_OR_FOLLOWER, f"broker {broker} did not answer")
                self._refresh_soon()
            out.update({k: v for k, v in resp.items() if k != spec.resp_topics})
            for t in resp[spec.resp_topics]:
                key = (t.get("name") or t.get("topic"), t.get("topic_id"))
                if key in merged:
                    merged[key][spec.resp_parts].extend(t[spec.resp_parts])
                else:
                    merged[key] = t
        out[spec.resp_topics] = list(merged.values())
        if "error_code" in out and hdr.api_key == schemas.FETCH.key:
            out["error_code"], out["session_id"] = 0, 0
        return out

    async def _to_coordinator(self, group: str, hdr: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        """Send to the group's coordinator; if it fails, the client gets
        COORDINATOR_NOT_AVAILABLE (from the server's error handling) and looks
        for the coordinator again."""
        try:
            resp = await self._send(self.cluster.coordinator_for(group), hdr, body)
            assert resp is not None
            return resp
        except UpstreamError:
            self._refresh_soon()
            raise

    async def _group_keyed(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        return await self._to_coordinator(req["group_id"], hdr, req)

    async def _offset_fetch(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if hdr.api_version < 8:
            return await self._to_coordinator(req["group_id"], hdr, req)
        groups = []
        for g in req["groups"]:
            resp = await self._to_coordinator(g["group_id"], hdr, {**req, "groups": [g]})
            groups.extend(resp["groups"])
        return {"throttle_time_ms": 0, "groups": groups}

    def _per_group(self, field: str, resp_field: str, id_key: str) -> Callable[..., Awaitable[dict[str, Any]]]:
        async def handler(hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
            out = []
            for g in req[field]:
                resp = await self._to_coordinator(g, hdr, {**req, field: [g]})
                out.extend(resp[resp_field])
            return {"throttle_time_ms": 0, resp_field: out}
        return handler

    async def _list_groups(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        resps = await asyncio.gather(*(self._send(b, hdr, req) for b in list(self.cluster.brokers)),
                                     return_exceptions=True)
        groups = [g for r in resps if isinstance(r, dict) for g in r["groups"]]
        return {"throttle_time_ms": 0, "error_code": 0, "groups": groups}


async def run_proxy_until_signal(cfg: Config) -> None:

    from kafscale.adminhttp import AdminAuth, AdminServer
    from kafscale.broker.server import ConnectionLimits, KafkaServer, SaslSettings

    meta = MetaStore.from_config(cfg)
    await meta.start()
    proxy = Proxy(cfg, meta)
    await proxy.start()
    host, port = cfg.listen_addr()
    mechanisms = cfg.sasl_mechanism_list()
    sasl = SaslSettings(mechanisms, meta.get_user) if mechanisms else None
    server = KafkaServer(proxy.handlers, host, port, ConnectionLimits.from_config(cfg), ssl=cfg.server_ssl(),
                         sasl=sasl)
    await server.start()
    log.info("proxy for cluster %r on %s:%d in front of brokers %s", cfg.cluster, host, server.port,
             sorted(proxy.cluster.brokers))
    admin = None
    if cfg.admin_listen:
        async def brokers_known() -> None:
            if not proxy.cluster.brokers:
                raise RuntimeError("no live broker registered in etcd")

        admin = AdminServer(cfg.admin_listen, {"etcd": meta.ping, "brokers": brokers_known}, auth=AdminAuth(cfg, meta))
        await admin.start()
    stop = stop_on_signals()
    await stop.wait()
    if admin is not None:
        await admin.close()
    await server.close()
    await proxy.close()
    await meta.close()
