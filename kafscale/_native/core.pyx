# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Hot-path primitives: CRC32C, varints, Kafka RecordBatch v2 parsing,
validation, in-place base-offset patching, segment assembly, record
iteration and compression dispatch.

RecordBatch v2 layout (big-endian), offsets from the batch start:
  0 baseOffset i64 | 8 batchLength i32 | 12 partitionLeaderEpoch i32 |
  16 magic i8 | 17 crc u32 | 21 attributes i16 | 23 lastOffsetDelta i32 |
  27 baseTimestamp i64 | 35 maxTimestamp i64 | 43 producerId i64 |
  51 producerEpoch i16 | 53 baseSequence i32 | 57 recordCount i32 | 61 records
The CRC32C covers bytes 21..end, so patching baseOffset or the leader epoch
never requires recomputing it; correcting maxTimestamp (see validate_batches)
does.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE,
                                PyByteArray_Resize)
from cpython.bytes cimport PyBytes_AsString, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItemWithError
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport INT32_MAX, INT64_MIN, uint8_t, uint32_t, int64_t, uint64_t, int32_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

import zlib

cdef extern from "crc32c_impl.h":
    uint32_t ks_crc32c(uint32_t crc, const uint8_t *p, size_t n, int force_sw) nogil

cdef extern from *:
    """
    static inline uint64_t ks_load_u64(const unsigned char *p) {
        return __atomic_load_n((const uint64_t *)p, __ATOMIC_SEQ_CST);
    }
    static inline void ks_store_u64(unsigned char *p, uint64_t v) {
        __atomic_store_n((uint64_t *)p, v, __ATOMIC_SEQ_CST);
    }
    """
    uint64_t ks_load_u64(const uint8_t *p) nogil
    void ks_store_u64(uint8_t *p, uint64_t v) nogil

# Kafka error codes raised by validation.
CORRUPT_MESSAGE = 2
MESSAGE_TOO_LARGE = 10
INVALID_RECORD = 87
UNSUPPORTED_COMPRESSION_TYPE = 76

BATCH_HEADER_SIZE = 61
LOG_OVERHEAD = 12  # baseOffset + batchLength
# where a v2 batch header's fields that a segment's build reads lie, from the batch's start
cdef enum:
    LAST_OFFSET_DELTA_AT = 23
    BASE_TIMESTAMP_AT = 27
    MAX_TIMESTAMP_AT = 35
    RECORD_COUNT_AT = 57

# The .kfs segment, written only here (assemble_segment, assemble_node) and
# parsed by storage/segment.py (docs/segment-format.md): a header of magic
# u32, version u16, flags u16, base offset i64, records i32, created ms i64
# and 4 zero bytes; the batches; a footer of their CRC32C u32, the last
# offset i64 and the footer magic u32; all big-endian.
cdef enum:
    KFS_HEADER = 32
    KFS_FOOTER = 16
    KFS_VERSION = 1
cdef uint32_t KFS_MAGIC = 0x4B414653  # "KAFS"
cdef uint32_t KFS_END = 0x454E4421  # "END!"
SEGMENT_HEADER_SIZE, SEGMENT_FOOTER_SIZE, SEGMENT_VERSION = KFS_HEADER, KFS_FOOTER, KFS_VERSION
SEGMENT_MAGIC, SEGMENT_FOOTER_MAGIC = KFS_MAGIC, KFS_END

COMPRESSION_NONE = 0
COMPRESSION_GZIP = 1
COMPRESSION_SNAPPY = 2
COMPRESSION_LZ4 = 3
COMPRESSION_ZSTD = 4
CODEC_NAMES = ("none", "gzip", "snappy", "lz4", "zstd")


class BatchError(ValueError):
    """A record batch failed validation; `code` is the Kafka error code."""

    def __init__(self, int code, str message):
        super().__init__(message)
        self.code = code


def atomic_load(const uint8_t[::1] buf, Py_ssize_t pos):
    """Sequentially consistent load of the aligned u64 at `pos` of a buffer
    shared between processes (ring and cache cursors)."""
    if pos < 0 or pos + 8 > buf.shape[0] or pos % 8:
        raise ValueError(f"bad u64 position {pos}")
    return ks_load_u64(&buf[pos])


def atomic_store(uint8_t[::1] buf, Py_ssize_t pos, uint64_t value):
    """Sequentially consistent store of an aligned u64 (see atomic_load)."""
    if pos < 0 or pos + 8 > buf.shape[0] or pos % 8:
        raise ValueError(f"bad u64 position {pos}")
    ks_store_u64(&buf[pos], value)


cdef class RingWriter:
    """A worker's end of its shared-memory produce ring (kafscale/broker/shm.py):
    reserves room at the head (the u64 at 0 of the header; the log process
    moves the tail, the u64 at 8) and copies a payload in, in one call.
    Positions are absolute byte counts; a payload never wraps."""
    cdef uint8_t[::1] _header
    cdef uint8_t[::1] _data
    cdef Py_ssize_t size

    def __cinit__(self, uint8_t[::1] header not None, uint8_t[::1] data not None):
        if header.shape[0] < 16 or data.shape[0] == 0:
            raise ValueError("a ring needs a 16-byte header and room for data")
        self._header = header
        self._data = data
        self.size = data.shape[0]

    cdef int64_t _alloc(self, Py_ssize_t n) noexcept:
        cdef uint8_t *h = &self._header[0]
        cdef int64_t head = <int64_t>ks_load_u64(h), start = head, tail
        cdef int64_t off = start % self.size
        if n > self.size:
            return -1
        if off + n > self.size:
            start += self.size - off
        tail = <int64_t>ks_load_u64(h + 8)
        # what [start, start+n) overwrites is the previous lap's [start-size, start+n-size):
        # free unless live payloads [tail, head) reach into it
        if tail < head and start + n - self.size > tail:
            return -1
        ks_store_u64(h, <uint64_t>(start + n))
        return start

    def put(self, const uint8_t[::1] payload not None):
        """Reserve room for payload and copy it in: its absolute position, or None when full."""
        cdef Py_ssize_t n = payload.shape[0]
        cdef int64_t start = self._alloc(n)
        if start < 0:
            return None
        if n:
            memcpy(&self._data[start % self.size], &payload[0], n)
        return start


cdef class RingReader:
    """The log process's end of a produce ring (kafscale/broker/shm.py): the
    payloads it holds, in the order the worker wrote them. Releasing the
    oldest one moves the tail (the u64 at 8 of the header) past it and past
    every later one released already, so the worker may write there again;
    with none held, the tail is where the newest one ended."""
    cdef uint8_t[::1] _header
    cdef object _data  # a memoryview: a payload is a slice of it
    cdef Py_ssize_t size
    cdef int64_t *_starts  # the positions of the payloads held, by sequence number modulo _cap
    cdef uint8_t *_released
    cdef int64_t _cap, _first, _next  # sequence numbers of the oldest held and of the next one
    cdef int64_t _end  # where the newest payload held ends
    cdef dict _seqs  # position -> sequence number, of each payload held

    def __cinit__(self, uint8_t[::1] header not None, data not None):
        if header.shape[0] < 16:
            raise ValueError("a ring needs a 16-byte header")
        self._header = header
        self._data = memoryview(data)
        self.size = len(self._data)
        self._seqs = {}
        self._end = <int64_t>ks_load_u64(&header[8])
        self._alloc(1024)

    def __dealloc__(self):
        free(self._starts)
        free(self._released)

    cdef int _alloc(self, int64_t cap) except -1:
        """Room for cap payloads, those held kept at their sequence numbers modulo cap."""
        cdef int64_t *starts = <int64_t *>malloc(cap * sizeof(int64_t))
        cdef uint8_t *released = <uint8_t *>malloc(cap)
        cdef int64_t seq
        if starts == NULL or released == NULL:
            free(starts)
            free(released)
            raise MemoryError()
        for seq in range(self._first, self._next):
            starts[seq % cap] = self._starts[seq % self._cap]
            released[seq % cap] = self._released[seq % self._cap]
        free(self._starts)
        free(self._released)
        self._starts, self._released, self._cap = starts, released, cap
        return 0

    def hold(self, int64_t start, Py_ssize_t n):
        """track, with what releases the payload: (view, release())."""
        return self._hold(start, n)

    cdef tuple _hold(self, int64_t start, Py_ssize_t n):
        return self._track(start, n), _release_of(self, start)

    def track(self, int64_t start, Py_ssize_t n):
        """Hold the payload the worker wrote at start (n bytes): a view of it."""
        return self._track(start, n)

    cdef object _track(self, int64_t start, Py_ssize_t n):
        cdef int64_t i, off = start % self.size
        if off + n > self.size or n < 0:
            raise ValueError(f"no payload of {n} bytes at {start}")
        if self._next - self._first == self._cap:
            self._alloc(2 * self._cap)
        i = self._next % self._cap
        self._starts[i] = start
        self._released[i] = 0
        self._seqs[start] = self._next
        self._next += 1
        self._end = start + n
        return self._data[off:off + n]

    cpdef release(self, int64_t start):
        """The payload at start is no longer needed (KeyError: it is not held)."""
        cdef int64_t seq = self._seqs.pop(start)
        self._released[seq % self._cap] = 1
        while self._first < self._next and self._released[self._first % self._cap]:
            self._first += 1
        ks_store_u64(&self._header[8], <uint64_t>(self._starts[self._first % self._cap] if self._first < self._next
                                                  else self._end))


def hold_produce(list calls, list readers, object refused):
    """The requests of a worker's produce calls (messages.ProduceCall, in the
    order it staged their payloads), each payload held in its ring: a list of
    (acks, timeout_ms, transactional_id, [(topic, [(partition, payload)])])
    where a payload is (view, release()) as RingReader.hold gives it, or what
    refused(p) makes of a payload the worker refused (not a tuple). One call
    for all: about 6,600 instructions a one-partition request fewer than the
    same loops in Python (bench/history.md, session 92)."""
    cdef list reqs = [], topics, parts
    cdef RingReader reader
    cdef Py_ssize_t slot
    cdef int64_t start
    for call in calls:
        _, _, _, _, _, acks, timeout_ms, transactional_id, named = call
        topics = []
        for name, partitions in named:
            parts = []
            for index, payload in partitions:
                if isinstance(payload, tuple):
                    slot, start, n = payload
                    if not 0 <= slot < len(readers):
                        raise ValueError(f"no ring {slot}")
                    reader = readers[slot]
                    parts.append((index, reader._hold(start, n)))
                else:
                    parts.append((index, refused(payload)))
            topics.append((name, parts))
        reqs.append((acks, timeout_ms, transactional_id, topics))
    return reqs


