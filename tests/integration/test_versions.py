"""Every advertised version of the data-path APIs, byte-exact through our
codec: Produce, Fetch (topic ids from v13), Metadata, ListOffsets (and its
special timestamps), OffsetCommit/OffsetFetch (topic ids from v10) and
DescribeGroups (GROUP_ID_NOT_FOUND from v6)."""
from __future__ import annotations

from kafscale import _native
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import (
    API_VERSIONS,
    APIS,
    DESCRIBE_GROUPS,
    FETCH,
    FIND_COORDINATOR,
    LIST_OFFSETS,
    METADATA,
    OFFSET_COMMIT,
    OFFSET_FETCH,
    PRODUCE,
)
from kafscale.protocol.types import EARLIEST_LOCAL, LATEST_TIERED
from tests.integration.clients import create_topic
from tests.integration.rawclient import RawClient


def test_api_versions_advertises_exactly_what_is_implemented(broker):
    c = RawClient(broker.bootstrap)
    for v in range(API_VERSIONS.min_version, API_VERSIONS.max_version + 1):
        body = c.request(API_VERSIONS.key, v, {"client_software_name": "t", "client_software_version": "1"})
        assert body["error_code"] == 0
        assert {k["api_key"]: (k["min_version"], k["max_version"]) for k in body["api_keys"]} == {
            a.key: (a.min_version, a.max_version) for a in APIS.values()}
    c.close()
    # kafka-python infers the broker's Kafka version from these ranges (it was 3.3 before Kafka 4.1's versions)
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert admin._client.check_version() >= (4, 0)
    finally:
        admin.close()


def test_all_versions_produce_fetch_metadata_list_offsets(broker, topic_name):
    create_topic(broker.bootstrap, topic_name)
    c = RawClient(broker.bootstrap)
    md = c.request(METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}]})
    topic_id = md["topics"][0]["topic_id"]
    assert topic_id != bytes(16)

    expected = 0
    for v in range(PRODUCE.min_version, PRODUCE.max_version + 1):
        batch = _native.build_batch([(1000 + v, b"k%d" % v, b"produce v%d" % v, [("v", b"%d" % v)])], codec=v % 5)
        body = {"acks": -1, "timeout_ms": 10000,
                "topic_data": [{"name": topic_name, "partition_data": [{"index": 0, "records": batch}]}]}
        r = c.request(PRODUCE.key, v, body)["responses"][0]["partition_responses"][0]
        assert (r["error_code"], r["base_offset"]) == (0, expected), (v, r)
        expected += 1

    for v in range(FETCH.min_version, FETCH.max_version + 1):
        body = {"max_wait_ms": 0, "min_bytes": 0, "max_bytes": 1 << 20, "isolation_level": 0,
                "topics": [{"topic": topic_name, "topic_id": topic_id,
                            "partitions": [{"partition": 0, "fetch_offset": 2, "partition_max_bytes": 1 << 20}]}]}
        resp = c.request(FETCH.key, v, body)
        t = resp["responses"][0]
        if v >= 13:
            assert t["topic_id"] == topic_id
        else:
            assert t["topic"] == topic_name
        p = t["partitions"][0]
        assert (p["error_code"], p["high_watermark"]) == (0, expected), (v, p)
        records = bytes(p["records"])
        values = [rec[3] for b in _native.scan_batches(records, True) for rec in _native.iter_records(b, records)]
        assert values == [b"produce v%d" % i for i in range(5, PRODUCE.max_version + 1)], v  # offset 2 was v5

    for v in range(METADATA.min_version, METADATA.max_version + 1):
        body = {"topics": [{"name": topic_name, "topic_id": bytes(16)}], "allow_auto_topic_creation": False}
        md = c.request(METADATA.key, v, body)
        assert md["brokers"][0]["port"] == int(broker.bootstrap.rsplit(":", 1)[1])
        t = md["topics"][0]
        assert (t["error_code"], t["name"], len(t["partitions"])) == (0, topic_name, 1), v

    for v in range(LIST_OFFSETS.min_version, LIST_OFFSETS.max_version + 1):
        body = {"replica_id": -1, "topics": [{"name": topic_name, "partitions": [
            {"partition_index": 0, "timestamp": -1, "max_num_offsets": 1}]}]}
        p = c.request(LIST_OFFSETS.key, v, body)["topics"][0]["partitions"][0]
        assert p["error_code"] == 0
        assert (p["old_style_offsets"] if v == 0 else [p["offset"]]) == [expected], v
    # v8+: the earliest offset on the broker's storage; v9+: the last one in remote storage.
    # Both storages are the object store: the log start and the last committed record.
    for v, ts, want in ((8, EARLIEST_LOCAL, 0), (9, LATEST_TIERED, expected - 1), (10, LATEST_TIERED, expected - 1)):
        body = {"replica_id": -1, "timeout_ms": 5000, "topics": [{"name": topic_name, "partitions": [
            {"partition_index": 0, "timestamp": ts}]}]}
        p = c.request(LIST_OFFSETS.key, v, body)["topics"][0]["partitions"][0]
        assert (p["error_code"], p["offset"]) == (0, want), (v, ts, p)

    # Fetch v13 with an unknown topic id
    body = {"max_wait_ms": 0, "min_bytes": 0, "topics": [{"topic_id": b"\x01" * 16, "partitions": [
        {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 100}]}]}
    assert c.request(FETCH.key, 13, body)["responses"][0]["partitions"][0]["error_code"] == 100  # UNKNOWN_TOPIC_ID
    c.close()


