"""The HTTP admin endpoint of a broker node (served by its log process), of
the proxy and of `kafscale console`: /metrics (Prometheus), /healthz (the
process answers), /readyz (it can take traffic: etcd and S3 answer, the
broker is registered and not draining) and, where enabled, the web console
at /. Each check is bounded by CHECK_TIMEOUT_S."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kafscale import metrics
from kafscale.config import Config
from kafscale.lifecycle import stop_on_signals
from kafscale.metadata.store import MetaStore
from kafscale.security.acl import Authorizer
from kafscale.security.sasl import SaslExchange, SaslFailed

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0
Check = Callable[[], Awaitable[None]]  # raises when the dependency is not usable
LagSource = Callable[[], Awaitable[dict[tuple[str, str, int], int]]]
OPEN_PATHS = ("/healthz", "/readyz")  # probes: never behind authentication


class AdminAuth:
    """Who may read the admin endpoint when the Kafka listener requires SASL:
    HTTP Basic credentials of a Kafka user (the SCRAM records `kafscale users`
    writes, checked as SASL/PLAIN checks them), and with the authorizer on
    only a super user (the console and /metrics show every topic, group and
    offset). Without SASL the endpoint is open: bind it to a private address."""

    def __init__(self, cfg: Config, meta: MetaStore) -> None:
        self.required = bool(cfg.sasl_mechanism_list())
        self.super_users = Authorizer(cfg.authorizer, cfg.super_users).super_users if cfg.authorizer else None
        self.meta = meta

    async def refusal(self, request: web.Request) -> web.Response | None:
        """None when the request may proceed, else the 401/403 answer."""
        if not self.required or request.path in OPEN_PATHS:
            return None
        header = request.headers.get("Authorization", "")
        principal = None
        if header.startswith("Basic "):
            try:
                user, _, password = base64.b64decode(header[6:]).decode().partition(":")
                exchange = SaslExchange("PLAIN", self.meta.get_user)
                await exchange.step(b"\0" + user.encode() + b"\0" + password.encode())
                principal = exchange.principal
            except (ValueError, SaslFailed):
                principal = None
        if principal is None:
            return web.json_response({"error": "sign in with a Kafka user"}, status=401,
                                     headers={"WWW-Authenticate": 'Basic realm="kafscale"'})
        if self.super_users is not None and principal not in self.super_users:
            return web.json_response({"error": f"{principal} is not a super user"}, status=403)
        return None


@web.middleware
async def _cross_site_guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse what a page on another site can make a browser send: a POST must
    carry JSON (a form cannot), and an Origin, when sent, must be this host."""
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        if request.content_type != "application/json":
            return web.json_response({"error": "send application/json"}, status=415)
        origin = request.headers.get("Origin")
        if origin is not None and origin.split("://", 1)[-1] != request.host:
            return web.json_response({"error": f"cross-site request from {origin} refused"}, status=403)
    return await handler(request)


class AdminServer:
    def __init__(self, listen: str, checks: dict[str, Check], lag: LagSource | None = None,
                 console: tuple[MetaStore, str] | None = None, auth: AdminAuth | None = None) -> None:
        """console: (etcd metadata, cluster name) to serve the web console at /."""
        host, _, port = listen.rpartition(":")
        self.host, self.port = host or "0.0.0.0", int(port)
        self.checks = checks
        self.lag = lag
        self.console = console
        self.auth = auth
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        auth = self.auth

        @web.middleware
        async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
            refusal = await auth.refusal(request) if auth is not None else None
            return refusal if refusal is not None else await handler(request)

        app = web.Application(middlewares=[authenticate, _cross_site_guard])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if self.console is not None:
            from kafscale.console.api import add_routes

            add_routes(app, *self.console, self.health, as_user=auth is not None and auth.required)
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


async def serve_standalone(cfg: Config) -> None:
    """`kafscale console`: the console and /metrics /healthz /readyz with only
    etcd and S3 (no broker), until SIGINT/SIGTERM."""

    from kafscale.storage.objectstore import ObjectStore

    meta = MetaStore.from_config(cfg)
    await meta.start()
    store = ObjectStore.from_config(cfg)
    await store.start()
    admin = AdminServer(cfg.admin_listen or "127.0.0.1:9644", {"etcd": meta.ping, "s3": store.ping},
                        console=(meta, cfg.cluster), auth=AdminAuth(cfg, meta))
    await admin.start()
    stop = stop_on_signals()
    try:
        await stop.wait()
    finally:
        await admin.close()
        await store.close()
        await meta.close()
