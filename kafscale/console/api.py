"""The console's data and routes, added to an AdminServer: GET / (the page),
GET /api/overview (JSON), POST /api/topics (create a topic; basic auth).

Everything shown comes from etcd (brokers, topics, partition watermarks and
owners, segment counts, committed offsets) plus the readiness checks, so the
console runs inside a broker's admin endpoint or standalone (`kafscale
console`) with only etcd and S3. Without KAFSCALE_CONSOLE_USER and
KAFSCALE_CONSOLE_PASSWORD in the environment the console is read-only."""
from __future__ import annotations

import asyncio
import base64
import hmac
import os
import time
from importlib import resources
from typing import Any

from aiohttp import web

from kafscale.config import Config
from kafscale.metadata.store import MetaStore, TopicExists
from kafscale.metadata.topic_config import topic_name_error

PAGE = resources.files("kafscale.console").joinpath("page.html").read_text()
USER_ENV, PASSWORD_ENV = "KAFSCALE_CONSOLE_USER", "KAFSCALE_CONSOLE_PASSWORD"


async def overview(meta: MetaStore, health: dict[str, str], cluster: str) -> dict[str, Any]:
    brokers, draining, topics, owners, groups, states, counts = await asyncio.gather(
        meta.list_brokers(), meta.draining(), meta.list_topics(), meta.owners(), meta.group_names_with_offsets(),
        meta.partition_states(), meta.segment_counts())
    out_topics = []
    hws: dict[tuple[str, int], int] = {}
    for t in sorted(topics, key=lambda t: t.name):
        parts = []
        for p in range(t.partitions):
            state = states.get((t.name, p))
            hw, start = (state.hw, state.log_start) if state else (0, 0)
            hws[(t.name, p)] = hw
            parts.append({"partition": p, "high_watermark": hw, "log_start": start, "leader": owners.get((t.name, p)),
                          "segments": counts.get((t.name, p), 0)})
        out_topics.append({"name": t.name, "partitions": parts, "config": t.config,
                           "records": sum(x["high_watermark"] - x["log_start"] for x in parts),
                           "segments": sum(x["segments"] for x in parts)})
    out_groups = []
    for g in sorted(groups):
        rows = [{"topic": t, "partition": p, "committed": c["offset"],
                 "lag": max(hws.get((t, p), c["offset"]) - c["offset"], 0)}
                for (t, p), c in sorted((await meta.fetch_offsets(g)).items())]
        out_groups.append({"group": g, "lag": sum(r["lag"] for r in rows), "partitions": rows})
    return {"cluster": cluster, "time_ms": int(time.time() * 1000), "health": health,
            "brokers": [{"id": b, "host": h, "port": port, "draining": b in draining} for b, h, port in brokers],
            "topics": out_topics, "groups": out_groups, "writable": _credentials() is not None}


def _credentials() -> tuple[str, str] | None:
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password else None


def _authorized(request: web.Request) -> bool:
    creds = _credentials()
    header = request.headers.get("Authorization", "")
    if creds is None or not header.startswith("Basic "):
        return False
    try:
        user, _, password = base64.b64decode(header[6:]).decode().partition(":")
    except ValueError:
        return False
    return hmac.compare_digest(user, creds[0]) and hmac.compare_digest(password, creds[1])


def add_routes(app: web.Application, meta: MetaStore, cluster: str, health: Any) -> None:
    """health: an async callable returning {check: "ok" | "failed: ..."}."""

    async def page(_req: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def api_overview(_req: web.Request) -> web.Response:
        return web.json_response(await overview(meta, await health(), cluster))

    async def create_topic(req: web.Request) -> web.Response:
        if _credentials() is None:
            return web.json_response({"error": "the console is read-only (no credentials configured)"}, status=403)
        if not _authorized(req):
            return web.json_response({"error": "sign in required"}, status=401,
                                     headers={"WWW-Authenticate": 'Basic realm="kafscale console"'})
        body = await req.json()
        name, partitions = str(body.get("name", "")), int(body.get("partitions", 1))
        error = topic_name_error(name) or (None if partitions >= 1 else "a topic needs 1 or more partitions")
        if error:
            return web.json_response({"error": error}, status=400)
        try:
            await meta.create_topic(name, partitions, {})
        except TopicExists:
            return web.json_response({"error": f"topic {name} already exists"}, status=409)
        return web.json_response({"created": name, "partitions": partitions}, status=201)

    app.router.add_get("/", page)
    app.router.add_get("/api/overview", api_overview)
    app.router.add_post("/api/topics", create_topic)


async def serve_standalone(cfg: Config) -> None:
    """`kafscale console`: the console and /metrics /healthz /readyz with only
    etcd and S3 (no broker), until SIGINT/SIGTERM."""
    import signal

    from kafscale.adminhttp import AdminAuth, AdminServer
    from kafscale.storage.objectstore import ObjectStore

    meta = MetaStore.from_config(cfg)
    await meta.start()
    store = ObjectStore.from_config(cfg)
    await store.start()
    admin = AdminServer(cfg.admin_listen or "127.0.0.1:9644", {"etcd": meta.ping, "s3": store.ping},
                        console=(meta, cfg.cluster), auth=AdminAuth(cfg, meta))
    await admin.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await admin.close()
        await store.close()
        await meta.close()
