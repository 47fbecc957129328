"""One schema-driven codec for every Kafka request and response.

Messages are described as data (see schemas.py) in a small indented
notation that mirrors Kafka's JSON message specs:

    name: type [versions] [?nullable-versions] [tag=N] [default=V]

`type` is a primitive (int8 int16 int32 int64 uint16 float64 bool string
bytes uuid records), `[primitive]` for an array of primitives, or `[` / `{`
opening a nested array-of-struct / struct block closed by `]` / `}` on its
own line. Versions are `3+`, `3-12` or `5`; absent means all versions.
`?` alone makes the field nullable in all its versions, `?10` from v10 on.
`tag=N` makes it a tagged field (flexible versions only). A nullable struct
is written after an int8 marker, -1 for null and 1 for present, as Kafka does.

A Message compiles, per version, a list of steps; decode turns bytes into
plain dicts with snake_case keys (every field of the schema is present, with
its default where this version lacks it, so handlers need not care about
versions) and encode walks the same steps, taking values from dicts and
falling back to each field's default. Records are
passed through as buffers (a list of buffers is written without joining).

With KAFSCALE_STRICT_CODEC=1 in the environment (the test suite sets it, for
brokers too) encoding refuses what would otherwise be silently lost: a key
the schema does not know (a typo such as `eror_code`), and an error code set
in a version that has no field for it. Fields the version lacks are otherwise
dropped by design: handlers build every response against the newest schema.
Each Message checks its schema's invariants when it is created."""
from __future__ import annotations

import functools
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kafscale import _native

_PRIMS = {
    "int8": struct.Struct(">b"),
    "int16": struct.Struct(">h"),
    "int32": struct.Struct(">i"),
    "int64": struct.Struct(">q"),
    "uint16": struct.Struct(">H"),
    "float64": struct.Struct(">d"),
}
_I8 = _PRIMS["int8"]
_I16 = _PRIMS["int16"]
_I32 = _PRIMS["int32"]
MAX_VERSION = 0x7FFF
NULL_UUID = b"\x00" * 16


NO_DEFAULT: Any = object()  # a field without `default=` in the schema
STRICT = os.environ.get("KAFSCALE_STRICT_CODEC") == "1"


@dataclass(frozen=True)
class Encoded:
    """An array field's elements encoded already, for the version the message
    is written in: the codec writes their count and their bytes as they are
    (the partitions of a large topic's Metadata, see topic_api), or their
    chunks (Writer.finish's), large ones by reference (a Fetch's records)."""

    count: int
    data: bytes | list[Any]


class DecodeError(ValueError):
    """The bytes do not match the schema (truncated, bad length, bad UTF-8)."""


class EncodeError(ValueError):
    """Strict mode: a value the encoding would silently drop (see the module docstring)."""


@dataclass
class Field:
    name: str
    type: str  # primitive name, "struct" or "array"
    item: str | None = None  # element type of a primitive array
    vmin: int = 0
    vmax: int = MAX_VERSION
    null_min: int | None = None
    tag: int | None = None
    default: Any = NO_DEFAULT
    fields: list[Field] = field(default_factory=list)

    def present(self, v: int) -> bool:
        return self.vmin <= v <= self.vmax

    def nullable(self, v: int) -> bool:
        return self.null_min is not None and v >= self.null_min

    def default_value(self, v: int) -> Any:
        if self.default is not NO_DEFAULT:
            return self.default
        if self.nullable(v) and self.type in ("string", "bytes", "records", "array", "struct"):
            return None
        if self.type == "array":
            return []
        if self.type == "struct":
            return {f.name: f.default_value(v) for f in self.fields if f.present(v)}
        return {"string": "", "bytes": b"", "bool": False, "uuid": NULL_UUID, "records": None,
                "float64": 0.0}.get(self.type, 0)


def _versions(tok: str) -> tuple[int, int]:
    if tok.endswith("+"):
        return int(tok[:-1]), MAX_VERSION
    if "-" in tok:
        lo, hi = tok.split("-")
        return int(lo), int(hi)
    return int(tok), int(tok)


def _parse_default(text: str, ftype: str) -> Any:
    if text == "null":
        return None
    if ftype in ("string",):
        return text
    if ftype == "bool":
        return text == "true"
    return int(text, 0)


