"""SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and ACLs on a real pre-forked
broker: users made with `kafscale users add`, librdkafka (confluent-kafka),
kafka-python, aiokafka and kcat authenticating over plaintext and TLS, the
Kafka error codes of SASL misuse, and ACLs set through Kafka's ACL APIs and
`kafscale acls`, enforced on produce, fetch, groups and admin requests."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from kafscale.protocol import schemas
from kafscale.protocol.errors import ErrorCode
from tests.conftest import BrokerProcess
from tests.integration.clients import (
    Rec,
    aiokafka_consume,
    aiokafka_produce,
    create_topic,
    kafka_python_consume,
    kafka_python_produce,
    kcat,
)
from tests.integration.rawclient import RawClient
from tests.integration.test_groups import wait_for
from tests.integration.test_tls import round_trip

ALL_MECHANISMS = "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"
PASSWORDS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret", "carol": "carol-secret"}


def kafscale(broker: BrokerProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kafscale.cli", *args], env=broker.env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def add_users(broker: BrokerProcess, *names: str) -> None:
    for name in names:
        kafscale(broker, "users", "add", name, "--password", PASSWORDS[name])


def sasl(user: str, mechanism: str = "PLAIN", protocol: str = "SASL_PLAINTEXT") -> dict[str, str]:
    return {"security.protocol": protocol, "sasl.mechanism": mechanism, "sasl.username": user,
            "sasl.password": PASSWORDS[user]}


def kcat_sasl(broker: BrokerProcess, user: str, mechanism: str, *extra: str) -> list[str]:
    conf = {**sasl(user, mechanism), **dict(x.split("=", 1) for x in extra)}
    conf["sasl.mechanisms"] = conf.pop("sasl.mechanism")
    return ["-b", broker.bootstrap, *(a for k, v in conf.items() for a in ("-X", f"{k}={v}"))]


@pytest.fixture(scope="module")
def sasl_broker(stack, tmp_path_factory) -> BrokerProcess:
    b = BrokerProcess(stack, tmp_path_factory.mktemp("sasl"), f"s{time.time_ns() % 10**10}", workers=2,
                      sasl_mechanisms=ALL_MECHANISMS)
    add_users(b, "alice")
    b.start()
    yield b
    b.stop()


def test_every_mechanism_with_every_client(sasl_broker, topic_name):
    b = sasl_broker
    for mech in ALL_MECHANISMS.split(","):
        topic = f"{topic_name}-{mech.lower()}"
        assert round_trip(b.bootstrap, topic, sasl("alice", mech), n=20) == [b"tls-%d" % i for i in range(20)]
    recs = [Rec(b"k%d" % i, b"v%d" % i) for i in range(10)]
    py = {"security_protocol": "SASL_PLAINTEXT", "sasl_plain_username": "alice", "sasl_plain_password": "alice-secret"}
    topic = f"{topic_name}-plain"
    assert kafka_python_produce(b.bootstrap, topic, recs, None, sasl_mechanism="SCRAM-SHA-512", **py) == list(
        range(20, 30))
    assert [r for _, r in kafka_python_consume(b.bootstrap, topic, 30, sasl_mechanism="SCRAM-SHA-256", **py)][20:] \
        == recs
    assert aiokafka_produce(b.bootstrap, topic, recs, None, sasl_mechanism="PLAIN", **py) == list(range(30, 40))
    assert [o for o, _ in aiokafka_consume(b.bootstrap, topic, 40, sasl_mechanism="SCRAM-SHA-256", **py)] == list(
        range(40))
    kcat("-P", "-t", topic, *kcat_sasl(b, "alice", "SCRAM-SHA-512"), input=b"from-kcat\n")
    out = kcat("-C", "-t", topic, "-o", "40", "-e", "-q", *kcat_sasl(b, "alice", "SCRAM-SHA-256"))
    assert out == b"from-kcat\n"
    # kafscale produce / consume sign in with SCRAM (the password from the environment)
    cmd = lambda *a, pw="alice-secret": subprocess.run(  # noqa: E731
        [sys.executable, "-m", "kafscale.cli", *a, "--bootstrap", b.bootstrap, "--user", "alice"], input="mine\n",
        env={**os.environ, "KAFSCALE_PASSWORD": pw}, capture_output=True, text=True, timeout=60)
    assert cmd("produce", topic).returncode == 0
    got = cmd("consume", topic, "--partition", "0", "--offset", "41", "-e")
    assert got.stdout == "mine\n", got.stderr
    refused = cmd("consume", topic, "-e", pw="guess")
    assert refused.returncode == 1 and refused.stderr.strip().startswith("kafscale consume: SASL_AUTHENTICATION_FAILED")


def test_scram_users_through_kafka_admin_clients(sasl_broker, topic_name):
    """AlterUserScramCredentials and DescribeUserScramCredentials (confluent-kafka
    and kafka-python) work on the users `kafscale users` manages: a user created
    by an admin client signs in, and one deleted by it no longer does."""
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion
    from kafka.admin import KafkaAdminClient, UserScramCredentialDeletion
    from kafka.admin import ScramMechanism as KScramMechanism

    b = sasl_broker
    admin = AdminClient({"bootstrap.servers": b.bootstrap, **sasl("alice")})
    up = UserScramCredentialUpsertion("dave", ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), b"dave-pw")
    admin.alter_user_scram_credentials([up])["dave"].result(10)
    assert "dave" in kafscale(b, "users", "ls").split()
    described = {u: f.result(10) for u, f in admin.describe_user_scram_credentials(["dave", "alice"]).items()}
    assert [(i.mechanism, i.iterations) for i in described["dave"].scram_credential_infos] == [
        (ScramMechanism.SCRAM_SHA_512, 8192)]
    assert {i.mechanism for i in described["alice"].scram_credential_infos} == {
        ScramMechanism.SCRAM_SHA_256, ScramMechanism.SCRAM_SHA_512}
    dave = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "dave",
            "sasl.password": "dave-pw"}
    assert topic_name not in AdminClient({"bootstrap.servers": b.bootstrap, **dave}).list_topics(timeout=10).topics
    py = KafkaAdminClient(bootstrap_servers=b.bootstrap, security_protocol="SASL_PLAINTEXT",
                          sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                          sasl_plain_password="alice-secret")
    try:
        infos = py.describe_user_scram_credentials(["dave"])["dave"]
        assert infos["error"] is None and [i["iterations"] for i in infos["credential_infos"]] == [8192]
        assert py.alter_user_scram_credentials([UserScramCredentialDeletion("dave", KScramMechanism.SCRAM_SHA_512)]) \
            == {"dave": None}
        assert py.describe_user_scram_credentials(["dave"])["dave"]["error"] is not None
    finally:
        py.close()
    assert "dave" not in kafscale(b, "users", "ls").split()
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": b.bootstrap, **dave}).list_topics(timeout=3)


def test_bad_credentials_and_removed_users_are_refused(sasl_broker, topic_name):
    b = sasl_broker
    for mech in ALL_MECHANISMS.split(","):
        wrong = {**sasl("alice", mech), "sasl.password": "guess"}
        with pytest.raises(KafkaException):
            AdminClient({"bootstrap.servers": b.bootstrap, **wrong}).list_topics(timeout=3)
    assert "Authentication failed: invalid credentials with SASL mechanism SCRAM-SHA-512" in b.log()
    add_users(b, "carol")
    assert topic_name not in AdminClient({"bootstrap.servers": b.bootstrap, **sasl("carol")}).list_topics(
        timeout=10).topics
    assert "removed user carol" in kafscale(b, "users", "rm", "carol")
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": b.bootstrap, **sasl("carol")}).list_topics(timeout=3)
    assert "carol" not in kafscale(b, "users", "ls").split()
    plain = AdminClient({"bootstrap.servers": b.bootstrap, "socket.timeout.ms": 2000})
    with pytest.raises(KafkaException):
        plain.list_topics(timeout=3)  # no SASL: the connection is closed at the first request
    assert "Metadata request before SASL authentication" in b.log()


def test_sasl_protocol_errors(sasl_broker, broker):
    c = RawClient(sasl_broker.bootstrap)
    r = c.request(schemas.SASL_HANDSHAKE.key, 1, {"mechanism": "GSSAPI"})
    assert r == {"error_code": ErrorCode.UNSUPPORTED_SASL_MECHANISM,
                 "mechanisms": ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]}
    assert c.closed_by_peer()
    c = RawClient(sasl_broker.bootstrap)
    assert c.request(schemas.SASL_AUTHENTICATE.key, 2, {"auth_bytes": b"x"})["error_code"] == \
        ErrorCode.ILLEGAL_SASL_STATE
    assert c.closed_by_peer()
    c = RawClient(sasl_broker.bootstrap)  # a garbled PLAIN token fails cleanly
    assert c.request(schemas.SASL_HANDSHAKE.key, 1, {"mechanism": "PLAIN"})["error_code"] == 0
    r = c.request(schemas.SASL_AUTHENTICATE.key, 1, {"auth_bytes": b"\xff\x00"})
    assert r["error_code"] == ErrorCode.SASL_AUTHENTICATION_FAILED and "PLAIN" in r["error_message"]
    assert c.closed_by_peer()
    c = RawClient(sasl_broker.bootstrap)  # SaslHandshake v0: a bare token follows, answered bare
    assert c.request(schemas.SASL_HANDSHAKE.key, 0, {"mechanism": "PLAIN"})["error_code"] == 0
    token = b"\x00alice\x00alice-secret"
    c.send_bytes(struct.pack(">i", len(token)) + token)
    assert c.read_frame() == b""
    assert c.request(schemas.METADATA.key, 1, {"topics": []})["brokers"][0]["port"] == sasl_broker.port
    c = RawClient(broker.bootstrap)  # a listener without SASL
    assert c.request(schemas.SASL_HANDSHAKE.key, 1, {"mechanism": "PLAIN"}) == {
        "error_code": ErrorCode.ILLEGAL_SASL_STATE, "mechanisms": []}
    assert sasl_broker.alive()


def test_sasl_over_tls_with_kcat_and_librdkafka(make_broker, certs: Path, topic_name):
    b = make_broker(workers=1, sasl_mechanisms="SCRAM-SHA-512", tls_cert=certs / "server.pem",
                    tls_key=certs / "server.key")
    add_users(b, "alice")
    conf = {**sasl("alice", "SCRAM-SHA-512", "SASL_SSL"), "ssl.ca.location": str(certs / "ca.pem")}
    assert round_trip(b.bootstrap, topic_name, conf, n=5) == [b"tls-%d" % i for i in range(5)]
    tls = ("security.protocol=SASL_SSL", f"ssl.ca.location={certs / 'ca.pem'}")
    kcat("-P", "-t", topic_name, *kcat_sasl(b, "alice", "SCRAM-SHA-512", *tls), input=b"over-tls\n")
    assert kcat("-C", "-t", topic_name, "-o", "5", "-e", "-q", *kcat_sasl(b, "alice", "SCRAM-SHA-512", *tls)) == \
        b"over-tls\n"
    with pytest.raises(KafkaException):  # PLAIN is not offered on this listener
        AdminClient({"bootstrap.servers": b.bootstrap, **conf, "sasl.mechanism": "PLAIN"}).list_topics(timeout=3)


def raw_sasl_plain(bootstrap: str, user: str) -> RawClient:
    c = RawClient(bootstrap)
    assert c.request(schemas.SASL_HANDSHAKE.key, 1, {"mechanism": "PLAIN"})["error_code"] == 0
    token = f"\x00{user}\x00{PASSWORDS[user]}".encode()
    assert c.request(schemas.SASL_AUTHENTICATE.key, 2, {"auth_bytes": token})["error_code"] == 0
    return c


def describe_acls_error(c: RawClient) -> int:
    return c.request(schemas.DESCRIBE_ACLS.key, 3, {
        "resource_type_filter": 1, "resource_name_filter": None, "pattern_type_filter": 1, "principal_filter": None,
        "host_filter": None, "operation": 1, "permission_type": 1})["error_code"]


def consume_errors(bootstrap: str, conf: dict[str, str], topic: str, group: str, subscribe: bool,
                   want: int) -> tuple[list[bytes], set[int]]:
    """Values read (up to want) and the error codes seen, within 15 s."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest", **conf})
    if subscribe:
        c.subscribe([topic])
    else:
        c.assign([TopicPartition(topic, 0, 0)])
    got: list[bytes] = []
    errors: set[int] = set()
    deadline = time.monotonic() + 15
    while len(got) < want and not errors and time.monotonic() < deadline:
        for m in c.consume(want, 0.5):
            if m.error() is None:
                got.append(m.value())
            else:
                errors.add(m.error().code())
    if subscribe and got:
        c.commit(asynchronous=False)
    c.close()
    return got, errors


