"""Bad input: the broker answers with a Kafka error or closes that one
connection with a log line, keeps serving everyone else, and never commits
anything from a rejected batch."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
import time
import uuid
from typing import Any

import pytest

from kafscale import _native
from kafscale.protocol.codec import Field
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.framing import encode_request
from kafscale.protocol.schemas import (
    API_VERSIONS,
    APIS,
    LIST_OFFSETS,
    METADATA,
    OFFSET_COMMIT,
    OFFSET_FETCH,
    PRODUCE,
)
from kafscale.storage.segment import parse_segment_key
from tests.conftest import BrokerProcess
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.rawclient import RawClient


@pytest.fixture(scope="module")
def plain_broker(stack, tmp_path_factory):
    """A broker with the default configuration (auto-create off)."""
    b = BrokerProcess(stack, tmp_path_factory.mktemp("bad-input"), f"b{uuid.uuid4().hex[:10]}").start()
    yield b
    b.stop()


@pytest.fixture
def served(plain_broker, topic_name):
    create_topic(plain_broker.bootstrap, topic_name)
    return plain_broker, topic_name


def still_serves(b, topic: str) -> None:
    """The broker process is alive and a real client can still produce + consume."""
    assert b.alive()
    c = RawClient(b.bootstrap)
    before = latest_offset(c, topic)
    c.close()
    off = confluent_produce(b.bootstrap, topic, [Rec(b"ok", b"still serving")])
    assert off == [before]
    got = confluent_consume(b.bootstrap, topic, before + 1)
    assert got[-1] == (before, Rec(b"ok", b"still serving"))


def produce_raw(c: RawClient, topic: str, records: bytes, version: int = 9, timeout_ms: int = 10000) -> dict:
    body = {"acks": -1, "timeout_ms": timeout_ms,
            "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": records}]}]}
    resp = c.request(PRODUCE.key, version, body)
    return resp["responses"][0]["partition_responses"][0]


def latest_offset(c: RawClient, topic: str) -> int:
    body = {"replica_id": -1, "topics": [{"name": topic, "partitions": [{"partition_index": 0, "timestamp": -1}]}]}
    return c.request(LIST_OFFSETS.key, 5, body)["topics"][0]["partitions"][0]["offset"]


def segment_objects(stack, b, topic: str) -> list[str]:
    """The topic's segment and index objects (not its marker)."""
    r = stack.s3_client().list_objects_v2(Bucket=stack.bucket, Prefix=f"{b.cluster}/{topic}/")
    return [o["Key"] for o in r.get("Contents", []) if parse_segment_key(o["Key"]) is not None]


@pytest.mark.parametrize("name,payload,reason", [
    ("truncated frame", struct.pack(">i", 100) + b"\x00\x03" + b"x" * 10, "truncated frame"),
    ("negative size", struct.pack(">i", -5), "frame size -5"),
    ("oversized frame", struct.pack(">i", 2**31 - 1) + b"\x00" * 8, "frame size 2147483647"),
    ("tiny frame", struct.pack(">i", 3) + b"abc", "frame size 3"),
    ("unknown api key", struct.pack(">ihhih", 10, 999, 0, 1, -1), "unknown API key 999"),
    ("unsupported version", struct.pack(">ihhih", 10, 0, 2, 1, -1), "Produce v2 is not supported"),
    ("short size prefix", b"\x00\x00", "truncated size prefix"),
    ("bad header string", struct.pack(">ihhih", 10, 3, 1, 1, 500), "malformed request header"),
    ("metadata array too long", struct.pack(">ihhih", 14, 3, 1, 7, -1) + struct.pack(">i", 1_000_000),
     "malformed Metadata v1 body"),
])
def test_malformed_frames_close_cleanly(served, name, payload, reason):
    b, topic = served
    c = RawClient(b.bootstrap)
    c.send_bytes(payload)
    if name == "truncated frame" or name == "short size prefix":
        c.sock.shutdown(1)  # the client goes away mid-frame
    assert c.closed_by_peer(), f"{name}: connection should be closed"
    c.close()
    still_serves(b, topic)
    assert reason in b.log(), f"no log line for {name}"


