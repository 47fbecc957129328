"""The console's data and routes, added to an AdminServer: GET / (the page),
GET /api/overview (JSON), GET /api/topics/NAME/records (the record browser),
GET /api/groups/NAME (a consumer group), POST /api/topics (create a topic;
basic auth).

The overview comes from etcd (brokers, topics, partition watermarks and
owners, segment counts, committed offsets) plus the readiness checks, so the
console runs inside a broker's admin endpoint or standalone (`kafscale
console`) with only etcd and S3. Records and group members are read over the
Kafka protocol from the brokers registered in etcd, as the signed-in user
when the admin endpoint asked for one: a Fetch, a ListOffsets, a
DescribeGroups like any client's, through the same checks and ACLs, and
never a commit. Without KAFSCALE_CONSOLE_USER and KAFSCALE_CONSOLE_PASSWORD
in the environment the console is read-only."""
from __future__ import annotations

import asyncio
import base64
import hmac
import os
import time
from importlib import resources
from typing import Any

from aiohttp import web

from kafscale.client import Cluster, Credentials
from kafscale.metadata.store import MetaStore, TopicExists
from kafscale.metadata.topic_config import topic_name_error
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.types import TopicPartition
from kafscale.records import browse
from kafscale.storage.wal import committed_watermarks
from kafscale.tools import describe_group

PAGE = resources.files("kafscale.console").joinpath("page.html").read_text()
USER_ENV, PASSWORD_ENV = "KAFSCALE_CONSOLE_USER", "KAFSCALE_CONSOLE_PASSWORD"
MAX_PAGE = 500  # records in one page of the record browser
NOT_FOUND = (ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, ErrorCode.GROUP_ID_NOT_FOUND)
REFUSED = (ErrorCode.TOPIC_AUTHORIZATION_FAILED, ErrorCode.GROUP_AUTHORIZATION_FAILED,
           ErrorCode.SASL_AUTHENTICATION_FAILED)


async def overview(meta: MetaStore, health: dict[str, str], cluster: str) -> dict[str, Any]:
    brokers, draining, topics, owners, groups, counts = await asyncio.gather(
        meta.list_brokers(), meta.draining(), meta.list_topics(), meta.owners(), meta.group_names_with_offsets(),
        meta.segment_counts())
    marks = await committed_watermarks(meta, topics)
    out_topics = []
    hws: dict[tuple[str, int], int] = {}
    for t in sorted(topics, key=lambda t: t.name):
        parts = []
        for p in range(t.partitions):
            hw, start, slices = marks[TopicPartition(t.name, p)]
            hws[(t.name, p)] = hw
            parts.append({"partition": p, "high_watermark": hw, "log_start": start, "leader": owners.get((t.name, p)),
                          "segments": counts.get((t.name, p), 0) + slices})
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


def _basic(request: web.Request) -> Credentials | None:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        user, _, password = base64.b64decode(header[6:]).decode().partition(":")
    except ValueError:
        return None
    return Credentials(user, password)


def _authorized(request: web.Request) -> bool:
    creds, given = _credentials(), _basic(request)
    if creds is None or given is None:
        return False
    return hmac.compare_digest(given.user, creds[0]) and hmac.compare_digest(given.password, creds[1])


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _int(req: web.Request, name: str, default: int | None = None) -> int | None:
    value = req.query.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f'{{"error": "{name} must be a whole number"}}',
                                 content_type="application/json") from None


async def _over_kafka(meta: MetaStore, req: web.Request, as_user: bool, work: Any) -> web.Response:
    """Run work(cluster) against the registered brokers as the signed-in user
    (when the admin endpoint requires one) and answer its JSON, or the error."""
    brokers = [f"{h}:{p}" for _id, h, p in await meta.list_brokers()]
    if not brokers:
        return web.json_response({"error": "no broker is registered"}, status=503)
    credentials = _basic(req) if as_user else None
    try:
        async with Cluster(brokers, "kafscale-console", credentials) as cluster:
            return web.json_response(await work(cluster))
    except KafkaError as exc:
        status = 404 if exc.code in NOT_FOUND else 403 if exc.code in REFUSED else 502
        return web.json_response({"error": str(exc)}, status=status)
    except OSError as exc:
        return web.json_response({"error": f"no broker answered: {exc}"}, status=502)


def add_routes(app: web.Application, meta: MetaStore, cluster: str, health: Any, as_user: bool = False) -> None:
    """health: an async callable returning {check: "ok" | "failed: ..."}. as_user: the
    admin endpoint signs users in as Kafka users, and records are read as that user."""

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

    async def records(req: web.Request) -> web.Response:
        partition, limit = _int(req, "partition", 0), min(max(_int(req, "limit", 50) or 1, 1), MAX_PAGE)
        offset, at_ms = _int(req, "offset"), _int(req, "time")

        async def work(c: Cluster) -> dict[str, Any]:
            page = await browse(c, req.match_info["topic"], partition or 0, offset, at_ms, limit)
            page["records"] = [{"offset": r.offset, "timestamp": r.timestamp, "key": _b64(r.key),
                                "value": _b64(r.value), "headers": [[k, _b64(v)] for k, v in r.headers]}
                               for r in page["records"]]
            return page

        return await _over_kafka(meta, req, as_user, work)

    async def group(req: web.Request) -> web.Response:
        return await _over_kafka(meta, req, as_user, lambda c: describe_group(c, req.match_info["group"]))

    app.router.add_get("/", page)
    app.router.add_get("/api/overview", api_overview)
    app.router.add_get("/api/topics/{topic}/records", records)
    app.router.add_get("/api/groups/{group}", group)
    app.router.add_post("/api/topics", create_topic)
