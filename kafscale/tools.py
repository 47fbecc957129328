"""`kafscale topics ...` and `kafscale groups ...`: operator tools that talk
the Kafka protocol to a broker (or the proxy), like Kafka's own scripts."""
from __future__ import annotations

import argparse
from datetime import datetime
from typing import Any

from kafscale.client import KafkaClient, decode_assignment
from kafscale.protocol import schemas
from kafscale.protocol.errors import KafkaError

TOPIC_RESOURCE = 2
OP_SET, OP_DELETE = 0, 1
EARLIEST, LATEST = -2, -1


async def _metadata(c: KafkaClient, topics: list[str] | None) -> list[dict[str, Any]]:
    body = {"topics": None if topics is None else [{"name": t, "topic_id": bytes(16)} for t in topics],
            "allow_auto_topic_creation": False}
    resp = await c.request(schemas.METADATA.key, body)
    for t in resp["topics"]:
        if t["error_code"]:
            raise KafkaError(t["error_code"], f"topic {t['name']}")
    return resp["topics"]


async def list_offsets(c: KafkaClient, wanted: dict[str, list[int]], ts: int) -> dict[tuple[str, int], int]:
    body = {"replica_id": -1, "isolation_level": 0, "topics": [
        {"name": t, "partitions": [{"partition_index": p, "timestamp": ts} for p in parts]}
        for t, parts in wanted.items()]}
    resp = await c.request(schemas.LIST_OFFSETS.key, body)
    return {(t["name"], p["partition_index"]): p["offset"] for t in resp["topics"] for p in t["partitions"]}


# ------------------------------------------------------------------ topics
async def topics_ls(c: KafkaClient, args: argparse.Namespace) -> None:
    for t in sorted(await _metadata(c, None), key=lambda t: t["name"]):
        print(f"{t['name']}\t{len(t['partitions'])} partitions")


async def topics_describe(c: KafkaClient, args: argparse.Namespace) -> None:
    [t] = await _metadata(c, [args.topic])
    parts = sorted(p["partition_index"] for p in t["partitions"])
    lo = await list_offsets(c, {args.topic: parts}, EARLIEST)
    hi = await list_offsets(c, {args.topic: parts}, LATEST)
    print(f"Topic: {args.topic}\tTopicId: {t['topic_id'].hex()}\tPartitions: {len(parts)}")
    cfg = await c.request(schemas.DESCRIBE_CONFIGS.key, {"resources": [
        {"resource_type": TOPIC_RESOURCE, "resource_name": args.topic, "configuration_keys": None}]})
    for e in cfg["results"][0]["configs"]:
        print(f"  {e['name']}={e['value']}" + (" (default)" if e["config_source"] == 5 else ""))
    print(f"{'partition':>9} {'log start':>12} {'high watermark':>15} {'records':>10}")
    for p in parts:
        start, end = lo[(args.topic, p)], hi[(args.topic, p)]
        print(f"{p:>9} {start:>12} {end:>15} {end - start:>10}")


async def topics_alter(c: KafkaClient, args: argparse.Namespace) -> None:
    if args.partitions:
        resp = await c.request(schemas.CREATE_PARTITIONS.key, {"topics": [
            {"name": args.topic, "count": args.partitions, "assignments": None}], "timeout_ms": 30000,
            "validate_only": False})
        r = resp["results"][0]
        if r["error_code"]:
            raise KafkaError(r["error_code"], r["error_message"])
    ops = [{"name": k, "config_operation": OP_SET, "value": v} for k, _, v in (s.partition("=") for s in args.config)]
    ops += [{"name": k, "config_operation": OP_DELETE, "value": None} for k in args.delete_config]
    if ops:
        resp = await c.request(schemas.INCREMENTAL_ALTER_CONFIGS.key, {"resources": [
            {"resource_type": TOPIC_RESOURCE, "resource_name": args.topic, "configs": ops}], "validate_only": False})
        r = resp["responses"][0]
        if r["error_code"]:
            raise KafkaError(r["error_code"], r["error_message"])
    print(f"altered {args.topic}")


async def topics_create(c: KafkaClient, args: argparse.Namespace) -> None:
    if args.partitions < 1:
        raise SystemExit(f"kafscale topics: --partitions must be 1 or more, not {args.partitions}")
    configs = [{"name": k, "value": v} for k, _, v in (s.partition("=") for s in args.config)]
    resp = await c.request(schemas.CREATE_TOPICS.key, {"topics": [
        {"name": args.topic, "num_partitions": args.partitions, "replication_factor": -1, "assignments": [],
         "configs": configs}], "timeout_ms": 30000, "validate_only": False})
    r = resp["topics"][0]
    if r["error_code"]:
        raise KafkaError(r["error_code"], r["error_message"])
    print(f"created {args.topic} with {args.partitions} partitions")


async def topics_delete(c: KafkaClient, args: argparse.Namespace) -> None:
    resp = await c.request(schemas.DELETE_TOPICS.key, {"topic_names": [args.topic],
                                                        "topics": [{"name": args.topic, "topic_id": bytes(16)}],
                                                        "timeout_ms": 30000})
    r = resp["responses"][0]
    if r["error_code"]:
        raise KafkaError(r["error_code"], r.get("error_message") or f"topic {args.topic}")
    print(f"deleted {args.topic}")


# ------------------------------------------------------------------ groups
async def groups_ls(c: KafkaClient, args: argparse.Namespace) -> None:
    resp = await c.request(schemas.LIST_GROUPS.key, {})
    for g in resp["groups"]:
        print(f"{g['group_id']}\t{g['group_state'] or '-'}")


