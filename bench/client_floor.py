"""The producer's own share of bench/partitions.py's acknowledgement latency.

bench/partitions.py measures an acknowledgement from librdkafka's
produce() to its delivery report, so every figure includes what the client
itself takes. With many partitions that is not small: librdkafka keeps a
queue, a linger timer and a batch per partition and goes through them from
its broker thread. This bench offers the same load (`bench.partitions.offer`:
acks=all, linger.ms 5 or --client-linger-ms, 1 KiB records, partitions in turn; with --client,
Sarama's or aiokafka's offer of bench.partitions instead) to a Kafka listener
that answers every Produce request at once: `KafkaServer` in a process of
its own, with ApiVersions, a Metadata answer naming one topic of P
partitions led by itself, and each run of Produce requests validated and
staged as a worker stages them (`_native.stage_produce_run`), then answered
as appended. No log process, S3 or etcd is behind it. What the producer
still waits for is its own linger and its own work. That is the floor under
any broker's ack latency at that P, on this machine, with this client.

With --answer-ms D the listener answers each request D ms after it came
instead, as a broker whose node flush takes D ms would: what the client
makes of a broker's latency, with the connection's in-flight limit
(--max-in-flight, max_in_flight_requests) holding back its reading as the
broker's does, and the broker's receive buffer (--receive-buffer,
socket_receive_buffer_bytes) holding what the client sends past it.

For each P: records acknowledged, ack p50/p99 and the p99 as a ratio to the
first P, and the CPU cores of the producer (this process: librdkafka's
threads and the loop offering records; or Sarama's Go process, which it
waits for) and of the listener.

    python -m bench.client_floor [--partitions 1,10000] [--rate 2000] [--seconds 30] [--client sarama]
                                 [--answer-ms 0] [--max-in-flight 1000] [--receive-buffer 102400]
                                 [--send-buffer 0] [--client-linger-ms 5]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
from typing import Any

from bench.e2e import CpuMeter, pct
from bench.listener import staged_answers
from bench.partitions import add_client_arguments, client_offer, sarama_offer
from kafscale import _native
from kafscale.broker.context import RequestContext
from kafscale.broker.server import ConnectionLimits, KafkaServer, RunRespond
from kafscale.config import Config
from kafscale.protocol import schemas
from kafscale.protocol.framing import encode_produce_responses

TOPIC = "bench"
TOPIC_ID = bytes(range(16))


def serve(partitions: int, answer_ms: float, limits: ConnectionLimits, ports: mp.Queue) -> None:
    """A listener that answers every Produce request answer_ms after it came (at once: 0), for a topic of
    `partitions` partitions, under the broker's connection limits (its in-flight limit and receive buffer)."""

    async def main() -> None:
        header, data = bytearray(16), bytearray(1 << 24)
        ring = _native.RingWriter(header, data)
        port = 0

        async def api_versions(_hdr: RequestContext, _req: dict[str, Any]) -> dict[str, Any]:
            return schemas.api_versions_response()

        async def metadata(_hdr: RequestContext, _req: dict[str, Any]) -> dict[str, Any]:
            parts = [{"error_code": 0, "partition_index": p, "leader_id": 0, "leader_epoch": 0,
                      "replica_nodes": [0], "isr_nodes": [0], "offline_replicas": []} for p in range(partitions)]
            return {"throttle_time_ms": 0, "brokers": [{"node_id": 0, "host": "127.0.0.1", "port": port,
                                                         "rack": None}],
                    "cluster_id": "client-floor", "controller_id": 0,
                    "topics": [{"error_code": 0, "name": TOPIC, "topic_id": TOPIC_ID, "is_internal": False,
                                "partitions": parts}]}

        def produce_run(_hdr: RequestContext, frames: memoryview, count: int, respond: RunRespond) -> None:
            answers = encode_produce_responses(staged_answers(frames, count, header, ring))
            if answer_ms:
                asyncio.get_running_loop().call_later(answer_ms / 1000, respond, answers)
            else:
                respond(answers)

        server = KafkaServer({schemas.API_VERSIONS.key: api_versions, schemas.METADATA.key: metadata},
                             "127.0.0.1", 0, limits, produce_run=produce_run)
        await server.start()
        port = server.port
        ports.put(port)
        await asyncio.Event().wait()  # until terminated

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", default="1,10000", help="partition counts, comma-separated")
    ap.add_argument("--rate", type=int, default=2000, help="records a second offered")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--drain", type=float, default=60)
    ap.add_argument("--answer-ms", type=float, default=0.0,
                    help="answer each Produce this long after it came, as a broker whose flush takes that long")
    ap.add_argument("--max-in-flight", type=int, default=Config().max_in_flight_requests,
                    help="the listener's max_in_flight_requests")
    ap.add_argument("--receive-buffer", type=int, default=Config().socket_receive_buffer_bytes,
                    help="the listener's socket_receive_buffer_bytes (-1: the system's)")
    add_client_arguments(ap, "who offers the load")
    args = ap.parse_args()
    offer = client_offer(args.client, args.send_buffer, args.client_linger_ms)
    if args.client == "sarama":
        sarama_offer()  # compiled before any load is measured
    when = f"{args.answer_ms:g} ms after each request" if args.answer_ms else "at once"
    sndbuf = f"{args.send_buffer} B" if args.send_buffer else "the system's"
    print(f"{args.rate} records/s of 1 KiB for {args.seconds:g} s from {args.client}, acks=all, linger "
          f"{args.client_linger_ms} ms, to a listener that answers {when}, {args.max_in_flight} requests in flight "
          f"at most, receive buffer {args.receive_buffer} B, client send buffer {sndbuf} "
          f"(ratio to the first P in brackets)")
    print(f"{'P':>6} {'acked':>13} {'ack p50 ms':>11} {'ack p99 ms':>17} {'producer cores':>15} {'listener cores':>15}")
    first = None
    limits = ConnectionLimits.from_config(Config(max_in_flight_requests=args.max_in_flight,
                                                 socket_receive_buffer_bytes=args.receive_buffer))
    for partitions in [int(p) for p in args.partitions.split(",")]:
        ports: mp.Queue = mp.Queue()
        listener = mp.Process(target=serve, args=(partitions, args.answer_ms, limits, ports), daemon=True)
        listener.start()
        try:
            port = ports.get(timeout=30)
            assert listener.pid is not None
            with CpuMeter({"listener": [listener.pid]}) as cpu:
                offered, acked, _failed, latencies, _ = offer(f"127.0.0.1:{port}", TOPIC, partitions, args.rate,
                                                             args.seconds, args.drain)
        finally:
            listener.terminate()
            listener.join()
        p50, p99 = pct(latencies, 0.5) * 1000, pct(latencies, 0.99) * 1000
        first = first or p99
        print(f"{partitions:>6} {f'{acked}/{offered}':>13} {p50:>11.1f} {f'{p99:.1f} ({p99 / first:.2f})':>17} "
              f"{cpu.cores['bench client']:>15.2f} {cpu.cores['listener']:>15.2f}")


if __name__ == "__main__":
    main()
