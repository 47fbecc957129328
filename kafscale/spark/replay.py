"""`kafscale replay`: a Spark job over a topic's segments in S3. It writes a
range of the topic to Parquet or JSON files, or produces it again into a
topic through a broker (backfill). Spark runs in local mode unless --master
names a cluster; the broker serves only the backfill's produce requests."""
from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import Any

from kafscale import config as config_mod
from kafscale import extras


def bound_options(value: str | None, which: str) -> dict[str, str]:
    """--from / --to as source options: earliest, latest, an offset (every
    partition) or an ISO-8601 time such as 2026-11-01T00:00:00Z."""
    if value is None:
        return {}
    if value in ("earliest", "latest") or value.lstrip("-").isdigit():
        return {f"{which}Offsets": value}
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is not earliest, latest, an offset or an ISO-8601 time") from None
    if when.tzinfo is None:
        raise ValueError(f"{value!r}: give a time zone (for example a trailing Z)")
    return {f"{which}Timestamp": str(int(when.timestamp() * 1000))}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="read a topic range from S3 with Spark: to files, or back into a topic")
    p.add_argument("--topic", required=True)
    p.add_argument("--from", dest="start", help="earliest (default), an offset, or an ISO-8601 time")
    p.add_argument("--to", dest="end", help="latest (default), an offset or an ISO-8601 time (exclusive)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="directory to write (local path or a URI Spark can write)")
    out.add_argument("--to-topic", help="produce the records into this topic (backfill)")
    p.add_argument("--format", choices=["parquet", "json"], default="parquet")
    p.add_argument("--as-text", action="store_true", help="key, value and header values as UTF-8 strings")
    p.add_argument("--mode", choices=["error", "overwrite", "append"], default="error",
                   help="when --out exists (default: error)")
    p.add_argument("--bootstrap", default="localhost:9092", help="broker for --to-topic")
    p.add_argument("--same-partition", action="store_true",
                   help="--to-topic: keep each record's partition number (default: partition by key)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--no-etcd", action="store_true", help="find segments by listing the bucket, not in etcd")
    config_mod.add_arguments(p, only=config_mod.STORE_FIELDS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extras.load("pyspark", "replay")
    segments = extras.load("kafscale.storage.scan", "replay")
    try:
        options = {"topic": args.topic, **bound_options(args.start, "starting"), **bound_options(args.end, "ending"),
                   **segments.StoreOptions.from_config(config_mod.load(args), not args.no_etcd).as_source_options()}
    except ValueError as exc:
        print(f"kafscale replay: {exc}", file=sys.stderr)
        return 2
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from kafscale.spark import register

    spark = (SparkSession.builder.master(args.master).appName(f"kafscale replay {args.topic}")
             .config("spark.ui.showConsoleProgress", "true").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        register(spark)
        df = spark.read.format("kafscale").options(**options).load()
        if args.to_topic:
            produced = spark.sparkContext.accumulator(0)
            ordered = df.repartition("partition").sortWithinPartitions("partition", "offset")
            ordered.foreachPartition(_producer(args.bootstrap, args.to_topic, args.same_partition, produced))
            print(f"kafscale replay: produced {produced.value} records into {args.to_topic}")
            return 0
        if args.as_text:
            df = (df.withColumn("key", F.col("key").cast("string")).withColumn("value", F.col("value").cast("string"))
                  .withColumn("headers", F.expr("transform(headers, h -> named_struct('key', h.key, "
                                                "'value', cast(h.value as string)))")))
        df.write.mode(args.mode).format(args.format).save(args.out)
        written = spark.read.format(args.format).load(args.out).count() if args.mode != "append" else None
        print(f"kafscale replay: wrote {args.out}" + (f" ({written} records)" if written is not None else ""))
        return 0
    finally:
        spark.stop()


def _producer(bootstrap: str, topic: str, same_partition: bool, produced: Any) -> Any:
    """The function each Spark task runs: produce its rows in order, acks=all,
    idempotent; any failed delivery fails the task (Spark retries it, so a
    backfill is at-least-once)."""
    def produce(rows: Any) -> None:
        from confluent_kafka import KafkaException, Producer

        p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                      "linger.ms": 20, "compression.type": "lz4"})
        errors: list[Any] = []
        n = 0

        def cb(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        for r in rows:
            kw: dict[str, Any] = {"partition": r.partition} if same_partition else {}
            while True:
                try:
                    p.produce(topic, value=r.value, key=r.key, timestamp=int(r.timestamp.timestamp() * 1000),
                              headers=[(h.key, h.value) for h in r.headers], on_delivery=cb, **kw)
                    break
                except BufferError:
                    p.poll(0.05)
            n += 1
            p.poll(0)
        if p.flush(120) or errors:
            raise KafkaException(errors[0] if errors else "records still undelivered after 120 s")
        produced.add(n)

    return produce
