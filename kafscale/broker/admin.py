"""Admin API handlers: CreatePartitions, DescribeConfigs, AlterConfigs,
IncrementalAlterConfigs, OffsetForLeaderEpoch, DescribeCluster, DeleteRecords."""
from __future__ import annotations

from typing import Any

from kafscale.broker.context import RequestContext
from kafscale.broker.partitions import PartitionApi
from kafscale.metadata import topic_config
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from kafscale.security.acl import CLUSTER, Operation, ResourceType
from kafscale.storage.partition import LogError

RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4
SOURCE_TOPIC, SOURCE_DYNAMIC_DEFAULT_BROKER, SOURCE_STATIC_BROKER, SOURCE_DEFAULT = 1, 3, 4, 5
OP_SET, OP_DELETE, OP_APPEND, OP_SUBTRACT = 0, 1, 2, 3
MAX_PARTITIONS = 10000


class AdminApi(PartitionApi):
    ROUTES = {
        schemas.CREATE_PARTITIONS.key: "create_partitions",
        schemas.DESCRIBE_CONFIGS.key: "describe_configs",
        schemas.ALTER_CONFIGS.key: "alter_configs",
        schemas.INCREMENTAL_ALTER_CONFIGS.key: "incremental_alter_configs",
        schemas.OFFSET_FOR_LEADER_EPOCH.key: "offset_for_leader_epoch",
        schemas.DESCRIBE_CLUSTER.key: "describe_cluster",
        schemas.DELETE_RECORDS.key: "delete_records",
    }

    async def create_partitions(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        results = []
        for t in req["topics"]:
            r = {"name": t["name"], "error_code": 0, "error_message": None}
            results.append(r)
            meta = await self.partitions.topic(t["name"])
            if not self.access.allowed(hdr, Operation.ALTER, ResourceType.TOPIC, t["name"]):
                r["error_code"] = ErrorCode.TOPIC_AUTHORIZATION_FAILED
            elif meta is None:
                r["error_code"] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
            elif t["count"] <= meta.partitions or t["count"] > MAX_PARTITIONS:
                r["error_code"] = ErrorCode.INVALID_PARTITIONS
                r["error_message"] = f"topic has {meta.partitions} partitions; the new count must be larger " \
                                     f"(and at most {MAX_PARTITIONS})"
            elif t["assignments"] and len(t["assignments"]) != t["count"] - meta.partitions:
                r["error_code"] = ErrorCode.INVALID_REPLICA_ASSIGNMENT
                r["error_message"] = f"the assignment names {len(t['assignments'])} new partitions, not " \
                                     f"{t['count'] - meta.partitions}"
            elif t["assignments"] and self.assignment_error([a["broker_ids"] for a in t["assignments"]]):
                r["error_code"] = ErrorCode.INVALID_REPLICA_ASSIGNMENT
                r["error_message"] = self.assignment_error([a["broker_ids"] for a in t["assignments"]])
            elif not req["validate_only"]:
                self.partitions.topics.put(await self.meta.update_topic(meta.name, partitions=t["count"]))
        return {"throttle_time_ms": 0, "results": results}

    # ---------------------------------------------------------------- configs
    async def describe_configs(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        results = []
        for res in req["resources"]:
            r: dict[str, Any] = {"error_code": 0, "error_message": None, "resource_type": res["resource_type"],
                                 "resource_name": res["resource_name"], "configs": []}
            results.append(r)
            keys = res["configuration_keys"]
            refused = self._refused(hdr, Operation.DESCRIBE_CONFIGS, res)
            if refused:
                r["error_code"], r["error_message"] = refused
            elif res["resource_type"] == RESOURCE_TOPIC:
                meta = await self.partitions.topic(res["resource_name"])
                if meta is None:
                    r["error_code"] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                    r["error_message"] = f"unknown topic {res['resource_name']}"
                    continue
                for name, (value, is_default) in topic_config.effective(meta.config, self.partitions.defaults).items():
                    if keys is None or name in keys:
                        d = topic_config.TOPIC_CONFIGS[name]
                        r["configs"].append(self._entry(name, value, is_default, False, d.type, d.doc,
                                                        SOURCE_DEFAULT if is_default else SOURCE_TOPIC))
            elif res["resource_type"] == RESOURCE_BROKER:
                dynamic = self.partitions.defaults.dynamic
                for name, value in self._broker_configs().items():
                    if keys is None or name in keys:
                        d = topic_config.DYNAMIC_BROKER_CONFIGS.get(name)
                        source = SOURCE_DYNAMIC_DEFAULT_BROKER if name in dynamic else SOURCE_STATIC_BROKER
                        r["configs"].append(self._entry(name, value, False, d is None, d.type if d else
                                                        topic_config.STRING, d.doc if d else None, source))
            else:
                r["error_code"] = ErrorCode.INVALID_REQUEST
                r["error_message"] = f"resource type {res['resource_type']} is not supported"
        return {"throttle_time_ms": 0, "results": results}

    @staticmethod
    def _entry(name: str, value: str, is_default: bool, read_only: bool, ctype: int, doc: str | None,
               source: int) -> dict[str, Any]:
        return {"name": name, "value": value, "read_only": read_only, "is_default": is_default,
                "config_source": source, "is_sensitive": False, "synonyms": [], "config_type": ctype,
                "documentation": doc}

    def _broker_configs(self) -> dict[str, str]:
        cfg = self.cfg
        host, port = cfg.advertised_addr()
        return {"broker.id": str(cfg.node_id), "auto.create.topics.enable": str(cfg.auto_create_topics).lower(),
                "socket.request.max.bytes": str(cfg.max_request_bytes),
                "group.initial.rebalance.delay.ms": str(cfg.group_initial_rebalance_delay_ms),
                "advertised.listeners": f"{'SSL' if cfg.tls_cert else 'PLAINTEXT'}://{host}:{port}",
                "default.replication.factor": "1", "min.insync.replicas": "1",
                "log.dirs": f"s3://{cfg.bucket}/{cfg.namespace}",
                **{name: self.partitions.defaults.broker(name) for name in topic_config.DYNAMIC_BROKER_CONFIGS}}

    async def alter_configs(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        """Non-incremental: the given set replaces the topic's configs."""
        return await self._alter(hdr, req, lambda current, configs: {c["name"]: c["value"] for c in configs})

    async def incremental_alter_configs(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        def apply(current: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str]:
            out = dict(current)
            for c in configs:
                op = c["config_operation"]
                if op == OP_SET:
                    out[c["name"]] = c["value"]
                elif op == OP_DELETE:
                    out.pop(c["name"], None)
                elif op in (OP_APPEND, OP_SUBTRACT) and c["name"] == "cleanup.policy":
                    items = [x for x in out.get(c["name"], "delete").split(",") if x]
                    items = [*items, c["value"]] if op == OP_APPEND else [x for x in items if x != c["value"]]
                    out[c["name"]] = ",".join(dict.fromkeys(items))
                else:
                    raise LogError(ErrorCode.INVALID_CONFIG, f"operation {op} is not valid for {c['name']}")
            return out
        return await self._alter(hdr, req, apply)

    def _refused(self, hdr: RequestContext, op: Operation, res: dict[str, Any]) -> tuple[ErrorCode, str] | None:
        """The error for a config resource this principal may not use (None: allowed)."""
        if res["resource_type"] == RESOURCE_BROKER:
            if not self.access.allowed(hdr, op, ResourceType.CLUSTER, CLUSTER):
                return ErrorCode.CLUSTER_AUTHORIZATION_FAILED, f"{hdr.principal} may not {op.name} the cluster"
        elif res["resource_type"] == RESOURCE_TOPIC and not self.access.allowed(hdr, op, ResourceType.TOPIC,
                                                                                 res["resource_name"]):
            return ErrorCode.TOPIC_AUTHORIZATION_FAILED, f"{hdr.principal} may not {op.name} this topic"
        return None

    async def _alter(self, hdr: RequestContext, req: dict[str, Any], apply: Any) -> dict[str, Any]:
        out = []
        for res in req["resources"]:
            r = {"error_code": 0, "error_message": None, "resource_type": res["resource_type"],
                 "resource_name": res["resource_name"]}
            out.append(r)
            refused = self._refused(hdr, Operation.ALTER_CONFIGS, res)
            if refused:
                r["error_code"], r["error_message"] = refused
                continue
            if res["resource_type"] == RESOURCE_BROKER:
                r["error_code"], r["error_message"] = await self._alter_brokers(res, apply, req["validate_only"])
                continue
            if res["resource_type"] != RESOURCE_TOPIC:
                r["error_code"] = ErrorCode.INVALID_REQUEST
                r["error_message"] = f"resource type {res['resource_type']} has no configs to alter"
                continue
            meta = await self.partitions.topic(res["resource_name"])
            if meta is None:
                r["error_code"] = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                continue
            try:
                new = apply(meta.config, res["configs"])
            except LogError as exc:
                r["error_code"], r["error_message"] = exc.code, str(exc)
                continue
            err = topic_config.validate(new)
            if err:
                r["error_code"], r["error_message"] = ErrorCode.INVALID_CONFIG, err
            elif not req["validate_only"]:
                await self.partitions.apply_topic_meta(await self.meta.update_topic(meta.name, config=new))
        return {"throttle_time_ms": 0, "responses": out}

    async def _alter_brokers(self, res: dict[str, Any], apply: Any, validate_only: bool
                             ) -> tuple[ErrorCode, str | None]:
        """KafScale brokers share one configuration: a change to the cluster
        default (an empty broker name) or to any live broker applies to every
        broker, through etcd."""
        name = res["resource_name"]
        if name and name not in {str(b) for b, _, _ in await self.meta.list_brokers()}:
            return ErrorCode.INVALID_REQUEST, f"no live broker {name!r} (an empty name is the cluster default)"

        def change(current: dict[str, str]) -> dict[str, str]:
            new = apply(current, res["configs"])
            for k, v in new.items():
                err = topic_config.broker_config_error(k, v)
                if err:
                    raise LogError(ErrorCode.INVALID_CONFIG, err)
            return new
        try:
            if validate_only:
                change(await self.meta.cluster_configs())
            else:
                await self.meta.update_cluster_configs(change)
                await self.partitions.refresh_defaults()
        except LogError as exc:
            return exc.code, str(exc)
        return ErrorCode.NONE, None

    # ------------------------------------------------------------ the rest
    async def offset_for_leader_epoch(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        """Every batch is written with leader epoch 0, so epoch 0 ends at the
        high watermark; a client on a newer epoch is ahead of us."""
        topics = []
        for t in req["topics"]:
            meta = await self.partitions.topic(t["topic"])
            parts = []
            for p in t["partitions"]:
                r = {"error_code": 0, "partition": p["partition"], "leader_epoch": -1, "end_offset": -1}
                parts.append(r)
                r["error_code"] = self.partition_refusal(hdr, Operation.DESCRIBE, t["topic"], meta, p["partition"])
                if r["error_code"] or meta is None:
                    continue
                if p["current_leader_epoch"] > 0:
                    r["error_code"] = ErrorCode.UNKNOWN_LEADER_EPOCH
                    continue
                try:
                    lg = await self.partitions.partition_log(meta.name, p["partition"])
                except LogError as exc:
                    r["error_code"] = exc.code
                    continue
                if p["leader_epoch"] >= 0:
                    r["leader_epoch"], r["end_offset"] = 0, lg.hw
            topics.append({"topic": t["topic"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    async def delete_records(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        """Move each partition's log start offset up to the given offset (-1:
        the high watermark), fenced like a commit; whole segments before it are
        deleted, and nothing before it is served again."""
        topics = []
        for t in req["topics"]:
            meta = await self.partitions.topic(t["name"])
            parts = []
            for p in t["partitions"]:
                r = {"partition_index": p["partition_index"], "low_watermark": -1, "error_code": 0}
                parts.append(r)
                r["error_code"] = self.partition_refusal(hdr, Operation.DELETE, t["name"], meta, p["partition_index"])
                if r["error_code"] or meta is None:
                    continue
                try:
                    lg = await self.partitions.partition_log(meta.name, p["partition_index"])
                    before = lg.hw if p["offset"] == -1 else p["offset"]
                    if not 0 <= before <= lg.hw:
                        raise LogError(ErrorCode.OFFSET_OUT_OF_RANGE, f"offset {before} beyond the high watermark")
                    r["low_watermark"] = await lg.delete_records(before)
                except LogError as exc:
                    r["error_code"] = exc.code
            topics.append({"name": t["name"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    async def describe_cluster(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if not self.access.allowed(hdr, Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER):
            return {"throttle_time_ms": 0, "error_code": ErrorCode.CLUSTER_AUTHORIZATION_FAILED,
                    "error_message": f"{hdr.principal} may not describe the cluster", "cluster_id": "",
                    "brokers": []}
        brokers = await self.meta.list_brokers()
        resp = {"throttle_time_ms": 0, "error_code": 0, "cluster_id": self.cfg.cluster,
                "controller_id": self.cfg.node_id,
                "brokers": [{"broker_id": b, "host": h, "port": p, "rack": None, "is_fenced": False}
                            for b, h, p in brokers]}
        if req.get("include_cluster_authorized_operations"):
            resp["cluster_authorized_operations"] = self.access.operations(hdr, ResourceType.CLUSTER, CLUSTER)
        return resp
