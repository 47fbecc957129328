"""Pipelined OffsetCommits: a librdkafka consumer that commits asynchronously
after every message sends its commits back to back on one connection.

One broker against a real etcd and SeaweedFS. First --sync synchronous
commits, one at a time (the baseline: what a commit costs alone), then --n
asynchronous ones sent back to back, each of the offsets of --partitions
partitions, timed until the client has every answer. Printed per round: the
pipelined commits' time per commit as a ratio to a synchronous commit's
median, and the etcd transactions they cost (counted by etcd's own
/metrics; other writes of the idle broker count too) per commit.

    python -m bench.commits [--n 2000] [--sync 200] [--partitions 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from bench.e2e import ready_broker, stack_dirs
from kafscale.devstack import DevStack


def one_round(stack: DevStack, bootstrap: str, topic: str, partitions: int, n: int, sync: int) -> str:
    answered: list[float] = []
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "on_commit": lambda err, _: answered.append(time.perf_counter())})
    try:
        def offsets(i: int) -> list[TopicPartition]:
            return [TopicPartition(topic, p, i) for p in range(partitions)]

        took = []
        for i in range(sync):
            t = time.perf_counter()
            c.commit(offsets=offsets(i), asynchronous=False)
            took.append(time.perf_counter() - t)
        c.poll(0)  # the synchronous commits' callbacks
        answered.clear()
        txns = stack.server_counts()["txns"]
        t0 = time.perf_counter()
        for i in range(n):
            c.commit(offsets=offsets(sync + i), asynchronous=True)
        while len(answered) < n and time.perf_counter() - t0 < 300:
            c.poll(0.05)
        txns = stack.server_counts()["txns"] - txns
        if len(answered) < n:
            return f"only {len(answered)} of {n} commits answered in 300 s"
        per = (answered[-1] - t0) / n
        one = statistics.median(took)
        return (f"pipelined {per * 1e3:.2f} ms a commit, synchronous median {one * 1e3:.2f} ms: "
                f"ratio {per / one:.3f}; etcd transactions {txns:.0f} ({txns / n:.3f} a commit)")
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="asynchronous commits sent back to back")
    ap.add_argument("--sync", type=int, default=200, help="synchronous commits before them (the baseline)")
    ap.add_argument("--partitions", type=int, default=1, help="partitions each commit names")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with stack_dirs(False) as (tmp, s3_dir):
        stack = DevStack(data_dir=tmp, s3_dir=s3_dir).start()
        cluster = f"c{uuid.uuid4().hex[:8]}"
        topic = "commits"
        proc, bootstrap = ready_broker(stack, Path(tmp), cluster, (topic,), args.partitions)
        try:
            for r in range(args.rounds):
                print(f"round {r + 1}: {one_round(stack, bootstrap, topic, args.partitions, args.n, args.sync)}",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
            stack.stop()


if __name__ == "__main__":
    main()
