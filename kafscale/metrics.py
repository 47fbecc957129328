"""Prometheus metrics (prometheus_client).

A broker node is several processes: each writes its own samples to files in
the node's metrics directory (prometheus_client's multiprocess mode, set up
by `init_process` right after the supervisor forks it), and the log process
serves them merged on the admin port together with values it computes at
scrape time (group lag). The proxy is one process and serves its own.

Every metric carries `node` (the broker id; 0 for the proxy); per-process
ones carry `process` ("log" or the worker slot)."""
from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import GaugeMetricFamily

_labels = {"node": "0", "process": "main"}
_tally_s = 0.0  # how long a Tally may hold increments (multiprocess mode only)
_tallies: list[Tally] = []

REQUESTS = Counter("kafscale_requests", "Kafka requests answered, by API and process",
                   ["node", "process", "api"])
_REQUEST_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10)  # seconds, a client's waits
REQUEST_SECONDS = Histogram("kafscale_request_seconds", "Time from a request's arrival to its response",
                            ["node", "api"], buckets=_REQUEST_BUCKETS)
CONNECTION_PAUSED_SECONDS = Histogram(
    "kafscale_connection_paused_seconds", "How long each time a client connection was not read because it had "
    "max_in_flight_requests requests read and not yet answered", ["node", "process"], buckets=_REQUEST_BUCKETS)
PRODUCE_BYTES = Counter("kafscale_produce_bytes", "Record batch bytes accepted by Produce", ["node", "process"])
FETCH_BYTES = Counter("kafscale_fetch_bytes", "Record batch bytes returned by Fetch", ["node", "process"])
FETCHES = Counter("kafscale_fetch_requests", "Fetch requests a worker answered, by kind: sessionless, full (beginning "
                  "an incremental fetch session) or incremental (KIP-227)", ["node", "process", "kind"])
SEGMENT_READS = Counter("kafscale_segment_reads", "Fetch reads of committed segments, by where they came from",
                        ["node", "source"])
