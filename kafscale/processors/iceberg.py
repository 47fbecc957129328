"""`kafscale processor iceberg`: materialize a topic's completed segments into
an Apache Iceberg table with pyiceberg, straight from S3 (no broker).

Each pass lists the committed segments in etcd, decodes the records after
the checkpoint (the next offset per partition, kept in etcd under
processors/iceberg:{table}/{topic}/{p}), appends them to the table in one
Iceberg commit and only then moves the checkpoint. A crash between the two
replays that pass: at-least-once, duplicates limited to one pass
(--max-records).

Columns: topic, partition, offset, timestamp, key, value, and with a YAML
mapping, columns taken from JSON values:

    columns:
      - {name: order_id, path: id, type: long}
      - {name: amount, path: total.amount, type: double}
    keep_value: false        # drop the raw value column (default true)

Types: string, long, int, double, boolean, timestamp (epoch milliseconds).
A value that is not JSON, or lacks a path, gives nulls."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import yaml

from kafscale import config as config_mod
from kafscale.metadata.store import MetaStore
from kafscale.storage.scan import Slice, StoreOptions, arrow_batches, list_segments
from kafscale.storage.segment import FOOTER_SIZE, HEADER_SIZE

log = logging.getLogger("kafscale.processor.iceberg")

ARROW_TYPES = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
               "boolean": pa.bool_(), "timestamp": pa.timestamp("us", tz="UTC")}
BASE_COLUMNS = [("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
                ("timestamp", pa.timestamp("us", tz="UTC")), ("key", pa.binary())]


@dataclass
class Mapping:
    columns: list[tuple[str, list[str], str]] = field(default_factory=list)  # name, JSON path, type
    keep_value: bool = True

    @classmethod
    def load(cls, path: str | None) -> Mapping:
        if not path:
            return cls()
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
        cols = []
        for c in doc.get("columns", []):
            if c.get("type", "string") not in ARROW_TYPES:
                raise ValueError(f"column {c.get('name')!r}: type must be one of {sorted(ARROW_TYPES)}")
            cols.append((c["name"], str(c.get("path", c["name"])).split("."), c.get("type", "string")))
        return cls(cols, bool(doc.get("keep_value", True)))

    def schema(self) -> pa.Schema:
        fields = list(BASE_COLUMNS) + ([("value", pa.binary())] if self.keep_value else [])
        return pa.schema(fields + [(name, ARROW_TYPES[t]) for name, _, t in self.columns])

    def extract(self, value: bytes | None) -> list[Any]:
        if not self.columns:
            return []
        try:
            doc = json.loads(value) if value is not None else None
        except ValueError:
            doc = None
        return [_convert(_dig(doc, path), t) for _, path, t in self.columns]


def _dig(doc: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def _convert(v: Any, t: str) -> Any:
    if v is None:
        return None
    try:
        if t == "string":
            return v if isinstance(v, str) else json.dumps(v)
        if t in ("long", "int"):
            return int(v)
        if t == "double":
            return float(v)
        if t == "boolean":
            return bool(v)
        return int(v) * 1000  # timestamp: epoch ms to us
    except (TypeError, ValueError):
        return None


def catalog_properties(catalog: str, warehouse: str | None, cfg: config_mod.Config) -> dict[str, str]:
    """An http(s) URL is a REST catalog; anything else a SQL catalog URI
    (default sqlite). The warehouse defaults to s3://{bucket}/iceberg with the
    broker's S3 settings."""
    props = {"type": "rest", "uri": catalog} if catalog.startswith(("http://", "https://")) else \
        {"type": "sql", "uri": catalog}
    props["warehouse"] = warehouse or f"s3://{cfg.bucket}/iceberg"
    for key, value in (("s3.endpoint", cfg.s3_endpoint), ("s3.region", cfg.s3_region),
                       ("s3.access-key-id", cfg.s3_access_key), ("s3.secret-access-key", cfg.s3_secret_key)):
        if value:
            props[key] = value
    return props


class IcebergProcessor:
    def __init__(self, cfg: config_mod.Config, topic: str, table: str, catalog: dict[str, str], mapping: Mapping,
                 max_records: int = 500_000) -> None:
        self.cfg, self.topic, self.table_name, self.mapping = cfg, topic, table, mapping
        self.catalog_props = catalog
        self.max_records = max_records
        self.opts = StoreOptions.from_config(cfg)
        self.name = f"iceberg:{table}"
        self.schema = mapping.schema()
        self.table: Any = None

    def open_table(self) -> Any:
        # pyarrow's AWS SDK signs uploads with streaming checksums by default,
        # which S3-compatible stores such as SeaweedFS reject; ask for the
        # checksums only where the S3 API requires them.
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog("kafscale", **self.catalog_props)
        ns = tuple(self.table_name.split(".")[:-1])
        if ns:
            catalog.create_namespace_if_not_exists(ns)
        return catalog.create_table_if_not_exists(self.table_name, schema=self.schema)

    async def run_pass(self, meta: MetaStore) -> int:
        """Materialize what is new, up to max_records; returns how many records."""
        done = await meta.load_checkpoint(self.name, self.topic)
        parts: list[pa.RecordBatch] = []
        taken = 0
        moved: dict[int, int] = {}
        async with self.opts.store() as store:
            for p, (segs, log_start, _hw) in sorted((await list_segments(self.opts, self.topic)).items()):
                start = done.get(p, log_start)
                if start < log_start:
                    log.warning("%s/%d: offsets %d..%d were deleted by retention before they were materialized",
                                self.topic, p, start, log_start - 1)
                    start = log_start
                for s in segs:
                    if s.last < start or taken >= self.max_records:
                        continue
                    end = min(s.last + 1, start + self.max_records - taken)  # offsets are dense in a segment
                    data = await store.get(s.key, s.start + HEADER_SIZE, s.start + s.size - FOOTER_SIZE)
                    for batch in arrow_batches(Slice(self.topic, p, s.key, HEADER_SIZE, 0, start, end), data):
                        parts.append(self._columns(batch))
                        taken += batch.num_rows
                    start = moved[p] = end
        if not moved:
            return 0
        if taken:
            table = pa.Table.from_batches(parts, schema=self.schema)
            await asyncio.to_thread(self.table.append, table)
        await meta.save_checkpoint(self.name, self.topic, moved)
        log.info("materialized %d records of %s into %s; next offsets %s", taken, self.topic, self.table_name, moved)
        return taken

    def _columns(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A decoded record batch in the table's columns."""
        cols = [batch.column(name) for name, _ in BASE_COLUMNS]
        if self.mapping.keep_value:
            cols.append(batch.column("value"))
        if self.mapping.columns:
            extracted = [self.mapping.extract(v) for v in batch.column("value").to_pylist()]
            cols += [pa.array([e[i] for e in extracted], ARROW_TYPES[t])
                     for i, (_, _, t) in enumerate(self.mapping.columns)]
        return pa.RecordBatch.from_arrays(cols, schema=self.schema)

    async def run(self, interval_s: float, once: bool) -> None:
        self.table = await asyncio.to_thread(self.open_table)
        meta = MetaStore.from_config(self.cfg)
        await meta.start()
        try:
            while True:
                n = await self.run_pass(meta)
                if n < self.max_records:
                    if once:
                        return
                    await asyncio.sleep(interval_s)
        finally:
            await meta.close()


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proc = IcebergProcessor(cfg, args.topic, args.table, catalog_properties(args.catalog, args.warehouse, cfg),
                                Mapping.load(args.mapping), args.max_records)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kafscale processor iceberg: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(proc.run(args.interval, args.once))
    except KeyboardInterrupt:
        pass
    return 0
