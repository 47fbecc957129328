"""One consumer-group member in its own process, so tests can SIGKILL it.

    python -m tests.integration.group_member LIB BOOTSTRAP GROUP TOPIC OUTFILE [STRATEGY]

Consumes with LIB (confluent, kafka-python, aiokafka), and after processing
each polled batch appends "partition offset" lines to OUTFILE and only then
commits them (at-least-once). Every assignment it receives is appended as
"assigned p,p,...". Runs until killed or sent SIGTERM."""
from __future__ import annotations

import asyncio
import signal
import sys
import time

SESSION_MS = 6000


def record(out, rows: list[tuple[int, int]]) -> None:
    out.write("".join(f"{p} {o}\n" for p, o in rows))
    out.flush()


def commit_or_carry_on(commit) -> None:
    """A failed commit (coordinator moving, rebalance) only means redelivery later."""
    try:
        commit()
    except Exception as exc:
        print(f"commit failed, carrying on: {exc}", file=sys.stderr, flush=True)


def run_confluent(bootstrap: str, group: str, topic: str, out, strategy: str, stop) -> None:
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "session.timeout.ms": SESSION_MS,
                  "heartbeat.interval.ms": 500, "partition.assignment.strategy": strategy})

    def on_assign(consumer, parts) -> None:
        out.write("assigned " + ",".join(str(p.partition) for p in parts) + "\n")
        out.flush()

    c.subscribe([topic], on_assign=on_assign)
    while not stop():
        msgs = c.consume(50, 0.2)
        rows = [(m.partition(), m.offset()) for m in msgs if m.error() is None]
        if rows:
            time.sleep(0.02)  # "processing"
            record(out, rows)
            commit_or_carry_on(lambda: c.commit(asynchronous=False))
    c.close()


def run_kafka_python(bootstrap: str, group: str, topic: str, out, strategy: str, stop) -> None:
    from kafka import KafkaConsumer
    from kafka.coordinator.assignors.range import RangePartitionAssignor
    from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

    assignor = RoundRobinPartitionAssignor if strategy == "roundrobin" else RangePartitionAssignor
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                      auto_offset_reset="earliest", session_timeout_ms=SESSION_MS, heartbeat_interval_ms=500,
                      partition_assignment_strategy=[assignor], max_poll_records=50)
    while not stop():
        batch = c.poll(timeout_ms=200)
        rows = [(m.partition, m.offset) for msgs in batch.values() for m in msgs]
        if rows:
            time.sleep(0.02)
            record(out, rows)
            commit_or_carry_on(c.commit)
    c.close()


async def run_aiokafka(bootstrap: str, group: str, topic: str, out, strategy: str, stop) -> None:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor
    from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

    assignor = RoundRobinPartitionAssignor if strategy == "roundrobin" else RangePartitionAssignor
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                         auto_offset_reset="earliest", session_timeout_ms=SESSION_MS, heartbeat_interval_ms=500,
                         partition_assignment_strategy=[assignor], max_poll_records=50)
    await c.start()
    try:
        while not stop():
            batch = await c.getmany(timeout_ms=200)
            rows = [(m.partition, m.offset) for msgs in batch.values() for m in msgs]
            if rows:
                await asyncio.sleep(0.02)
                record(out, rows)
                try:
                    await c.commit()
                except Exception as exc:
                    print(f"commit failed, carrying on: {exc}", file=sys.stderr, flush=True)
    finally:
        await c.stop()


def main() -> None:
    lib, bootstrap, group, topic, path = sys.argv[1:6]
    strategy = sys.argv[6] if len(sys.argv) > 6 else "range"
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    with open(path, "a") as out:
        if lib == "confluent":
            run_confluent(bootstrap, group, topic, out, strategy, lambda: bool(stopping))
        elif lib == "kafka-python":
            run_kafka_python(bootstrap, group, topic, out, strategy, lambda: bool(stopping))
        else:
            asyncio.run(run_aiokafka(bootstrap, group, topic, out, strategy, lambda: bool(stopping)))


if __name__ == "__main__":
    main()
