"""The proxy's split and merge (proxy/proxy.py) without sockets: a request
naming partitions of several brokers goes out as one sub-request per broker
holding only that broker's partitions, the answers merge into one response
per topic, and a broker that fails answers NOT_LEADER_OR_FOLLOWER (offsets
-1) for its partitions only. The merged response must encode at the
client's version (strict encoding)."""
from __future__ import annotations

import asyncio

from kafscale.broker.context import RequestContext
from kafscale.config import Config
from kafscale.metadata.store import MetaStore
from kafscale.protocol import codec
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import LIST_OFFSETS, PRODUCE
from kafscale.proxy.proxy import Proxy, UpstreamError


def proxy_with(owners: dict[tuple[str, int], int], failing: set[int]) -> tuple[Proxy, dict[int, dict]]:
    proxy = Proxy(Config(), MetaStore.in_memory())
    proxy.cluster.brokers = {1: ("h1", 1), 2: ("h2", 2), 3: ("h3", 3)}
    proxy.cluster.owners = owners
    sent: dict[int, dict] = {}

    async def send(broker, hdr, body, expect_reply=True):
        sent[broker] = body
        if broker in failing:
            raise UpstreamError(f"broker {broker} went away")
        return {"throttle_time_ms": 0, "responses": [
            {"name": t["name"], "partition_responses": [
                {"index": p["index"], "error_code": 0, "base_offset": 100 * broker + p["index"],
                 "log_append_time_ms": -1, "log_start_offset": 0, "record_errors": [], "error_message": None}
                for p in t["partition_data"]]}
            for t in body["topic_data"]]}

    proxy._send = send  # type: ignore[method-assign]
    proxy._refresh_soon = lambda: None  # type: ignore[method-assign]
    return proxy, sent


def test_a_produce_is_split_by_owner_and_merged_back():
    owners = {("a", 0): 1, ("a", 1): 2, ("a", 2): 1, ("b", 0): 3}
    proxy, sent = proxy_with(owners, failing={3})
    req = {"transactional_id": None, "acks": -1, "timeout_ms": 1000, "topic_data": [
        {"name": "a", "partition_data": [{"index": i, "records": b"x"} for i in range(3)]},
        {"name": "b", "partition_data": [{"index": 0, "records": b"y"}]}]}
    hdr = RequestContext(PRODUCE.key, 9, 1, "c", True)
    resp = asyncio.run(proxy._partitioned(hdr, req))
    assert {b: [(t["name"], [p["index"] for p in t["partition_data"]]) for t in body["topic_data"]]
            for b, body in sent.items()} == {1: [("a", [0, 2])], 2: [("a", [1])], 3: [("b", [0])]}
    parts = {(t["name"], p["index"]): p for t in resp["responses"] for p in t["partition_responses"]}
    assert [t["name"] for t in resp["responses"]] == ["a", "b"], "one entry per topic"
    assert {k: p["base_offset"] for k, p in parts.items() if k[0] == "a"} == {("a", 0): 100, ("a", 1): 201,
                                                                             ("a", 2): 102}
    failed = parts[("b", 0)]
    assert failed["error_code"] == ErrorCode.NOT_LEADER_OR_FOLLOWER and failed["base_offset"] == -1
    assert failed["log_start_offset"] == -1 and "broker 3" in failed["error_message"]
    assert codec.STRICT
    PRODUCE.response.encode(resp, 9)
    PRODUCE.response.encode(resp, 3)


def test_a_failed_broker_fails_only_its_list_offsets_partitions():
    proxy, _ = proxy_with({("t", 0): 1, ("t", 1): 2}, failing={1, 2})
    req = {"replica_id": -1, "isolation_level": 0,
           "topics": [{"name": "t", "partitions": [{"partition_index": 0, "timestamp": -1},
                                                    {"partition_index": 1, "timestamp": -1}]}]}
    resp = asyncio.run(proxy._partitioned(RequestContext(LIST_OFFSETS.key, 7, 1, "c", True), req))
    [topic] = resp["topics"]
    assert sorted((p["partition_index"], p["error_code"], p["offset"]) for p in topic["partitions"]) == [
        (0, ErrorCode.NOT_LEADER_OR_FOLLOWER, -1), (1, ErrorCode.NOT_LEADER_OR_FOLLOWER, -1)]
    LIST_OFFSETS.response.encode(resp, 7)
