"""Admin APIs through confluent-kafka's AdminClient and kafka-python's admin client."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
)

from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import INCREMENTAL_ALTER_CONFIGS, OFFSET_FOR_LEADER_EPOCH
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.rawclient import RawClient


def topic_configs(admin: AdminClient, topic: str) -> dict[str, ConfigEntry]:
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return admin.describe_configs([res])[res].result(10)


def test_create_partitions(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=2)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_partitions([NewPartitions(topic_name, 5)])[topic_name].result(10)
    assert len(admin.list_topics(timeout=10).topics[topic_name].partitions) == 5
    assert confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", b"in p4")], partition=4) == [0]
    assert [r.value for _, r in confluent_consume(broker.bootstrap, topic_name, 1, partition=4)] == [b"in p4"]
    with pytest.raises(KafkaException) as exc:
        admin.create_partitions([NewPartitions(topic_name, 3)])[topic_name].result(10)
    assert exc.value.args[0].code() == ErrorCode.INVALID_PARTITIONS


def test_describe_and_alter_configs(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, config={"retention.ms": "3600000"})
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    cfg = topic_configs(admin, topic_name)
    assert cfg["retention.ms"].value == "3600000" and not cfg["retention.ms"].is_default
    assert cfg["retention.bytes"].value == "-1" and cfg["retention.bytes"].is_default
    assert cfg["cleanup.policy"].value == "delete"

    res = ConfigResource(ConfigResource.Type.TOPIC, topic_name, incremental_configs=[
        ConfigEntry("retention.bytes", "1048576", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.ms", None, incremental_operation=AlterConfigOpType.DELETE)])
    admin.incremental_alter_configs([res])[res].result(10)
    cfg = topic_configs(admin, topic_name)
    assert cfg["retention.bytes"].value == "1048576" and cfg["retention.ms"].is_default

    for bad in (ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET),
                ConfigEntry("retention.ms", "soon", incremental_operation=AlterConfigOpType.SET),
                ConfigEntry("no.such.config", "1", incremental_operation=AlterConfigOpType.SET)):
        res = ConfigResource(ConfigResource.Type.TOPIC, topic_name, incremental_configs=[bad])
        with pytest.raises(KafkaException) as exc:
            admin.incremental_alter_configs([res])[res].result(10)
        assert exc.value.args[0].code() == ErrorCode.INVALID_CONFIG, bad.name
    assert topic_configs(admin, topic_name)["retention.bytes"].value == "1048576"  # unchanged by failures

    # max.message.bytes is enforced per topic
    res = ConfigResource(ConfigResource.Type.TOPIC, topic_name, incremental_configs=[
        ConfigEntry("max.message.bytes", "2000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result(10)
    with pytest.raises(AssertionError, match="MSG_SIZE_TOO_LARGE"):
        confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", b"x" * 5000)], retries=0)

    broker_res = ConfigResource(ConfigResource.Type.BROKER, "1")
    bcfg = admin.describe_configs([broker_res])[broker_res].result(10)
    assert bcfg["auto.create.topics.enable"].is_read_only


def test_kafka_python_admin_and_describe_cluster(broker, topic_name):
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic_name, 3, 1, topic_configs={"retention.ms": "1000000"})])
    desc = admin.describe_configs([KConfigResource(ConfigResourceType.TOPIC, topic_name)])
    assert "1000000" in repr(desc)
    admin.alter_configs([KConfigResource(ConfigResourceType.TOPIC, topic_name, configs={"retention.ms": "5000"})])
    assert "5000" in repr(admin.describe_configs([KConfigResource(ConfigResourceType.TOPIC, topic_name)]))
    cluster = admin.describe_cluster()
    assert cluster["cluster_id"] and [b["broker_id"] for b in cluster["brokers"]] == [1]
    admin.close()
    # without an authorizer every operation is authorized: 7 on the cluster, 8 on a topic (librdkafka)
    from confluent_kafka import TopicCollection

    rd = AdminClient({"bootstrap.servers": broker.bootstrap})
    assert len(rd.describe_cluster(include_authorized_operations=True).result(10).authorized_operations) == 7
    [topic] = rd.describe_topics(TopicCollection([topic_name]), include_authorized_operations=True).values()
    assert len(topic.result(10).authorized_operations) == 8


def test_offset_for_leader_epoch(broker, topic_name):
    create_topic(broker.bootstrap, topic_name)
    confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", b"v")] * 3)
    c = RawClient(broker.bootstrap)
    body = {"replica_id": -1, "topics": [{"topic": topic_name, "partitions": [
        {"partition": 0, "current_leader_epoch": 0, "leader_epoch": 0},
        {"partition": 7, "current_leader_epoch": 0, "leader_epoch": 0}]}]}
    parts = c.request(OFFSET_FOR_LEADER_EPOCH.key, 4, body)["topics"][0]["partitions"]
    assert (parts[0]["error_code"], parts[0]["leader_epoch"], parts[0]["end_offset"]) == (0, 0, 3)
    assert parts[1]["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    c.close()


def test_delete_records_with_two_admin_clients(broker, topic_name):
    """DeleteRecords moves a partition's log start (fenced, like a commit):
    nothing before it is served again, whole segments before it go, and an
    offset beyond the high watermark is refused."""
    from confluent_kafka import Consumer, TopicPartition
    from kafka import TopicPartition as KTopicPartition
    from kafka.admin import KafkaAdminClient
    from kafka.errors import OffsetOutOfRangeError

    create_topic(broker.bootstrap, topic_name, partitions=2)
    for p in (0, 1):
        for i in range(3):  # three segments of 3 records each
            confluent_produce(broker.bootstrap, topic_name, [Rec(None, b"p%d-%d" % (p, 3 * i + j)) for j in range(3)],
                              partition=p)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    [fut] = admin.delete_records([TopicPartition(topic_name, 0, 4)]).values()
    assert fut.result(10).low_watermark == 4
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        got = py.delete_records({KTopicPartition(topic_name, 1): 7})
        assert got[KTopicPartition(topic_name, 1)]["low_watermark"] == 7
        with pytest.raises(OffsetOutOfRangeError):
            py.delete_records({KTopicPartition(topic_name, 1): 100})
    finally:
        py.close()
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"{topic_name}-r"})
    assert [c.get_watermark_offsets(TopicPartition(topic_name, p), timeout=10) for p in (0, 1)] == [(4, 9), (7, 9)]
    c.assign([TopicPartition(topic_name, 0, -2)])
    values = []
    while len(values) < 5:
        m = c.poll(10)
        assert m is not None and not m.error(), m and m.error()
        values.append((m.offset(), m.value()))
    c.close()
    assert values == [(i, b"p0-%d" % i) for i in range(4, 9)], "served from the new log start, nothing before it"


def test_offset_delete_with_kafka_python(broker, topic_name):
    """OffsetDelete forgets a group's committed offsets of some partitions,
    and refuses those of a topic the group's live members subscribe to."""
    import time

    from confluent_kafka import Consumer, TopicPartition
    from kafka import TopicPartition as KTopicPartition
    from kafka.admin import KafkaAdminClient
    from kafka.errors import GroupIdNotFoundError, GroupSubscribedToTopicError, NoError

    create_topic(broker.bootstrap, topic_name, partitions=2)
    group = f"{topic_name}-g"
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic_name, 0, 5), TopicPartition(topic_name, 1, 6)], asynchronous=False)
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert py.delete_group_offsets(group, [KTopicPartition(topic_name, 0)]) == {
            KTopicPartition(topic_name, 0): NoError}
        assert [tp.offset for tp in c.committed([TopicPartition(topic_name, p) for p in (0, 1)], 10)] == [-1001, 6]
        c.subscribe([topic_name])
        deadline = time.monotonic() + 30
        while not c.assignment() and time.monotonic() < deadline:
            c.poll(0.2)
        assert c.assignment(), "the member joined"
        refused = py.delete_group_offsets(group, [KTopicPartition(topic_name, 1)])
        assert refused == {KTopicPartition(topic_name, 1): GroupSubscribedToTopicError}
        with pytest.raises(GroupIdNotFoundError):
            py.delete_group_offsets(f"{group}-none", [KTopicPartition(topic_name, 1)])
    finally:
        py.close()
        c.close()


