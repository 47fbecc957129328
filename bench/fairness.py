"""Another client's acknowledgements while one connection pipelines Produce
requests on the same worker: what the in-flight cap costs the others.

A connection is read while fewer than max_in_flight_requests of its requests
are unanswered, so the cap bounds how many of one client's requests sit in
the worker and the log process ahead of another client's. For each --caps
value, a fresh broker with one worker (so both clients are on it) gets a
topic of --partitions partitions for the flood and one of one partition for
the probe. The probe (librdkafka, acks=all, linger 0, connected first) sends
one 1 KiB record every 20 ms and times each acknowledgement: first alone,
then while a flood producer (bench.partitions' librdkafka load in a process
of its own: acks=all, linger 5 ms, 1 KiB records, partitions in turn) offers
--rate records/s. librdkafka sends a Produce request per partition batch
over one connection: at 20,000 records/s over 1,000 partitions about 16,000
a second, some 1,600 of them in flight at 100 ms each. Printed per cap and
round: the probe's p50/p99 alone and under the flood (its p99 also as a
ratio to alone), the flood's acknowledged share and ack p99, and, from the
broker's own /metrics over the probe's time under the flood (both clients'
requests together), where an acknowledgement waits: Produce requests in the
worker, node object PUTs, etcd commits and the log process's event-loop lag
(p50/p99/max, each the upper bound of its histogram bucket).

    python -m bench.fairness [--caps 1000,5000] [--partitions 1000] [--rate 20000] [--seconds 20] [--rounds 2]
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from bench.e2e import latencies, pct, stack_dirs, start_broker, stop_broker
from bench.partitions import BROKER_HISTOGRAMS, histogram_buckets, offer, open_all, reference_ms, stage_ms, stages_text
from kafscale.devstack import DevStack, free_port

PROBE_GAP_S = 0.02
RAMP_S = 3.0  # the flood runs this long before the probe starts, and the probe stops this long before it ends
STARTUP_S = 2.0  # the flood's process, client and warm-up record, before its load starts


def _flood(bootstrap: str, topic: str, partitions: int, rate: int, seconds: float, out: mp.Queue) -> None:
    offered, acked, _failed, lat, _secs = offer(bootstrap, topic, partitions, rate, seconds, 120)
    out.put((offered, acked, pct(lat, 0.99)))


def one_cap(stack: DevStack, logdir: Path, cap: int, partitions: int, rate: int, seconds: float) -> str:
    cluster = f"fair{cap}{uuid.uuid4().hex[:4]}"
    reference = reference_ms()
    admin = f"127.0.0.1:{free_port()}"
    proc, bootstrap = start_broker(stack, logdir, cluster, workers="1", max_in_flight_requests=str(cap),
                                   admin_listen=admin)
    metrics = f"http://{admin}/metrics"
    try:
        client = AdminClient({"bootstrap.servers": bootstrap})
        for topic, n in (("flood", partitions), ("probe", 1)):
            client.create_topics([NewTopic(topic, n, 1)])[topic].result(60)
        open_all(bootstrap, "flood", partitions)
        probes = int((seconds - 2 * RAMP_S) / PROBE_GAP_S)
        alone = latencies(bootstrap, "probe", probes, PROBE_GAP_S)
        spawn = mp.get_context("spawn")  # a fresh process: no copy of this one's librdkafka client
        out: mp.Queue = spawn.Queue()
        flood = spawn.Process(target=_flood, args=(bootstrap, "flood", partitions, rate, seconds, out))
        flood.start()
        try:
            time.sleep(STARTUP_S + RAMP_S)
            before = histogram_buckets(metrics, BROKER_HISTOGRAMS)
            flooded = latencies(bootstrap, "probe", probes, PROBE_GAP_S)
            stages = stage_ms(before, histogram_buckets(metrics, BROKER_HISTOGRAMS))
            offered, acked, flood_p99 = out.get(timeout=seconds + 300)
        finally:
            flood.join(60)
    finally:
        stop_broker(proc, 120)
    a99, f99 = pct(alone, 0.99), pct(flooded, 0.99)
    return (f"cap {cap:>6}: probe alone p50 {pct(alone, 0.5) * 1000:6.1f} ms p99 {a99 * 1000:6.1f} ms; "
            f"under the flood p50 {pct(flooded, 0.5) * 1000:6.1f} ms p99 {f99 * 1000:7.1f} ms ({f99 / a99:5.2f}x); "
            f"flood {acked}/{offered} acked, p99 {flood_p99 * 1000:7.1f} ms; reference work {reference:.0f} ms\n"
            f"            in the broker under the flood, p50/p99/max ms: {stages_text(stages)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="1000,5000", help="comma-separated max_in_flight_requests values")
    ap.add_argument("--partitions", type=int, default=1000, help="the flood topic's partitions")
    ap.add_argument("--rate", type=int, default=20_000, help="records/s the flood offers")
    ap.add_argument("--seconds", type=float, default=20, help="how long the flood offers its load")
    ap.add_argument("--rounds", type=int, default=2, help="every cap this many times, in turn")
    args = ap.parse_args()
    with stack_dirs(False) as (tmp, s3_dir):
        stack = DevStack(data_dir=tmp, volume_mib=8192, s3_dir=s3_dir).start()
        try:
            caps = [int(c) for c in args.caps.split(",")]
            for _rnd, cap in itertools.product(range(args.rounds), caps):
                print(one_cap(stack, Path(tmp), cap, args.partitions, args.rate, args.seconds), flush=True)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
