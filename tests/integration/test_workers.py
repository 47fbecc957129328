"""The pre-forked node: its port accepts once every worker is ready, a
killed worker is replaced with nothing acked lost, a dead log process takes
the node down, and a full produce ring or an S3 outage gives producers
retriable errors, after which they carry on with no gap and no duplicate."""
from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
import uuid

import pytest
from confluent_kafka import Producer

from kafscale import _native
from kafscale.devstack import free_port
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import METADATA, OFFSET_COMMIT
from kafscale.records import decode_records
from tests.conftest import BrokerProcess
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.rawclient import RawClient
from tests.integration.relay import Relay
from tests.integration.test_bad_input import produce_raw
from tests.integration.test_cluster import Stream, check_all_acked_present
from tests.integration.test_groups import wait_for
from tests.integration.test_topics_offsets import fetch_raw


def _accepted_by(workers: list[int], port: int) -> dict[int, int]:
    """The connections to `port` the workers accepted: client port -> the worker's pid."""
    owners = {}
    for pid in workers:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                owners[link[8:-1]] = pid
    accepted = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            _, local, remote, *_, inode = line.split()[:10]
            if int(local.split(":")[1], 16) == port and inode in owners:
                accepted[int(remote.split(":")[1], 16)] = owners[inode]
    return accepted


def test_the_port_accepts_once_every_worker_is_ready(stack, tmp_path):
    """Connections made as soon as the port accepts reach every worker. When
    workers started one after another, the first listened while the next one
    was still faulting the shared memory in (about half a second for the
    default 1 GiB cache), and every connection made meanwhile stayed on the
    first for its lifetime."""
    b = BrokerProcess(stack, tmp_path, f"t{uuid.uuid4().hex[:10]}", workers=2)
    b.launch()
    clients: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not clients:  # the first connection the port accepts
            assert time.monotonic() < deadline and b.alive(), b.log()[-2000:]
            s = socket.socket()
            if s.connect_ex(("127.0.0.1", b.port)) == 0:
                clients.append(s)
            else:
                s.close()
                time.sleep(0.01)
        for _ in range(19):  # and 19 more within the next 100 ms
            time.sleep(0.005)
            clients.append(socket.create_connection(("127.0.0.1", b.port)))
        _, *workers = b.children()
        assert len(workers) == 2
        ports = {c.getsockname()[1] for c in clients}
        wait_for(lambda: ports <= _accepted_by(workers, b.port).keys(), 10, "every connection accepted")
        accepted = _accepted_by(workers, b.port)
        assert {accepted[p] for p in ports} == set(workers)
    finally:
        for c in clients:
            c.close()
        b.stop()


def test_killed_worker_is_replaced_under_load(make_broker, topic_name):
    b = make_broker(workers=2)
    create_topic(b.bootstrap, topic_name, partitions=2)
    log_pid, *workers = b.children()
    assert len(workers) == 2
    stream = Stream(b.bootstrap, topic_name, 2)
    try:
        time.sleep(2)
        victim = random.choice(workers)
        b.signal_pid(victim, signal.SIGKILL)
        wait_for(lambda: "starting a new one" in b.log(), 20, "the supervisor to replace the worker")
        wait_for(lambda: len(b.children()) == 3 and victim not in b.children(), 20, "a new worker")
        assert b.children()[0] == log_pid  # the log process carried on
        time.sleep(2)
    finally:
        stream.stop()
    assert stream.failed == 0 and len(stream.acked) > 100
    check_all_acked_present(b.bootstrap, topic_name, 2, stream.acked)


def test_log_process_death_stops_the_node(make_broker, topic_name):
    b = make_broker(workers=2)
    log_pid = b.children()[0]
    b.signal_pid(log_pid, signal.SIGKILL)
    assert b.proc is not None
    assert b.proc.wait(20) != 0
    assert "log process exited" in b.log()


def idempotent_producer(bootstrap: str) -> tuple[Producer, dict[int, bytes], list[object]]:
    acked: dict[int, bytes] = {}
    errors: list[object] = []

    def cb(err, msg) -> None:
        if err is None:
            acked[msg.offset()] = msg.value()
        else:
            errors.append(err)

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                  "message.timeout.ms": 120000, "on_delivery": cb})
    return p, acked, errors


