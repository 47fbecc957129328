"""The native hot path against known vectors."""
from __future__ import annotations

import os
import struct

import pytest

from kafscale import _native

# CRC32C check values: the standard "123456789" vector and RFC 3720 (iSCSI) B.4.
CRC_VECTORS = [
    (b"", 0),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data,expected", CRC_VECTORS)
def test_crc32c_vectors(data, expected):
    assert _native.crc32c(data) == expected
    assert _native.crc32c_portable(data) == expected


@pytest.mark.parametrize("size", [1, 7, 8, 9, 63, 4096, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 100_003, 1 << 20])
def test_crc32c_fast_path_matches_table_path(size):
    data = os.urandom(size + 3)[3:]  # unaligned start
    assert _native.crc32c(data) == _native.crc32c_portable(data)


def test_crc32c_is_incremental():
    data = os.urandom(50_000)
    assert _native.crc32c(data[20_000:], _native.crc32c(data[:20_000])) == _native.crc32c(data)


@pytest.mark.parametrize("value,encoded", [(0, b"\x00"), (-1, b"\x01"), (1, b"\x02"), (63, b"\x7e"),
                                           (-64, b"\x7f"), (64, b"\x80\x01"), (300, b"\xd8\x04"),
                                           (-(2**63), b"\xff" * 9 + b"\x01")])
def test_varint(value, encoded):
    assert _native.encode_varint(value) == encoded
    assert _native.decode_varint(encoded) == (value, len(encoded))


def test_varint_malformed():
    with pytest.raises(ValueError):
        _native.decode_varint(b"\x80\x80")


def test_batch_layout_matches_kafka_v2():
    recs = [(1_700_000_000_000, b"key", b"value", [("h", b"1")]), (1_700_000_000_005, None, b"v2", [])]
    batch = _native.build_batch(recs)
    base, length, leader_epoch, magic, crc, attrs, lod, base_ts, max_ts, pid, pepoch, seq, count = struct.unpack_from(
        ">qiibIhiqqqhii", batch)
    assert (base, length, leader_epoch, magic, attrs, lod, count) == (0, len(batch) - 12, -1, 2, 0, 1, 2)
    assert (base_ts, max_ts, pid, pepoch, seq) == (1_700_000_000_000, 1_700_000_000_005, -1, -1, -1)
    assert crc == _native.crc32c(batch[21:])
    # first record: length, attributes, ts delta, offset delta, key, value, headers
    rec = batch[61:]
    length, pos = _native.decode_varint(rec)
    assert rec[pos:pos + 1] == b"\x00"
    assert list(_native.iter_records(_native.scan_batches(batch)[0], batch)) == [
        (0, 1_700_000_000_000, b"key", b"value", [("h", b"1")]),
        (1, 1_700_000_000_005, None, b"v2", []),
    ]


@pytest.mark.parametrize("codec", range(5))
def test_codecs_round_trip(codec):
    recs = [(1000 + i, f"k{i}".encode(), os.urandom(10) * (i + 1), [("x", None)]) for i in range(50)]
    batch = _native.build_batch(recs, codec=codec)
    [info] = _native.validate_batches(batch)
    assert info.compression == codec and info.record_count == 50
    assert [(ts, k, v, h) for _, ts, k, v, h in _native.iter_records(info, batch)] == recs


def test_xerial_snappy_framing():
    """Java and kafka-python frame snappy in xerial blocks; both forms decode."""
    import cramjam
    plain = os.urandom(100) * 50
    block = bytes(cramjam.snappy.compress_raw(plain))
    xerial = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1) + struct.pack(">i", len(block)) + block
    assert _native.decompress(2, xerial) == plain
    assert _native.decompress(2, block) == plain


def test_patch_batch_keeps_crc_valid():
    batch = bytearray(_native.build_batch([(1, b"a", b"b", [])]))
    _native.patch_batch(batch, 0, 123456789, 7)
    [info] = _native.validate_batches(bytes(batch))
    assert info.base_offset == 123456789
    assert struct.unpack_from(">i", batch, 12)[0] == 7


@pytest.mark.parametrize("codec", [0, 4])
def test_validate_corrects_a_wrong_max_timestamp(codec):
    """Sarama sends maxTimestamp -1: validation finds the records' largest
    timestamp and set_max_timestamp writes it into the stored copy with a new CRC."""
    batch = bytearray(_native.build_batch([(1000, b"k", b"a", []), (3000, b"k", b"b", []), (2000, None, b"c", [])],
                                          codec=codec))
    [good] = _native.validate_batches(bytes(batch))
    assert good.max_timestamp == 3000 and not good.max_timestamp_fixed
    struct.pack_into(">q", batch, 35, -1)
    struct.pack_into(">I", batch, 17, _native.crc32c(bytes(batch[21:])))
    [info] = _native.validate_batches(bytes(batch))
    assert info.max_timestamp == 3000 and info.max_timestamp_fixed
    _native.set_max_timestamp(batch, info)
    [fixed] = _native.validate_batches(bytes(batch))
    assert (fixed.max_timestamp, fixed.max_timestamp_fixed) == (3000, False)
    assert bytes(batch) == _native.build_batch([(1000, b"k", b"a", []), (3000, b"k", b"b", []),
                                                (2000, None, b"c", [])], codec=codec)


