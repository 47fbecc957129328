"""Consumer groups with real clients: rebalances, crashes, restarts, offsets."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, ConsumerGroupState, ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.integration.clients import create_topic, kcat

PARTITIONS = 4


def produce_spread(bootstrap: str, topic: str, n: int, partitions: int = PARTITIONS) -> set[tuple[int, int]]:
    """n records round-robin over the partitions; returns every (partition, offset)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    done: set[tuple[int, int]] = set()
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, partition=i % partitions,
                  on_delivery=lambda err, m: done.add((m.partition(), m.offset())) if err is None else None)
        if i % 500 == 0:
            p.poll(0)
    assert p.flush(60) == 0
    assert len(done) == n
    return done


class Member:
    def __init__(self, lib: str, bootstrap: str, group: str, topic: str, out: Path, strategy: str = "range"):
        self.out = out
        self.err = open(out.with_suffix(".err"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.group_member", lib, bootstrap, group,
                                      topic, str(out), strategy], stderr=self.err)

    def processed(self) -> list[tuple[int, int]]:
        if not self.out.exists():
            return []
        rows = []
        for line in self.out.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                rows.append((int(parts[0]), int(parts[1])))
        return rows

    def stderr_tail(self, n: int = 2000) -> str:
        """The end of what the member's process wrote to stderr (its client's logs)."""
        return self.out.with_suffix(".err").read_bytes()[-n:].decode(errors="replace")

    def assignments(self) -> list[set[int]]:
        text = self.out.read_text() if self.out.exists() else ""
        return [{int(p) for p in line.split()[1].split(",") if p} if len(line.split()) > 1 else set()
                for line in text.splitlines() if line.startswith("assigned")]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stable_with(bootstrap: str, group: str, n: int) -> bool:
    """The group is stable with n members, each assigned at least one partition."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    desc = admin.describe_consumer_groups([group])[group].result(10)
    return (desc.state == ConsumerGroupState.STABLE and len(desc.members) == n
            and all(m.assignment.topic_partitions for m in desc.members))


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("lib", ["confluent", "kafka-python", "aiokafka"])
def test_rebalance_and_crash_skip_nothing(broker, topic_name, tmp_path, lib):
    """Members join and one is SIGKILLed mid-stream; with commits after processing
    every record is processed at least once (count and compare)."""
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    produced = produce_spread(broker.bootstrap, topic_name, 1000)
    group = f"g-{topic_name}"
    members = [Member(lib, broker.bootstrap, group, topic_name, tmp_path / "m0.txt")]

    def seen() -> list[tuple[int, int]]:
        return [r for m in members for r in m.processed()]

    try:
        wait_for(lambda: len(seen()) >= 200, 60, "the first member to consume")
        members.append(Member(lib, broker.bootstrap, group, topic_name, tmp_path / "m1.txt"))
        members.append(Member(lib, broker.bootstrap, group, topic_name, tmp_path / "m2.txt"))
        # produce only once the new members own partitions: before that the first member may take it all
        wait_for(lambda: stable_with(broker.bootstrap, group, 3), 60, "three members to share the partitions")
        produced |= produce_spread(broker.bootstrap, topic_name, 1000)
        wait_for(lambda: len(members[1].processed()) > 0 or len(members[2].processed()) > 0, 60,
                 "the rebalance to give work to new members")
        members[0].kill()  # crash: no LeaveGroup, no final commit
        produced |= produce_spread(broker.bootstrap, topic_name, 1000)
        wait_for(lambda: set(seen()) >= produced, 120, "every record to be processed")
    finally:
        for m in members:
            m.stop()
    rows = seen()
    assert set(rows) == produced
    duplicates = len(rows) - len(set(rows))
    assert duplicates < len(produced), duplicates  # only redelivery of uncommitted work


@pytest.mark.parametrize("strategy", ["range", "roundrobin", "cooperative-sticky"])
def test_assignment_strategies(broker, topic_name, tmp_path, strategy):
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    group = f"g-{topic_name}"
    a = Member("confluent", broker.bootstrap, group, topic_name, tmp_path / "a.txt", strategy)
    b = Member("confluent", broker.bootstrap, group, topic_name, tmp_path / "b.txt", strategy)
    try:
        def split() -> bool:
            aa, bb = a.assignments(), b.assignments()
            if strategy == "cooperative-sticky":  # incremental: accumulate assigned partitions
                have_a = set().union(*aa) if aa else set()
                have_b = set().union(*bb) if bb else set()
            else:
                have_a, have_b = (aa[-1] if aa else set()), (bb[-1] if bb else set())
            return bool(have_a) and bool(have_b) and have_a | have_b == set(range(PARTITIONS))

        wait_for(split, 60, f"{strategy} to split the partitions")
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})  # kept alive until its future resolves
        desc = admin.describe_consumer_groups([group])[group].result(10)
        assert desc.partition_assignor == strategy
        assert len(desc.members) == 2
        owned = [tp.partition for m in desc.members for tp in m.assignment.topic_partitions]
        assert sorted(owned) == list(range(PARTITIONS))
    finally:
        a.stop()
        b.stop()


def test_kcat_balanced_consumer_commits(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    produce_spread(broker.bootstrap, topic_name, 400)
    group = f"g-{topic_name}"
    out = kcat("-b", broker.bootstrap, "-G", group, topic_name, "-o", "beginning", "-e", "-q", "-f", "%p %o\n",
               timeout=60)
    assert len(set(out.decode().split("\n")) - {""}) == 400
    again = kcat("-b", broker.bootstrap, "-G", group, topic_name, "-e", "-q", "-f", "%p %o\n", timeout=60)
    assert again.decode().strip() == ""  # resumed from the committed offsets


def test_offsets_and_group_survive_broker_sigkill(make_broker, topic_name, tmp_path):
    b = make_broker()
    create_topic(b.bootstrap, topic_name, partitions=PARTITIONS)
    produced = produce_spread(b.bootstrap, topic_name, 400)
    group = f"g-{topic_name}"
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic_name])
    got: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 60
    while len(got) < 200 and time.monotonic() < deadline:
        msgs = [m for m in c.consume(50, 0.5) if m.error() is None]
        got |= {(m.partition(), m.offset()) for m in msgs}
        if msgs:
            c.commit(asynchronous=False)
    committed = {tp.partition: tp.offset for tp in c.committed([TopicPartition(topic_name, p)
                                                                for p in range(PARTITIONS)], timeout=10)
                 if tp.offset >= 0}
    assert committed
    c.close()
    b.kill()
    b.start()
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(10)
    assert {tp.partition: tp.offset for tp in res.topic_partitions} == committed
    # a new member resumes exactly there and reads the rest
    m = Member("confluent", b.bootstrap, group, topic_name, tmp_path / "after.txt")
    try:
        wait_for(lambda: got | set(m.processed()) >= produced, 60, "the rest of the records")
    finally:
        m.stop()
    resumed = {}
    for p, o in m.processed():
        resumed.setdefault(p, o)
    assert all(resumed[p] == committed.get(p, 0) for p in resumed)


def test_static_membership_keeps_assignment(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    group = f"g-{topic_name}"
    conf = {"bootstrap.servers": broker.bootstrap, "group.id": group, "session.timeout.ms": 30000,
            "auto.offset.reset": "earliest"}
    assigned: dict[str, list[int]] = {}

    def consumer(instance: str) -> Consumer:
        c = Consumer({**conf, "group.instance.id": instance})
        c.subscribe([topic_name], on_assign=lambda _c, parts: assigned.__setitem__(
            instance, sorted(p.partition for p in parts)))
        return c

    a, b = consumer("static-a"), consumer("static-b")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (assigned.get("static-a") and assigned.get("static-b")
                                               and len(assigned["static-a"] + assigned["static-b"]) == PARTITIONS):
        a.poll(0.2)
        b.poll(0.2)
    first = dict(assigned)
    assert sorted(first["static-a"] + first["static-b"]) == list(range(PARTITIONS))
    a.close()  # a static member does not leave the group on close
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    assert len(admin.describe_consumer_groups([group])[group].result(10).members) == 2
    assigned.pop("static-a")
    a = consumer("static-a")  # back within the session timeout, with a new member id
    deadline = time.monotonic() + 30
    while "static-a" not in assigned and time.monotonic() < deadline:
        a.poll(0.2)
        b.poll(0.2)
    assert assigned["static-a"] == first["static-a"]
    assert assigned["static-b"] == first["static-b"]  # b was not rebalanced
    desc = admin.describe_consumer_groups([group])[group].result(10)
    assert sorted(m.group_instance_id for m in desc.members) == ["static-a", "static-b"]
    a.close()
    b.close()


def test_admin_list_describe_delete(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=2)
    group = f"g-{topic_name}"
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "auto.offset.reset": "earliest"})
    c.commit(offsets=[TopicPartition(topic_name, 0, 7), TopicPartition(topic_name, 1, 3)], asynchronous=False)
    c.close()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    listed = admin.list_consumer_groups().result(10)
    assert group in {g.group_id for g in listed.valid}
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(10)
    assert sorted((tp.partition, tp.offset) for tp in res.topic_partitions) == [(0, 7), (1, 3)]
    admin.delete_consumer_groups([group])[group].result(10)
    assert group not in {g.group_id for g in admin.list_consumer_groups().result(10).valid}
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(10)
    assert all(tp.offset < 0 for tp in res.topic_partitions)


def test_group_error_codes(broker, topic_name):
    from kafscale.protocol.errors import ErrorCode as E
    from kafscale.protocol.schemas import (
        DELETE_GROUPS,
        HEARTBEAT,
        JOIN_GROUP,
        LEAVE_GROUP,
        OFFSET_COMMIT,
        SYNC_GROUP,
    )
    from tests.integration.rawclient import RawClient

    create_topic(broker.bootstrap, topic_name)
    group = f"g-{topic_name}"
    c = RawClient(broker.bootstrap, timeout=30)

    def join(member_id: str = "", session_ms: int = 10000, ptype: str = "consumer", version: int = 5, **kw) -> dict:
        body = {"group_id": kw.get("group", group), "session_timeout_ms": session_ms, "rebalance_timeout_ms": 5000,
                "member_id": member_id, "group_instance_id": None, "protocol_type": ptype,
                "protocols": [{"name": "range", "metadata": b"\x00"}]}
        return c.request(JOIN_GROUP.key, version, body)

    assert join(group="")["error_code"] == E.INVALID_GROUP_ID
    assert join(session_ms=10)["error_code"] == E.INVALID_SESSION_TIMEOUT
    first = join()
    assert first["error_code"] == E.MEMBER_ID_REQUIRED and first["member_id"]
    assert join(member_id="made-up")["error_code"] == E.UNKNOWN_MEMBER_ID
    joined = join(member_id=first["member_id"])
    assert joined["error_code"] == 0 and joined["leader"] == first["member_id"]
    mid, gen = joined["member_id"], joined["generation_id"]
    assert join(member_id="", ptype="connect", version=3)["error_code"] == E.INCONSISTENT_GROUP_PROTOCOL

    def sync(member: str, generation: int) -> dict:
        return c.request(SYNC_GROUP.key, 3, {"group_id": group, "generation_id": generation, "member_id": member,
                                             "assignments": [{"member_id": mid, "assignment": b"\x01\x02"}]})

    assert sync(mid, gen + 5)["error_code"] == E.ILLEGAL_GENERATION
    assert sync("stranger", gen)["error_code"] == E.UNKNOWN_MEMBER_ID
    ok = sync(mid, gen)
    assert ok["error_code"] == 0 and ok["assignment"] == b"\x01\x02"

    def heartbeat(member: str, generation: int) -> int:
        return c.request(HEARTBEAT.key, 3, {"group_id": group, "generation_id": generation,
                                            "member_id": member})["error_code"]

    assert heartbeat(mid, gen) == 0
    assert heartbeat(mid, gen - 1) == E.ILLEGAL_GENERATION
    assert heartbeat("stranger", gen) == E.UNKNOWN_MEMBER_ID

    def commit(member: str, generation: int, metadata: str = "", partition: int = 0) -> int:
        body = {"group_id": group, "generation_id_or_member_epoch": generation, "member_id": member,
                "topics": [{"name": topic_name, "partitions": [
                    {"partition_index": partition, "committed_offset": 1, "committed_metadata": metadata}]}]}
        return c.request(OFFSET_COMMIT.key, 7, body)["topics"][0]["partitions"][0]["error_code"]

    assert commit(mid, gen) == 0
    assert commit(mid, gen + 1) == E.ILLEGAL_GENERATION
    assert commit("stranger", gen) == E.UNKNOWN_MEMBER_ID
    assert commit(mid, gen, metadata="x" * 5000) == E.OFFSET_METADATA_TOO_LARGE
    assert commit(mid, gen, partition=9) == E.UNKNOWN_TOPIC_OR_PARTITION

    def delete(name: str) -> int:
        return c.request(DELETE_GROUPS.key, 2, {"groups_names": [name]})["results"][0]["error_code"]

    assert delete(group) == E.NON_EMPTY_GROUP
    assert delete("no-such-group") == E.GROUP_ID_NOT_FOUND
    left = c.request(LEAVE_GROUP.key, 4, {"group_id": group, "members": [{"member_id": mid}]})
    assert left["error_code"] == 0 and left["members"][0]["error_code"] == 0
    assert heartbeat(mid, gen) == E.UNKNOWN_MEMBER_ID
    assert delete(group) == 0
    c.close()


def test_several_kcat_members_share_the_topic(broker, topic_name):
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    produced = produce_spread(broker.bootstrap, topic_name, 800)
    group = f"g-{topic_name}"
    procs = [subprocess.Popen(["kcat", "-b", broker.bootstrap, "-G", group, topic_name, "-o", "beginning", "-e",
                               "-q", "-f", "%p %o\n"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    rows = [tuple(map(int, line.split())) for out in outs for line in out.splitlines() if line]
    assert set(rows) == produced
    assert all(out.strip() for out in outs), "both members got partitions"


def test_live_group_survives_broker_sigkill(make_broker, topic_name, tmp_path):
    """The group's generation and members are in etcd: after a broker restart a
    running member carries on with the same member id, without rejoining."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name, partitions=PARTITIONS)
    first = produce_spread(b.bootstrap, topic_name, 200)
    group = f"g-{topic_name}"
    m = Member("confluent", b.bootstrap, group, topic_name, tmp_path / "m.txt")
    try:
        wait_for(lambda: set(m.processed()) >= first, 60, "the first records")
        admin = AdminClient({"bootstrap.servers": b.bootstrap})
        before = admin.describe_consumer_groups([group])[group].result(10)
        b.kill()
        b.start()
        later = produce_spread(b.bootstrap, topic_name, 200)
        wait_for(lambda: set(m.processed()) >= first | later, 60, "records produced after the restart")
        admin = AdminClient({"bootstrap.servers": b.bootstrap})
        after = admin.describe_consumer_groups([group])[group].result(10)
        assert [x.member_id for x in after.members] == [x.member_id for x in before.members]
        since_restart = b.log().split("Kafka listener on")[-1]
        assert "joined" not in since_restart and "preparing rebalance" not in since_restart
    finally:
        m.stop()


def test_deleting_a_group_leaves_groups_named_under_it(broker, topic_name):
    """Group names are escaped in etcd keys: DeleteGroups("shared") must not
    delete the committed offsets of group "shared/prod"."""
    create_topic(broker.bootstrap, topic_name)
    shared, prod = f"shared-{topic_name}", f"shared-{topic_name}/prod"
    for group, offset in ((shared, 3), (prod, 7)):
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
        c.commit(offsets=[TopicPartition(topic_name, 0, offset)], asynchronous=False)
        c.close()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.delete_consumer_groups([shared])[shared].result(10)
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(prod)])[prod].result(10)
    assert [(tp.partition, tp.offset) for tp in res.topic_partitions] == [(0, 7)]
