"""The listener's CPU per Produce request, without S3, etcd or a log process.

A worker's Kafka listener (`KafkaServer` with a Produce run handler that
validates and copies each payload into a ring, as a worker stages a run of
them (`_native.stage_produce_run`), and answers every
5 ms in one go, as a node flush acknowledges) in a process of its own, with
the garbage collector set as a broker sets it. A client sends one-partition
Produce requests of one 1 KiB record (as librdkafka does with many
partitions: a request per partition batch), 300 in flight, over one
connection. Printed: the server's CPU time (user + system, getrusage) per
request over --requests requests after as many to warm up, for --runs runs.

    python -m bench.listener --requests 40000 --runs 5

The figure is the listener's own cost per request, the part of a worker's
cost that does not depend on the log process; compare commits by running
this at each, alternately, on the same machine.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import resource
import socket
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from kafscale import _native, metrics
from kafscale.broker.context import RequestContext
from kafscale.broker.messages import RejectedPayload
from kafscale.broker.server import ConnectionLimits, KafkaServer, RunRespond
from kafscale.broker.supervisor import GC_THRESHOLDS
from kafscale.config import Config
from kafscale.protocol import schemas
from kafscale.protocol.framing import encode_produce_responses, encode_request

IN_FLIGHT = 300
PARTITIONS = 100
ACK_EVERY_S = 0.005


def cpu_s() -> float:
    """This process's CPU seconds (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def staged_answers(frames: memoryview, count: int, header: bytearray, ring: _native.RingWriter
                   ) -> list[tuple[int, int, dict[str, Any]]]:
    """A run of Produce requests validated and staged in the ring as a worker
    stages them (the ring reused from its start: nothing is kept), and every
    partition of them answered as appended: the bodies encode_produce_responses frames."""
    header[:8] = bytes(8)
    requests, _, _ = _native.stage_produce_run(frames, count, schemas.PRODUCE.request.flexible_min, ring, 0,
                                               True, 1 << 20, RejectedPayload)
    return [(correlation_id, version, {"throttle_time_ms": 0, "responses": [
        {"name": name, "partition_responses": [
            {"index": index, "error_code": 0, "base_offset": 1, "log_append_time_ms": -1,
             "log_start_offset": 0, "record_errors": [], "error_message": None}
            for index, _ in parts]} for name, parts in topics]})
        for correlation_id, version, *_, topics in requests]


def serve(ports: mp.Queue, marks: mp.Queue, readings: mp.Queue) -> None:
    """Run the listener until told to stop, answering each mark with the process's CPU seconds."""
    metrics.init_process(1, "worker-0", tempfile.mkdtemp(prefix="kafscale-bench-metrics-"))
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        header, data = bytearray(16), bytearray(1 << 22)
        ring = _native.RingWriter(header, data)
        unanswered: list[tuple[RunRespond, list[tuple[int, int, dict[str, Any]]]]] = []

        def acknowledge() -> None:
            answers, unanswered[:] = list(unanswered), []
            for respond, bodies in answers:
                respond(encode_produce_responses(bodies))

        def produce_run(hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond) -> None:
            bodies = staged_answers(frames, count, header, ring)
            if not unanswered:
                loop.call_later(ACK_EVERY_S, acknowledge)
            unanswered.append((respond, bodies))

        server = KafkaServer({}, "127.0.0.1", 0, ConnectionLimits.from_config(Config()),
                             produce_run=produce_run)
        await server.start()
        ports.put(server.port)
        while await loop.run_in_executor(None, marks.get) != "stop":
            readings.put(cpu_s())
        await server.close()

    asyncio.run(main())


def send(port: int, requests: int) -> None:
    """Send `requests` Produce requests, IN_FLIGHT at most unanswered, and read every response."""
    batch = _native.build_batch([(1_700_000_000_000, b"k", b"x" * 1024, [])])
    frames = b"".join(bytes(encode_request(schemas.PRODUCE.key, 9, p, {
        "transactional_id": None, "acks": -1, "timeout_ms": 30000,
        "topic_data": [{"name": "bench", "partition_data": [{"index": p, "records": batch}]}]}, "bench"))
        for p in range(PARTITIONS))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = answered = received = 0
        response_size = 0
        while answered < requests:
            while sent < requests and sent - answered < IN_FLIGHT:
                s.sendall(frames)
                sent += PARTITIONS
            data = s.recv(1 << 20)
            if not data:
                raise ConnectionError("the listener closed the connection")
            response_size = response_size or 4 + int.from_bytes(data[:4], "big")  # all responses are this long
            received += len(data)
            answered = received // response_size


def per_request_runs(doc: str, one_run: Callable[..., float], what: str,
                     options: dict[str, tuple[int, str]] | None = None) -> None:
    """A per-request bench's command line (--requests, --runs, and its own
    integer options: name -> default, help): one_run(requests, **options)
    (µs of CPU per request) --runs times, each printed, then their median."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--runs", type=int, default=5)
    for name, (default, what_it_is) in (options or {}).items():
        ap.add_argument(f"--{name}", type=int, default=default, help=what_it_is)
    args = ap.parse_args()
    own = {name: getattr(args, name) for name in options or {}}
    per_request = []
    for _ in range(args.runs):
        per_request.append(one_run(args.requests, **own))
        print(f"{what} CPU per Produce request: {per_request[-1]:.1f} µs")
    print(f"median of {args.runs} runs: {statistics.median(per_request):.1f} µs")


def one_run(requests: int) -> float:
    """The listener's CPU per request (µs) in a fresh server process, after as many requests to warm up."""
    ports: mp.Queue = mp.Queue()
    marks: mp.Queue = mp.Queue()
    readings: mp.Queue = mp.Queue()
    server = mp.Process(target=serve, args=(ports, marks, readings))
    server.start()
    port = ports.get()
    send(port, requests)  # warm-up
    marks.put("start")
    start = readings.get()
    send(port, requests)
    marks.put("end")
    end = readings.get()
    marks.put("stop")
    server.join()
    return (end - start) / requests * 1e6


def main() -> None:
    per_request_runs(__doc__, one_run, "listener")


if __name__ == "__main__":
    main()