@pytest.mark.parametrize("mutate,code", [
    (lambda b: b[:30], _native.CORRUPT_MESSAGE),
    (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], _native.CORRUPT_MESSAGE),  # CRC byte
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), _native.CORRUPT_MESSAGE),  # payload byte
    (lambda b: b[:16] + b"\x00" + b[17:], _native.INVALID_RECORD),  # magic 0
    (lambda b: b[:8] + struct.pack(">i", 10) + b[12:], _native.CORRUPT_MESSAGE),  # length below header
    (lambda b: b"", _native.INVALID_RECORD),
])
def test_validate_rejects(mutate, code):
    batch = _native.build_batch([(1, b"k", b"v", [])])
    with pytest.raises(_native.BatchError) as exc:
        _native.validate_batches(mutate(batch))
    assert exc.value.code == code


def test_validate_rejects_unknown_codec_and_control_batches():
    batch = bytearray(_native.build_batch([(1, b"k", b"v", [])]))
    for attrs, code in ((5, _native.UNSUPPORTED_COMPRESSION_TYPE), (0x20, _native.INVALID_RECORD),
                        (0x10, _native.INVALID_RECORD)):
        b = bytearray(batch)
        struct.pack_into(">h", b, 21, attrs)
        struct.pack_into(">I", b, 17, _native.crc32c(bytes(b[21:])))
        with pytest.raises(_native.BatchError) as exc:
            _native.validate_batches(bytes(b))
        assert exc.value.code == code


def test_validate_garbage_never_crashes():
    import random
    rng = random.Random(7)
    good = _native.build_batch([(1, b"k", b"v" * 40, [("h", b"x")])] * 3, codec=0)
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if rng.random() < 0.5:
            struct.pack_into(">I", b, 17, _native.crc32c(bytes(b[21:])))  # CRC ok: reach the record walk
        try:
            _native.validate_batches(bytes(b[: rng.randint(0, len(b))] if rng.random() < 0.2 else b))
        except _native.BatchError:
            pass


@pytest.mark.parametrize("codec", range(5))
def test_decode_columns_matches_iter_records(codec):
    """The columnar decoder (Spark, Iceberg) gives what the record iterator
    gives: nulls, empty values, headers, an offset range cut inside a batch."""
    import random

    rnd = random.Random(codec)
    buf = bytearray()
    base = 100
    for _ in range(4):
        recs = []
        for i in range(rnd.randint(1, 40)):
            key = None if i % 5 == 1 else os.urandom(rnd.randint(0, 30))
            value = None if i % 7 == 2 else os.urandom(rnd.randint(0, 300))
            headers = [(f"h{j}", None if j == 2 else os.urandom(j)) for j in range(i % 4)]
            recs.append((1_700_000_000_000 + i, key, value, headers))
        batch = _native.build_batch(recs, codec=codec, base_offset=base)
        base += len(recs)
        buf += batch
    data = bytes(buf)
    batches = _native.scan_batches(data, True)
    want = [r for b in batches for r in _native.iter_records(b, data) if 103 <= r[0] < base - 5]
    c = _native.decode_columns(data, batches, 103, base - 5)
    assert c["n"] == len(want)
    offsets = struct.unpack(f"<{c['n']}q", c["offset"])
    timestamps = struct.unpack(f"<{c['n']}q", c["timestamp"])
    k_off = struct.unpack(f"<{c['n'] + 1}i", c["key_offsets"])
    v_off = struct.unpack(f"<{c['n'] + 1}i", c["value_offsets"])
    h_off = struct.unpack(f"<{c['n'] + 1}i", c["header_offsets"])
    nh = h_off[-1]
    hk_off = struct.unpack(f"<{nh + 1}i", c["header_key_offsets"])
    hv_off = struct.unpack(f"<{nh + 1}i", c["header_value_offsets"])
    for i, (off, ts, key, value, headers) in enumerate(want):
        assert (offsets[i], timestamps[i]) == (off, ts)
        assert (c["key_data"][k_off[i]:k_off[i + 1]] if c["key_valid"][i] else None) == key
        assert (c["value_data"][v_off[i]:v_off[i + 1]] if c["value_valid"][i] else None) == value
        got = [(c["header_key_data"][hk_off[h]:hk_off[h + 1]].decode(),
                c["header_value_data"][hv_off[h]:hv_off[h + 1]] if c["header_value_valid"][h] else None)
               for h in range(h_off[i], h_off[i + 1])]
        assert got == headers
    assert set(c["timestamp_type"][::4]) == {0}


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_decompression_stops_at_the_limit(codec):
    """A batch that inflates past max_uncompressed is refused with
    MESSAGE_TOO_LARGE, whatever its codec; under the limit it validates."""
    recs = [(1000, b"k", bytes(200_000), [])]
    batch = _native.build_batch(recs, codec=codec)
    assert len(batch) < 20_000  # zeros compress well: a small bomb
    [info] = _native.validate_batches(batch, True, 300_000)
    assert info.record_count == 1
    with pytest.raises(_native.BatchError) as exc:
        _native.validate_batches(batch, True, 100_000)
    assert exc.value.code == 10  # MESSAGE_TOO_LARGE


def test_fixed_dicts_makes_each_row_a_dict_of_its_names_then_the_defaults():
    rows = [(1, 2, 0), (3, 4, 0)]  # a trailing value (a flexible version's tag count) is left out
    got = _native.fixed_dicts(rows, ("a", "b"), {"c": -1})
    assert got == [{"a": 1, "b": 2, "c": -1}, {"a": 3, "b": 4, "c": -1}]
    assert [list(d) for d in got] == [["a", "b", "c"]] * 2, "the names first, then the defaults"
    assert got[0] is not got[1] and _native.fixed_dicts([], ("a",), {}) == []
    with pytest.raises(ValueError):
        _native.fixed_dicts([(1,)], ("a", "b"), {})
    with pytest.raises(TypeError):
        _native.fixed_dicts([[1, 2]], ("a", "b"), {})
