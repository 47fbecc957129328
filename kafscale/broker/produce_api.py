"""Produce (payloads already validated by a protocol worker and handed over
in shared memory) and InitProducerId. A produce is answered once every
batch it carries is durable: in a segment in S3 and committed in etcd."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kafscale import _native
from kafscale.broker.context import RequestContext
from kafscale.broker.partitions import PartitionApi
from kafscale.metadata import topic_config
from kafscale.metadata.store import TopicMeta, has_partition
from kafscale.protocol import schemas
from kafscale.protocol.errors import NO_TRANSACTIONS, ErrorCode
from kafscale.protocol.framing import ProduceAnswer
from kafscale.security.acl import CLUSTER, Operation, ResourceType
from kafscale.storage.partition import LogError, PartitionLog
from kafscale.storage.wal import Turns

log = logging.getLogger(__name__)

# partition batches a call appends before other work gets a turn: Sarama's requests naming 10,000 partitions each
# kept the log process's event-loop lag p99 in the 250 ms bucket, 100 ms with turns (bench/history.md, session 60)
APPEND_TURN = 1000

# A produce payload a worker validated and put in shared memory, and how to
# hand that memory back; or the error the worker found instead.
Accepted = tuple[memoryview, Callable[[], None]]
# A produce request as a worker hands it over (messages.ProduceCall without
# its connection's fields), its payloads accepted or refused:
#   (acks, timeout_ms, transactional_id, ((topic, ((partition, Accepted | LogError), ...)), ...))
ProduceTopics = Sequence[tuple[str, Sequence[tuple[int, Accepted | LogError]]]]
ProduceRequest = tuple[int, int, str | None, ProduceTopics]
# What a call's requests need of a topic they write to (looked up once a call):
# whether the principal may write it, its metadata, its max.message.bytes
_Topic = tuple[bool, TopicMeta | None, int]
# A partition's answer (framing.ProduceAnswer), its fields by index
_ERROR_CODE, _BASE_OFFSET, _LOG_START, _ERROR_MESSAGE = 1, 2, 3, 4


class Deadlines:
    """Ends waits at their deadlines without a timer each (a produce's
    timeout_ms: thousands a second, nearly all ended by their node flush
    first). A waiter goes into the TICK_S bucket its deadline falls in and
    leaves it when it ends; one task sets the waiters of past buckets, so a
    wait that times out ends up to TICK_S late."""
    TICK_S = 0.05

    def __init__(self) -> None:
        self._buckets: dict[int, set[asyncio.Future[None]]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def wait(self, waiter: asyncio.Future[None], timeout_s: float) -> None:
        """Until waiter is done, or timeout_s passed (this then sets it done)."""
        bucket = self._buckets.setdefault(math.ceil((time.monotonic() + timeout_s) / self.TICK_S), set())
        bucket.add(waiter)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        try:
            await waiter
        finally:
            bucket.discard(waiter)

    async def _sweep(self) -> None:
        while self._buckets:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic() / self.TICK_S
            for b in [b for b in self._buckets if b <= now or not self._buckets[b]]:
                for w in self._buckets.pop(b):
                    if not w.done():
                        w.set_result(None)


class Acks(_native.AckSet):
    """The partition responses of a call's produce requests (those of one
    timeout_ms) that wait for their batches' durability, and one future for
    all of them (an Acknowledger to their logs; expect, forget and answer
    are AckSet's). A batch durable leaves its response as appended (with its
    base offset); a failed one gets its error. A future per batch, with a
    callback each to count them down, cost the log process a loop callback
    per batch (librdkafka sends one partition a request; a connection's
    requests of one pass come as one call)."""
    __slots__ = ()

    def failed(self, token: list[Any], exc: LogError) -> None:
        token[_ERROR_CODE], token[_ERROR_MESSAGE], token[_BASE_OFFSET] = exc.code, str(exc), -1

    async def wait(self, deadlines: Deadlines, timeout_s: float) -> None:
        """Until every response is answered, or timeout_s passed: those left
        then time out (their batches may still become durable later)."""
        if self.waiting():
            self.waiter = asyncio.get_running_loop().create_future()
            await deadlines.wait(self.waiter, max(timeout_s, 0.001))
        for r in self.give_up():
            self.failed(r, LogError(ErrorCode.REQUEST_TIMED_OUT, "not durable within timeout_ms"))


def _release(topic_data: ProduceTopics, skip: int) -> None:
    """Hand back the accepted payloads of a request's partition batches after the first `skip`."""
    for _, partition_data in topic_data:
        for _, payload in partition_data:
            if skip > 0:
                skip -= 1
            elif isinstance(payload, tuple):
                payload[1]()


