"""SCRAM users through Kafka's admin APIs: DescribeUserScramCredentials and
AlterUserScramCredentials, over the same etcd records `kafscale users` writes
(`users/{name}`: one credential per mechanism, never the password). Describe
needs Describe on the cluster, Alter needs Alter. PLAIN checks passwords
against the SCRAM-SHA-256 credential, so a user given only SCRAM-SHA-512
signs in with SCRAM-SHA-512 only."""
from __future__ import annotations

from collections import Counter
from typing import Any

from kafscale.broker.access import Access
from kafscale.broker.context import RequestContext
from kafscale.metadata.store import MetaStore
from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from kafscale.security.acl import CLUSTER, Operation, ResourceType
from kafscale.security.sasl import MIN_ITERATIONS, ScramCredential

MECHANISM_CODES = {1: "SCRAM-SHA-256", 2: "SCRAM-SHA-512"}  # Kafka's ScramMechanism ids
MAX_ITERATIONS = 16384  # as Kafka


class UserApi:
    def __init__(self, meta: MetaStore, access: Access) -> None:
        self.meta = meta
        self.access = access
        self.handlers = {
            schemas.DESCRIBE_USER_SCRAM_CREDENTIALS.key: self.describe,
            schemas.ALTER_USER_SCRAM_CREDENTIALS.key: self.alter,
        }

    async def describe(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if not self.access.allowed(hdr, Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER):
            return {"throttle_time_ms": 0, "error_code": ErrorCode.CLUSTER_AUTHORIZATION_FAILED,
                    "error_message": f"{hdr.principal} may not describe users", "results": []}
        names = [u["name"] for u in req["users"]] if req["users"] is not None else await self.meta.list_users()
        codes = {v: k for k, v in MECHANISM_CODES.items()}
        twice = {n for n, c in Counter(names).items() if c > 1}
        results = []
        for name in dict.fromkeys(names):
            stored = None if name in twice else await self.meta.get_user(name)
            r: dict[str, Any] = {"user": name, "error_code": 0, "error_message": None, "credential_infos": []}
            if name in twice:
                r["error_code"], r["error_message"] = ErrorCode.DUPLICATE_RESOURCE, f"user {name} named twice"
            elif not stored:
                r["error_code"], r["error_message"] = ErrorCode.RESOURCE_NOT_FOUND, f"no credentials for {name}"
            else:
                r["credential_infos"] = [{"mechanism": codes[m], "iterations": int(c["iterations"])}
                                         for m, c in sorted(stored.items()) if m in codes]
            results.append(r)
        return {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "results": results}

    async def alter(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        changes = [(d["name"], d["mechanism"], None) for d in req["deletions"]]
        changes += [(u["name"], u["mechanism"], u) for u in req["upsertions"]]
        may = self.access.allowed(hdr, Operation.ALTER, ResourceType.CLUSTER, CLUSTER)
        twice = {n for n, c in Counter((n, m) for n, m, _ in changes).items() if c > 1}
        errors: dict[str, tuple[ErrorCode, str]] = {}
        for name, mechanism, up in changes:
            if not may:
                errors[name] = (ErrorCode.CLUSTER_AUTHORIZATION_FAILED, f"{hdr.principal} may not alter users")
            elif (name, mechanism) in twice:
                errors[name] = (ErrorCode.DUPLICATE_RESOURCE, f"{name}: one change per mechanism")
            elif mechanism not in MECHANISM_CODES:
                errors[name] = (ErrorCode.UNSUPPORTED_SASL_MECHANISM, f"mechanism {mechanism} is not SCRAM")
            elif not name:
                errors[name] = (ErrorCode.UNACCEPTABLE_CREDENTIAL, "the user name is empty")
            elif up is not None and not MIN_ITERATIONS <= up["iterations"] <= MAX_ITERATIONS:
                errors[name] = (ErrorCode.UNACCEPTABLE_CREDENTIAL,
                                f"iterations must be {MIN_ITERATIONS} to {MAX_ITERATIONS}")
        for name in dict.fromkeys(n for n, _, _ in changes if n not in errors):
            stored = dict(await self.meta.get_user(name) or {})
            for n, mechanism, up in changes:
                if n != name:
                    continue
                m = MECHANISM_CODES[mechanism]
                if up is None:
                    if m not in stored:
                        errors[name] = (ErrorCode.RESOURCE_NOT_FOUND, f"{name} has no {m} credential")
                        break
                    del stored[m]
                else:
                    stored[m] = ScramCredential.from_salted_password(
                        m, bytes(up["salt"]), bytes(up["salted_password"]), up["iterations"]).to_json()
            if name in errors:
                continue
            if stored:
                await self.meta.put_user(name, stored)
            else:
                await self.meta.delete_user(name)
        names = dict.fromkeys(n for n, _, _ in changes)
        return {"throttle_time_ms": 0, "results": [
            {"user": n, "error_code": errors.get(n, (0, None))[0], "error_message": errors.get(n, (0, None))[1]}
            for n in names]}
