"""`kafscale topics`, `kafscale groups`, `kafscale produce` and `kafscale
consume` against a running broker, checked with librdkafka and kafka-python."""
from __future__ import annotations

import subprocess
import sys

from confluent_kafka import Consumer, TopicPartition
from kafka.partitioner.default import murmur2

from tests.integration.clients import create_topic
from tests.integration.test_groups import PARTITIONS, Member, produce_spread, wait_for


def cli(*args: str, ok: bool = True, stdin: str | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "kafscale.cli", *args], capture_output=True, text=True, timeout=60,
                       input=stdin)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout + r.stderr


def test_produce_and_consume_commands(broker, topic_name):
    """Lines in, records out: keys land where Kafka's Java partitioner puts
    them (kafka-python's murmur2), a line without the separator is reported
    by number and fails the command, a group consumer resumes where the last
    one committed, and librdkafka sees the commits."""
    create_topic(broker.bootstrap, topic_name, partitions=4)
    lines = [f"key-{i}:value-{i}" for i in range(200)]
    out = cli("produce", topic_name, "--key-separator", ":", "--bootstrap", broker.bootstrap, ok=False,
              stdin="\n".join([*lines[:100], "no separator here", *lines[100:]]) + "\n")
    assert "line 101 not written: no key separator ':'" in out and "200 records written" in out and "1 failed" in out
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"{topic_name}-c", "enable.auto.commit": False})
    c.assign([TopicPartition(topic_name, p, 0) for p in range(4)])
    seen = {}
    while len(seen) < 200:
        m = c.poll(10)
        assert m is not None and not m.error(), m and m.error()
        seen[m.key()] = (m.partition(), m.value())
    assert all(p == (murmur2(k) & 0x7FFFFFFF) % 4 and v == k.replace(b"key", b"value") for k, (p, v) in seen.items())

    group, args = f"{topic_name}-g", ("--bootstrap", broker.bootstrap)
    first = cli("consume", topic_name, "--group", group, "--from-beginning", "-n", "50", "--print-key", *args)
    rest = cli("consume", topic_name, "--group", group, "-e", "--print-key", *args)
    got = [line.split("\t") for text in (first, rest) for line in text.splitlines() if "\t" in line]
    assert sorted(got) == sorted([f"key-{i}", f"value-{i}"] for i in range(200)), "each record once, none lost"
    assert "Processed a total of 50 messages" in first and "Processed a total of 150 messages" in rest
    reader = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    committed = reader.committed([TopicPartition(topic_name, p) for p in range(4)], timeout=10)
    reader.close()
    c.close()
    assert sum(tp.offset for tp in committed) == 200
    one = cli("consume", topic_name, "--partition", "2", "--offset", "3", "-e", *args)
    assert one.count("value-") == sum(1 for p, _ in seen.values() if p == 2) - 3
    for cmd, why in ((["produce", "no topic!"], "INVALID_TOPIC_EXCEPTION"),
                     (["consume", topic_name, "--partition", "9", "-e"], "has no partition 9"),
                     (["consume", topic_name, "--from", "noon"], "neither ISO 8601")):
        err = cli(*cmd, *args, ok=False, stdin="x\n")
        assert why in err and len(err.strip().splitlines()) == 1, err


def test_topics_tools(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=2, config={"retention.ms": "86400000"})
    assert f"{topic_name}\t2 partitions" in cli("topics", "ls", "--bootstrap", broker.bootstrap)
    cli("topics", "alter", topic_name, "--partitions", "4", "--config", "retention.bytes=5000000",
        "--delete-config", "retention.ms", "--bootstrap", broker.bootstrap)
    out = cli("topics", "describe", topic_name, "--bootstrap", broker.bootstrap)
    assert "Partitions: 4" in out and "retention.bytes=5000000\n" in out and "retention.ms=604800000 (default)" in out
    bad = cli("topics", "alter", topic_name, "--config", "cleanup.policy=compact", "--bootstrap", broker.bootstrap,
              ok=False)
    assert "INVALID_CONFIG" in bad


def test_groups_tools_show_members_and_lag(broker, topic_name, tmp_path):
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    produce_spread(broker.bootstrap, topic_name, 400)
    group = f"g-{topic_name}"
    m = Member("confluent", broker.bootstrap, group, topic_name, tmp_path / "m.txt")
    try:
        wait_for(lambda: len(m.processed()) == 400, 60, "the member to consume everything")
        out = cli("groups", "describe", group, "--bootstrap", broker.bootstrap)
        assert "state Stable" in out and "1 members" in out
        rows = [line.split() for line in out.splitlines() if line.startswith(topic_name)]
        assert len(rows) == PARTITIONS
        assert all(r[2] == "100" and r[3] == "100" and r[4] == "0" and r[5].startswith("rdkafka") for r in rows)
        assert f"{group}\tStable" in cli("groups", "ls", "--bootstrap", broker.bootstrap)
        refused = cli("groups", "reset-offsets", group, "--topic", topic_name, "--to-earliest", "--execute",
                      "--bootstrap", broker.bootstrap, ok=False)
        assert "active members" in refused
    finally:
        m.stop()
    wait_for(lambda: "state Empty" in cli("groups", "describe", group, "--bootstrap", broker.bootstrap), 30,
             "the group to empty")
    dry = cli("groups", "reset-offsets", group, "--topic", topic_name, "--to-offset", "40", "--bootstrap",
              broker.bootstrap)
    assert "dry run" in dry
    cli("groups", "reset-offsets", group, "--topic", topic_name, "--to-offset", "40", "--execute", "--bootstrap",
        broker.bootstrap)
    rows = [line.split() for line in cli("groups", "describe", group, "--bootstrap", broker.bootstrap).splitlines()
            if line.startswith(topic_name)]
    assert [(r[2], r[4]) for r in rows] == [("40", "60")] * PARTITIONS