def test_offsets_by_topic_id_from_v10_and_unknown_groups_from_describe_groups_v6(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=2)
    c = RawClient(broker.bootstrap)
    topic_id = c.request(METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}]}
                         )["topics"][0]["topic_id"]
    group = f"{topic_name}-g"
    assert c.request(FIND_COORDINATOR.key, 4, {"key_type": 0, "coordinator_keys": [group]}
                     )["coordinators"][0]["error_code"] == 0
    unknown = b"\x07" * 16
    commit = {"group_id": group, "generation_id_or_member_epoch": -1, "member_id": "", "topics": [
        {"topic_id": topic_id,
         "partitions": [{"partition_index": 1, "committed_offset": 42, "committed_metadata": "m"}]},
        {"topic_id": unknown,
         "partitions": [{"partition_index": 0, "committed_offset": 1, "committed_metadata": ""}]}]}
    r = c.request(OFFSET_COMMIT.key, 10, commit)["topics"]
    assert [(t["topic_id"], t["partitions"][0]["error_code"]) for t in r] == [
        (topic_id, 0), (unknown, ErrorCode.UNKNOWN_TOPIC_ID)]

    def fetched(version: int, topics: list | None) -> list:
        body = {"groups": [{"group_id": group, "topics": topics}], "require_stable": False}
        return c.request(OFFSET_FETCH.key, version, body)["groups"][0]["topics"]

    by_id = fetched(10, [{"topic_id": topic_id, "partition_indexes": [1]},
                         {"topic_id": unknown, "partition_indexes": [0]}])
    assert [(t["topic_id"], [(p["committed_offset"], p["metadata"], p["error_code"]) for p in t["partitions"]])
            for t in by_id] == [(topic_id, [(42, "m", 0)]), (unknown, [(-1, "", ErrorCode.UNKNOWN_TOPIC_ID)])]
    every = fetched(10, None)  # all the group committed, named by id
    assert [(t["topic_id"], t["partitions"][0]["committed_offset"]) for t in every] == [(topic_id, 42)]
    by_name = fetched(9, [{"name": topic_name, "partition_indexes": [1]}])  # the same commit, seen by name
    assert (by_name[0]["name"], by_name[0]["partitions"][0]["committed_offset"]) == (topic_name, 42)

    groups = c.request(DESCRIBE_GROUPS.key, 6, {"groups": [group, "no-such-group"]})["groups"]
    assert [(g["group_id"], g["error_code"], g["group_state"]) for g in groups] == [
        (group, 0, "Empty"), ("no-such-group", ErrorCode.GROUP_ID_NOT_FOUND, "")]
    assert "does not exist" in groups[1]["error_message"]
    old = c.request(DESCRIBE_GROUPS.key, 5, {"groups": ["no-such-group"]})["groups"][0]
    assert (old["error_code"], old["group_state"]) == (0, "Dead")  # as Kafka before KIP-1043
    c.close()