async def _committed(c: KafkaClient, group: str) -> dict[tuple[str, int], int]:
    resp = await c.request(schemas.OFFSET_FETCH.key, {"group_id": group, "topics": None,
                                                      "groups": [{"group_id": group, "topics": None}]})
    topics = resp["groups"][0]["topics"] if resp.get("groups") else resp["topics"]
    return {(t["name"], p["partition_index"]): p["committed_offset"] for t in topics for p in t["partitions"]}


async def groups_describe(c: KafkaClient, args: argparse.Namespace) -> None:
    desc = (await c.request(schemas.DESCRIBE_GROUPS.key, {"groups": [args.group]}))["groups"][0]
    owner: dict[tuple[str, int], dict[str, Any]] = {}
    for m in desc["members"]:
        for topic, parts in decode_assignment(bytes(m["member_assignment"])).items():
            for p in parts:
                owner[(topic, p)] = m
    committed = await _committed(c, args.group)
    keys = sorted(set(committed) | set(owner))
    wanted: dict[str, list[int]] = {}
    for t, p in keys:
        wanted.setdefault(t, []).append(p)
    ends = await list_offsets(c, wanted, LATEST) if wanted else {}
    print(f"Group {args.group}: state {desc['group_state']}, protocol {desc['protocol_data'] or '-'}, "
          f"{len(desc['members'])} members")
    print(f"{'TOPIC':<24} {'PARTITION':>9} {'CURRENT-OFFSET':>15} {'LOG-END-OFFSET':>15} {'LAG':>8}  "
          f"{'CONSUMER-ID':<45} {'HOST':<16} CLIENT-ID")
    for key in keys:
        cur, end = committed.get(key, -1), ends.get(key, -1)
        m = owner.get(key)
        lag = end - cur if cur >= 0 else "-"
        print(f"{key[0]:<24} {key[1]:>9} {cur if cur >= 0 else '-':>15} {end:>15} {lag:>8}  "
              f"{m['member_id'] if m else '-':<45} {m['client_host'] if m else '-':<16} "
              f"{m['client_id'] if m else '-'}")


async def groups_reset_offsets(c: KafkaClient, args: argparse.Namespace) -> None:
    desc = (await c.request(schemas.DESCRIBE_GROUPS.key, {"groups": [args.group]}))["groups"][0]
    if desc["members"]:
        raise SystemExit(f"group {args.group} has {len(desc['members'])} active members; stop them first")
    [t] = await _metadata(c, [args.topic])
    parts = sorted(p["partition_index"] for p in t["partitions"])
    if args.to_offset is not None:
        targets = {(args.topic, p): args.to_offset for p in parts}
    elif args.to_datetime:
        ts = int(datetime.fromisoformat(args.to_datetime).timestamp() * 1000)
        targets = await list_offsets(c, {args.topic: parts}, ts)
        ends = await list_offsets(c, {args.topic: parts}, LATEST)
        targets = {k: v if v >= 0 else ends[k] for k, v in targets.items()}
    else:
        targets = await list_offsets(c, {args.topic: parts}, LATEST if args.to_latest else EARLIEST)
    for (topic, p), off in sorted(targets.items()):
        print(f"{topic}\t{p}\t{off}")
    if not args.execute:
        print("(dry run: add --execute to commit these offsets)")
        return
    body = {"group_id": args.group, "generation_id_or_member_epoch": -1, "member_id": "",
            "topics": [{"name": args.topic, "partitions": [
                {"partition_index": p, "committed_offset": off, "committed_metadata": ""}
                for (_, p), off in sorted(targets.items())]}]}
    resp = await c.request(schemas.OFFSET_COMMIT.key, body)
    for p in resp["topics"][0]["partitions"]:
        if p["error_code"]:
            raise KafkaError(p["error_code"], f"commit partition {p['partition_index']}")
    print(f"reset offsets of group {args.group}")


def add_parsers(sub: Any, run: Any) -> None:
    """Register `topics` and `groups` sub-commands; `run(coro_fn)` executes one."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap", default="127.0.0.1:9092", help="a broker or the proxy (host:port)")

    def leaf(parent: Any, name: str, fn: Any) -> argparse.ArgumentParser:
        p = parent.add_parser(name, parents=[common])
        p.set_defaults(func=run(fn))
        return p

    tsub = sub.add_parser("topics", help="list, create, describe, alter and delete topics through a broker"
                          ).add_subparsers(dest="action", required=True)
    leaf(tsub, "ls", topics_ls)
    create = leaf(tsub, "create", topics_create)
    create.add_argument("topic")
    create.add_argument("--partitions", type=int, default=1, help="partitions (default 1)")
    create.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    leaf(tsub, "delete", topics_delete).add_argument("topic")
    leaf(tsub, "describe", topics_describe).add_argument("topic")
    a = leaf(tsub, "alter", topics_alter)
    a.add_argument("topic")
    a.add_argument("--partitions", type=int, help="grow to this many partitions")
    a.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    a.add_argument("--delete-config", action="append", default=[], metavar="KEY")

    gsub = sub.add_parser("groups", help="list, describe (with lag) and reset consumer groups").add_subparsers(
        dest="action", required=True)
    leaf(gsub, "ls", groups_ls)
    leaf(gsub, "describe", groups_describe).add_argument("group")
    r = leaf(gsub, "reset-offsets", groups_reset_offsets)
    r.add_argument("group")
    r.add_argument("--topic", required=True)
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--to-earliest", action="store_true")
    where.add_argument("--to-latest", action="store_true")
    where.add_argument("--to-offset", type=int)
    where.add_argument("--to-datetime", help="ISO 8601, e.g. 2026-11-21T10:00:00+00:00")
    r.add_argument("--execute", action="store_true", help="commit (default: dry run)")
