"""`kafscale topics ...`, `kafscale groups ...`, `kafscale produce` and
`kafscale consume`: tools that talk the Kafka protocol to a broker (or the
proxy), like Kafka's own scripts."""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from datetime import datetime
from typing import Any

from kafscale import _native
from kafscale.client import Cluster, decode_assignment, offset_fetch_topics
from kafscale.lifecycle import stop_on_signals
from kafscale.protocol import schemas
from kafscale.protocol.errors import KafkaError
from kafscale.protocol.types import EARLIEST, LATEST
from kafscale.records import Consumer, Producer, Record, Start, list_offsets

TOPIC_RESOURCE = 2
OP_SET, OP_DELETE = 0, 1
PRODUCE_CHUNK = 1000  # lines read while the previous send was on its way go out in one request


# ------------------------------------------------------------------ topics
async def topics_ls(c: Cluster, args: argparse.Namespace) -> None:
    for t in sorted(await c.topics(None), key=lambda t: t["name"]):
        print(f"{t['name']}\t{len(t['partitions'])} partitions")


async def topics_describe(c: Cluster, args: argparse.Namespace) -> None:
    [t] = await c.topics([args.topic])
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


async def topics_alter(c: Cluster, args: argparse.Namespace) -> None:
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


async def topics_create(c: Cluster, args: argparse.Namespace) -> None:
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


async def topics_delete(c: Cluster, args: argparse.Namespace) -> None:
    resp = await c.request(schemas.DELETE_TOPICS.key, {"topic_names": [args.topic],
                                                        "topics": [{"name": args.topic, "topic_id": bytes(16)}],
                                                        "timeout_ms": 30000})
    r = resp["responses"][0]
    if r["error_code"]:
        raise KafkaError(r["error_code"], r.get("error_message") or f"topic {args.topic}")
    print(f"deleted {args.topic}")


# ------------------------------------------------------------------ groups
async def groups_ls(c: Cluster, args: argparse.Namespace) -> None:
    resp = await c.request(schemas.LIST_GROUPS.key, {})
    for g in resp["groups"]:
        print(f"{g['group_id']}\t{g['group_state'] or '-'}")


async def describe_group(c: Cluster, group: str) -> dict[str, Any]:
    """A group's state and members (from its coordinator) and, per partition it
    has committed or been assigned, the committed offset, log end, lag and owner."""
    coordinator = await c.coordinator(group)
    desc = (await coordinator.request(schemas.DESCRIBE_GROUPS.key, {"groups": [group]}))["groups"][0]
    if desc["error_code"]:
        raise KafkaError(desc["error_code"], f"group {group}")
    members = [{"member_id": m["member_id"], "client_id": m["client_id"], "client_host": m["client_host"],
                "assignment": decode_assignment(bytes(m["member_assignment"]))} for m in desc["members"]]
    owner = {(t, p): m for m in members for t, parts in m["assignment"].items() for p in parts}
    resp = await coordinator.request(schemas.OFFSET_FETCH.key, {"group_id": group, "topics": None,
                                                                "groups": [{"group_id": group, "topics": None}]})
    topics = offset_fetch_topics(resp)
    committed = {(t["name"], p["partition_index"]): p["committed_offset"] for t in topics for p in t["partitions"]}
    keys = sorted(set(committed) | set(owner))
    wanted: dict[str, list[int]] = {}
    for t, p in keys:
        wanted.setdefault(t, []).append(p)
    ends = await list_offsets(c, wanted, LATEST) if wanted else {}
    rows = []
    for key in keys:
        cur, end = committed.get(key, -1), ends.get(key, -1)
        m = owner.get(key)
        rows.append({"topic": key[0], "partition": key[1], "committed": cur, "log_end": end,
                     "lag": end - cur if cur >= 0 else None, "member_id": m["member_id"] if m else None,
                     "client_id": m["client_id"] if m else None, "client_host": m["client_host"] if m else None})
    return {"group": group, "state": desc["group_state"], "protocol": desc["protocol_data"],
            "members": members, "partitions": rows}


async def groups_describe(c: Cluster, args: argparse.Namespace) -> None:
    d = await describe_group(c, args.group)
    print(f"Group {args.group}: state {d['state']}, protocol {d['protocol'] or '-'}, {len(d['members'])} members")
    print(f"{'TOPIC':<24} {'PARTITION':>9} {'CURRENT-OFFSET':>15} {'LOG-END-OFFSET':>15} {'LAG':>8}  "
          f"{'CONSUMER-ID':<45} {'HOST':<16} CLIENT-ID")
    for r in d["partitions"]:
        print(f"{r['topic']:<24} {r['partition']:>9} {r['committed'] if r['committed'] >= 0 else '-':>15} "
              f"{r['log_end']:>15} {'-' if r['lag'] is None else r['lag']:>8}  {r['member_id'] or '-':<45} "
              f"{r['client_host'] or '-':<16} {r['client_id'] or '-'}")


async def groups_reset_offsets(c: Cluster, args: argparse.Namespace) -> None:
    coordinator = await c.coordinator(args.group)
    desc = (await coordinator.request(schemas.DESCRIBE_GROUPS.key, {"groups": [args.group]}))["groups"][0]
    if desc["members"]:
        raise SystemExit(f"group {args.group} has {len(desc['members'])} active members; stop them first")
    [t] = await c.topics([args.topic])
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
    resp = await coordinator.request(schemas.OFFSET_COMMIT.key, body)
    for p in resp["topics"][0]["partitions"]:
        if p["error_code"]:
            raise KafkaError(p["error_code"], f"commit partition {p['partition_index']}")
    print(f"reset offsets of group {args.group}")