cdef class _Release:
    """Releases one payload a RingReader holds, when called (a cheaper functools.partial)."""
    cdef RingReader reader
    cdef int64_t start

    def __call__(self):
        self.reader.release(self.start)


cdef inline _Release _release_of(RingReader reader, int64_t start):
    """A _Release made without a Python call (its arguments parsed: a third of a hold)."""
    cdef _Release r = _Release.__new__(_Release)
    r.reader, r.start = reader, start
    return r


cdef uint32_t _crc(const uint8_t[::1] data, uint32_t crc, int force_sw):
    if data.shape[0] == 0:
        return crc
    with nogil:
        crc = ks_crc32c(crc, &data[0], data.shape[0], force_sw)
    return crc


def crc32c(const uint8_t[::1] data, uint32_t crc=0):
    """CRC32C of `data`, continuing from `crc` (0 to start)."""
    return _crc(data, crc, 0)


def crc32c_portable(const uint8_t[::1] data, uint32_t crc=0):
    """CRC32C computed with the table path only (used to test the fast path)."""
    return _crc(data, crc, 1)


cdef inline int64_t rd_i64(const uint8_t *p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(8):
        v = (v << 8) | p[i]
    return <int64_t>v


cdef inline int32_t rd_i32(const uint8_t *p) noexcept nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3])


cdef inline int rd_i16(const uint8_t *p) noexcept nogil:
    return <short>((p[0] << 8) | p[1])


cdef inline void wr_i64(uint8_t *p, int64_t value) noexcept nogil:
    cdef uint64_t v = <uint64_t>value
    cdef int i
    for i in range(7, -1, -1):
        p[i] = v & 0xff
        v >>= 8


cdef inline void wr_i32(uint8_t *p, int32_t value) noexcept nogil:
    cdef uint32_t v = <uint32_t>value
    p[0] = (v >> 24) & 0xff
    p[1] = (v >> 16) & 0xff
    p[2] = (v >> 8) & 0xff
    p[3] = v & 0xff


cdef inline void wr_i16(uint8_t *p, int value) noexcept nogil:
    p[0] = (value >> 8) & 0xff
    p[1] = value & 0xff


cdef inline Py_ssize_t rd_uvarint(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, uint64_t *out) noexcept nogil:
    """Unsigned varint; returns the new position or -1 when malformed."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef uint8_t b
    while True:
        if pos >= end or shift > 63:
            return -1
        b = p[pos]
        pos += 1
        v |= (<uint64_t>(b & 0x7f)) << shift
        if not (b & 0x80):
            break
        shift += 7
    out[0] = v
    return pos


cdef inline Py_ssize_t rd_varlong(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, int64_t *out) noexcept nogil:
    """Zig-zag varint; returns the new position or -1 when malformed."""
    cdef uint64_t v
    pos = rd_uvarint(p, pos, end, &v)
    if pos >= 0:
        out[0] = <int64_t>(v >> 1) ^ -(<int64_t>(v & 1))
    return pos


def decode_varint(const uint8_t[::1] data, Py_ssize_t pos=0):
    """Decode one zig-zag varint; returns (value, new_pos)."""
    cdef int64_t v
    cdef Py_ssize_t n = rd_varlong(&data[0] if data.shape[0] else NULL, pos, data.shape[0], &v)
    if n < 0:
        raise ValueError("malformed varint")
    return v, n


def encode_varint(int64_t value):
    """Zig-zag varint bytes of `value`."""
    cdef uint64_t v = (<uint64_t>value << 1) ^ <uint64_t>(value >> 63)
    cdef uint8_t buf[10]
    cdef int n = 0
    while v >= 0x80:
        buf[n] = (v & 0x7f) | 0x80
        v >>= 7
        n += 1
    buf[n] = v
    return bytes(buf[:n + 1])


cdef Py_ssize_t walk_records(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, int32_t count,
                             int64_t *max_ts_delta) noexcept nogil:
    """Check that `count` records exist back to back in [pos, end) with
    offset deltas 0..count-1, and store the largest timestamp delta in
    max_ts_delta. Returns 0 when valid, else a negative reason."""
    cdef int64_t length, v, n_headers, klen
    cdef Py_ssize_t rec_end, q
    cdef int32_t i, h
    max_ts_delta[0] = INT64_MIN
    for i in range(count):
        pos = rd_varlong(p, pos, end, &length)
        if pos < 0 or length < 0 or pos + length > end:
            return -1
        rec_end = pos + length
        q = pos + 1  # attributes
        q = rd_varlong(p, q, rec_end, &v)  # timestamp delta
        if q < 0:
            return -2
        if v > max_ts_delta[0]:
            max_ts_delta[0] = v
        q = rd_varlong(p, q, rec_end, &v)  # offset delta
        if q < 0 or v != i:
            return -3
        q = rd_varlong(p, q, rec_end, &klen)  # key
        if q < 0 or klen < -1 or (klen > 0 and q + klen > rec_end):
            return -4
        if klen > 0:
            q += klen
        q = rd_varlong(p, q, rec_end, &klen)  # value
        if q < 0 or klen < -1 or (klen > 0 and q + klen > rec_end):
            return -5
        if klen > 0:
            q += klen
        q = rd_varlong(p, q, rec_end, &n_headers)
        if q < 0 or n_headers < 0:
            return -6
        for h in range(n_headers):
            q = rd_varlong(p, q, rec_end, &klen)
            if q < 0 or klen < 0 or q + klen > rec_end:
                return -7
            q += klen
            q = rd_varlong(p, q, rec_end, &klen)
            if q < 0 or klen < -1 or (klen > 0 and q + klen > rec_end):
                return -8
            if klen > 0:
                q += klen
        if q != rec_end:
            return -9
        pos = rec_end
    if pos != end:
        return -10
    return 0


def decompress(int codec, data, Py_ssize_t limit=-1):
    """Decompress a batch's records section for `codec` (attributes & 7).
    With limit >= 0, raises BatchError(MESSAGE_TOO_LARGE) as soon as the
    output would exceed limit bytes: at most limit + one chunk is ever held
    (a 32 KB zstd batch can claim a 1 GiB record)."""
    if codec == COMPRESSION_NONE:
        return bytes(data)
    if codec == COMPRESSION_GZIP:
        d = zlib.decompressobj(47)  # gzip or zlib header, auto-detected
        out = d.decompress(data, limit + 1 if limit >= 0 else 0)
        if limit >= 0 and (len(out) > limit or d.unconsumed_tail):
            raise _too_large(codec, limit)
        return out + d.flush()
    if codec == COMPRESSION_SNAPPY:
        return _snappy_decompress(data, limit)
    if codec == COMPRESSION_LZ4:
        import lz4.frame
        if limit < 0:
            return lz4.frame.decompress(data)
        d = lz4.frame.LZ4FrameDecompressor()
        out = d.decompress(data, max_length=limit + 1)
        if len(out) > limit or not d.eof:
            raise _too_large(codec, limit)
        return out
    if codec == COMPRESSION_ZSTD:
        import io
        import zstandard
        if limit < 0:
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        parts, n = [], 0
        while chunk := reader.read(min(limit + 1 - n, 1 << 20) or 1):
            parts.append(chunk)
            n += len(chunk)
            if n > limit:
                raise _too_large(codec, limit)
        return b"".join(parts)
    raise BatchError(UNSUPPORTED_COMPRESSION_TYPE, f"unknown compression codec {codec}")


def _too_large(int codec, Py_ssize_t limit):
    return BatchError(MESSAGE_TOO_LARGE, f"{CODEC_NAMES[codec]} records decompress to more than {limit} bytes")


def compress(int codec, data):
    """Compress a records section the way Kafka producers do."""
    if codec == COMPRESSION_NONE:
        return bytes(data)
    if codec == COMPRESSION_GZIP:
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()
    if codec == COMPRESSION_SNAPPY:
        import cramjam
        return bytes(cramjam.snappy.compress_raw(data))
    if codec == COMPRESSION_LZ4:
        import lz4.frame
        return lz4.frame.compress(data)
    if codec == COMPRESSION_ZSTD:
        import zstandard
        return zstandard.ZstdCompressor().compress(data)
    raise BatchError(UNSUPPORTED_COMPRESSION_TYPE, f"unknown compression codec {codec}")


_XERIAL_MAGIC = b"\x82SNAPPY\x00"


cdef Py_ssize_t _snappy_raw_length(const uint8_t[::1] buf):
    """The uncompressed length a raw snappy block declares (its leading varint)."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef Py_ssize_t i
    for i in range(min(buf.shape[0], 10)):
        v |= <uint64_t>(buf[i] & 0x7F) << shift
        if buf[i] < 0x80:
            return <Py_ssize_t>v
        shift += 7
    raise BatchError(CORRUPT_MESSAGE, "malformed snappy length")


def _snappy_decompress(data, Py_ssize_t limit=-1):
    """Raw snappy, or the xerial block framing that Java/kafka-python write;
    each block's declared length counts against limit before it is inflated."""
    import cramjam
    buf = bytes(data)
    if not buf.startswith(_XERIAL_MAGIC):
        if limit >= 0 and _snappy_raw_length(buf) > limit:
            raise _too_large(COMPRESSION_SNAPPY, limit)
        return bytes(cramjam.snappy.decompress_raw(buf))
    out = []
    cdef Py_ssize_t total = 0
    pos = 16  # magic(8) + version(4) + compatible version(4)
    while pos < len(buf):
        if pos + 4 > len(buf):
            raise BatchError(CORRUPT_MESSAGE, "truncated xerial snappy block")
        n = int.from_bytes(buf[pos:pos + 4], "big")
        pos += 4
        block = buf[pos:pos + n]
        if limit >= 0:
            total += _snappy_raw_length(block)
            if total > limit:
                raise _too_large(COMPRESSION_SNAPPY, limit)
        out.append(bytes(cramjam.snappy.decompress_raw(block)))
        pos += n
    return b"".join(out)


cdef class BatchInfo:
    """Header fields of one RecordBatch located at `position` in a buffer."""
    cdef readonly Py_ssize_t position
    cdef readonly Py_ssize_t size
    cdef readonly int64_t base_offset
    cdef readonly int32_t last_offset_delta
    cdef readonly int attributes
    cdef readonly int64_t base_timestamp
    cdef readonly int64_t max_timestamp
    cdef readonly int64_t producer_id
    cdef readonly int producer_epoch
    cdef readonly int32_t base_sequence
    cdef readonly int32_t record_count
    cdef readonly uint32_t crc
    # validate_batches found the header's maxTimestamp wrong (Sarama sends -1)
    # and put the records' largest timestamp in max_timestamp: the stored
    # batch must get it too (set_max_timestamp)
    cdef readonly bint max_timestamp_fixed

    @property
    def compression(self):
        return self.attributes & 7

    @property
    def last_offset(self):
        return self.base_offset + self.last_offset_delta

    @property
    def is_control(self):
        return bool(self.attributes & 0x20)

    @property
    def is_transactional(self):
        return bool(self.attributes & 0x10)

    def __repr__(self):
        return (f"BatchInfo(position={self.position}, size={self.size}, base_offset={self.base_offset}, "
                f"records={self.record_count}, codec={CODEC_NAMES[self.attributes & 7] if (self.attributes & 7) < 5 else '?'})")