def test_fetch_from_s3_while_s3_is_down_gets_a_retriable_error(make_broker, stack, topic_name):
    """A consumer catching up from S3 during an outage gets KAFKA_STORAGE_ERROR
    for that partition on a connection that stays open, and its records once
    S3 is back."""
    relay = Relay(stack.s3_port)
    try:
        b = make_broker(workers=1, s3_endpoint=relay.url)
        create_topic(b.bootstrap, topic_name)
        confluent_produce(b.bootstrap, topic_name, [Rec(None, b"v%d" % i) for i in range(50)])
        b.stop()
        b.start()  # an empty cache: reads go to S3
        relay.cut()
        c = RawClient(b.bootstrap, timeout=60)
        r = fetch_raw(c, topic_name, 0, max_wait_ms=100)
        assert r["error_code"] == ErrorCode.KAFKA_STORAGE_ERROR and len(r["records"] or b"") == 0
        relay.restore()
        # on the same connection; like any consumer, fetch on from the offset
        # after what came back (a cold read returns the first object it reaches
        # at once and reads ahead the rest, rather than waiting for all of it)
        offset = 0
        values: list[bytes] = []
        while offset < 50:
            r = fetch_raw(c, topic_name, offset, max_wait_ms=100)
            assert r["error_code"] == 0
            got, offset_after = decode_records(0, bytes(r["records"]), offset)
            assert got and got[0].offset == offset
            values += [rec.value for rec in got]
            offset = offset_after
        assert values == [b"v%d" % i for i in range(50)]
        c.close()
    finally:
        relay.close()


def test_s3_outage_backpressure_then_recovery(make_broker, stack, topic_name):
    """While S3 is unreachable the broker buffers at most its ring: past that,
    produce is refused with a retriable error. When S3 is back, an idempotent
    producer's records all land once each, at dense offsets."""
    relay = Relay(stack.s3_port)
    try:
        b = make_broker(workers=1, ring_bytes=1024 * 1024, s3_endpoint=relay.url, s3_timeout_s=5)
        create_topic(b.bootstrap, topic_name)
        p, acked, errors = idempotent_producer(b.bootstrap)
        sent = [b"before-%d" % i for i in range(200)]
        for v in sent:
            p.produce(topic_name, value=v, partition=0)
        assert p.flush(30) == 0

        relay.cut()
        stop = threading.Event()

        def keep_producing() -> None:
            i = 0
            while not stop.is_set():
                v = b"during-%d-" % i + b"x" * 1000
                try:
                    p.produce(topic_name, value=v, partition=0)
                    sent.append(v)
                    i += 1
                except BufferError:
                    time.sleep(0.01)
                p.poll(0.001)

        t = threading.Thread(target=keep_producing)
        t.start()
        try:
            # fill the rest of the ring with raw produces: they time out (kept, not durable yet) until the
            # ring is full, then are refused at once with a retriable code
            c = RawClient(b.bootstrap, timeout=30)
            codes = []
            batch = _native.build_batch([(1000, None, b"r" * 60_000, [])])
            for _ in range(40):
                r = produce_raw(c, topic_name, batch, timeout_ms=200)
                codes.append(r["error_code"])
                if r["error_code"] == ErrorCode.NOT_ENOUGH_REPLICAS:
                    break
            c.close()
            assert codes[-1] == ErrorCode.NOT_ENOUGH_REPLICAS, codes
            assert set(codes) <= {ErrorCode.REQUEST_TIMED_OUT, ErrorCode.NOT_ENOUGH_REPLICAS}, codes
            wait_for(lambda: "failed (" in b.log(), 30, "the log process to report failing uploads")
        finally:
            relay.restore()
            time.sleep(1)
            stop.set()
            t.join()
        assert p.flush(90) == 0 and not errors, errors
    finally:
        relay.close()
    # every record the producer sent is acked exactly once, at dense offsets
    assert sorted(acked.values()) == sorted(sent)
    got = confluent_consume(b.bootstrap, topic_name, max(acked) + 1)
    offsets = [o for o, _ in got]
    assert offsets == list(range(len(offsets)))
    values = [r.value for _, r in got]
    mine = [v for v in values if not v.startswith(b"r")]
    assert sorted(mine) == sorted(sent), "each produced record exactly once"
    for o, v in acked.items():
        assert values[o] == v


def commit_raw(c: RawClient, group: str, topic: str, offset: int) -> int:
    """A simple (generation -1) OffsetCommit of partition 0; its error code."""
    part = {"partition_index": 0, "committed_offset": offset, "committed_metadata": None}
    r = c.request(OFFSET_COMMIT.key, 8, {"group_id": group, "member_id": "",
                                         "topics": [{"name": topic, "partitions": [part]}]})
    return r["topics"][0]["partitions"][0]["error_code"]


