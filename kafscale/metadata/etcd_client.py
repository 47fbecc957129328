"""aetcd's client with what MetaStore needs beyond it: `range_page` (aetcd's
range call has no limit) and, in TlsEtcdClient, TLS. aetcd opens plaintext
gRPC channels only; the subclass opens a TLS channel (etcd's
--cert-file/--key-file, optionally client certificates) and then sets up
exactly what aetcd.Client.connect sets up: the authentication token, the
service stubs and the watcher."""
from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher


class EtcdClient(aetcd.Client):
    async def range_page(self, start: bytes, end: bytes, limit: int, revision: int,
                         keys_only: bool, min_mod_revision: int = 0) -> tuple[list[Any], bool, int]:
        """Up to limit key-values in [start, end) at revision (0: the newest),
        of those last written at min_mod_revision or later (0: all): (key-values
        with .key and .value, whether more follow, the revision read)."""
        req = self._build_get_range_request(start, end, keys_only=keys_only)
        req.limit, req.revision, req.min_mod_revision = limit, revision, min_mod_revision
        try:
            resp = await self.kvstub.Range(req, timeout=self._timeout, metadata=self.metadata)
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)  # raises the matching aetcd exception
            raise
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
