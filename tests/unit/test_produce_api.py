"""ProduceApi.produce_all over the in-memory twins of S3 and etcd: requests
to open partitions are appended in one pass (other work gets a turn every
APPEND_TURN partition batches), the others wait for their partitions to
open, all of a call's partitions open at once, and each request and
partition gets its own answer."""
from __future__ import annotations

import asyncio
import contextlib
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