def test_manual_assignments_and_message_format_version_are_accepted(broker, topic_name):
    """Replica assignments naming live brokers are accepted (placement is not
    applied: S3 keeps the one copy); one naming another broker is refused with
    INVALID_REPLICA_ASSIGNMENT. message.format.version is accepted and ignored."""
    from confluent_kafka.admin import NewTopic
    from kafka.admin import KafkaAdminClient
    from kafka.admin import NewPartitions as KNewPartitions

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    new = NewTopic(topic_name, 3, replica_assignment=[[1], [1], [1]], config={"message.format.version": "2.8"})
    admin.create_topics([new])[topic_name].result(10)
    assert len(admin.list_topics(timeout=10).topics[topic_name].partitions) == 3
    with pytest.raises(KafkaException) as exc:
        bad = NewTopic(f"{topic_name}-x", 2, replica_assignment=[[1], [99]])
        admin.create_topics([bad])[bad.topic].result(10)
    assert exc.value.args[0].code() == ErrorCode.INVALID_REPLICA_ASSIGNMENT
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        py.create_partitions({topic_name: KNewPartitions(total_count=5, new_assignments=[[1], [1]])})
    finally:
        py.close()
    assert len(admin.list_topics(timeout=10).topics[topic_name].partitions) == 5
    assert confluent_produce(broker.bootstrap, topic_name, [Rec(b"k", b"v")], partition=4) == [0]


