"""`kafscale` command line: broker, proxy, console, dev, segments, topics, groups, produce, consume, replay,
processor, users, acls."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

from kafscale import config as config_mod
from kafscale.extras import MissingExtra

DEV_CONSOLE_PORT = 9644  # kafscale dev serves the console and /metrics here unless told otherwise
log = logging.getLogger("kafscale")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "aiobotocore", "boto3", "urllib3", "grpc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _serve(main: Any, log_level: str) -> int:
    """Run a server coroutine until it is signalled; exit 2 with a clear
    message if it cannot start (etcd or S3 unusable, port taken)."""
    from kafscale.broker.node import StartupError

    _setup_logging(log_level)
    try:
        asyncio.run(main)
    except (StartupError, OSError) as exc:
        print(f"kafscale: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_broker(cfgs: list[config_mod.Config]) -> int:
    from kafscale.broker.supervisor import run_nodes

    _setup_logging(cfgs[0].log_level)
    return run_nodes(cfgs)


def cmd_broker(args: argparse.Namespace) -> int:
    if args.action:
        if args.broker_id is None:
            print(f"kafscale broker {args.action}: which broker id?", file=sys.stderr)
            return 2
        return _drain(config_mod.load(args), args.broker_id, args.action == "drain")
    return _run_broker([config_mod.load(args)])


def _drain(cfg: config_mod.Config, broker_id: int, draining: bool) -> int:
    """Mark a broker as draining (or not): the brokers hand its partitions and
    groups to the others after flushing; it can then be stopped."""
    from kafscale.metadata.store import MetaStore

    async def go() -> None:
        meta = MetaStore.from_config(cfg)
        await meta.start()
        try:
            await meta.set_draining(broker_id, draining)
        finally:
            await meta.close()

    asyncio.run(go())
    print(f"broker {broker_id} {'is draining' if draining else 'takes work again'}")
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from kafscale.proxy.proxy import run_proxy_until_signal

    cfg = config_mod.load(args)
    return _serve(run_proxy_until_signal(cfg), cfg.log_level)


def cmd_console(args: argparse.Namespace) -> int:
    from kafscale.adminhttp import serve_standalone

    cfg = config_mod.load(args)
    return _serve(serve_standalone(cfg), cfg.log_level)


def cmd_dev(args: argparse.Namespace) -> int:
    from kafscale.devstack import DevStack, port_is_free

    _setup_logging("INFO")
    # a development stack: topics are created on first use, and the console is on
    if args.auto_create_topics is None and "KAFSCALE_AUTO_CREATE_TOPICS" not in os.environ:
        args.auto_create_topics = True
    if args.admin_listen is None and "KAFSCALE_ADMIN_LISTEN" not in os.environ:
        args.admin_listen = f"127.0.0.1:{DEV_CONSOLE_PORT}"
    kafka_ports = [args.port + i for i in range(args.brokers)]
    admin_port = int(args.admin_listen.rpartition(":")[2]) if args.admin_listen else None
    for port, what in ((args.etcd_port, "etcd"), (args.s3_port, "S3"), *((p, "Kafka") for p in kafka_ports),
                       *(((admin_port, "the console (--admin-listen)"),) if admin_port else ())):
        if not port_is_free(port):
            print(f"kafscale dev: port {port} for {what} is in use", file=sys.stderr)
            return 2
    admin_ports = {admin_port + i for i in range(args.brokers)} if admin_port else set()
    stack = DevStack(data_dir=args.data_dir, etcd_port=args.etcd_port, s3_port=args.s3_port,
                     reserved={*kafka_ports, *admin_ports})
    log.info("starting etcd on :%d and SeaweedFS S3 on :%d (data in %s)", args.etcd_port, args.s3_port,
             args.data_dir or "a temporary directory")
    stack.start()
    try:
        env = stack.broker_env()
        cfgs = [config_mod.load(args, etcd=env["KAFSCALE_ETCD"], s3_endpoint=env["KAFSCALE_S3_ENDPOINT"],
                                bucket=env["KAFSCALE_BUCKET"], s3_access_key=env["KAFSCALE_S3_ACCESS_KEY"],
                                s3_secret_key=env["KAFSCALE_S3_SECRET_KEY"], listen=f"127.0.0.1:{port}",
                                node_id=i + 1) for i, port in enumerate(kafka_ports)]
        for i, cfg in enumerate(cfgs[1:], 1):  # --admin-listen H:P gives broker i the port P + i
            if cfg.admin_listen:
                host, _, admin_port = cfg.admin_listen.rpartition(":")
                cfg.admin_listen = f"{host}:{int(admin_port) + i}"
        log.info("KafScale dev: bootstrap.servers=%s  console=%s  etcd=%s  s3=%s bucket=%s  (Ctrl-C stops all)",
                 ",".join(f"127.0.0.1:{p}" for p in kafka_ports),
                 f"http://{cfgs[0].admin_listen}/" if cfgs[0].admin_listen else "off", stack.etcd_endpoint,
                 stack.s3_endpoint, stack.bucket)
        return _run_broker(cfgs)
    finally:
        stack.stop()
        log.info("dev stack stopped")


def _store(cfg: config_mod.Config) -> Any:
    from kafscale.storage.objectstore import ObjectStore

    return ObjectStore.from_config(cfg)


async def _segments_ls(cfg: config_mod.Config, topic: str, partition: int | None) -> None:
    """The topic's .kfs segments, then its segments in shared segment objects and
    its slices of node objects (not compacted yet), both as KEY#POS: those of
    the topic id its marker names (none of a deleted topic of the same name)."""
    from kafscale.storage.segment import HEADER_SIZE, parse_header, parse_segment_key
    from kafscale.storage.wal import (
        directory_slices,
        marker_topic_id,
        node_prefix,
        of_topic,
        read_node_directory,
        shared_prefix,
    )

    prefix = f"{cfg.namespace}/{topic}/" + ("" if partition is None else f"{partition}/")
    async with _store(cfg) as store:
        print(f"{'partition':>9} {'base offset':>12} {'records':>8} {'bytes':>10}  key")
        for obj in sorted(await store.list(prefix), key=lambda o: o["Key"]):
            key = obj["Key"]
            if not key.endswith(".kfs"):
                continue
            hdr = parse_header(await store.get(key, 0, HEADER_SIZE))
            parsed = parse_segment_key(key)
            part = parsed.partition if parsed is not None else "?"
            print(f"{part:>9} {hdr.base_offset:>12} {hdr.count:>8} {obj['Size']:>10}  {key}")
        topic_id = await marker_topic_id(store, cfg.namespace, topic)
        for root in (shared_prefix(cfg.namespace), node_prefix(cfg.namespace)):
            for obj in sorted(await store.list(root), key=lambda o: o["Key"]):
                for s in directory_slices(await read_node_directory(store, obj["Key"], int(obj["Size"]))):
                    _, _, p, base, _, count, pos, size, *_ = s
                    if of_topic(s, topic, topic_id) and partition in (None, p):
                        print(f"{p:>9} {base:>12} {count:>8} {size:>10}  {obj['Key']}#{pos}")


def _show(b: bytes | None) -> str:
    if b is None:
        return "null"
    try:
        s = b.decode()
        return json.dumps(s if len(s) <= 200 else s[:200] + "...")
    except UnicodeDecodeError:
        return "0x" + b[:100].hex() + ("..." if len(b) > 100 else "")


async def _segments_dump(cfg: config_mod.Config, key: str) -> None:
    """A .kfs segment's records; of a node object or shared segment object
    (.kfn), each slice's (KEY#POS: that slice only)."""
    from kafscale.storage.wal import directory_slices, node_directory

    key, _, pos = key.partition("#")
    async with _store(cfg) as store:
        data = await store.get(key)
    if not key.endswith(".kfn"):
        _dump_segment(key, data)
        return
    for topic, _, p, _, _, _, at, size, *_ in directory_slices(node_directory(data)):
        if pos in ("", str(at)):
            _dump_segment(f"{key}#{at} ({topic}/{p})", data[at:at + size])