def test_etcd_outage_answers_errors_and_closes_no_connection(make_broker, stack, topic_name):
    """While etcd is unreachable, Metadata (of every topic, and of one) is
    answered from what the broker knows and OffsetCommit gets
    COORDINATOR_NOT_AVAILABLE (retriable), on a connection that stays open;
    once etcd is back the same connection commits."""
    relay = Relay(stack.etcd_port)
    try:
        b = make_broker(workers=1, etcd=f"127.0.0.1:{relay.port}", lease_ttl_s=30)
        create_topic(b.bootstrap, topic_name)
        c = RawClient(b.bootstrap, timeout=60)
        group = f"g-{topic_name}"
        assert commit_raw(c, group, topic_name, 5) == 0
        relay.cut()
        md = c.request(METADATA.key, 12, {"topics": None, "allow_auto_topic_creation": False,
                                          "include_topic_authorized_operations": False})
        assert [t["name"] for t in md["topics"]] == [topic_name] and md["brokers"]
        md = c.request(METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}],
                                          "allow_auto_topic_creation": False,
                                          "include_topic_authorized_operations": False})
        assert [(t["name"], t["error_code"], len(t["partitions"])) for t in md["topics"]] == [(topic_name, 0, 1)]
        assert commit_raw(c, group, topic_name, 6) == ErrorCode.COORDINATOR_NOT_AVAILABLE
        relay.restore()
        wait_for(lambda: commit_raw(c, group, topic_name, 7) == 0, 30, "commits once etcd is back")
        c.close()
        assert "closing the connection" not in b.log() and "closing:" not in b.log()
    finally:
        relay.close()


def serves_a_record(b, topic: str) -> None:
    """Start broker b, create topic through it and produce one record, stop it."""
    b.start()
    try:
        create_topic(b.bootstrap, topic)
        assert confluent_produce(b.bootstrap, topic, [Rec(None, b"v")]) == [0]
    finally:
        b.stop()


def test_a_broker_uses_the_next_etcd_endpoint_when_the_first_is_down(stack, tmp_path, topic_name):
    dead = free_port()
    serves_a_record(BrokerProcess(stack, tmp_path, "endpoints", workers=1,
                                  etcd=f"127.0.0.1:{dead},{stack.etcd_endpoint}"), topic_name)


def test_etcd_with_authentication(tmp_path, topic_name):
    """Against an etcd with authentication on (its own, so the shared one stays
    open), a broker with etcd_user/etcd_password works and one without is refused at start."""
    import subprocess
    from pathlib import Path

    from kafscale.devstack import DevStack, etcd_binary
    own = DevStack(data_dir=str(tmp_path / "stack")).start()
    try:
        etcdctl = [str(Path(etcd_binary()).with_name("etcdctl")), f"--endpoints={own.etcd_endpoint}"]
        for args in (["user", "add", "root:root-secret"], ["user", "add", "kafscale:etcd-secret"],
                     ["role", "add", "kafscale"],
                     ["role", "grant-permission", "kafscale", "--prefix=true", "readwrite", "/kafscale/"],
                     ["user", "grant-role", "kafscale", "kafscale"], ["auth", "enable"]):
            subprocess.run([*etcdctl, *args], check=True, capture_output=True, timeout=30)
        refused = BrokerProcess(own, tmp_path, "authz", workers=1)
        with pytest.raises(RuntimeError, match="etcd"):
            refused.start()
        serves_a_record(BrokerProcess(own, tmp_path, "auth", workers=1, etcd_user="kafscale",
                                      etcd_password="etcd-secret"), topic_name)
    finally:
        own.stop()


def test_etcd_over_tls(stack, certs, tmp_path, topic_name):
    """An etcd that speaks only TLS: a broker given its CA (etcd_ca) works."""
    import subprocess

    from kafscale.devstack import etcd_binary, port_is_free
    port, peer = free_port(), free_port()
    etcd = subprocess.Popen([etcd_binary(), "--name", "tls", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"https://127.0.0.1:{port}",
                             "--advertise-client-urls", f"https://127.0.0.1:{port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
                             "--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server.key"),
                             "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: not port_is_free(port), 20, "etcd to listen")
        serves_a_record(BrokerProcess(stack, tmp_path, "etcdtls", workers=1, etcd=f"127.0.0.1:{port}",
                                      etcd_ca=certs / "ca.pem"), topic_name)
        plain = BrokerProcess(stack, tmp_path, "etcdplain", workers=1, etcd=f"127.0.0.1:{port}")
        with pytest.raises(RuntimeError, match="etcd"):
            plain.start()
    finally:
        etcd.terminate()
        etcd.wait(10)
