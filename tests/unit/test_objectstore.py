"""The S3 clients' endpoint cache works for every key of a bucket; single
PUTs and GETs (signed and sent without botocore's client, in a thread, and
small PUTs from the event loop) are addressed, signed, conditional and
retried as the clients would (against a local HTTP server; the integration
tests use SeaweedFS)."""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import http.client
import http.server
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import botocore.auth
import botocore.session
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config as BotoConfig
from botocore.credentials import Credentials

from kafscale.storage import objectstore
from kafscale.storage.objectstore import (
    UNUSED_ENDPOINT_PARAMS,
    ObjectExists,
    RequestFailed,
    _Direct,
    _LoopPuts,
    _SigV4,
    signs_payload,
    sync_client,
)


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        own = {node["ref"]} if isinstance(node.get("ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_no_s3_endpoint_rule_reads_the_parameters_left_out():
    """Leaving them out changes no endpoint while botocore's S3 rules never read them
    (this fails, and the list must shrink, the day a rule starts to)."""
    loader = botocore.session.get_session().get_component("data_loader")
    rules = loader.load_service_model("s3", "endpoint-rule-set-1")
    assert set(UNUSED_ENDPOINT_PARAMS) <= set(rules["parameters"])  # still declared: still worth leaving out
    assert not _refs(rules["rules"]) & set(UNUSED_ENDPOINT_PARAMS), json.dumps(sorted(_refs(rules["rules"])))


def test_endpoints_resolve_once_per_bucket_not_per_key():
    client = sync_client("http://127.0.0.1:9", "us-east-1", "k", "s")
    cache_info = type(client._ruleset_resolver._provider).resolve_endpoint.cache_info  # one cache per process
    before = cache_info()
    for i in range(20):
        client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": f"k{i}"})
    after = cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 19)


class _Fake(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next status of `statuses` (then 200 or,
    to a ranged GET, 206), recording what came; a GET gets `body` (or the
    range of it), with a Content-Length of `claimed` bytes if set."""
    statuses: list[int] = []
    seen: list[tuple[str, str, dict[str, str], bytes]] = []
    body = b""
    claimed: int | None = None
    port = 0

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if self.claimed is None else self.claimed))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(("PUT", self.path, dict(self.headers), body))
        self._answer(type(self).statuses.pop(0) if type(self).statuses else 200, b"")

    def do_GET(self) -> None:
        type(self).seen.append(("GET", self.path, dict(self.headers), b""))
        if type(self).statuses:
            self._answer(type(self).statuses.pop(0), b"<Error/>")
        elif rng := self.headers.get("Range"):
            first, _, last = rng.removeprefix("bytes=").partition("-")
            self._answer(206, self.body[int(first):int(last) + 1 if last else None])
        else:
            self._answer(200, self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_s3():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Fake.statuses, _Fake.seen, _Fake.body, _Fake.claimed = [], [], b"", None
    _Fake.port = server.server_port
    direct = _Direct("bkt", f"http://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    direct.BACKOFF_S = 0.001
    yield direct
    direct.close()
    server.shutdown()


Put = Callable[[str, bytes | bytearray, str, bool], None]


def putter(direct: _Direct, how: str) -> Iterator[Put]:
    """direct's PUT in a thread's way, or from an event loop (_LoopPuts, on one loop throughout)."""
    if how == "thread":
        yield direct.put
        return
    loop, puts = asyncio.new_event_loop(), _LoopPuts(direct)
    yield lambda *args: loop.run_until_complete(puts.put(*args))
    puts.close()
    loop.run_until_complete(asyncio.sleep(0))  # the connections' transports close
    loop.close()


@pytest.fixture(params=["thread", "loop"])
def put(fake_s3, request) -> Iterator[Put]:
    yield from putter(fake_s3, request.param)


def test_a_put_is_signed_addressed_by_path_and_conditional(put):
    put("t/0/segment 1.kfs", bytearray(b"body"), "AAAAAA==", True)
    [(_, path, headers, body)] = _Fake.seen
    assert path == "/bkt/t/0/segment%201.kfs" and body == b"body"
    assert headers["If-None-Match"] == "*" and headers["x-amz-checksum-crc32c"] == "AAAAAA=="
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=key/")
    assert "host;" in headers["Authorization"] and headers["Host"] == f"127.0.0.1:{_Fake.port}"
    assert headers["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"  # loopback: the CRC32C guards the body


@pytest.mark.parametrize(("endpoint", "signed"), [
    ("http://127.0.0.1:8333", False), ("http://localhost:9000", False), ("http://[::1]:9000", False),
    ("https://minio.internal:9000", False), (None, False),  # AWS over https
    ("http://10.0.0.7:9000", True), ("http://minio.storage.svc:9000", True)])
def test_a_body_is_hashed_into_its_signature_only_over_plain_http_to_another_host(endpoint, signed):
    direct = _Direct("bkt", endpoint, "us-east-1", "key", "secret", pool=1)
    body = bytearray(b"segment bytes")
    _, headers = direct.signed("PUT", "k", direct.put_headers("AAAAAA==", True), body)
    assert signs_payload(endpoint) is signed
    assert headers["X-Amz-Content-SHA256"] == (hashlib.sha256(body).hexdigest() if signed else "UNSIGNED-PAYLOAD")
    assert sync_client(endpoint, "us-east-1", "k", "s").meta.config.s3["payload_signing_enabled"] is signed


def botocore_signed(endpoint: str | None, credentials: Credentials, method: str, target: str,
                    headers: dict[str, str], body: bytes) -> dict[str, str]:
    """What botocore's S3 signer adds to a request as _Direct sends it (a PutObject's context when a PUT)."""
    url = _Direct("bkt", endpoint, "eu-west-1", "k", "s", pool=1)._origin + target
    req = AWSRequest(method, url, data=body, headers=headers)
    if method == "PUT":
        req.context.update({"has_streaming_input": True,
                            "client_config": BotoConfig(s3={"payload_signing_enabled": signs_payload(endpoint)}),
                            "checksum": {"request_algorithm": {"in": "header", "name": "x-amz-checksum-crc32c"}}})
    S3SigV4Auth(credentials, "s3", "eu-west-1").add_auth(req)
    return dict(req.headers.items())


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8333", "http://10.0.0.7:9000", "https://s3.example.com",
                                      "https://s3.example.com:8443/base", None])
@pytest.mark.parametrize("token", [None, "session/token+="])
def test_requests_are_signed_as_botocores_s3_signer_signs_them(monkeypatch, endpoint, token):
    """Byte for byte the headers botocore's S3SigV4Auth adds, at a fixed time:
    single PUTs (signed body or not), ranged GETs and listings, keys and
    continuation tokens that need encoding, a session token; and a new day
    derives a new signing key."""
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    direct = _Direct("bkt", endpoint, "eu-west-1", "k", "s", pool=1)
    direct.signer = _SigV4(credentials, "eu-west-1")
    body = b"\x00segment bytes\xff" * 100
    query = "list-type=2&prefix=ns%2Ft%20%C3%A9%2F&continuation-token=1%2Fab%2B%3D%3D&encoding-type=url"
    requests = [("PUT", "ns/t é/0/00000000000000000042.kfs", direct.put_headers("AAAAAA==", True), body),
                ("PUT", "wal/n1/7.obj", direct.put_headers("q83vEg==", False), body),
                ("GET", "ns/t/0/1.kfs", {"Range": "bytes=0-1023"}, b""),
                ("GET", "", {}, b"")]
    for day in ("20261202", "20261203"):
        when = datetime.datetime(int(day[:4]), int(day[4:6]), int(day[6:]), 23, 59, 58)
        monkeypatch.setattr(objectstore, "_amz_date", lambda w=when: w.strftime("%Y%m%dT%H%M%SZ"))
        monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda w=when: w)
        for method, key, headers, data in requests:
            target, ours = direct.signed(method, key, headers, data, query if not key else "")
            unsigned = {k: v for k, v in ours.items() if k not in ("X-Amz-Date", "X-Amz-Content-SHA256",
                                                                     "X-Amz-Security-Token", "Authorization")}
            assert ours == botocore_signed(endpoint, credentials, method, target, unsigned, data)


def test_a_put_is_retried_on_5xx_and_429_only(put):
    _Fake.statuses = [503, 429]
    put("k", b"x", "AAAAAA==", False)
    assert len(_Fake.seen) == 3 and "If-None-Match" not in _Fake.seen[0][2]
    _Fake.statuses = [412]
    with pytest.raises(ObjectExists):
        put("k", b"x", "AAAAAA==", True)
    _Fake.statuses = [403]
    with pytest.raises(RequestFailed, match="HTTP 403"):
        put("k", b"x", "AAAAAA==", True)
    _Fake.statuses = [500, 500, 500]
    with pytest.raises(RequestFailed, match="HTTP 500"):
        put("k", b"x", "AAAAAA==", True)
    assert len(_Fake.seen) == 3 + 1 + 1 + 3


def test_a_get_reads_the_object_or_a_range_of_it(fake_s3):
    _Fake.body = bytes(range(256)) * 64
    assert fake_s3.get("t/0/a b.kfs", None) == _Fake.body
    assert fake_s3.get("t/0/a b.kfs", "bytes=10-19") == _Fake.body[10:20]
    assert fake_s3.get("t/0/a b.kfs", "bytes=16000-") == _Fake.body[16000:]
    assert [(m, p, h.get("Range")) for m, p, h, _ in _Fake.seen] == [
        ("GET", "/bkt/t/0/a%20b.kfs", None), ("GET", "/bkt/t/0/a%20b.kfs", "bytes=10-19"),
        ("GET", "/bkt/t/0/a%20b.kfs", "bytes=16000-")]
    assert all(h["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=key/") for _, _, h, _ in _Fake.seen)


def test_a_get_is_retried_on_5xx_and_refused_on_4xx(fake_s3):
    _Fake.body = b"data"
    _Fake.statuses = [500, 503]
    assert fake_s3.get("k", None) == b"data"
    _Fake.statuses = [404]
    with pytest.raises(RequestFailed, match="GET k: HTTP 404"):
        fake_s3.get("k", None)
    assert len(_Fake.seen) == 3 + 1


def test_a_get_answered_short_is_retried_then_raises(fake_s3):
    """A body shorter than its Content-Length is never returned as the object."""
    _Fake.body, _Fake.claimed = b"data", 10
    with pytest.raises(http.client.IncompleteRead):
        fake_s3.get("k", None)
    assert len(_Fake.seen) == 3


class _KeepAlive(_Fake):
    """HTTP/1.1: the connection stays open after an answer, unless `drop`
    (then the server closes it after answering, without saying so)."""
    protocol_version = "HTTP/1.1"
    drop = False
    ports: list[int] = []

    def _answer(self, status: int, body: bytes) -> None:
        type(self).ports.append(self.client_address[1])
        drop = type(self).drop  # read before the client has its answer (and may change it)
        super()._answer(status, body)
        self.close_connection = drop


@pytest.mark.parametrize("how", ["thread", "loop"])
def test_a_connection_is_kept_and_one_the_server_closed_meanwhile_is_not_used(how):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _KeepAlive.statuses, _KeepAlive.seen, _KeepAlive.ports, _KeepAlive.claimed = [], [], [], None
    direct = _Direct("bkt", f"http://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    direct.BACKOFF_S = 10  # a retry would show as a 10 s wait
    puts = putter(direct, how)
    put = next(puts)
    try:
        for i in range(3):
            put(f"k{i}", b"x", "AAAAAA==", True)
        _KeepAlive.drop = True
        put("k3", b"x", "AAAAAA==", True)
        time.sleep(0.2)  # the server has closed it
        t = time.monotonic()
        put("k4", b"x", "AAAAAA==", True)
        assert time.monotonic() - t < 5, "sent on the closed connection, then retried"
        assert len(set(_KeepAlive.ports[:4])) == 1 and _KeepAlive.ports[4] != _KeepAlive.ports[3]
        assert len(_KeepAlive.seen) == 5
    finally:
        _KeepAlive.drop = False
        puts.close()
        direct.close()
        server.shutdown()


class _Odd(_Fake):
    """Refuses a PUT with its error in the two other ways HTTP/1.1 allows
    for a body: chunked (then keeps the connection), or up to the close."""
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(("PUT", self.path, dict(self.headers), b""))
        self.send_response(403)
        if self.path.endswith("chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"6\r\n<Error\r\n9;ext=1\r\n>Denied</\r\n6\r\nError>\r\n0\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"<Error>Denied</Error>")
            self.close_connection = True


def test_a_put_from_the_loop_reads_a_chunked_answer_and_one_up_to_the_close():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Odd.seen = []
    direct = _Direct("bkt", f"http://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    puts = putter(direct, "loop")
    put = next(puts)
    try:
        for key in ("a-chunked", "b-closed", "c-chunked"):
            with pytest.raises(RequestFailed, match="HTTP 403 b'<Error>Denied</Error>'"):
                put(key, b"x", "AAAAAA==", True)
        assert len(_Odd.seen) == 3, "a 403 is not retried"
    finally:
        puts.close()
        direct.close()
        server.shutdown()


@pytest.mark.parametrize(("answer", "outcome"), [
    (b"HTTP/1.1 200 OK\r\nContent-LENGTH: 2\r\nX-Amz-Id: a:b\r\n\r\nokEXTRA", (200, b"ok", True)),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", (200, b"", False)),
    (b"HTTP/1.0 503 Busy\r\n\r\nlater", (503, b"later", False)),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", EOFError("cut short")),
    (b"", EOFError("no HTTP status line")),
    (b"\r\n\r\n", EOFError("no HTTP status line"))])
def test_an_answer_is_parsed_from_its_head_or_refused_when_cut_short(answer, outcome):
    async def parse() -> tuple[int, bytes, bool]:
        reader = asyncio.StreamReader()
        reader.feed_data(answer)
        reader.feed_eof()
        return await objectstore._response(reader)

    if isinstance(outcome, Exception):
        with pytest.raises(type(outcome), match=str(outcome)):
            asyncio.run(parse())
    else:
        assert asyncio.run(parse()) == outcome


@pytest.mark.parametrize("how", ["thread", "loop"])
def test_a_put_over_https_trusts_the_ca_bundle(how, certs, monkeypatch):
    """An https endpoint: the server's certificate is checked against
    AWS_CA_BUNDLE (as botocore's clients do), the request arrives whole and
    signed for the host and port it was sent to."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs / "server.pem", certs / "server.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Fake.statuses, _Fake.seen, _Fake.claimed = [], [], None
    monkeypatch.setenv("AWS_CA_BUNDLE", str(certs / "ca.pem"))
    direct = _Direct("bkt", f"https://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    puts = putter(direct, how)
    put = next(puts)
    try:
        put("t/0/a.kfs", bytearray(b"secret body" * 1000), "AAAAAA==", True)
        put("t/0/b.kfs", b"again", "AAAAAA==", True)
        assert [(p, b[:11], len(b), h["Host"]) for _, p, h, b in _Fake.seen] == [
            ("/bkt/t/0/a.kfs", b"secret body", 11_000, f"127.0.0.1:{server.server_port}"),
            ("/bkt/t/0/b.kfs", b"again", 5, f"127.0.0.1:{server.server_port}")]
    finally:
        puts.close()
        direct.close()
        server.shutdown()


@pytest.mark.parametrize("how", ["thread", "loop"])
def test_a_put_to_a_store_gone_away_raises_oserror_after_its_attempts(how):
    """The server answered once and then went away (its connection closed,
    nothing listening): the PUT tries ATTEMPTS times and raises an OSError,
    which the node flush's upload retries."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _KeepAlive.statuses, _KeepAlive.seen, _KeepAlive.ports, _KeepAlive.claimed = [], [], [], None
    direct = _Direct("bkt", f"http://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    direct.BACKOFF_S = 0.001
    puts = putter(direct, how)
    put = next(puts)
    try:
        _KeepAlive.drop = True  # the server closes the connection after its answer
        put("k0", b"x", "AAAAAA==", True)
        server.shutdown()
        server.server_close()
        with pytest.raises(OSError):
            put("k1", b"x", "AAAAAA==", True)
        assert len(_KeepAlive.seen) == 1
    finally:
        _KeepAlive.drop = False
        puts.close()
        direct.close()
