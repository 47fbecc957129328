"""An HTTP proxy in front of the real S3 server that records each request's
method and path, so that a test can count which objects a reader GETs, and
when each request was forwarded, so that a test can see which overlapped
(`delay` holds every request back that long, as a slow store would)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from kafscale.devstack import free_port


class S3RequestLog:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.requests: list[tuple[str, str]] = []  # (method, path without the query)
        # [method, target, forwarding began, ended]: noted as the request comes (its answer may reach
        # the client before this thread is scheduled again), the end once forwarded (None until then)
        self.timeline: list[list[Any]] = []
        self.delay = 0.0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.timeline.clear()

    def gets(self, suffix: str) -> list[str]:
        """Object keys (bucket/key) fetched with GET whose name ends with suffix."""
        with self._lock:
            return [p.lstrip("/") for m, p in self.requests if m == "GET" and p.endswith(suffix)]

    def most_at_once(self, method: str, query: str) -> int:
        """The most requests with this method and query parameter forwarded at
        the same time."""
        with self._lock:
            still = time.monotonic()  # the end of one still being forwarded
            spans = [(t0, still if t1 is None else t1) for m, target, t0, t1 in self.timeline
                     if m == method and query in target]
        edges = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
        most = now = 0
        for _, step in edges:
            now += step
            most = max(most, now)
        return most

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Forward requests one by one, noting each; bodies pass unparsed."""
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = src.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                noted = [method, target, time.monotonic(), None]
                with self._lock:
                    self.requests.append((method, unquote(urlsplit(target).path)))
                    self.timeline.append(noted)
                time.sleep(self.delay)
                dst.sendall(head + b"\r\n\r\n")
                left = int(headers.get("content-length", "0"))
                while left > 0:
                    if not buf:
                        buf = src.recv(65536)
                        if not buf:
                            return
                    chunk, buf = buf[:left], buf[left:]
                    dst.sendall(chunk)
                    left -= len(chunk)
                noted[3] = time.monotonic()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
