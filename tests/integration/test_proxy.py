"""`kafscale proxy`: clients that only know the proxy keep working while the
brokers behind it are killed, restarted and added."""
from __future__ import annotations

from confluent_kafka.admin import AdminClient

from kafscale.broker.cluster import rendezvous
from tests.conftest import BrokerProcess
from tests.integration.clients import create_topic, kcat
from tests.integration.test_cluster import Stream, drain_and_verify, leaders
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
