"""What open partitions cost a broker while nothing is written: the CPU of
its background passes (the compaction check, the collector, the balancer,
retention), each P as a ratio to P = 1 in the same run.

For each P, a fresh broker (its own cluster namespace in one etcd and one
SeaweedFS) gets a topic of P partitions and one record to every partition
(librdkafka, acks=all), which opens them all. Once every node object is
compacted away (compaction lag 10 s, small partitions three lags: about
30-45 s), the CPU each process uses over --seconds is read from /proc: the
log process, the workers, etcd and SeaweedFS. Then the broker is stopped
(SIGTERM): how long it takes to exit, handing every partition over, and the
etcd transactions it makes meanwhile (etcd's own /metrics). Before the stop,
METADATA_REQUESTS Metadata requests (v12, one after the other on one
connection) name a one-partition topic beside the P partitions (their p50
and p99), then METADATA_OF_P name the P-partition topic itself (their p50),
each as a ratio to P = 1's. Then a consumer (librdkafka, or kafka-python
with --consumer) is assigned every one of the P partitions from offset 0:
the seconds until it has read their P records (its first Fetches open a
view of every partition in the workers), then the cores the workers use
over --seconds while it waits for more. librdkafka's every Fetch names all
P partitions; kafka-python's name only what changed once the broker gave it
an incremental fetch session (KIP-227; --fetch-session-slots 0: the broker
gives none, as before they existed). SeaweedFS keeps its objects on a tmpfs
(/dev/shm), as bench/partitions.py does.

    python -m bench.idle [--partitions 1,1000,10000] [--seconds 30] [--consumer kafka-python]
                         [--fetch-session-slots 0]
"""
from __future__ import annotations

import argparse
import socket
import struct
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench.e2e import CpuMeter, broker_children, compacted_s, pct, stack_dirs, start_broker, stop_broker
from bench.partitions import open_all
from kafscale.devstack import DevStack
from kafscale.protocol.framing import decode_response, encode_request
from kafscale.protocol.schemas import METADATA

COMPACTED_WITHIN_S = 180  # the opening records' node objects are compacted away by then (else the run fails)
METADATA_REQUESTS = 200
METADATA_OF_P = 20


def read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        buf += chunk
    return bytes(buf)


def metadata_latencies(bootstrap: str, topic: str, n: int = METADATA_REQUESTS) -> list[float]:
    """Seconds each of n Metadata requests naming `topic` took until its
    whole response was read (decoding it is the client's time), sorted."""
    host, _, port = bootstrap.rpartition(":")
    body = {"topics": [{"name": topic, "topic_id": bytes(16)}], "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False}
    out = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for i in range(n):
            t0 = time.perf_counter()
            sock.sendall(encode_request(METADATA.key, 12, i, body))
            frame = read_exactly(sock, struct.unpack(">i", read_exactly(sock, 4))[0])
            out.append(time.perf_counter() - t0)
            _, md = decode_response(METADATA.key, 12, frame)
            if md["topics"][0]["error_code"]:
                raise RuntimeError(f"Metadata of {topic}: error {md['topics'][0]['error_code']}")
    return sorted(out)


def consumer_cost(bootstrap: str, topic: str, partitions: int, workers: list[int], seconds: float,
                  client: str = "librdkafka") -> tuple[float, float, float]:
    """A consumer assigned every partition from offset 0: seconds until it read
    one record of each, then the workers' cores and its own over `seconds`
    while it waits."""
    if client == "kafka-python":
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KafkaTopicPartition

        kc = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                           auto_offset_reset="earliest")
        kc.assign([KafkaTopicPartition(topic, p) for p in range(partitions)])
        kc.seek_to_beginning()

        def poll() -> int:
            return sum(map(len, kc.poll(timeout_ms=500).values()))
        close = kc.close
    else:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "idle-bench", "enable.auto.commit": False})
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])

        def poll() -> int:
            return sum(1 for m in c.consume(1000, 0.5) if not m.error())
        close = c.close
    try:
        got, t0 = 0, time.perf_counter()
        while got < partitions:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"the consumer read {got} of {partitions} records in 300 s")
            got += poll()
        first = time.perf_counter() - t0
        with CpuMeter({"workers": workers}) as cpu:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                poll()
        return first, cpu.cores["workers"], cpu.cores["bench client"]
    finally:
        close()