S3_SECONDS = Histogram("kafscale_s3_request_seconds", "S3 request latency, by operation", ["node", "op"],
                       buckets=(.0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
S3_ERRORS = Counter("kafscale_s3_errors", "Failed S3 requests, by operation", ["node", "op"])
ETCD_SECONDS = Histogram("kafscale_etcd_commit_seconds",
                         "Latency of the etcd transaction committing a node object or segment",
                         ["node"], buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5))
LOOP_LAG = Histogram("kafscale_event_loop_lag_seconds",
                     "How late a process's event loop runs a callback due now (how busy the process is)",
                     ["node", "process"], buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
COMPACTED_BYTES = Counter("kafscale_compacted_bytes",
                          "Bytes compaction rewrote into committed segments, by what they were: slices (node objects' "
                          "bytes, compacted for the first time) or merged (small compacted segments written again); "
                          "(slices + merged) / slices is compaction's write amplification", ["node", "source"])
NODE_FLUSH_SECONDS = Histogram(
    "kafscale_node_flush_seconds", "Where an acknowledgement's time in the log process goes, per node object, by "
    "stage: queued (its oldest batch's wait until the object is cut: the flush linger), upload (its PUT, retries "
    "included), commit (uploaded until committed: behind the objects before it, then the etcd transaction) and durable "
    "(its oldest batch queued until its producers are acknowledged)", ["node", "stage"],
    buckets=(.0005, .001, .002, .003, .005, .0075, .01, .015, .02, .03, .05, .075, .1, .25, .5, 1, 2.5, 10))
FLUSH_BYTES = Histogram("kafscale_segment_flush_bytes", "Size of each node object or segment a flush uploads", ["node"],
                        buckets=tuple(float(1 << n) for n in range(12, 31, 2)))


def init_process(node_id: int, process: str, metrics_dir: str | None) -> None:
    """Label this process's samples; with metrics_dir, write them there for
    the node's log process to merge (call before any metric is used)."""
    _labels.update(node=str(node_id), process=process)
    global _tally_s
    if metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        values.ValueClass = values.MultiProcessValue()
        _tally_s = 0.1


def node() -> str:
    return _labels["node"]


def process() -> str:
    return _labels["process"]


class Tally:
    """A counter child that a process's event loop bumps for every request.
    In multiprocess mode an increment of the value itself takes a lock,
    checks the pid and writes the mmapped file (2-8 µs; the two of every
    Produce were 4% of a worker at 2,000 requests/s), so increments add up
    here and reach the value at most 0.1 s later: at the next tick of
    watch_loop_lag, or the first increment after that. Not thread-safe: for
    the event loop's thread only."""

    def __init__(self, child: Any) -> None:
        self._child = child
        self._pending = 0.0
        self._due = 0.0  # when the increments held here must reach the value
        _tallies.append(self)

    def inc(self, amount: float = 1) -> None:
        self._pending += amount
        now = time.monotonic()
        if now >= self._due:
            self.flush(now)

    def flush(self, now: float) -> None:
        if self._pending:
            self._child.inc(self._pending)
            self._pending = 0.0
        self._due = now + _tally_s


class HistogramTally(Tally):
    """A histogram child observed for every request, its observations held
    like a Tally's increments: an observe in multiprocess mode is two locked,
    pid-checked writes (5% of a worker at 6,000-8,000 Produce requests/s).
    Uses how prometheus_client's Histogram keeps its values (`_upper_bounds`,
    a value per bucket not yet cumulative in `_buckets`, and `_sum`): the
    unit tests compare the exposition with plain observes."""

    def __init__(self, child: Any) -> None:
        super().__init__(child)
        self._bounds = list(child._upper_bounds)
        self._counts = [0] * len(self._bounds)

    def observe(self, amount: float, n: int = 1) -> None:
        """n observations of amount."""
        self._counts[bisect.bisect_left(self._bounds, amount)] += n  # the first bucket with amount <= bound
        self.inc(amount * n)

    def flush(self, now: float) -> None:
        if any(self._counts):
            self._child._sum.inc(self._pending)
            for value, n in zip(self._child._buckets, self._counts, strict=True):
                if n:
                    value.inc(n)
            self._counts = [0] * len(self._bounds)
            self._pending = 0.0
        self._due = now + _tally_s


def flush_tallies() -> None:
    now = time.monotonic()
    for t in _tallies:
        t.flush(now)


@contextmanager
def s3_call(op: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    except Exception:
        S3_ERRORS.labels(node(), op).inc()
        raise
    finally:
        S3_SECONDS.labels(node(), op).observe(time.perf_counter() - t)


async def watch_loop_lag(interval_s: float = 0.1) -> None:
    """Observe LOOP_LAG every interval_s: how much later than asked a sleep
    ends; and flush the Tallies."""
    lag = LOOP_LAG.labels(node(), process())
    try:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(interval_s)
            lag.observe(max(time.perf_counter() - t - interval_s, 0))
            flush_tallies()
    finally:
        flush_tallies()


def render(lag: dict[tuple[str, str, int], int] | None = None) -> bytes:
    """The exposition text: this process's metrics, or with multiprocess mode
    the merged samples of every process of the node; plus group lag."""
    registry = CollectorRegistry()
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY
        registry = REGISTRY
    out = generate_latest(registry)
    if lag is not None:
        fam = GaugeMetricFamily("kafscale_group_lag", "High watermark minus committed offset, per group partition",
                                labels=["node", "group", "topic", "partition"])
        for (group, topic, p), n in sorted(lag.items()):
            fam.add_metric([node(), group, topic, str(p)], n)
        extra = CollectorRegistry()
        extra.register(_Fixed(fam))
        out += generate_latest(extra)
    return out


class _Fixed:
    def __init__(self, fam: GaugeMetricFamily) -> None:
        self.fam = fam

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self.fam