cdef Py_ssize_t batch_size(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end) except -1:
    """The size of the v2 batch at p + pos (of a buffer ending at p + end), its length and magic checked."""
    cdef Py_ssize_t avail = end - pos
    cdef int32_t batch_len
    if avail < LOG_OVERHEAD:
        raise BatchError(CORRUPT_MESSAGE, f"truncated batch at byte {pos}: {avail} bytes left")
    batch_len = rd_i32(p + pos + 8)
    if batch_len < BATCH_HEADER_SIZE - LOG_OVERHEAD:
        raise BatchError(CORRUPT_MESSAGE, f"batch length {batch_len} below the v2 header size")
    if batch_len > avail - LOG_OVERHEAD:
        raise BatchError(CORRUPT_MESSAGE, f"batch length {batch_len} exceeds the {avail - LOG_OVERHEAD} bytes present")
    if p[pos + 16] != 2:
        raise BatchError(INVALID_RECORD, f"record batch magic {p[pos + 16]} is not supported (only v2)")
    return batch_len + LOG_OVERHEAD


cdef BatchInfo read_header(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, bint verify):
    cdef uint32_t actual
    cdef Py_ssize_t size = batch_size(p, pos, end)
    cdef BatchInfo b = BatchInfo.__new__(BatchInfo)
    b.position = pos
    b.size = size
    b.base_offset = rd_i64(p + pos)
    b.crc = <uint32_t>rd_i32(p + pos + 17)
    b.attributes = rd_i16(p + pos + 21)
    b.last_offset_delta = rd_i32(p + pos + LAST_OFFSET_DELTA_AT)
    b.base_timestamp = rd_i64(p + pos + BASE_TIMESTAMP_AT)
    b.max_timestamp = rd_i64(p + pos + MAX_TIMESTAMP_AT)
    b.producer_id = rd_i64(p + pos + 43)
    b.producer_epoch = rd_i16(p + pos + 51)
    b.base_sequence = rd_i32(p + pos + 53)
    b.record_count = rd_i32(p + pos + RECORD_COUNT_AT)
    if verify:
        with nogil:
            actual = ks_crc32c(0, p + pos + 21, b.size - 21, 0)
        if actual != b.crc:
            raise BatchError(CORRUPT_MESSAGE, f"batch CRC mismatch: stored {b.crc:#010x}, computed {actual:#010x}")
    return b


def scan_batches(buf, bint verify=False, bint partial=False):
    """Headers of every RecordBatch packed back to back in `buf`.

    With verify, each CRC is checked. With partial, an incomplete batch at
    the end (a ranged read that stopped mid-batch) ends the scan instead of
    being an error. Raises BatchError on any defect. `buf` is taken
    through the buffer protocol (the log process scans every partition
    batch: a typed memoryview argument made an object each call)."""
    cdef Py_buffer view
    cdef Py_ssize_t pos = 0, end
    cdef const uint8_t *p
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        p, end = <const uint8_t *>view.buf, view.len
        out = []
        while pos < end:
            if partial and (end - pos < BATCH_HEADER_SIZE or rd_i32(p + pos + 8) + LOG_OVERHEAD > end - pos):
                break
            b = read_header(p, pos, end, verify)
            out.append(b)
            pos += b.size
        return out
    finally:
        PyBuffer_Release(&view)


def validate_batches(const uint8_t[::1] buf, bint deep_compressed=True, Py_ssize_t max_uncompressed=-1):
    """Validate a produce payload: CRCs, headers, and record framing.

    Uncompressed batches have every record walked. Compressed ones are
    decompressed (to at most max_uncompressed bytes, unless negative) and
    walked too when deep_compressed is set. Returns the
    BatchInfo list; raises BatchError (with a Kafka error code). A walked
    batch whose header maxTimestamp is not its records' largest timestamp
    comes back with the right one and max_timestamp_fixed set."""
    cdef Py_ssize_t end = buf.shape[0]
    cdef const uint8_t *p
    cdef int rc
    cdef const uint8_t[::1] inner
    if end == 0:
        raise BatchError(INVALID_RECORD, "empty record set")
    p = &buf[0]
    batches = scan_batches(buf, True)
    cdef BatchInfo b
    cdef int64_t max_delta
    for b in batches:
        if b.record_count <= 0:
            raise BatchError(INVALID_RECORD, f"batch declares {b.record_count} records")
        if b.last_offset_delta != b.record_count - 1:
            raise BatchError(INVALID_RECORD, f"lastOffsetDelta {b.last_offset_delta} does not match {b.record_count} records")
        if b.is_control or b.is_transactional:
            raise BatchError(INVALID_RECORD, "transactional and control batches are not supported")
        codec = b.attributes & 7
        if codec > 4:
            raise BatchError(UNSUPPORTED_COMPRESSION_TYPE, f"unknown compression codec {codec}")
        if codec == 0:
            rc = walk_records(p, b.position + BATCH_HEADER_SIZE, b.position + b.size, b.record_count, &max_delta)
        elif deep_compressed:
            try:
                plain = decompress(codec, buf[b.position + BATCH_HEADER_SIZE:b.position + b.size], max_uncompressed)
            except BatchError:
                raise
            except Exception as exc:
                raise BatchError(CORRUPT_MESSAGE, f"{CODEC_NAMES[codec]} payload does not decompress: {exc}")
            inner = plain
            rc = walk_records(&inner[0] if inner.shape[0] else NULL, 0, inner.shape[0], b.record_count, &max_delta)
        else:
            continue  # records not walked: the header's maxTimestamp stands
        if rc != 0:
            raise BatchError(INVALID_RECORD, f"malformed record framing in batch at byte {b.position} (reason {-rc})")
        # As Kafka does on append: the batch's maxTimestamp is its records' largest.
        if b.base_timestamp + max_delta != b.max_timestamp:
            b.max_timestamp = b.base_timestamp + max_delta
            b.max_timestamp_fixed = True
    return batches


def set_max_timestamp(uint8_t[::1] buf, BatchInfo b):
    """Write b.max_timestamp into the header of the batch at b.position of buf
    (a copy of what b was validated from) and recompute its CRC32C."""
    if b.position < 0 or b.position + b.size > buf.shape[0]:
        raise IndexError("batch out of range")
    _write_max_timestamp(&buf[b.position], b)


cdef void _write_max_timestamp(uint8_t *p, BatchInfo b) noexcept:
    """b.max_timestamp into the batch header at p, and its CRC32C again."""
    wr_i64(p + MAX_TIMESTAMP_AT, b.max_timestamp)
    cdef uint32_t crc
    with nogil:
        crc = ks_crc32c(0, p + 21, b.size - 21, 0)
    wr_i32(p + 17, <int32_t>crc)
    b.crc = crc


def patch_batch(uint8_t[::1] buf, Py_ssize_t position, int64_t base_offset, int32_t leader_epoch):
    """Write the assigned base offset and leader epoch into a batch in place.
    Neither field is covered by the batch CRC."""
    if position < 0 or position + BATCH_HEADER_SIZE > buf.shape[0]:
        raise IndexError("batch position out of range")
    wr_i64(&buf[position], base_offset)
    wr_i32(&buf[position + 12], leader_epoch)


cdef struct _SegStats:
    int64_t count  # records
    int64_t min_ts  # smallest base timestamp
    int64_t max_ts  # largest max timestamp
    int64_t last_offset


cdef struct _Tab:
    int64_t *bases  # of each batch placed, its base offset
    int64_t *positions  # and its position (from the segment's start)
    Py_ssize_t n, cap


cdef int _tab_add(_Tab *t, int64_t base, int64_t position) except -1:
    cdef Py_ssize_t cap
    cdef int64_t *grown
    if t.n == t.cap:
        cap = max(2 * t.cap, 16)
        grown = <int64_t *>realloc(t.bases, cap * sizeof(int64_t))
        if grown == NULL:
            raise MemoryError()
        t.bases = grown
        grown = <int64_t *>realloc(t.positions, cap * sizeof(int64_t))
        if grown == NULL:
            raise MemoryError()
        t.positions, t.cap = grown, cap
    t.bases[t.n], t.positions[t.n] = base, position
    t.n += 1
    return 0


cdef Py_ssize_t _place_batches(uint8_t *d, Py_ssize_t pos, object payload, int64_t base, Py_ssize_t origin,
                               _SegStats *st, _Tab *tab) except -1:
    """Copy a payload's batches to d + pos, each with its base offset patched
    in (from `base` on) and its leader epoch zeroed; adds each one's base
    offset and position (from `origin`) to tab; returns where they end. The
    payload's bytes are taken through the buffer protocol and each header is
    read in place: with a typed memoryview (an object a payload) and
    read_header (a BatchInfo a batch), assemble_segment of 1,000 one-batch
    parts took 397 us, 290 without (bench/history.md, session 93). The tables
    are C arrays, not lists of Python ints (assemble_node of 1,000 slices
    1,565 -> 1,533 us, session 94)."""
    cdef Py_buffer view
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        return _place_bytes(d, pos, <const uint8_t *>view.buf, view.len, base, origin, st, tab)
    finally:
        PyBuffer_Release(&view)


cdef Py_ssize_t _place_bytes(uint8_t *d, Py_ssize_t pos, const uint8_t *src, Py_ssize_t n, int64_t base,
                             Py_ssize_t origin, _SegStats *st, _Tab *tab) except -1:
    """_place_batches of the n bytes at src."""
    cdef uint8_t *b
    cdef Py_ssize_t at = 0, size
    cdef int64_t ts
    if n:
        memcpy(d + pos, src, n)
    while at < n:
        size = batch_size(d + pos, at, n)
        b = d + pos + at
        wr_i64(b, base)
        wr_i32(b + 12, 0)
        _tab_add(tab, base, pos + at - origin)
        st.count += rd_i32(b + RECORD_COUNT_AT)
        ts = rd_i64(b + BASE_TIMESTAMP_AT)
        if ts < st.min_ts:
            st.min_ts = ts
        ts = rd_i64(b + MAX_TIMESTAMP_AT)
        if ts > st.max_ts:
            st.max_ts = ts
        st.last_offset = base + rd_i32(b + LAST_OFFSET_DELTA_AT)
        base = st.last_offset + 1
        at += size
    return pos + n


