"""The live brokers as this broker sees them, and who should own what.

Partitions and consumer groups are placed on live brokers by rendezvous
(highest random weight) hashing: every broker computes the same answer from
the same membership, and when a broker joins or leaves only the keys it
gains or loses move."""
from __future__ import annotations

import xxhash

from kafscale.config import Config
from kafscale.metadata.store import MetaStore


def rendezvous(key: str, ids: list[int]) -> int | None:
    return max(ids, key=lambda b: xxhash.xxh64_intdigest(f"{key}|{b}".encode())) if ids else None


class Cluster:
    def __init__(self, meta: MetaStore, cfg: Config) -> None:
        self.meta = meta
        self.me = cfg.node_id
        self.brokers: dict[int, tuple[str, int]] = {self.me: cfg.advertised_addr()}

    async def refresh(self) -> None:
        live = {b: (h, p) for b, h, p in await self.meta.list_brokers()}
        live.setdefault(self.me, self.brokers[self.me])  # we are alive even if etcd has not caught up
        self.brokers = live

    def desired_owner(self, topic: str, partition: int) -> int:
        return rendezvous(f"p|{topic}|{partition}", sorted(self.brokers)) or self.me

    def coordinator_for(self, group: str) -> int:
        return rendezvous(f"g|{group}", sorted(self.brokers)) or self.me

    def address(self, broker_id: int) -> tuple[str, int]:
        return self.brokers.get(broker_id, self.brokers[self.me])
