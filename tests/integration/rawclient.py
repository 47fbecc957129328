"""A raw-socket Kafka client for sending exactly the bytes a test wants."""
from __future__ import annotations

import socket
import struct
from typing import Any

from kafscale.protocol.framing import decode_response, encode_request


class RawClient:
    def __init__(self, bootstrap: str, timeout: float = 10, source: str | None = None) -> None:
        """source: the local address to connect from (any 127.x.y.z is this machine)."""
        host, _, port = bootstrap.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.correlation = 0

    def close(self) -> None:
        self.sock.close()

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> bytes | None:
        """The next response frame, or None when the broker closed the connection."""
        head = self._read(4)
        if head is None:
            return None
        (size,) = struct.unpack(">i", head)
        return self._read(size)

    def _read(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def request(self, api_key: int, version: int, body: dict[str, Any]) -> dict[str, Any]:
        self.correlation += 1
        self.send_bytes(encode_request(api_key, version, self.correlation, body))
        frame = self.read_frame()
        assert frame is not None, "broker closed the connection"
        corr, resp = decode_response(api_key, version, frame)
        assert corr == self.correlation
        return resp

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True
