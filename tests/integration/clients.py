"""Thin helpers over the real Kafka clients used by the integration tests."""
from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


@dataclass(frozen=True)
class Rec:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


def sample_records(n: int, tag: str) -> list[Rec]:
    """Keys, null keys, null values and headers, mixed (never both null: kafka-python refuses that)."""
    out = []
    for i in range(n):
        value = None if i % 11 == 5 else f"{tag}-value-{i}-".encode() * (1 + i % 5)
        key = None if i % 7 == 3 and value is not None else f"{tag}-key-{i}".encode()
        headers = (("h1", f"v{i}".encode()), ("trace", tag.encode())) if i % 3 == 0 else ()
        out.append(Rec(key, value, headers))
    return out


def create_topic(bootstrap: str, name: str, partitions: int = 1, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    fut = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})])
    fut[name].result(30)


def confluent_produce(bootstrap: str, topic: str, recs: list[Rec], codec: str = "none", partition: int = 0,
                      timestamps: list[int] | None = None, **extra: object) -> list[int]:
    """Produce with librdkafka, acks=all (with the given CreateTime timestamps,
    ms); returns the offsets in input order."""
    p = Producer({"bootstrap.servers": bootstrap, "compression.type": codec, "acks": "all", "linger.ms": 5,
                  "message.max.bytes": 4 * 1024 * 1024, **extra})
    offsets: list[int] = [-1] * len(recs)
    errors: list[object] = []

    def report(i: int):
        def cb(err, msg) -> None:
            if err is not None:
                errors.append(err)
            else:
                offsets[i] = msg.offset()
        return cb

    for i, r in enumerate(recs):
        p.produce(topic, value=r.value, key=r.key, headers=list(r.headers) or None, partition=partition,
                  on_delivery=report(i), timestamp=timestamps[i] if timestamps else 0)
        p.poll(0)
    assert p.flush(60) == 0, "messages still queued after 60s"
    assert not errors, errors
    return offsets


def confluent_consume(bootstrap: str, topic: str, n: int, partition: int = 0, start: int = 0,
                      timeout: float = 60) -> list[tuple[int, Rec]]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "kafscale-test-reader", "enable.auto.commit": False,
                  "fetch.message.max.bytes": 4 * 1024 * 1024})
    c.assign([TopicPartition(topic, partition, start)])
    out: list[tuple[int, Rec]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append((msg.offset(), Rec(msg.key(), msg.value(), tuple(msg.headers() or ()))))
    finally:
        c.close()
    return out


# Python clients take security settings as keyword arguments (security_protocol, sasl_mechanism, ...).
def kafka_python_produce(bootstrap: str, topic: str, recs: list[Rec], codec: str | None, **security: str
                         ) -> list[int]:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=5,
                      max_request_size=4 * 1024 * 1024, **security)
    futs = [p.send(topic, value=r.value, key=r.key, headers=list(r.headers), partition=0) for r in recs]
    offsets = [f.get(timeout=60).offset for f in futs]
    p.close()
    return offsets


def kafka_python_consume(bootstrap: str, topic: str, n: int, timeout: float = 60, **security: str
                         ) -> list[tuple[int, Rec]]:
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest", max_partition_fetch_bytes=4 * 1024 * 1024, **security)
    c.assign([KTP(topic, 0)])
    c.seek_to_beginning()
    out: list[tuple[int, Rec]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        for msgs in c.poll(timeout_ms=500).values():
            out += [(m.offset, Rec(m.key, m.value, tuple(m.headers))) for m in msgs]
    c.close()
    return out


async def _aiokafka_produce(bootstrap: str, topic: str, recs: list[Rec], codec: str | None, **security: str
                            ) -> list[int]:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=5, acks="all",
                         max_request_size=4 * 1024 * 1024, **security)
    await p.start()
    try:
        futs = [await p.send(topic, value=r.value, key=r.key, headers=list(r.headers), partition=0) for r in recs]
        return [(await f).offset for f in futs]
    finally:
        await p.stop()


async def _aiokafka_consume(bootstrap: str, topic: str, n: int, wait_s: float, **security: str
                            ) -> list[tuple[int, Rec]]:
    from aiokafka import AIOKafkaConsumer
    from aiokafka import TopicPartition as ATP

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                         auto_offset_reset="earliest", max_partition_fetch_bytes=4 * 1024 * 1024, **security)
    await c.start()
    out: list[tuple[int, Rec]] = []
    try:
        c.assign([ATP(topic, 0)])
        await c.seek_to_beginning()
        deadline = time.monotonic() + wait_s
        while len(out) < n and time.monotonic() < deadline:
            for msgs in (await c.getmany(timeout_ms=500)).values():
                out += [(m.offset, Rec(m.key, m.value, tuple(m.headers))) for m in msgs]
    finally:
        await c.stop()
    return out


def aiokafka_produce(bootstrap: str, topic: str, recs: list[Rec], codec: str | None, **security: str) -> list[int]:
    return asyncio.run(_aiokafka_produce(bootstrap, topic, recs, codec, **security))


def aiokafka_consume(bootstrap: str, topic: str, n: int, timeout: float = 60, **security: str
                     ) -> list[tuple[int, Rec]]:
    return asyncio.run(_aiokafka_consume(bootstrap, topic, n, timeout, **security))


def kcat(*args: str, input: bytes | None = None, timeout: float = 60) -> bytes:
    r = subprocess.run(["kcat", *args], input=input, capture_output=True, timeout=timeout)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    return r.stdout