cdef inline void _start_stats(_SegStats *st) noexcept nogil:
    st.count = 0
    st.min_ts = 0x7FFFFFFFFFFFFFFF
    st.max_ts = -1
    st.last_offset = -1


cdef void _seal_segment(uint8_t *d, Py_ssize_t end, _SegStats *st, int64_t first, int64_t created_ms
                        ) noexcept nogil:
    """Write the header and footer of the segment at d whose batches end at d + end."""
    wr_i32(d, <int32_t>KFS_MAGIC)
    wr_i16(d + 4, KFS_VERSION)
    wr_i16(d + 6, 0)  # flags
    wr_i64(d + 8, first)
    wr_i32(d + 16, <int32_t>st.count)
    wr_i64(d + 20, created_ms)
    wr_i32(d + 28, 0)
    wr_i32(d + end, <int32_t>ks_crc32c(0, d + KFS_HEADER, end - KFS_HEADER, 0))
    wr_i64(d + end + 4, st.last_offset)
    wr_i32(d + end + 12, <int32_t>KFS_END)


def assemble_segment(list parts, int64_t created_ms, Py_ssize_t index_interval):
    """A whole segment, its batches copied once into a new buffer: `parts`
    are (payload, assigned base offset) pairs, a payload holding one or more
    batches back to back. Each batch gets its base offset patched in and its
    leader epoch zeroed, and an index entry (offset i64, position i32,
    big-endian) names the first batch and then each batch starting
    index_interval or more bytes after the last named one. Returns (buffer,
    batches, their tables (_tables: base offsets, then positions: a cache
    entry's, as assemble_node gives a slice's), index entries, records,
    smallest base timestamp, largest max timestamp, last offset); with no
    batches at all, the buffer holds no header or footer. Lists of Python
    ints for the tables, packed again for the cache by each compaction,
    had 4% of the compaction's samples at 1,000 partitions (bench/history.md,
    session 95)."""
    cdef Py_ssize_t total = 0, pos = KFS_HEADER
    cdef _SegStats st
    cdef _Tab tab = _Tab(NULL, NULL, 0, 0)
    _start_stats(&st)
    for payload, base_obj in parts:
        total += len(payload)
    data = _unfilled(KFS_HEADER + total + KFS_FOOTER)
    try:
        for payload, base_obj in parts:
            pos = _place_batches(<uint8_t *>PyByteArray_AS_STRING(data), pos, payload, base_obj, 0, &st, &tab)
        return _sealed(data, pos, &st, &tab, created_ms, index_interval)
    finally:
        _tab_free(&tab)


def assemble_cached(dict objects, list manifests, int64_t floor, ring, Py_ssize_t size, int64_t created_ms,
                    Py_ssize_t index_interval):
    """assemble_segment of the batches of the segments these manifests name
    in a shared cache (cached_batches' arguments), each from its manifest's
    base offset on, copied straight out of the ring; None if one of them is
    not cached (or was overwritten). A compaction's slices went through a
    memoryview each (0.5 us to make) and a list of pairs first
    (bench/history.md, session 97)."""
    cdef Py_ssize_t n = len(manifests), i, total = 0, pos = KFS_HEADER, got
    cdef int64_t *at = <int64_t *>malloc(sizeof(int64_t) * 2 * n + 1)
    cdef _SegStats st
    cdef _Tab tab = _Tab(NULL, NULL, 0, 0)
    cdef Py_buffer view
    cdef const uint8_t *r
    cdef PyObject *placed
    if at == NULL:
        raise MemoryError()
    _start_stats(&st)
    try:
        for i in range(n):
            if _cache_entry(objects, manifests[i], floor, &at[2 * i], &got, &placed) < 0:
                return None
            if got < KFS_HEADER + KFS_FOOTER:
                raise ValueError(f"a cached segment of {got} bytes")
            at[2 * i + 1] = got - KFS_HEADER - KFS_FOOTER
            total += at[2 * i + 1]
        data = _unfilled(KFS_HEADER + total + KFS_FOOTER)
        PyObject_GetBuffer(ring, &view, PyBUF_SIMPLE)
        try:
            r = <const uint8_t *>view.buf
            for i in range(n):
                pos = _place_bytes(<uint8_t *>PyByteArray_AS_STRING(data), pos, r + at[2 * i] % size + KFS_HEADER,
                                   at[2 * i + 1], manifests[i].base, 0, &st, &tab)
        finally:
            PyBuffer_Release(&view)
        return _sealed(data, pos, &st, &tab, created_ms, index_interval)
    finally:
        free(at)
        _tab_free(&tab)


cdef tuple _sealed(bytearray data, Py_ssize_t end, _SegStats *st, _Tab *tab, int64_t created_ms,
                   Py_ssize_t index_interval):
    """assemble_segment's result, once the batches are placed in data (up to end)."""
    cdef Py_ssize_t i, last_indexed = -index_interval
    cdef uint8_t *d = <uint8_t *>PyByteArray_AS_STRING(data)
    cdef uint8_t entry[12]
    entries = bytearray()
    for i in range(tab.n):
        if tab.positions[i] - last_indexed >= index_interval:
            wr_i64(entry, tab.bases[i])
            wr_i32(entry + 8, <int32_t>tab.positions[i])
            entries += entry[:12]
            last_indexed = tab.positions[i]
    if tab.n:
        with nogil:
            _seal_segment(d, end, st, tab.bases[0], created_ms)
    else:
        memset(d, 0, PyByteArray_GET_SIZE(data))
    return data, tab.n, _tables(tab), bytes(entries), st.count, st.min_ts, st.max_ts, st.last_offset


cdef bytearray _unfilled(Py_ssize_t n):
    """A bytearray of n bytes not zeroed first, for a caller that writes
    every one of them (a segment's header, batches and footer, or a node
    object's slices back to back): zeroing each node object's megabyte
    first had 1.3% of py-spy's samples of bench.logproc at 1,000
    partitions (bench/history.md, session 94)."""
    return PyByteArray_FromStringAndSize(NULL, n)


cdef void _tab_free(_Tab *t) noexcept:
    free(t.bases)
    free(t.positions)


cdef bytes _tables(const _Tab *t):
    """A cache entry's tables (shm.CacheRef): every base offset, then every
    position, as native-endian 8-byte integers."""
    out = PyBytes_FromStringAndSize(NULL, 16 * t.n)
    memcpy(<char *>out, t.bases, 8 * t.n)
    memcpy(<char *>out + 8 * t.n, t.positions, 8 * t.n)
    return out


cdef inline Py_ssize_t _put_int(uint8_t *d, int64_t v) noexcept nogil:
    """Write v in decimal at d; returns the characters written (at most 20)."""
    cdef uint8_t digits[20]
    cdef uint64_t u = <uint64_t>v
    cdef Py_ssize_t n = 0, sign = 0, i
    if v < 0:
        d[0] = 45  # '-'
        sign = 1
        u = 0 - u
    while True:
        digits[n] = 48 + <uint8_t>(u % 10)
        n += 1
        u //= 10
        if not u:
            break
    for i in range(n):
        d[sign + i] = digits[n - 1 - i]
    return sign + n


cdef Py_ssize_t _put_row(bytearray out, Py_ssize_t used, const int64_t *vals, bytes extra) except -1:
    """Append a directory row (directory_rows) to out[:used], a comma before
    it unless it is the first: the nine numbers, then extra (JSON) unless
    empty. Returns where it ends; out grows as needed."""
    cdef Py_ssize_t n = len(extra), i
    cdef Py_ssize_t need = used + 3 + 9 * 21 + n
    cdef uint8_t *d
    if need > PyByteArray_GET_SIZE(out):
        PyByteArray_Resize(out, 2 * need)
    d = <uint8_t *>PyByteArray_AS_STRING(out)
    if used:
        d[used] = 44  # ','
        used += 1
    d[used] = 91  # '['
    used += 1
    for i in range(9):
        if i:
            d[used] = 44
            used += 1
        used += _put_int(d + used, vals[i])
    if n:
        d[used] = 44
        memcpy(d + used + 1, <const char *>extra, n)
        used += 1 + n
    d[used] = 93  # ']'
    return used + 1


cdef inline int64_t _place(dict places, str topic) except -1:
    """The topic's place among a directory's topics (a new one gets the next)."""
    place = places.get(topic)
    if place is None:
        place = places[topic] = len(places)
    return place


def directory_rows(list slices, dict places, dumps):
    """The rows of a node or shared object's directory (storage/wal.py
    `directory`; docs/segment-format.md), comma-separated: a slice's row is
    [topic place, partition, base, last, count, pos, size, min_ts, max_ts]
    from its `log` (topic, partition) and `manifest`, with its manifest's
    producers as a tenth element (dumps(producers)) if it has any. A topic
    not in `places` yet gets the next place there. Formatted here: an
    f-string a row took the log process about 9,000 instructions a slice,
    a twentieth of a Produce request's at 1,000 partitions."""
    cdef int64_t vals[9]
    cdef Py_ssize_t used = 0
    out = bytearray(200 * len(slices))
    for s in slices:
        lg, m = s.log, s.manifest
        vals[0], vals[1], vals[2], vals[3] = _place(places, lg.topic), lg.partition, m.base, m.last
        vals[4], vals[5], vals[6], vals[7], vals[8] = m.count, m.pos, m.size, m.min_ts, m.max_ts
        used = _put_row(out, used, vals, dumps(m.producers).encode() if m.producers else b"")
    PyByteArray_Resize(out, used)
    return out


cdef class AckSet:
    """The native core of produce_api.Acks: responses waiting for their
    batches' durability (expect), each answered once (answer: a batch
    durable leaves its response as it is, a failed one is passed to the
    subclass's failed(token, exc)), and `waiter`, a future set once none is
    left. Pending.answer calls an AckSet's answer without a Python call
    (bench/history.md, session 94)."""
    cdef dict _left  # id(response) -> response
    cdef public object waiter

    def __cinit__(self):
        self._left = {}

    def expect(self, r):
        """Wait for r (before its batch is appended: a duplicate of a committed one is answered at once)."""
        self._left[id(r)] = r
        return self, r

    def forget(self, r):
        """r's batch was not appended after all."""
        self._left.pop(id(r), None)

    def answer(self, token, exc):
        self._answer(token, exc)

    cdef _answer(self, token, exc):
        if self._left.pop(id(token), None) is None:  # answered already, or timed out
            return
        if exc is not None:
            self.failed(token, exc)
        if not self._left and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def waiting(self):
        """Whether any response is still waiting."""
        return bool(self._left)

    def give_up(self):
        """The responses still waiting, which wait no more."""
        left = list(self._left.values())
        self._left.clear()
        return left