def test_replication_admin_apis_answer_for_brokers_without_replicas(broker, topic_name):
    """DescribeLogDirs sizes the partitions this broker serves from their
    manifests; no reassignment is ever in progress, one is refused with its
    reason; every partition already has its leader (ElectLeaders)."""
    from confluent_kafka import ElectionType, TopicPartition
    from kafka import TopicPartition as KTopicPartition
    from kafka.admin import KafkaAdminClient
    from kafka.errors import InvalidReplicationAssignmentError

    create_topic(broker.bootstrap, topic_name, partitions=2)
    confluent_produce(broker.bootstrap, topic_name, [Rec(None, b"x" * 1000)] * 5, partition=1)
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        [dirs] = py.describe_log_dirs({topic_name: [0, 1]})
        [log_dir] = dirs["results"] if "results" in dirs else dirs["log_dirs"]
        assert str(log_dir["log_dir"]).startswith("s3://")
        [topic] = [t for t in log_dir["topics"] if t["name"] == topic_name]
        sizes = {p["partition_index"]: p["partition_size"] for p in topic["partitions"]}
        assert sizes[0] == 0 and sizes[1] > 5000, sizes
        assert py.list_partition_reassignments() == {}
        refused = py.alter_partition_reassignments({KTopicPartition(topic_name, 0): [1]})
        assert refused[KTopicPartition(topic_name, 0)] is InvalidReplicationAssignmentError
    finally:
        py.close()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    elected = admin.elect_leaders(ElectionType.PREFERRED, [TopicPartition(topic_name, 0)]).result(10)
    assert [(tp.partition, err.code()) for tp, err in elected.items()] == [(0, ErrorCode.ELECTION_NOT_NEEDED)]


