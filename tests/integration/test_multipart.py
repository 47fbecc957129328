"""Multipart segment uploads against the real SeaweedFS, seen through a
proxy that records every request: parts go up concurrently (never more than
the configured number at once), a background write's parts one at a time, the
object reads back byte for byte, the write-once condition holds for multipart
too, and a broker whose segments are above the threshold serves them back
after a restart (from S3)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from kafscale.devstack import DEV_ACCESS_KEY, DEV_SECRET_KEY
from kafscale.storage.objectstore import MIN_PART, ObjectExists, ObjectStore
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic
from tests.integration.s3log import S3RequestLog
from tests.integration.test_groups import wait_for


@pytest.fixture
def s3log(stack) -> Iterator[S3RequestLog]:
    log = S3RequestLog(stack.s3_port)
    yield log
    log.close()


def test_parts_upload_concurrently_and_the_object_reads_back(stack, s3log):
    data = os.urandom(5 * MIN_PART + 12345)  # 6 parts, the last one short
    key = f"multipart-test/{os.urandom(4).hex()}.kfs"

    async def run() -> tuple[bytes, bool]:
        store = ObjectStore(stack.bucket, s3log.url, access_key=DEV_ACCESS_KEY, secret_key=DEV_SECRET_KEY,
                            multipart_threshold=MIN_PART, part_size=MIN_PART, part_concurrency=3)
        async with store:
            await store.put(key, data)
            back = await store.get(key)
            try:
                await store.put(key, data)  # segments are written once, multipart included
                refused = False
            except ObjectExists:
                refused = True
            await store.delete(key)
        return back, refused

    s3log.delay = 0.3  # a slow store: parts that can overlap do
    back, refused = asyncio.run(run())
    assert back == data
    assert refused
    parts = [t for m, t, _, _ in s3log.timeline if m == "PUT" and "partNumber=" in t]
    assert len(parts) == 12  # 6 parts, twice (the refused second upload sends its parts before completing)
    assert s3log.most_at_once("PUT", "partNumber=") == 3
    assert [m for m, t, _, _ in s3log.timeline if "uploadId=" in t and m == "POST"] == ["POST", "POST"]


def test_a_background_write_sends_parts_of_at_least_min_part_one_at_a_time(stack, s3log):
    data = os.urandom(3 * MIN_PART + 12345)  # below the threshold: a foreground write would be one PUT
    key = f"multipart-test/{os.urandom(4).hex()}.kfs"

    async def run() -> bytes:
        async with ObjectStore(stack.bucket, s3log.url, access_key=DEV_ACCESS_KEY,
                               secret_key=DEV_SECRET_KEY) as store:
            await store.put(key, data, background=True)
            back = await store.get(key)
            await store.delete(key)
        return back

    s3log.delay = 0.3  # parts that could overlap would
    assert asyncio.run(run()) == data
    parts = [t for m, t, _, _ in s3log.timeline if m == "PUT" and "partNumber=" in t]
    assert len(parts) == 3  # the short rest shared out, no part below S3's minimum
    assert s3log.most_at_once("PUT", "partNumber=") == 1


def test_a_broker_uploads_large_segments_in_parts_and_reads_them_back(make_broker, topic_name, s3log):
    """The node object of a flush, then the segment it is compacted into, both above the threshold."""
    broker = make_broker(s3_endpoint=s3log.url, multipart_threshold=MIN_PART, linger_ms=3000,
                         segment_bytes=64 << 20, flush_bytes=64 << 20, compaction_lag_ms=500)
    create_topic(broker.bootstrap, topic_name)
    recs = [Rec(b"k%d" % i, os.urandom(16 << 10), ()) for i in range(800)]  # 12.5 MiB: one flush, one segment
    assert confluent_produce(broker.bootstrap, topic_name, recs, **{"linger.ms": 50}) == list(range(800))

    def uploaded_in_parts(suffix: str) -> bool:
        return any(t.split("?")[0].endswith(suffix) for m, t, _, _ in s3log.timeline
                   if m == "PUT" and "partNumber=" in t)

    assert uploaded_in_parts(".kfn"), s3log.timeline
    wait_for(lambda: uploaded_in_parts(".kfs"), 30, "the compacted segment's upload")
    assert s3log.most_at_once("PUT", ".kfs?") == 1  # its parts: a compaction is a background write
    broker.stop()
    broker.start()  # a fresh cache: the records come back from S3
    got = confluent_consume(broker.bootstrap, topic_name, len(recs))
    assert [(o, r.key, r.value) for o, r in got] == [(i, r.key, r.value) for i, r in enumerate(recs)]
