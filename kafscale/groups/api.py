"""Kafka request handlers for the group APIs, over GroupCoordinator."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kafscale.groups.coordinator import GroupCoordinator, GroupError, offset_record
from kafscale.metadata.store import TopicMeta
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import RequestHeader

KEY_TYPE_GROUP = 0


class GroupApi:
    def __init__(self, coordinator: GroupCoordinator, address: Callable[[], tuple[int, str, int]],
                 topic: Callable[[str], Awaitable[TopicMeta | None]]) -> None:
        self.coord = coordinator
        self.address = address  # (node id, host, port) of the coordinator: this broker
        self.topic = topic
        self.handlers = {
            schemas.FIND_COORDINATOR.key: self.find_coordinator,
            schemas.JOIN_GROUP.key: self.join_group,
            schemas.SYNC_GROUP.key: self.sync_group,
            schemas.HEARTBEAT.key: self.heartbeat,
            schemas.LEAVE_GROUP.key: self.leave_group,
            schemas.OFFSET_COMMIT.key: self.offset_commit,
            schemas.OFFSET_FETCH.key: self.offset_fetch,
            schemas.DESCRIBE_GROUPS.key: self.describe_groups,
            schemas.LIST_GROUPS.key: self.list_groups,
            schemas.DELETE_GROUPS.key: self.delete_groups,
        }

    async def find_coordinator(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        node, host, port = self.address()
        keys = req["coordinator_keys"] if hdr.api_version >= 4 else [req["key"]]
        found = []
        for key in keys:
            if req["key_type"] != KEY_TYPE_GROUP:
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.COORDINATOR_NOT_AVAILABLE,
                              "error_message": "transactions are not supported"})
            elif not key:
                found.append({"key": key, "node_id": -1, "host": "", "port": -1,
                              "error_code": ErrorCode.INVALID_GROUP_ID, "error_message": "empty group id"})
            else:
                found.append({"key": key, "node_id": node, "host": host, "port": port, "error_code": 0,
                              "error_message": None})
        first = found[0] if found else {"node_id": -1, "host": "", "port": -1, "error_code": 0,
                                        "error_message": None}
        return {"throttle_time_ms": 0, "error_code": first["error_code"], "error_message": first["error_message"],
                "node_id": first["node_id"], "host": first["host"], "port": first["port"], "coordinators": found}

    async def join_group(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.coord.join(req, hdr.api_version, hdr.client_id or "", hdr.client_host)
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "generation_id": -1, "protocol_type": None,
                    "protocol_name": None, "leader": "", "member_id": req["member_id"], "members": []}

    async def sync_group(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.coord.sync(req)
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code, "assignment": b""}

    async def heartbeat(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        try:
            await self.coord.heartbeat(req)
            return {"throttle_time_ms": 0, "error_code": 0}
        except GroupError as exc:
            return {"throttle_time_ms": 0, "error_code": exc.code}

    async def leave_group(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        if hdr.api_version >= 3:
            who = [(m["member_id"], m["group_instance_id"]) for m in req["members"]]
        else:
            who = [(req["member_id"], None)]
        codes = await self.coord.leave(req["group_id"], who)
        top = codes[0] if hdr.api_version < 3 and codes else ErrorCode.NONE
        return {"throttle_time_ms": 0, "error_code": top,
                "members": [{"member_id": mid, "group_instance_id": inst, "error_code": code}
                            for (mid, inst), code in zip(who, codes, strict=True)]}

    async def offset_commit(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        results: dict[tuple[str, int], ErrorCode] = {}
        offsets = {}
        for t in req["topics"]:
            meta = await self.topic(t["name"])
            for p in t["partitions"]:
                key = (t["name"], p["partition_index"])
                if meta is None or not 0 <= p["partition_index"] < meta.partitions:
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
                await self.coord.commit_offsets(req["group_id"], req.get("generation_id_or_member_epoch", -1),
                                                req.get("member_id", ""), req.get("group_instance_id"), offsets)
            except GroupError as exc:
                results.update(dict.fromkeys(offsets, exc.code))
        return {"throttle_time_ms": 0, "topics": [
            {"name": t["name"], "partitions": [{"partition_index": p["partition_index"],
                                                "error_code": results[(t["name"], p["partition_index"])]}
                                               for p in t["partitions"]]} for t in req["topics"]]}

    async def _fetch_group(self, group_id: str, topics: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        committed = await self.coord.fetch_offsets(group_id)
        if topics is None:
            wanted: dict[str, list[int]] = {}
            for t, p in sorted(committed):
                wanted.setdefault(t, []).append(p)
        else:
            wanted = {t["name"]: t["partition_indexes"] for t in topics}
        out = []
        for name, parts in wanted.items():
            rows = []
            for p in parts:
                c = committed.get((name, p))
                rows.append({"partition_index": p, "committed_offset": c["offset"] if c else -1,
                             "committed_leader_epoch": c["leader_epoch"] if c else -1,
                             "metadata": c["metadata"] if c else "", "error_code": 0})
            out.append({"name": name, "partitions": rows})
        return out

    async def offset_fetch(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        if hdr.api_version >= 8:
            groups = [{"group_id": g["group_id"], "topics": await self._fetch_group(g["group_id"], g["topics"]),
                       "error_code": 0} for g in req["groups"]]
            return {"throttle_time_ms": 0, "groups": groups}
        return {"throttle_time_ms": 0, "error_code": 0,
                "topics": await self._fetch_group(req["group_id"], req["topics"])}

    async def describe_groups(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        return {"throttle_time_ms": 0, "groups": [await self.coord.describe(g) for g in req["groups"]]}

    async def list_groups(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        states = {s.lower() for s in req.get("states_filter") or []}
        types = {t.lower() for t in req.get("types_filter") or []}
        groups = [{"group_id": gid, "protocol_type": pt, "group_state": st, "group_type": "classic"}
                  for gid, pt, st in await self.coord.list()
                  if (not states or st.lower() in states) and (not types or "classic" in types)]
        return {"throttle_time_ms": 0, "error_code": 0, "groups": groups}

    async def delete_groups(self, hdr: RequestHeader, req: dict[str, Any]) -> dict[str, Any]:
        return {"throttle_time_ms": 0, "results": [{"group_id": g, "error_code": await self.coord.delete(g)}
                                                   for g in req["groups_names"]]}