class ProduceApi(PartitionApi):
    ROUTES = {
        schemas.INIT_PRODUCER_ID.key: "init_producer_id",
    }

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.deadlines = Deadlines()

    async def produce_all(self, hdr: RequestContext, reqs: list[ProduceRequest]
                          ) -> list[ProduceAnswer | Exception | None]:
        """Produce requests one connection sent in a row, appended in that
        order under its lock, then waited for together: each one's answer
        (None for acks=0), or the exception it failed with (the others are
        answered all the same). A request whose topics are known here and
        whose partitions are open (nearly all) is appended without waiting
        for anything, no coroutine of its own, but other work gets a turn
        every APPEND_TURN partition batches."""
        opening = hdr.append_order.locked()
        if opening:  # an earlier call is appending: open what these need meanwhile
            self._start_opening(hdr, reqs)
        topics: dict[str, _Topic] = {}  # looked up once for the call: its requests share a principal
        acks = {timeout_ms: Acks() for timeout_ms in {req[1] for req in reqs}}
        appended: list[ProduceAnswer | Exception] = []
        turns = Turns(APPEND_TURN)
        taken = 0  # the requests before this one had their payloads appended or released
        try:
            async with hdr.append_order:  # appends in the order the connection sent them
                for i, req in enumerate(reqs):
                    try:
                        logs = self._resolve(hdr, req, topics, None)
                        if logs is None:  # a topic to look up or a partition to open first
                            if not opening:  # once a call (a pass over the later requests for each
                                # request that waited was quadratic: it held a stopping broker's loop for 5 s)
                                self._start_opening(hdr, reqs[i + 1:])
                                opening = True
                            logs = self._resolve(hdr, req, topics, await self._open(hdr, req, topics))
                            assert logs is not None
                        answer: ProduceAnswer = []
                        appending = self._append(hdr, req, topics, logs, acks[req[1]] if req[0] != 0 else None,
                                                 answer)
                        taken = i + 1  # _append releases what it does not append, also when closed midway
                        try:
                            for _ in appending:
                                if turns.due():
                                    await asyncio.sleep(0)
                        finally:
                            appending.close()
                        appended.append(answer)
                    except Exception as exc:
                        log.exception("produce failed")
                        appended.append(exc)
                        if taken == i:  # it failed before _append took its payloads
                            taken = i + 1
                            _release(req[3], 0)
        finally:  # cancelled: the payloads of the requests not reached go back to their rings
            for req in reqs[taken:]:
                _release(req[3], 0)
        start = time.monotonic()
        for timeout_ms in sorted(acks):  # each waits its own timeout_ms from now
            await acks[timeout_ms].wait(self.deadlines, start + timeout_ms / 1000 - time.monotonic())
        return [None if req[0] == 0 and not isinstance(done, Exception) else done
                for req, done in zip(reqs, appended, strict=True)]

    def _known_topic(self, hdr: RequestContext, name: str) -> _Topic | None:
        """What a call's requests need of a topic, when that is known without
        a lookup (None: look it up, _topic)."""
        if not self.access.allowed(hdr, Operation.WRITE, ResourceType.TOPIC, name):
            return False, None, 0
        meta = self.partitions.topics.get(name)
        if meta is None:
            return None
        return True, meta, topic_config.value(meta.config, "max.message.bytes", self.partitions.defaults)

    async def _topic(self, hdr: RequestContext, name: str) -> _Topic:
        """What a call's requests need of a topic not known here yet: looked up, maybe created."""
        known = self._known_topic(hdr, name)
        if known is not None:
            return known
        meta = await self.partitions.topic(name, self.access.may_create_topic(hdr, name))
        limit = topic_config.value(meta.config, "max.message.bytes", self.partitions.defaults) if meta else 0
        return True, meta, limit

    def _resolve(self, hdr: RequestContext, req: ProduceRequest, topics: dict[str, _Topic],
                 failed: dict[tuple[str, int], LogError] | None) -> list[PartitionLog | LogError | None] | None:
        """The log of each partition a request writes to, in its order (None
        where it may not or cannot be written: _append says why), or None
        when a topic must be looked up or a partition opened first (_open).
        After _open (with its failures as `failed`) it never returns None: a
        partition whose open failed has its error, one closed again since has
        NOT_LEADER_OR_FOLLOWER."""
        logs: list[PartitionLog | LogError | None] = []
        for name, partition_data in req[3]:
            topic = topics.get(name)
            if topic is None:
                topic = self._known_topic(hdr, name)
                if topic is None:
                    return None
                topics[name] = topic
            writable, meta, _ = topic
            for index, _ in partition_data:
                if not writable or not has_partition(meta, index):
                    logs.append(None)
                elif (lg := self.partitions.open_log(meta.name, index)) is not None:
                    logs.append(lg)
                elif failed is None:
                    return None
                else:
                    logs.append(failed.get((name, index)) or LogError(ErrorCode.NOT_LEADER_OR_FOLLOWER,
                                                                      f"{name}/{index} closed"))
        return logs

    async def _open(self, hdr: RequestContext, req: ProduceRequest, topics: dict[str, _Topic]
                    ) -> dict[tuple[str, int], LogError]:
        """Look up the topics a request names that are not known yet and open
        its partitions that are not open yet: why those that could not be opened were not."""
        failed: dict[tuple[str, int], LogError] = {}
        for name, partition_data in req[3]:
            if name not in topics:
                topics[name] = await self._topic(hdr, name)
            writable, meta, _ = topics[name]
            for index, _ in partition_data:
                if writable and has_partition(meta, index):
                    try:
                        await self.partitions.partition_log(meta.name, index)
                    except LogError as exc:
                        failed[(name, index)] = exc
        return failed

    def _append(self, hdr: RequestContext, req: ProduceRequest, topics: dict[str, _Topic],
                logs: list[PartitionLog | LogError | None], durable: Acks | None, responses: ProduceAnswer
                ) -> Iterator[None]:
        """Append a request's batches to their logs (_resolve's; under the
        connection's lock), yielding after each partition (the caller may let
        other work run there), and put its answer in `responses`; the
        partitions' of batches appended wait in `durable` (None: acks=0).
        The payloads it does not reach (closed midway, or failed) go back to
        their rings."""
        acks, _, transactional_id, topic_data = req
        i = 0
        try:
            for name, partition_data in topic_data:
                writable, _, limit = topics[name]
                parts: list[list[Any]] = []
                for index, accepted in partition_data:
                    lg = logs[i]
                    i += 1
                    r = [index, 0, -1, -1, None]
                    parts.append(r)
                    payload: Accepted | LogError | None = accepted
                    try:
                        if isinstance(payload, LogError):
                            raise payload
                        if not writable:
                            raise LogError(ErrorCode.TOPIC_AUTHORIZATION_FAILED, f"{hdr.principal} may not write")
                        if acks not in (0, 1, -1):
                            raise LogError(ErrorCode.INVALID_REQUIRED_ACKS, f"acks={acks}")
                        if transactional_id is not None:
                            raise LogError(ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, NO_TRANSACTIONS)
                        if lg is None:
                            raise LogError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"{name}/{index}")
                        if isinstance(lg, LogError):
                            raise lg
                        data, release = payload
                        batches = _native.scan_batches(data)
                        # not any(generator): with PartitionLog.append, 2.5% of a request's instructions
                        for b in batches:
                            if b.size > limit:
                                raise LogError(ErrorCode.MESSAGE_TOO_LARGE,
                                               f"a batch exceeds max.message.bytes={limit}")
                        try:
                            r[_BASE_OFFSET] = lg.append(data, batches,
                                                        None if durable is None else durable.expect(r), release)
                        except BaseException:
                            if durable is not None:
                                durable.forget(r)
                            raise
                        payload = None  # the log releases the payload now
                        r[_LOG_START] = lg.log_start
                    except LogError as exc:
                        r[_ERROR_CODE], r[_ERROR_MESSAGE] = exc.code, str(exc)
                        log.info("produce %s/%s rejected: %s %s", name, index, exc.code.name, exc)
                    finally:
                        if isinstance(payload, tuple):
                            payload[1]()
                    yield
                responses.append((name, parts))
        except BaseException:  # closed midway (GeneratorExit), or failed: what it did not reach goes back to its
            _release(topic_data, i)  # ring (a request appended to its end has nothing left: no call for it)
            raise

    def _start_opening(self, hdr: RequestContext, reqs: list[ProduceRequest]) -> None:
        """Start opening the partitions these requests may write to that are
        not open yet, before they wait for their turn to append: the produces
        a connection sends to partitions not open yet (librdkafka sends one
        request per partition; a first produce to a large topic reaches every
        partition) then open all at once, not one after another behind the
        connection's append order."""
        if self.partitions.closing:  # nothing opens any more
            return
        wanted: dict[str, dict[int, None]] = {}  # each partition once, in the order the requests name them
        for req in reqs:
            for name, partition_data in req[3]:
                wanted.setdefault(name, {}).update((p, None) for p, _ in partition_data)
        for name, parts in wanted.items():
            meta = self.partitions.topics.get(name)
            if meta is None:
                continue
            closed = [p for p in parts if not self.partitions.is_open(meta.name, p)]
            if not closed or not self.access.allowed(hdr, Operation.WRITE, ResourceType.TOPIC, meta.name):
                continue
            for p in closed:
                if has_partition(meta, p):
                    self.partitions.open_soon(meta.name, p)

    async def init_producer_id(self, hdr: RequestContext, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("transactional_id") is not None:
            return {"throttle_time_ms": 0, "error_code": ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        # Kafka's rule (KIP-679): IdempotentWrite on the cluster, or Write on some topic
        if not (self.access.allowed(hdr, Operation.IDEMPOTENT_WRITE, ResourceType.CLUSTER, CLUSTER)
                or self.access.may_write_some_topic(hdr)):
            return {"throttle_time_ms": 0, "error_code": ErrorCode.CLUSTER_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        # Without a transactional id Kafka always allocates a fresh producer id,
        # whatever id and epoch the request carries (a client may send 0/0, or an
        # id another producer holds): two producers must never share one.
        return {"throttle_time_ms": 0, "error_code": 0, "producer_id": await self.meta.next_producer_id(),
                "producer_epoch": 0}
