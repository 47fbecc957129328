"""The ACL APIs: DescribeAcls, CreateAcls, DeleteAcls over the bindings in
etcd. Describing needs Describe on the cluster, changing needs Alter; a
broker without `--authorizer` answers SECURITY_DISABLED, as Kafka does."""
from __future__ import annotations

from itertools import groupby
from typing import Any

from kafscale.broker.access import Access
from kafscale.broker.context import RequestContext
from kafscale.metadata.store import MetaStore
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from kafscale.security.acl import CLUSTER, AclBinding, Operation, ResourceType, invalid_filter


class AclApi:
    def __init__(self, meta: MetaStore, access: Access) -> None:
        self.meta = meta
        self.access = access
        self.handlers = {
            schemas.DESCRIBE_ACLS.key: self.describe_acls,
            schemas.CREATE_ACLS.key: self.create_acls,
            schemas.DELETE_ACLS.key: self.delete_acls,
        }

    def _refused(self, hdr: RequestContext, op: Operation) -> tuple[ErrorCode, str] | None:
        if not self.access.enabled:
            return ErrorCode.SECURITY_DISABLED, "no authorizer is configured on this broker (--authorizer)"
        if not self.access.allowed(hdr, op, ResourceType.CLUSTER, CLUSTER):
            return ErrorCode.CLUSTER_AUTHORIZATION_FAILED, f"{hdr.principal} may not {op.name} ACLs"
        return None

    async def describe_acls(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refused = self._refused(hdr, Operation.DESCRIBE) or (
            (ErrorCode.INVALID_REQUEST, bad) if (bad := invalid_filter(req)) else None)
        if refused:
            return {"throttle_time_ms": 0, "error_code": refused[0], "error_message": refused[1], "resources": []}
        matching = [a for a in await self.meta.list_acls() if a.matches_filter(req)]

        def resource(a: AclBinding) -> tuple[int, str, int]:
            return a.resource_type, a.resource_name, a.pattern_type

        resources = [{"resource_type": rtype, "resource_name": name, "pattern_type": pattern,
                      "acls": [{"principal": a.principal, "host": a.host, "operation": a.operation,
                                "permission_type": a.permission} for a in acls]}
                     for (rtype, name, pattern), acls in groupby(sorted(matching, key=resource), key=resource)]
        return {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "resources": resources}

    async def create_acls(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refused = self._refused(hdr, Operation.ALTER)
        results, new = [], []
        for c in req["creations"]:
            acl = AclBinding(c["resource_type"], c["resource_name"], c["resource_pattern_type"], c["principal"],
                             c["host"], c["operation"], c["permission_type"])
            bad = refused or ((ErrorCode.INVALID_REQUEST, why) if (why := acl.invalid()) else None)
            results.append({"error_code": bad[0] if bad else 0, "error_message": bad[1] if bad else None})
            if not bad:
                new.append(acl)
        if new:
            await self.meta.put_acls(new)
            await self.access.refresh()
        return {"throttle_time_ms": 0, "results": results}

    async def delete_acls(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        refused = self._refused(hdr, Operation.ALTER)
        existing = [] if refused else await self.meta.list_acls()
        out, gone = [], []
        for f in req["filters"]:
            bad = refused or ((ErrorCode.INVALID_REQUEST, why) if (why := invalid_filter(f)) else None)
            if bad:
                out.append({"error_code": bad[0], "error_message": bad[1], "matching_acls": []})
                continue
            matched = [a for a in existing if a.matches_filter(f)]
            gone += matched
            out.append({"error_code": 0, "error_message": None, "matching_acls": [
                {"error_code": 0, "error_message": None, "resource_type": a.resource_type,
                 "resource_name": a.resource_name, "pattern_type": a.pattern_type, "principal": a.principal,
                 "host": a.host, "operation": a.operation, "permission_type": a.permission} for a in matched]})
        if gone:
            await self.meta.delete_acls(list(dict.fromkeys(gone)))
            await self.access.refresh()
        return {"throttle_time_ms": 0, "filter_results": out}
