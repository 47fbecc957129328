"""Partition-scale benchmark: one broker, the same offered load spread over
P partitions, each P's figures as a ratio to P = 1 in the same run.

For each rate and each P (and each round), a fresh broker on a fresh etcd
and SeaweedFS gets a topic of P partitions (one SeaweedFS for them all ran
out of space on the tmpfs in the third 40 s round: it makes as many
volumes as the free space holds, and a bench writes gigabytes). One record to every
partition first opens them all (the time until all are acknowledged is
"open s"; the log process's resident memory before and after gives the cost
of an idle open partition). Then a producer (librdkafka; --client below; acks=all, linger.ms
5, 1 KiB records, partitions in turn; connected first, by one record it
waits for) offers RATE records/s for --seconds, and waits up to --drain
seconds for every acknowledgement. Counted by the servers themselves from their
/metrics, over the time from the first record offered to the last one
acknowledged: S3 PUTs/s (SeaweedFS), etcd transactions/s; after the run, the
etcd keys the run added and etcd's DB size. From the producer: ack latency
p50/p99 (produce() to delivery report) and how many records were
acknowledged; then how long until every node object is compacted away
(its wal/ key gone: the collector looks every half compaction lag, so this
is the lag, 10 s, plus up to 5 s at best). From /proc: the broker's CPU (all its processes, and its log process's,
its workers', SeaweedFS's and etcd's apart), the producer's (this
process: librdkafka's threads and the loop offering records), the whole
machine's, and the log process's peak RSS; from the scheduler's per-task
statistics, how long tasks were runnable but waited for a CPU (how many of
the machine's on average, and the log process's threads per second they
ran: past 1, a thread waits longer for the CPU than it runs; every hop of an
acknowledgement waits). From the broker's own /metrics, where an acknowledgement's
time goes: Produce request p50/p99/max (arrival to response, in the workers),
node object PUT, etcd commit, each node object's oldest batch's wait to
be cut (queued) and to be acknowledged (durable), how late the log
process's event loop runs what is due (each the upper bound of its
histogram bucket; a busy loop makes the PUTs and commits look slower, as
their completions wait for it), and how often and how long the
producer's connection was not read because it had
max_in_flight_requests unanswered (its requests then wait in the client). From
etcd's own /metrics, its WAL fsyncs and backend commits p99/max: node objects
commit in order, so one slow fsync holds every acknowledgement behind it while
adding only one slow commit to the broker's histogram.

The latency bound: linger + 2 x p99 of a 64 KiB S3 PUT + p99 of a one-key
etcd transaction. Measured twice: once on the idle machine before each
broker starts, and during each load by a probe process of its own (a PUT and a
transaction sent every 100 ms, not waiting for the ones before, against the
same SeaweedFS and etcd; its requests are left out of the counts above). The
second is the storage the acknowledgements actually waited on: under the
load, PUTs and fsyncs are slower than on the idle machine, and every few
seconds one stalls for hundreds of ms (in both the probe's and the
broker's), which the idle figure never sees.

With --modes node,partition each load runs once with node flushes (one
object per flush cycle for all partitions, the default) and once with a
flush of each partition on its own (node_flush off), each compared to its
own P = 1.

    python -m bench.partitions [--partitions 1,100,1000,10000] [--rates 2000,20000]
                               [--modes node,partition] [--seconds 15] [--drain 180] [--rounds 1]
                               [--s3-on-disk] [--client librdkafka|sarama|aiokafka] [--send-buffer B]
                               [--client-linger-ms MS] [--tail]

--client names the producer that offers the load. librdkafka (the default)
sends a Produce request per partition batch: at 2,000 records/s over 100 or
more partitions, a request a record. Sarama (Go, bench/go/sarama_offer, built
against Debian's golang-github-shopify-sarama-dev) and aiokafka send a broker
one request holding every partition's ready batch, as Kafka's Java client
does; aiokafka's own cost per record (pure Python) is the highest.
--send-buffer sets librdkafka's socket.send.buffer.bytes (default 0, the
system's: over loopback Linux lets it grow to megabytes, thousands of small
requests the client counts as sent while the broker does not read them;
Kafka's Java producer asks for 128 KiB). --client-linger-ms sets the
producer's linger (default 5 ms, as the broker's; the broker's and the
latency bound's stay 5 ms): librdkafka sends a request per partition batch,
and over many partitions a longer linger puts more records in each.

With --tail a consumer (librdkafka, its own process) reads every partition
from its end while the load is offered, as a consumer following a topic
does: the broker then also sends the workers serving it each partition's
commits, and serves its fetches. The records it read and its CPU are
reported; without it no record is read during the load.

With --rounds N every P runs N times, in turn (1, 100, 1,000, then 1 again),
and each P's medians over the rounds follow the tables: of its figures, and
of their ratios to P = 1 of the same round.

SeaweedFS keeps its objects on a tmpfs (/dev/shm) unless --s3-on-disk: on
one ext4 disk, each of etcd's fsyncs also waits for the object data
SeaweedFS wrote since the last one (ordered journaling), and the 2 to 8
MiB/s of node objects and compacted segments made one-key etcd
transactions take up to half a second. No deployment shares a disk
between etcd and S3 (bench/README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import gc
import glob
import itertools
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bench.e2e import (
    CpuMeter,
    broker_children,
    compacted_s,
    dev_store,
    pct,
    put_latencies,
    stack_dirs,
    start_broker,
    stop_broker,
)
from kafscale.devstack import DevStack, free_port
from kafscale.metadata.etcd_client import EtcdClient

LINGER_MS = 5
RECORD = 1024
REFERENCE_LOOP = 2_000_000  # iterations of the machine's reference work (reference_ms)


async def etcd_txn_latencies(stack: DevStack, n: int = 300) -> list[float]:
    """Sorted latencies of n sequential one-key etcd transactions (a compare and a put, as a commit)."""
    async with _etcd(stack.etcd_endpoint) as txn:
        return sorted([await txn(i) for i in range(n)])


@contextlib.asynccontextmanager
async def _etcd(endpoint: str) -> AsyncIterator[Callable[[int], Awaitable[float]]]:
    """A timed one-key etcd transaction (a compare and a put, as a commit): seconds it took."""
    host, port = endpoint.split(":")
    client = EtcdClient(host=host, port=int(port), timeout=10)
    await client.connect()
    tx, key = client.transactions, f"/bench/{uuid.uuid4().hex}".encode()

    async def txn(i: int) -> float:
        t = time.perf_counter()
        await client.transaction(compare=[tx.version(key) > -1], success=[tx.put(key, b"%d" % i)], failure=[])
        return time.perf_counter() - t

    try:
        yield txn
    finally:
        await client.delete(key)
        await client.close()


def latency_bound(put_p99: float, txn_p99: float) -> float:
    """The ack p99 bound: linger + 2 x S3 PUT p99 + etcd transaction p99 (seconds)."""
    return LINGER_MS / 1000 + 2 * put_p99 + txn_p99


PROBE_INTERVAL_S = 0.1


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic collector off while this process measures a load (the
    producer, the probe), after collecting what is garbage already: a full
    collection in the producer (64,000 objects left by the setup) held its
    delivery reports for 90-160 ms in the middle of a load, and the ack
    latencies counted that as the broker's."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _probe(bucket: str, s3_endpoint: str, etcd_endpoint: str, conn: Connection) -> None:
    """In a process of its own: a 64 KiB S3 PUT and a one-key etcd transaction
    started every PROBE_INTERVAL_S until told to stop, each whether or not the
    ones before have finished (as the producer offers its records); then sends
    their latencies, each from the moment it was sent."""
    async def run() -> tuple[list[float], list[float]]:
        data = os.urandom(64 << 10)
        store = dev_store(bucket, s3_endpoint)
        prefix = f"bench/probe-{uuid.uuid4().hex}/"

        async def put(i: int) -> float:
            t = time.perf_counter()
            await store.put(f"{prefix}{i}", data)
            return time.perf_counter() - t

        async with store, _etcd(etcd_endpoint) as txn:
            conn.send("ready")
            sent: list[asyncio.Task[float]] = []
            due = time.perf_counter()
            with collector_off():
                while not conn.poll():
                    sent += [asyncio.create_task(put(len(sent))), asyncio.create_task(txn(len(sent)))]
                    due += PROBE_INTERVAL_S
                    await asyncio.sleep(max(due - time.perf_counter(), 0))
                done = await asyncio.gather(*sent)
            await store.delete_prefix(prefix)
        return done[0::2], done[1::2]

    conn.send(asyncio.run(run()))


class SideProcess:
    """A process of its own while the block runs (spawned: not a fork of a
    process with librdkafka's threads): target(*args, conn) sends "ready"
    once it is, works until the block ends (conn.poll()), then sends what it
    found (`result`; None if nothing came within a minute)."""

    def __init__(self, what: str, target: Callable[..., None], *args: object, start_s: float = 60) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.what, self.start_s = what, start_s
        self.result: Any = None

    def __enter__(self) -> SideProcess:
        self._proc.start()
        if not self._conn.poll(self.start_s) or self._conn.recv() != "ready":
            raise RuntimeError(f"the {self.what} did not start")
        return self

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        if self._conn.poll(60):
            self.result = self._conn.recv()
        self._proc.join(30)


class StorageProbe(SideProcess):
    """S3 PUT and etcd transaction latencies as a client of the same servers
    sees them while the block runs (the probe is a process of its own, so
    neither the producer's loop nor the broker's delays its timings). Its
    requests go out at a steady rate like the producer's records: one that
    waited for the one before would send a single request through a stall
    of the store, which holds every record offered meanwhile; its
    requests are counted, to be left out of the servers' counts."""

    def __init__(self, stack: DevStack) -> None:
        super().__init__("storage probe", _probe, stack.bucket, stack.s3_endpoint, stack.etcd_endpoint)
        self.puts: list[float] = []
        self.txns: list[float] = []

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.result is not None:
            self.puts, self.txns = (sorted(x) for x in self.result)


def _tail(bootstrap: str, topic: str, partitions: int, conn: Connection) -> None:
    """In a process of its own: a consumer of every partition from its end,
    ready once its fetches return (every partition's view open); reads until
    told to stop, then sends how many records it read."""
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"tail-{uuid.uuid4().hex}",
                  "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, OFFSET_END) for p in range(partitions)])
    ready = time.perf_counter() + 5
    while time.perf_counter() < ready:  # OFFSET_END resolved and every partition fetched once
        c.consume(1000, 0.1)
    conn.send("ready")
    read = 0
    while not conn.poll():
        read += sum(1 for m in c.consume(1000, 0.1) if m.error() is None)
    c.close()
    conn.send(read)


class Tail(SideProcess):
    """--tail's consumer while the block runs: its pid (for CpuMeter) and,
    after the block, the records it read (`read`, -1 if it did not say)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        super().__init__("tail consumer", _tail, bootstrap, topic, partitions, start_s=120)

    @property
    def read(self) -> int:
        return -1 if self.result is None else int(self.result)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


BROKER_HISTOGRAMS: dict[str, tuple[str, tuple[str, str] | None]] = {  # column: (histogram, label selecting it)
    "produce": ("kafscale_request_seconds", ("api", "Produce")),
    "PUT": ("kafscale_s3_request_seconds", ("op", "put")),
    "commit": ("kafscale_etcd_commit_seconds", None),
    "queued": ("kafscale_node_flush_seconds", ("stage", "queued")),
    "durable": ("kafscale_node_flush_seconds", ("stage", "durable")),
    "log loop lag": ("kafscale_event_loop_lag_seconds", ("process", "log")),
    "in-flight pause": ("kafscale_connection_paused_seconds", None),
}


ETCD_HISTOGRAMS: dict[str, tuple[str, tuple[str, str] | None]] = {
    "WAL fsync": ("etcd_disk_wal_fsync_duration_seconds", None),
    "backend commit": ("etcd_disk_backend_commit_duration_seconds", None),
}


def scrape(url: str) -> Iterator[Metric]:
    """The metric families of a Prometheus /metrics URL, parsed."""
    return text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode())


def histogram_buckets(url: str, histograms: dict[str, tuple[str, tuple[str, str] | None]]
                      ) -> dict[str, dict[float, float]]:
    """Latency histograms scraped from a /metrics URL: cumulative count per bucket bound, per column."""
    out: dict[str, dict[float, float]] = {k: {} for k in histograms}
    for fam in scrape(url):
        for col, (name, label) in histograms.items():
            if fam.name != name:
                continue
            for s in fam.samples:
                if s.name == f"{name}_bucket" and (label is None or s.labels.get(label[0]) == label[1]):
                    le = float(s.labels["le"])
                    out[col][le] = out[col].get(le, 0) + s.value
    return out


def compacted_bytes(url: str) -> dict[str, float]:
    """The broker's kafscale_compacted_bytes from a /metrics URL, per source (slices, merged)."""
    out = {"slices": 0.0, "merged": 0.0}
    for fam in scrape(url):
        for s in fam.samples:
            if s.name == "kafscale_compacted_bytes_total":
                out[s.labels["source"]] += s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q of what was observed between two scrapes."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0) for b in bounds]
    if not counts or not counts[-1]:
        return float("nan")
    return next(b for b, c in zip(bounds, counts, strict=True) if c >= q * counts[-1])


def stage_ms(before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
             ) -> dict[str, tuple[float, float, float]]:
    """Per column, (p50, p99, max) in ms of what was observed between two scrapes (bucket upper bounds)."""
    def ms(col: str, q: float) -> float:
        return bucket_quantile(before[col], after[col], q) * 1000

    return {col: (ms(col, 0.5), ms(col, 0.99), ms(col, 1.0)) for col in after}


def stages_text(stages: dict[str, tuple[float, float, float]]) -> str:
    """stage_ms's figures as "column p50/p99/max, ..."."""
    return ", ".join(f"{col} {p50:g}/{p99:g}/{top:g}" if p50 == p50 else f"{col} none"  # nan: none observed
                     for col, (p50, p99, top) in stages.items())


@dataclass
class Run:
    mode: str
    round: int
    partitions: int
    rate: int
    offered: int
    acked: int
    failed: int
    seconds: float  # first record offered to last one acknowledged
    puts: float
    gets: float  # the compaction reading back slices the cache no longer held (no consumer reads)
    txns: float
    keys: float
    db_mib: tuple[float, float]  # etcd's DB size before and after the run
    lat: list[float]
    cpu: float  # cores, all the broker's processes
    cpu_of: dict[str, float]  # cores of the log process, the workers, SeaweedFS and etcd
    client_cpu: float  # cores, this process (the producer: librdkafka's threads and the loop offering records)
    machine_cpu: float  # cores busy on the whole machine (etcd and SeaweedFS included)
    stolen: float  # of those, the hypervisor's steal (machine_busy_s)
    waiting: float  # tasks of the whole machine runnable but waiting for a CPU, on average (run_queue_waits)
    log_waited: float  # seconds the log process's threads waited for a CPU per second they ran
    peak_rss_mib: float  # the log process
    idle_kib_per_partition: float
    open_s: float  # one record to every partition, all acknowledged
    broker_ms: dict[str, tuple[float, float, float]]  # BROKER_HISTOGRAMS column -> (p50, p99, max) in ms
    etcd_ms: dict[str, tuple[float, float, float]]  # ETCD_HISTOGRAMS column -> (p50, p99, max) in ms
    produce_requests: float
    pauses: float  # times a client connection was not read for its in-flight limit (max_in_flight_requests)
    compacted_s: float  # from the last acknowledgement until every node object is compacted away
    rewrote: dict[str, float]  # bytes compaction rewrote from the load's start until compacted_s: slices, merged
    probe_put_p99: float  # seconds, a 64 KiB PUT by the StorageProbe during the load
    probe_txn_p99: float  # seconds, a one-key etcd transaction by the StorageProbe during the load
    reference_ms: float  # the machine's reference work just before the broker started (reference_ms())
    idle_bound: float  # seconds, latency_bound on the idle machine just before the broker started
    tail_read: int = -1  # records the --tail consumer read during the load (-1: no --tail)
    tail_cpu: float = 0.0  # cores, the --tail consumer

    @property
    def bound(self) -> float:
        """The latency bound of the storage during this load (seconds)."""
        return latency_bound(self.probe_put_p99, self.probe_txn_p99)

    def per_s(self, what: str) -> float:
        return getattr(self, what) / self.seconds


def reference_ms(times: int = 5) -> float:
    """How long a fixed piece of pure-Python work takes this process (the
    median of a few): how fast the machine is now. On the bench's virtual
    machine the same broker work took 26-30% more CPU in the afternoon
    than in the morning, so runs are compared by their ratios to P = 1 of
    the same round, and by this where they are not (it varies by up to a
    quarter between back-to-back measurements on the idle machine too)."""
    def once() -> float:
        t, x = time.perf_counter(), 0
        for i in range(REFERENCE_LOOP):
            x += i * i
        return time.perf_counter() - t
    return statistics.median(once() for _ in range(times)) * 1000


def machine_busy_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (not idle, not waiting on
    I/O) since boot, and of those the hypervisor's steal (its virtual CPUs
    were not running: to the tasks on them, a CPU taken away)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / hz, ticks[7] / hz  # guest time is already in user