cdef class Pending:
    """One produce's batches queued in a partition log (storage/partition.py)
    until the object holding them is durable: their bytes (`payload`, one or
    more batches back to back), the `base` offset assigned to them, who waits
    for them (`acks`: (who, token) pairs, who.answer(token, exc), a retried
    duplicate adding its own; None: nobody, acks=0), what hands the payload's
    memory back (`release`: a produce ring slot; None once done) and, from an
    idempotent producer, (id, epoch, first and last sequence) as `producer`.
    Native, as one is made, copied, released and answered for every
    partition batch: as a Python dataclass with Python methods these were
    about 5% of a request's instructions at 1,000 partitions
    (bench/history.md, session 93)."""
    cdef public object payload
    cdef public int64_t base
    cdef public object acks
    cdef public object release
    cdef public object producer

    def __init__(self, payload, int64_t base, acks, release, producer=None):
        self.payload, self.base, self.acks, self.release, self.producer = payload, base, acks, release, producer

    cpdef done_with_payload(self):
        """Hand the payload's memory back (once: later calls do nothing)."""
        release, self.release = self.release, None
        if release is not None:
            release()

    cpdef answer(self, exc):
        """Tell whoever waits that the batches are durable (exc None) or never will be."""
        if self.acks:
            for who, token in self.acks:
                if isinstance(who, AckSet):
                    (<AckSet>who)._answer(token, exc)
                else:
                    who.answer(token, exc)


def answer(list items, exc):
    """Pending.answer(exc) of each of these (a node object's commit answers every batch it holds)."""
    cdef Pending p
    for p in items:
        p.answer(exc)


def assemble_node(list taken, int64_t created_ms, str key, dict places, manifest, piece, dumps):
    """A node object's slices, back to back in one new buffer, each a whole
    segment (as assemble_segment makes it), and what each slice needs
    besides, in one call (built slice by slice, the per-slice work was a
    third of the log process's at 1,000 partitions). `taken` holds a
    (log, items) pair a slice: items are Pending (their payloads are handed
    back once copied); a log has `topic`, `partition` and
    producers_of(items), called for a slice's manifest only when an
    idempotent producer wrote one of its batches. Of each slice, piece(log,
    its manifest, items) (wal.Slice) goes in the slices returned, its
    manifest being manifest(base, last, count, size, min_ts, max_ts, key,
    created_ms, producers, pos, ref) (SegmentManifest, given its ref "key#pos";
    tests/unit/test_segment.py checks it is the ref SegmentManifest makes);
    its cache entry (its position, size, and its cache tables: _tables,
    positions from the slice's start) in the entries (shm.Entries, as
    pack_entries makes them); its
    directory row (directory_rows, its topic placed in `places`) in the
    rows, and its topic's place, partition, base and last offset as
    native-endian 8-byte integers in the summary (wal.summary's rows: the
    collector's, without parsing the directory back). Returns (buffer,
    slices, entries, rows, summary)."""
    cdef Py_ssize_t total = 0, pos = 0, start, used = 0
    cdef _SegStats st
    cdef _Tab tab = _Tab(NULL, NULL, 0, 0)
    cdef uint8_t *d
    cdef int64_t vals[9]
    cdef int64_t *summed
    cdef bytes summary
    cdef Pending p
    cdef bint idempotent
    for lg, items in taken:
        total += KFS_HEADER + KFS_FOOTER
        for p in items:
            total += len(p.payload)
    data = _unfilled(total)
    d = <uint8_t *>PyByteArray_AS_STRING(data)
    slices, rows = [], bytearray(200 * len(taken))
    cdef bytes packed = PyBytes_FromStringAndSize(NULL, 32 * len(taken))  # new, so written in place
    cdef int64_t *quads = <int64_t *><char *>packed
    tables = bytearray()
    summary = PyBytes_FromStringAndSize(NULL, 32 * len(taken))  # new, so written in place
    summed = <int64_t *><char *>summary
    try:
        for lg, items in taken:
            start = pos
            pos += KFS_HEADER
            _start_stats(&st)
            tab.n = 0
            idempotent = False
            for p in items:
                pos = _place_batches(d, pos, p.payload, p.base, start, &st, &tab)
                idempotent = idempotent or p.producer is not None
            if not tab.n:
                raise ValueError("a slice needs at least one batch")
            with nogil:
                _seal_segment(d + start, pos - start, &st, tab.bases[0], created_ms)
            pos += KFS_FOOTER
            for p in items:
                p.done_with_payload()
            producers = lg.producers_of(items) if idempotent else {}
            ref = f"{key}#{start}"
            slices.append(piece(lg, manifest(tab.bases[0], st.last_offset, st.count, pos - start, st.min_ts,
                                             st.max_ts, key, created_ms, producers, start, ref), items))
            quads[4 * len(slices) - 4], quads[4 * len(slices) - 3] = start, pos - start
            quads[4 * len(slices) - 2] = len(tables)
            tables += _tables(&tab)
            quads[4 * len(slices) - 1] = len(tables)
            vals[0], vals[1], vals[2], vals[3] = _place(places, lg.topic), lg.partition, tab.bases[0], st.last_offset
            memcpy(summed + 4 * len(slices) - 4, vals, 32)
            vals[4], vals[5], vals[6], vals[7], vals[8] = st.count, start, pos - start, st.min_ts, st.max_ts
            used = _put_row(rows, used, vals, dumps(producers).encode() if producers else b"")
    finally:
        _tab_free(&tab)
    PyByteArray_Resize(rows, used)
    return data, slices, (packed, bytes(tables)), rows, summary


cdef inline int64_t _ref_i64(const char *r, Py_ssize_t i) noexcept nogil:
    cdef int64_t v
    memcpy(&v, r + 8 * i, 8)
    return v


def cached_slice(data, Py_ssize_t size, bytes ref, int64_t offset, Py_ssize_t max_bytes):
    """CachedSegment.slice_from of the segment a cache ref names (shm.CacheRef:
    its position in the cache and its size, then its batches' base offsets
    and positions, 8-byte integers) in the ring `data` of `size` bytes,
    without making the CachedSegment: its whole batches from the one holding
    `offset` (the first if none does), up to max_bytes but at least that one,
    and whether they reach the end of its batches. A consumer's Fetch reads
    a slice of each partition with new records: through a CachedSegment
    (two casts of the tables, a list of every batch's end) a worker's read
    of a 2-batch slice, pinned and released, took 2.7-2.8 us, of a
    200-batch segment 5.6-5.9; this way 1.0 each (bench/history.md, session
    96)."""
    cdef const char *r = PyBytes_AsString(ref)
    cdef Py_ssize_t n = len(ref) - 16, count, lo, hi, mid, start, end, last, body_end
    if n <= 0 or n % 16:
        raise ValueError(f"a cache ref of {n + 16} bytes")
    count = n // 16  # base offsets at 2 + i, positions at 2 + count + i
    lo, hi = 0, count
    while lo < hi:  # the first batch whose base is past offset
        mid = (lo + hi) // 2
        if _ref_i64(r, 2 + mid) <= offset:
            lo = mid + 1
        else:
            hi = mid
    cdef Py_ssize_t first = lo - 1 if lo > 0 else 0
    start = _ref_i64(r, 2 + count + first)
    body_end = _ref_i64(r, 1) - KFS_FOOTER
    lo, hi = first + 1, count  # the first batch after `first` ending past start + max_bytes
    while lo < hi:
        mid = (lo + hi) // 2
        end = _ref_i64(r, 2 + count + mid + 1) if mid + 1 < count else body_end
        if end <= start + max_bytes:
            lo = mid + 1
        else:
            hi = mid
    last = lo - 1
    end = _ref_i64(r, 2 + count + last + 1) if last + 1 < count else body_end
    cdef Py_ssize_t at = _ref_i64(r, 0) % size
    return data[at + start:at + end], end == body_end


def pack_entries(list entries):
    """A cache object's entries (shm.Entries) of (position, size, tables)
    triples: (position, size, where its tables start and end in the second)
    of each as native-endian 8-byte integers, and their tables back to back;
    triples of size 0 left out. Kept as these two bytes objects, an object's
    entries are no objects of Python's cyclic collector: a tuple a slice
    (about 450,000 in the cache at 20,000 records/s over 1,000 partitions)
    each went through a young collection (bench/history.md, session 97), and
    a binary search over tuples of Python ints took about thirty cache misses
    a lookup (2.4 us)."""
    cdef list kept = [e for e in entries if (<tuple?>e)[1]]
    cdef Py_ssize_t i, n = len(kept), at = 0
    cdef bytes packed = PyBytes_FromStringAndSize(NULL, 32 * n)  # new, so written in place
    cdef int64_t *v = <int64_t *><char *>packed
    cdef tuple entry
    for i in range(n):
        entry = <tuple>kept[i]
        v[4 * i], v[4 * i + 1], v[4 * i + 2] = entry[0], entry[1], at
        at += len(<bytes?>entry[2])
        v[4 * i + 3] = at
    return packed, b"".join([(<tuple>e)[2] for e in kept])


cdef Py_ssize_t _cache_entry(dict objects, object m, int64_t floor, int64_t *at, Py_ssize_t *size,
                             PyObject **placed) except -2:
    """The index in its object's entries of the segment manifest m names in
    a shared cache's objects (shm.SharedCache: object key -> (shift, packed
    entries, tables): shm.Placed), its absolute position in the ring in `at`, its
    size in `size` and its object's place (borrowed) in `placed`; -1 if it is
    not there, or was overwritten (at a position below floor). A segment of
    a larger object put alone (read back from S3) is under its ref
    (SharedCache.put)."""
    cdef Py_ssize_t pos = m.pos
    if pos < 0:  # a segment object of its own: it starts at the object's byte 0
        return _object_entry(objects, m.key, 0, floor, at, size, placed)
    cdef Py_ssize_t i = _object_entry(objects, m.key, pos, floor, at, size, placed)
    return i if i >= 0 else _object_entry(objects, m.ref, pos, floor, at, size, placed)


