"""Produce then consume with every real client and every codec."""
from __future__ import annotations

import os

import pytest

from tests.integration.clients import (
    Rec,
    aiokafka_consume,
    aiokafka_produce,
    confluent_consume,
    confluent_produce,
    create_topic,
    kafka_python_consume,
    kafka_python_produce,
    kcat,
    sample_records,
)

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
N = 60


def check_readback(got: list[tuple[int, Rec]], sent: list[Rec], offsets: list[int]) -> None:
    assert offsets == list(range(offsets[0], offsets[0] + len(sent))), "offsets must be contiguous, in order"
    assert [o for o, _ in got] == offsets
    assert [r for _, r in got] == sent


def _python_codec(codec: str) -> str | None:
    return None if codec == "none" else codec


# producer, then the consumers that read its records back (its own library and another one)
CLIENTS = {
    "confluent-kafka": (lambda b, t, recs, codec: confluent_produce(b, t, recs, codec),
                        [confluent_consume, aiokafka_consume]),
    "kafka-python": (lambda b, t, recs, codec: kafka_python_produce(b, t, recs, _python_codec(codec)),
                     [kafka_python_consume, confluent_consume]),
    "aiokafka": (lambda b, t, recs, codec: aiokafka_produce(b, t, recs, _python_codec(codec)),
                 [aiokafka_consume, kafka_python_consume]),
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("client", list(CLIENTS))
def test_client_round_trip(broker, topic_name, client, codec):
    """Defaults of each library work unchanged (kafka-python: idempotent producer,
    acks=all); the kafka-python and aiokafka cases rely on auto-create."""
    if client == "confluent-kafka":
        create_topic(broker.bootstrap, topic_name)
    produce, consumers = CLIENTS[client]
    sent = sample_records(N, f"{client}-{codec}")
    offsets = produce(broker.bootstrap, topic_name, sent, codec)
    for consume in consumers:
        check_readback(consume(broker.bootstrap, topic_name, N), sent, offsets)


@pytest.mark.parametrize("codec", CODECS)
def test_kcat(broker, topic_name, codec):
    lines = [f"key{i}\tvalue-{i}-{codec}" for i in range(N)]
    kcat("-P", "-b", broker.bootstrap, "-t", topic_name, "-K", "\t", "-z", codec, "-H", "origin=kcat",
         input=("\n".join(lines) + "\n").encode())
    out = kcat("-C", "-b", broker.bootstrap, "-t", topic_name, "-e", "-q", "-f", "%o|%k|%s|%h\n").decode()
    assert out.splitlines() == [f"{i}|key{i}|value-{i}-{codec}|origin=kcat" for i in range(N)]
    got = confluent_consume(broker.bootstrap, topic_name, N)
    assert [r.headers for _, r in got] == [(("origin", b"kcat"),)] * N


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_large_records(broker, topic_name, codec):
    """1 MiB values (incompressible) round-trip through every consumer."""
    create_topic(broker.bootstrap, topic_name)
    sent = [Rec(f"big-{i}".encode(), os.urandom(1024 * 1024), (("n", str(i).encode()),)) for i in range(4)]
    offsets = confluent_produce(broker.bootstrap, topic_name, sent, codec)
    for consume in (confluent_consume, kafka_python_consume, aiokafka_consume):
        check_readback(consume(broker.bootstrap, topic_name, len(sent)), sent, offsets)