def test_a_malformed_commit_amid_pipelined_ones_ends_the_run(served):
    """The OffsetCommits a connection pipelines are checked together, but
    those after a malformed one take no effect: the connection closes after
    the answers before it, as if it had been read alone."""
    b, topic = served
    group = f"g-{uuid.uuid4().hex[:8]}"

    def commit(offset: int, correlation: int) -> bytes:
        body = {"group_id": group, "generation_id_or_member_epoch": -1, "member_id": "", "group_instance_id": None,
                "topics": [{"name": topic, "partitions": [{"partition_index": 0, "committed_offset": offset,
                                                           "committed_leader_epoch": -1, "committed_metadata": ""}]}]}
        return encode_request(OFFSET_COMMIT.key, 7, correlation, body)

    good = commit(6, 2)
    malformed = struct.pack(">i", len(good) - 4 - 9) + good[4:-9]  # the body cut short
    c = RawClient(b.bootstrap)
    c.send_bytes(commit(5, 1) + good + malformed + commit(99, 4))
    answered = [c.read_frame() for _ in range(2)]
    assert [struct.unpack_from(">i", f)[0] for f in answered if f] == [1, 2]
    assert c.closed_by_peer()
    c.close()
    offsets = {"group_id": group, "topics": [{"name": topic, "partition_indexes": [0]}]}
    c = RawClient(b.bootstrap)
    got = c.request(OFFSET_FETCH.key, 5, offsets)["topics"][0]["partitions"][0]
    c.close()
    assert (got["committed_offset"], got["error_code"]) == (6, ErrorCode.NONE)
    assert "malformed OffsetCommit v7 body" in b.log()


def test_garbage_bytes(served):
    b, topic = served
    for _ in range(20):
        c = RawClient(b.bootstrap)
        c.send_bytes(os.urandom(512))
        c.sock.shutdown(1)
        assert c.closed_by_peer()
        c.close()
    still_serves(b, topic)


def test_api_versions_unsupported_version_answers_v0(served):
    b, _ = served
    c = RawClient(b.bootstrap)
    c.send_bytes(struct.pack(">ihhih", 10, API_VERSIONS.key, 99, 42, -1))
    frame = c.read_frame()
    assert frame is not None
    corr, err = struct.unpack_from(">ih", frame)
    assert (corr, err) == (42, ErrorCode.UNSUPPORTED_VERSION)
    # and the v0 body lists our ranges so the client can retry lower
    from kafscale.protocol.framing import decode_response
    _, body = decode_response(API_VERSIONS.key, 0, frame)
    assert {k["api_key"] for k in body["api_keys"]} >= {0, 1, 2, 3, 18, 19, 20}
    c.close()


def test_bad_crc_is_corrupt_message_and_nothing_committed(served, stack):
    b, topic = served
    c = RawClient(b.bootstrap)
    before_objects = segment_objects(stack, b, topic)
    batch = bytearray(_native.build_batch([(1000, b"k", b"v" * 100, [])]))
    batch[-5] ^= 0xFF
    r = produce_raw(c, topic, bytes(batch))
    assert r["error_code"] == ErrorCode.CORRUPT_MESSAGE
    assert "CRC" in r["error_message"]
    # one good batch and one bad in the same payload: the whole payload is refused
    good = _native.build_batch([(1000, b"k", b"good", [])])
    r = produce_raw(c, topic, good + bytes(batch))
    assert r["error_code"] == ErrorCode.CORRUPT_MESSAGE
    assert latest_offset(c, topic) == 0
    assert segment_objects(stack, b, topic) == before_objects
    c.close()
    still_serves(b, topic)


@pytest.mark.parametrize("mutate,code", [
    (lambda b: b[:16] + b"\x01" + b[17:], ErrorCode.INVALID_RECORD),  # magic 1
    (lambda b: b[:-3], ErrorCode.CORRUPT_MESSAGE),  # truncated batch
    (lambda b: b + b"\x00\x00\x00", ErrorCode.CORRUPT_MESSAGE),  # trailing junk
])
def test_malformed_batches_rejected(served, mutate, code):
    b, topic = served
    c = RawClient(b.bootstrap)
    good = _native.build_batch([(1000, b"k", b"v", [])])
    r = produce_raw(c, topic, mutate(good))
    assert r["error_code"] == code, r
    assert latest_offset(c, topic) == 0
    c.close()
    still_serves(b, topic)


