"""The log process's side of a node, put together: the partitions it owns
(partitions.py), who may do what (access.py), the group coordinator, and the
API classes that answer every Kafka request except ApiVersions and Fetch
(which protocol workers answer themselves). `handlers` maps an API key to
its coroutine. Produce arrives with its payloads already validated."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kafscale.broker.access import Access
from kafscale.broker.acl_api import AclApi
from kafscale.broker.admin import AdminApi
from kafscale.broker.cluster import Cluster
from kafscale.broker.partitions import PartitionRegistry
from kafscale.broker.produce_api import ProduceApi
from kafscale.broker.replica_api import ReplicaApi
from kafscale.broker.server import Handler
from kafscale.broker.topic_api import TopicApi
from kafscale.broker.user_api import UserApi
from kafscale.config import Config
from kafscale.groups.api import GroupApi
from kafscale.groups.coordinator import GroupCoordinator
from kafscale.metadata.store import MetaStore
from kafscale.protocol.types import TopicPartition
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.reader import SegmentSource
from kafscale.storage.wal import committed_watermarks

log = logging.getLogger(__name__)


class Broker:
    def __init__(self, cfg: Config, store: ObjectStore, meta: MetaStore, cache: SegmentSource) -> None:
        self.cfg = cfg
        self.meta = meta
        self.cluster = Cluster(meta, cfg)
        self.access = Access(cfg, meta)
        self.partitions = PartitionRegistry(cfg, store, meta, cache, self.cluster)
        self.lease_until = 0.0  # monotonic time until which our etcd lease surely lives (BrokerNode keeps it)
        self.groups = GroupCoordinator(meta, cfg.group_initial_rebalance_delay_ms,
                                       lambda: time.monotonic() < self.lease_until)
        self.produce_api = ProduceApi(cfg, meta, self.partitions, self.access)
        self.handlers: dict[int, Handler] = {}
        for api in (TopicApi(cfg, meta, self.partitions, self.access), self.produce_api,
                    GroupApi(self.groups, self.cluster, self.partitions.topic, self.partitions.topic_by_id,
                             self.access.allowed),
                    AdminApi(cfg, meta, self.partitions, self.access), AclApi(meta, self.access),
                    UserApi(meta, self.access), ReplicaApi(cfg, meta, self.partitions, self.access)):
            self.handlers.update(api.handlers)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, lease: Any) -> None:
        await self.partitions.start(lease)
        await self.cluster.refresh()
        await self.cluster.follow_owners()
        await self.partitions.refresh_defaults()
        await self.groups.start()
        self._tasks = [asyncio.create_task(self.partitions.watch_topics(), name="topic watch"),
                       asyncio.create_task(self.partitions.retention_loop(), name="retention"),
                       asyncio.create_task(self.partitions.collection_loop(), name="node object collection"),
                       asyncio.create_task(self._balance_loop(), name="balancer")]
        if self.cfg.etcd_compaction_ms > 0:
            self._tasks.append(asyncio.create_task(self._history_loop(), name="etcd history compaction"))
        if self.partitions.flusher is not None:
            self._tasks.append(asyncio.create_task(self.partitions.compaction_loop(), name="compaction"))
        if self.access.enabled:
            await self.access.refresh()
            self._tasks.append(asyncio.create_task(self.access.run(), name="acls"))

    async def close(self, drain_s: float = 10) -> None:
        """Stop the background loops, hand the groups over, then flush and
        release the partitions (see PartitionRegistry.close)."""
        self.partitions.closing = True
        for task in self._tasks:
            task.cancel()
        self.cluster.close()
        await self.groups.close()
        await self.partitions.close(drain_s)

    async def _balance_loop(self) -> None:
        """Follow membership: hand partitions and groups to the broker that
        should have them now (a broker joined), after flushing what is queued;
        and adopt the dynamic broker configs."""
        while True:
            await asyncio.sleep(self.cfg.balance_interval_ms / 1000)
            try:
                await self.cluster.refresh()
                await self.partitions.refresh_defaults()
                await self.partitions.hand_over_misplaced()
                await self.groups.evict(lambda g: self.cluster.coordinator_for(g) != self.cfg.node_id)
            except Exception as exc:
                log.warning("balancing pass failed: %r", exc)

    async def _history_loop(self) -> None:
        """Compact etcd's history every etcd_compaction_ms, on the broker that
        collects node objects, up to the revision it saw the pass before: etcd
        keeps every version of every key until its history is compacted, and
        every node object's directory is put and later deleted, so at 1,000
        partitions and 2,000 records/s its database grew by about 0.6 MiB a
        second and would reach etcd's default quota of 2 GiB, past which it
        refuses every write, within about an hour. At least one interval of
        history stays, far longer than a scan or a watch's reconnect takes."""
        seen = 0
        while True:
            await asyncio.sleep(self.cfg.etcd_compaction_ms / 1000)
            try:
                if not self.cluster.collects():
                    seen = 0
                    continue
                if seen:
                    await self.meta.compact_history(seen)
                seen = await self.meta.revision()
            except Exception as exc:
                log.warning("compacting etcd's history failed: %r", exc)

    async def lease_lost(self, new_lease: Any) -> None:
        """Our lease expired (we were paused or cut off): drop every partition and group."""
        await self.partitions.drop_all(new_lease)
        await self.groups.evict(lambda g: True)

    async def group_lag(self) -> dict[tuple[str, str, int], int]:
        """(group, topic, partition) -> high watermark - committed offset, for
        the groups this broker coordinates."""
        lag: dict[tuple[str, str, int], int] = {}
        elsewhere: dict[TopicPartition, tuple[int, int, int]] | None = None  # committed watermarks, read once if needed
        mine = [g for g in await self.meta.group_names_with_offsets()
                if self.cluster.coordinator_for(g) == self.cfg.node_id]
        for group in sorted(set(mine) | set(self.groups.groups)):
            for (topic, p), committed in (await self.meta.fetch_offsets(group)).items():
                hw = self.partitions.high_watermark(topic, p)
                if hw is None:  # not open here
                    if elsewhere is None:
                        elsewhere = await committed_watermarks(self.meta, await self.meta.list_topics())
                    hw = elsewhere.get(TopicPartition(topic, p), (0, 0, 0))[0]
                lag[(group, topic, p)] = max(hw - committed["offset"], 0)
        return lag
