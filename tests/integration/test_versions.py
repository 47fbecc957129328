"""Every advertised version of the data-path APIs, byte-exact through our
codec: Produce v3-v9, Fetch v4-v13 (topic ids from v13), Metadata v0-v12,
ListOffsets v0-v7."""
from __future__ import annotations

from kafscale import _native
from kafscale.protocol.schemas import API_VERSIONS, APIS, FETCH, LIST_OFFSETS, METADATA, PRODUCE
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
        assert values == [b"produce v%d" % i for i in range(5, 10)], v  # offsets 2.. were produced at v5..

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

    # Fetch v13 with an unknown topic id
    body = {"max_wait_ms": 0, "min_bytes": 0, "topics": [{"topic_id": b"\x01" * 16, "partitions": [
        {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 100}]}]}
    assert c.request(FETCH.key, 13, body)["responses"][0]["partitions"][0]["error_code"] == 100  # UNKNOWN_TOPIC_ID
    c.close()
