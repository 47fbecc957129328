"""The replication-related admin APIs, answered for brokers that keep no
replicas (S3 keeps each partition's one copy; the live brokers share the
partitions by hashing, one owner at a time):

- DescribeLogDirs: one log dir per broker, named after the bucket and
  namespace, holding the partitions this broker serves, sized from their
  segment manifests in etcd;
- ListPartitionReassignments: none is ever in progress;
- AlterPartitionReassignments: refused per partition with
  INVALID_REPLICA_ASSIGNMENT and the reason (cancelling: none in progress);
- ElectLeaders: every partition already has its one leader
  (ELECTION_NOT_NEEDED).

Describe on the cluster for the first two, Alter for the others, as in Kafka."""
from __future__ import annotations

from typing import Any

from kafscale.broker.context import RequestContext
from kafscale.broker.partitions import PartitionApi
from kafscale.metadata.store import has_partition
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from kafscale.security.acl import CLUSTER, Operation, ResourceType

NO_REPLICAS = ("KafScale keeps no replicas to move: S3 holds each partition's one copy, and the live brokers "
               "share the partitions by hashing (drain a broker to move its partitions)")


class ReplicaApi(PartitionApi):
    ROUTES = {
        schemas.DESCRIBE_LOG_DIRS.key: "describe_log_dirs",
        schemas.LIST_PARTITION_REASSIGNMENTS.key: "list_reassignments",
        schemas.ALTER_PARTITION_REASSIGNMENTS.key: "alter_reassignments",
        schemas.ELECT_LEADERS.key: "elect_leaders",
    }

    def _cluster_refusal(self, hdr: RequestContext, op: Operation) -> ErrorCode:
        ok = self.access.allowed(hdr, op, ResourceType.CLUSTER, CLUSTER)
        return ErrorCode.NONE if ok else ErrorCode.CLUSTER_AUTHORIZATION_FAILED

    async def describe_log_dirs(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refusal = self._cluster_refusal(hdr, Operation.DESCRIBE)
        if refusal:
            return {"throttle_time_ms": 0, "error_code": refusal, "results": []}
        cluster, me = self.partitions.cluster, self.cfg.node_id
        sizes = await self.meta.segment_bytes()
        if req["topics"] is None:
            wanted = {t.name: range(t.partitions) for t in await self.meta.list_topics()}
        else:
            wanted = {}
            for t in req["topics"]:
                meta = await self.partitions.topic(t["topic"])
                if meta is not None:
                    wanted[meta.name] = [p for p in t["partitions"] if has_partition(meta, p)]
        topics = []
        for name, parts in sorted(wanted.items()):
            mine = [p for p in parts if cluster.leader(name, p) == me]
            if mine:
                topics.append({"name": name, "partitions": [
                    {"partition_index": p, "partition_size": self.partitions.log_bytes(name, p, sizes), "offset_lag": 0,
                     "is_future_key": False} for p in mine]})
        log_dir = f"s3://{self.cfg.bucket}/{self.cfg.namespace}"
        return {"throttle_time_ms": 0, "error_code": 0, "results": [
            {"error_code": 0, "log_dir": log_dir, "topics": topics, "total_bytes": -1, "usable_bytes": -1,
             "is_cordoned": False}]}

    async def list_reassignments(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refusal = self._cluster_refusal(hdr, Operation.DESCRIBE)
        return {"throttle_time_ms": 0, "error_code": refusal, "error_message": None, "topics": []}

    async def alter_reassignments(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refusal = self._cluster_refusal(hdr, Operation.ALTER)
        if refusal:
            return {"throttle_time_ms": 0, "error_code": refusal, "error_message": None, "responses": []}
        responses = []
        for t in req["topics"]:
            meta = await self.partitions.topic(t["name"])
            parts = []
            for p in t["partitions"]:
                if not has_partition(meta, p["partition_index"]):
                    code, why = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, None
                elif p["replicas"] is None:
                    code, why = ErrorCode.NO_REASSIGNMENT_IN_PROGRESS, "no reassignment is ever in progress"
                else:
                    code, why = ErrorCode.INVALID_REPLICA_ASSIGNMENT, NO_REPLICAS
                parts.append({"partition_index": p["partition_index"], "error_code": code, "error_message": why})
            responses.append({"name": t["name"], "partitions": parts})
        return {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "responses": responses}

    async def elect_leaders(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refusal = self._cluster_refusal(hdr, Operation.ALTER)
        if refusal:
            return {"throttle_time_ms": 0, "error_code": refusal, "replica_election_results": []}
        results = []
        for t in req["topic_partitions"] or []:  # null: every partition, none of which needs an election
            meta = await self.partitions.topic(t["topic"])
            results.append({"topic": t["topic"], "partition_result": [
                {"partition_id": p, "error_code": ErrorCode.ELECTION_NOT_NEEDED if has_partition(meta, p)
                 else ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, "error_message": None} for p in t["partitions"]]})
        return {"throttle_time_ms": 0, "error_code": 0, "replica_election_results": results}
