"""ProduceApi.produce_all over the in-memory twins of S3 and etcd: requests
to open partitions are appended in one pass (other work gets a turn every
APPEND_TURN partition batches), the others wait for their partitions to
open, all of a call's partitions open at once, and each request and
partition gets its own answer."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

from kafscale import _native
from kafscale.broker import produce_api
from kafscale.broker.broker import Broker
from kafscale.broker.context import RequestContext
from kafscale.broker.produce_api import ProduceRequest
from kafscale.config import Config
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import MetaStore
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import PRODUCE
from kafscale.storage.memory import MemoryObjectStore
from kafscale.storage.partition import PartitionLog
from kafscale.storage.reader import LogError
from tests.unit.test_partition import DictCache, run

TOPIC = "orders"
PARTITIONS = 6


@contextlib.asynccontextmanager
async def started() -> AsyncIterator[Broker]:
    """A broker owning every partition of TOPIC, none open yet."""
    cfg = Config(node_id=1, namespace="t", node_flush=True, auto_create_topics=True)
    etcd = MemoryEtcd()
    meta = MetaStore.in_memory("t", etcd)
    await meta.create_topic(TOPIC, PARTITIONS, {})
    b = Broker(cfg, MemoryObjectStore(), meta, DictCache())
    b.partitions.cluster.desired_owner = lambda _t, _p: cfg.node_id  # type: ignore[method-assign]
    await b.partitions.start(await etcd.lease(60))
    await b.partitions.refresh_defaults()
    await b.partitions.topic(TOPIC)
    yield b
    await b.close(1)


def produce(topic: str, partition: int, value: bytes = b"v", acks: int = -1) -> ProduceRequest:
    payload = memoryview(_native.build_batch([(1_700_000_000_000, b"k", value, [])]))
    return acks, 30_000, None, [(topic, [(partition, (payload, lambda: None))])]


def answers(replies: list[Any]) -> list[list[tuple[str, int, int, int]]]:
    """Each reply's (topic, partition, error code, base offset)s."""
    return [[(name, r[0], r[1], r[2]) for name, parts in reply for r in parts] for reply in replies]


def header() -> RequestContext:
    return RequestContext(PRODUCE.key, 9, 0, "test", False, "/127.0.0.1", "User:ANONYMOUS")


def test_a_calls_partitions_open_at_once_and_its_requests_keep_their_order():
    """A call to partitions none of which is open: the first request waits
    for its partition, and meanwhile every later request's partition starts
    opening too (not one after another behind the first)."""
    async def go() -> None:
        async with started() as broker:
            reg = broker.partitions
            opening: list[int] = []
            gate = asyncio.Event()
            real_open = reg._open

            async def gated_open(topic: str, p: int) -> PartitionLog:
                opening.append(p)
                await gate.wait()
                return await real_open(topic, p)

            reg._open = gated_open  # type: ignore[method-assign]
            reqs = [produce(TOPIC, p, bytes([p])) for p in range(PARTITIONS)] + [produce(TOPIC, 0, b"again")]
            call = asyncio.create_task(broker.produce_api.produce_all(header(), reqs))
            for _ in range(20):
                await asyncio.sleep(0)
            assert sorted(opening) == list(range(PARTITIONS)), "every partition of the call opens at once"
            assert not call.done()
            gate.set()
            replies = await call
            assert answers(replies) == [[(TOPIC, p, 0, 0)] for p in range(PARTITIONS)] + [[(TOPIC, 0, 0, 1)]]

    run(go())


def test_open_partitions_are_appended_in_one_pass_with_each_partitions_own_answer():
    async def go() -> None:
        async with started() as broker:
            reg, api = broker.partitions, broker.produce_api
            await asyncio.gather(*(reg.partition_log(TOPIC, p) for p in range(PARTITIONS)))

            async def unavailable(topic: str, p: int) -> PartitionLog:
                raise LogError(ErrorCode.LEADER_NOT_AVAILABLE, "etcd is down")

            reg._open = unavailable  # type: ignore[method-assign]
            reqs = [produce(TOPIC, 1), produce(TOPIC, PARTITIONS), produce(TOPIC, 1, acks=0),
                    produce(TOPIC, 2, acks=5), produce("new-topic", 0), produce(TOPIC, 1)]
            replies = await api.produce_all(header(), reqs)
            assert replies[2] is None, "acks=0: no answer"
            assert answers([r for r in replies if r is not None]) == [
                [(TOPIC, 1, 0, 0)],
                [(TOPIC, PARTITIONS, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, -1)],
                [(TOPIC, 2, ErrorCode.INVALID_REQUIRED_ACKS, -1)],
                [("new-topic", 0, ErrorCode.LEADER_NOT_AVAILABLE, -1)],  # auto-created; its partition cannot open
                [(TOPIC, 1, 0, 2)],  # after the acks=0 one at offset 1
            ]
            assert reg.topics.get("new-topic") is not None

    run(go())


