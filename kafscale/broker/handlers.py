"""Request handlers: one coroutine per API, taking and returning plain dicts
shaped by kafscale.protocol.schemas."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kafscale import _native
from kafscale.broker.acl_api import AclApi
from kafscale.broker.admin import AdminApi
from kafscale.broker.cluster import Cluster
from kafscale.broker.server import Handler
from kafscale.config import Config
from kafscale.groups.api import GroupApi
from kafscale.groups.coordinator import GroupCoordinator
from kafscale.metadata import topic_config
from kafscale.metadata.store import MetaStore, SegmentManifest, TopicCache, TopicExists, TopicMeta, unavailable
from kafscale.metadata.topic_config import topic_name_error
from kafscale.protocol import schemas
from kafscale.protocol.errors import NO_TRANSACTIONS, ErrorCode
from kafscale.protocol.framing import RequestHeader
from kafscale.security.acl import CLUSTER, AclBinding, Authorizer, Operation, ResourceType
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.partition import LogError, PartitionLog
from kafscale.storage.reader import ReadBudget, SegmentSource

log = logging.getLogger(__name__)

ACL_REFRESH_S = 1.0  # how soon ACLs changed by another broker (or `kafscale acls`) apply here

# A produce payload a worker validated and put in shared memory, and how to
# hand that memory back; or the error the worker found instead.
Accepted = tuple[memoryview, Callable[[], None]]


class Broker:
    """The log process's side of a node: owns its partition logs and answers
    every Kafka request except ApiVersions and Fetch (which protocol workers
    answer themselves). Produce arrives with its payloads already validated."""

    def __init__(self, cfg: Config, store: ObjectStore, meta: MetaStore, cache: SegmentSource) -> None:
        self.cfg = cfg
        self.store = store
        self.meta = meta
        self.cache = cache
        self.read_budget = ReadBudget(cfg.readahead_memory_bytes)
        # told when a partition log commits a segment, moves its start or closes
        self.on_change: Callable[[PartitionLog, SegmentManifest | None], None] = lambda lg, m: None
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[PartitionLog]] = {}
        self.topics = TopicCache()
        self._retention: asyncio.Task[None] | None = None
        self._topic_watch: asyncio.Task[None] | None = None
        self._balancer: asyncio.Task[None] | None = None
        self._acl_refresher: asyncio.Task[None] | None = None
        self.closing = False  # shutting down: no partition is opened any more
        self.authz = Authorizer(cfg.authorizer, cfg.super_users, cfg.allow_everyone_if_no_acl_found)
        # told when the ACLs change (the log process passes them on to its workers)
        self.on_acls: Callable[[list[AclBinding]], None] = lambda acls: None
        self.handlers: dict[int, Handler] = {
            schemas.METADATA.key: self.metadata,
            schemas.PRODUCE.key: self.produce,
            schemas.LIST_OFFSETS.key: self.list_offsets,
            schemas.CREATE_TOPICS.key: self.create_topics,
            schemas.DELETE_TOPICS.key: self.delete_topics,
            schemas.INIT_PRODUCER_ID.key: self.init_producer_id,
        }
        self.cluster = Cluster(meta, cfg)
        self.lease: Any = None  # our etcd lease: broker registration and partition ownership hang on it
        self.lease_until = 0.0  # monotonic time until which the lease is surely alive (BrokerNode keeps it)
        self.groups = GroupCoordinator(meta, cfg.group_initial_rebalance_delay_ms,
                                       lambda: time.monotonic() < self.lease_until)
        self.handlers.update(GroupApi(self.groups, self.cluster, self.topic, self.allowed).handlers)
        self.handlers.update(AdminApi(self).handlers)
        self.handlers.update(AclApi(self).handlers)

    async def start(self, lease: Any) -> None:
        self.lease = lease
        await self.cluster.refresh()
        await self.groups.start()
        self._topic_watch = asyncio.create_task(self._watch_topics(), name="topic watch")
        self._retention = asyncio.create_task(self._retention_loop(), name="retention")
        self._balancer = asyncio.create_task(self._balance_loop(), name="balancer")
        if self.authz.enabled:
            await self.refresh_acls()
            self._acl_refresher = asyncio.create_task(self._acl_loop(), name="acls")

    # ------------------------------------------------------------ authorization
    def allowed(self, hdr: RequestHeader, op: Operation, rtype: ResourceType, name: str) -> bool:
        return self.authz.allows(hdr.principal, hdr.client_host, op, rtype, name)

    def may_create_topic(self, hdr: RequestHeader, name: str) -> bool:
        return (self.allowed(hdr, Operation.CREATE, ResourceType.CLUSTER, CLUSTER)
                or self.allowed(hdr, Operation.CREATE, ResourceType.TOPIC, name))

    async def refresh_acls(self) -> None:
        acls = await self.meta.list_acls()
        if acls != self.authz.acls:
            self.authz.update(acls)
            self.on_acls(acls)

    async def _acl_loop(self) -> None:
        while True:
            await asyncio.sleep(ACL_REFRESH_S)
            try:
                await self.refresh_acls()
            except Exception as exc:
                log.warning("reading ACLs failed (the last ones read still apply): %r", exc)

    async def _balance_loop(self) -> None:
        """Follow membership: hand partitions and groups to the broker that
        should have them now (a broker joined), after flushing what is queued."""
        while True:
            await asyncio.sleep(self.cfg.balance_interval_ms / 1000)
            try:
                await self.cluster.refresh()
                for (topic, p), lg in list(self.logs.items()):
                    desired = self.cluster.desired_owner(topic, p)
                    if desired != self.cfg.node_id:
                        log.info("handing %s/%d over to broker %d", topic, p, desired)
                        await self.release_partition(topic, p, lg)
                await self.groups.evict(lambda g: self.cluster.coordinator_for(g) != self.cfg.node_id)
            except Exception as exc:
                log.warning("balancing pass failed: %r", exc)

    async def release_partition(self, topic: str, p: int, lg: PartitionLog, drain_s: float = 10) -> None:
        self.logs.pop((topic, p), None)
        await lg.close(drain_s=drain_s)
        await self.meta.release_owner(topic, p, self.cfg.node_id)

    async def group_lag(self) -> dict[tuple[str, str, int], int]:
        """(group, topic, partition) -> high watermark - committed offset, for
        the groups this broker coordinates."""
        lag: dict[tuple[str, str, int], int] = {}
        hws: dict[tuple[str, int], int] = {}
        mine = [g for g in await self.meta.group_names_with_offsets()
                if self.cluster.coordinator_for(g) == self.cfg.node_id]
        for group in sorted(set(mine) | set(self.groups.groups)):
            for (topic, p), committed in (await self.meta.fetch_offsets(group)).items():
                if (topic, p) not in hws:
                    lg = self.logs.get((topic, p))
                    state = None if lg is not None else await self.meta.get_partition(topic, p)
                    hws[(topic, p)] = lg.hw if lg is not None else (state[0].hw if state else 0)
                lag[(group, topic, p)] = max(hws[(topic, p)] - committed["offset"], 0)
        return lag

    async def lease_lost(self, new_lease: Any) -> None:
        """Our lease expired (we were paused or cut off): whatever we owned may
        have a new owner already. Drop it all; commits would be fenced anyway."""
        log.warning("etcd lease lost: dropping %d partitions and all groups", len(self.logs))
        logs, self.logs = list(self.logs.values()), {}
        await asyncio.gather(*(lg.close() for lg in logs))
        await self.groups.evict(lambda g: True)
        self.lease = new_lease

    async def _watch_topics(self) -> None:
        """Keep the topic cache current with what any broker changes in etcd
        (partitions added, configs altered, topics deleted). After an etcd
        outage the cache is read afresh, then watched again."""
        while True:
            try:
                for meta in await self.meta.list_topics():
                    await self.apply_topic_meta(meta)
                async for name, meta in self.meta.watch_topics():
                    if meta is not None:
                        await self.apply_topic_meta(meta)
                    else:
                        await self.forget_topic(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("watching topics failed (%r); reading them again in 1 s", exc)
            await asyncio.sleep(1)

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.retention_check_ms / 1000)
            try:
                await self.enforce_retention()
            except Exception as exc:
                log.warning("retention pass failed: %r", exc)

    async def enforce_retention(self) -> int:
        """Apply every topic's retention.ms / retention.bytes to its partitions."""
        removed = 0
        now_ms = int(time.time() * 1000)
        for meta in await self.meta.list_topics():
            self.topics.put(meta)
            ms = topic_config.value(meta.config, "retention.ms", self.cfg)
            size = topic_config.value(meta.config, "retention.bytes", self.cfg)
            if ms < 0 and size < 0:
                continue
            for p in range(meta.partitions):
                if self.cluster.desired_owner(meta.name, p) == self.cfg.node_id:
                    lg = await self.partition_log(meta.name, p)
                    removed += await lg.apply_retention(ms, size, now_ms)
        return removed

    async def close(self, drain_s: float = 10) -> None:
        """Flush what producers are waiting on (up to drain_s), release the
        partitions so other brokers take over at once, then stop. From the
        first moment no partition is opened here any more (requests get
        NOT_LEADER_OR_FOLLOWER), so what is handed over stays handed over."""
        self.closing = True
        for task in (self._topic_watch, self._retention, self._balancer, self._acl_refresher):
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._opening.values(), return_exceptions=True)  # opened or failed: then released
        await self.groups.close()
        results = await asyncio.gather(*(self.release_partition(t, p, lg, drain_s)
                                         for (t, p), lg in list(self.logs.items())), return_exceptions=True)
        for exc in results:
            if isinstance(exc, BaseException):
                log.warning("handing a partition over failed (its lease expiry hands it over): %r", exc)

    # ----------------------------------------------------------- topics/logs
    async def topic(self, name: str, auto_create: bool = False) -> TopicMeta | None:
        meta = self.topics.get(name)
        if meta is None:
            meta = await self.meta.get_topic(name)
            if meta is None and auto_create and self.cfg.auto_create_topics and topic_name_error(name) is None:
                try:
                    meta = await self.meta.create_topic(name, self.cfg.default_partitions, {})
                    log.info("auto-created topic %s", name)
                except TopicExists:
                    meta = await self.meta.get_topic(name)
            if meta is not None:
                self.topics.put(meta)
        return meta

    async def topic_by_id(self, topic_id: bytes) -> TopicMeta | None:
        """From the topic cache, which the topic watch keeps current: a request
        naming thousands of ids costs no etcd reads."""
        return self.topics.by_id(topic_id)

    async def apply_topic_meta(self, meta: TopicMeta) -> None:
        """Adopt a topic's new configuration in the cache and its open logs."""
        self.topics.put(meta)
        for (name, _), lg in self.logs.items():
            if name == meta.name:
                self._configure(lg, meta)

    def _configure(self, lg: PartitionLog, meta: TopicMeta) -> None:
        lg.segment_bytes = topic_config.value(meta.config, "segment.bytes", self.cfg)

    async def partition_log(self, topic: str, p: int) -> PartitionLog:
        key = (topic, p)
        lg = self.logs.get(key)
        if lg is not None and not lg.closed:
            return lg
        pending = self._opening.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        if self.closing:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"broker {self.cfg.node_id} is shutting down")
        desired = self.cluster.desired_owner(topic, p)
        if desired != self.cfg.node_id:
            raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"{topic}/{p} belongs on broker {desired}")
        fut: asyncio.Future[PartitionLog] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            if not await self.meta.claim_owner(topic, p, self.cfg.node_id, self.lease):
                owner = await self.meta.owner_of(topic, p)
                raise LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER, f"{topic}/{p} is still owned by broker {owner}")
            lg = PartitionLog(topic, p, self.cfg, self.store, self.meta, self.cache, self.read_budget,
                              lambda lg, m: self.on_change(lg, m))
            meta = self.topics.get(topic)
            if meta is not None:
                self._configure(lg, meta)
            await lg.open()
            self.logs[key] = lg
            fut.set_result(lg)
            return lg
        except LogError as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        except KeyError as exc:  # the topic was deleted meanwhile
            err = LogError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, str(exc))
            fut.set_exception(err)
            fut.exception()
            raise err from exc
        except Exception as exc:  # etcd unreachable or similar: clients retry on this code
            log.warning("cannot open %s/%d: %r", topic, p, exc)
            err = LogError(ErrorCode.LEADER_NOT_AVAILABLE, f"partition {topic}/{p} is not available: {exc}")
            fut.set_exception(err)
            fut.exception()  # retrieved: waiters re-raise it
            raise err from exc
        finally:
            del self._opening[key]

    # --------------------------------------------------------------- Metadata
    def _broker_list(self) -> list[dict[str, Any]]:
        return [{"node_id": b, "host": h, "port": p, "rack": None}
                for b, (h, p) in sorted(self.cluster.brokers.items())]

    def _topic_metadata(self, meta: TopicMeta, owners: dict[tuple[str, int], int]) -> dict[str, Any]:
        parts = []
        for p in range(meta.partitions):
            leader = owners.get((meta.name, p))
            if leader not in self.cluster.brokers:  # unowned (or owner gone): where it will be claimed
                leader = self.cluster.desired_owner(meta.name, p)
            parts.append({"error_code": 0, "partition_index": p, "leader_id": leader, "leader_epoch": 0,
                          "replica_nodes": [leader], "isr_nodes": [leader], "offline_replicas": []})
        return {"error_code": 0, "name": meta.name, "topic_id": meta.id, "is_internal": False, "partitions": parts}

    @staticmethod
    def _topic_error(code: ErrorCode, name: str | None, t: dict[str, Any]) -> dict[str, Any]:
        return {"error_code": code, "name": name, "topic_id": t.get("topic_id", bytes(16)), "partitions": []}

    async def metadata(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        """Topics, partitions and leaders. While etcd is unreachable, answered
        from what this broker last read (leaders where they will be claimed)."""
        wanted = req.get("topics")
        etcd_down = False
        try:
            owners = await self.meta.owners()
        except Exception as exc:
            if not unavailable(exc):
                raise
            log.warning("Metadata: etcd unreachable (%r); answering from the cached topics", exc)
            owners, etcd_down = {}, True
        if wanted is None or (hdr.api_version == 0 and not wanted):
            metas = list(self.topics.values()) if etcd_down else await self.meta.list_topics()
            for m in metas:
                self.topics.put(m)
            topics = [self._topic_metadata(m, owners) for m in sorted(metas, key=lambda m: m.name)
                      if self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, m.name)]
        else:
            topics = []
            auto = req.get("allow_auto_topic_creation", True)
            for t in wanted:
                name = t.get("name")
                if name and not self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, name):
                    topics.append(self._topic_error(ErrorCode.TOPIC_AUTHORIZATION_FAILED, name, t))
                    continue
                meta = (await self.topic(name, auto and self.may_create_topic(hdr, name)) if name
                        else await self.topic_by_id(t.get("topic_id", b"")))
                if meta is not None and not self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, meta.name):
                    topics.append(self._topic_error(ErrorCode.TOPIC_AUTHORIZATION_FAILED, name, t))
                elif meta is None:
                    err = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if name else ErrorCode.UNKNOWN_TOPIC_ID
                    if name and topic_name_error(name):
                        err = ErrorCode.INVALID_TOPIC_EXCEPTION
                    topics.append(self._topic_error(err, name, t))
                else:
                    topics.append(self._topic_metadata(meta, owners))
        return {"throttle_time_ms": 0, "brokers": self._broker_list(), "cluster_id": self.cfg.cluster,
                "controller_id": self.cfg.node_id, "topics": topics}

    # ---------------------------------------------------------------- Produce
    async def produce(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any] | None:
        acks = req["acks"]
        results: list[tuple[dict[str, Any], asyncio.Future[int] | None]] = []
        responses = []
        async with hdr.append_order:  # appends in the order the connection sent them
            for td in req["topic_data"]:
                parts = []
                writable = self.allowed(hdr, Operation.WRITE, ResourceType.TOPIC, td["name"])
                meta = await self.topic(td["name"], self.may_create_topic(hdr, td["name"])) if writable else None
                for pd in td["partition_data"]:
                    r = {"index": pd["index"], "error_code": 0, "base_offset": -1, "log_append_time_ms": -1,
                         "log_start_offset": -1, "record_errors": [], "error_message": None}
                    parts.append(r)
                    fut = None
                    accepted: Accepted | LogError | None = pd["records"]
                    try:
                        if isinstance(accepted, LogError):
                            raise accepted
                        if not writable:
                            raise LogError(ErrorCode.TOPIC_AUTHORIZATION_FAILED, f"{hdr.principal} may not write")
                        if acks not in (0, 1, -1):
                            raise LogError(ErrorCode.INVALID_REQUIRED_ACKS, f"acks={acks}")
                        if req.get("transactional_id") is not None:
                            raise LogError(ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, NO_TRANSACTIONS)
                        if meta is None or not 0 <= pd["index"] < meta.partitions:
                            raise LogError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"{td['name']}/{pd['index']}")
                        payload, release = accepted
                        batches = _native.scan_batches(payload)
                        limit = topic_config.value(meta.config, "max.message.bytes", self.cfg)
                        if any(b.size > limit for b in batches):
                            raise LogError(ErrorCode.MESSAGE_TOO_LARGE, f"a batch exceeds max.message.bytes={limit}")
                        lg = await self.partition_log(meta.name, pd["index"])
                        base, fut = lg.append(payload, batches, acks != 0, release)
                        accepted = None  # the log releases the payload now
                        r["base_offset"] = base
                        r["log_start_offset"] = lg.log_start
                    except LogError as exc:
                        r["error_code"], r["error_message"] = exc.code, str(exc)
                        log.info("produce %s/%s rejected: %s %s", td["name"], pd["index"], exc.code.name, exc)
                    finally:
                        if isinstance(accepted, tuple):
                            accepted[1]()
                    results.append((r, fut))
                responses.append({"name": td["name"], "partition_responses": parts})
        if acks == 0:
            return None
        await self._await_durable(results, req["timeout_ms"] / 1000)
        return {"responses": responses, "throttle_time_ms": 0}

    @staticmethod
    async def _await_durable(results: list[tuple[dict[str, Any], asyncio.Future[int] | None]],
                             wait_s: float) -> None:
        futs = [f for _, f in results if f is not None]
        if futs:
            await asyncio.wait(futs, timeout=max(wait_s, 0.001))
        for r, fut in results:
            if fut is None:
                continue
            if not fut.done():
                r["error_code"], r["error_message"] = ErrorCode.REQUEST_TIMED_OUT, "not durable within timeout_ms"
                r["base_offset"] = -1
                fut.add_done_callback(lambda f: f.exception())  # it may still complete later
            elif fut.exception() is not None:
                exc = fut.exception()
                r["error_code"] = exc.code if isinstance(exc, LogError) else ErrorCode.UNKNOWN_SERVER_ERROR
                r["error_message"], r["base_offset"] = str(exc), -1
            else:
                r["base_offset"] = fut.result()

    # ------------------------------------------------------------ ListOffsets
    async def list_offsets(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        topics = []
        for t in req["topics"]:
            meta = await self.topic(t["name"])
            parts = []
            for p in t["partitions"]:
                r = {"partition_index": p["partition_index"], "error_code": 0, "old_style_offsets": [],
                     "timestamp": -1, "offset": -1, "leader_epoch": 0}
                parts.append(r)
                if not self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, t["name"]):
                    r["error_code"] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
                    continue
                if meta is None or not 0 <= p["partition_index"] < meta.partitions:
                    r["error_code"] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                    continue
                try:
                    lg = await self.partition_log(meta.name, p["partition_index"])
                except LogError as exc:
                    r["error_code"] = exc.code
                    continue
                ts = p["timestamp"]
                if ts == -1:
                    r["offset"] = lg.hw
                elif ts == -2:
                    r["offset"] = lg.log_start
                elif ts == -3:  # v7+: the record with the largest timestamp
                    r["offset"], r["timestamp"] = await lg.offset_of_max_timestamp()
                elif ts < 0:
                    r["error_code"] = ErrorCode.INVALID_REQUEST
                else:
                    r["offset"], r["timestamp"] = await lg.offset_for_timestamp(ts)
                r["old_style_offsets"] = [r["offset"]] if r["offset"] >= 0 else []
            topics.append({"name": t["name"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    # ----------------------------------------------------------- CreateTopics
    async def create_topics(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        out = []
        for t in req["topics"]:
            name = t["name"]
            n = t["num_partitions"]
            n = self.cfg.default_partitions if n == -1 else n
            r = {"name": name, "topic_id": bytes(16), "error_code": 0, "error_message": None,
                 "num_partitions": n, "replication_factor": 1, "configs": []}
            out.append(r)
            configs = {c["name"]: c["value"] for c in t["configs"]}
            bad_cfg = topic_config.validate(configs)
            if not self.may_create_topic(hdr, name):
                r["error_code"] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
                r["error_message"] = f"{hdr.principal} may not create topic {name}"
            elif topic_name_error(name):
                r["error_code"], r["error_message"] = ErrorCode.INVALID_TOPIC_EXCEPTION, topic_name_error(name)
            elif n <= 0 or n > 10000:
                r["error_code"], r["error_message"] = ErrorCode.INVALID_PARTITIONS, f"{n} partitions"
            elif t["replication_factor"] == 0 or t["replication_factor"] < -1:
                r["error_code"] = ErrorCode.INVALID_REPLICATION_FACTOR
                r["error_message"] = "replication factor must be -1 or positive (S3 provides the durability)"
            elif t["assignments"]:
                r["error_code"] = ErrorCode.INVALID_REQUEST
                r["error_message"] = "manual replica assignment is not supported"
            elif bad_cfg:
                r["error_code"], r["error_message"] = ErrorCode.INVALID_CONFIG, bad_cfg
            elif req.get("validate_only"):
                pass
            else:
                try:
                    meta = await self.meta.create_topic(name, n, {k: v for k, v in configs.items() if v is not None})
                    self.topics.put(meta)
                    r["topic_id"] = meta.id
                    log.info("created topic %s with %d partitions", name, n)
                except TopicExists:
                    r["error_code"] = ErrorCode.TOPIC_ALREADY_EXISTS
                    r["error_message"] = f"topic {name} already exists"
            r["configs"] = [{"name": k, "value": v, "read_only": False, "config_source": 1, "is_sensitive": False}
                            for k, v in configs.items()]
        return {"throttle_time_ms": 0, "topics": out}

    # ----------------------------------------------------------- DeleteTopics
    async def delete_topics(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        wanted: list[tuple[str | None, bytes]] = [(n, bytes(16)) for n in req.get("topic_names") or []]
        wanted += [(t["name"], t["topic_id"]) for t in req.get("topics") or []]
        out = []
        for name, topic_id in wanted:
            meta = await self.topic(name) if name else await self.topic_by_id(topic_id)
            r = {"name": name, "topic_id": topic_id, "error_code": 0, "error_message": None}
            out.append(r)
            if not self.allowed(hdr, Operation.DELETE, ResourceType.TOPIC, meta.name if meta else name or ""):
                r["error_code"] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
                continue
            if meta is None:
                r["error_code"] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if name else ErrorCode.UNKNOWN_TOPIC_ID
                continue
            r["name"], r["topic_id"] = meta.name, meta.id
            await self.drop_topic(meta.name)
        return {"throttle_time_ms": 0, "responses": out}

    async def forget_topic(self, name: str) -> None:
        """Close a deleted topic's open logs and drop it from the cache."""
        for key in [k for k in self.logs if k[0] == name]:
            await self.logs.pop(key).close(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        self.topics.pop(name)

    async def drop_topic(self, name: str) -> None:
        """Delete a topic's etcd keys and then its objects."""
        await self.forget_topic(name)
        await self.meta.delete_topic(name)
        prefix = f"{self.cfg.namespace}/{name}/"
        self.cache.drop_prefix(prefix)
        n = await self.store.delete_prefix(prefix)
        log.info("deleted topic %s (%d objects)", name, n)

    # --------------------------------------------------------- InitProducerId
    async def init_producer_id(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("transactional_id") is not None:
            return {"throttle_time_ms": 0, "error_code": ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        # Kafka's rule (KIP-679): IdempotentWrite on the cluster, or Write on some topic
        if not (self.allowed(hdr, Operation.IDEMPOTENT_WRITE, ResourceType.CLUSTER, CLUSTER)
                or self.authz.allows_any_topic(hdr.principal, hdr.client_host, Operation.WRITE)):
            return {"throttle_time_ms": 0, "error_code": ErrorCode.CLUSTER_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        # Without a transactional id Kafka always allocates a fresh producer id,
        # whatever id and epoch the request carries (a client may send 0/0, or an
        # id another producer holds): two producers must never share one.
        return {"throttle_time_ms": 0, "error_code": 0, "producer_id": await self.meta.next_producer_id(),
                "producer_epoch": 0}