def produce_errors(bootstrap: str, conf: dict[str, str], topic: str, n: int) -> set[int]:
    errors: set[int] = set()
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 10000, **conf})
    for i in range(n):
        p.produce(topic, b"m%d" % i, on_delivery=lambda err, _m: err is not None and errors.add(err.code()))
    p.flush(20)
    return errors


def test_acls_on_produce_fetch_groups_and_admin(make_broker, topic_name):
    b = make_broker(workers=2, sasl_mechanisms="PLAIN", authorizer="true", super_users="User:admin")
    add_users(b, "admin", "alice", "bob", "carol")
    admin = AdminClient({"bootstrap.servers": b.bootstrap, **sasl("admin")})
    orders, payments = f"orders-{topic_name}", f"payments-{topic_name}"
    for f in admin.create_topics([NewTopic(orders, 1, 1), NewTopic(payments, 1, 1)]).values():
        f.result(30)
    grants = [AclBinding(ResourceType.TOPIC, "orders-", ResourcePatternType.PREFIXED, "User:alice", "*",
                         AclOperation.WRITE, AclPermissionType.ALLOW),
              AclBinding(ResourceType.TOPIC, orders, ResourcePatternType.LITERAL, "User:bob", "*",
                         AclOperation.READ, AclPermissionType.ALLOW),
              AclBinding(ResourceType.GROUP, "bob-", ResourcePatternType.PREFIXED, "User:bob", "*",
                         AclOperation.READ, AclPermissionType.ALLOW)]
    for f in admin.create_acls(grants).values():
        f.result(10)
    everything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
                                  AclPermissionType.ANY)
    assert sorted(map(str, admin.describe_acls(everything).result(10))) == sorted(map(str, grants))

    # produce: alice may write orders-*, nothing else; bob may not write at all
    assert produce_errors(b.bootstrap, sasl("alice"), orders, 5) == set()
    assert produce_errors(b.bootstrap, sasl("alice"), payments, 1) == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    assert produce_errors(b.bootstrap, sasl("bob"), orders, 1) == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    # fetch and groups: bob reads orders in bob-* groups only; alice may not read
    got, errors = consume_errors(b.bootstrap, sasl("bob"), orders, "bob-1", True, 5)
    assert (got, errors) == ([b"m%d" % i for i in range(5)], set())
    assert consume_errors(b.bootstrap, sasl("bob"), orders, "other", True, 5)[1] == {
        KafkaError.GROUP_AUTHORIZATION_FAILED}
    # (her consumer's group lookups fail too: she may not use the bob-* groups)
    assert KafkaError.TOPIC_AUTHORIZATION_FAILED in consume_errors(b.bootstrap, sasl("alice"), orders, "bob-2",
                                                                   False, 5)[1]
    # authorized_operations (Metadata v8+, DescribeCluster, DescribeGroups) follow the ACLs
    from confluent_kafka import TopicCollection
    from kafka.admin import KafkaAdminClient

    def topic_ops(client: AdminClient) -> set[AclOperation]:
        [fut] = client.describe_topics(TopicCollection([orders]), include_authorized_operations=True).values()
        return set(fut.result(10).authorized_operations)

    bob = AdminClient({"bootstrap.servers": b.bootstrap, **sasl("bob")})
    assert topic_ops(bob) == {AclOperation.READ, AclOperation.DESCRIBE}
    assert len(topic_ops(admin)) == 8, "a super user may do all 8 topic operations"
    assert len(admin.describe_cluster(include_authorized_operations=True).result(10).authorized_operations) == 7
    py = KafkaAdminClient(bootstrap_servers=b.bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                          sasl_plain_username="bob", sasl_plain_password=PASSWORDS["bob"])
    try:
        group = py.describe_groups(["bob-1"], include_authorized_operations=True)["bob-1"]
        assert {getattr(op, "name", op) for op in group["authorized_operations"]} == {"READ", "DESCRIBE"}, group
    finally:
        py.close()
    # admin: carol sees no topics and may create none; non-super users may not manage ACLs
    carol = AdminClient({"bootstrap.servers": b.bootstrap, **sasl("carol")})
    assert not {orders, payments} & set(carol.list_topics(timeout=10).topics)
    with pytest.raises(KafkaException) as exc:
        carol.create_topics([NewTopic(f"c-{topic_name}", 1, 1)])[f"c-{topic_name}"].result(10)
    assert exc.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    carols = AclBinding(ResourceType.TOPIC, orders, ResourcePatternType.LITERAL, "User:carol", "*",
                        AclOperation.READ, AclPermissionType.ALLOW)
    with pytest.raises(KafkaException) as exc:
        carol.create_acls([carols])[carols].result(10)
    assert exc.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED
    # (librdkafka drops DescribeAcls' top-level error, so ask with a raw client)
    assert describe_acls_error(raw_sasl_plain(b.bootstrap, "carol")) == ErrorCode.CLUSTER_AUTHORIZATION_FAILED

    # `kafscale acls` writes etcd directly; brokers pick it up within a second (all ACLs in one
    # read, so once the topic ACL written last is visible, the group ACL written before it is too)
    kafscale(b, "acls", "add", "--principal", "User:carol", "--operation", "read", "--group", "carol-", "--prefixed")
    out = kafscale(b, "acls", "add", "--principal", "User:carol", "--operation", "read", "--operation", "describe",
                   "--topic", orders)
    assert out.count("added:") == 2
    wait_for(lambda: orders in carol.list_topics(timeout=10).topics, 10, "carol's new Describe ACL")
    assert consume_errors(b.bootstrap, sasl("carol"), orders, "carol-1", False, 5) == (
        [b"m%d" % i for i in range(5)], set())
    assert "User:carol" in kafscale(b, "acls", "ls", "--topic", orders)

    # a DENY overrides the prefixed ALLOW; deleting bob's ACLs locks him out again
    deny = AclBinding(ResourceType.TOPIC, orders, ResourcePatternType.LITERAL, "User:alice", "*",
                      AclOperation.ALL, AclPermissionType.DENY)
    admin.create_acls([deny])[deny].result(10)
    assert produce_errors(b.bootstrap, sasl("alice"), orders, 1) == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    bobs = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, "User:bob", None, AclOperation.ANY,
                            AclPermissionType.ANY)
    assert len(admin.delete_acls([bobs])[bobs].result(10)) == 2
    assert consume_errors(b.bootstrap, sasl("bob"), orders, "bob-1", True, 5)[1] & {
        KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED}
    assert b.alive()


