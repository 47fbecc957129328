"""An in-memory twin of ObjectStore for unit tests: the same calls and the
same contract (a conditional PUT refuses an existing key with ObjectExists,
ranged GETs are [start, end)), plus request counts and injected failures.
Integration tests use SeaweedFS; nothing in the broker imports this."""
from __future__ import annotations

from collections import Counter
from typing import Any

from kafscale.storage.objectstore import ObjectExists


class MemoryObjectStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.requests: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # call name -> how many of its next calls raise OSError

    def fail_next(self, call: str, times: int = 1) -> None:
        self.failures[call] += times

    def _call(self, name: str) -> None:
        self.requests[name] += 1
        if self.failures[name] > 0:
            self.failures[name] -= 1
            raise OSError(f"injected {name} failure")

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> MemoryObjectStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def ensure_bucket(self) -> None:
        return None

    async def ping(self) -> None:
        self._call("ping")

    async def check_writable(self) -> None:
        self._call("put")

    async def put(self, key: str, data: bytes | bytearray | memoryview, if_none_match: bool = True,
                  background: bool = False) -> None:
        self._call("put")
        if if_none_match and key in self.objects:
            raise ObjectExists(key)
        self.objects[key] = bytes(data)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._call("get")
        if key not in self.objects:
            raise FileNotFoundError(key)
        data = self.objects[key]
        return data if start is None else data[start:end]

    async def size(self, key: str) -> int:
        self._call("head")
        if key not in self.objects:
            raise FileNotFoundError(key)
        return len(self.objects[key])

    async def list(self, prefix: str) -> list[dict[str, Any]]:
        self._call("list")
        return [{"Key": k, "Size": len(v)} for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    async def folders(self, prefix: str) -> list[str]:
        self._call("list")
        return sorted({k[:k.index("/", len(prefix)) + 1] for k in self.objects
                       if k.startswith(prefix) and "/" in k[len(prefix):]})

    async def delete(self, key: str) -> None:
        self._call("delete")
        self.objects.pop(key, None)

    async def delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self._call("delete_many")
            for k in keys[i:i + 1000]:
                self.objects.pop(k, None)

    async def delete_prefix(self, prefix: str) -> int:
        keys = [k for k in self.objects if k.startswith(prefix)]
        await self.delete_many(keys)
        return len(keys)
