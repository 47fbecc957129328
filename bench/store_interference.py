"""How a large upload slows the small PUTs beside it, against one real SeaweedFS.

Node flushes acknowledge producers after small PUTs (a few KiB to a few
MiB); compactions upload segments of up to segment.bytes (16 MiB) to the same
store meanwhile. For --seconds, 13 KiB PUTs start every 6.6 ms (150/s, what a
node flush does at 2,000 records/s on one partition) while every 4 s one
16 MiB object is written: not at all (the baseline), as one PUT (how
compactions wrote before), and as a background write (ObjectStore.put with
background=True: parts of about 5 MiB, one at a time, as compactions write
now). Printed per mode: the small PUTs' latency p50/p99/max and each large
upload's duration, with the p99 as a ratio to the baseline's.

    python -m bench.store_interference [--seconds 20]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bench.e2e import pct
from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY, DevStack
from kafscale.storage.objectstore import ObjectStore

SMALL, LARGE = 13 * 1024, 16_700_000  # a node object of 2,000 records/s at P = 1; a compacted segment
SMALL_GAP_S, LARGE_EVERY_S = 1 / 150, 4.0


async def run(stack: DevStack, mode: str, seconds: float) -> tuple[list[float], list[float]]:
    """(sorted small PUT latencies, large upload durations) of one mode."""
    small, large = os.urandom(SMALL), bytearray(os.urandom(LARGE))
    lat: list[float] = []
    took: list[float] = []
    async with ObjectStore(stack.bucket, stack.s3_endpoint, access_key=DEV_ACCESS_KEY,
                           secret_key=DEV_SECRET_KEY) as store:
        async def large_loop() -> None:
            for n in range(1_000_000):
                await asyncio.sleep(LARGE_EVERY_S)
                t = time.perf_counter()
                await store.put(f"interference/{mode}/large-{n}", large, background=mode == "background")
                took.append(time.perf_counter() - t)

        async def put_small(n: int) -> None:
            t = time.perf_counter()
            await store.put(f"interference/{mode}/small-{n}", small)
            lat.append(time.perf_counter() - t)

        writer = asyncio.create_task(large_loop()) if mode != "none" else None
        tasks = []
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            tasks.append(asyncio.create_task(put_small(n)))
            n += 1
            await asyncio.sleep(SMALL_GAP_S)
        if writer is not None:
            writer.cancel()
        await asyncio.gather(*tasks)
        await store.delete_prefix(f"interference/{mode}/")
    return sorted(lat), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20, help="how long each mode runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kafscale-bench-") as tmp:
        stack = DevStack(data_dir=tmp, volume_mib=8192).start()
        try:
            results = {mode: asyncio.run(run(stack, mode, args.seconds)) for mode in ("none", "single", "background")}
        finally:
            stack.stop()
    base = pct(results["none"][0], 0.99)
    print(f"13 KiB PUTs at 150/s; a 16 MiB upload every {LARGE_EVERY_S:.0f} s (ratio to no large upload)")
    for mode, (lat, took) in results.items():
        print(f"{mode:>10}: small PUT p50 {pct(lat, 0.5) * 1000:5.1f} ms  p99 {pct(lat, 0.99) * 1000:5.1f} ms "
              f"({pct(lat, 0.99) / base:.2f})  max {lat[-1] * 1000:6.1f} ms   large uploads "
              + " ".join(f"{t * 1000:.0f}" for t in took) + " ms")


if __name__ == "__main__":
    main()
