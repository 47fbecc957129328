"""Request/response headers around the schema-encoded bodies.

Requests carry header v1 (api_key, api_version, correlation_id, client_id)
and, for flexible versions, v2 (plus tagged fields). Responses carry v0
(correlation_id) or, for flexible versions, v1 (plus tagged fields); the
ApiVersions response always uses v0 so that any client can read it."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kafscale.protocol.codec import DecodeError, Reader, Writer
from kafscale.protocol.schemas import API_VERSIONS, APIS

_HDR = struct.Struct(">hhi")
_I32 = struct.Struct(">i")
MAX_FRAME = 100 * 1024 * 1024  # socket.request.max.bytes in Kafka


@dataclass
class RequestHeader:
    """A request header's wire fields (header v1/v2 without the tagged fields)."""
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    flexible: bool


def parse_request_header(frame: memoryview) -> tuple[RequestHeader, int]:
    """Parse the header of a request frame (without its size prefix).

    Returns the header and the offset where the body starts. The API key
    and version need not be supported: callers answer UNSUPPORTED_VERSION."""
    if len(frame) < 8:
        raise DecodeError(f"request of {len(frame)} bytes is shorter than a header")
    api_key, api_version, correlation_id = _HDR.unpack_from(frame, 0)
    r = Reader(frame, 8)
    n = r.prim(struct.Struct(">h"))
    client_id = None if n < 0 else str(r.take(n), "utf-8", "replace")
    api = APIS.get(api_key)
    flexible = bool(api and api.supports(api_version) and api_version >= api.request.flexible_min)
    if flexible:
        for _ in range(r.uvarint()):
            r.uvarint()
            r.take(r.uvarint())
    return RequestHeader(api_key, api_version, correlation_id, client_id, flexible), r.pos


def encode_response(header: RequestHeader, body: dict[str, Any]) -> list[Any]:
    """Frame a response body for `header`'s API and version; returns chunks
    ready for `writelines` (size prefix first)."""
    api = APIS[header.api_key]
    w = Writer()
    w.write(_I32.pack(header.correlation_id))
    flexible = header.api_version >= api.response.flexible_min
    if flexible and header.api_key != API_VERSIONS.key:
        w.write(b"\x00")  # no tagged fields in the response header
    api.response.encode(body, header.api_version, w)
    chunks = w.finish()
    return [_I32.pack(w.size), *chunks]


def encode_request(api_key: int, api_version: int, correlation_id: int, body: dict[str, Any],
                   client_id: str | None = "kafscale") -> bytes:
    """Frame a request (size prefix included), as a client would send it."""
    api = APIS[api_key]
    w = Writer()
    w.write(_HDR.pack(api_key, api_version, correlation_id))
    cid = None if client_id is None else client_id.encode()
    w.write(struct.pack(">h", -1) if cid is None else struct.pack(">h", len(cid)) + cid)
    if api_version >= api.request.flexible_min:
        w.write(b"\x00")
    api.request.encode(body, api_version, w)
    data = b"".join(bytes(c) for c in w.finish())
    return _I32.pack(len(data)) + data


def decode_response(api_key: int, api_version: int, frame: bytes) -> tuple[int, dict[str, Any]]:
    """Decode a response frame (without its size prefix): (correlation id, body)."""
    api = APIS[api_key]
    mv = memoryview(frame)
    (correlation_id,) = _I32.unpack_from(mv, 0)
    r = Reader(mv, 4)
    if api_version >= api.response.flexible_min and api_key != API_VERSIONS.key:
        for _ in range(r.uvarint()):
            r.uvarint()
            r.take(r.uvarint())
    body, end = api.response.decode(mv, api_version, r.pos)
    if end != len(frame):
        raise DecodeError(f"{len(frame) - end} trailing bytes in {api.name} response")
    return correlation_id, body
