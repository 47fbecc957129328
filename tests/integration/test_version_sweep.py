"""A version sweep with an independent encoder: for every API key and every
version the broker advertises, kafka-python's message classes (generated from
Kafka's own JSON message definitions) build a request with default field
values, and the broker's response must decode with kafka-python's response
class for that version, with the right correlation id. The broker runs with
strict encoding, so a response field its schema lacks fails here too."""
from __future__ import annotations

import socket
import struct

import kafka.protocol.admin
import kafka.protocol.consumer
import kafka.protocol.metadata
import kafka.protocol.producer
import kafka.protocol.sasl  # noqa: F401 - registers those message classes
import pytest
from kafka.protocol.api_message import ApiMessage, ResponseClassRegistry

from kafscale.protocol.schemas import APIS, SASL_AUTHENTICATE, SASL_HANDSHAKE

# SaslHandshake/SaslAuthenticate change the connection's state (tests/integration/test_security.py covers them)
SKIP = {SASL_HANDSHAKE.key, SASL_AUTHENTICATE.key}
# defaults that would make the broker answer nothing (acks=0) or wait (max_wait_ms)
OVERRIDES = {0: {"acks": 1, "timeout_ms": 1000}, 1: {"max_wait_ms": 0, "max_bytes": 1 << 20}}


def request_classes() -> dict[int, type]:
    def subclasses(c: type):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    return {c.API_KEY: c for c in subclasses(ApiMessage)
            if c.__name__.endswith("Request") and getattr(c, "API_KEY", None) is not None}


CLASSES = request_classes()
CASES = [(key, v) for key, api in sorted(APIS.items()) if key not in SKIP and key in CLASSES
         for v in range(api.min_version, api.max_version + 1)]


@pytest.fixture(scope="module")
def conn(broker):
    s = socket.create_connection(("127.0.0.1", broker.port), timeout=30)
    yield s
    s.close()


def read_frame(s: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "the broker closed the connection"
            buf += chunk
        return buf

    (size,) = struct.unpack(">i", exactly(4))
    return exactly(size)


def test_every_advertised_api_has_an_independent_encoder():
    missing = sorted(APIS[k].name for k in APIS if k not in CLASSES and k not in SKIP)
    assert not missing, f"kafka-python has no message class for {missing}"


@pytest.mark.parametrize("key,version", CASES, ids=[f"{APIS[k].name}-v{v}" for k, v in CASES])
def test_request_at_every_advertised_version_gets_a_well_formed_response(conn, key, version):
    cls = CLASSES[key]
    fields = {name: value for name, value in OVERRIDES.get(key, {}).items()}
    req = cls(version=version, **fields)
    correlation = key * 100 + version
    req.with_header(correlation_id=correlation, client_id="version-sweep")
    conn.sendall(req.encode(header=True, framed=True))
    frame = read_frame(conn)
    response_class = ResponseClassRegistry.get_response_class(req.header)
    resp = response_class.decode(frame, version=version, header=True)
    assert resp.header.correlation_id == correlation
    # and its body decodes to the last byte: nothing the v{version} schema lacks was sent
    body = memoryview(frame)[4 if key == 18 or version < APIS[key].response.flexible_min else 5:]
    flexible = response_class.flexible_version_q(version)
    decode = response_class._struct.compiled_decode_from(version, compact=flexible, tagged=flexible,
                                                          data_class=response_class[None])
    assert decode(body, 0)[1] == len(body), "bytes left over after the response"
