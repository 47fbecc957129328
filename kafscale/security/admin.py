"""`kafscale users` and `kafscale acls`: SASL users and ACLs, written to etcd.

Brokers read users on every authentication and re-read ACLs every second,
so changes apply without a restart. Kafka admin clients can manage ACLs too
(CreateAcls, DescribeAcls, DeleteAcls); users exist only here, as in Kafka,
where SCRAM credentials are set by an administrator, never by a client."""
from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from kafscale import config as config_mod
from kafscale.metadata.store import MetaStore
from kafscale.security.acl import CLUSTER, AclBinding, Operation, PatternType, Permission, ResourceType
from kafscale.security.sasl import MIN_ITERATIONS, make_credentials

OPERATIONS = [op.name.lower() for op in Operation if op >= Operation.ALL]


def _run(args: argparse.Namespace, fn: Callable[[MetaStore, argparse.Namespace], Awaitable[int]]) -> int:
    cfg = config_mod.load(args)

    async def go() -> int:
        meta = MetaStore.from_config(cfg)
        await meta.start()
        try:
            return await fn(meta, args)
        finally:
            await meta.close()

    return asyncio.run(go())


# ------------------------------------------------------------------- users
def _password(args: argparse.Namespace) -> str:
    if args.password is not None:
        return args.password
    if sys.stdin.isatty():
        return getpass.getpass(f"password for {args.name}: ")
    return sys.stdin.readline().rstrip("\n")


async def _users(meta: MetaStore, args: argparse.Namespace) -> int:
    if args.action == "ls":
        for name in await meta.list_users():
            print(name)
        return 0
    if not args.name:
        print(f"kafscale users {args.action}: which user?", file=sys.stderr)
        return 2
    if args.action == "rm":
        if not await meta.delete_user(args.name):
            print(f"kafscale users rm: no user {args.name}", file=sys.stderr)
            return 1
        print(f"removed user {args.name}")
        return 0
    password = _password(args)
    if not password:
        print("kafscale users add: the password must not be empty", file=sys.stderr)
        return 2
    await meta.put_user(args.name, make_credentials(password, args.iterations))
    print(f"user {args.name}: SCRAM-SHA-256 and SCRAM-SHA-512 credentials stored ({args.iterations} iterations; "
          "PLAIN checks against them)")
    return 0


# -------------------------------------------------------------------- acls
def _resource(args: argparse.Namespace) -> tuple[ResourceType, str | None]:
    if args.topic is not None:
        return ResourceType.TOPIC, args.topic
    if args.group is not None:
        return ResourceType.GROUP, args.group
    if args.cluster_resource:
        return ResourceType.CLUSTER, CLUSTER
    return ResourceType.ANY, None


def _filter(args: argparse.Namespace, op: str | None) -> dict[str, Any]:
    rtype, name = _resource(args)
    return {"resource_type_filter": rtype, "resource_name_filter": name,
            "pattern_type_filter": PatternType.PREFIXED if args.prefixed else
            (PatternType.LITERAL if name is not None else PatternType.ANY),
            "principal_filter": args.principal, "host_filter": args.host,
            "operation": Operation[op.upper()] if op else Operation.ANY,
            "permission_type": Permission.DENY if args.deny else (Permission.ALLOW if args.allow else Permission.ANY)}


def _show(a: AclBinding) -> str:
    pattern = "prefixed" if a.pattern_type == PatternType.PREFIXED else "literal"
    return (f"{Permission(a.permission).name:<5} {a.principal:<20} {Operation(a.operation).name.lower():<16} "
            f"{ResourceType(a.resource_type).name.lower()}:{a.resource_name} ({pattern}) from {a.host}")


async def _acls(meta: MetaStore, args: argparse.Namespace) -> int:
    if args.action in ("ls", "rm"):
        filters = [_filter(args, op) for op in args.operation or [None]]
        matching = [a for a in await meta.list_acls() if any(a.matches_filter(f) for f in filters)]
        if args.action == "rm":
            await meta.delete_acls(matching)
        for a in matching:
            print(f"removed: {_show(a)}" if args.action == "rm" else _show(a))
        return 0
    rtype, name = _resource(args)
    if name is None or not args.principal or not args.operation:
        print("kafscale acls add: needs --principal, --operation and one of --topic/--group/--cluster-resource",
              file=sys.stderr)
        return 2
    new = [AclBinding(rtype, name, PatternType.PREFIXED if args.prefixed else PatternType.LITERAL, args.principal,
                      args.host or "*", Operation[op.upper()], Permission.DENY if args.deny else Permission.ALLOW)
           for op in args.operation]
    for a in new:
        why = a.invalid()
        if why:
            print(f"kafscale acls add: {why}", file=sys.stderr)
            return 2
    await meta.put_acls(new)
    for a in new:
        print(f"added: {_show(a)}")
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("users", help="SASL users (SCRAM credentials, stored hashed in etcd)")
    p.add_argument("action", choices=["add", "rm", "ls"])
    p.add_argument("name", nargs="?")
    p.add_argument("--password", help="the password (default: asked for, or one line from standard input)")
    p.add_argument("--iterations", type=int, default=MIN_ITERATIONS, help="SCRAM iterations (at least 4096)")
    config_mod.add_arguments(p, only=("etcd", "cluster"))
    p.set_defaults(func=lambda args: _run(args, _users))

    p = sub.add_parser("acls", help="ACLs the brokers enforce with --authorizer (stored in etcd)")
    p.add_argument("action", choices=["add", "rm", "ls"])
    p.add_argument("--principal", help="User:NAME, or User:* for everyone")
    p.add_argument("--operation", action="append", choices=OPERATIONS, help="repeat for several")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--topic")
    what.add_argument("--group")
    what.add_argument("--cluster-resource", action="store_true", help="the cluster itself (kafka-cluster)")
    p.add_argument("--prefixed", action="store_true", help="the name is a prefix (default: literal, or * for all)")
    p.add_argument("--host", help="client address the ACL applies to (add: default *)")
    permission = p.add_mutually_exclusive_group()
    permission.add_argument("--allow", action="store_true", help="(the default for add)")
    permission.add_argument("--deny", action="store_true")
    config_mod.add_arguments(p, only=("etcd", "cluster"))
    p.set_defaults(func=lambda args: _run(args, _acls))
