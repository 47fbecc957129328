"""aetcd's client with what MetaStore needs beyond it: `range_page` (aetcd's
range call has no limit), a `transaction` whose request is written without
protobuf's message classes (`encode_txn`) and, in TlsEtcdClient, TLS. aetcd
opens plaintext gRPC channels only; the subclass opens a TLS channel (etcd's
--cert-file/--key-file, optionally client certificates) and then sets up
exactly what aetcd.Client.connect sets up: the authentication token, the
service stubs and the watcher."""
from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc, rtypes, transactions, watcher
from aetcd.client import _ensure_connected, _handle_errors
from aetcd.utils import lease_to_id, to_bytes

# etcd's rpc.proto: a Compare's target and the field number of its operand (a oneof: always encoded)
_COMPARE_TARGETS = {transactions.Value: (rpc.Compare.VALUE, 7), transactions.Version: (rpc.Compare.VERSION, 4),
                    transactions.Create: (rpc.Compare.CREATE, 5), transactions.Mod: (rpc.Compare.MOD, 6)}
_REQUEST_OP = {transactions.Get: 1, transactions.Put: 2, transactions.Delete: 3}  # RequestOp's oneof fields


_BYTE = [bytes((n,)) for n in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _BYTE[n]
    n &= (1 << 64) - 1  # an int64 below zero is its two's complement
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _number(field: int, n: int) -> bytes:
    return _BYTE[field << 3] + _varint(n)


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _op(op: Any) -> bytes:
    """A RequestOp: the range, put or delete request of an aetcd Get, Put or Delete."""
    field = _REQUEST_OP.get(type(op))
    if field is None:
        raise TypeError(f"unsupported transaction operation {op!r}")
    body = _bytes(1, op.key) if op.key else b""
    if isinstance(op, transactions.Put):
        lease = lease_to_id(op.lease)
        body += (_bytes(2, op.value) if op.value else b"") + (_number(3, lease) if lease else b"")
    elif op.range_end:
        body += _bytes(2, op.range_end)
    if getattr(op, "prev_kv", False):
        body += _number(4 if isinstance(op, transactions.Put) else 3, 1)
    return _bytes(field, body)


def encode_txn(compare: list[Any], success: list[Any], failure: list[Any]) -> bytes:
    """The TxnRequest aetcd's transaction sends for these aetcd compares and
    Put/Get/Delete operations, in protobuf's wire format, written here rather
    than by protobuf's message classes. Those allocate a protobuf arena for
    every message and for every unset sub-message touched: aetcd frees about
    1,200 arenas for a compaction commit of 100 partitions, and a request
    built in place by those classes still one an operation. protobuf's upb module
    calls malloc_trim(0) after every 10,000 arenas it frees, which hands every
    free heap page back to the kernel; the log process's next large buffers
    (node objects, compacted segments) then fault their pages back one by one
    while they hold the event loop. Written here, a transaction frees one
    arena: its response's."""
    out = bytearray()
    for cmp in compare:
        if cmp.op is None:
            raise ValueError("op must be one of =, !=, < or >")
        target, field = _COMPARE_TARGETS[type(cmp)]
        key = to_bytes(cmp.key)
        body = (_number(1, cmp.op) if cmp.op else b"") + (_number(2, target) if target else b"")
        body += _bytes(3, key) if key else b""
        body += _bytes(field, to_bytes(cmp.value)) if field == 7 else _number(field, int(cmp.value))
        if cmp.range_end:
            body += _bytes(64, to_bytes(cmp.range_end))
        out += _bytes(1, body)
    for field, ops in ((2, success), (3, failure)):
        for op in ops:
            out += _bytes(field, _op(op))
    return bytes(out)


class EtcdClient(aetcd.Client):
    @_handle_errors  # as aetcd's own calls: a gRPC error raised as the matching aetcd exception
    @_ensure_connected
    async def transaction(self, compare: list[Any], success: list[Any] | None = None,
                          failure: list[Any] | None = None) -> tuple[bool, list[Any]]:
        """aetcd's transaction (same arguments, same answer: whether the
        compares held, and a get's [(value, metadata)] or a put's or delete's
        response for each operation run), its request written by encode_txn:
        with no request serializer gRPC sends the bytes it is given as they are."""
        txn = self.channel.unary_unary("/etcdserverpb.KV/Txn", response_deserializer=rpc.TxnResponse.FromString)
        resp = await txn(encode_txn(compare, success or [], failure or []), timeout=self._timeout,
                         metadata=self.metadata)
        replies: list[Any] = []
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                replies.append([(kv.value, rtypes.Get(resp.header, kv)) for kv in r.response_range.kvs])
            elif kind is not None:
                replies.append(r)
        return resp.succeeded, replies

    @_handle_errors
    async def range_page(self, start: bytes, end: bytes, limit: int, revision: int,
                         keys_only: bool, min_mod_revision: int = 0) -> tuple[list[Any], bool, int]:
        """Up to limit key-values in [start, end) at revision (0: the newest),
        of those last written at min_mod_revision or later (0: all): (key-values
        with .key and .value, whether more follow, the revision read)."""
        req = self._build_get_range_request(start, end, keys_only=keys_only)
        req.limit, req.revision, req.min_mod_revision = limit, revision, min_mod_revision
        resp = await self.kvstub.Range(req, timeout=self._timeout, metadata=self.metadata)
        return list(resp.kvs), resp.more, resp.header.revision


class TlsEtcdClient(EtcdClient):
    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._channel_credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._channel_credentials,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        finally:
            self._is_connecting = False


def tls_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Trust etcd's certificate by the PEM CA bundle ca; with cert and key, present a client certificate."""
    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as fh:
            return fh.read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