def run_queue_waits() -> dict[str, int]:
    """Nanoseconds each task (thread) of the machine has spent runnable but
    waiting for a CPU, by its schedstat path, from the scheduler's per-task
    statistics (/proc/PID/task/TID/schedstat, second field). A task that
    ended meanwhile is not counted: wait_s takes the tasks alive at both
    reads."""
    waits = {}
    for path in glob.glob("/proc/*/task/*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            waits[path] = int(Path(path).read_text().split()[1])
    return waits


def wait_s(before: dict[str, int], after: dict[str, int], pid: int | None = None) -> float:
    """Seconds the tasks alive at both run_queue_waits reads (those of process
    pid only, if given) waited for a CPU in between."""
    mine = "/proc/" if pid is None else f"/proc/{pid}/task/"
    return sum(after[k] - v for k, v in before.items() if k in after and k.startswith(mine)) / 1e9


def open_all(bootstrap: str, topic: str, partitions: int) -> None:
    """One record to every partition, all acknowledged: every partition log is open."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": LINGER_MS})
    for i in range(partitions):
        p.produce(topic, value=b"open", partition=i)
        if i % 1000 == 0:
            p.poll(0)
    if p.flush(600):
        raise RuntimeError("the partitions did not all open")


class Delivered:
    """A producer's delivery reports: each acknowledged record's latency, how
    many failed, and when the last one was acknowledged."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failed = 0
        self.start = self.last_ack = time.perf_counter()

    def paced(self, rate: int, seconds: float) -> Iterator[int]:
        """From now, for seconds: how many records are due by now, at rate a second."""
        self.start = time.perf_counter()
        while (now := time.perf_counter() - self.start) < seconds:
            yield int(now * rate)

    def report(self, ok: bool, sent: float) -> None:
        now = time.perf_counter()
        if ok:
            self.latencies.append(now - sent)
            self.last_ack = now
        else:
            self.failed += 1

    def result(self, offered: int, seconds: float) -> tuple[int, int, int, list[float], float]:
        """offer's answer: (offered, acked, failed, sorted latencies, seconds from the first record to the last ack)."""
        return (offered, len(self.latencies), self.failed, sorted(self.latencies),
                max(self.last_ack - self.start, seconds))


def offer(bootstrap: str, topic: str, partitions: int, rate: int, seconds: float, drain: float, send_buffer: int = 0,
          linger_ms: int = LINGER_MS) -> tuple[int, int, int, list[float], float]:
    """Offer rate records/s for seconds, then wait up to drain s for the acknowledgements:
    (offered, acked, failed, sorted ack latencies, seconds from the first record to the last ack).
    send_buffer: librdkafka's socket.send.buffer.bytes (0: the system's); linger_ms: its linger.ms."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": linger_ms,
                  "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 2 * 1024 * 1024,
                  "message.timeout.ms": int((seconds + drain) * 1000), "compression.type": "none",
                  "socket.send.buffer.bytes": send_buffer})
    p.produce(topic, value=b"warm-up", partition=0)  # the client's connection and metadata are not the broker's
    p.flush(60)  # latency (they added 70-150 ms to the first records, a third of P = 1's p99)
    value = os.urandom(RECORD)
    acks = Delivered()
    with collector_off():
        i = 0
        for due in acks.paced(rate, seconds):
            while i < due:
                t = time.perf_counter()
                p.produce(topic, value=value, partition=i % partitions,
                          on_delivery=lambda e, _m, t=t: acks.report(e is None, t))
                i += 1
            p.poll(0.002)
        p.flush(drain)
    return acks.result(i, seconds)


def offer_aiokafka(bootstrap: str, topic: str, partitions: int, rate: int, seconds: float, drain: float,
                   linger_ms: int = LINGER_MS) -> tuple[int, int, int, list[float], float]:
    """offer with an aiokafka producer (acks=all, linger_ms) instead: like
    Kafka's Java client it sends a broker one Produce request holding the
    batches of every partition that has one ready, and one at a time, where
    librdkafka sends one request a partition batch, as many at once as are
    ready. Its own per-record cost is higher (pure Python)."""
    from aiokafka import AIOKafkaProducer

    async def run() -> tuple[int, int, int, list[float], float]:
        p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=linger_ms,
                             request_timeout_ms=int((seconds + drain) * 1000))
        await p.start()
        try:
            await (await p.send(topic, b"warm-up", partition=0))  # as offer: connection and metadata first
            value = os.urandom(RECORD)
            acks = Delivered()
            sent: list[asyncio.Future[object]] = []
            with collector_off():
                i = 0
                for due in acks.paced(rate, seconds):
                    while i < due:
                        t = time.perf_counter()
                        fut = await p.send(topic, value, partition=i % partitions)
                        fut.add_done_callback(
                            lambda f, t=t: acks.report(not f.cancelled() and f.exception() is None, t))
                        sent.append(fut)
                        i += 1
                    await asyncio.sleep(0.002)
                await asyncio.wait(sent, timeout=drain)
            return acks.result(i, seconds)
        finally:
            await p.stop()

    return asyncio.run(run())


@functools.cache
def sarama_offer() -> Path:
    """bench/go/sarama_offer, built once a run (before any load: compiling takes CPU)."""
    from tests.integration.foreign import build_go

    out = Path(tempfile.mkdtemp(prefix="kafscale-bench-go-"))
    atexit.register(shutil.rmtree, out, True)
    return build_go(Path(__file__).parent / "go" / "sarama_offer", out)


def offer_sarama(bootstrap: str, topic: str, partitions: int, rate: int, seconds: float, drain: float,
                 linger_ms: int = LINGER_MS) -> tuple[int, int, int, list[float], float]:
    """offer with Sarama's asynchronous producer (Go: bench/go/sarama_offer,
    built against Debian's golang-github-shopify-sarama-dev): a request per
    broker holding every partition's ready batch, as aiokafka and Kafka's
    Java client send them, at a compiled client's cost per record."""
    r = subprocess.run([str(sarama_offer()), bootstrap, topic, str(partitions), str(rate), str(seconds), str(drain),
                        str(linger_ms), str(RECORD)], capture_output=True, text=True,
                       timeout=seconds + drain + 120, check=True)
    head, *lines = r.stdout.split("\n")
    offered, acked, failed, secs = head.split()
    return int(offered), int(acked), int(failed), sorted(int(v) / 1e6 for v in lines if v), float(secs)


OFFERS = {"librdkafka": offer, "aiokafka": offer_aiokafka, "sarama": offer_sarama}  # --client: who offers the load


Offer = Callable[..., tuple[int, int, int, list[float], float]]  # offer's signature


def client_offer(client: str, send_buffer: int, linger_ms: int = LINGER_MS) -> Offer:
    """The offer of --client, with --client-linger-ms and --send-buffer (librdkafka's only)."""
    if client == "librdkafka":
        return functools.partial(offer, send_buffer=send_buffer, linger_ms=linger_ms)
    if send_buffer:
        raise SystemExit("--send-buffer is librdkafka's socket.send.buffer.bytes")
    return functools.partial(OFFERS[client], linger_ms=linger_ms)


def add_client_arguments(ap: argparse.ArgumentParser, client_help: str) -> None:
    ap.add_argument("--client", choices=sorted(OFFERS), default="librdkafka", help=client_help)
    ap.add_argument("--send-buffer", type=int, default=0, help="librdkafka's socket.send.buffer.bytes (0: the "
                    "system's, which grows to megabytes over loopback)")
    ap.add_argument("--client-linger-ms", type=int, default=LINGER_MS, help="the producer's linger (the broker's "
                    f"stays {LINGER_MS} ms, and so does the latency bound's)")


def measure(stack: DevStack, logdir: Path, mode: str, rnd: int, partitions: int, rate: int, seconds: float,
            drain: float, offer_load: Offer = offer, tail: bool = False) -> Run:
    cluster = f"p{partitions}r{rate}{uuid.uuid4().hex[:4]}"
    admin = f"127.0.0.1:{free_port()}"
    idle_bound = idle_latency_bound(stack)
    reference = reference_ms()
    proc, bootstrap = start_broker(stack, logdir, cluster, linger_ms=str(LINGER_MS),
                                   node_flush=str(mode == "node").lower(), admin_listen=admin)
    try:
        log_process, *workers = broker_children(proc.pid)
        topic = "scale"
        client = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until its future resolves
        client.create_topics([NewTopic(topic, partitions, 1)])[topic].result(60)
        before_open, opening = rss_kib(log_process), time.perf_counter()
        open_all(bootstrap, topic, partitions)
        open_s = time.perf_counter() - opening
        idle = (rss_kib(log_process) - before_open) / partitions
        broker_url, etcd_url = f"http://{admin}/metrics", f"http://{stack.etcd_endpoint}/metrics"
        start, compacted_before = stack.server_counts(), compacted_bytes(broker_url)
        following = Tail(bootstrap, topic, partitions) if tail else None
        with following or contextlib.nullcontext(), StorageProbe(stack) as probe:
            hist, disk = histogram_buckets(broker_url, BROKER_HISTOGRAMS), histogram_buckets(etcd_url, ETCD_HISTOGRAMS)
            since, busy, queued = time.perf_counter(), machine_busy_s(), run_queue_waits()
            etcd, weed = (p.pid for p in stack.procs)
            with CpuMeter({"broker": [proc.pid, log_process, *workers], "log process": [log_process],
                           "workers": workers, "SeaweedFS": [weed], "etcd": [etcd],
                           "tail consumer": [] if following is None else [following.pid]}) as cpu:
                offered, acked, failed, lat, secs = offer_load(bootstrap, topic, partitions, rate, seconds, drain)
            wall = time.perf_counter() - since
            machine, stolen = ((b - a) / wall for a, b in zip(busy, machine_busy_s(), strict=True))
            queued_end = run_queue_waits()
            waiting = wait_s(queued, queued_end) / wall
            log_waited = wait_s(queued, queued_end, log_process) / (cpu.cores["log process"] * wall)
        end, hist_end = stack.server_counts(), histogram_buckets(broker_url, BROKER_HISTOGRAMS)
        broker_ms = stage_ms(hist, hist_end)
        etcd_ms = stage_ms(disk, histogram_buckets(etcd_url, ETCD_HISTOGRAMS))
        requests, pauses = (hist_end[col].get(float("inf"), 0) - hist[col].get(float("inf"), 0)
                            for col in ("produce", "in-flight pause"))
        compacted = compacted_s(stack, cluster, drain)
        rewrote = {k: v - compacted_before[k] for k, v in compacted_bytes(broker_url).items()}
        peak = rss_kib(log_process, "VmHWM") / 1024
    finally:
        stop_broker(proc, 120)
    return Run(mode, rnd, partitions, rate, offered, acked, failed, secs, end["puts"] - start["puts"] - len(probe.puts),
               end["gets"] - start["gets"], end["txns"] - start["txns"] - len(probe.txns), end["keys"] - start["keys"],
               (start["db"] / (1 << 20), end["db"] / (1 << 20)),
               lat, cpu.cores["broker"], {k: cpu.cores[k] for k in ("log process", "workers", "SeaweedFS", "etcd")},
               cpu.cores["bench client"], machine, stolen, waiting, log_waited, peak, idle, open_s, broker_ms, etcd_ms,
               requests, pauses, compacted, rewrote, pct(probe.puts, 0.99), pct(probe.txns, 0.99), reference,
               idle_bound, -1 if following is None else following.read, cpu.cores["tail consumer"])


def idle_latency_bound(stack: DevStack) -> float:
    """latency_bound of the storage on the idle machine (seconds)."""
    put_p99 = pct(asyncio.run(put_latencies(stack)), 0.99)
    etcd_p99 = pct(asyncio.run(etcd_txn_latencies(stack)), 0.99)
    print(f"on the idle machine: 64 KiB S3 PUT p99 {put_p99 * 1000:.1f} ms, etcd transaction p99 "
          f"{etcd_p99 * 1000:.1f} ms", flush=True)
    return latency_bound(put_p99, etcd_p99)


def report(runs: list[Run]) -> None:
    for mode, rate, rnd in sorted({(r.mode, r.rate, r.round) for r in runs}):
        rows = [r for r in runs if (r.mode, r.rate, r.round) == (mode, rate, rnd)]
        base = rows[0]
        print(f"\n{mode} flushes, round {rnd + 1}: {rate} records/s of {RECORD} B offered, acks=all, linger "
              f"{LINGER_MS} ms (ratio to P = {base.partitions} in brackets)")
        print(f"{'P':>6} {'acked':>13} {'S3 PUT/s':>15} {'etcd txn/s':>15} {'ack p50 ms':>17} {'ack p99 ms':>17} "
              f"{'CPU cores':>12} {'log RSS MiB':>14} {'+etcd keys':>11} {'idle KiB/p':>10} {'open s':>7} "
              f"{'compacted s':>15}")
        for r in rows:
            def cell(v: float, b: float, fmt: str = ".0f") -> str:
                return f"{v:{fmt}} ({v / b:.2f})" if b else f"{v:{fmt}}"
            p50, p99 = (pct(r.lat, 0.5) * 1000, pct(r.lat, 0.99) * 1000) if r.lat else (float("nan"),) * 2
            b50, b99 = (pct(base.lat, 0.5) * 1000, pct(base.lat, 0.99) * 1000) if base.lat else (0, 0)
            print(f"{r.partitions:>6} {r.acked:>6}/{r.offered:<6} {cell(r.per_s('puts'), base.per_s('puts')):>15} "
                  f"{cell(r.per_s('txns'), base.per_s('txns')):>15} {cell(p50, b50, '.1f'):>17} "
                  f"{cell(p99, b99, '.1f'):>17} {cell(r.cpu, base.cpu, '.2f'):>12} "
                  f"{cell(r.peak_rss_mib, base.peak_rss_mib):>14} {r.keys:>11.0f} {r.idle_kib_per_partition:>10.1f} "
                  f"{r.open_s:>7.1f} {cell(r.compacted_s, base.compacted_s, '.1f'):>15}")
            print(f"       in the broker: {r.per_s('produce_requests'):.0f} Produce requests/s, {r.per_s('gets'):.0f} "
                  f"S3 GETs/s, {r.per_s('pauses'):.0f} in-flight pauses/s; p50/p99/max ms: {stages_text(r.broker_ms)}")
            if r.rewrote["slices"]:
                print(f"       compaction rewrote {r.rewrote['slices'] / (1 << 20):.1f} MiB of slices and "
                      f"{r.rewrote['merged'] / (1 << 20):.1f} MiB of merged segments: write amplification "
                      f"{sum(r.rewrote.values()) / r.rewrote['slices']:.2f}")
            disk = ", ".join(f"{col} {p99:g}/{top:g}" for col, (_, p99, top) in r.etcd_ms.items())
            of = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_of.items())
            print(f"       CPU cores: broker {r.cpu:.2f} ({of}), the producer {r.client_cpu:.2f}, the whole machine "
                  f"{r.machine_cpu:.2f} of {os.cpu_count()} ({r.stolen:.2f} stolen by the hypervisor); the machine's "
                  f"reference work {r.reference_ms:.0f} ms")
            if r.tail_read >= 0:
                print(f"       the tail consumer read {r.tail_read} records during the load, {r.tail_cpu:.2f} cores")
            print(f"       waiting for a CPU: {r.waiting:.2f} tasks of the machine on average; the log process's "
                  f"threads {r.log_waited:.2f} s a second they ran")
            print(f"       in etcd: p99/max ms: {disk}; its DB {r.db_mib[0]:.1f} -> {r.db_mib[1]:.1f} MiB")
            print(f"       storage during the load (the probe): S3 PUT p99 {r.probe_put_p99 * 1000:.1f} ms, etcd "
                  f"transaction p99 {r.probe_txn_p99 * 1000:.1f} ms; bound {r.bound * 1000:.1f} ms, ack p99 / bound "
                  f"{pct(r.lat, 0.99) / r.bound:.2f}" if r.lat else "")
            if r.failed or r.acked < r.offered:
                print(f"       {r.offered - r.acked} records not acknowledged ({r.failed} failed)")
        idle = [r.idle_bound * 1000 for r in rows]
        print(f"ack p99 bound (linger + 2 x S3 PUT p99 + etcd txn p99) on the idle machine before each P "
              f"{min(idle):.1f}-{max(idle):.1f} ms, worst ack p99 / it = "
              f"{max(pct(r.lat, 0.99) / r.idle_bound for r in rows if r.lat):.2f}; during each load (the probe's) "
              f"worst ack p99 / bound = {max(pct(r.lat, 0.99) / r.bound for r in rows if r.lat):.2f}")
    if max(r.round for r in runs):
        medians(runs)


