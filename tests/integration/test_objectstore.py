"""Listings (ListObjectsV2, sent and parsed by the store itself) against the
real SeaweedFS: every page, every key as it was written whatever its
characters, sizes and modification times, and the folders one level down."""
from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY
from kafscale.storage.objectstore import ObjectStore


def test_a_listing_reads_every_page_and_every_key_as_written(stack):
    root = f"listing{random.randrange(1 << 30)}/"
    odd = ["a b", "a+b", "100%", "x&y<z>", "ünïcödé", "q?r=s", "t~u"]
    keys = {f"{root}many/{i:05d}-{odd[i % len(odd)]}": i for i in range(1_100)}  # more than a page of 1,000
    keys |= {f"{root}few/{name}": 1 for name in odd} | {f"{root}top": 3}

    async def run() -> tuple[list[dict], list[str], list[dict]]:
        async with ObjectStore(stack.bucket, stack.s3_endpoint, access_key=DEV_ACCESS_KEY,
                               secret_key=DEV_SECRET_KEY) as store:
            await asyncio.gather(*(store.put(k, b"x" * size) for k, size in keys.items()))
            return await store.list(root), await store.folders(root), await store.list(f"{root}few/")

    before = datetime.now(UTC)
    listed, folders, few = asyncio.run(run())
    assert {o["Key"]: o["Size"] for o in listed} == keys
    assert len(listed) == len(keys), "no key twice"
    assert all(abs((o["LastModified"] - before).total_seconds()) < 120 for o in listed)
    assert folders == [f"{root}few/", f"{root}many/"]
    assert sorted(o["Key"] for o in few) == sorted(f"{root}few/{name}" for name in odd)
