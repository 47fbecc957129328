"""TLS listeners on the pre-forked broker and the proxy, with certificates
made by openssl: librdkafka (confluent-kafka) and kcat produce and consume
over TLS, mutual TLS refuses a client without a certificate, and the proxy
reaches TLS brokers."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import BrokerProcess


def tls_client(certs: Path, client_cert: bool = False) -> dict[str, str]:
    conf = {"security.protocol": "SSL", "ssl.ca.location": str(certs / "ca.pem")}
    if client_cert:
        conf.update({"ssl.certificate.location": str(certs / "client.pem"),
                     "ssl.key.location": str(certs / "client.key")})
    return conf


def round_trip(bootstrap: str, topic: str, conf: dict[str, str], n: int = 50) -> list[bytes]:
    admin = AdminClient({"bootstrap.servers": bootstrap, **conf})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", **conf})
    for i in range(n):
        p.produce(topic, value=b"tls-%d" % i)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topic}", **conf})
    c.assign([TopicPartition(topic, 0, 0)])
    got: list[bytes] = []
    while len(got) < n:
        got += [m.value() for m in c.consume(n, 10) if m.error() is None]
    c.close()
    return got


def test_tls_listener_with_librdkafka_and_kcat(make_broker, certs, topic_name):
    b = make_broker(workers=2, tls_cert=certs / "server.pem", tls_key=certs / "server.key")
    got = round_trip(b.bootstrap, topic_name, tls_client(certs))
    assert got == [b"tls-%d" % i for i in range(50)]
    kcat = ["kcat", "-b", b.bootstrap, "-X", "security.protocol=SSL", "-X", f"ssl.ca.location={certs / 'ca.pem'}"]
    subprocess.run([*kcat, "-P", "-t", topic_name], input=b"from-kcat\n", check=True, timeout=30)
    out = subprocess.run([*kcat, "-C", "-t", topic_name, "-o", "50", "-e", "-q"], capture_output=True, check=True,
                         timeout=30)
    assert out.stdout == b"from-kcat\n"
    plain = AdminClient({"bootstrap.servers": b.bootstrap, "socket.timeout.ms": 2000})
    with pytest.raises(KafkaException):
        plain.list_topics(timeout=3)  # a plaintext client gets no Kafka answer from a TLS listener


def test_mutual_tls_requires_a_client_certificate(make_broker, certs, topic_name):
    b = make_broker(workers=1, tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                    tls_client_ca=certs / "ca.pem")
    assert round_trip(b.bootstrap, topic_name, tls_client(certs, client_cert=True), n=5) == [
        b"tls-%d" % i for i in range(5)]
    anonymous = AdminClient({"bootstrap.servers": b.bootstrap, **tls_client(certs)})
    with pytest.raises(KafkaException):
        anonymous.list_topics(timeout=3)


def test_proxy_over_tls_in_front_of_tls_brokers(stack, make_cluster, certs, topic_name, tmp_path):
    tls = {"tls_cert": certs / "server.pem", "tls_key": certs / "server.key"}
    broker = make_cluster(1, **tls)[0]
    proxy = BrokerProcess(stack, tmp_path, broker.cluster, command="proxy", tls_broker_ca=certs / "ca.pem",
                          **tls).start()
    try:
        assert round_trip(proxy.bootstrap, topic_name, tls_client(certs), n=10) == [b"tls-%d" % i for i in range(10)]
    finally:
        proxy.stop()