def test_bad_record_framing_with_valid_crc_is_invalid_record(served):
    """Record count lies but the CRC is recomputed: caught by the record walk."""
    b, topic = served
    c = RawClient(b.bootstrap)
    for codec in (0, 4):
        batch = bytearray(_native.build_batch([(1000, b"k", b"v", []), (1001, b"k2", b"v2", [])], codec=codec))
        struct.pack_into(">i", batch, 57, 3)  # claims 3 records
        struct.pack_into(">i", batch, 23, 2)
        struct.pack_into(">I", batch, 17, _native.crc32c(bytes(batch[21:])))
        r = produce_raw(c, topic, bytes(batch))
        assert r["error_code"] == ErrorCode.INVALID_RECORD, r
    assert latest_offset(c, topic) == 0
    c.close()


def test_unknown_topic_and_partition(served):
    b, topic = served
    c = RawClient(b.bootstrap)
    good = _native.build_batch([(1000, b"k", b"v", [])])
    assert produce_raw(c, "no-such-topic", good)["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    body = {"acks": -1, "timeout_ms": 1000,
            "topic_data": [{"name": topic, "partition_data": [{"index": 7, "records": good}]}]}
    r = c.request(PRODUCE.key, 9, body)["responses"][0]["partition_responses"][0]
    assert r["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    body["acks"] = 2
    body["topic_data"][0]["partition_data"][0]["index"] = 0
    r = c.request(PRODUCE.key, 9, body)["responses"][0]["partition_responses"][0]
    assert r["error_code"] == ErrorCode.INVALID_REQUIRED_ACKS
    md = c.request(METADATA.key, 12, {"topics": [{"name": "no-such-topic", "topic_id": bytes(16)}],
                                      "allow_auto_topic_creation": True})
    assert md["topics"][0]["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION  # auto-create is off by default
    c.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def test_unfinished_frames_hold_bounded_memory_and_time_out(make_broker):
    """Clients that send the size prefix of a 90 MiB frame and most of its
    bytes, then stall: the worker holds at most queued_max_request_bytes of
    them at once (the other sockets are not read) and closes each one
    request_read_timeout_s after its prefix."""
    budget_mib, timeout_s = 100, 2
    b = make_broker(workers=1, queued_max_request_bytes=budget_mib << 20, request_read_timeout_s=timeout_s)
    worker = b.children()[1]
    base = _rss_mib(worker)
    socks = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", b.port))
        s.settimeout(0.5)
        socks.append(s)

    def stall(s: socket.socket) -> None:
        s.sendall(struct.pack(">i", 90 << 20))
        chunk = bytes(1 << 20)
        with contextlib.suppress(OSError):  # a socket the broker does not read fills up, then times out
            for _ in range(89):
                s.sendall(chunk)

    threads = [threading.Thread(target=stall, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    peak, closed = base, set()
    deadline = time.monotonic() + 4 * (timeout_s + 1) + 10
    while len(closed) < len(socks) and time.monotonic() < deadline:
        peak = max(peak, _rss_mib(worker))
        for i, s in enumerate(socks):
            if i not in closed:
                with contextlib.suppress(TimeoutError, BlockingIOError):
                    try:
                        if s.recv(1, socket.MSG_DONTWAIT) == b"":
                            closed.add(i)
                    except ConnectionResetError:
                        closed.add(i)
        time.sleep(0.1)
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    assert len(closed) == len(socks), "every stalled connection is closed by the read timeout"
    assert peak - base < budget_mib + 40, f"worker grew {peak - base:.0f} MiB holding unfinished frames"
    assert b.log().count("not received within") >= len(socks)


def test_unauthenticated_frames_are_small(make_broker):
    """Before SASL authentication a frame may be 512 KiB at most (Kafka's
    sasl.server.max.receive.size): a larger size prefix closes the connection
    at once, before any of it is buffered."""
    b = make_broker(workers=1, sasl_mechanisms="PLAIN")
    c = RawClient(b.bootstrap)
    c.send_bytes(struct.pack(">i", 90 << 20) + bytes(1024))
    assert c.closed_by_peer()
    c.close()
    assert "before authentication" in b.log()


def zstd_bomb(value_bytes: int) -> bytes:
    """A RecordBatch v2 (zstd) of one record whose value is value_bytes of
    zeros: a few tens of KB on the wire, value_bytes once decompressed."""
    import zstandard

    body = b"\x00" + _native.encode_varint(0) + _native.encode_varint(0) + _native.encode_varint(-1)
    body += _native.encode_varint(value_bytes)
    record_len = len(body) + value_bytes + 1  # + the header count
    z = zstandard.ZstdCompressor().compressobj()
    out = [z.compress(_native.encode_varint(record_len) + body)]
    chunk = bytes(1 << 20)
    for _ in range(value_bytes >> 20):
        out.append(z.compress(chunk))
    out.append(z.compress(_native.encode_varint(0)) + z.flush())
    records = b"".join(out)
    after_crc = struct.pack(">hiqqqhii", 4, 0, 1000, 1000, -1, -1, -1, 1) + records  # zstd, 1 record
    head = struct.pack(">qiib", 0, 4 + 1 + 4 + len(after_crc), 0, 2)
    return head + struct.pack(">I", _native.crc32c(after_crc)) + after_crc


def test_a_compression_bomb_is_refused_with_bounded_memory(served):
    """One zstd batch of ~30 KB whose record decompresses to 1 GiB: refused
    with MESSAGE_TOO_LARGE after at most max_uncompressed_batch_bytes (64 MiB)
    were inflated; nothing is stored."""
    plain_broker, topic = served
    bomb = zstd_bomb(1 << 30)
    assert len(bomb) < 100_000
    workers = plain_broker.children()[1:]
    before = {pid: _rss_mib(pid) for pid in workers}
    c = RawClient(plain_broker.bootstrap, timeout=60)
    start = latest_offset(c, topic)
    r = produce_raw(c, topic, bomb)
    assert r["error_code"] == ErrorCode.MESSAGE_TOO_LARGE, r
    assert latest_offset(c, topic) == start
    c.close()
    grew = max(_rss_mib(pid) - before[pid] for pid in workers)
    assert grew < 64 + 64, f"a worker grew {grew:.0f} MiB"
    still_serves(plain_broker, topic)


def test_clients_that_never_read_hold_bounded_memory_and_are_disconnected(make_broker, topic_name):
    """20 clients each ask for a 40 MB Fetch and never read: the worker writes
    responses a slice at a time, so it holds about one slice per client (not
    the whole response), and disconnects each after response_write_timeout_s."""
    from kafscale.protocol.framing import encode_request
    from kafscale.protocol.schemas import FETCH

    b = make_broker(workers=1, response_write_timeout_s=3)
    create_topic(b.bootstrap, topic_name)
    value = os.urandom(1024)
    confluent_produce(b.bootstrap, topic_name, [Rec(None, value)] * 40_000, **{"linger.ms": 50, "batch.size": 1 << 20})
    worker = b.children()[1]
    base = _rss_mib(worker)
    body = {"max_wait_ms": 0, "min_bytes": 1, "max_bytes": 50 << 20, "isolation_level": 0,
            "topics": [{"topic": topic_name, "partitions": [{"partition": 0, "fetch_offset": 0,
                                                             "partition_max_bytes": 50 << 20}]}]}
    socks = []
    for i in range(20):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", b.port))
        s.sendall(encode_request(FETCH.key, 11, i, body))
        socks.append(s)
    peak = base
    deadline = time.monotonic() + 20
    while b.log().count("took no response bytes") < len(socks) and time.monotonic() < deadline:
        peak = max(peak, _rss_mib(worker))
        time.sleep(0.1)
    for s in socks:
        s.close()
    assert b.log().count("took no response bytes") == len(socks), "each non-reading client is disconnected"
    assert peak - base < 20 * 2 + 60, f"worker grew {peak - base:.0f} MiB for 20 clients that never read"
    still_serves(b, topic_name)


def sample_request(fields: list[Field], version: int, topic: str) -> dict[str, Any]:
    """A well-formed request body of this schema and version: one element in
    every array, names naming `topic`, a valid batch where records go."""
    body: dict[str, Any] = {}
    for f in (f for f in fields if f.present(version)):
        if f.type in ("array", "struct"):
            item = sample_value(f.item, f.name, topic) if f.item else sample_request(f.fields, version, topic)
            body[f.name] = [item] if f.type == "array" else item
        else:
            body[f.name] = sample_value(f.type, f.name, topic)
    return body


def sample_value(ftype: str, name: str, topic: str) -> Any:
    if ftype == "string":
        return topic if "name" in name or "topic" in name else "x"
    if ftype in ("int8", "int16", "int32", "int64", "uint16"):
        return 0 if "partition" in name or "index" in name else 1
    return {"bytes": b"x", "records": _native.build_batch([(1000, b"k", b"v" * 50, [])]), "bool": False,
            "uuid": bytes(16), "float64": 0.0}[ftype]


def mutate(frame: bytes, rnd: random.Random) -> bytes:
    """The frame with one kind of damage, its size prefix matching what is sent."""
    b = bytearray(frame[4:])
    at = rnd.randrange(8, len(b))  # past the API key, version and correlation id
    kind = rnd.randrange(5)
    if kind == 0:  # bits flipped
        for _ in range(rnd.randint(1, 3)):
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
    elif kind == 1:  # cut short
        del b[at:]
    elif kind == 2:  # a length or count made huge, negative or null
        b[at:at + 4] = rnd.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\xff\xff", b"\x80\x00\x00\x00"])
    elif kind == 3:  # a varint longer than any field it may be
        b[at:at + 1] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x0f"
    else:  # bytes appended
        b += bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 40)))
    return struct.pack(">i", len(b)) + bytes(b)


MUTANTS = 6  # of each API version's request


@pytest.mark.parametrize("front", ["broker", "proxy"])
def test_mutated_requests_of_every_api_and_version_are_answered_or_closed(make_cluster, topic_name, front):
    """A valid request of every API and version the broker implements,
    damaged MUTANTS ways each: every one is answered, or its connection is
    closed (or, for a long poll or acks=0, simply not answered yet); no
    worker dies, no handler fails (no traceback in the logs), and real
    clients still produce and consume. Admin requests name another topic,
    so that what they may still do (delete it, alter it) leaves ours."""
    *brokers, proxy = make_cluster(1, proxy=True)
    broker = brokers[0]
    target = proxy if front == "proxy" else broker
    create_topic(broker.bootstrap, topic_name)
    pids = broker.children(), proxy.children()
    rnd = random.Random(19)
    host, port = target.bootstrap.rsplit(":", 1)
    outcomes: dict[str, int] = {}
    sent = b""
    for api in APIS.values():
        name = f"{topic_name}-other" if api.name.startswith(("Create", "Delete", "Alter", "Elect",
                                                              "IncrementalAlter")) else topic_name
        for version in range(api.min_version, api.max_version + 1):
            frame = encode_request(api.key, version, 7, sample_request(api.request.fields, version, name))
            for _ in range(MUTANTS):
                try:
                    s = socket.create_connection((host, int(port)), timeout=2)
                except OSError as exc:
                    pytest.fail(f"the {front} stopped listening after {sent.hex()}: {exc!r}")
                sent = mutate(frame, rnd)
                with s:
                    s.sendall(sent)
                    try:
                        outcome = "answered" if s.recv(4) else "closed"
                    except TimeoutError:
                        outcome = "not answered in 2 s"
                    except ConnectionResetError:
                        outcome = "closed"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                assert broker.alive() and proxy.alive(), f"{api.name} v{version}: {sent.hex()}"
        assert (broker.children(), proxy.children()) == pids, f"a process died after {api.name}: {outcomes}"
    assert outcomes["answered"] > 100 and outcomes["closed"] > 100, outcomes
    for b in (broker, proxy):
        assert "Traceback" not in b.log() and " ERROR " not in b.log(), b.log()[-5000:]
    still_serves(target, topic_name)
