"""The S3 clients' endpoint cache works for every key of a bucket; single
PUTs (signed and sent without botocore's client) are addressed, signed,
conditional and retried as the clients would (against a local HTTP server;
the integration tests put against SeaweedFS)."""
from __future__ import annotations

import http.server
import json
import threading

import botocore.session
import pytest

from kafscale.storage.objectstore import UNUSED_ENDPOINT_PARAMS, ObjectExists, PutFailed, _Put, sync_client


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
    """Answers each PUT with the next status of `statuses` (then 200), recording what came."""
    statuses: list[int] = []
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((self.path, dict(self.headers), body))
        status = type(self).statuses.pop(0) if type(self).statuses else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_s3():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Fake.statuses, _Fake.seen = [], []
    put = _Put("bkt", f"http://127.0.0.1:{server.server_port}", "us-east-1", "key", "secret", pool=2)
    put.BACKOFF_S = 0.001
    yield put
    put.close()
    server.shutdown()


def test_a_put_is_signed_addressed_by_path_and_conditional(fake_s3):
    fake_s3("t/0/segment 1.kfs", bytearray(b"body"), "AAAAAA==", True)
    [(path, headers, body)] = _Fake.seen
    assert path == "/bkt/t/0/segment%201.kfs" and body == b"body"
    assert headers["If-None-Match"] == "*" and headers["x-amz-checksum-crc32c"] == "AAAAAA=="
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=key/")


def test_a_put_is_retried_on_5xx_and_429_only(fake_s3):
    _Fake.statuses = [503, 429]
    fake_s3("k", b"x", "AAAAAA==", False)
    assert len(_Fake.seen) == 3 and "If-None-Match" not in _Fake.seen[0][1]
    _Fake.statuses = [412]
    with pytest.raises(ObjectExists):
        fake_s3("k", b"x", "AAAAAA==", True)
    _Fake.statuses = [403]
    with pytest.raises(PutFailed, match="HTTP 403"):
        fake_s3("k", b"x", "AAAAAA==", True)
    _Fake.statuses = [500, 500, 500]
    with pytest.raises(PutFailed, match="HTTP 500"):
        fake_s3("k", b"x", "AAAAAA==", True)
    assert len(_Fake.seen) == 3 + 1 + 1 + 3
