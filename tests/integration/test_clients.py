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


@pytest.mark.parametrize("codec", CODECS)
def test_confluent_kafka(broker, topic_name, codec):
    create_topic(broker.bootstrap, topic_name)
    sent = sample_records(N, f"ck-{codec}")
    offsets = confluent_produce(broker.bootstrap, topic_name, sent, codec)
    check_readback(confluent_consume(broker.bootstrap, topic_name, N), sent, offsets)
    check_readback(aiokafka_consume(broker.bootstrap, topic_name, N), sent, offsets)


@pytest.mark.parametrize("codec", CODECS)
def test_kafka_python(broker, topic_name, codec):
    """kafka-python's defaults (idempotent producer, acks=all) work unchanged."""
    sent = sample_records(N, f"kp-{codec}")
    offsets = kafka_python_produce(broker.bootstrap, topic_name, sent, None if codec == "none" else codec)
    check_readback(kafka_python_consume(broker.bootstrap, topic_name, N), sent, offsets)
    check_readback(confluent_consume(broker.bootstrap, topic_name, N), sent, offsets)


@pytest.mark.parametrize("codec", CODECS)
def test_aiokafka(broker, topic_name, codec):
    sent = sample_records(N, f"ak-{codec}")
    offsets = aiokafka_produce(broker.bootstrap, topic_name, sent, None if codec == "none" else codec)
    check_readback(aiokafka_consume(broker.bootstrap, topic_name, N), sent, offsets)
    check_readback(kafka_python_consume(broker.bootstrap, topic_name, N), sent, offsets)


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
    check_readback(confluent_consume(broker.bootstrap, topic_name, len(sent)), sent, offsets)
    check_readback(kafka_python_consume(broker.bootstrap, topic_name, len(sent)), sent, offsets)
    check_readback(aiokafka_consume(broker.bootstrap, topic_name, len(sent)), sent, offsets)