cdef Py_ssize_t _object_entry(dict objects, object key, int64_t pos, int64_t floor, int64_t *at,
                              Py_ssize_t *size, PyObject **placed) except -2:
    """_cache_entry of the segment at pos in object `key`. The positions are
    searched where they would be if the entries were of one size (a node
    object's slices mostly are), then by halves."""
    cdef PyObject *found = PyDict_GetItemWithError(objects, key)
    if found == NULL:
        return -1
    cdef tuple place = <tuple?>(<object>found)
    cdef bytes packed = <bytes?>place[1]
    cdef const int64_t *v = <const int64_t *><const char *>packed
    cdef Py_ssize_t n = len(packed) // 32, lo = 0, hi = n, mid
    cdef int64_t first, last
    if n == 0:
        return -1
    first, last = v[0], v[4 * (n - 1)]
    if first < pos < last:  # a first guess, then the halves on its side
        mid = <Py_ssize_t>((<double>(pos - first) / (last - first)) * (n - 1))
        if v[4 * mid] < pos:
            lo = mid + 1
        else:
            hi = mid + 1
    while lo < hi:  # the first entry at pos or after it
        mid = (lo + hi) // 2
        if v[4 * mid] < pos:
            lo = mid + 1
        else:
            hi = mid
    if lo == n or v[4 * lo] != pos:
        return -1
    at[0] = <int64_t>place[0] + pos
    size[0] = v[4 * lo + 1]
    placed[0] = found
    return -1 if at[0] < floor else lo


def cache_ref(dict objects, m, int64_t floor):
    """The cache ref (shm.CacheRef: absolute position and size, then the
    tables) of the segment manifest m names, if a shared cache's objects
    hold it and it has not been overwritten (floor: the oldest valid
    position); else None. Made only when a worker is to read it: one a
    cached slice, kept until the ring overwrote it, cost the log process
    its making and a dict entry each (bench/history.md, session 97)."""
    cdef int64_t head[2]
    cdef Py_ssize_t size
    cdef PyObject *placed
    cdef Py_ssize_t i = _cache_entry(objects, m, floor, &head[0], &size, &placed)
    if i < 0:
        return None
    head[1] = size
    cdef bytes packed = <bytes?>(<tuple>placed)[1]
    cdef const int64_t *v = <const int64_t *><const char *>packed
    cdef bytes tables = <bytes?>(<tuple>placed)[2]
    cdef Py_ssize_t start = v[4 * i + 2], n = v[4 * i + 3] - v[4 * i + 2]
    if start < 0 or n < 0 or start + n > len(tables):
        raise ValueError("a cache entry's tables lie outside its object's")
    cdef bytes ref = PyBytes_FromStringAndSize(NULL, 16 + n)  # new, so written in place
    memcpy(<char *>ref, head, 16)
    memcpy(<char *>ref + 16, <const char *>tables + start, n)
    return ref


def cache_holds(dict objects, m, int64_t floor):
    """Whether cache_ref would find m's segment (without making its ref)."""
    cdef int64_t at
    cdef Py_ssize_t size
    cdef PyObject *placed
    return _cache_entry(objects, m, floor, &at, &size, &placed) >= 0


def cached_batches(dict objects, manifests, int64_t floor, data, Py_ssize_t size):
    """SharedCache.batches: of the segment each manifest names, its batches
    in the ring `data` of `size` bytes (header and footer left out), or None
    (not cached, or overwritten: at a position below floor). In Python this
    loop had 2% of py-spy's samples of bench.logproc at 1,000 partitions
    (bench/history.md, session 94)."""
    cdef list found = []
    cdef int64_t at
    cdef Py_ssize_t off, n
    cdef PyObject *placed
    for m in manifests:
        if _cache_entry(objects, m, floor, &at, &n, &placed) < 0:
            found.append(None)
            continue
        off = at % size
        found.append(data[off + KFS_HEADER:off + n - KFS_FOOTER])
    return found


def iter_records(BatchInfo batch, const uint8_t[::1] buf):
    """Decode the records of `batch` (found in `buf`), decompressing as needed.

    Yields (offset, timestamp, key, value, headers) with key/value bytes or
    None and headers a list of (str, bytes|None)."""
    cdef const uint8_t[::1] body
    cdef const uint8_t *p
    cdef Py_ssize_t pos = 0, end, rec_end
    cdef int64_t length, ts_delta, off_delta, klen, vlen, nh, hk, hv
    cdef int32_t i
    codec = batch.attributes & 7
    raw = buf[batch.position + BATCH_HEADER_SIZE:batch.position + batch.size]
    body = decompress(codec, raw) if codec else raw
    end = body.shape[0]
    p = &body[0] if end else NULL
    for i in range(batch.record_count):
        pos = rd_varlong(p, pos, end, &length)
        if pos < 0 or length < 0 or pos + length > end:
            raise BatchError(CORRUPT_MESSAGE, "truncated record")
        rec_end = pos + length
        pos += 1
        pos = rd_varlong(p, pos, rec_end, &ts_delta)
        pos = rd_varlong(p, pos, rec_end, &off_delta) if pos >= 0 else -1
        pos = rd_varlong(p, pos, rec_end, &klen) if pos >= 0 else -1
        if pos < 0 or (klen > 0 and pos + klen > rec_end):
            raise BatchError(CORRUPT_MESSAGE, "malformed record key")
        key = None if klen < 0 else bytes(body[pos:pos + klen])
        pos += max(klen, 0)
        pos = rd_varlong(p, pos, rec_end, &vlen)
        if pos < 0 or (vlen > 0 and pos + vlen > rec_end):
            raise BatchError(CORRUPT_MESSAGE, "malformed record value")
        value = None if vlen < 0 else bytes(body[pos:pos + vlen])
        pos += max(vlen, 0)
        pos = rd_varlong(p, pos, rec_end, &nh)
        if pos < 0:
            raise BatchError(CORRUPT_MESSAGE, "malformed header count")
        headers = []
        for _ in range(nh):
            pos = rd_varlong(p, pos, rec_end, &hk)
            if pos < 0 or hk < 0 or pos + hk > rec_end:
                raise BatchError(CORRUPT_MESSAGE, "malformed header key")
            hkey = bytes(body[pos:pos + hk]).decode("utf-8", "replace")
            pos += hk
            pos = rd_varlong(p, pos, rec_end, &hv)
            if pos < 0 or (hv > 0 and pos + hv > rec_end):
                raise BatchError(CORRUPT_MESSAGE, "malformed header value")
            headers.append((hkey, None if hv < 0 else bytes(body[pos:pos + hv])))
            pos += max(hv, 0)
        pos = rec_end
        yield batch.base_offset + off_delta, batch.base_timestamp + ts_delta, key, value, headers


cdef class _Sink:
    """A growable byte buffer (a bytearray and a fill mark)."""
    cdef bytearray data
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t capacity=4096):
        self.data = bytearray(capacity)
        self.n = 0

    cdef uint8_t *room(self, Py_ssize_t k) except NULL:
        """k more bytes at the end, to be written through the pointer returned."""
        cdef Py_ssize_t cap = PyByteArray_GET_SIZE(self.data)
        if self.n + k > cap:
            PyByteArray_Resize(self.data, max(cap * 2, self.n + k))
        cdef uint8_t *at = <uint8_t *>PyByteArray_AS_STRING(self.data) + self.n
        self.n += k
        return at

    cdef int put(self, const void *p, Py_ssize_t k) except -1:
        if k:
            memcpy(self.room(k), p, k)
        return 0

    cdef int put_i32(self, Py_ssize_t v) except -1:
        cdef int32_t x
        if v > INT32_MAX:
            raise ValueError("more than 2 GiB of keys, values or headers in one decode_columns call")
        x = <int32_t>v
        return self.put(&x, 4)

    cdef int put_u8(self, uint8_t v) except -1:
        return self.put(&v, 1)

    cdef bytes take(self):
        return PyBytes_FromStringAndSize(PyByteArray_AS_STRING(self.data), self.n)


def decode_columns(const uint8_t[::1] buf, list batches, int64_t start, int64_t end):
    """The records with offsets in [start, end) of `batches` (BatchInfo of
    batches in buf), decompressed and decoded into Arrow-style columns, raw
    little-endian buffers a reader wraps without copying:

    n; offset, timestamp (ms) as i64; timestamp_type as i32 (1: the batch is
    LogAppendTime, its max timestamp applies to every record); key and value
    as i32 offsets (n + 1), data bytes and validity bytes (1 = not null);
    headers as i32 list offsets (n + 1), then per header key offsets and
    data, value offsets, data and validity."""
    cdef _Sink offs = _Sink(), tss = _Sink(), tst = _Sink()
    cdef _Sink k_off = _Sink(), k_dat = _Sink(), k_ok = _Sink()
    cdef _Sink v_off = _Sink(), v_dat = _Sink(), v_ok = _Sink()
    cdef _Sink h_off = _Sink(), hk_off = _Sink(), hk_dat = _Sink(), hv_off = _Sink(), hv_dat = _Sink()
    cdef _Sink hv_ok = _Sink()
    cdef const uint8_t[::1] body
    cdef const uint8_t *p
    cdef Py_ssize_t pos, rec_end, bend, n = 0, nh_total = 0
    cdef int64_t length, ts_delta, off_delta, klen, vlen, nh, hk, hv, off, ts
    cdef int32_t i, log_append, j
    cdef BatchInfo b
    k_off.put_i32(0)
    v_off.put_i32(0)
    h_off.put_i32(0)
    hk_off.put_i32(0)
    hv_off.put_i32(0)
    for b in batches:
        if b.base_offset + b.last_offset_delta < start or b.base_offset >= end:
            continue
        codec = b.attributes & 7
        raw = buf[b.position + BATCH_HEADER_SIZE:b.position + b.size]
        body = decompress(codec, raw) if codec else raw
        bend = body.shape[0]
        p = &body[0] if bend else NULL
        log_append = (b.attributes >> 3) & 1
        pos = 0
        for i in range(b.record_count):
            pos = rd_varlong(p, pos, bend, &length)
            if pos < 0 or length < 0 or pos + length > bend:
                raise BatchError(CORRUPT_MESSAGE, "truncated record")
            rec_end = pos + length
            pos += 1
            pos = rd_varlong(p, pos, rec_end, &ts_delta)
            pos = rd_varlong(p, pos, rec_end, &off_delta) if pos >= 0 else -1
            if pos < 0:
                raise BatchError(CORRUPT_MESSAGE, "malformed record")
            off = b.base_offset + off_delta
            if off < start or off >= end:
                pos = rec_end
                continue
            ts = b.max_timestamp if log_append else b.base_timestamp + ts_delta
            offs.put(&off, 8)
            tss.put(&ts, 8)
            tst.put(&log_append, 4)
            pos = rd_varlong(p, pos, rec_end, &klen)
            if pos < 0 or (klen > 0 and pos + klen > rec_end):
                raise BatchError(CORRUPT_MESSAGE, "malformed record key")
            k_ok.put_u8(klen >= 0)
            if klen > 0:
                k_dat.put(p + pos, klen)
                pos += klen
            k_off.put_i32(k_dat.n)
            pos = rd_varlong(p, pos, rec_end, &vlen)
            if pos < 0 or (vlen > 0 and pos + vlen > rec_end):
                raise BatchError(CORRUPT_MESSAGE, "malformed record value")
            v_ok.put_u8(vlen >= 0)
            if vlen > 0:
                v_dat.put(p + pos, vlen)
                pos += vlen
            v_off.put_i32(v_dat.n)
            pos = rd_varlong(p, pos, rec_end, &nh)
            if pos < 0 or nh < 0:
                raise BatchError(CORRUPT_MESSAGE, "malformed header count")
            for j in range(nh):
                pos = rd_varlong(p, pos, rec_end, &hk)
                if pos < 0 or hk < 0 or pos + hk > rec_end:
                    raise BatchError(CORRUPT_MESSAGE, "malformed header key")
                hk_dat.put(p + pos, hk)
                pos += hk
                hk_off.put_i32(hk_dat.n)
                pos = rd_varlong(p, pos, rec_end, &hv)
                if pos < 0 or (hv > 0 and pos + hv > rec_end):
                    raise BatchError(CORRUPT_MESSAGE, "malformed header value")
                hv_ok.put_u8(hv >= 0)
                if hv > 0:
                    hv_dat.put(p + pos, hv)
                    pos += hv
                hv_off.put_i32(hv_dat.n)
            nh_total += nh
            h_off.put_i32(nh_total)
            n += 1
            pos = rec_end
    return {"n": n, "offset": offs.take(), "timestamp": tss.take(), "timestamp_type": tst.take(),
            "key_offsets": k_off.take(), "key_data": k_dat.take(), "key_valid": k_ok.take(),
            "value_offsets": v_off.take(), "value_data": v_dat.take(), "value_valid": v_ok.take(),
            "header_offsets": h_off.take(), "header_key_offsets": hk_off.take(), "header_key_data": hk_dat.take(),
            "header_value_offsets": hv_off.take(), "header_value_data": hv_dat.take(),
            "header_value_valid": hv_ok.take()}