def parse_schema(text: str) -> list[Field]:
    """Parse the indented notation described in the module docstring."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    pos = 0

    def block(closer: str | None) -> list[Field]:
        nonlocal pos
        out: list[Field] = []
        while pos < len(lines):
            line = lines[pos]
            pos += 1
            if line in ("]", "}"):
                if line != closer:
                    raise ValueError(f"unbalanced {line!r} in schema")
                return out
            name, _, spec = line.partition(":")
            toks = spec.split()
            kind = toks[0]
            f = Field(name=name.strip(), type=kind)
            for tok in toks[1:]:
                if tok.startswith("?"):
                    f.null_min = int(tok[1:]) if len(tok) > 1 else -1
                elif tok.startswith("tag="):
                    f.tag = int(tok[4:])
                elif tok.startswith("default="):
                    f.default = _parse_default(tok[8:], kind)
                else:
                    f.vmin, f.vmax = _versions(tok)
            if f.null_min == -1:
                f.null_min = f.vmin
            if kind == "[":
                f.type = "array"
                f.fields = block("]")
            elif kind == "{":
                f.type = "struct"
                f.fields = block("}")
            elif kind.startswith("["):
                f.type, f.item = "array", kind[1:-1]
            out.append(f)
        if closer:
            raise ValueError(f"missing {closer!r} in schema")
        return out

    return block(None)


# --------------------------------------------------------------------------- encoding helpers

_SMALL = [bytes([n]) for n in range(0x80)]  # the one-byte varints: nearly every length and count


def uvarint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Writer:
    """Collects encoded bytes as chunks; large buffers are kept by reference."""

    __slots__ = ("buf", "chunks", "size")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.chunks: list[Any] = []
        self.size = 0

    def write(self, b: bytes | bytearray) -> None:
        self.buf += b

    def write_big(self, b: Any) -> None:
        if len(b) < 4096:
            self.buf += b
            return
        if self.buf:
            self.chunks.append(bytes(self.buf))
            self.size += len(self.buf)
            self.buf = bytearray()
        self.chunks.append(b)
        self.size += len(b)

    def finish(self) -> list[Any]:
        if self.buf:
            self.chunks.append(bytes(self.buf))
            self.size += len(self.buf)
            self.buf = bytearray()
        return self.chunks


class Reader:
    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise DecodeError(f"need {n} bytes at {self.pos}, only {self.end - self.pos} left")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def prim(self, s: struct.Struct) -> Any:
        if self.pos + s.size > self.end:
            raise DecodeError(f"truncated at byte {self.pos}")
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def uvarint(self) -> int:
        pos = self.pos
        if pos < self.end and (b := self.buf[pos]) < 0x80:  # one byte: nearly every length and count
            self.pos = pos + 1
            return b
        shift = result = 0
        while True:
            if self.pos >= self.end or shift > 63:
                raise DecodeError("malformed unsigned varint")
            b = self.buf[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7


# --------------------------------------------------------------------------- compiled codecs

class _StructCodec:
    """Encoder/decoder for one struct level at one version."""

    def __init__(self, fields: list[Field], version: int, flexible: bool) -> None:
        self.version = version
        self.flexible = flexible
        self.fields = [f for f in fields if f.present(version) and (f.tag is None or flexible)]
        self.absent = [f for f in fields if f not in self.fields]  # decoded as their defaults
        self.names = {f.name for f in fields}
        self.regular = [f for f in self.fields if f.tag is None]
        self.tagged = sorted((f for f in self.fields if f.tag is not None), key=lambda f: f.tag or 0)
        self.children = {f.name: _StructCodec(f.fields, version, flexible)
                         for f in self.fields if f.type in ("array", "struct") and f.item is None}
        # Compiled for this version (a Produce request is decoded and its response
        # encoded for every produce: the checks by type and version then happen
        # once here, not per field per message): a reader and a writer per
        # field, and the defaults of the fields a message may lack, made anew
        # per message only where they are mutable.
        self._readers = [(f.name, self._reader(f)) for f in self.regular]
        self._writers = [(f.name, self._writer(f)) for f in self.regular]
        self._tag_readers = {f.tag: (f.name, self._reader(f)) for f in self.tagged}
        self._tag_writers = [(f, self._writer(f)) for f in self.tagged]
        self._defaults = [(f.name, value, f if isinstance(value, list | dict) else None)
                          for f in (*self.tagged, *self.absent) for value in (f.default_value(version),)]
        # every field a fixed-size integer, every default immutable: an array of these (a Fetch's
        # partitions, 10,000 in every Fetch of a consumer of as many) is read one struct an element
        # (its last byte, in flexible versions, the count of its tagged fields) while none has a tagged field
        self.fixed = None
        if self.regular and all(f.type in _PRIMS for f in self.regular) and all(
                fresh is None for _, _, fresh in self._defaults):
            self.fixed = struct.Struct(">" + "".join(_PRIMS[f.type].format[1:] for f in self.regular)
                                       + ("B" if flexible else ""))
            self._fixed_names = tuple(f.name for f in self.regular)
            self._fixed_defaults = {name: value for name, value, _ in self._defaults}

    def _reader(self, f: Field) -> Callable[[Reader], Any]:
        """Integers and arrays here; the other types through _read."""
        s = _PRIMS.get(f.type)
        if s is not None:
            size, unpack = s.size, s.unpack_from

            def prim(r: Reader) -> Any:
                pos = r.pos
                if pos + size > r.end:
                    raise DecodeError(f"truncated at byte {pos}")
                r.pos = pos + size
                return unpack(r.buf, pos)[0]
            return prim
        if f.type == "array":
            flex = self.flexible
            child = self.children[f.name] if f.item is None else None
            element = child.decode if child is not None else self._reader(Field(name=f.name, type=f.item))
            fixed = child if child is not None and child.fixed is not None else None

            def array(r: Reader) -> list[Any] | None:
                n = self._len(r, flex, True)
                if n < 0:
                    return self._null(f)
                if n > r.end - r.pos:  # each element takes at least one byte
                    raise DecodeError(f"array {f.name} claims {n} elements")
                if fixed is not None:
                    rows = fixed.fixed_rows(r, n)
                    if rows is not None:
                        return rows
                return [element(r) for _ in range(n)]
            return array
        return functools.partial(self._read, f=f)

    def _writer(self, f: Field) -> Callable[[Writer, Any], None]:
        """Integers and arrays here; the other types through _write."""
        default = f.default_value(self.version)
        s = _PRIMS.get(f.type)
        if s is not None:
            pack = s.pack

            def prim(w: Writer, value: Any) -> None:
                w.buf += pack(default if value is _MISSING else value)
            return prim
        if f.type == "array":
            nullable = f.nullable(self.version)
            element = (self.children[f.name].encode if f.item is None
                       else self._writer(Field(name=f.name, type=f.item)))

            def array(w: Writer, value: Any) -> None:
                if value is _MISSING:
                    value = f.default_value(self.version)
                if isinstance(value, Encoded):
                    self._write_len(w, value.count, True)
                    if isinstance(value.data, list):
                        for chunk in value.data:
                            w.write_big(chunk)
                    else:
                        w.write(value.data)
                    return
                if value is None:
                    if nullable:
                        self._write_len(w, -1, True)
                        return
                    value = ()  # null is not expressible in this version: send the empty value
                self._write_len(w, len(value), True)
                for v in value:
                    element(w, v)
            return array
        return functools.partial(self._write, f=f)

    # -- decode
    def decode(self, r: Reader) -> dict[str, Any]:
        out = {name: read(r) for name, read in self._readers}
        for name, value, fresh in self._defaults:
            out[name] = value if fresh is None else fresh.default_value(self.version)
        if self.flexible:
            for _ in range(r.uvarint()):
                tag, size = r.uvarint(), r.uvarint()
                known = self._tag_readers.get(tag)
                if known is None:
                    r.take(size)  # unknown tagged field: skip
                    continue
                name, read = known
                out[name] = read(Reader(r.take(size)))
        return out

    def fixed_rows(self, r: Reader, n: int) -> list[dict[str, Any]] | None:
        """n elements of this fixed layout (self.fixed) read at once, as decode
        reads them; None (nothing read) when there are fewer bytes or one has
        a tagged field: then decode each. Every tag count read as 0 means every
        element was read at its own position."""
        assert self.fixed is not None
        end = r.pos + n * self.fixed.size
        if end > r.end:
            return None
        rows = list(self.fixed.iter_unpack(r.buf[r.pos:end]))
        if self.flexible and any(row[-1] for row in rows):
            return None
        r.pos = end
        # the tag count, in flexible versions, left out: _native.fixed_dicts takes the first values only
        return _native.fixed_dicts(rows, self._fixed_names, self._fixed_defaults)

    def _len(self, r: Reader, compact: bool, wide: bool) -> int:
        if compact:
            return r.uvarint() - 1
        return r.prim(_I32 if wide else _I16)

    def _read(self, r: Reader, f: Field) -> Any:
        """A field of a type _reader does not compile."""
        t = f.type
        flex = self.flexible
        if t == "string":
            n = self._len(r, flex, False)
            if n < 0:
                return self._null(f)
            try:
                return str(r.take(n), "utf-8")
            except UnicodeDecodeError as exc:
                raise DecodeError(f"invalid UTF-8 in {f.name}") from exc
        if t in ("bytes", "records"):
            n = self._len(r, flex, True)
            if n < 0:
                return self._null(f)
            return r.take(n)
        if t == "bool":
            return r.take(1)[0] != 0
        if t == "uuid":
            return bytes(r.take(16))
        if t == "struct":
            if f.nullable(self.version) and r.prim(_I8) < 0:  # a nullable struct: -1 null, 1 present
                return None
            return self.children[f.name].decode(r)
        raise DecodeError(f"unknown type {t}")

    def _null(self, f: Field) -> None:
        """A negative length: null where the field may be null, else malformed
        (a handler must never see None where the schema promises a value)."""
        if not f.nullable(self.version):
            raise DecodeError(f"null (negative length) for non-nullable {f.type} {f.name}")
        return None

    # -- encode
    def _check(self, obj: dict[str, Any]) -> None:
        unknown = obj.keys() - self.names
        if unknown:
            raise EncodeError(f"unknown field(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(self.names))})")
        for f in self.absent:
            if f.name == "error_code" and obj.get(f.name, 0):
                raise EncodeError(f"error_code {obj[f.name]} set, but version {self.version} has no error_code here")

    def check_all(self, obj: dict[str, Any]) -> None:
        """Strict mode's checks of encode for a whole message, without encoding it."""
        self._check(obj)
        for name, child in self.children.items():
            value = obj.get(name)
            for item in value if isinstance(value, list | tuple) else [value] if isinstance(value, dict) else []:
                child.check_all(item)

    def encode(self, w: Writer, obj: dict[str, Any]) -> None:
        if STRICT:
            self._check(obj)
        get = obj.get
        for name, write in self._writers:
            write(w, get(name, _MISSING))
        if self.flexible:
            if not self.tagged:
                w.buf += b"\x00"  # no tagged fields
                return
            present = []
            for f, write in self._tag_writers:
                value = obj.get(f.name, _MISSING)
                if value is _MISSING or value == f.default_value(self.version):
                    continue
                sub = Writer()
                write(sub, value)
                present.append((f.tag, b"".join(bytes(c) for c in sub.finish())))
            w.write(uvarint(len(present)))
            for tag, data in present:
                w.write(uvarint(tag or 0))
                w.write(uvarint(len(data)))
                w.write(data)

    def _write_len(self, w: Writer, n: int, wide: bool) -> None:
        if self.flexible:
            w.write(uvarint(n + 1))
        else:
            w.write((_I32 if wide else _I16).pack(n))

    def _write(self, w: Writer, value: Any, f: Field) -> None:
        """A field of a type _writer does not compile."""
        if value is _MISSING:
            value = f.default_value(self.version)
        t = f.type
        if value is None and not f.nullable(self.version) and t in _EMPTY:
            value = _EMPTY[t]  # null is not expressible in this version: send the empty value
        if t == "string":
            if value is None:
                self._write_len(w, -1, False)
                return
            data = value.encode()
            self._write_len(w, len(data), False)
            w.write(data)
        elif t in ("bytes", "records"):
            if value is None:
                self._write_len(w, -1, True)
                return
            if isinstance(value, list | tuple):  # several buffers, written without joining
                self._write_len(w, sum(len(b) for b in value), True)
                for b in value:
                    w.write_big(b)
                return
            self._write_len(w, len(value), True)
            w.write_big(value)
        elif t == "bool":
            w.write(b"\x01" if value else b"\x00")
        elif t == "uuid":
            w.write(value.bytes if isinstance(value, uuid.UUID) else value)
        elif t == "struct":
            if f.nullable(self.version):
                w.write(b"\xff" if value is None else b"\x01")
                if value is None:
                    return
            self.children[f.name].encode(w, value)
        else:
            raise ValueError(f"unknown type {t}")


