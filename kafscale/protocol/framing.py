"""Request/response headers around the schema-encoded bodies.

Requests carry header v1 (api_key, api_version, correlation_id, client_id)
and, for flexible versions, v2 (plus tagged fields). Responses carry v0
(correlation_id) or, for flexible versions, v1 (plus tagged fields); the
ApiVersions response always uses v0 so that any client can read it."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kafscale import _native
from kafscale.protocol import codec
from kafscale.protocol.codec import DecodeError, Reader, Writer
from kafscale.protocol.schemas import API_VERSIONS, APIS, FETCH, PRODUCE

_HDR = struct.Struct(">hhi")
_I32 = struct.Struct(">i")
# a response's size and correlation id, and in header v1 no tagged fields
_HEAD = struct.Struct(">ii")
_HEAD_TAGGED = struct.Struct(">iiB")
# a Fetch response partition's fields before its records, by version: (the struct, those after the log start
# offset: the aborted transactions as null, in flexible versions a compact array's, and the preferred read
# replica, -1, from version 11)
_FETCH_HEADS: dict[int, tuple[struct.Struct, tuple[int, ...]]] = {}
MAX_FRAME = 100 * 1024 * 1024  # socket.request.max.bytes in Kafka


@dataclass
class RequestHeader:
    """A request header's wire fields (header v1/v2 without the tagged fields)."""
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    flexible: bool


def _flexible_versions() -> bytes:
    """The table _native.parse_request_header looks up header v2 in."""
    table = bytearray((max(APIS) + 1) * _native.HEADER_VERSIONS)
    for key, api in APIS.items():
        for v in range(api.request.flexible_min, min(api.max_version + 1, _native.HEADER_VERSIONS)):
            if api.supports(v):
                table[key * _native.HEADER_VERSIONS + v] = 1
    return bytes(table)


_FLEXIBLE_VERSIONS = _flexible_versions()
# A request header's fields and where its body starts: (api_key, api_version,
# correlation_id, client_id, flexible, body_at).
HeaderFields = tuple[int, int, int, str | None, bool, int]


def request_header_fields(frame: memoryview) -> HeaderFields:
    """Parse the header of a request frame (without its size prefix), in
    native code: its fields, then the offset where the body starts. The API
    key and version need not be supported: callers answer UNSUPPORTED_VERSION."""
    try:
        return _native.parse_request_header(frame, _FLEXIBLE_VERSIONS)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def parse_request_header(frame: memoryview) -> tuple[RequestHeader, int]:
    """request_header_fields as a RequestHeader and the offset of the body."""
    *fields, body_at = request_header_fields(frame)
    return RequestHeader(*fields), body_at


def encode_response(header: RequestHeader, body: dict[str, Any]) -> list[Any]:
    """Frame a response body for `header`'s API and version; returns chunks
    ready for `writelines` (size prefix first)."""
    api = APIS[header.api_key]
    tagged = header.api_version >= api.response.flexible_min and header.api_key != API_VERSIONS.key
    if api.response.native_encode is not None:  # the body in one piece: its head packed in one go
        data = api.response.encode_native(body, header.api_version)
        return [_HEAD_TAGGED.pack(len(data) + 5, header.correlation_id, 0) if tagged
                else _HEAD.pack(len(data) + 4, header.correlation_id), data]
    w = Writer()
    w.write(_I32.pack(header.correlation_id))
    if tagged:
        w.write(b"\x00")  # no tagged fields in the response header
    api.response.encode(body, header.api_version, w)
    chunks = w.finish()
    return [_I32.pack(w.size), *chunks]


# A broker's answer to a Produce request, as the log process replies with it
# (lists and tuples pickle in a third of the time the response dicts took):
# per topic (name, partitions), per partition a list
#   [index, error_code, base_offset, log_start_offset, error_message]
# and nothing else: no throttle time, no record errors, no log append time.
ProduceAnswer = list[tuple[str, list[list[Any]]]]


def answer_body(answer: ProduceAnswer) -> dict[str, Any]:
    """A broker's answer as the response dict the Produce schema describes."""
    return {"responses": [{"name": name, "partition_responses": [
        {"index": p[0], "error_code": p[1], "base_offset": p[2], "log_start_offset": p[3], "error_message": p[4]}
        for p in parts]} for name, parts in answer], "throttle_time_ms": 0}


def encode_produce_responses(answers: list[tuple[int, int, dict[str, Any] | ProduceAnswer]]) -> bytes:
    """Produce responses framed back to back in one native call, each answer
    a (correlation id, version, body), a body a response dict or a broker's
    answer (ProduceAnswer); in strict mode each body is checked against its
    schema first, as encode_response does."""
    if codec.STRICT:
        for _, version, body in answers:
            PRODUCE.response.codec(version).check_all(body if isinstance(body, dict) else answer_body(body))
    return _native.encode_produce_responses(answers, PRODUCE.response.flexible_min)


# a Fetch response partition: (partition, error code, high watermark, log start offset, records chunks)
FetchPartition = tuple[int, int, int, int, list[Any] | None]


def fetch_partitions(parts: list[FetchPartition], version: int) -> codec.Encoded:
    """A Fetch response's partitions in `version`'s layout (the last stable
    offset is the high watermark, no aborted transactions, no preferred read
    replica), each records chunk of 4 KiB and more by reference. A consumer of
    10,000 partitions asks for all in every Fetch, most with nothing new: as
    dicts through the schema's encoder they took a fifth of a worker's time."""
    flexible = version >= FETCH.response.flexible_min
    if version not in _FETCH_HEADS:
        fmt = ">ihqq" + ("q" if version >= 5 else "") + ("B" if flexible else "i") + ("i" if version >= 11 else "")
        _FETCH_HEADS[version] = struct.Struct(fmt), (0 if flexible else -1,) + ((-1,) if version >= 11 else ())
    head, after = _FETCH_HEADS[version]
    log_start = version >= 5
    # no records: an empty compact records field and no tagged fields, or an empty one of 32-bit length
    empty = b"\x01\x00" if flexible else bytes(4)
    w = Writer()
    for p, error, hw, start, records in parts:
        w.buf += head.pack(p, error, hw, hw, start, *after) if log_start else head.pack(p, error, hw, hw, *after)
        if not records:
            w.buf += empty
            continue
        size = sum(len(c) for c in records)
        w.buf += codec.uvarint(size + 1) if flexible else _I32.pack(size)
        for c in records:
            w.write_big(c)
        if flexible:
            w.buf += b"\x00"
    return codec.Encoded(len(parts), w.finish())


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
