"""Property-based fuzzing of what a client controls: request frames (header
and body decoders of every API and version) and record batches (native
validation, scanning and decoding). Bad input may only raise the documented
errors; anything else is a crash. Regression vectors found while fuzzing stay
in REGRESSIONS. The budget is bounded (FUZZ_EXAMPLES, default 300 per target)
so that CI stays fast; raise it for a longer local run."""
from __future__ import annotations

import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafscale import _native
from kafscale.broker.server import ProtocolViolation, parse_header
from kafscale.protocol.codec import DecodeError
from kafscale.protocol.schemas import APIS

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REGRESSIONS: list[bytes] = [
    b"",
    b"\x00\x00",
    struct.pack(">hhi", 0, 9, 1) + b"\xff\xff",  # Produce v9 header with a truncated client id
    struct.pack(">hhih", 1, 13, 7, -1) + b"\x00" + b"\xff" * 32,  # Fetch v13, garbage tagged fields
    struct.pack(">hhih", 3, 12, 1, 0) + b"\x00\x80\x80\x80\x80\x10",  # Metadata v12, an over-long varint
]


def decode_frame(frame: bytes) -> None:
    """What a worker does with a frame before any handler runs."""
    mv = memoryview(frame)
    try:
        api_key, api_version, *_, body_at = parse_header(mv)
    except ProtocolViolation:
        return
    try:
        APIS[api_key].request.decode(mv, api_version, body_at)
    except DecodeError:
        pass


def header_for(api_key: int, version: int) -> bytes:
    return struct.pack(">hhih", api_key, version, 42, 3) + b"fuz"


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """A valid header for a supported (API, version), then random body bytes;
    or wholly random bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    api = draw(st.sampled_from(sorted(APIS.values(), key=lambda a: a.key)))
    version = draw(st.integers(api.min_version, api.max_version))
    tagged = b"\x00" if version >= api.request.flexible_min else b""
    return header_for(api.key, version) + tagged + draw(st.binary(max_size=512))


@FUZZ
@given(frames())
def test_request_decoding_never_crashes(frame):
    decode_frame(frame)


def test_request_regression_vectors():
    for frame in REGRESSIONS:
        decode_frame(frame)


def valid_batch() -> bytes:
    return _native.build_batch([(1_700_000_000_000 + i, b"k%d" % i, b"v" * i, [("h", b"x")]) for i in range(5)])


@st.composite
def mutated_batches(draw: st.DrawFn) -> bytes:
    """A real batch (any codec) with random bytes overwritten, cut or appended."""
    codec = draw(st.integers(0, 4))
    data = bytearray(_native.build_batch([(1_700_000_000_000 + i, b"k", b"value-%d" % i, [])
                                          for i in range(draw(st.integers(1, 20)))], codec=codec))
    for _ in range(draw(st.integers(0, 6))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data) + draw(st.binary(max_size=16))


def check_batch(data: bytes) -> None:
    """Validation either accepts the bytes (then every reader copes with
    them) or raises BatchError with a Kafka error code."""
    try:
        infos = _native.validate_batches(data)
    except _native.BatchError as exc:
        assert exc.code in (_native.CORRUPT_MESSAGE, _native.INVALID_RECORD, _native.UNSUPPORTED_COMPRESSION_TYPE)
        return
    for b in infos:
        list(_native.iter_records(b, data))
    _native.decode_columns(data, list(infos), 0, 1 << 62)


@FUZZ
@given(mutated_batches())
def test_batch_validation_never_crashes(data):
    check_batch(data)


@FUZZ
@given(st.binary(max_size=512))
def test_scanning_random_bytes_raises_only_batch_errors(data):
    try:
        _native.scan_batches(data, True, True)
    except _native.BatchError:
        pass


def test_batch_regression_vectors():
    good = valid_batch()
    for data in (good, good[:61], good[:-1], good + b"\x00" * 12, b"\x00" * 61):
        check_batch(data)