_MISSING = object()
_EMPTY: dict[str, Any] = {"string": "", "bytes": b"", "records": b""}


def check_schema(fields: list[Field], flexible_min: int, where: str = "") -> None:
    """The notation's invariants: unique names and tags per level, nullability
    and tags only within a field's versions, tags only in flexible versions."""
    names: set[str] = set()
    tags: set[int] = set()
    for f in fields:
        at = f"{where}{f.name}"
        if f.name in names:
            raise ValueError(f"schema: {at} is defined twice")
        names.add(f.name)
        if f.vmin > f.vmax:
            raise ValueError(f"schema: {at} has versions {f.vmin}-{f.vmax}")
        if f.null_min is not None and not f.vmin <= f.null_min <= f.vmax:
            raise ValueError(f"schema: {at} is nullable from v{f.null_min}, outside its versions")
        if f.tag is not None:
            if f.tag in tags:
                raise ValueError(f"schema: tag {f.tag} of {at} is used twice")
            tags.add(f.tag)
            if f.vmax < flexible_min:
                raise ValueError(f"schema: tagged field {at} exists only in non-flexible versions")
        if f.type in ("array", "struct") and f.item is None:
            if not f.fields:
                raise ValueError(f"schema: {at} has no fields")
            check_schema(f.fields, flexible_min, f"{at}.")


