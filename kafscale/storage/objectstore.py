"""S3-compatible object store: bodies (GETs, PUTs above SMALL_PUT_BYTES,
parts) and listings move in a thread pool, small PUTs go from the event
loop; deletes and the multipart bookkeeping use aioboto3.

Segments are written once: every PUT (and multipart completion) sends
`If-None-Match: *`, so nothing can overwrite an existing segment object.
Objects above `multipart_threshold` are uploaded in parts, concurrently.
A single PUT carries the object's CRC32C, computed natively (about 14 GB/s
here); S3 rejects the PUT if the bytes it received differ, and no other
checksum pass is made over the body except over plain HTTP to another host,
where the body's SHA-256 is signed (signs_payload).

Parts go through botocore's blocking client. Single PUTs and GETs do not:
they are signed with S3's SigV4 (`_SigV4`: what botocore's S3 signer adds,
at a tenth of its CPU) and sent on a keep-alive
connection of the standard library's HTTP client, one per thread (on
botocore's urllib3 session where a proxy is configured), which skips the
client's per-call work (parameter validation and serialization, endpoint
rules, event hooks, user agent, response parsing) and urllib3's pool, retry
and response layers, and reads a GET's body in one call (`_Direct`). Client
CPU against SeaweedFS: an 18 KiB PUT 0.9 ms (1.7 on urllib3, 2.5 through the
client for 1 KiB), an 18 KiB GET 0.7 (1.5), a 1 MiB GET 1.1 (2.3; 3.0-3.5
through the client). Listings
(ListObjectsV2) go the same way and are parsed with the standard library's C
XML parser: botocore's parser (every LastModified through dateutil) took a
tenth of the log process's time while it reopened 10,000 partitions.

A single PUT of up to SMALL_PUT_BYTES is not sent from a thread but from
the event loop (`_LoopPuts`), signed and retried the same way: the trip
through the pool and back cost about as much CPU as the rest of a small
PUT. Larger bodies go through threads because a thread sends or receives
a body with a few large socket calls outside the GIL. aiohttp, on Python
3.11, copies a PUT body three or four times on the event loop and reads a
GET in 64-256 KiB chunks that wake the loop and are copied again to be
joined; SeaweedFS also spends more CPU per byte on its smaller writes.
Measured on the bench machine (four 14 MiB PUTs in flight): 120 MiB/s
with aiohttp against 155 MiB/s with threads, at 2.0 against 1.4 client
CPU-seconds per GiB; for reads, taking GETs off a protocol worker's loop
made cold catch-up about 15% faster (bench/history.md)."""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote_plus, urlencode, urlsplit
from xml.etree import ElementTree

import aioboto3
import botocore.session
import urllib3
from botocore.awsrequest import AWSRequest
from botocore.config import Config as BotoConfig
from botocore.credentials import Credentials
from botocore.exceptions import ClientError, HTTPClientError, NoCredentialsError
from botocore.httpsession import URLLib3Session
from botocore.utils import get_environ_proxies

from kafscale import _native, metrics
from kafscale.config import Config

log = logging.getLogger(__name__)

MIN_PART = 5 * 1024 * 1024
BODY_THREADS = 16  # GETs, PUTs and parts in flight at once per store (each process has one store)
SMALL_PUT_BYTES = 256 << 10  # single PUTs up to this size are sent from the event loop (_LoopPuts)


ATTEMPTS = 3  # of every S3 request (the clients' standard retry mode, and _Direct)
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 5, 10


def signs_payload(endpoint: str | None) -> bool:
    """Whether a PUT's body is hashed into its SigV4 signature. The body's
    checksum (CRC32C on a single PUT, botocore's on a part) already makes S3
    refuse bytes that changed on the way; a signed hash also stops someone
    between the broker and S3 from changing them, which TLS does on https
    and nobody can on this machine's loopback. So only plain HTTP to another
    host pays for a SHA-256 pass over every body written (the AWS SDKs sign
    every payload sent over plain HTTP), and for the store's check of it."""
    url = urlsplit(endpoint or "https://")
    if url.scheme == "https" or url.hostname == "localhost":
        return False
    try:
        return not ipaddress.ip_address(url.hostname or "").is_loopback
    except ValueError:  # a host name
        return True


