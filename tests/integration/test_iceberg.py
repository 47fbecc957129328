"""`kafscale processor iceberg` against a real broker, etcd and SeaweedFS: a
processor killed mid-way and restarted loses nothing, its duplicates stay
within one commit, and Spark reads the table's Parquet files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.clients import Rec, confluent_produce, create_topic

pytest.importorskip("pyspark")
NoSuchTableError = pytest.importorskip("pyiceberg.exceptions").NoSuchTableError

MAX_RECORDS = 300
PER_PARTITION = 2000


def processor(broker, tmp_path, topic: str, warehouse: str | None, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **broker.stack.broker_env(), KAFSCALE_CLUSTER=broker.cluster,
               KAFSCALE_NAMESPACE=broker.cluster)
    args = [sys.executable, "-m", "kafscale.cli", "processor", "iceberg", "--topic", topic, "--table", "sales.orders",
            "--catalog", f"sqlite:///{tmp_path}/catalog.db", "--mapping", str(tmp_path / "mapping.yaml"),
            "--max-records", str(MAX_RECORDS), "--interval", "0.2", *extra]
    if warehouse:
        args += ["--warehouse", warehouse]
    log = open(tmp_path / "processor.log", "ab")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def load_table(broker, tmp_path):
    """The table as any pyiceberg user opens it (S3 settings for an S3 warehouse).
    A reader never creates the catalog's own tables: pyiceberg checks for them
    and then creates them, so a reader and the processor starting on a new
    catalog both found none and the second CREATE TABLE failed."""
    from pyiceberg.catalog import load_catalog

    env = broker.stack.broker_env()
    return load_catalog("kafscale", type="sql", uri=f"sqlite:///{tmp_path}/catalog.db", **{
        "init_catalog_tables": "false",
        "s3.endpoint": env["KAFSCALE_S3_ENDPOINT"], "s3.access-key-id": env["KAFSCALE_S3_ACCESS_KEY"],
        "s3.secret-access-key": env["KAFSCALE_S3_SECRET_KEY"], "s3.region": "us-east-1"}).load_table("sales.orders")


def table_rows(broker, tmp_path) -> int:
    from sqlalchemy.exc import OperationalError

    try:
        return load_table(broker, tmp_path).scan().to_arrow().num_rows
    except (NoSuchTableError, OperationalError):  # not created yet (the table, or the catalog's own tables)
        return 0


@pytest.mark.parametrize("warehouse", ["s3", "file"])
def test_processor_restart_loses_nothing_and_spark_reads_the_table(broker, topic_name, tmp_path, spark, warehouse):
    """Default warehouse (s3://bucket/iceberg in SeaweedFS) or a local one,
    which Spark here can read without S3 connector jars."""
    where = None if warehouse == "s3" else f"file://{tmp_path}/warehouse"
    (tmp_path / "mapping.yaml").write_text(
        "columns:\n"
        "  - {name: order_id, path: id, type: long}\n"
        "  - {name: amount, path: total.amount, type: double}\n"
        "  - {name: customer, path: customer, type: string}\n")
    create_topic(broker.bootstrap, topic_name, partitions=2)
    want = {}
    for p in range(2):
        recs = [Rec(None, json.dumps({"id": p * 10_000 + i, "total": {"amount": i / 4},
                                      "customer": f"c{i % 7}"}).encode()) for i in range(PER_PARTITION)]
        recs[7] = Rec(None, b"not json")
        for o, r in zip(confluent_produce(broker.bootstrap, topic_name, recs, partition=p), recs, strict=True):
            want[(p, o)] = r.value

    first = processor(broker, tmp_path, topic_name, where)
    try:
        deadline = time.monotonic() + 120
        while table_rows(broker, tmp_path) < 3 * MAX_RECORDS and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "processor.log").read_text()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    mid = table_rows(broker, tmp_path)
    assert 0 < mid < len(want), "killed in the middle"

    second = processor(broker, tmp_path, topic_name, where, "--once")
    assert second.wait(180) == 0, (tmp_path / "processor.log").read_text()[-3000:]

    table = load_table(broker, tmp_path)
    rows = table.scan().to_arrow().to_pylist()
    seen = Counter((r["partition"], r["offset"]) for r in rows)
    assert set(seen) == set(want), "every record materialized"
    duplicates = sum(n - 1 for n in seen.values())
    assert duplicates <= MAX_RECORDS, f"{duplicates} duplicates: more than one commit was replayed"
    print(f"at-least-once: {duplicates} duplicate rows after the restart")
    for r in rows:
        assert r["value"] == want[(r["partition"], r["offset"])]
        if r["value"] == b"not json":
            assert (r["order_id"], r["amount"], r["customer"]) == (None, None, None)
        else:
            doc = json.loads(r["value"])
            assert (r["order_id"], r["amount"], r["customer"]) == (doc["id"], doc["total"]["amount"],
                                                                   doc["customer"])

    files = [t.file.file_path for t in table.scan().plan_files()]
    assert all(f.startswith(f"s3://{broker.stack.bucket}/iceberg/" if where is None else "file://") for f in files)
    if where is None:
        return
    df = spark.read.parquet(*files)
    assert df.count() == len(rows)
    assert {"topic", "partition", "offset", "timestamp", "key", "value", "order_id", "amount"} <= set(df.columns)