@dataclass
class Message:
    """A request or response body schema with its valid and flexible versions."""

    fields: list[Field]
    flexible_min: int
    # native code for the same dicts: a decoder (buf, pos, version) -> (dict, end), raising ValueError,
    # and an encoder (dict, version) -> bytes
    native_decode: Callable[[memoryview, int, int], tuple[dict[str, Any], int]] | None = None
    native_encode: Callable[[dict[str, Any], int], bytes | bytearray] | None = None

    def __post_init__(self) -> None:
        check_schema(self.fields, self.flexible_min)

    @cache  # noqa: B019 - a handful of Message objects live for the process
    def codec(self, version: int) -> _StructCodec:
        return _StructCodec(self.fields, version, version >= self.flexible_min)

    def decode(self, buf: memoryview, version: int, pos: int = 0) -> tuple[dict[str, Any], int]:
        if self.native_decode is not None:
            try:
                return self.native_decode(buf, pos, version)
            except ValueError as exc:
                raise DecodeError(str(exc)) from None
        return self.generic_decode(buf, version, pos)

    def generic_decode(self, buf: memoryview, version: int, pos: int = 0) -> tuple[dict[str, Any], int]:
        """decode by the schema alone (what a native decoder must match)."""
        r = Reader(buf, pos)
        out = self.codec(version).decode(r)
        return out, r.pos

    def encode(self, obj: dict[str, Any], version: int, w: Writer | None = None) -> Writer:
        w = w or Writer()
        if self.native_encode is None:
            self.codec(version).encode(w, obj)
        else:
            w.write(self.encode_native(obj, version))
        return w

    def encode_native(self, obj: dict[str, Any], version: int) -> bytes | bytearray:
        """encode with the native encoder (there must be one), in one piece."""
        assert self.native_encode is not None
        if STRICT:
            self.codec(version).check_all(obj)
        return self.native_encode(obj, version)

    def generic_encode(self, obj: dict[str, Any], version: int) -> Writer:
        """encode by the schema alone (what a native encoder must match)."""
        w = Writer()
        self.codec(version).encode(w, obj)
        return w

    def __hash__(self) -> int:
        return id(self)
