"""End-to-end produce benchmark against one real SeaweedFS, in one run:

1. raw S3 PUT MB/s: 8 MiB objects, one PUT at a time, aioboto3 (the baseline);
2. broker produce MB/s: librdkafka producer, acks=all, 1 KiB records;
3. broker produce records/s with 100-byte records;

then prints each broker figure as a ratio of the baseline.

    python bench/e2e.py [--mib 256] [--partitions 1]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY, DevStack, free_port
from kafscale.storage.objectstore import ObjectStore


async def raw_put_mbps(stack: DevStack, total_mib: int, object_mib: int = 8) -> tuple[float, list[float]]:
    store = ObjectStore(stack.bucket, stack.s3_endpoint, access_key=DEV_ACCESS_KEY, secret_key=DEV_SECRET_KEY,
                        multipart_threshold=1 << 40)
    data = os.urandom(object_mib << 20)
    latencies = []
    async with store:
        await store.put(f"bench/warmup-{uuid.uuid4()}", data[:1 << 20], if_none_match=False)
        t0 = time.perf_counter()
        for i in range(max(total_mib // object_mib, 1)):
            t = time.perf_counter()
            await store.put(f"bench/raw-{uuid.uuid4()}-{i}", data)
            latencies.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t0
        await store.delete_prefix("bench/")
    return len(latencies) * object_mib / elapsed, latencies


def start_broker(stack: DevStack, logdir: Path, **cfg: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, **stack.broker_env(), KAFSCALE_LISTEN=f"127.0.0.1:{port}",
               KAFSCALE_CLUSTER=f"bench{uuid.uuid4().hex[:6]}", KAFSCALE_LOG_LEVEL="WARNING",
               **{f"KAFSCALE_{k.upper()}": v for k, v in cfg.items()})
    log = open(logdir / f"broker-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kafscale.cli", "broker"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=1)
            return proc, bootstrap
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("broker did not start")


def produce(bootstrap: str, topic: str, partitions: int, record_size: int, total_bytes: int) -> tuple[float, int]:
    """Returns (seconds, records) for acks=all delivery of total_bytes."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5, "batch.size": 1_000_000,
                  "queue.buffering.max.kbytes": 512 * 1024, "queue.buffering.max.messages": 1_000_000,
                  "compression.type": "none"})
    value = os.urandom(record_size)
    n = total_bytes // record_size
    errors = []

    def cb(err, _msg) -> None:
        if err is not None:
            errors.append(err)

    t0 = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=value, on_delivery=cb, partition=i % partitions)
                break
            except BufferError:
                p.poll(0.005)
        if i % 1000 == 0:
            p.poll(0)
    remaining = p.flush(300)
    elapsed = time.perf_counter() - t0
    if remaining or errors:
        raise RuntimeError(f"{remaining} undelivered, {len(errors)} errors: {errors[:3]}")
    return elapsed, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB to write in each measurement")
    ap.add_argument("--partitions", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kafscale-bench-") as tmp:
        stack = DevStack(data_dir=tmp).start()
        try:
            raw, lat = asyncio.run(raw_put_mbps(stack, args.mib))
            lat.sort()
            proc, bootstrap = start_broker(stack, Path(tmp))
            try:
                admin = AdminClient({"bootstrap.servers": bootstrap})
                for t in ("bench1k", "bench100"):
                    admin.create_topics([NewTopic(t, args.partitions, 1)])[t].result(30)
                secs, n = produce(bootstrap, "bench1k", args.partitions, 1024, args.mib << 20)
                mbps = n * 1024 / secs / (1 << 20)
                secs100, n100 = produce(bootstrap, "bench100", args.partitions, 100, min(args.mib, 64) << 20)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        finally:
            stack.stop()
    print(f"raw S3 PUT (8 MiB objects, 1 in flight): {raw:8.1f} MiB/s  "
          f"p50 {lat[len(lat) // 2] * 1000:.0f} ms  p99 {lat[int(len(lat) * 0.99)] * 1000:.0f} ms")
    print(f"broker produce 1 KiB records, acks=all:  {mbps:8.1f} MiB/s  ({n} records, {args.partitions} partition(s))")
    print(f"ratio broker / raw PUT:                  {mbps / raw:8.2f}")
    mbps100 = n100 * 100 / secs100 / (1 << 20)
    print(f"broker produce 100 B records, acks=all:  {n100 / secs100:8.0f} records/s "
          f"({mbps100:.1f} MiB/s, ratio to raw PUT {mbps100 / raw:.2f})")


if __name__ == "__main__":
    main()