def test_acl_apis_need_the_authorizer(broker):
    assert describe_acls_error(RawClient(broker.bootstrap)) == ErrorCode.SECURITY_DISABLED
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    acl = AclBinding(ResourceType.TOPIC, "t", ResourcePatternType.LITERAL, "User:x", "*", AclOperation.READ,
                     AclPermissionType.ALLOW)
    with pytest.raises(KafkaException) as exc:
        admin.create_acls([acl])[acl].result(10)
    assert exc.value.args[0].code() == KafkaError.SECURITY_DISABLED


def test_admin_endpoint_needs_a_kafka_user_when_the_listener_does(make_broker):
    """With SASL and the authorizer on, the console and /metrics need HTTP Basic
    credentials of a super user (probes stay open), and requests a page on
    another site could send (a form POST, a foreign Origin) are refused."""
    import base64
    import urllib.error
    import urllib.request

    from kafscale.devstack import free_port

    admin = f"127.0.0.1:{free_port()}"
    b = make_broker(workers=1, sasl_mechanisms="PLAIN", authorizer="true", super_users="User:admin",
                    admin_listen=admin, console_user="ops", console_password="s3cret")
    add_users(b, "admin", "alice")

    def status(path: str, user: str | None = None, method: str = "GET", body: bytes | None = None,
               headers: dict[str, str] | None = None) -> int:
        req = urllib.request.Request(f"http://{admin}{path}", data=body, method=method, headers=headers or {})
        if user:
            token = base64.b64encode(f"{user}:{PASSWORDS.get(user, 'wrong')}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("/healthz") == 200 and status("/readyz") == 200
    for path in ("/", "/api/overview", "/metrics"):
        assert status(path) == 401, path
        assert status(path, "mallory") == 401, path
        assert status(path, "alice") == 403, path
        assert status(path, "admin") == 200, path
    # records and groups are read over Kafka as the signed-in user (SASL PLAIN here)
    assert status("/api/topics/no-such-topic/records", "admin") == 404
    assert status("/api/groups/no-such-group", "admin") == 404  # GROUP_ID_NOT_FOUND (DescribeGroups v6)
    form = {"Content-Type": "text/plain"}
    assert status("/api/topics", "admin", "POST", b'{"name": "x"}', form) == 415
    foreign = {"Content-Type": "application/json", "Origin": "http://evil.example"}
    assert status("/api/topics", "admin", "POST", b'{"name": "x"}', foreign) == 403


def test_sasl_and_acls_through_the_proxy(make_cluster, topic_name):
    """The proxy authenticates clients with the cluster's SASL users and, with
    proxy_secret, opens each client's broker connections as that client: the
    brokers' ACLs apply to alice through the proxy as they do directly."""
    *brokers, proxy = make_cluster(2, proxy=True, workers=1, sasl_mechanisms="PLAIN", authorizer="true",
                                   super_users="User:admin", proxy_secret="proxy-s3cret")
    add_users(brokers[0], "admin", "alice")
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap, **sasl("admin")})
    orders, payments = f"orders-{topic_name}", f"payments-{topic_name}"
    for f in admin.create_topics([NewTopic(orders, 4, 1), NewTopic(payments, 1, 1)]).values():
        f.result(30)
    grant = AclBinding(ResourceType.TOPIC, orders, ResourcePatternType.LITERAL, "User:alice", "*",
                       AclOperation.WRITE, AclPermissionType.ALLOW)
    admin.create_acls([grant])[grant].result(10)
    time.sleep(1.5)  # brokers re-read ACLs every second
    assert produce_errors(proxy.bootstrap, sasl("alice"), orders, 20) == set()
    assert produce_errors(proxy.bootstrap, sasl("alice"), payments, 1) == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    wrong = {**sasl("alice"), "sasl.password": "wrong"}
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": proxy.bootstrap, **wrong}).list_topics(timeout=5)