# ------------------------------------------------------------------ records
def _split(line: bytes, separator: bytes | None) -> tuple[bytes | None, bytes | None] | str:
    """(key, value) of one input line, or why it has none."""
    line = line.rstrip(b"\n").removesuffix(b"\r")
    if separator is None:
        return None, line
    key, sep, value = line.partition(separator)
    return (key, value) if sep else f"no key separator {separator.decode()!r} in the line"


async def produce(c: Cluster, args: argparse.Namespace) -> None:
    producer = Producer(c, args.topic, _native.CODEC_NAMES.index(args.compression))
    await producer.start()
    separator = args.key_separator.encode() if args.key_separator is not None else None
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def read() -> None:  # stdin blocks: a thread reads it
        for line in sys.stdin.buffer:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()
    done = written = failed = 0
    while True:
        chunk = [await lines.get()]
        while chunk[-1] is not None and not lines.empty() and len(chunk) < PRODUCE_CHUNK:
            chunk.append(lines.get_nowait())
        eof = chunk[-1] is None
        parsed = [_split(line, separator) for line in chunk if line is not None]
        records = [r for r in parsed if not isinstance(r, str)]
        where = [done + i + 1 for i, r in enumerate(parsed) if not isinstance(r, str)]
        errors = [(done + i + 1, r) for i, r in enumerate(parsed) if isinstance(r, str)]
        if records:
            errors += [(where[i], why) for i, why in await producer.send(records)]  # type: ignore[arg-type]
        for line_no, why in sorted(errors):
            print(f"kafscale produce: line {line_no} not written: {why}", file=sys.stderr)
        done += len(parsed)
        failed += len(errors)
        written += len(parsed) - len(errors)
        if eof:
            break
    print(f"{written} records written to {args.topic}" + (f", {failed} failed" if failed else ""), file=sys.stderr)
    if failed:
        raise SystemExit(1)


def _start(args: argparse.Namespace) -> Start:
    if args.offset is not None:
        return Start("offset", args.offset)
    if args.from_time is not None:
        try:
            at = int(args.from_time) if args.from_time.lstrip("-").isdigit() else int(
                datetime.fromisoformat(args.from_time).timestamp() * 1000)
        except ValueError:
            raise SystemExit(f"kafscale consume: --from {args.from_time!r} is neither ISO 8601 nor milliseconds "
                             "since 1970") from None
        return Start("time", at)
    return Start("earliest" if args.from_beginning else "latest")


async def consume(c: Cluster, args: argparse.Namespace) -> None:
    if args.group and args.partition is not None:
        raise SystemExit("kafscale consume: --partition and --group exclude each other (the group assigns)")
    consumer = Consumer(c, args.topic, _start(args), None if args.partition is None else [args.partition], args.group)
    out, separator = sys.stdout.buffer, args.key_separator.encode()
    show = lambda b: b"null" if b is None else b  # noqa: E731

    def emit(records: list[Record]) -> None:
        for r in records:
            out.write((show(r.key) + separator if args.print_key else b"") + show(r.value) + b"\n")
        out.flush()

    stop = stop_on_signals(once=True)  # the first Ctrl-C stops cleanly (commit, leave), a second one at once
    count = await consumer.run(emit, args.max_messages, args.exit_at_end, stop)
    print(f"Processed a total of {count} messages", file=sys.stderr)


def add_parsers(sub: Any, run: Any) -> None:
    """Register `topics` and `groups` sub-commands; `run(coro_fn)` executes one."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap", default="127.0.0.1:9092", help="a broker or the proxy (host:port[,...])")
    common.add_argument("--user", help="SASL user (SCRAM or PLAIN, whichever the broker offers)")
    common.add_argument("--password", help="SASL password (default: $KAFSCALE_PASSWORD)")

    def leaf(parent: Any, name: str, fn: Any, **kw: Any) -> argparse.ArgumentParser:
        p = parent.add_parser(name, parents=[common], **kw)
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

    p = leaf(sub, "produce", produce, help="write lines from standard input to a topic (acks=all)")
    p.add_argument("topic")
    p.add_argument("--key-separator", metavar="SEP", help="each line is KEY SEP VALUE (default: no key)")
    p.add_argument("--compression", choices=_native.CODEC_NAMES, default="none")

    p = leaf(sub, "consume", consume, help="print a topic's records, alone or as a consumer group member")
    p.add_argument("topic")
    p.add_argument("--group", help="consume as a member of this consumer group, from its committed offsets")
    p.add_argument("--partition", type=int, help="only this partition (not with --group)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--from-beginning", action="store_true", help="start at the oldest record")
    where.add_argument("--offset", type=int, help="start at this offset")
    where.add_argument("--from", dest="from_time", metavar="TIME",
                       help="start at the first record at or after TIME (ISO 8601 or ms since 1970)")
    p.add_argument("-n", "--max-messages", type=int, help="stop after N records")
    p.add_argument("-e", "--exit-at-end", action="store_true", help="stop at the end of every partition")
    p.add_argument("--print-key", action="store_true", help="print KEY SEP VALUE")
    p.add_argument("--key-separator", default="\t", metavar="SEP", help="between key and value (default: tab)")