def test_describe_topic_partitions_pages_with_a_cursor(broker, topic_name):
    """DescribeTopicPartitions (KIP-966, kafka-python): pages of at most the
    requested number of partitions, across topics in name order, with a cursor."""
    from kafka.admin import KafkaAdminClient

    create_topic(broker.bootstrap, f"{topic_name}-a", partitions=3)
    create_topic(broker.bootstrap, f"{topic_name}-b", partitions=2)
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        seen, cursor, pages = [], None, 0
        while True:
            page = py.describe_topic_partitions([f"{topic_name}-b", f"{topic_name}-a"], response_partition_limit=2,
                                                cursor=cursor)
            pages += 1
            for t in page["topics"]:
                assert t["error_code"] == 0 and t["topic_authorized_operations"] > 0
                seen += [(t["name"], p["partition_index"], p["leader_id"]) for p in t["partitions"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert pages == 3
        assert seen == [(f"{topic_name}-a", p, 1) for p in range(3)] + [(f"{topic_name}-b", p, 1) for p in range(2)]
        [missing] = py.describe_topic_partitions([f"{topic_name}-none"])["topics"]
        assert missing["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    finally:
        py.close()


def test_broker_configs_are_described(broker):
    """DescribeConfigs of a broker resource lists its settings, read-only (kafka-python and librdkafka)."""
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient

    res = ConfigResource(ConfigResource.Type.BROKER, "1")
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    entries = admin.describe_configs([res])[res].result(10)
    assert entries["broker.id"].value == "1" and entries["broker.id"].is_read_only
    assert entries["advertised.listeners"].value == f"PLAINTEXT://{broker.bootstrap}"
    assert entries["log.dirs"].value.startswith("s3://")
    py = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        # kafka-python shows only modified configs unless asked: static ones need config_filter="all"
        resp = py.describe_configs([KConfigResource(ConfigResourceType.BROKER, "1")], config_filter="all")
        assert "log.retention.ms" in repr(resp) and "num.partitions" in repr(resp), resp
    finally:
        py.close()


def test_dynamic_broker_configs_apply_cluster_wide(make_cluster, topic_name):
    """IncrementalAlterConfigs/AlterConfigs on a broker resource (the cluster default or
    any live broker) change the defaults of every broker, through etcd."""
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient, NewTopic

    b1, b2 = make_cluster(2, balance_interval_ms=300)
    admin1 = AdminClient({"bootstrap.servers": b1.bootstrap})
    admin2 = AdminClient({"bootstrap.servers": b2.bootstrap})

    def alter(admin: AdminClient, broker: str, *entries: ConfigEntry) -> None:
        res = ConfigResource(ConfigResource.Type.BROKER, broker, incremental_configs=list(entries))
        admin.incremental_alter_configs([res])[res].result(10)

    def described(admin: AdminClient, broker: str) -> dict[str, ConfigEntry]:
        res = ConfigResource(ConfigResource.Type.BROKER, broker)
        return admin.describe_configs([res])[res].result(10)

    alter(admin1, "1", ConfigEntry("num.partitions", "3", incremental_operation=AlterConfigOpType.SET),
          ConfigEntry("log.retention.ms", "600000", incremental_operation=AlterConfigOpType.SET))
    deadline = time.monotonic() + 10  # broker 2 adopts them at its next balancing pass
    while described(admin2, "2")["num.partitions"].value != "3":
        assert time.monotonic() < deadline, "broker 2 never saw the change"
        time.sleep(0.2)
    entry = described(admin2, "2")["log.retention.ms"]
    assert entry.value == "600000" and not entry.is_read_only
    assert entry.source == ConfigSource.DYNAMIC_DEFAULT_BROKER_CONFIG.value
    assert described(admin2, "2")["broker.id"].is_read_only

    py = KafkaAdminClient(bootstrap_servers=b2.bootstrap)
    try:
        py.create_topics([NewTopic(topic_name, num_partitions=-1, replication_factor=-1)])  # the broker default
        assert len(py.describe_topics([topic_name])[0]["partitions"]) == 3
        retention = topic_configs(admin1, topic_name)["retention.ms"]
        assert (retention.value, retention.is_default) == ("600000", True)
        # kafka-python's (non-incremental) AlterConfigs on broker 2 replaces the dynamic set, for broker 1 too
        py.alter_configs([KConfigResource(ConfigResourceType.BROKER, "2", configs={"log.retention.ms": "120000"})],
                         incremental=False)
    finally:
        py.close()
    while described(admin1, "1")["log.retention.ms"].value != "120000":
        assert time.monotonic() < deadline + 10
        time.sleep(0.2)
    assert described(admin1, "1")["num.partitions"].value == "1"  # back to the static setting
    assert topic_configs(admin2, topic_name)["retention.ms"].value == "120000"

    for broker, entry, code in (
            ("1", ConfigEntry("broker.id", "5", incremental_operation=AlterConfigOpType.SET), ErrorCode.INVALID_CONFIG),
            ("1", ConfigEntry("num.partitions", "0", incremental_operation=AlterConfigOpType.SET),
             ErrorCode.INVALID_CONFIG)):
        with pytest.raises(KafkaException) as exc:
            alter(admin1, broker, entry)
        assert exc.value.args[0].code() == code, (broker, entry.name)
    assert described(admin1, "1")["log.retention.ms"].value == "120000"  # unchanged by the failures

    # the cluster default, as `kafka-configs --entity-default` names it (an empty broker name),
    # and a broker that is not live (librdkafka would wait for broker 9 to answer)
    raw = RawClient(b1.bootstrap)
    for name, code in (("", ErrorCode.NONE), ("9", ErrorCode.INVALID_REQUEST)):
        body = {"validate_only": False, "resources": [{"resource_type": 4, "resource_name": name, "configs": [
            {"name": "num.partitions", "config_operation": 0, "value": "2" if name == "" else "7"}]}]}
        assert raw.request(INCREMENTAL_ALTER_CONFIGS.key, 1, body)["responses"][0]["error_code"] == code, name
    raw.close()
    assert described(admin1, "1")["num.partitions"].value == "2"
