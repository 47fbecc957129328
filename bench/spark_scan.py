"""Spark scan throughput of a topic read straight from its segments in S3,
against plain Spark reads of the same records in one run:

1. `spark.read.format("kafscale")` over the segments in SeaweedFS;
2. the same records as Parquet objects in the same SeaweedFS, read through a
   minimal Python data source (pyarrow, one object per Spark partition): the
   same store and the same Spark path, so the ratio isolates segment decoding;
3. Spark's own Parquet and JSON readers over the same records on local disk
   (this Spark has no S3 connector jars, so it cannot read S3 itself).

Every scan computes count(*) and sum(length(value)); each is run twice and
the faster run counts. Spark runs in local mode on every core.

    python bench/spark_scan.py [--mib 1024]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pyarrow as pa
from confluent_kafka.admin import AdminClient, NewTopic
from e2e import produce, start_broker, stop_broker
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY, DevStack
from kafscale.spark import register
from kafscale.storage.scan import StoreOptions, list_segments

SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
                    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp", pa.timestamp("us", tz="UTC"))])


class S3Parquet(DataSource):
    """Parquet objects under a prefix, one Spark partition per object."""

    @classmethod
    def name(cls) -> str:
        return "s3parquet"

    def schema(self) -> str:
        return "key binary, value binary, topic string, partition int, offset long, timestamp timestamp"

    def reader(self, schema: object) -> DataSourceReader:
        return S3ParquetReader(self.options)


class S3ParquetReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.o = dict(options)

    def _s3(self) -> object:
        return boto3.client("s3", endpoint_url=self.o["endpoint"], aws_access_key_id=DEV_ACCESS_KEY,
                            aws_secret_access_key=DEV_SECRET_KEY, region_name="us-east-1")

    def partitions(self) -> list[InputPartition]:
        pages = self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.o["bucket"], Prefix=self.o["prefix"])
        return [InputPartition(o["Key"]) for p in pages for o in p.get("Contents", []) if o["Key"].endswith(".parquet")]

    def read(self, partition: InputPartition) -> Iterator[object]:
        import pyarrow.parquet as pq

        body = self._s3().get_object(Bucket=self.o["bucket"], Key=partition.value)["Body"].read()
        table = pq.read_table(io.BytesIO(body), columns=[f.name for f in SCHEMA])
        yield from table.cast(SCHEMA).to_batches()


def scan(df: object) -> tuple[float, int, int]:
    """Best of two: (seconds, records, value bytes)."""
    best = None
    for _ in range(2):
        t0 = time.perf_counter()
        row = df.selectExpr("count(*) AS n", "sum(length(value)) AS b").collect()[0]  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - t0
        best = min(best or elapsed, elapsed)
    return best, row.n, row.b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="topic size in MiB of 1 KiB records")
    ap.add_argument("--partitions", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kafscale-spark-bench-") as tmp:
        stack = DevStack(data_dir=tmp).start()
        cluster = f"sb{uuid.uuid4().hex[:6]}"
        spark = None
        try:
            proc, bootstrap = start_broker(stack, Path(tmp), cluster, workers="2")
            try:
                admin = AdminClient({"bootstrap.servers": bootstrap})
                admin.create_topics([NewTopic("scan", args.partitions, 1)])["scan"].result(30)
                produce(bootstrap, "scan", args.partitions, 1024, args.mib << 20)
            finally:
                stop_broker(proc)
            opts = StoreOptions(stack.bucket, cluster, stack.s3_endpoint, "us-east-1", DEV_ACCESS_KEY, DEV_SECRET_KEY,
                                stack.etcd_endpoint, cluster)
            segments = sum(len(s) for s, _, _ in asyncio.run(list_segments(opts, "scan")).values())
            spark = (SparkSession.builder.master(f"local[{os.cpu_count()}]").appName("kafscale spark bench")
                     .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
                     .config("spark.driver.memory", "4g").getOrCreate())
            spark.sparkContext.setLogLevel("ERROR")
            register(spark)
            spark.dataSource.register(S3Parquet)
            ks = spark.read.format("kafscale").options(topic="scan", **opts.as_source_options()).load()
            local = Path(tmp) / "export"
            ks.write.parquet(str(local / "parquet"))
            ks.selectExpr("CAST(key AS STRING) AS key", "CAST(value AS STRING) AS value", "topic", "partition",
                          "offset", "timestamp").write.json(str(local / "json"))
            s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint, aws_access_key_id=DEV_ACCESS_KEY,
                              aws_secret_access_key=DEV_SECRET_KEY, region_name="us-east-1")
            for f in (local / "parquet").glob("*.parquet"):
                s3.upload_file(str(f), stack.bucket, f"bench-parquet/{f.name}")
            results = {
                "kafscale segments (S3)": scan(ks),
                "Parquet objects (S3, pyarrow source)": scan(spark.read.format("s3parquet").options(
                    endpoint=stack.s3_endpoint, bucket=stack.bucket, prefix="bench-parquet/").load()),
                "Spark Parquet reader (local disk)": scan(spark.read.parquet(str(local / "parquet"))),
                "Spark JSON reader (local disk)": scan(spark.read.json(str(local / "json"))),
            }
        finally:
            if spark is not None:
                spark.stop()
            stack.stop()
    base_secs, n, b = results["kafscale segments (S3)"]
    print(f"topic: {n} records, {b / (1 << 20):.0f} MiB of values, {args.partitions} partitions, {segments} segments")
    for name, (secs, rn, rb) in results.items():
        assert rn == n, f"{name} saw {rn} records, expected {n}"
        print(f"{name:40s} {rn / secs:12,.0f} records/s {rb / secs / (1 << 20):8.1f} MiB/s"
              f"   kafscale / this = {secs / base_secs:.2f}")


if __name__ == "__main__":
    main()
