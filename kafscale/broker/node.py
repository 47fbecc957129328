"""Run one broker node: connect to etcd and S3 (failing fast with a clear
message if either is unusable), then serve Kafka until stopped."""
from __future__ import annotations

import asyncio
import logging
import signal

from kafscale.broker.handlers import Broker
from kafscale.broker.server import KafkaServer
from kafscale.config import Config
from kafscale.metadata.store import MetaStore
from kafscale.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


class BrokerNode:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.store = ObjectStore(cfg.bucket, cfg.s3_endpoint or None, cfg.s3_region, cfg.s3_access_key or None,
                                 cfg.s3_secret_key or None, multipart_threshold=cfg.multipart_threshold)
        self.meta = MetaStore(cfg.etcd, cfg.cluster)
        self.broker: Broker | None = None
        self.server: KafkaServer | None = None
        self._lease = None
        self._keepalive: asyncio.Task[None] | None = None

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
        self.broker = Broker(self.cfg, self.store, self.meta)
        await self.broker.start()
        host, port = self.cfg.listen_addr()
        self.server = KafkaServer(self.broker, host, port, self.cfg.max_request_bytes)
        await self.server.start()
        adv_host, _ = self.cfg.advertised_addr()
        self._lease = await self.meta.register_broker(self.cfg.node_id, adv_host, self.server.port)
        self._keepalive = asyncio.create_task(self._keep_lease())

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(3)
            try:
                await self._lease.refresh()
            except Exception as exc:
                log.warning("broker lease refresh failed: %s", exc)

    async def stop(self) -> None:
        if self._keepalive:
            self._keepalive.cancel()
        if self.server:
            await self.server.close()
        if self.broker:
            await self.broker.close()
        await self.store.close()
        await self.meta.close()


async def run_until_signal(cfg: Config) -> None:
    node = BrokerNode(cfg)
    await node.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await node.stop()
