"""A consumer replays a backlog far larger than the broker's read-ahead
memory: every record comes back, and each broker process's private memory
grows by no more than its configured bounds, however large the backlog.

KAFSCALE_BACKLOG_MIB sets the backlog (default 256 MiB with small read-ahead
settings, so that the bound is well below the backlog). With
KAFSCALE_BACKLOG_MIB=5120 it replays 5 GiB with the default settings and
prints the peaks (bench/README.md records that run)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from tests.integration.clients import create_topic

MIB = 1 << 20
BACKLOG_MIB = int(os.environ.get("KAFSCALE_BACKLOG_MIB", "256"))
PARTITIONS = 4
VALUE = 4096
FETCH_MAX = 16 * MIB  # the consumer's fetch.max.bytes: one response per worker in flight
# interpreter and allocator noise, transport buffers: freed windows stay on the
# malloc heaps (the supervisor lets each of its 2 keep 128 MiB free); the serving
# worker of the 256 MiB replay grew 42-75 MiB in 6 runs (2026-11-23; 59-90 MiB
# before the heaps were capped at 2, when the S3 body threads had one each)
SLACK = 64 * MIB


def rss_anon(pid: int) -> int:
    """Private resident memory (bytes): shared memory (the produce rings and the
    segment cache, fixed in size) is not counted."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for {pid}")


class PeakMemory:
    """Samples RssAnon of some processes every 20 ms; peak growth over the first sample."""

    def __init__(self, pids: list[int]) -> None:
        self.base = {p: rss_anon(p) for p in pids}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for p in self.peak:
                self.peak[p] = max(self.peak[p], rss_anon(p))

    def growth(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return {p: self.peak[p] - self.base[p] for p in self.peak}


def produce_backlog(bootstrap: str, topic: str, total: int) -> int:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20, "batch.size": 1_000_000,
                  "queue.buffering.max.kbytes": 256 * 1024})
    value = os.urandom(VALUE)
    n = total // VALUE
    failed: list[object] = []
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=value, partition=i % PARTITIONS,
                          on_delivery=lambda err, _m: err is None or failed.append(err))
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(600) == 0
    assert not failed, failed[:3]
    return n


def replay(bootstrap: str, topic: str, n: int) -> dict[int, int]:
    """Reads every partition from offset 0 to its end; records per partition."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "backlog", "enable.auto.commit": False,
                  "fetch.max.bytes": FETCH_MAX, "max.partition.fetch.bytes": 4 * MIB})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    seen = dict.fromkeys(range(PARTITIONS), 0)
    want = {p: n // PARTITIONS + (p < n % PARTITIONS) for p in range(PARTITIONS)}
    deadline = time.monotonic() + 600
    try:
        while seen != want and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                assert m.error() is None, m.error()
                assert m.offset() == seen[m.partition()]  # in order, no gap, nothing twice
                assert len(m.value()) == VALUE
                seen[m.partition()] += 1
    finally:
        c.close()
    assert seen == want
    return seen


def test_replaying_a_large_backlog_keeps_broker_memory_bounded(make_broker, topic_name):
    if BACKLOG_MIB >= 1024:  # the real thing: default settings
        config: dict[str, int] = {}
        readahead, budget = 16 * MIB, 128 * MIB
    else:
        readahead, budget = 2 * MIB, 8 * MIB
        config = {"readahead_bytes": readahead, "readahead_memory_bytes": budget}
    broker = make_broker(workers=2, **config)
    create_topic(broker.bootstrap, topic_name, partitions=PARTITIONS)
    t0 = time.monotonic()
    n = produce_backlog(broker.bootstrap, topic_name, BACKLOG_MIB * MIB)
    produced_s = time.monotonic() - t0
    broker.stop()
    broker.start()  # a fresh broker: nothing of the backlog is in its cache, all of it comes from S3
    pids = broker.children()  # the log process, then the workers
    peaks = PeakMemory(pids)
    t0 = time.monotonic()
    replay(broker.bootstrap, topic_name, n)
    replay_s = time.monotonic() - t0
    growth = peaks.growth()
    # A worker holds at most its read-ahead budget, a window each partition is
    # waiting for, a window being read from the HTTP body, and the responses
    # being sent.
    bound = budget + PARTITIONS * readahead + 2 * readahead + FETCH_MAX + SLACK
    print(f"\nbacklog {BACKLOG_MIB} MiB ({n} records, {PARTITIONS} partitions), produced in {produced_s:.0f} s, "
          f"replayed in {replay_s:.1f} s ({BACKLOG_MIB / replay_s:.0f} MiB/s); private memory growth per process: "
          + ", ".join(f"{g / MIB:.0f} MiB" for g in growth.values())
          + f" (log process, workers); bound per worker {bound / MIB:.0f} MiB")
    assert bound < BACKLOG_MIB * MIB
    for pid, g in growth.items():
        assert g <= bound, f"process {pid} grew by {g / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)"