def build_batch(records, int codec=0, int64_t base_offset=0, int64_t base_timestamp=-1):
    """Build one RecordBatch v2 from (timestamp, key, value, headers) tuples.

    Used by `kafscale replay`, tests and benchmarks; brokers never rebuild
    producer batches."""
    body = bytearray()
    if not records:
        raise ValueError("a batch needs at least one record")
    if base_timestamp < 0:
        base_timestamp = records[0][0]
    max_ts = base_timestamp
    for i, (ts, key, value, headers) in enumerate(records):
        rec = bytearray(b"\x00")
        rec += encode_varint(ts - base_timestamp)
        rec += encode_varint(i)
        for item in (key, value):
            if item is None:
                rec += encode_varint(-1)
            else:
                rec += encode_varint(len(item))
                rec += item
        rec += encode_varint(len(headers))
        for hkey, hval in headers:
            hk = hkey.encode() if isinstance(hkey, str) else hkey
            rec += encode_varint(len(hk))
            rec += hk
            if hval is None:
                rec += encode_varint(-1)
            else:
                rec += encode_varint(len(hval))
                rec += hval
        body += encode_varint(len(rec))
        body += rec
        max_ts = max(max_ts, ts)
    payload = compress(codec, bytes(body))
    n = len(records)
    out = bytearray(BATCH_HEADER_SIZE + len(payload))
    cdef uint8_t[::1] o = out
    wr_i64(&o[0], base_offset)
    wr_i32(&o[8], <int32_t>(len(out) - LOG_OVERHEAD))
    wr_i32(&o[12], -1)
    o[16] = 2
    o[21] = 0
    o[22] = codec
    wr_i32(&o[23], n - 1)
    wr_i64(&o[27], base_timestamp)
    wr_i64(&o[35], max_ts)
    wr_i64(&o[43], -1)
    o[51] = 0xff
    o[52] = 0xff
    wr_i32(&o[53], -1)
    wr_i32(&o[57], n)
    out[BATCH_HEADER_SIZE:] = payload
    cdef uint32_t crc = crc32c(o[21:])
    wr_i32(&o[17], <int32_t>crc)
    return bytes(out)


# ----------------------------------------------------------------- Produce requests
# The one request decoded thousands of times a second (librdkafka sends one per
# partition batch): decoded here into what the schema codec decodes it into
# (kafscale.protocol.codec; tests compare the two for every version). Errors
# are ValueErrors, which the codec turns into DecodeError.

cdef inline Py_ssize_t _need(Py_ssize_t pos, int64_t n, Py_ssize_t end) except -1:
    if n < 0 or n > end - pos:
        raise ValueError(f"need {n} bytes at {pos}, only {end - pos} left")
    return pos + <Py_ssize_t>n


cdef int64_t _uvarint(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end) except? -1:
    cdef uint64_t v
    pos[0] = rd_uvarint(p, pos[0], end, &v)
    if pos[0] < 0:
        raise ValueError("malformed unsigned varint")
    return <int64_t>(v if v < (<uint64_t>1 << 62) else (<uint64_t>1 << 62))  # too large for any buffer anyway


cdef int64_t _length(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, bint compact, bint wide) except? -3:
    """A length or count: compact (unsigned varint + 1) or int32 / int16; negative: null."""
    cdef int64_t n
    if compact:
        return _uvarint(p, pos, end) - 1
    if wide:
        pos[0] = _need(pos[0], 4, end)
        return rd_i32(p + pos[0] - 4)
    pos[0] = _need(pos[0], 2, end)
    return rd_i16(p + pos[0] - 2)


cdef object _string(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, bint compact, bint nullable, str what):
    cdef int64_t n = _length(p, pos, end, compact, False)
    cdef Py_ssize_t start = pos[0]
    if n < 0:
        if nullable:
            return None
        raise ValueError(f"null (negative length) for non-nullable string {what}")
    pos[0] = _need(start, n, end)
    return PyUnicode_DecodeUTF8(<const char *>p + start, <Py_ssize_t>n, NULL)


cdef int64_t _count(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, bint compact, str what) except? -3:
    cdef int64_t n = _length(p, pos, end, compact, True)
    if n < 0:
        raise ValueError(f"null (negative length) for non-nullable array {what}")
    if n > end - pos[0]:  # each element takes at least one byte
        raise ValueError(f"array {what} claims {n} elements")
    return n


cdef int _skip_tags(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end) except -1:
    """A flexible struct's tagged fields (Produce requests define none: all are skipped)."""
    cdef int64_t i, n = _uvarint(p, pos, end)
    for i in range(n):
        _uvarint(p, pos, end)
        pos[0] = _need(pos[0], _uvarint(p, pos, end), end)
    return 0


# Request headers: v1 (api_key i16, api_version i16, correlation_id i32,
# client_id nullable int16 string) and, for flexible request versions, v2
# (plus tagged fields). Parsed for every request a listener reads.
HEADER_VERSIONS = 64  # flexible_versions has this many entries per API key


def parse_request_header(const uint8_t[::1] frame, const uint8_t[::1] flexible_versions):
    """(api_key, api_version, correlation_id, client_id, flexible, body_at)
    of a request frame (without its size prefix). flexible_versions[key *
    HEADER_VERSIONS + version] is 1 where that API version has header v2;
    an API key or version outside it has header v1. client_id's invalid
    UTF-8 is replaced. ValueError if the frame is shorter than its header."""
    cdef Py_ssize_t end = frame.shape[0], pos = 10
    cdef const uint8_t *p = &frame[0] if end else NULL
    cdef int api_key, api_version
    cdef int64_t n
    cdef bint flexible = False
    if end < 10:
        raise ValueError(f"request of {end} bytes is shorter than a header")
    api_key = rd_i16(p)
    api_version = rd_i16(p + 2)
    if 0 <= api_key and 0 <= api_version < HEADER_VERSIONS:
        n = <int64_t>api_key * HEADER_VERSIONS + api_version
        flexible = n < flexible_versions.shape[0] and flexible_versions[n]
    client_id = _client_id(p, end, flexible, &pos)
    return api_key, api_version, rd_i32(p + 4), client_id, flexible, pos


cdef object _client_id(const uint8_t *p, Py_ssize_t end, bint flexible, Py_ssize_t *body_at):
    """The client_id of the request header at p (a frame of end >= 10 bytes);
    body_at is set to where the body starts (after the tagged fields of a
    header v2)."""
    cdef Py_ssize_t pos = 10
    cdef int64_t n = rd_i16(p + 8)
    client_id = None
    if n >= 0:
        pos = _need(pos, n, end)
        client_id = PyUnicode_DecodeUTF8(<const char *>p + 10, <Py_ssize_t>n, "replace")
    if flexible:
        _skip_tags(p, &pos, end)
    body_at[0] = pos
    return client_id


cdef tuple _produce_body(buf, Py_ssize_t pos, int version, bint dicts):
    """A Produce request body (v3 and later, up to v12) at `pos` of `buf` (a
    memoryview; records are slices of it): (transactional_id, acks,
    timeout_ms, topics, end), topics as [(name, [(index, records or None),
    ...]), ...], or with dicts as the schema codec's topic_data list."""
    cdef const uint8_t[::1] view = buf
    cdef Py_ssize_t end = view.shape[0]
    cdef const uint8_t *p = &view[0] if end else NULL
    cdef bint flex = version >= 9
    cdef int64_t nt, npart, n, t, i
    cdef Py_ssize_t start
    if pos < 0 or pos > end:
        raise ValueError(f"body at {pos} of {end} bytes")
    tid = _string(p, &pos, end, flex, True, "transactional_id")
    pos = _need(pos, 6, end)
    acks = rd_i16(p + pos - 6)
    timeout_ms = rd_i32(p + pos - 4)
    topics = []
    nt = _count(p, &pos, end, flex, "topic_data")
    for t in range(nt):
        name = _string(p, &pos, end, flex, False, "name")
        parts = []
        npart = _count(p, &pos, end, flex, "partition_data")
        for i in range(npart):
            pos = _need(pos, 4, end)
            index = rd_i32(p + pos - 4)
            n = _length(p, &pos, end, flex, True)
            if n < 0:
                records = None
            else:
                start = pos
                pos = _need(pos, n, end)
                records = buf[start:pos]
            if flex:
                _skip_tags(p, &pos, end)
            parts.append({"index": index, "records": records} if dicts else (index, records))
        if flex:
            _skip_tags(p, &pos, end)
        topics.append({"name": name, "partition_data": parts} if dicts else (name, parts))
    if flex:
        _skip_tags(p, &pos, end)
    return tid, acks, timeout_ms, topics, pos


