"""The log process of a broker node: connects to etcd and S3 (failing fast
with a clear message if either is unusable), registers the broker, owns its
partition logs and serves its protocol workers until stopped."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kafscale.adminhttp import AdminAuth, AdminServer, Check
from kafscale.broker.broker import Broker
from kafscale.broker.logproc import LogService
from kafscale.broker.shm import SharedArea, SharedCache
from kafscale.config import Config
from kafscale.lifecycle import started, stop_on_signals
from kafscale.metadata.store import MetaStore
from kafscale.storage.objectstore import ObjectStore
from kafscale.storage.reader import SegmentSource

log = logging.getLogger(__name__)


DRAIN_S = 10  # on shutdown, how long queued produce data may take to become durable
HANDOVER_S = 5  # and then how long releasing partitions and groups in etcd may take
REVOKE_S = 1  # and then deregistering (an etcd that does not answer: the lease's TTL deregisters)


class StartupError(RuntimeError):
    pass


class BrokerNode:
    def __init__(self, cfg: Config, cache: SegmentSource) -> None:
        self.cfg = cfg
        self.cache = cache
        self.store = ObjectStore.from_config(cfg)
        self.meta = MetaStore.from_config(cfg)
        self.broker: Broker | None = None
        self._lease = None
        self._keepalive: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    async def start(self) -> None:
        try:
            await asyncio.wait_for(self.meta.start(), 15)
        except Exception as exc:
            raise StartupError(f"etcd at {self.cfg.etcd} is unreachable: {exc!r}") from exc
        try:
            await self.store.start()
            await asyncio.wait_for(self.store.check_writable(), 30)
        except Exception as exc:
            raise StartupError(f"S3 bucket {self.cfg.bucket!r} at {self.cfg.s3_endpoint or 'AWS'} is not "
                               f"writable: {exc!r}") from exc
        self.broker = Broker(self.cfg, self.store, self.meta, self.cache)
        self.broker.lease_until = await self._register()
        # refreshed from now on: a start slower than the lease's TTL must not lose it
        self._keepalive = asyncio.create_task(self._keep_lease())
        await self.broker.start(self._lease)
        self._started.set()

    def readiness_checks(self) -> dict[str, Check]:
        async def registered() -> None:
            if self._lease is None or await self._lease.remaining_ttl() <= 0:
                raise RuntimeError("broker lease expired")

        async def not_draining() -> None:
            if self.cfg.node_id in await self.meta.draining():
                raise RuntimeError("draining")

        async def kafka_listening() -> None:  # the workers (forked after this process is up) accept
            host, port = self.cfg.listen_addr()
            _, writer = await asyncio.open_connection("127.0.0.1" if host in ("", "0.0.0.0") else host, port)
            writer.close()

        return {"etcd": self.meta.ping, "s3": self.store.ping, "registered": registered, "draining": not_draining,
                "kafka": kafka_listening}

    async def _register(self) -> float:
        """Register on a new lease; returns until when (monotonic) it surely lives."""
        host, port = self.cfg.advertised_addr()
        asked = time.monotonic()
        self._lease = await self.meta.register_broker(self.cfg.node_id, host, port, self.cfg.lease_ttl_s)
        return asked + self.cfg.lease_ttl_s

    async def _keep_lease(self) -> None:
        """Refresh the lease; if it expired (we were paused or cut off from
        etcd), drop everything it covered and register again. The broker knows
        until when the lease surely lives (etcd granted it for TTL seconds from
        a moment after we asked): its group coordinator acts only until then."""
        assert self.broker is not None
        while True:
            await asyncio.sleep(max(self.cfg.lease_ttl_s / 3, 0.5))
            try:
                asked = time.monotonic()
                reply = await self._lease.refresh()
                took = time.monotonic() - asked
                if took > self.cfg.lease_ttl_s / 3:  # one more such wait and the lease may be gone
                    log.warning("broker lease refresh took %.1f s (TTL %d s): etcd or this process is overloaded",
                                took, self.cfg.lease_ttl_s)
                if reply is not None and reply.TTL > 0:
                    self.broker.lease_until = asked + reply.TTL
                else:
                    alive_until = await self._register()
                    await self._started.wait()  # then drop what the start took under the old lease
                    await self.broker.lease_lost(self._lease)
                    self.broker.lease_until = alive_until
            except Exception as exc:
                log.warning("broker lease refresh failed: %s", exc)

    async def stop(self) -> None:
        await self.hand_over()
        await self.close()

    async def hand_over(self) -> None:
        """Flush what producers wait on (they still get their acks) and release
        the partitions and groups, within DRAIN_S + HANDOVER_S."""
        if self._keepalive:
            self._keepalive.cancel()
        if self.broker:
            try:
                await asyncio.wait_for(self.broker.close(DRAIN_S), DRAIN_S + HANDOVER_S)
            except TimeoutError:
                log.warning("hand-over did not finish within %ds; stopping anyway (leases expire)",
                            DRAIN_S + HANDOVER_S)

    async def close(self) -> None:
        """Deregister, and close the etcd and S3 clients."""
        if self._lease is not None:  # deregister at once rather than after the TTL
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), REVOKE_S)
        await self.store.close()
        await self.meta.close()


async def run_log_process(cfg: Config, area: SharedArea, socket_path: str, ready_fd: int) -> None:
    """Start the node, serve the workers on `socket_path`, write one byte to
    `ready_fd`, and run until SIGTERM/SIGINT; then drain and stop."""
    cache = SharedCache(area)
    node = BrokerNode(cfg, cache)
    try:
        await node.start()
        assert node.broker is not None
        service = LogService(node.broker, area, cache)
        await service.start(socket_path)
    except BaseException:
        await node.stop()
        raise
    stop = stop_on_signals()
    admin = None
    if cfg.admin_listen:
        admin = AdminServer(cfg.admin_listen, node.readiness_checks(), node.broker.group_lag,
                            console=(node.meta, cfg.cluster), auth=AdminAuth(cfg, node.meta))
        await admin.start()
    started(ready_fd)
    await stop.wait()
    log.info("shutting down")
    if admin is not None:
        await admin.close()
    await node.hand_over()
    await service.close()  # the workers close their connections: no request reaches the clients closed next
    await node.close()
