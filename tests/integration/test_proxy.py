"""`kafscale proxy`: clients that only know the proxy keep working while the
brokers behind it are killed, restarted and added."""
from __future__ import annotations

import signal
import time

from confluent_kafka.admin import AdminClient

from kafscale.broker.cluster import rendezvous
from tests.conftest import BrokerProcess
from tests.integration.clients import create_topic, kcat
from tests.integration.test_cluster import Stream, bootstrap, check_all_acked_present, drain_and_verify, leaders
from tests.integration.test_groups import Member, wait_for


def test_clients_only_know_the_proxy(make_cluster, topic_name, tmp_path, stack):
    *brokers, proxy = make_cluster(3, proxy=True, lease_ttl_s=2, balance_interval_ms=500)
    boot = proxy.bootstrap
    create_topic(boot, topic_name, partitions=6)
    md = AdminClient({"bootstrap.servers": boot}).list_topics(timeout=10)
    assert [b.id for b in md.brokers.values()] == [0] and set(leaders(boot, topic_name).values()) == {0}
    extra = BrokerProcess(stack, tmp_path, brokers[0].cluster, node_id=4, lease_ttl_s=2, balance_interval_ms=500)
    member = Member("confluent", boot, f"g-{topic_name}", topic_name, tmp_path / "m.txt")
    stream = Stream(boot, topic_name, 6)
    try:
        wait_for(lambda: len(stream.acked) > 1000, 60, "acks through the proxy")
        brokers[1].kill()
        before = len(stream.acked)
        wait_for(lambda: len(stream.acked) > before + 1000, 60, "acks after a broker died")
        extra.start()
        brokers[1].start()
        placement = {p: rendezvous(f"p|{topic_name}|{p}", [1, 2, 3, 4]) for p in range(6)}
        wait_for(lambda: leaders(brokers[0].bootstrap, topic_name) == placement, 30,
                 "partitions to move to their places over four brokers (no data copied)")
        before = len(stream.acked)
        wait_for(lambda: len(stream.acked) > before + 1000, 60, "acks after scaling up")
    finally:
        try:
            drain_and_verify(stream, member, boot, topic_name, 6)
        finally:
            extra.stop()
    out = kcat("-C", "-b", boot, "-t", topic_name, "-p", "0", "-c", "5", "-e", "-q", "-f", "%o\n").decode()
    assert out.split() == ["0", "1", "2", "3", "4"]


def test_paused_owner_is_taken_over_through_the_proxy(make_cluster, topic_name):
    """A broker SIGSTOPped past its lease: every partition acks again within
    seconds through the proxy, the paused broker's at their new owner, with
    the producer's default 30 s request timeout (one Produce through the proxy
    spans every broker: the proxy fails what waits on a broker whose lease
    expired, rather than letting it hold the others' acks), and no acked
    record is lost."""
    *brokers, proxy = make_cluster(3, proxy=True, lease_ttl_s=2, balance_interval_ms=500)
    # a topic placed on all three brokers
    topic_name = next(f"{topic_name}-{i}" for i in range(100)
                      if len({rendezvous(f"p|{topic_name}-{i}|{p}", [1, 2, 3]) for p in range(6)}) == 3)
    create_topic(proxy.bootstrap, topic_name, partitions=6)
    direct = bootstrap(brokers)
    wait_for(lambda: len(set(leaders(direct, topic_name).values())) == 3, 30, "partitions on all three brokers")
    victim_id = leaders(direct, topic_name)[0]
    victim = brokers[victim_id - 1]
    stream = Stream(proxy.bootstrap, topic_name, 6, request_timeout_ms=30_000)

    def acks(p: int) -> int:
        return sum(1 for pp, _ in list(stream.acked) if pp == p)

    try:
        wait_for(lambda: all(acks(p) > 100 for p in range(6)), 60, "acks on every partition")
        victim.signal(signal.SIGSTOP)
        time.sleep(3)  # past its lease
        before = {p: acks(p) for p in range(6)}
        wait_for(lambda: all(acks(p) > before[p] + 100 for p in range(6)), 15,
                 "every partition, the paused broker's included, to ack again through the proxy")
    finally:
        victim.signal(signal.SIGCONT)
        stream.stop()
    check_all_acked_present(direct, topic_name, 6, stream.acked)
