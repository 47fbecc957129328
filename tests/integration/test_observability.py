"""The HTTP admin endpoint of a pre-forked broker and of the proxy, scraped
for real: Prometheus metrics merged over every process of a node (the text
parsed with prometheus_client's parser), group lag, /healthz and /readyz
following etcd, S3 and drain state."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from kafscale.devstack import free_port
from tests.conftest import BrokerProcess
from tests.integration.clients import Rec, confluent_produce, create_topic
from tests.integration.relay import Relay
from tests.integration.test_groups import wait_for


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(smp: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in smp.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def test_metrics_merge_every_process_and_report_group_lag(make_broker, topic_name):
    admin = f"127.0.0.1:{free_port()}"
    b = make_broker(workers=2, admin_listen=admin, compaction_lag_ms=500)
    create_topic(b.bootstrap, topic_name)
    confluent_produce(b.bootstrap, topic_name, [Rec(b"k", b"v" * 100) for _ in range(100)])
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": f"g-{topic_name}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic_name, 0, 0)])
    got = 0
    while got < 60:
        got += len([m for m in c.consume(60 - got, 5) if m.error() is None])
    c.commit(offsets=[TopicPartition(topic_name, 0, 60)], asynchronous=False)
    c.close()

    assert get(f"http://{admin}/metrics")[0] == 200
    # the workers' request counters, latencies and byte counters reach the metrics files within 0.1 s
    # (metrics.Tally, HistogramTally), and each process samples its loop's lag every 0.1 s (the second worker
    # may start after the test's requests)
    scraped: list[dict] = []

    def counted() -> bool:
        scraped[:] = [samples(get(f"http://{admin}/metrics")[1])]
        lagged = {lab["process"] for lab, v in scraped[0].get("kafscale_event_loop_lag_seconds_count", []) if v}
        return (total(scraped[0], "kafscale_fetch_bytes_total") >= 60 * 100
                and total(scraped[0], "kafscale_produce_bytes_total") >= 100 * 100 and lagged == {"log", "0", "1"}
                and total(scraped[0], "kafscale_compacted_bytes_total", source="slices") >= 100 * 100)

    wait_for(counted, 10, "the bytes counted, compacted, and every process's loop lag sampled")
    smp = scraped[0]
    assert total(smp, "kafscale_requests_total", api="Produce") >= 1
    assert total(smp, "kafscale_requests_total", api="Fetch") >= 1
    assert total(smp, "kafscale_requests_total", api="OffsetCommit") == 1, "forwarded requests count once"
    processes = {lab["process"] for lab, v in smp["kafscale_requests_total"] if v}
    assert processes <= {"0", "1"} and processes, "requests are counted by the workers that answered them"
    assert total(smp, "kafscale_produce_bytes_total") >= 100 * 100
    assert total(smp, "kafscale_fetch_bytes_total") >= 60 * 100
    assert total(smp, "kafscale_segment_reads_total") >= 1, "the fetches read segments (from the cache or S3)"
    assert total(smp, "kafscale_s3_request_seconds_count", op="put") >= 1, "the node object PUT"
    assert total(smp, "kafscale_etcd_commit_seconds_count") >= 1
    assert total(smp, "kafscale_segment_flush_bytes_count") >= 1
    flushed = [total(smp, "kafscale_node_flush_seconds_count", stage=st) for st in ("queued", "upload", "commit",
                                                                                       "durable")]
    assert flushed[0] >= 1 and len(set(flushed)) == 1, f"every stage of every node object: {flushed}"
    assert total(smp, "kafscale_request_seconds_count", api="Produce") >= 1
    lagged = {lab["process"] for lab, v in smp["kafscale_event_loop_lag_seconds_count"] if v}
    assert lagged == {"log", "0", "1"}, "every process samples its event loop's lag"
    assert total(smp, "kafscale_group_lag", group=f"g-{topic_name}", topic=topic_name, partition="0") == 40
    assert all(lab["node"] == "1" for name in smp for lab, _ in smp[name] if "node" in lab)

    status, body = get(f"http://{admin}/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = get(f"http://{admin}/readyz")
    assert status == 200, body
    assert json.loads(body)["checks"] == {"etcd": "ok", "s3": "ok", "registered": "ok", "draining": "ok",
                                          "kafka": "ok"}

    env = b.env()
    subprocess.run([sys.executable, "-m", "kafscale.cli", "broker", "drain", "1"], env=env, check=True,
                   capture_output=True, timeout=60)
    status, body = get(f"http://{admin}/readyz")
    assert status == 503 and json.loads(body)["checks"]["draining"].startswith("failed")
    subprocess.run([sys.executable, "-m", "kafscale.cli", "broker", "undrain", "1"], env=env, check=True,
                   capture_output=True, timeout=60)
    assert get(f"http://{admin}/readyz")[0] == 200


def test_readyz_reports_s3_down(stack, make_broker):
    relay = Relay(stack.s3_port)
    admin = f"127.0.0.1:{free_port()}"
    try:
        make_broker(workers=1, admin_listen=admin, s3_endpoint=relay.url)
        assert get(f"http://{admin}/readyz")[0] == 200
        relay.cut()
        status, body = get(f"http://{admin}/readyz")
        assert status == 503
        checks = json.loads(body)["checks"]
        assert checks["s3"].startswith("failed") and checks["etcd"] == "ok"
        relay.restore()
        wait_for(lambda: get(f"http://{admin}/readyz")[0] == 200, 30, "ready again once S3 is back")
    finally:
        relay.close()


def test_proxy_serves_metrics_and_readiness(stack, make_cluster, topic_name, tmp_path):
    broker = make_cluster(1)[0]
    admin = f"127.0.0.1:{free_port()}"
    proxy = BrokerProcess(stack, tmp_path, broker.cluster, command="proxy", admin_listen=admin).start()
    try:
        create_topic(proxy.bootstrap, topic_name)
        confluent_produce(proxy.bootstrap, topic_name, [Rec(None, b"x")] * 5)
        status, text = get(f"http://{admin}/metrics")
        assert status == 200
        smp = samples(text)
        assert total(smp, "kafscale_requests_total", api="Produce", node="0") >= 1
        status, body = get(f"http://{admin}/readyz")
        assert status == 200 and json.loads(body)["checks"] == {"etcd": "ok", "brokers": "ok"}
    finally:
        proxy.stop()