def test_a_request_of_many_partitions_lets_other_work_run_while_it_is_appended(monkeypatch):
    """Every APPEND_TURN partition batches, even within one request, the
    event loop runs other work (requests naming 10,000 partitions each kept
    its lag p99 at 250 ms); the request is still answered as one."""
    monkeypatch.setattr(produce_api, "APPEND_TURN", 2)

    async def go() -> None:
        async with started() as broker:
            logs = await asyncio.gather(*(broker.partitions.partition_log(TOPIC, p) for p in range(PARTITIONS)))
            req = (-1, 30_000, None, [(TOPIC, [produce(TOPIC, p)[3][0][1][0] for p in range(PARTITIONS)])])
            seen: list[int] = []  # batches appended, each time the watcher ran

            async def watch() -> None:
                while True:
                    seen.append(sum(lg.next_offset for lg in logs))
                    await asyncio.sleep(0)

            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0)
            replies = await broker.produce_api.produce_all(header(), [req])
            watcher.cancel()
            assert answers(replies) == [[(TOPIC, p, 0, 0) for p in range(PARTITIONS)]]
            assert {0, 2, 4, PARTITIONS} <= set(seen), seen

    run(go())


async def durable(logs: list[Any]) -> None:
    """Until what these logs hold is committed."""
    for _ in range(500):
        if all(lg.hw == lg.next_offset for lg in logs):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not committed within 5 s")


class Ring:
    """Payloads handed out and handed back, as a worker's ring sees them (each at most once)."""

    def __init__(self) -> None:
        self.out: set[int] = set()
        self.twice: list[int] = []
        self._tokens = itertools.count()

    def payload(self, value: bytes) -> tuple[memoryview, Any]:
        token = next(self._tokens)
        self.out.add(token)

        def release() -> None:
            if token in self.out:
                self.out.remove(token)
            else:
                self.twice.append(token)

        return memoryview(_native.build_batch([(1_700_000_000_000, b"k", value, [])])), release


def test_a_call_cancelled_midway_hands_back_the_payloads_it_did_not_append(monkeypatch):
    """A call cancelled between two turns of a request: the partitions it
    appended become durable and their payloads go back to the ring after
    their flush, and those of the rest of that request and of the requests
    after it go back at once, each exactly once (else the ring's tail
    stays behind them and the worker's ring fills for good)."""
    monkeypatch.setattr(produce_api, "APPEND_TURN", 2)

    async def go() -> None:
        async with started() as broker:
            logs = await asyncio.gather(*(broker.partitions.partition_log(TOPIC, p) for p in range(PARTITIONS)))
            ring = Ring()
            reqs: list[ProduceRequest] = [
                (-1, 30_000, None, [(TOPIC, [(p, ring.payload(bytes([n, p]))) for p in range(PARTITIONS)])])
                for n in range(2)]
            call = asyncio.create_task(broker.produce_api.produce_all(header(), reqs))
            await asyncio.sleep(0)  # the first turn: two partitions of the first request appended
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            assert sum(lg.next_offset for lg in logs) == 2, "the first turn's partitions are appended"
            await durable(logs)
            assert not ring.out and not ring.twice, "every payload handed back once"

    run(go())


def test_a_request_that_fails_before_it_is_appended_hands_back_its_payloads():
    """A topic lookup that fails with an unexpected error (not a Kafka
    error) fails its request, whose payloads go back to the ring; the
    requests after it are appended as usual."""
    async def go() -> None:
        async with started() as broker:
            reg = broker.partitions
            await reg.partition_log(TOPIC, 0)

            async def broken(name: str, create: bool = False) -> None:
                raise RuntimeError("etcd went away")

            reg.topic = broken  # type: ignore[method-assign,assignment]
            ring = Ring()
            reqs: list[ProduceRequest] = [
                (-1, 30_000, None, [("elsewhere", [(0, ring.payload(b"a")), (1, ring.payload(b"b"))])]),
                (-1, 30_000, None, [(TOPIC, [(0, ring.payload(b"c"))])])]
            replies = await broker.produce_api.produce_all(header(), reqs)
            assert isinstance(replies[0], RuntimeError)
            assert answers(replies[1:]) == [[(TOPIC, 0, 0, 0)]]
            await durable([reg.open_log(TOPIC, 0)])
            assert not ring.out and not ring.twice

    run(go())
