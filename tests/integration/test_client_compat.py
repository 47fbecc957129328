"""What real clients legally send must not lose or reorder acknowledged data:
each test here reproduces a defect a real client found."""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.foreign import NODE, build_go, node, run
from tests.integration.test_groups import Member, produce_spread, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def sarama_produce(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go("sarama_produce", tmp_path_factory.mktemp("go"))


def test_sarama_batches_survive_retention_and_are_found_by_time(make_broker, topic_name, sarama_produce):
    """Sarama leaves RecordBatch.MaxTimestamp at -1: the broker must store the
    records' largest timestamp, so retention (1 minute here) keeps the batch and
    ListOffsets by time finds it."""
    b = make_broker(retention_check_ms=200)
    create_topic(b.bootstrap, topic_name, config={"retention.ms": "60000"})
    before = int(time.time() * 1000) - 1000
    assert run(sarama_produce, b.bootstrap, topic_name, "50").strip() == "acked 50"
    time.sleep(1.5)  # several retention passes
    got = confluent_consume(b.bootstrap, topic_name, 50, timeout=30)
    assert [o for o, _ in got] == list(range(50))
    assert [r.value for _, r in got] == [b"sarama-%d" % i for i in range(50)]
    assert "retention removed" not in b.log()
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "by-time"})
    try:
        [tp] = c.offsets_for_times([TopicPartition(topic_name, 0, before)], timeout=10)
        assert tp.offset == 0
        [tp] = c.offsets_for_times([TopicPartition(topic_name, 0, -3)], timeout=10)  # max timestamp (KIP-734)
        assert 0 <= tp.offset < 50
    finally:
        c.close()


def test_two_platformatic_idempotent_producers_keep_all_records(make_broker, topic_name):
    """@platformatic/kafka sends InitProducerId with producer id 0, epoch 0 and
    no transactional id: each producer must get an id of its own, or the second
    one's batches pass for retries of the first one's and are dropped."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    assert node("platformatic_idempotent.mjs", b.bootstrap, topic_name, "200").strip() == "acked 400"
    got = confluent_consume(b.bootstrap, topic_name, 400, timeout=30)
    assert len(got) == 400
    values = sorted(r.value for _, r in got)
    assert values == sorted(f"p{i}-{k}".encode() for i in range(2) for k in range(200))


def test_pipelined_async_commits_leave_the_last_offset(make_broker, stack, topic_name):
    """librdkafka sends asynchronous commits back to back on one connection:
    they must take effect in the order sent, so the last one wins. They are
    written to etcd a run at a time: one transaction each took over 10 s for
    these 1,000 on a slow machine (committed()'s own timeout: a timed-out
    look is looked again)."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name)
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": f"g-{topic_name}", "enable.auto.commit": False})
    tp = TopicPartition(topic_name, 0)
    try:
        c.list_topics(topic_name, timeout=10)  # connected before the count starts
        txns = stack.server_counts()["txns"]
        for i in range(1, 1001):
            c.commit(offsets=[TopicPartition(topic_name, 0, i)], asynchronous=True)
        began = time.monotonic()
        deadline = began + 60
        while time.monotonic() < deadline:
            c.poll(0.1)  # serves the commit callbacks
            try:
                [tp] = c.committed([TopicPartition(topic_name, 0)], timeout=10)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._TIMED_OUT:
                    raise
                continue
            if tp.offset == 1000:
                break
        seen = f"{tp.offset} after {time.monotonic() - began:.1f} s"  # 1000 then less is a reorder, else too slow
        time.sleep(1)  # any commit still in flight would land now
        [tp] = c.committed([TopicPartition(topic_name, 0)], timeout=10)
        assert tp.offset == 1000, f"committed {tp.offset}; the wait for 1000 saw {seen}"
        txns = stack.server_counts()["txns"] - txns
        assert txns < 100, f"{txns:.0f} etcd transactions for 1,000 commits"
    finally:
        c.close()


def test_fetch_max_bytes_below_two_batches_still_makes_progress(make_broker, topic_name):
    """With fetch.max.bytes=1000000 and a 900 KiB batch on each of two
    partitions, only the first partition may exceed what is left of the
    response's max_bytes: a 1.8 MB response is rejected by librdkafka."""
    b = make_broker()
    create_topic(b.bootstrap, topic_name, partitions=2)
    big = {p: bytes([65 + p]) * (900 * 1024) for p in (0, 1)}
    for p, value in big.items():
        confluent_produce(b.bootstrap, topic_name, [Rec(b"k", value)], partition=p)
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": f"g-{topic_name}", "enable.auto.commit": False,
                  "fetch.max.bytes": 1_000_000, "fetch.message.max.bytes": 1_000_000})
    got: dict[int, bytes] = {}
    try:
        c.assign([TopicPartition(topic_name, p, 0) for p in (0, 1)])
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None:
                assert msg.error() is None, msg.error()
                got[msg.partition()] = msg.value()
    finally:
        c.close()
    assert got == big