FIGURES: dict[str, Callable[[Run], float]] = {  # what medians() reports of each run
    "p50": lambda r: pct(r.lat, 0.5) * 1000, "p99": lambda r: pct(r.lat, 0.99) * 1000,
    "p99 / bound": lambda r: pct(r.lat, 0.99) / r.bound, "puts": lambda r: r.per_s("puts"),
    "txns": lambda r: r.per_s("txns"), "cpu": lambda r: r.cpu, "reference": lambda r: r.reference_ms}


def median_cell(runs: list[Run], base: dict[int, Run], what: str, fmt: str) -> str:
    """The median of a figure over the runs, and (but for p99 / bound) the median of its ratios to base's
    run of the same round."""
    f = FIGURES[what]
    ratio = ("" if what in ("p99 / bound", "reference")
             else f" ({statistics.median(f(r) / f(base[r.round]) for r in runs):.2f})")
    return f"{statistics.median(f(r) for r in runs):{fmt}}{ratio}"


def medians(runs: list[Run]) -> None:
    """Each P's median over the rounds: of its figures, and of their ratios to
    P = 1 of the same round (single 30 s runs on this machine move by 2x)."""
    for mode, rate in sorted({(r.mode, r.rate) for r in runs}):
        rows = [r for r in runs if (r.mode, r.rate) == (mode, rate) and r.lat]
        base = {r.round: r for r in rows if r.partitions == min(x.partitions for x in rows)}
        print(f"\n{mode} flushes, {rate} records/s: medians over {len(base)} rounds (of each round's ratio to its "
              f"P = {next(iter(base.values())).partitions} in brackets)")
        print(f"{'P':>6} {'ack p50 ms':>15} {'ack p99 ms':>15} {'p99 / bound':>12} {'S3 PUT/s':>13} {'etcd txn/s':>13} "
              f"{'broker cores':>13} {'ref. ms':>8}   p99 per round ms")
        for n in sorted({r.partitions for r in rows}):
            mine = [r for r in rows if r.partitions == n and r.round in base]
            cells = [median_cell(mine, base, what, fmt) for what, fmt in
                     (("p50", ".1f"), ("p99", ".1f"), ("p99 / bound", ".2f"), ("puts", ".0f"), ("txns", ".0f"),
                      ("cpu", ".2f"), ("reference", ".0f"))]
            print(f"{n:>6} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, (15, 15, 12, 13, 13, 13, 8), strict=True))
                  + "   " + " ".join(f"{FIGURES['p99'](r):.0f}" for r in mine))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="1,100,1000,10000", help="comma-separated partition counts")
    ap.add_argument("--rates", default="2000,20000", help="comma-separated offered records/s")
    ap.add_argument("--modes", default="node", help="comma-separated: node (node flushes), partition (one flush "
                    "of each partition on its own)")
    ap.add_argument("--seconds", type=float, default=15, help="how long each load is offered")
    ap.add_argument("--drain", type=float, default=180, help="how long to wait for the last acknowledgements")
    ap.add_argument("--rounds", type=int, default=1, help="run every P this many times, in turn, and report the "
                    "medians too")
    ap.add_argument("--s3-on-disk", action="store_true", help="keep SeaweedFS's objects on etcd's disk")
    ap.add_argument("--tail", action="store_true", help="a consumer reads every partition from its end during the "
                    "load")
    add_client_arguments(ap, "the producer that offers the load (aiokafka and sarama: a request per broker, not "
                         "per partition)")
    args = ap.parse_args()
    offer_load = client_offer(args.client, args.send_buffer, args.client_linger_ms)  # refuses a wrong --send-buffer
    counts = sorted(int(x) for x in args.partitions.split(","))
    if args.client == "sarama":
        sarama_offer()
    print(f"the load offered by a {args.client} producer"
          + (f" with a {args.send_buffer} B send buffer" if args.send_buffer else "")
          + (f", its linger {args.client_linger_ms} ms" if args.client_linger_ms != LINGER_MS else ""))
    runs = []
    for mode in args.modes.split(","):
        for rate in (int(x) for x in args.rates.split(",")):
            for rnd, n in itertools.product(range(args.rounds), counts):
                with fresh_stack(args.s3_on_disk) as (stack, tmp):
                    runs.append(measure(stack, Path(tmp), mode, rnd, n, rate, args.seconds, args.drain, offer_load,
                                        args.tail))
                r = runs[-1]
                print(f"{mode} P={n} rate={rate} round {rnd + 1}: {r.acked}/{r.offered} acked in "
                      f"{r.seconds:.1f} s", flush=True)
    report(runs)


@contextlib.contextmanager
def fresh_stack(s3_on_disk: bool) -> Iterator[tuple[DevStack, str]]:
    """A dev stack of its own for one measurement, and its data directory."""
    with stack_dirs(s3_on_disk) as (tmp, s3_dir):
        stack = DevStack(data_dir=tmp, volume_mib=8192, s3_dir=s3_dir).start()
        print(f"SeaweedFS's objects in {stack.s3_dir}, etcd's data in {tmp}/etcd", flush=True)
        try:
            yield stack, tmp
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