def fixed_dicts(list rows, tuple names, dict defaults):
    """Each row (a tuple holding at least len(names) values, as
    struct.iter_unpack makes them) as a dict of names to its values, then
    defaults: the elements of an array of fixed-size fields
    (protocol/codec.py _StructCodec.fixed_rows), a consumer's Fetch naming
    each of its partitions. dict(zip(names, row)) and an update made a
    Fetch partition in 0.65-0.74 us, this in 0.15 (bench/history.md,
    session 96)."""
    cdef Py_ssize_t k = len(names), i
    cdef list out = []
    cdef dict d
    cdef tuple row
    for r in rows:
        row = <tuple?>r
        if PyTuple_GET_SIZE(row) < k:
            raise ValueError(f"a row of {PyTuple_GET_SIZE(row)} values for {k} names")
        d = {}
        for i in range(k):
            d[<object>PyTuple_GET_ITEM(names, i)] = <object>PyTuple_GET_ITEM(row, i)
        if defaults:
            d.update(defaults)
        out.append(d)
    return out


def decode_produce_request(buf, Py_ssize_t pos, int version):
    """A Produce request body (v3 and later, up to v12) at `pos` of `buf` (a
    memoryview; records are slices of it): the dict the schema codec
    decodes, and where the body ends."""
    tid, acks, timeout_ms, topics, end = _produce_body(buf, pos, version, True)
    return {"transactional_id": tid, "acks": acks, "timeout_ms": timeout_ms, "topic_data": topics}, end


# A produce payload the worker's ring has no room for: every client retries NOT_ENOUGH_REPLICAS.
NOT_ENOUGH_REPLICAS = 19
RING_FULL = "the broker's produce buffer is full (S3 is slow or unavailable); retry"


cdef object _stage(RingWriter ring, int slot, records, bint deep_compressed, Py_ssize_t max_uncompressed,
                   reject, Py_ssize_t *staged):
    """One partition's records validated and copied into the ring: (slot,
    start, length); or reject(code, message) saying why not."""
    if records is None or len(records) == 0:
        return reject(INVALID_RECORD, "no records")
    try:
        batches = validate_batches(records, deep_compressed, max_uncompressed)
    except BatchError as exc:
        return reject(exc.code, str(exc))
    cdef const uint8_t[::1] src = records
    cdef Py_ssize_t n = src.shape[0]
    if n > ring.size:
        return reject(MESSAGE_TOO_LARGE, f"{n} bytes exceed the produce buffer")
    cdef int64_t start = ring._alloc(n)
    if start < 0:
        return reject(NOT_ENOUGH_REPLICAS, RING_FULL)
    cdef uint8_t *dst = &ring._data[start % ring.size]
    memcpy(dst, &src[0], n)
    cdef BatchInfo b
    for b in batches:
        if b.max_timestamp_fixed:
            _write_max_timestamp(dst + b.position, b)
    staged[0] += n
    return slot, start, n


# A connection's pipelined Produce requests, many at a time: librdkafka sends one
# per partition batch, and a read of its connection holds dozens. A run of
# complete Produce frames is split off, parsed, decoded and staged in one call,
# and their responses are framed together (kafscale/broker/server.py).

def produce_run(const uint8_t[::1] buf, Py_ssize_t pos, Py_ssize_t max_size, Py_ssize_t max_frames,
                int min_version, int max_version):
    """The complete request frames (4-byte size, then the frame) from `pos`
    of `buf` that are Produce requests of min_version to max_version, of 10
    (a header) to max_size bytes: at most max_frames, up to the first that
    is not.
    Returns (how many, where they end)."""
    cdef Py_ssize_t end = buf.shape[0], count = 0
    cdef int32_t size
    cdef int version
    while count < max_frames and end - pos >= 8:
        size = rd_i32(&buf[pos])
        if size < 10 or size > max_size or size > end - pos - 4:
            break
        version = rd_i16(&buf[pos + 6])
        if rd_i16(&buf[pos + 4]) != 0 or version < min_version or version > max_version:
            break
        pos += 4 + size
        count += 1
    return count, pos


def stage_produce_run(buf, Py_ssize_t count, int flexible_min, RingWriter ring not None, int slot,
                      bint deep_compressed, Py_ssize_t max_uncompressed, reject):
    """`count` framed Produce requests back to back in `buf` (as produce_run
    found them; header v2 from flexible_min on), decoded and staged: a
    list of (correlation_id, version, client_id, acks, timeout_ms,
    transactional_id, topics) for the requests up to the first that does not
    decode, the bytes staged for them, and that one's (version, error) (None
    if all decode; nothing of it or after it is staged). Each request's
    topics are ((name, ((index, (slot, start, length) or reject(code,
    message)), ...)), ...), the payload part of a ProduceCall: its records
    validated (validate_batches) and copied into the ring, a corrected
    maxTimestamp written into the copy."""
    cdef const uint8_t[::1] view = buf
    cdef Py_ssize_t pos = 0, size, body_at, staged = 0, i, end = view.shape[0]
    cdef const uint8_t *p
    cdef int version
    decoded = []
    error = None
    for i in range(count):
        if end - pos < 14:
            raise ValueError(f"no complete request frame at byte {pos} of the run")
        p = &view[pos]
        size = rd_i32(p)
        if size < 10 or size > end - pos - 4:
            raise ValueError(f"no complete request frame at byte {pos} of the run")
        version = rd_i16(p + 6)
        frame = buf[pos + 4:pos + 4 + size]
        try:
            client_id = _client_id(p + 4, size, version >= flexible_min, &body_at)
            tid, acks, timeout_ms, topics, _ = _produce_body(frame, body_at, version, False)
        except ValueError as exc:
            error = (version, str(exc))
            break
        decoded.append((rd_i32(p + 8), version, client_id, acks, timeout_ms, tid, topics))
        pos += 4 + size
    out = []
    for correlation_id, version, client_id, acks, timeout_ms, tid, topics in decoded:
        out.append((correlation_id, version, client_id, acks, timeout_ms, tid, tuple([
            (name, tuple([(index, _stage(ring, slot, records, deep_compressed, max_uncompressed, reject, &staged))
                          for index, records in parts])) for name, parts in topics])))
    return out, staged, error


# ---------------------------------------------------------------- Produce responses
# Encoded here for the same reason, from the dicts the schema codec encodes
# (its defaults for the fields a dict lacks; tests compare the two).

cdef int _put_uvarint(_Sink out, uint64_t v) except -1:
    while v >= 0x80:
        out.put_u8((v & 0x7f) | 0x80)
        v >>= 7
    return out.put_u8(<uint8_t>v)


cdef int _put_length(_Sink out, int64_t n, bint compact, bint wide) except -1:
    """A length or count as _length reads it (-1: null)."""
    if compact:
        return _put_uvarint(out, <uint64_t>(n + 1))
    if wide:
        wr_i32(out.room(4), <int32_t>n)
        return 0
    wr_i16(out.room(2), <int>n)
    return 0


cdef int _put_string(_Sink out, value, bint compact, bint nullable) except -1:
    """None is null where the field may be null, else the empty string (as the schema codec writes it)."""
    if value is None and nullable:
        return _put_length(out, -1, compact, False)
    cdef bytes data = b"" if value is None else value.encode()
    _put_length(out, len(data), compact, False)
    return out.put(<const char *>data, len(data))


cdef object _put_array(_Sink out, value, bint compact):
    """An array's count (None: empty, as the schema codec writes a non-nullable one); its items."""
    items = () if value is None else value
    _put_length(out, len(items), compact, True)
    return items


def encode_produce_response(dict body, int version):
    """A Produce response body (v3 and later, up to v12), as bytes."""
    cdef _Sink out = _Sink(256)
    _produce_response(out, body, version)
    return out.take()


def encode_produce_responses(list answers, int flexible_min):
    """Produce responses framed back to back (4-byte size, correlation id,
    from flexible_min on the header's empty tagged fields, then the body):
    `answers` are (correlation_id, version, body) each, a body either a
    response dict or a broker's answer (a list of (topic, partitions), each
    partition a sequence of index, error code, base offset, log start offset
    and error message; throttle time 0, no record errors: the tuples a
    produce's reply crosses the log process's channel as, cheaper to pickle
    than dicts)."""
    cdef _Sink out = _Sink(64 * len(answers) + 64)
    cdef Py_ssize_t start
    cdef int version
    for correlation_id, version, body in answers:
        start = out.n
        out.room(4)
        wr_i32(out.room(4), correlation_id)
        if version >= flexible_min:
            out.put_u8(0)
        if type(body) is dict:
            _produce_response(out, body, version)
        else:
            _produce_answer(out, body, version)
        wr_i32(<uint8_t *>PyByteArray_AS_STRING(out.data) + start, <int32_t>(out.n - start - 4))
    return out.take()


cdef int _produce_partition(_Sink out, int version, bint flex, int32_t index, int error_code, int64_t base_offset,
                            int64_t log_append_time_ms, int64_t log_start_offset, record_errors,
                            error_message) except -1:
    """One partition's response."""
    wr_i32(out.room(4), index)
    wr_i16(out.room(2), error_code)
    wr_i64(out.room(8), base_offset)
    wr_i64(out.room(8), log_append_time_ms)
    if version >= 5:
        wr_i64(out.room(8), log_start_offset)
    if version >= 8:
        for e in _put_array(out, record_errors, flex):
            wr_i32(out.room(4), e.get("batch_index", 0))
            _put_string(out, e.get("batch_index_error_message"), flex, True)
            if flex:
                _put_uvarint(out, 0)
        _put_string(out, error_message, flex, True)
    if flex:
        _put_uvarint(out, 0)
    return 0


cdef int _produce_response(_Sink out, dict body, int version) except -1:
    cdef bint flex = version >= 9
    for topic in _put_array(out, body.get("responses"), flex):
        _put_string(out, topic.get("name"), flex, False)
        for r in _put_array(out, topic.get("partition_responses"), flex):
            _produce_partition(out, version, flex, r.get("index", 0), r.get("error_code", 0),
                               r.get("base_offset", 0), r.get("log_append_time_ms", -1),
                               r.get("log_start_offset", -1), r.get("record_errors"), r.get("error_message"))
        if flex:
            _put_uvarint(out, 0)
    wr_i32(out.room(4), body.get("throttle_time_ms", 0))
    if flex:
        _put_uvarint(out, 0)
    return 0


cdef int _produce_answer(_Sink out, list topics, int version) except -1:
    """A broker's answer (see encode_produce_responses) as a response body."""
    cdef bint flex = version >= 9
    for name, parts in _put_array(out, topics, flex):
        _put_string(out, name, flex, False)
        for p in _put_array(out, parts, flex):
            _produce_partition(out, version, flex, p[0], p[1], p[2], -1, p[3], None, p[4])
        if flex:
            _put_uvarint(out, 0)
    wr_i32(out.room(4), 0)  # throttle_time_ms
    if flex:
        _put_uvarint(out, 0)
    return 0
