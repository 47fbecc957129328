"""The log process's CPU per Produce request, without IPC, S3 or etcd.

The log process's produce path (`LogService._produce`: the produce calls of
one connection, appended, flushed in node objects, committed, acknowledged)
in this process, over the in-memory twins of S3 and etcd, with the real
shared rings and segment cache. Each call is a list of one-partition
produce calls of two 1 KiB records, spread over --partitions partitions
(100), as librdkafka sends them with many partitions; a list holds --calls
requests (50: a connection's requests of one loop pass at 20,000 records/s
over 100 partitions) and CALLS_IN_FLIGHT lists are outstanding at a time.
Printed: this process's CPU time (user + system, getrusage) per request
over --requests requests, for --runs runs, each in a fresh process. Staging
each payload in a ring (a worker's part) is included: about 1 µs a request.

    python -m bench.logproc --requests 40000 --runs 5 [--partitions 100] [--calls 50] [--spread 1] [--compact 1]

With many partitions and few requests a call (--partitions 10000 --calls 5,
as at 2,000 records/s over 10,000 partitions) each partition's slice of a
node object holds one request, and the costs of a slice and of a call
count as much as those of a request. With --spread N each request names N
partitions (each with its own payload of two records), as Kafka's Java
client and Sarama send a broker one request holding every partition's ready
batch: the cost printed is then that of N partition batches. With
--compact 1, every load is followed by the compaction of all it wrote (as
the broker's compaction loop does it: neighbouring partitions' segments in
shared objects), and the cost printed includes it; each run then also
prints the CPU of those compactions per partition compacted in the
measured load (what a partition's compaction costs whatever it holds: with
few requests a partition, as at 10,000 partitions, that dominates).

What the in-memory stores cost is not the broker's; compare commits by
running this at each, alternately, on the same machine (with
bench/listener.py for a worker's side).
"""
from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import time

from bench.listener import cpu_s, per_request_runs
from kafscale import _native
from kafscale.broker import messages
from kafscale.broker.broker import Broker
from kafscale.broker.logproc import LogService
from kafscale.broker.partitions import compaction_batches
from kafscale.broker.shm import SharedArea, SharedCache
from kafscale.broker.supervisor import GC_THRESHOLDS
from kafscale.config import Config
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import MetaStore
from kafscale.storage.memory import MemoryObjectStore

PARTITIONS = 100  # --partitions by default
CALLS = 50  # --calls by default: a connection's requests of one loop pass at 20,000 records/s over 100 partitions
CALLS_IN_FLIGHT = 20
TOPIC = "bench"


async def _run(requests: int, partitions: int = PARTITIONS, calls: int = CALLS, spread: int = 1,
               compact: int = 0) -> float:
    cfg = Config(node_id=1, namespace="bench", node_flush=True)
    etcd = MemoryEtcd()
    meta = MetaStore.in_memory("bench", etcd)
    await meta.create_topic(TOPIC, partitions, {})
    area = SharedArea(1, cfg.ring_bytes, cfg.cache_bytes)
    area.populate()  # as the log process does: no first-touch page faults in the copies measured
    cache = SharedCache(area)
    broker = Broker(cfg, MemoryObjectStore(), meta, cache)
    broker.partitions.cluster.desired_owner = lambda _t, _p: cfg.node_id  # type: ignore[method-assign]
    await broker.partitions.start(await etcd.lease(60))
    await broker.partitions.refresh_defaults()
    service = LogService(broker, area, cache)
    ring = area.rings[0]
    payload = _native.build_batch([(1_700_000_000_000, b"k", b"x" * 1024, [])] * 2)

    def staged() -> messages.RingPayload:
        start = ring.put(payload)
        assert start is not None, "the ring is full: fewer calls in flight"
        return 0, start, len(payload)

    def produce(first: int) -> asyncio.Future[list[object]]:
        call: list[messages.ProduceCall] = [
            (1, 9, "bench", "/127.0.0.1", "User:ANONYMOUS", -1, 30_000, None,
             ((TOPIC, tuple((((first + i) * spread + j) % partitions, staged()) for j in range(spread))),))
            for i in range(calls)]
        return asyncio.ensure_future(service._produce(0, call))

    compacted = {"cpu_s": 0.0, "partitions": 0}  # by compact_all, in the measured load

    async def load(n: int) -> None:
        in_flight: list[asyncio.Future[list[object]]] = []
        for first in range(0, n, calls):
            in_flight.append(produce(first))
            if len(in_flight) >= CALLS_IN_FLIGHT:
                replies = await in_flight.pop(0)
                assert all(isinstance(r, list) for r in replies), replies
            await asyncio.sleep(0)
        await asyncio.gather(*in_flight)
        if compact:
            await compact_all()

    async def compact_all() -> None:
        """Every partition's committed slices compacted, in the batches the compaction loop makes of them."""
        now_ms = int(time.time() * 1000)
        due = [lg for lg in broker.partitions.logs.values() if lg.compaction_due(now_ms, 0, 0)]
        started = cpu_s()
        for logs, shared in compaction_batches(due, cfg.shared_compaction):
            await broker.partitions.compact(logs, shared)
        compacted["cpu_s"] += cpu_s() - started
        compacted["partitions"] += len(due)

    await load(-(-partitions * 4 // spread))  # every partition opened
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    compacted.update(cpu_s=0.0, partitions=0)
    started = cpu_s()
    await load(requests)
    per_request = (cpu_s() - started) / requests
    if compact:
        print(f"compaction CPU per partition compacted: {compacted['cpu_s'] / compacted['partitions'] * 1e6:.1f} µs "
              f"({compacted['partitions']} partitions)", flush=True)
    await broker.close(1)
    return per_request


def _one(requests: int, partitions: int, calls: int, spread: int, compact: int, out: mp.Queue) -> None:
    out.put(asyncio.run(_run(requests, partitions, calls, spread, compact)))


def one_run(requests: int, partitions: int = PARTITIONS, calls: int = CALLS, spread: int = 1,
            compact: int = 0) -> float:
    """The log process's CPU per request (µs), in a fresh process."""
    out: mp.Queue = mp.Queue()
    proc = mp.Process(target=_one, args=(requests, partitions, calls, spread, compact, out))
    proc.start()
    per_request: float = out.get()
    proc.join()
    return per_request * 1e6


def main() -> None:
    per_request_runs(__doc__, one_run, "log process", {
        "partitions": (PARTITIONS, "partitions the requests go to, in turn"),
        "calls": (CALLS, "produce requests in one call from a worker"),
        "spread": (1, "partitions a request names (librdkafka: 1; Kafka's Java client and Sarama: every "
                      "partition with a batch ready)"),
        "compact": (0, "1: each load is followed by the compaction of what it wrote, counted in the cost")})


if __name__ == "__main__":
    main()
