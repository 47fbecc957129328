"""The command-line client's pieces that need no broker: Kafka's murmur2
partitioner (checked against kafka-python's), the range assignor, and SCRAM
and PLAIN against the broker's own SASL server."""
from __future__ import annotations

import asyncio
import random

import pytest
from kafka.partitioner.default import murmur2 as kafka_python_murmur2

from kafscale.client import Credentials, KafkaClient, scram_exchange
from kafscale.protocol.errors import KafkaError
from kafscale.records import GroupMember, murmur2, partition_for
from kafscale.security.sasl import SaslExchange, SaslFailed, make_credentials


def test_murmur2_matches_kafkas_partitioner():
    rng = random.Random(7)
    keys = [rng.randbytes(n) for n in range(40) for _ in range(25)] + [b"", b"key-1", "ключ".encode()]
    for key in keys:
        assert murmur2(key) & 0x7FFFFFFF == kafka_python_murmur2(key) & 0x7FFFFFFF, key
        assert partition_for(key, 7) == (kafka_python_murmur2(key) & 0x7FFFFFFF) % 7


class _Topics:
    async def topics(self, names):
        return [{"name": n, "partitions": [{}] * {"a": 5, "b": 2}[n]} for n in names]


def test_range_assignor_splits_each_topic_in_runs_like_kafkas():
    from kafscale.client import encode_subscription

    member = GroupMember(_Topics(), "g", ["a"])  # type: ignore[arg-type]
    members = [{"member_id": "m2", "metadata": encode_subscription(["a", "b"])},
               {"member_id": "m1", "metadata": encode_subscription(["a"])}]
    got = asyncio.run(member._assign(members))
    assert got == {"m1": {"a": [0, 1, 2]}, "m2": {"a": [3, 4], "b": [0, 1]}}


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_client_authenticates_with_the_broker_side(mechanism):
    stored = {"al,i=ce": make_credentials("pw")}

    async def lookup(user):
        return stored.get(user)

    async def run(password):
        server = SaslExchange(mechanism, lookup)
        await scram_exchange(mechanism, Credentials("al,i=ce", password), server.step)
        return server.principal

    assert asyncio.run(run("pw")) == "User:al,i=ce"
    with pytest.raises((KafkaError, SaslFailed)):
        asyncio.run(run("wrong"))


def test_client_refuses_a_dead_address_in_one_line():
    async def go():
        async with KafkaClient("127.0.0.1:1"):
            pass

    with pytest.raises(OSError, match=r"cannot connect to 127\.0\.0\.1:1"):
        asyncio.run(go())