def _boto_config(endpoint: str | None, pool: int, attempts: int) -> BotoConfig:
    """The settings of every S3 client, blocking or asyncio."""
    return BotoConfig(max_pool_connections=pool, retries={"max_attempts": attempts, "mode": "standard"},
                      s3={"addressing_style": "path", "payload_signing_enabled": signs_payload(endpoint)},
                      connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S)


# S3's endpoint ruleset declares these parameters but no rule reads them; botocore
# caches resolved endpoints by their parameters, so with them every new key
# re-evaluated the whole ruleset (botocore issue #3528, fixed upstream in PR
# #3692 by dropping the same three).
UNUSED_ENDPOINT_PARAMS = ("Key", "Prefix", "CopySource")


def _cache_endpoints(client: Any) -> Any:
    """Let the client's endpoint cache hit for every key of a bucket."""
    resolver = getattr(client, "_ruleset_resolver", None)
    params = getattr(resolver, "_param_definitions", None)
    if isinstance(params, dict):
        for name in UNUSED_ENDPOINT_PARAMS:
            params.pop(name, None)
    return client


def sync_client(endpoint: str | None, region: str | None, access_key: str | None, secret_key: str | None,
                pool: int = 10, attempts: int = ATTEMPTS) -> Any:
    """A blocking botocore S3 client (thread-safe); credentials left empty come
    from the AWS default chain."""
    return _cache_endpoints(botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=region or "us-east-1", aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=_boto_config(endpoint, pool, attempts)))


class ObjectExists(Exception):
    """A conditional PUT found an object already at that key."""


class RequestFailed(Exception):
    """S3 refused a request (its status and the start of its answer)."""


def done(method: str, key: str, status: int, answer: bytes, attempt: int) -> bool:
    """Whether attempt `attempt` of a request succeeded (False: try again);
    ObjectExists or RequestFailed when it failed for good."""
    if status in (200, 206):
        return True
    if status == 412:
        raise ObjectExists(key)
    if attempt == ATTEMPTS or not (status == 429 or status >= 500):
        raise RequestFailed(f"{method} {key}: HTTP {status} {answer[:300]!r}")
    return False


UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _amz_date() -> str:
    """Now, as SigV4 stamps a request."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


class _SigV4:
    """S3's SigV4 header signature of _Direct's requests: the headers
    botocore's S3SigV4Auth adds, with the same values (a unit test compares
    them), at about a tenth of its CPU. botocore's signer builds an
    email.message header map twice, parses the URL and derives the day's
    signing key (four HMACs) again for every request: about 190 µs here, a
    fifth of a small PUT's CPU in the log process. Credentials are read at
    each signature, so those of the default chain that refresh keep doing so."""

    def __init__(self, credentials: Credentials | None, region: str) -> None:
        self.credentials = credentials
        self.region = region
        self._key: tuple[str, str, bytes] = ("", "", b"")  # secret key, day, that day's signing key

    def sign(self, method: str, target: str, headers: dict[str, str], payload_hash: str) -> None:
        """Add X-Amz-Date, X-Amz-Content-SHA256, X-Amz-Security-Token (with a
        session token) and Authorization to the headers (Host among them) of a
        request for target (path and query string, both URL-encoded)."""
        if self.credentials is None:
            raise NoCredentialsError()
        frozen = self.credentials.get_frozen_credentials()
        access_key, secret_key, token = frozen.access_key, frozen.secret_key, frozen.token
        stamp = _amz_date()
        headers["X-Amz-Date"], headers["X-Amz-Content-SHA256"] = stamp, payload_hash
        if token:
            headers["X-Amz-Security-Token"] = token
        path, _, query = target.partition("?")
        if query:
            query = "&".join(f"{k}={v}" for k, _, v in sorted(pair.partition("=") for pair in query.split("&")))
        fields = sorted((k.lower(), " ".join(v.split())) for k, v in headers.items())
        names = ";".join(k for k, _ in fields)
        canonical = "\n".join((method, path, query, *(f"{k}:{v}" for k, v in fields), "", names, payload_hash))
        day = stamp[:8]
        scope = f"{day}/{self.region}/s3/aws4_request"
        if self._key[:2] != (secret_key, day):
            key = f"AWS4{secret_key}".encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.digest(key, part.encode(), "sha256")
            self._key = (secret_key, day, key)
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key[2], to_sign.encode(), "sha256").hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={names}, "
                                    f"Signature={signature}")


class _Direct:
    """Single PUTs and GETs (blocking, thread-safe) signed with S3's SigV4
    (_SigV4) and sent on a keep-alive connection of the standard library's
    HTTP client (botocore's HTTP session through a proxy), with path-style
    addressing like the clients; retried like the clients' standard mode
    (ATTEMPTS) on connection errors, 429 and 5xx."""
    BACKOFF_S = 0.1

    def __init__(self, bucket: str, endpoint: str | None, region: str, access_key: str | None,
                 secret_key: str | None, pool: int) -> None:
        self.base = f"{(endpoint or f'https://s3.{region}.amazonaws.com').rstrip('/')}/{quote(bucket)}/"
        credentials = (Credentials(access_key, secret_key) if access_key and secret_key
                       else botocore.session.get_session().get_credentials())  # the default chain
        self.signer = _SigV4(credentials, region)
        self.sign_payload = signs_payload(endpoint)
        # as botocore's clients: CA bundle and proxies from the environment, no Nagle delay
        proxies = get_environ_proxies(self.base)
        self.http = URLLib3Session(verify=os.environ.get("AWS_CA_BUNDLE") or True,
                                   timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S), proxies=proxies,
                                   max_pool_connections=pool,
                                   socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]) if proxies else None
        # without a proxy, each thread keeps one connection of the standard library's HTTP client:
        # urllib3's pool, retry and response layers cost 0.8 ms of CPU per 18 KiB PUT (of 1.8)
        url = urlsplit(self.base)
        self._netloc, self.tls, self._path = url.netloc, url.scheme == "https", url.path
        self._origin = f"{url.scheme}://{url.netloc}"
        default_port = 443 if self.tls else 80
        self.addr = url.hostname or "", url.port or default_port  # where a connection goes
        host = f"[{self.addr[0]}]" if ":" in self.addr[0] else self.addr[0]  # an IPv6 address in brackets
        self.host = host if self.addr[1] == default_port else f"{host}:{self.addr[1]}"  # signed as sent
        self.tls_context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE")) if self.tls else None
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []

    @staticmethod
    def put_headers(crc32c: str, if_none_match: bool) -> dict[str, str]:
        """A single PUT's headers."""
        return {"x-amz-checksum-crc32c": crc32c, **({"If-None-Match": "*"} if if_none_match else {})}

    def put(self, key: str, body: bytes | bytearray, crc32c: str, if_none_match: bool) -> None:
        """Raises ObjectExists if if_none_match and the key is taken."""
        self._send("PUT", key, self.put_headers(crc32c, if_none_match), body)

    def get(self, key: str, byte_range: str | None) -> bytes:
        """The object, or the range of it (an HTTP Range value)."""
        return self._send("GET", key, {"Range": byte_range} if byte_range else {})

    def list_page(self, prefix: str, delimiter: str, token: str | None
                  ) -> tuple[list[dict[str, Any]], list[str], str | None]:
        """One page of a ListObjectsV2 of prefix: its objects (Key, Size and
        LastModified, as botocore gives them), its common prefixes, and the
        next page's token (None after the last). Keys come form-encoded (as
        botocore asks for them), so that no key can make the XML invalid."""
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url",
                 **({"delimiter": delimiter} if delimiter else {}), **({"continuation-token": token} if token else {})}
        query_string = urlencode(sorted(query.items()), quote_via=quote, safe="~")
        root = ElementTree.fromstring(self._send("GET", "", {}, query=query_string))
        objects: list[dict[str, Any]] = []
        prefixes: list[str] = []
        token = None
        truncated = False
        for node in root:
            tag = node.tag.rpartition("}")[2]  # with or without the S3 namespace
            if tag == "Contents":
                fields = {child.tag.rpartition("}")[2]: child.text or "" for child in node}
                objects.append({"Key": unquote_plus(fields["Key"]), "Size": int(fields["Size"]),
                                "LastModified": datetime.fromisoformat(fields["LastModified"])})
            elif tag == "CommonPrefixes":
                prefixes += [unquote_plus(child.text or "") for child in node if child.tag.endswith("Prefix")]
            elif tag == "IsTruncated":
                truncated = node.text == "true"
            elif tag == "NextContinuationToken":
                token = node.text
        return objects, prefixes, token if truncated else None

    def _send(self, method: str, key: str, headers: dict[str, str], body: bytes | bytearray = b"",
              query: str = "") -> bytes:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                status, answer = self._roundtrip(method, *self.signed(method, key, headers, body, query), body)
            except (HTTPClientError, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError):
                if attempt == ATTEMPTS:
                    raise
            else:
                if done(method, key, status, answer, attempt):
                    return answer
            time.sleep(self.BACKOFF_S * 4 ** (attempt - 1))
        raise AssertionError("unreachable")

    def signed(self, method: str, key: str, headers: dict[str, str], body: bytes | bytearray = b"",
               query: str = "") -> tuple[str, dict[str, str]]:
        """A request for key, signed now (each attempt is signed anew): its
        target (path and query string) and its headers, Host among them. A
        PUT's body is hashed into the signature where signs_payload says."""
        target = self._path + quote(key, safe="/~") + (f"?{query}" if query else "")
        headers = {"Host": self.host, **headers}
        payload = (hashlib.sha256(body).hexdigest() if self.sign_payload else UNSIGNED_PAYLOAD) if method == "PUT" \
            else EMPTY_SHA256
        self.signer.sign(method, target, headers, payload)
        return target, headers

    def _roundtrip(self, method: str, target: str, headers: dict[str, str], body: bytes | bytearray
                   ) -> tuple[int, bytes]:
        """Send a signed request: its status and whole body, read in one call and
        checked against its Content-Length (a short one raises)."""
        if self.http is not None:
            req = AWSRequest(method, self._origin + target, data=body, headers=headers, stream_output=True)
            resp = self.http.send(req.prepare())
            return resp.status_code, resp.raw.read() if resp.status_code in (200, 206) else resp.content
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = (
                http.client.HTTPSConnection(self._netloc, timeout=CONNECT_TIMEOUT_S, context=self.tls_context)
                if self.tls else http.client.HTTPConnection(self._netloc, timeout=CONNECT_TIMEOUT_S))
            self._conns.append(conn)
        try:
            if conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
                conn.close()  # the server closed it while idle (or sent what nobody asked for)
            if conn.sock is None:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sock.settimeout(READ_TIMEOUT_S)
            conn.request(method, target, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()  # a request cut short leaves the connection unusable: the next one opens anew
            raise
        if resp.will_close:
            conn.close()
        return resp.status, data

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        for conn in self._conns:
            conn.close()


class _LoopPuts:
    """Single PUTs of bodies up to SMALL_PUT_BYTES, sent from the event loop
    on keep-alive connections of asyncio's streams (up to BODY_THREADS at
    once), signed and retried as _Direct's. In a thread a 14 KiB PUT cost
    the process 375-460 µs of CPU, about 200 of them the trip through the
    pool and back to the loop, and both the thread and the loop wanted the
    GIL meanwhile; here it costs 205-215 µs (bench/history.md, session 61).
    A larger body stays in a thread: what the socket does not take at once,
    asyncio's transport copies and sends from the loop in pieces."""

    def __init__(self, direct: _Direct) -> None:
        self.direct = direct
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(BODY_THREADS)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def put(self, key: str, body: bytes | bytearray, crc32c: str, if_none_match: bool) -> None:
        """As _Direct.put, awaited."""
        headers = self.direct.put_headers(crc32c, if_none_match)
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections and slots belong to the loop they were made in
            self.close()
            self._loop, self._slots = loop, asyncio.Semaphore(BODY_THREADS)
        async with self._slots:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    status, answer = await self._roundtrip(*self.direct.signed("PUT", key, headers, body), body)
                except (OSError, EOFError, ValueError):  # refused, reset, timed out, cut short, not HTTP
                    if attempt == ATTEMPTS:
                        raise
                else:
                    if done("PUT", key, status, answer, attempt):
                        return
                await asyncio.sleep(self.direct.BACKOFF_S * 4 ** (attempt - 1))

    async def _roundtrip(self, target: str, headers: dict[str, str], body: bytes | bytearray) -> tuple[int, bytes]:
        """Send a signed PUT on an idle connection (or a new one): its status and body."""
        while self._idle:
            reader, writer = self._idle.pop()
            sock = writer.get_extra_info("socket")
            if not (reader.at_eof() or writer.is_closing() or select.select([sock], [], [], 0)[0]):
                break
            writer.close()  # the server closed it while idle (or sent what nobody asked for)
        else:
            tls = self.direct.tls_context
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(*self.direct.addr, ssl=tls,
                                                               server_hostname=self.direct.addr[0] if tls else None)
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                writer.write(f"PUT {target} HTTP/1.1\r\nContent-Length: {len(body)}\r\n{fields}\r\n".encode("latin-1"))
                writer.write(body)
                status, answer, keep = await _response(reader)
        except BaseException:
            writer.close()  # cut short (or cancelled): the connection is in an unknown state
            raise
        if keep:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return status, answer

    def close(self) -> None:
        for _, writer in self._idle:
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                writer.close()
        self._idle = []


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """An HTTP/1.1 response: its status, its body (by Content-Length,
    chunked, or up to the close), and whether the connection may carry
    another request. Its head is read in one call (a read a line cost a
    small PUT a sixth of its CPU)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise EOFError("the answer's headers were cut short" if exc.partial else "no HTTP status line") from exc
    except asyncio.LimitOverrunError as exc:
        raise ValueError("the answer's headers are too long") from exc
    first, *fields = head[:-4].split(b"\r\n")
    status_line = first.split()
    if len(status_line) < 2:
        raise EOFError("no HTTP status line")
    status, length, chunked, keep = int(status_line[1]), -1, False, status_line[0] == b"HTTP/1.1"
    for line in fields:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
    if chunked:
        parts = []
        while size := int((await reader.readline()).partition(b";")[0], 16):
            parts.append(await reader.readexactly(size + 2))
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return status, b"".join(p[:-2] for p in parts), keep
    if length < 0:
        return status, await reader.read(), False
    return status, await reader.readexactly(length), keep


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
        self._blocking: Any = None  # the client that uploads parts, in _pool's threads
        self._direct: _Direct | None = None  # single PUTs and GETs, in _pool's threads
        self._loop_puts: _LoopPuts | None = None  # small single PUTs, on the event loop (not through a proxy)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> ObjectStore:
        """The store a broker, worker or tool uses (empty settings: AWS defaults)."""
        return cls(cfg.bucket, cfg.s3_endpoint or None, cfg.s3_region, cfg.s3_access_key or None,
                   cfg.s3_secret_key or None, multipart_threshold=cfg.multipart_threshold)

    async def start(self) -> None:
        self._client = _cache_endpoints(await self._stack.enter_async_context(
            self._session.client("s3", endpoint_url=self.endpoint, config=_boto_config(self.endpoint, 64, ATTEMPTS))))
        self._blocking = sync_client(self.endpoint, self._region, *self._credentials, pool=BODY_THREADS)
        self._direct = _Direct(self.bucket, self.endpoint, self._region or "us-east-1", *self._credentials,
                               pool=BODY_THREADS)
        self._loop_puts = _LoopPuts(self._direct) if self._direct.http is None else None
        self._pool = concurrent.futures.ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="s3-body")

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None
        if self._pool is not None:
            # a request still running finishes in its thread; its caller has gone
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._blocking.close()
            if self._direct is not None:
                self._direct.close()
            if self._loop_puts is not None:
                self._loop_puts.close()
            self._pool = self._blocking = self._direct = self._loop_puts = None

    async def _in_thread(self, call: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

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
    async def put(self, key: str, data: bytes | bytearray | memoryview, if_none_match: bool = True,
                  background: bool = False) -> None:
        """Write an object once. Raises ObjectExists if the key is taken. A
        background write (a compaction's segment) larger than MIN_PART goes as
        parts of about MIN_PART, one at a time: a store answers other requests
        slowly while it takes in a large body (SeaweedFS: a 13 KiB PUT 20-90 ms
        during a 16 MiB one, under 25 ms during its 5 MiB parts; bench/history.md),
        and the PUTs that acknowledge producers must not wait behind it."""
        with metrics.s3_call("put"):
            if background and len(data) > MIN_PART:
                parts = len(data) // MIN_PART  # the rest shared out: no part below MIN_PART
                await self._put_multipart(key, data, if_none_match, -(-len(data) // parts), 1)
            elif len(data) > self.multipart_threshold:
                await self._put_multipart(key, data, if_none_match, self.part_size, self.part_concurrency)
            else:
                body = data if isinstance(data, bytes | bytearray) else bytes(data)  # botocore takes no memoryview
                crc = base64.b64encode(_native.crc32c(body).to_bytes(4, "big")).decode()
                direct = self._direct
                assert direct is not None, "store not started"
                if self._loop_puts is not None and len(body) <= SMALL_PUT_BYTES:
                    await self._loop_puts.put(key, body, crc, if_none_match)
                else:
                    await self._in_thread(lambda: direct.put(key, body, crc, if_none_match))

    async def _put_multipart(self, key: str, data: bytes | bytearray | memoryview, if_none_match: bool,
                             part_size: int, at_once: int) -> None:
        mv = memoryview(data)
        up = await self._client.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload_id = up["UploadId"]
        sem = asyncio.Semaphore(at_once)

        async def part(n: int, start: int) -> dict[str, Any]:
            async with sem:
                body = bytes(mv[start:start + part_size])
                r = await self._in_thread(lambda: self._blocking.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body))
                return {"PartNumber": n, "ETag": r["ETag"]}

        try:
            parts = await asyncio.gather(*(part(i + 1, off) for i, off in
                                           enumerate(range(0, len(mv), part_size))))
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            await self._client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                         MultipartUpload={"Parts": list(parts)}, **extra)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
            if code in ("PreconditionFailed", "412"):  # the completion's If-None-Match found the key taken
                raise ObjectExists(key) from exc
            raise

    # ---------------------------------------------------------------- read
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or the byte range [start, end) of it."""
        byte_range = None if start is None else f"bytes={start}-" + ("" if end is None else str(end - 1))
        direct = self._direct
        assert direct is not None, "store not started"
        with metrics.s3_call("get"):
            return await self._in_thread(lambda: direct.get(key, byte_range))

    async def size(self, key: str) -> int:
        return (await self._client.head_object(Bucket=self.bucket, Key=key))["ContentLength"]

    async def list(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under prefix: dicts with Key, Size and LastModified."""
        return (await self._listing(prefix, ""))[0]

    async def folders(self, prefix: str) -> list[str]:
        """The prefixes one '/' deeper than prefix that hold objects (a LIST
        with a delimiter: the store does not walk the objects under them)."""
        return (await self._listing(prefix, "/"))[1]

    async def _listing(self, prefix: str, delimiter: str) -> tuple[list[dict[str, Any]], list[str]]:
        """Every page of a ListObjectsV2 of prefix: the objects and the common prefixes."""
        direct = self._direct
        assert direct is not None, "store not started"
        objects: list[dict[str, Any]] = []
        prefixes: list[str] = []
        token: str | None = None
        while True:
            with metrics.s3_call("list"):
                page, folders, token = await self._in_thread(lambda t=token: direct.list_page(prefix, delimiter, t))
            objects += page
            prefixes += folders
            if token is None:
                return objects, prefixes

    async def delete(self, key: str) -> None:
        await self._client.delete_object(Bucket=self.bucket, Key=key)

    async def delete_many(self, keys: list[str]) -> None:
        """Delete keys, 1,000 per request (DeleteObjects); OSError naming what failed, after trying all."""
        failed: list[str] = []
        for i in range(0, len(keys), 1000):
            reply = await self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            failed += [e["Key"] for e in reply.get("Errors", [])]
        if failed:
            raise OSError(f"{len(failed)} objects not deleted, {failed[0]} first")

    async def delete_prefix(self, prefix: str) -> int:
        keys = [o["Key"] for o in await self.list(prefix)]
        await self.delete_many(keys)
        return len(keys)