def test_host_acls_hold_through_the_proxy(make_cluster, topic_name):
    """With proxy_secret, brokers see each client's own address behind the
    proxy: an ACL allowing only host 127.0.0.1 lets a client connecting from
    127.0.0.1 describe the topic and refuses one from 127.0.0.2."""
    *brokers, proxy = make_cluster(1, proxy=True, workers=1, authorizer="true", allow_everyone_if_no_acl_found="true",
                                   proxy_secret="proxy-s3cret")
    create_topic(brokers[0].bootstrap, topic_name)  # allowed: no ACL names the cluster or the topic yet
    kafscale(brokers[0], "acls", "add", "--principal", "User:ANONYMOUS", "--operation", "describe",
             "--topic", topic_name, "--host", "127.0.0.1")
    time.sleep(1.5)

    def describe_from(source: str) -> int:
        c = RawClient(proxy.bootstrap, source=source)
        md = c.request(schemas.METADATA.key, 12, {"topics": [{"name": topic_name, "topic_id": bytes(16)}],
                                          "allow_auto_topic_creation": False,
                                          "include_topic_authorized_operations": False})
        c.close()
        return md["topics"][0]["error_code"]

    assert describe_from("127.0.0.1") == 0
    assert describe_from("127.0.0.2") == ErrorCode.TOPIC_AUTHORIZATION_FAILED
    # a client cannot pass itself off as the proxy without the secret
    c = RawClient(brokers[0].bootstrap, source="127.0.0.2")
    assert c.request(schemas.SASL_HANDSHAKE.key, 1, {"mechanism": "KAFSCALE-PROXY"})["error_code"] == 0
    token = json.dumps({"secret": "guess", "principal": "User:admin", "host": "/127.0.0.1"}).encode()
    r = c.request(schemas.SASL_AUTHENTICATE.key, 2, {"auth_bytes": token})
    assert r["error_code"] == ErrorCode.SASL_AUTHENTICATION_FAILED
    assert c.closed_by_peer()
    c.close()
