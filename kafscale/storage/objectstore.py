"""S3-compatible object store: writes and listings with aioboto3, reads with
botocore's blocking client in a thread pool.

Segments are written once: every PUT (and multipart completion) sends
`If-None-Match: *`, so nothing can overwrite an existing segment object.
Objects above `multipart_threshold` are uploaded in parts, concurrently.

Reads run in threads because a thread reads a GET's body with a few large
`recv_into` calls outside the GIL, where aiohttp wakes the event loop for
every 64-256 KiB and copies the chunks once more to join them. A protocol
worker's loop also writes the Fetch responses that the reads are for; taking
the reads off it made cold catch-up about 15% faster (bench/README.md)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import Any

import aioboto3
import botocore.session
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from kafscale import metrics
from kafscale.config import Config

log = logging.getLogger(__name__)

MIN_PART = 5 * 1024 * 1024
READ_THREADS = 16  # GETs in flight at once per store (each process has one store)


def _boto_config(pool: int, attempts: int) -> BotoConfig:
    """The settings of every S3 client, blocking or asyncio."""
    return BotoConfig(max_pool_connections=pool, retries={"max_attempts": attempts, "mode": "standard"},
                      s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=10)


def sync_client(endpoint: str | None, region: str | None, access_key: str | None, secret_key: str | None,
                pool: int = 10, attempts: int = 3) -> Any:
    """A blocking botocore S3 client (thread-safe); credentials left empty come
    from the AWS default chain."""
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=region or "us-east-1", aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=_boto_config(pool, attempts))


class ObjectExists(Exception):
    """A conditional PUT found an object already at that key."""


class ObjectStore:
    def __init__(self, bucket: str, endpoint: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 multipart_threshold: int = 16 * 1024 * 1024, part_size: int = 8 * 1024 * 1024,
                 part_concurrency: int = 4) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        self._region = region
        self._credentials = (access_key, secret_key)
        self.multipart_threshold = multipart_threshold
        self.part_size = max(part_size, MIN_PART)
        self.part_concurrency = part_concurrency
        self._session = aioboto3.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                         region_name=region or "us-east-1")
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._reader: Any = None  # the blocking client GETs use, in _read_pool's threads
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> ObjectStore:
        """The store a broker, worker or tool uses (empty settings: AWS defaults)."""
        return cls(cfg.bucket, cfg.s3_endpoint or None, cfg.s3_region, cfg.s3_access_key or None,
                   cfg.s3_secret_key or None, multipart_threshold=cfg.multipart_threshold)

    async def start(self) -> None:
        self._client = await self._stack.enter_async_context(
            self._session.client("s3", endpoint_url=self.endpoint, config=_boto_config(64, 3)))
        self._reader = sync_client(self.endpoint, self._region, *self._credentials, pool=READ_THREADS)
        self._read_pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="s3-get")

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None
        if self._read_pool is not None:
            # a GET still running finishes in its thread; its caller has gone
            self._read_pool.shutdown(wait=False, cancel_futures=True)
            self._reader.close()
            self._read_pool = self._reader = None

    async def __aenter__(self) -> ObjectStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- bucket
    async def ensure_bucket(self) -> None:
        try:
            await self._client.head_bucket(Bucket=self.bucket)
        except ClientError:
            await self._client.create_bucket(Bucket=self.bucket)

    async def ping(self) -> None:
        """One cheap request: raises unless the bucket answers."""
        with metrics.s3_call("head"):
            await self._client.head_bucket(Bucket=self.bucket)

    async def check_writable(self) -> None:
        """Fail fast if the bucket cannot be written and read back."""
        key = "_kafscale/healthcheck"
        await self._client.put_object(Bucket=self.bucket, Key=key, Body=b"ok")
        await self.get(key)

    # ---------------------------------------------------------------- write
    async def put(self, key: str, data: bytes | bytearray | memoryview, if_none_match: bool = True) -> None:
        """Write an object once. Raises ObjectExists if the key is taken."""
        try:
            with metrics.s3_call("put"):
                if len(data) > self.multipart_threshold:
                    await self._put_multipart(key, data, if_none_match)
                else:
                    extra = {"IfNoneMatch": "*"} if if_none_match else {}
                    await self._client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data), **extra)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise ObjectExists(key) from exc
            raise

    async def _put_multipart(self, key: str, data: bytes | bytearray | memoryview, if_none_match: bool) -> None:
        mv = memoryview(data)
        up = await self._client.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload_id = up["UploadId"]
        sem = asyncio.Semaphore(self.part_concurrency)

        async def part(n: int, start: int) -> dict[str, Any]:
            async with sem:
                r = await self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                                   Body=bytes(mv[start:start + self.part_size]))
                return {"PartNumber": n, "ETag": r["ETag"]}

        try:
            parts = await asyncio.gather(*(part(i + 1, off) for i, off in
                                           enumerate(range(0, len(mv), self.part_size))))
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            await self._client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                         MultipartUpload={"Parts": list(parts)}, **extra)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    # ---------------------------------------------------------------- read
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or the byte range [start, end) of it."""
        extra = {}
        if start is not None:
            extra["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))

        def read() -> bytes:
            return self._reader.get_object(Bucket=self.bucket, Key=key, **extra)["Body"].read()

        with metrics.s3_call("get"):
            return await asyncio.get_running_loop().run_in_executor(self._read_pool, read)

    async def size(self, key: str) -> int:
        return (await self._client.head_object(Bucket=self.bucket, Key=key))["ContentLength"]

    async def list(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        paginator = self._client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            out.extend(page.get("Contents", []))
        return out

    async def delete(self, key: str) -> None:
        await self._client.delete_object(Bucket=self.bucket, Key=key)

    async def delete_prefix(self, prefix: str) -> int:
        keys = [o["Key"] for o in await self.list(prefix)]
        for i in range(0, len(keys), 1000):
            chunk = keys[i:i + 1000]
            await self._client.delete_objects(Bucket=self.bucket,
                                              Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
        return len(keys)