def _dump_segment(name: str, data: bytes) -> None:
    from kafscale import _native
    from kafscale.storage.segment import open_segment

    hdr, body, last = open_segment(data)
    print(f"# {name}: base offset {hdr.base_offset}, last offset {last}, {hdr.count} records, "
          f"created {hdr.created_ms} ms, CRC32C ok")
    for b in _native.scan_batches(body, True):
        print(f"# batch offset {b.base_offset}..{b.last_offset} codec {_native.CODEC_NAMES[b.compression]} "
              f"{b.size} bytes")
        for off, ts, k, v, headers in _native.iter_records(b, body):
            hs = ",".join(f"{hk}={_show(hv)}" for hk, hv in headers)
            print(f"offset={off} timestamp={ts} key={_show(k)} value={_show(v)}" + (f" headers={hs}" if hs else ""))


def cmd_segments(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    if args.action == "ls":
        asyncio.run(_segments_ls(cfg, args.topic, args.partition))
    else:
        asyncio.run(_segments_dump(cfg, args.key))
    return 0


def _kafka_command(fn: Any) -> Any:
    """Wrap an async tool taking (cluster, args) as a sub-command function."""
    from kafscale.client import Cluster, Credentials
    from kafscale.protocol.errors import KafkaError

    async def go(args: argparse.Namespace) -> None:
        password = args.password if args.password is not None else os.environ.get("KAFSCALE_PASSWORD", "")
        credentials = Credentials(args.user, password) if args.user else None
        async with Cluster(args.bootstrap, f"kafscale-{args.command}", credentials) as cluster:
            await fn(cluster, args)

    def command(args: argparse.Namespace) -> int:
        try:
            asyncio.run(go(args))
        except (KafkaError, OSError) as exc:
            print(f"kafscale {args.command}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        return 0

    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kafscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run a broker against an existing etcd and S3 (or drain one)")
    p.add_argument("action", nargs="?", choices=["drain", "undrain"],
                   help="drain ID: hand broker ID's partitions and groups to the others; undrain ID: undo")
    p.add_argument("broker_id", nargs="?", type=int, metavar="ID")
    config_mod.add_arguments(p)
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("proxy", help="one Kafka endpoint in front of every broker of a cluster")
    config_mod.add_arguments(p)
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser("console", help="the web console (and /metrics, /readyz) from etcd and S3, without a broker")
    config_mod.add_arguments(p, only=(*config_mod.STORE_FIELDS, "admin_listen", "log_level"))
    p.set_defaults(func=cmd_console)

    p = sub.add_parser("dev", help="run etcd + SeaweedFS S3 + a broker on this machine")
    p.add_argument("--data-dir", help="keep etcd and S3 data here across restarts (default: temporary)")
    p.add_argument("--port", type=int, default=9092, help="Kafka port (default 9092)")
    p.add_argument("--brokers", type=int, default=1, help="brokers to run, on --port, --port+1, ...")
    p.add_argument("--etcd-port", type=int, default=2379)
    p.add_argument("--s3-port", type=int, default=8333)
    config_mod.add_arguments(p, skip=("etcd", "s3_endpoint", "bucket", "s3_access_key", "s3_secret_key", "listen",
                                      "node_id", "advertised"))
    p.set_defaults(func=cmd_dev)

    p = sub.add_parser("segments", help="list or decode segments straight from S3")
    p.add_argument("action", choices=["ls", "dump"])
    p.add_argument("--topic", help="topic (ls)")
    p.add_argument("--partition", type=int, help="partition (ls; default all)")
    p.add_argument("--key", help="segment object key (dump), as printed by ls: a .kfs, a node object (.kfn) "
                   "or one slice of it (KEY#POS)")
    config_mod.add_arguments(p)
    p.set_defaults(func=cmd_segments)

    from kafscale.tools import add_parsers
    add_parsers(sub, _kafka_command)
    from kafscale.processors import add_parser as add_processor
    from kafscale.spark.replay import add_parser as add_replay
    add_replay(sub)
    add_processor(sub)
    from kafscale.security.admin import add_parsers as add_security
    add_security(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "segments" and ((args.action == "ls" and not args.topic) or
                                       (args.action == "dump" and not args.key)):
        print("kafscale segments: ls needs --topic, dump needs --key", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except config_mod.ConfigError as exc:
        print(f"kafscale {args.command}: {exc}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