def idle_run(stack: DevStack, logdir: Path, partitions: int, seconds: float, client: str, **cfg: str
             ) -> tuple[dict[str, float], tuple[list[float], list[float]], tuple[float, float, float], float, int]:
    """The cores each process of the node and the stores used over `seconds`
    with P idle open partitions, the latencies of Metadata requests naming
    a topic of one partition beside them and naming their topic, and what a
    consumer of the P partitions costs (consumer_cost); then the broker's
    stop: seconds to exit and etcd transactions."""
    cluster = f"idle{partitions}x{uuid.uuid4().hex[:4]}"
    proc, bootstrap = start_broker(stack, logdir, cluster, **cfg)
    try:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for topic, count in (("idle", partitions), ("one", 1)):
            admin.create_topics([NewTopic(topic, count, 1)])[topic].result(60)
            open_all(bootstrap, topic, count)
        if compacted_s(stack, cluster, COMPACTED_WITHIN_S) == float("inf"):
            raise RuntimeError(f"P = {partitions}: node objects left after {COMPACTED_WITHIN_S} s")
        log_process, *workers = broker_children(proc.pid)
        etcd, weed = (p.pid for p in stack.procs)
        with CpuMeter({"log process": [log_process], "workers": workers, "etcd": [etcd],
                       "SeaweedFS": [weed]}) as cpu:
            time.sleep(seconds)
        metadata = metadata_latencies(bootstrap, "one"), metadata_latencies(bootstrap, "idle", METADATA_OF_P)
        consumer = consumer_cost(bootstrap, "idle", partitions, workers, seconds, client)
    except BaseException:
        stop_broker(proc, 120)
        raise
    txns, stopping = stack.server_counts()["txns"], time.perf_counter()
    if stop_broker(proc, 120) != 0:
        raise RuntimeError(f"P = {partitions}: the broker exited with {proc.returncode} (its log: {logdir})")
    stop_s, stop_txns = time.perf_counter() - stopping, int(stack.server_counts()["txns"] - txns)
    return {k: v for k, v in cpu.cores.items() if k != "bench client"}, metadata, consumer, stop_s, stop_txns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="1,1000,10000", help="comma-separated partition counts")
    ap.add_argument("--seconds", type=float, default=30, help="how long the idle CPU is measured")
    ap.add_argument("--consumer", choices=("librdkafka", "kafka-python"), default="librdkafka",
                    help="the consumer of the P partitions")
    ap.add_argument("--fetch-session-slots", help="the broker's fetch_session_slots (default: its own)")
    args = ap.parse_args()
    cfg = {} if args.fetch_session_slots is None else {"fetch_session_slots": args.fetch_session_slots}
    counts = [int(p) for p in args.partitions.split(",")]
    with stack_dirs(False) as (tmp, s3_dir):
        stack = DevStack(data_dir=tmp, volume_mib=1024, s3_dir=s3_dir).start()
        try:
            runs = {p: idle_run(stack, Path(tmp), p, args.seconds, args.consumer, **cfg) for p in counts}
        finally:
            stack.stop()
    base, (base_one, base_all) = runs[counts[0]][0], runs[counts[0]][1]
    print(f"idle open partitions, CPU cores over {args.seconds:.0f} s once every node object was compacted "
          f"(ratio to P = {counts[0]} in brackets); Metadata of a one-partition topic beside them, p50 and p99 "
          f"of {METADATA_REQUESTS}, and of the P-partition topic, p50 of {METADATA_OF_P}; a consumer "
          f"({args.consumer}) of the P partitions: seconds to read a record of each, then the workers' cores "
          f"and its own while it waits; then the stop (SIGTERM to exit) and its etcd transactions")
    print(f"{'P':>7} " + " ".join(f"{name:>20}" for name in base)
          + f" {'Metadata p50 ms':>18} {'Metadata p99 ms':>18} {'of P topic p50':>18} {'consume s':>10}"
          + f" {'consumer cores':>15} {'client cores':>13} {'stop s':>8} {'stop txns':>10}")
    for p, (cores, (one, whole), (first, consumer, client), stop_s, stop_txns) in runs.items():
        print(f"{p:>7} " + " ".join(f"{c:8.3f} ({c / base[name] if base[name] else float('nan'):6.2f})    "
                                     for name, c in cores.items())
              + "".join(f" {pct(md, q) * 1000:9.2f} ({pct(md, q) / pct(md0, q):5.2f})"
                        for md, md0, q in ((one, base_one, 0.5), (one, base_one, 0.99), (whole, base_all, 0.5)))
              + f" {first:10.2f} {consumer:15.3f} {client:13.3f} {stop_s:8.1f} {stop_txns:10d}")


if __name__ == "__main__":
    main()
