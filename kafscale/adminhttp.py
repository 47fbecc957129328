"""The HTTP admin endpoint of a broker node (served by its log process), of
the proxy and of `kafscale console`: /metrics (Prometheus), /healthz (the
process answers), /readyz (it can take traffic: etcd and S3 answer, the
broker is registered and not draining) and, where enabled, the web console
at /. Each check is bounded by CHECK_TIMEOUT_S."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from kafscale import metrics
from kafscale.metadata.store import MetaStore

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0
Check = Callable[[], Awaitable[None]]  # raises when the dependency is not usable
LagSource = Callable[[], Awaitable[dict[tuple[str, str, int], int]]]


class AdminServer:
    def __init__(self, listen: str, checks: dict[str, Check], lag: LagSource | None = None,
                 console: tuple[MetaStore, str] | None = None) -> None:
        """console: (etcd metadata, cluster name) to serve the web console at /."""
        host, _, port = listen.rpartition(":")
        self.host, self.port = host or "0.0.0.0", int(port)
        self.checks = checks
        self.lag = lag
        self.console = console
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if self.console is not None:
            from kafscale.console.api import add_routes

            add_routes(app, *self.console, self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()
        log.info("admin endpoint on http://%s:%d (/metrics /healthz /readyz)", self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _req: web.Request) -> web.Response:
        lag = None
        if self.lag is not None:
            try:
                lag = await asyncio.wait_for(self.lag(), CHECK_TIMEOUT_S)
            except Exception as exc:
                log.warning("group lag for /metrics failed: %r", exc)
        body = await asyncio.to_thread(metrics.render, lag)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _healthz(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def health(self) -> dict[str, str]:
        """Each check: "ok" or "failed: why"."""
        results = await asyncio.gather(*(self._run(c) for c in self.checks.values()))
        return dict(zip(self.checks, results, strict=True))

    async def _readyz(self, _req: web.Request) -> web.Response:
        report = await self.health()
        ok = all(r == "ok" for r in report.values())
        return web.Response(status=200 if ok else 503, content_type="application/json",
                            text=json.dumps({"status": "ready" if ok else "not ready", "checks": report}))

    @staticmethod
    async def _run(check: Check) -> str:
        try:
            await asyncio.wait_for(check(), CHECK_TIMEOUT_S)
            return "ok"
        except Exception as exc:
            return f"failed: {exc!r}"
