"""`spark.read.format("kafscale")`: a PySpark Python Data Source that reads a
topic's segments straight from S3, with the columns of Spark's Kafka source.

    from kafscale.spark import register
    register(spark)
    df = (spark.read.format("kafscale").option("topic", "orders")
          .option("bucket", "kafscale").option("endpoint", "http://s3:8333")
          .option("etcd", "etcd:2379").option("cluster", "prod").load())

Options: topic (required); bucket, namespace (key prefix, default
"kafscale"), endpoint, region, accessKey, secretKey (default: the AWS
credential chain); etcd and cluster to plan from the segment manifests
(without etcd the bucket is listed); startingOffsets, endingOffsets
(earliest / latest / {"topic": {"0": 42}}, end exclusive), startingTimestamp,
endingTimestamp (ms); maxBytesPerPartition (default 128 MiB) splits big
segments along their index. One Spark partition per slice."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from kafscale.storage.scan import Slice, StoreOptions, arrow_batches, plan, read_slice

SCHEMA = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
          "timestampType int, headers array<struct<key: string, value: binary>>")


class _SlicePartition(InputPartition):
    def __init__(self, sl: Slice) -> None:
        super().__init__(sl)
        self.slice = sl


class KafScaleReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        o = {k.lower(): v for k, v in options.items()}
        if not o.get("topic"):
            raise ValueError("option 'topic' is required")
        self.topic = o["topic"]
        self.opts = StoreOptions.from_source_options(options)
        self.starting, self.ending = o.get("startingoffsets"), o.get("endingoffsets")
        self.starting_ts = int(o["startingtimestamp"]) if o.get("startingtimestamp") else None
        self.ending_ts = int(o["endingtimestamp"]) if o.get("endingtimestamp") else None
        self.max_bytes = int(o.get("maxbytesperpartition", 128 << 20))

    def partitions(self) -> list[InputPartition]:
        slices = asyncio.run(plan(self.opts, self.topic, self.starting, self.ending, self.starting_ts,
                                  self.ending_ts, self.max_bytes))
        return [_SlicePartition(s) for s in slices]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        sl: Slice = partition.slice  # type: ignore[attr-defined]
        yield from arrow_batches(sl, read_slice(self.opts, sl))


class KafScaleDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "kafscale"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafScaleReader(self.options)
