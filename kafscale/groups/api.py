"""Kafka request handlers for the group APIs, over GroupCoordinator."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kafscale.broker.context import RequestContext
from kafscale.groups.coordinator import DEAD, GroupCoordinator, GroupError, offset_record
from kafscale.metadata.store import TopicMeta, has_partition
from kafscale.protocol import schemas
from kafscale.protocol.errors import NO_TRANSACTIONS, ErrorCode
from kafscale.protocol.types import TopicPartition
from kafscale.security.acl import CLUSTER, Operation, ResourceType, authorized_operations

if TYPE_CHECKING:
    from kafscale.broker.cluster import Cluster

KEY_TYPE_GROUP = 0
KEY_TYPE_TRANSACTION = 1
Allowed = Callable[[RequestContext, Operation, ResourceType, str], bool]


class GroupApi:
    def __init__(self, coordinator: GroupCoordinator, cluster: Cluster,
                 topic: Callable[[str], Awaitable[TopicMeta | None]],
                 topic_by_id: Callable[[bytes], Awaitable[TopicMeta | None]], allowed: Allowed) -> None:
        self.allowed = allowed
        self.coord = coordinator
        self.cluster = cluster
        self.topic = topic
        self.topic_by_id = topic_by_id
        self.handlers = {
            schemas.FIND_COORDINATOR.key: self.find_coordinator,
            schemas.JOIN_GROUP.key: self.join_group,
            schemas.SYNC_GROUP.key: self.sync_group,
            schemas.HEARTBEAT.key: self.heartbeat,
            schemas.LEAVE_GROUP.key: self.leave_group,
            schemas.OFFSET_COMMIT.key: self.offset_commit,
            schemas.OFFSET_FETCH.key: self.offset_fetch,
            schemas.OFFSET_DELETE.key: self.offset_delete,
            schemas.DESCRIBE_GROUPS.key: self.describe_groups,
            schemas.LIST_GROUPS.key: self.list_groups,
            schemas.DELETE_GROUPS.key: self.delete_groups,
        }

    def _mine(self, hdr: RequestContext, op: Operation, group_id: str) -> None:
        """The principal may do op on the group (else GROUP_AUTHORIZATION_FAILED), and
        this broker coordinates it: each group has one live coordinator, others
        answer NOT_COORDINATOR."""
        if not self.allowed(hdr, op, ResourceType.GROUP, group_id):
            raise GroupError(ErrorCode.GROUP_AUTHORIZATION_FAILED, f"{hdr.principal} may not {op.name} {group_id}")
        if self.cluster.coordinator_for(group_id) != self.cluster.me:
            raise GroupError(ErrorCode.NOT_COORDINATOR, f"group {group_id} is coordinated by another broker")

    async def find_coordinator(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        keys = req["coordinator_keys"] if hdr.api_version >= 4 else [req["key"]]
        found = []
        for key in keys:
            if req["key_type"] == KEY_TYPE_TRANSACTION:
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                              "error_message": NO_TRANSACTIONS})
            elif req["key_type"] != KEY_TYPE_GROUP:
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.INVALID_REQUEST,
                              "error_message": f"coordinator key type {req['key_type']} is not supported"})
            elif not key:
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.INVALID_GROUP_ID, "error_message": "empty group id"})
            elif not self.allowed(hdr, Operation.DESCRIBE, ResourceType.GROUP, key):
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.GROUP_AUTHORIZATION_FAILED, "error_message": None})
            else:
                node = self.cluster.coordinator_for(key)
                host, port = self.cluster.address(node)
                found.append({"key": key, "node_id": node, "host": host, "port": port, "error_code": 0,
                              "error_message": None})
        if hdr.api_version >= 4:  # one answer per key
            return {"throttle_time_ms": 0, "coordinators": found}
        first = found[0] if found else {"node_id": -1, "host": "", "port": -1, "error_code": 0,
                                        "error_message": None}
        return {"throttle_time_ms": 0, "error_code": first["error_code"], "error_message": first["error_message"],
                "node_id": first["node_id"], "host": first["host"], "port": first["port"]}

    async def join_group(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        try:
            self._mine(hdr, Operation.READ, req["group_id"])
            return await self.coord.join(req, hdr.api_version, hdr.client_id or "", hdr.client_host)
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "generation_id": -1, "protocol_type": None,
                    "protocol_name": None, "leader": "", "member_id": req["member_id"], "members": []}

    async def sync_group(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        try:
            self._mine(hdr, Operation.READ, req["group_id"])
            return await self.coord.sync(req)
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "assignment": b""}

    async def heartbeat(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        try:
            self._mine(hdr, Operation.READ, req["group_id"])
            await self.coord.heartbeat(req)
            return {"throttle_time_ms": 0, "error_code": 0}
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code}

    async def leave_group(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if hdr.api_version >= 3:
            who = [(m["member_id"], m["group_instance_id"]) for m in req["members"]]
        else:
            who = [(req["member_id"], None)]
        try:
            self._mine(hdr, Operation.READ, req["group_id"])
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "members": []}
        codes = await self.coord.leave(req["group_id"], who)
        top = codes[0] if hdr.api_version < 3 and codes else ErrorCode.NONE
        return {"throttle_time_ms": 0, "error_code": top,
                "members": [{"member_id": mid, "group_instance_id": inst, "error_code": code}
                            for (mid, inst), code in zip(who, codes, strict=True)]}

    async def _named(self, topics: list[dict[str, Any]], by_id: bool) -> list[TopicMeta | None]:
        """Each request topic's metadata, found by name or, from OffsetCommit/OffsetFetch
        v10, by topic id; then its name is filled in (empty when the id is unknown)."""
        found = []
        for t in topics:
            meta = await self.topic_by_id(t["topic_id"]) if by_id else await self.topic(t["name"])
            if by_id:
                t["name"] = meta.name if meta else ""
            found.append(meta)
        return found

    async def offset_commit(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        results: dict[tuple[str, int], ErrorCode] = {}
        offsets = {}
        group_ok = self.allowed(hdr, Operation.READ, ResourceType.GROUP, req["group_id"])
        by_id = hdr.api_version >= 10
        for t, meta in zip(req["topics"], await self._named(req["topics"], by_id), strict=True):
            topic_ok = self.allowed(hdr, Operation.READ, ResourceType.TOPIC, t["name"])
            for p in t["partitions"]:
                key = (t["name"], p["partition_index"])
                if meta is None and by_id:
                    results[key] = ErrorCode.UNKNOWN_TOPIC_ID
                    continue
                if not group_ok:
                    results[key] = ErrorCode.GROUP_AUTHORIZATION_FAILED
                    continue
                if not topic_ok:
                    results[key] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
                    continue
                if not has_partition(meta, p["partition_index"]):
                    results[key] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                    continue
                try:
                    offsets[key] = offset_record(p["committed_offset"], p["committed_metadata"],
                                                 p["committed_leader_epoch"])
                    results[key] = ErrorCode.NONE
                except GroupError as exc:
                    results[key] = exc.code
        if offsets:
            try:
                self._mine(hdr, Operation.READ, req["group_id"])
                await self.coord.check_committer(req["group_id"], req.get("generation_id_or_member_epoch", -1),
                                                 req.get("member_id", ""), req.get("group_instance_id"))
                await hdr.turn()
                written = self.coord.queue_offsets(req["group_id"], offsets)
                hdr.placed()
                await written
            except GroupError as exc:
                results.update(dict.fromkeys(offsets, exc.code))
        return {"throttle_time_ms": 0, "topics": [
            {"name": t["name"], "topic_id": t.get("topic_id", bytes(16)),
             "partitions": [{"partition_index": p["partition_index"],
                             "error_code": results[(t["name"], p["partition_index"])]} for p in t["partitions"]]}
            for t in req["topics"]]}

    async def offset_delete(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        """Delete on the group, Read on each topic (as in Kafka)."""
        results: dict[TopicPartition, ErrorCode] = {}
        try:
            self._mine(hdr, Operation.DELETE, req["group_id"])
        except GroupError as exc:
            return {"error_code": exc.code, "throttle_time_ms": 0, "topics": []}
        wanted = []
        for t in req["topics"]:
            meta = await self.topic(t["name"])
            topic_ok = self.allowed(hdr, Operation.READ, ResourceType.TOPIC, t["name"])
            for p in t["partitions"]:
                tp = TopicPartition(t["name"], p["partition_index"])
                if not topic_ok:
                    results[tp] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
                elif not has_partition(meta, tp.partition):
                    results[tp] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                else:
                    wanted.append(tp)
        try:
            results.update(await self.coord.delete_offsets(req["group_id"], wanted))
        except GroupError as exc:
            return {"error_code": exc.code, "throttle_time_ms": 0, "topics": []}
        return {"error_code": 0, "throttle_time_ms": 0, "topics": [
            {"name": t["name"], "partitions": [
                {"partition_index": p["partition_index"], "error_code": results[(t["name"], p["partition_index"])]}
                for p in t["partitions"]]} for t in req["topics"]]}

    async def _fetch_group(self, hdr: RequestContext, group_id: str, topics: list[dict[str, Any]] | None
                           ) -> list[dict[str, Any]]:
        """The group's committed offsets for the topics asked (all it committed when
        None); from v10 topics go by id, and an unknown id answers UNKNOWN_TOPIC_ID."""
        self._mine(hdr, Operation.DESCRIBE, group_id)
        committed = await self.coord.fetch_offsets(group_id)
        by_id = hdr.api_version >= 10
        if topics is None:  # every committed partition the principal may see
            wanted: dict[str, list[int]] = {}
            for t, p in sorted(committed):
                if self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, t):
                    wanted.setdefault(t, []).append(p)
            asked = [{"name": t, "partition_indexes": ps} for t, ps in wanted.items()]
            metas = [await self.topic(t) for t in wanted] if by_id else [None] * len(asked)
        else:
            asked, metas = topics, await self._named(topics, by_id)
        out = []
        for t, meta in zip(asked, metas, strict=True):
            name, rows = t["name"], []
            code = ErrorCode.NONE
            if by_id and meta is None:
                code = ErrorCode.UNKNOWN_TOPIC_ID
            elif not self.allowed(hdr, Operation.DESCRIBE, ResourceType.TOPIC, name):
                code = ErrorCode.TOPIC_AUTHORIZATION_FAILED
            for p in t["partition_indexes"]:
                c = None if code else committed.get((name, p))
                rows.append({"partition_index": p, "committed_offset": c["offset"] if c else -1,
                             "committed_leader_epoch": c["leader_epoch"] if c else -1,
                             "metadata": c["metadata"] if c else "", "error_code": code})
            out.append({"name": name, "partitions": rows})
            if by_id:  # (the v0-v7 topics have no topic_id)
                out[-1]["topic_id"] = meta.id if meta else t["topic_id"]
        return out

    async def offset_fetch(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if hdr.api_version >= 8:
            groups = []
            for g in req["groups"]:
                try:
                    groups.append({"group_id": g["group_id"], "error_code": 0,
                                   "topics": await self._fetch_group(hdr, g["group_id"], g["topics"])})
                except GroupError as exc:
                    groups.append({"group_id": g["group_id"], "error_code": exc.code, "topics": []})
            return {"throttle_time_ms": 0, "groups": groups}
        try:
            return {"throttle_time_ms": 0, "error_code": 0,
                    "topics": await self._fetch_group(hdr, req["group_id"], req["topics"])}
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "topics": []}

    async def describe_groups(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        out = []
        for g in req["groups"]:
            try:
                self._mine(hdr, Operation.DESCRIBE, g)
                desc = await self.coord.describe(g)
                if hdr.api_version >= 6 and desc["group_state"] == DEAD:  # KIP-1043
                    raise GroupError(ErrorCode.GROUP_ID_NOT_FOUND, f"group {g} does not exist")
                if req.get("include_authorized_operations"):
                    desc["authorized_operations"] = authorized_operations(
                        lambda op, gid=g: self.allowed(hdr, op, ResourceType.GROUP, gid), ResourceType.GROUP)
                out.append(desc)
            except GroupError as exc:
                out.append({"error_code": exc.code, "error_message": str(exc), "group_id": g, "group_state": "",
                            "protocol_type": "", "protocol_data": "", "members": []})
        return {"throttle_time_ms": 0, "groups": out}

    async def list_groups(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        states = {s.lower() for s in req.get("states_filter") or []}
        types = {t.lower() for t in req.get("types_filter") or []}
        every = self.allowed(hdr, Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER)
        groups = [{"group_id": gid, "protocol_type": pt, "group_state": st, "group_type": "classic"}
                  for gid, pt, st in await self.coord.list()
                  if self.cluster.coordinator_for(gid) == self.cluster.me
                  and (every or self.allowed(hdr, Operation.DESCRIBE, ResourceType.GROUP, gid))
                  and (not states or st.lower() in states) and (not types or "classic" in types)]
        return {"throttle_time_ms": 0, "error_code": 0, "groups": groups}

    async def delete_groups(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        results = []
        for g in req["groups_names"]:
            try:
                self._mine(hdr, Operation.DELETE, g)
                results.append({"group_id": g, "error_code": await self.coord.delete(g)})
            except GroupError as exc:
                results.append({"group_id": g, "error_code": exc.code})
        return {"throttle_time_ms": 0, "results": results}