class KafkajsMember(Member):
    """A kafkajs group member in its own Node process (tests/integration/node/kafkajs_member.mjs),
    writing the same "PARTITION OFFSET" lines as Member, and "joined" per group join."""

    def __init__(self, bootstrap: str, group: str, topic: str, out: Path) -> None:
        self.out = out
        self.err = open(out.with_suffix(".err"), "wb")
        self.proc = subprocess.Popen(["node", str(NODE / "kafkajs_member.mjs"), bootstrap, group, topic, str(out)],
                                     stdout=subprocess.DEVNULL, stderr=self.err)

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def joins(self) -> int:
        return self.lines().count("joined")


def test_kafkajs_group_through_the_proxy_stays_stable(make_cluster, topic_name, tmp_path):
    """Three kafkajs members through `kafscale proxy` (3 brokers) stay in one
    generation while a fourth joins and leaves: a member's Heartbeat must
    never wait behind another member's JoinGroup on a shared upstream
    connection. Every produced record is processed."""
    *_, proxy = make_cluster(3, proxy=True)
    boot = proxy.bootstrap
    create_topic(boot, topic_name, partitions=4)
    group = f"g-{topic_name}"
    members = [KafkajsMember(boot, group, topic_name, tmp_path / f"m{i}.txt") for i in range(3)]
    extra = None
    produced: set[tuple[int, int]] = set()
    try:
        wait_for(lambda: all(m.joins() for m in members), 60, "three kafkajs members to join")
        # the members start a Node process each: one that starts past the group's initial delay joins later
        # and has the others join again, so the count that matters starts once the group has settled
        before = settled_joins(members)
        produced |= produce_spread(boot, topic_name, 1000, partitions=4)
        extra = KafkajsMember(boot, group, topic_name, tmp_path / "m3.txt")
        wait_for(lambda: extra.joins() > 0, 60, "a fourth member to join")
        produced |= produce_spread(boot, topic_name, 1000, partitions=4)
        extra.stop()
        produced |= produce_spread(boot, topic_name, 1000, partitions=4)
        everyone = [*members, extra]
        wait_for(lambda: produced <= {x for m in everyone for x in m.processed()}, 90,
                 "every record to be processed")
        time.sleep(3)  # a few heartbeats: the group must stay settled
        after = [m.joins() for m in members]  # before stopping them: each leaving has the others join again
    finally:
        for m in [*members, *([extra] if extra else [])]:
            m.stop()
    for m, settled, ended in zip(members, before, after, strict=True):
        assert not any(ln.startswith("crash") for ln in m.lines()), m.lines()[-3:]
        # once per rebalance: the fourth member arriving and leaving
        assert ended - settled <= 2, f"{m.out.name} joined {ended - settled} times after settling"


def settled_joins(members: list[KafkajsMember], quiet_s: float = 3.0, timeout_s: float = 60) -> list[int]:
    """The members' join counts once none has changed for quiet_s (a rebalance
    reaches every member within a heartbeat, 1 s)."""
    deadline = time.monotonic() + timeout_s
    counts, since = [m.joins() for m in members], time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"the group did not settle: joins {counts}")
        time.sleep(0.2)
        now = [m.joins() for m in members]
        if now != counts:
            counts, since = now, time.monotonic()
    return counts


def test_transactions_are_refused_at_once_with_a_fatal_error(broker, topic_name):
    """Transactions are a non-goal: each client must fail at once with a
    non-retriable error (not retry until its timeout). librdkafka shows the
    broker's message; kafka-python and aiokafka show the error code's name."""
    from aiokafka import AIOKafkaProducer
    from kafka import KafkaProducer
    from kafka.errors import TransactionalIdAuthorizationFailedError

    t = time.monotonic()
    with pytest.raises(KafkaException) as exc:
        Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": "tx-c"}).init_transactions(30)
    assert exc.value.args[0].fatal() and "does not support transactions" in exc.value.args[0].str()

    kp = KafkaProducer(bootstrap_servers=broker.bootstrap, transactional_id="tx-k")
    try:
        with pytest.raises(TransactionalIdAuthorizationFailedError):
            kp.init_transactions()
    finally:  # else its sender thread reconnects (with random backoff) for the rest of the test session
        kp.close(timeout=5)

    async def aiokafka_transaction() -> None:
        p = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, transactional_id="tx-a")
        try:
            await p.start()
        finally:
            await p.stop()

    with pytest.raises(Exception, match="TransactionalIdAuthorizationFailed"):
        asyncio.run(aiokafka_transaction())

    out = node("kafkajs_transaction.mjs", broker.bootstrap, topic_name)
    assert out.startswith("error ") and "retriable=false" in out, out
    assert time.monotonic() - t < 20, "a client retried instead of failing at once"
