"""`kafscale topics` and `kafscale groups` against a running broker."""
from __future__ import annotations

import subprocess
import sys

from tests.integration.clients import create_topic
from tests.integration.test_groups import PARTITIONS, Member, produce_spread, wait_for


def cli(*args: str, ok: bool = True) -> str:
    r = subprocess.run([sys.executable, "-m", "kafscale.cli", *args], capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    return r.stdout + r.stderr


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
