"""ACLs with Kafka's semantics (the codes of Kafka's ACL APIs), kept in etcd
under `acls/{id}` and evaluated in every broker process.

A request is allowed when the principal is a super user, or no DENY binding
matches and an ALLOW binding matches (for the operation, ALL, or an operation
that implies it: Read, Write, Delete and Alter imply Describe; AlterConfigs
implies DescribeConfigs). A resource that no binding names at all is allowed
only with `allow_everyone_if_no_acl_found`: deny by default, as in Kafka."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any


class ResourceType(IntEnum):
    UNKNOWN = 0
    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5
    DELEGATION_TOKEN = 6
    USER = 7


class PatternType(IntEnum):
    UNKNOWN = 0
    ANY = 1
    MATCH = 2
    LITERAL = 3
    PREFIXED = 4


class Operation(IntEnum):
    UNKNOWN = 0
    ANY = 1
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12


class Permission(IntEnum):
    UNKNOWN = 0
    ANY = 1
    DENY = 2
    ALLOW = 3


CLUSTER = "kafka-cluster"  # the one cluster resource's name

# The operations each resource type supports, as Kafka reports them in
# authorized_operations (Metadata, DescribeCluster, DescribeGroups).
SUPPORTED_OPERATIONS = {
    ResourceType.TOPIC: (Operation.READ, Operation.WRITE, Operation.CREATE, Operation.DELETE, Operation.ALTER,
                         Operation.DESCRIBE, Operation.DESCRIBE_CONFIGS, Operation.ALTER_CONFIGS),
    ResourceType.CLUSTER: (Operation.CREATE, Operation.ALTER, Operation.DESCRIBE, Operation.CLUSTER_ACTION,
                           Operation.DESCRIBE_CONFIGS, Operation.ALTER_CONFIGS, Operation.IDEMPOTENT_WRITE),
    ResourceType.GROUP: (Operation.READ, Operation.DESCRIBE, Operation.DELETE),
}


def authorized_operations(allowed: Callable[[Operation], bool], rtype: ResourceType) -> int:
    """Kafka's authorized_operations bit field: bit op set for each supported
    operation the principal may do on the resource."""
    return sum(1 << op for op in SUPPORTED_OPERATIONS[rtype] if allowed(op))
WILDCARD = "*"
_IMPLIED = {Operation.DESCRIBE: {Operation.READ, Operation.WRITE, Operation.DELETE, Operation.ALTER},
            Operation.DESCRIBE_CONFIGS: {Operation.ALTER_CONFIGS}}
_CONCRETE_TYPES = (ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER)


@dataclass(frozen=True, order=True)
class AclBinding:
    resource_type: int
    resource_name: str
    pattern_type: int
    principal: str
    host: str
    operation: int
    permission: int

    @property
    def id(self) -> str:
        """A stable etcd key for this binding (the same binding is stored once)."""
        return hashlib.sha256(self.to_json()).hexdigest()[:32]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> AclBinding:
        return cls(**json.loads(raw))

    def invalid(self) -> str | None:
        """Why this binding cannot be created (None: it can)."""
        if self.resource_type not in _CONCRETE_TYPES:
            return f"resource type {self.resource_type} is not supported (topic, group, cluster)"
        if self.pattern_type not in (PatternType.LITERAL, PatternType.PREFIXED):
            return "pattern type must be LITERAL or PREFIXED"
        if not self.resource_name:
            return "resource name must not be empty"
        if self.resource_type == ResourceType.CLUSTER and self.resource_name != CLUSTER:
            return f"the cluster resource is named {CLUSTER}"
        if self.operation in (Operation.UNKNOWN, Operation.ANY) or self.operation not in list(Operation):
            return f"operation {self.operation} is not a concrete operation"
        if self.permission not in (Permission.ALLOW, Permission.DENY):
            return "permission must be ALLOW or DENY"
        kind, _, name = self.principal.partition(":")
        if kind != "User" or not name:
            return f"principal {self.principal!r} must look like User:NAME (or User:*)"
        if not self.host:
            return "host must be an address or *"
        return None

    def covers(self, rtype: int, name: str) -> bool:
        """Does this binding's resource pattern match this concrete resource?"""
        if self.resource_type != rtype:
            return False
        if self.pattern_type == PatternType.PREFIXED:
            return name.startswith(self.resource_name)
        return self.resource_name in (name, WILDCARD)

    def matches_filter(self, f: dict[str, Any]) -> bool:
        """Kafka's AclBindingFilter (DescribeAcls, DeleteAcls): ANY and null match all."""
        if f["resource_type_filter"] not in (ResourceType.ANY, self.resource_type):
            return False
        pattern, name = f["pattern_type_filter"], f["resource_name_filter"]
        if pattern == PatternType.MATCH:  # every binding that would apply to that resource name
            resource_ok = name is None or self.covers(self.resource_type, name)
        else:
            resource_ok = (pattern in (PatternType.ANY, self.pattern_type)
                           and name in (None, self.resource_name))
        return (resource_ok and f["principal_filter"] in (None, self.principal)
                and f["host_filter"] in (None, self.host)
                and f["operation"] in (Operation.ANY, self.operation)
                and f["permission_type"] in (Permission.ANY, self.permission))


def invalid_filter(f: dict[str, Any]) -> str | None:
    """Why a DescribeAcls/DeleteAcls filter can match nothing sensible (None: fine)."""
    if f["resource_type_filter"] == ResourceType.UNKNOWN or f["pattern_type_filter"] == PatternType.UNKNOWN:
        return "the filter has an unknown resource or pattern type"
    if f["operation"] == Operation.UNKNOWN or f["permission_type"] == Permission.UNKNOWN:
        return "the filter has an unknown operation or permission"
    return None


class Authorizer:
    """Decides requests from the ACLs it was last given (see `update`)."""

    def __init__(self, enabled: bool, super_users: str = "", allow_if_no_acl: bool = False) -> None:
        self.enabled = enabled
        self.super_users = {u.strip() for u in super_users.split(";") if u.strip()}
        self.allow_if_no_acl = allow_if_no_acl
        self.acls: list[AclBinding] = []

    def update(self, acls: Iterable[AclBinding]) -> None:
        self.acls = list(acls)

    def allows(self, principal: str, client_host: str, op: Operation, rtype: ResourceType, name: str) -> bool:
        if not self.enabled or principal in self.super_users:
            return True
        host = client_host.lstrip("/")
        wanted = {op, Operation.ALL, *_IMPLIED.get(op, ())}
        named = False
        allowed = False
        for acl in self.acls:
            if not acl.covers(rtype, name):
                continue
            named = True
            if acl.principal not in (principal, "User:*") or acl.host not in (host, WILDCARD):
                continue
            if acl.permission == Permission.DENY and acl.operation in (op, Operation.ALL):
                return False
            if acl.permission == Permission.ALLOW and acl.operation in wanted:
                allowed = True
        return allowed or (not named and self.allow_if_no_acl)

    def allows_any_topic(self, principal: str, client_host: str, op: Operation) -> bool:
        """Kafka's rule for idempotent producers: some ALLOW for op on any topic."""
        if not self.enabled or principal in self.super_users:
            return True
        return any(a.resource_type == ResourceType.TOPIC and a.permission == Permission.ALLOW
                   and a.operation in (op, Operation.ALL) and a.principal in (principal, "User:*")
                   and self.allows(principal, client_host, op, ResourceType.TOPIC, a.resource_name)
                   for a in self.acls)
